"""The valid interval of a numeric config field, declared at the field (`within`) and
checked by the run config's parser (`config.build`, `check`), so that a bound sits beside
what it bounds. The groups' own checks catch what the code cannot run; these add the upper
ends that fail only later (a verifier timeout too large for the OS's timers overflowed at
RL step 1, after the warm start and the first evaluation) and the lower ends no group
checks. tests/test_config.py checks that every numeric field of every group has one. The
error a bad setting raises, `ConfigError`, is here too, below everything that raises it.

An interval is written as in mathematics, `[1, TOKENS]`, `(0, 1]`, `[0, 2**63)`, its ends
integers, floats, powers (`2**16`) or products (`16 * ROWS`) of the names below.
"""

from __future__ import annotations

import dataclasses
from typing import Any

TOKENS = 2**20  # any token count or length: far beyond any context
ROWS = 2**24  # any row, slot or prompt count: far beyond any slice's memory
STEPS = 10**9
_NAMES = {"TOKENS": (TOKENS, "2**20"), "ROWS": (ROWS, "2**24"), "STEPS": (STEPS, "10**9")}


class ConfigError(ValueError):
  """A bad experiment config or command-line flag; the message names it
  (`config.group.field`, `--flag`). Raised by the run config's parser (`config.ConfigError`,
  the same class) and by what checks a setting before compiling, at any layer."""


def within(interval: str, default: Any = dataclasses.MISSING, **kwargs) -> Any:
  """A dataclass field (`dataclasses.field`, its other arguments passed on) whose values
  must lie in `interval`; a tuple field's items each.

  Raises:
    ValueError: an interval `parse` cannot read (at import, where the field is declared).
  """
  parse(interval)
  return dataclasses.field(default=default, metadata={"interval": interval}, **kwargs)


def of(cls: type, name: str) -> str | None:
  """The interval declared for field `name` of dataclass `cls`, or None."""
  field = next((f for f in dataclasses.fields(cls) if f.name == name), None)
  return None if field is None else field.metadata.get("interval")


def parse(interval: str) -> tuple[float, float, bool, bool]:
  """(low, high, low closed, high closed) of an interval as `within` takes it.

  Raises:
    ValueError: naming the interval.
  """
  if interval[:1] not in "[(" or interval[-1:] not in "])" or interval.count(",") != 1:
    raise ValueError(f"interval {interval!r}: expected '[low, high]' with [ or ( and ] or )")
  low, high = interval[1:-1].split(",")
  return _number(low), _number(high), interval[0] == "[", interval[-1] == "]"


def _number(text: str) -> float:
  out = 1
  for factor in text.split(" * "):
    base, _, power = factor.strip().partition("**")
    if base in _NAMES:
      x = _NAMES[base][0]
    else:
      x = float(base) if "." in base or "e" in base else int(base)
    out *= x ** int(power) if power else x
  return out


def written(interval: str) -> str:
  """`interval` with its names as numbers (`[1, TOKENS]` -> `[1, 2**20]`), for messages."""
  for name, (_, text) in _NAMES.items():
    interval = interval.replace(name, text)
  return interval


def outside(interval: str, value: Any) -> bool:
  """Whether a number, or any item of a tuple, lies outside `interval`; bools and what is
  not a number (None for "derived", a string of a str-or-float field) are not judged."""
  low, high, low_closed, high_closed = parse(interval)
  for x in value if isinstance(value, tuple) else (value,):
    if isinstance(x, bool) or not isinstance(x, (int, float)):
      continue
    above = x >= low if low_closed else x > low
    below = x <= high if high_closed else x < high
    if not (above and below):
      return True
  return False
