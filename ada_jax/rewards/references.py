"""Reference final answers of data-set rows: which field holds the answer, how it is written.

`reference_answer` extracts the reference (LaTeX) of one JSONL row of a known maths set;
`answer_text` turns a row's answer field into text, refusing values that are no answer
(null, a list, an object, a boolean, NaN) instead of grading against their Python
spelling ('None', "['1', '2']"); `drop_thousands` removes thousands separators by the
grader's rule (`numbers.THOUSANDS`), leaving decimal commas alone. `data.sources` reads the
data sets with these.
"""

import ast
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from ada_jax.rewards.grader import last_boxed
from ada_jax.rewards.numbers import THOUSANDS

_TRAILING_ZEROS = re.compile(r"^(-?\d+)\.0+$")
_JSON_TYPES = {type(None): "null", bool: "a boolean", list: "a list", dict: "an object"}


def answer_text(value: Any, field: str) -> str:
  """A row's answer field as text: a string as it is, a JSON number as Python writes it
  (the shortest text that reads back as the same float), without a trailing ".0" (AMC23
  stores 27 as 27.0).

  Args:
    value: the decoded JSON value of the field.
    field: its name, for the message.

  Returns:
    The text, not stripped.

  Raises:
    ValueError: the value is null, a boolean, a list, an object or a non-finite number
      (field and JSON type named).
  """
  if isinstance(value, str):
    return value
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    kind = _JSON_TYPES.get(type(value), type(value).__name__)
    raise ValueError(f"field {field!r} is {kind}, not a string or a number")
  if isinstance(value, int):
    return str(value)
  if not math.isfinite(value):
    raise ValueError(f"field {field!r} is {value}, not a finite number")
  text = repr(value)
  return text[:-2] if text.endswith(".0") else text


def drop_thousands(answer: str) -> str:
  """`answer`, stripped, without its commas when it is one number written with thousands
  separators (`numbers.THOUSANDS`: "1,450" -> "1450"); anything else ("0,5", "1,22",
  "1,3,5") unchanged."""
  s = answer.strip()
  return s.replace(",", "") if THOUSANDS.fullmatch(s) else s


def _answer_field(field: str) -> Callable[[Mapping], str]:
  def get(row: Mapping) -> str:
    return _TRAILING_ZEROS.sub(r"\1", answer_text(row[field], field).strip())

  return get


def _last_box_of(field: str) -> Callable[[Mapping], str]:
  def get(row: Mapping) -> str:
    answer = last_boxed(answer_text(row[field], field))
    if answer is None:
      raise ValueError(f"field {field!r} has no complete \\boxed{{}} answer")
    return answer

  return get


def _gsm8k_answer(row: Mapping) -> str:
  text = answer_text(row["answer"], "answer")
  if "####" not in text:
    raise ValueError("field 'answer' has no '####' final-answer marker")
  return drop_thousands(text.rsplit("####", 1)[1])


def _olympiad_answer(row: Mapping) -> str:
  answers = row["final_answer"]
  if isinstance(answers, str):  # Some exports render the list as a string.
    answers = ast.literal_eval(answers) if answers.lstrip().startswith("[") else [answers]
  if not isinstance(answers, list):
    kind = _JSON_TYPES.get(type(answers), type(answers).__name__)
    raise ValueError(f"field 'final_answer' is {kind}, not a list of answers")
  # Entries are LaTeX in `$...$`; several answers become one comma-separated list.
  parts = [answer_text(a, "final_answer").replace("$", "").strip() for a in answers]
  return ", ".join(p for p in parts if p)


# Reference final answer per data source (keys are the JSONL file stems, README of
# ../shared/data). `math` is MATH's full test split (training prompts outside MATH500).
REFERENCE_ANSWER_FNS: dict[str, Callable[[Mapping], str]] = {
  "gsm8k": _gsm8k_answer,
  "math": _last_box_of("solution"),
  "math500": _answer_field("answer"),
  "minerva_math": _last_box_of("solution"),
  "olympiadbench": _olympiad_answer,
  "aime24": _answer_field("answer"),
  "amc23": _answer_field("answer"),
}


def reference_answer(source: str, row: Mapping) -> str:
  """The reference final answer (LaTeX) of one JSONL row of a maths data set.

  MATH500, AIME24, AMC23: `answer` (AMC's float 27.0 → "27"); MATH (full test split) and
  Minerva Math: last `\\boxed{}` of `solution`; OlympiadBench: `final_answer` (a list,
  `$` removed, joined by ", "); GSM8K: text after `####` without thousands separators.

  Args:
    source: one of `REFERENCE_ANSWER_FNS` ("gsm8k", "math", "math500", "minerva_math",
      "olympiadbench", "aime24", "amc23").
    row: the decoded JSON object of one line.

  Returns:
    The reference answer string.

  Raises:
    ValueError: unknown source, or a missing, mistyped (null, list, ...) or malformed
      answer field (named), or an empty answer.
  """
  try:
    fn = REFERENCE_ANSWER_FNS[source]
  except KeyError:
    raise ValueError(f"unknown source {source!r}; known: {sorted(REFERENCE_ANSWER_FNS)}") from None
  try:
    answer = fn(row)
  except KeyError as e:
    raise ValueError(f"{source}: row has no field {e.args[0]!r}") from None
  except (ValueError, SyntaxError, TypeError, AttributeError) as e:
    raise ValueError(f"{source}: bad reference answer: {e}") from None
  if not answer:
    raise ValueError(f"{source}: empty reference answer")
  return answer
