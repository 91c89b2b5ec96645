"""Verifiable maths rewards: last-box extraction, normalisation, math-verify equivalence.

Reward semantics (DESIGN.md §2 "Reward", as in the authors' verl fork of Reinforce-Ada,
arXiv 2510.04996): take the LAST `\\boxed{...}` (or `\\fbox{...}`) of a response with real
brace matching, compare it with the reference answer by math-verify (symbolic equivalence;
gold parsed as LaTeX, prediction as LaTeX or a plain expression) and return 1.0 or 0.0.
No box, an error or a timeout scores 0.

`math_reward` runs the judge in-process, for trusted input and tests; untrusted model output
is scored by `ada_jax.verifier.RewardPool`, which runs the `JUDGES` in worker processes
under a hard timeout. `reference_answer` extracts the reference of a data-set row.
"""

import ast
import decimal
import functools
import math
import re
import threading
from collections import deque
from collections.abc import Callable, Mapping

# --------------------------------------------------------------------------- extraction

_BOX_CMD = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# Escaped pairs (`\{`, `\}`, `\\`) are consumed whole so that they never count as braces.
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
# A final answer is short; longer box contents are treated as no answer (cheap DoS guard).
# The longest reference in the shared maths sets is under 300 characters.
MAX_ANSWER_CHARS = 1000


def last_boxed(response: str) -> str | None:
  """The contents of the last `\\boxed{...}` / `\\fbox{...}` of `response`.

  Braces are matched (nesting, escaped `\\{` `\\}` ignored); `\\boxed 5` (no braces) takes
  the run of non-space characters up to whitespace or `$`. An unclosed last box returns None
  (the response was cut off before its answer); earlier boxes are not used then.

  Args:
    response: model output text.

  Returns:
    The box contents, stripped, or None when there is no (complete, non-empty) box.
  """
  last = deque(_BOX_CMD.finditer(response), maxlen=1)  # Linear scan, keeps the last match.
  if not last:
    return None
  pos = last[0].end()
  n = len(response)
  start = pos
  while pos < n and response[pos].isspace():
    pos += 1
  if pos >= n:
    return None
  if response[pos] == "{":
    depth = 0
    for tok in _BRACE_TOKEN.finditer(response, pos):
      t = tok.group()
      if t == "{":
        depth += 1
      elif t == "}":
        depth -= 1
        if depth == 0:
          inner = response[pos + 1 : tok.start()].strip()
          return inner or None
    return None
  if pos == start or response[pos] == "$":  # `\boxed$` or `\boxedx`: no argument.
    return None
  end = pos
  while end < n and not response[end].isspace() and response[end] != "$":
    end += 1
  return response[pos:end] or None


# A plain (GSM8K-style) number: optional currency sign, thousands separators, decimals,
# then optional unit words ("18 dollars", "12 km"). Single letters are not units: "2 n".
_PLAIN_NUMBER = re.compile(
  r"(?:\\\$|\$)?\s*(?P<num>[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+)"
  r"(?:\s*(?:[A-Za-z]{2,}\.?|\\%|%)(?:\s+[A-Za-z]{2,}\.?)*)?"
)


def normalize_answer(answer: str) -> str:
  """Canonical form of a plain numeric answer; other answers come back stripped.

  "1,000" → "1000", "\\$18.00" → "18", "27.0" → "27", "18 dollars" → "18", "50%" → "50\\%".
  Thousands separators are recognised only in groups of three digits, so "1,3,5" (a list)
  is left alone. Applied to prediction and reference alike before math-verify.

  Args:
    answer: a box content or reference answer (LaTeX).

  Returns:
    The normalised string.
  """
  s = answer.strip()
  m = _PLAIN_NUMBER.fullmatch(s)
  if m is None:
    return s
  value = decimal.Decimal(m.group("num").replace(",", ""))
  num = "0" if value == 0 else format(value.normalize(), "f")
  return num + ("\\%" if s.endswith("%") else "")


# --------------------------------------------------------------------------- equivalence


def _in_main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


@functools.lru_cache(maxsize=8192)
def _parse_gold_cached(reference: str):
  # Only the no-timeout parse is cached (workers); a reference is shared by all responses
  # drawn for its prompt, so this saves one LaTeX parse per response.
  return _parse_gold(reference, None)


def _parse_gold(reference: str, timeout: int | None):
  import math_verify  # Imported lazily: sympy + antlr cost ~0.5 s and belong in workers.

  return math_verify.parse(
    "\\boxed{" + reference + "}",
    [math_verify.LatexExtractionConfig()],
    parsing_timeout=timeout,
    raise_on_error=True,
  )


def is_equivalent(prediction: str, reference: str, mv_timeout_s: int | None = None) -> bool:
  """Whether a boxed prediction equals the reference answer, by math-verify.

  Args:
    prediction: box contents from the response (LaTeX or a plain expression).
    reference: the reference final answer (LaTeX).
    mv_timeout_s: math-verify's own signal-based timeout per parse/compare (whole seconds;
      main thread only) or None for none (workers, where the pool enforces time).

  Returns:
    True when equal (identical normalised strings, or math-verify's `verify`).

  Raises:
    Whatever math-verify raises on unparseable input (callers score that 0).
  """
  import math_verify

  pred, ref = normalize_answer(prediction), normalize_answer(reference)
  if pred == ref:
    return True
  gold = _parse_gold_cached(ref) if mv_timeout_s is None else _parse_gold(ref, mv_timeout_s)
  target = math_verify.parse(
    "\\boxed{" + pred + "}",
    [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()],
    parsing_timeout=mv_timeout_s,
    raise_on_error=True,
  )
  if not gold or not target:
    return False
  return bool(math_verify.verify(gold, target, timeout_seconds=mv_timeout_s, raise_on_error=True))


# Judge outcome codes (worker → parent).
OK, NO_BOX, ERROR, TIMEOUT = "ok", "no_box", "error", "timeout"


def _judge_math(
  response: str, reference: str, mv_timeout_s: int | None, max_chars: int
) -> tuple[float, str]:
  pred = last_boxed(response)
  if pred is None or len(pred) > max_chars:
    return 0.0, NO_BOX
  return float(is_equivalent(pred, reference, mv_timeout_s)), OK


def _judge_exact(
  response: str, reference: str, mv_timeout_s: int | None, max_chars: int
) -> tuple[float, str]:
  del mv_timeout_s  # String comparison cannot hang.
  pred = last_boxed(response)
  if pred is None or len(pred) > max_chars:
    return 0.0, NO_BOX
  return float(normalize_answer(pred) == normalize_answer(reference)), OK


# Reward functions by config name:
#   (response, reference, mv_timeout_s, max_answer_chars) -> (reward, outcome).
# `exact` (normalised string match) suits the procedural arithmetic task.
JUDGES: dict[str, Callable[[str, str, int | None, int], tuple[float, str]]] = {
  "math": _judge_math,
  "exact": _judge_exact,
}


def math_reward(response: str, reference: str, timeout_s: float = 5) -> float:
  """Reward of one response, in-process: 1.0 when its last box equals the reference.

  In-process there is no hard timeout: math-verify's signal timer (main thread only) stops
  slow Python-level work, but C-level hangs (huge integer powers) are not interruptible.
  Score untrusted model output through `verifier.RewardPool.score`.

  Args:
    response: model output text.
    reference: reference final answer (LaTeX), e.g. from `reference_answer`.
    timeout_s: math-verify's per-call timeout, rounded up to whole seconds (not applied off
      the main thread, where signals cannot be used).

  Returns:
    1.0 or 0.0 (no box, not equal, or any error).
  """
  from math_verify.errors import TimeoutException  # A BaseException.

  # signal.alarm takes whole seconds; signals only work on the main thread.
  mv_timeout = max(1, math.ceil(timeout_s)) if _in_main_thread() else None
  try:
    return _judge_math(response, reference, mv_timeout, MAX_ANSWER_CHARS)[0]
  except (Exception, TimeoutException):  # Any failure of the verifier is a wrong answer.
    return 0.0


# --------------------------------------------------------------------------- references

_TRAILING_ZEROS = re.compile(r"^(-?\d+)\.0+$")


def _answer_field(field: str) -> Callable[[Mapping], str]:
  def get(row: Mapping) -> str:
    value = row[field]
    if isinstance(value, float):  # AMC23 stores 27.0 for 27.
      value = repr(value)
    return _TRAILING_ZEROS.sub(r"\1", str(value).strip())

  return get


def _last_box_of(field: str) -> Callable[[Mapping], str]:
  def get(row: Mapping) -> str:
    answer = last_boxed(row[field])
    if answer is None:
      raise ValueError(f"field {field!r} has no complete \\boxed{{}} answer")
    return answer

  return get


def _gsm8k_answer(row: Mapping) -> str:
  text = row["answer"]
  if "####" not in text:
    raise ValueError("field 'answer' has no '####' final-answer marker")
  return text.rsplit("####", 1)[1].strip().replace(",", "")


def _olympiad_answer(row: Mapping) -> str:
  answers = row["final_answer"]
  if isinstance(answers, str):  # Some exports render the list as a string.
    answers = ast.literal_eval(answers) if answers.lstrip().startswith("[") else [answers]
  # Entries are LaTeX in `$...$`; several answers become one comma-separated list.
  parts = [a.replace("$", "").strip() for a in answers]
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
    ValueError: unknown source, or a missing / malformed answer field (named).
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
