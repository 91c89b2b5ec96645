"""Verifiable maths rewards: last-box extraction, normalisation, math-verify equivalence.

Reward semantics (as in the authors' verl fork of Reinforce-Ada, arXiv 2510.04996): take
the LAST `\\boxed{...}` (or `\\fbox{...}`) of a response with real brace matching, compare it
with the reference answer by math-verify (symbolic equivalence; gold parsed as LaTeX,
prediction as LaTeX or a plain expression) and return 1.0 or 0.0.
No box, an error or a timeout scores 0.

Around math-verify, so that no wrong answer scores 1 and the usual ways of writing a right
one do:

- Notation, both sides: `3.89e-10` / `3.89E-10` (Python's and Minerva's scientific
  notation: a number directly followed by e and an integer) is `3.89\\times10^{-10}`, a
  decimal stating its mantissa's digits (`3e8` states one: 2.998\\times10^{8} rounds to it;
  `3\\times10^{8}` in LaTeX is the exact integer);
  `\\mathrm{e}`, `\\operatorname{e}`, `\\text{e}` are Euler's number e, `\\mathrm{i}`,
  `\\imath` are i, `\\mathrm{\\pi}`, `\\uppi`, `π` are π; `×`, `·`, `−` are `\\times`,
  `\\cdot`, `-`; `x^-7` is `x^{-7}`.
- Commas in numbers, both sides, for an answer that is one number written with commas
  between digits (no spaces):
  * thousands separators are commas after a first group of 1-3 digits that does not start
    with 0, every later group exactly three digits (`1,000`, `12,345.5`; `numbers.THOUSANDS`):
    they are dropped, so `1,234` is 1234, never 1.234;
  * any other single comma (after a leading 0, or followed by other than exactly three
    digits: `0,111`, `1,22`, `0,5`) is a decimal comma when the other answer is one
    number (`0,111` equals 0.111, not 111; `1,60` states precision as `1.60` does), and
    separates a list otherwise (`0,1` against `0, 1` or `\\{0, 1\\}`: MATH writes
    solution lists so). More commas (`1,3,5`) always make a list.
- Complex numbers: when the reference contains the symbol i, or has no variables at all,
  i is the imaginary unit on both sides (`14 - i` equals `14.0 - 1.0i`; `i^2` equals -1,
  `i^4` equals 1: against a number, an i can only be the unit).
- Numbers (every numeric comparison math-verify makes, inside tuples, sets, intervals and
  equations too) replace math-verify's rule, which rounds to 6 decimal places and chops
  values below 1e-15, so that 2^{-98} equalled 2^{-99}:
  * every decimal is taken at its written value (0.5 is exactly 1/2, 14.0 is 14);
  * exact values (integers, rationals, powers, factorials, radicals, π) compare exactly:
    rationals as rationals, irrationals to 40 significant digits;
  * a decimal REFERENCE (`1.6`, `3.89e-10`) states its precision: a response scores 1
    when it is within half a unit of the reference's last written digit (trailing zeros
    count: `1.60` asks for 1.595..1.605), i.e. when it rounds to the reference;
  * a decimal RESPONSE to an exact reference (0.333333 for 1/3, 1.41421 for √2) scores 1
    when it states at least `numbers.MIN_DECIMAL_DIGITS` (6) significant digits and is the
    reference rounded to its own last written digit (within half a unit of it); fewer
    digits (0.333, 1.414) score 0 unless the decimal is exactly the reference. The same
    relative rule is used for decimals inside larger expressions (`2.5\\pi`).
- Prose: a box whose content is words rather than maths ("the answer is 5", "no solution"
  when the reference is not prose), or that math-verify cannot parse at all, raises
  `UngradableAnswer`; a reference that is empty, prose ("see the worked solution above")
  or unparseable raises `UngradableReference` unless the box is the same string. The
  judges score both 0 with outcome `ERROR`, which the reward pool counts in its `errors`
  statistic.

`math_reward` runs the judge in-process, for trusted input and tests; untrusted model output
is scored by `ada_jax.rewards.verifier.Verifier`, which runs the `JUDGES` in worker processes
under a hard timeout. `rewards.references` extracts the reference of a data-set row.
"""

import decimal
import functools
import math
import re
import threading
from collections import deque
from collections.abc import Callable

from ada_jax.rewards import numbers

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
  r"(?:\\\$|\$)?\s*(?P<num>[-+]?(?:[1-9]\d{0,2}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+)"
  r"(?:\s*(?:[A-Za-z]{2,}\.?|\\%|%)(?:\s+[A-Za-z]{2,}\.?)*)?"
)


def normalize_answer(answer: str) -> str:
  """Canonical form of a plain numeric answer; other answers come back stripped.

  "1,000" → "1000", "\\$18.00" → "18", "27.0" → "27", "18 dollars" → "18", "50%" → "50\\%".
  Thousands separators are recognised only as `numbers.THOUSANDS` writes them (groups of
  three digits after a first group that does not start with 0), so "1,3,5" (a list),
  "0,111" and "1,22" (decimal commas or lists: `numbers.decimal_comma`) are left alone.
  Applied to prediction and reference alike before math-verify.

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


# Scientific notation as Python and Minerva's references write it: a number directly followed
# by e/E and an integer ("3.89e-10", "9e11"); "2e" or "2e - 1" (twice Euler's e, minus 1) stay.
_SCI_E = re.compile(r"(?<![\w.\\])(\d+(?:\.\d*)?|\.\d+)[eE]([-+]?\d+)(?![\w.])")
# Upright / operator / text forms of the constants e, i and π.
_CONST_FORM = re.compile(
  r"\\(?:mathrm|operatorname|mathit|mathup|textrm|textit|text|rm|up)\s*"
  r"(?:\{\s*(e|i|\\pi|π)\s*\}|\s+(e|i)(?![A-Za-z]))"
)
_CONST_NAME = re.compile(r"\\(imath|uppi|varpi)(?![A-Za-z])|π")
_BARE_EXPONENT = re.compile(r"\^\s*([-+]\s*\d+)")
_UNICODE_OPS = str.maketrans({"×": " \\times ", "·": " \\cdot ", "−": "-"})


def _sci_latex(match: re.Match) -> str:
  # "3e8" states one significant digit like "3.89e-10" states three: the mantissa becomes a
  # decimal (3.0), whose precision `_written_decimals` reads from the E-notation.
  mantissa = match.group(1) if "." in match.group(1) else match.group(1) + ".0"
  return f"{mantissa}\\times10^{{{match.group(2).lstrip('+')}}}"


def _spaced(match: re.Match, name: str) -> str:
  # Spaces only where a letter would otherwise join the name ("2\\mathrm{e}x"); math-verify
  # misreads a space before a closing brace ("\\frac{1}{ e }").
  text, start, end = match.string, match.start(), match.end()
  before = " " if start and text[start - 1].isalnum() else ""
  after = " " if end < len(text) and text[end].isalpha() else ""
  return before + name + after


def _standard_notation(answer: str) -> str:
  """One spelling for scientific notation, the constants e, i, π and a few operators."""
  s = answer.translate(_UNICODE_OPS)
  s = _SCI_E.sub(_sci_latex, s)
  s = _CONST_FORM.sub(lambda m: _spaced(m, (m.group(1) or m.group(2)).replace("π", "\\pi")), s)
  s = _CONST_NAME.sub(lambda m: _spaced(m, "i" if m.group(1) == "imath" else "\\pi"), s)
  return _BARE_EXPONENT.sub(lambda m: "^{" + m.group(1).replace(" ", "") + "}", s)


class UngradableAnswer(ValueError):
  """A boxed answer that is prose, or that math-verify cannot parse; scored 0 as an error."""


class UngradableReference(ValueError):
  """A reference that is empty, prose or unparseable, and that the response does not match
  as a string; scored 0 as an error."""


# A run of two words (letters only, two or more each) once LaTeX commands are gone and
# math-verify has dropped units and `\text{ and }`: "the answer is", "no solution".
_WORD_RUN = re.compile(r"[A-Za-z]{2,}\s+[A-Za-z]{2,}")
_LATEX_CMD = re.compile(r"\\[A-Za-z]+")


@functools.lru_cache(maxsize=8192)
def _is_prose(answer: str) -> bool:
  from latex2sympy2_extended.latex2sympy2 import normalize_latex
  from math_verify import LatexExtractionConfig

  normalized = normalize_latex(answer, LatexExtractionConfig().normalization_config)
  return _WORD_RUN.search(_LATEX_CMD.sub(" ", normalized)) is not None


# --------------------------------------------------------------------------- equivalence


def _in_main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


@functools.lru_cache(maxsize=8192)
def _parse_gold_cached(reference: str):
  # Only the no-timeout parse is cached (workers); a reference is shared by all responses
  # drawn for its prompt, so this saves one LaTeX parse per response.
  return _parse_gold(reference, None)


def _parse_gold(reference: str, timeout: int | None):
  math_verify = numbers.patched_math_verify()
  return math_verify.parse(
    "\\boxed{" + reference + "}",
    [math_verify.LatexExtractionConfig()],
    parsing_timeout=timeout,
    raise_on_error=True,
  )


def _parse_answer(answer: str, timeout: int | None):
  math_verify = numbers.patched_math_verify()
  return math_verify.parse(
    "\\boxed{" + answer + "}",
    [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()],
    parsing_timeout=timeout,
    raise_on_error=True,
  )


def _sympy(parsed: list) -> list:
  import sympy

  return [x for x in parsed if isinstance(x, (sympy.Basic, sympy.MatrixBase))]


def _is_number(parsed: list) -> bool:
  """Whether an answer parsed to one number (no variables; not a list, set or equation)."""
  import sympy

  exprs = _sympy(parsed)
  return bool(exprs) and isinstance(exprs[0], sympy.Expr) and bool(exprs[0].is_number)


def _imaginary_unit(parsed: list) -> list:
  """The parsed answers with every symbol named i replaced by the imaginary unit."""
  import sympy

  out = []
  for x in parsed:
    if isinstance(x, (sympy.Basic, sympy.MatrixBase)):
      x = x.xreplace({s: sympy.I for s in x.free_symbols if getattr(s, "name", None) == "i"})
    out.append(x)
  return out


def _i_is_the_unit(gold: list) -> bool:
  """Whether i is the imaginary unit: the reference contains i, or it has no variables at
  all, so that an i in the response (i^2, i^4, (1+i)(1-i)) can only be the unit."""
  import sympy

  exprs = _sympy(gold)
  return any(
    x.has(sympy.I) or any(getattr(s, "name", None) == "i" for s in x.free_symbols) for x in exprs
  ) or not any(x.free_symbols for x in exprs)


def is_equivalent(prediction: str, reference: str, mv_timeout_s: int | None = None) -> bool:
  """Whether a boxed prediction equals the reference answer (module docstring's rules).

  Args:
    prediction: box contents from the response (LaTeX or a plain expression).
    reference: the reference final answer (LaTeX).
    mv_timeout_s: math-verify's own signal-based timeout per parse/compare (whole seconds;
      main thread only) or None for none (workers, where the pool enforces time).

  Returns:
    True when equal (identical normalised strings, or math-verify's `verify` with our
    notation, comma, complex-number and numeric rules).

  Raises:
    UngradableAnswer: the prediction is prose (and the reference is not), or math-verify
      cannot parse it.
    UngradableReference: the reference is empty, prose or unparseable, and the prediction
      is not the same string.
    Whatever math-verify raises on unparseable input (callers score that 0).
  """
  pred, ref = normalize_answer(prediction), normalize_answer(reference)
  if pred == ref:
    return True
  if not ref:
    raise UngradableReference("empty reference answer")
  # A one-comma number ("0,5") is a list ("0, 5") unless the other side is one number.
  pred_decimal, ref_decimal = numbers.decimal_comma(pred), numbers.decimal_comma(ref)
  if pred_decimal:
    pred = pred.replace(",", ", ")
  if ref_decimal:
    ref = ref.replace(",", ", ")
  pred, ref = _standard_notation(pred), _standard_notation(ref)
  ref_is_prose = _is_prose(ref)
  if _is_prose(pred) and not ref_is_prose:
    raise UngradableAnswer(f"box content is prose, not maths: {pred[:80]!r}")
  math_verify = numbers.patched_math_verify()
  gold = _parse_gold_cached(ref) if mv_timeout_s is None else _parse_gold(ref, mv_timeout_s)
  target = _parse_answer(pred, mv_timeout_s)
  if not gold:
    raise UngradableReference(f"math-verify cannot parse the reference: {ref[:80]!r}")
  # The raw strings: `normalize_answer` drops trailing zeros ("1.60"), which state precision.
  written_ref, written_pred = reference, prediction
  if ref_decimal and _is_number(target):
    gold, written_ref = _parse_gold(ref_decimal, mv_timeout_s), reference.replace(",", ".")
  if pred_decimal and _is_number(gold):
    target, written_pred = _parse_answer(pred_decimal, mv_timeout_s), prediction.replace(",", ".")
  if _i_is_the_unit(gold):
    gold, target = _imaginary_unit(gold), _imaginary_unit(target)
  token = numbers.WRITTEN.set(
    (numbers.written_decimals(written_ref), numbers.written_decimals(written_pred))
  )
  try:
    equal = math_verify.verify(gold, target, timeout_seconds=mv_timeout_s, raise_on_error=True)
  finally:
    numbers.WRITTEN.reset(token)
  if not equal and (ref_is_prose or not _sympy(gold)):
    raise UngradableReference(f"the reference is not maths: {ref[:80]!r}")
  # Unparsed, the prediction could only match the reference's normalised LaTeX string.
  if not equal and not _sympy(target):
    raise UngradableAnswer(f"math-verify cannot parse the box content: {pred[:80]!r}")
  return bool(equal)


# Judge outcome codes (worker → parent).
OK, NO_BOX, ERROR, TIMEOUT = "ok", "no_box", "error", "timeout"


def _judge_math(
  response: str, reference: str, mv_timeout_s: int | None, max_chars: int
) -> tuple[float, str]:
  pred = last_boxed(response)
  if pred is None or len(pred) > max_chars:
    return 0.0, NO_BOX
  try:
    return float(is_equivalent(pred, reference, mv_timeout_s)), OK
  except (UngradableAnswer, UngradableReference):
    return 0.0, ERROR


def _judge_exact(
  response: str, reference: str, mv_timeout_s: int | None, max_chars: int
) -> tuple[float, str]:
  del mv_timeout_s  # String comparison cannot hang.
  pred = last_boxed(response)
  if pred is None or len(pred) > max_chars:
    return 0.0, NO_BOX
  pred, ref = normalize_answer(pred), normalize_answer(reference)
  if not ref:
    return 0.0, ERROR
  # `is_equivalent`'s comma rule, with "one number" read from the text.
  if numbers.decimal_comma(pred) and _PLAIN_NUMBER.fullmatch(ref):
    pred = normalize_answer(numbers.decimal_comma(pred))
  if numbers.decimal_comma(ref) and _PLAIN_NUMBER.fullmatch(pred):
    ref = normalize_answer(numbers.decimal_comma(ref))
  return float(pred == ref), OK


# Reward functions by config name:
#   (response, reference, mv_timeout_s, max_answer_chars) -> (reward, outcome).
# `exact` (normalised string match) suits the procedural arithmetic task. `ERROR`: the box
# is prose or unparseable (`UngradableAnswer`), or the reference cannot be graded
# (`UngradableReference`; `exact`: empty); the pool also counts judges that raise.
JUDGES: dict[str, Callable[[str, str, int | None, int], tuple[float, str]]] = {
  "math": _judge_math,
  "exact": _judge_exact,
}


def math_reward(response: str, reference: str, timeout_s: float = 5) -> float:
  """Reward of one response, in-process: 1.0 when its last box equals the reference.

  In-process there is no hard timeout: math-verify's signal timer (main thread only) stops
  slow Python-level work, but C-level hangs (huge integer powers) are not interruptible.
  Score untrusted model output through `verifier.Verifier.score`.

  Args:
    response: model output text.
    reference: reference final answer (LaTeX), e.g. from `references.reference_answer`.
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
