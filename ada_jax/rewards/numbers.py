"""The grader's numeric rule, patched into math-verify: decimals at their written value and
precision, exact values compared exactly, and commas in numbers read by one rule
(`grader`'s module docstring states both).

math-verify's own `sympy_numeric_eq` rounds both sides to 6 decimal places and chops
values below 1e-15 (2^{-98} equalled 2^{-99}); `patched_math_verify` replaces it, once, by
`_numeric_eq`, through which every numeric comparison math-verify makes passes (inside
tuples, sets, intervals and equations too). `grader.is_equivalent` sets `WRITTEN` to the
decimals of the two answers as written (sympy Floats forget trailing zeros) around a
comparison.
"""

import contextvars
import decimal
import re

MIN_DECIMAL_DIGITS = 6  # Significant digits a decimal response needs to approximate a value.
_EXACT_DIGITS = 40  # Significant digits to which exact irrational values must agree.
# Decimals, and the integer mantissa of E-notation ("3" of "3e8").
_DECIMAL_LITERAL = re.compile(r"(?<![\w.])(?:\d+\.\d+|\.\d+|\d+(?=[eE][-+]?\d))")
# Written decimals of (reference, prediction), by value: (exponent of the last written
# digit, significant digits). sympy Floats forget trailing zeros; "1.60" keeps them here.
WRITTEN: contextvars.ContextVar[tuple[dict, dict]] = contextvars.ContextVar(
  "WRITTEN", default=({}, {})
)


# Thousands separators: a first group of 1-3 digits that does not start with 0, then groups
# of exactly three ("1,000", "12,345.5"). Any other comma between digits is not one.
THOUSANDS = re.compile(r"[-+]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?")
_ONE_COMMA = re.compile(r"([-+]?\d+),(\d+)")


def decimal_comma(answer: str) -> str | None:
  """`answer` read with a decimal comma, when it is one number written with one comma that
  is no thousands separator (`THOUSANDS`): "0,111" -> "0.111", "1,22" -> "1.22",
  "-0,5" -> "-0.5". None for anything else ("1,000", "1,3,5", "1, 22", "x,1").

  Such an answer is ambiguous (1,22 is also the list 1, 22); `grader.is_equivalent` reads
  it as this decimal when the other answer is a single number, else as a list.
  """
  s = answer.strip()
  m = _ONE_COMMA.fullmatch(s)
  if m is None or THOUSANDS.fullmatch(s):
    return None
  return f"{m[1]}.{m[2]}"


def written_decimals(answer: str) -> dict[decimal.Decimal, tuple[int, int]]:
  """The decimals written in `answer`, by value: (exponent of the last written digit,
  significant digits), the precision `WRITTEN` carries into `_numbers_equal`."""
  out = {}
  for m in _DECIMAL_LITERAL.finditer(answer):
    d = decimal.Decimal(m.group())
    if d:
      t = d.as_tuple()
      key = d.normalize()
      if key not in out or t.exponent < out[key][0]:
        out[key] = (t.exponent, len(t.digits))
  return out


def _at_written_value(expr, written: dict, min_digits: int):
  """`expr` with each Float replaced by the rational it is written as, and the relative
  half-unit of the most precise decimal stating at least `min_digits` digits (0 if none).

  A decimal of whole value ("2849.00", "3.00000") reaches here as an Integer (math-verify
  turns whole Floats into Integers); an Integer that `written` holds as a decimal with
  digits after the point keeps that decimal's precision."""
  import sympy

  floats = expr.atoms(sympy.Float) | {
    i for i in expr.atoms(sympy.Integer) if written.get(decimal.Decimal(int(abs(i))), (0, 0))[0] < 0
  }
  if not floats:
    return expr, 0
  exact, rel = {}, sympy.Integer(0)
  for f in floats:
    d = decimal.Decimal(int(abs(f)) if f.is_Integer else str(abs(f))).normalize()
    t = d.as_tuple()
    exponent, digits = written.get(d, (t.exponent, len(t.digits)))
    value = sympy.Rational(*d.as_integer_ratio())
    exact[f] = value if f >= 0 else -value
    if d and digits >= min_digits:  # The most precise decimal sets the precision.
      half_unit = sympy.Rational(10) ** exponent / (2 * value)
      rel = half_unit if rel == 0 else min(rel, half_unit)
  return expr.xreplace(exact), rel


def _numbers_equal(gold, pred) -> bool:
  """Our numeric rule (module docstring): exact values exactly, decimals to their written
  precision. `gold`, `pred`: sympy expressions; False when their difference is symbolic (the
  caller then tries symbolic equality)."""
  import sympy

  written_gold, written_pred = WRITTEN.get()
  g, rel_g = _at_written_value(gold, written_gold, 1)
  p, rel_p = _at_written_value(pred, written_pred, MIN_DECIMAL_DIGITS)
  diff = g - p
  if diff == 0:
    return True
  if not diff.is_number:
    return False
  if g.free_symbols or p.free_symbols:  # Constant offset between symbolic sides: unequal.
    return False
  tol = max(abs(g) * rel_g, abs(p) * rel_p)
  if tol == 0:
    if diff.is_Rational or all(part.is_Rational for part in diff.as_real_imag()):
      return False
    size = sympy.Max(abs(g), abs(p)).evalf(_EXACT_DIGITS + 20)
    return bool(abs(diff).evalf(_EXACT_DIGITS + 20) <= size * sympy.Rational(10) ** -_EXACT_DIGITS)
  return bool(abs(diff).evalf(30) <= tol.evalf(30))


_MV_NUMERIC_EQ = None


def _numeric_eq(a, b, float_rounding: int, numeric_precision: int) -> bool:
  """Stand-in for `math_verify.grader.sympy_numeric_eq` (gold first, as math-verify calls
  it): matrices and percentages keep math-verify's handling, element-wise via this rule."""
  import sympy
  from sympy.matrices.expressions import MatrixExpr

  if isinstance(a, (sympy.MatrixBase, MatrixExpr)) or isinstance(b, (sympy.MatrixBase, MatrixExpr)):
    return _MV_NUMERIC_EQ(a, b, float_rounding, numeric_precision)
  if a.has(sympy.UnevaluatedExpr) or b.has(sympy.UnevaluatedExpr):  # "50\%" = 50·(1/100).
    return _MV_NUMERIC_EQ(a, b, float_rounding, numeric_precision)
  try:
    return _numbers_equal(a, b)
  except (TypeError, ValueError, ArithmeticError, AttributeError):  # NaN, zoo, sets...
    return False


def stock_numeric_eq():
  """math-verify's own numeric comparison once `patched_math_verify` has replaced it
  (None before: then math-verify's is still in place)."""
  return _MV_NUMERIC_EQ


def patched_math_verify():
  """math_verify, with its numeric comparison replaced by `_numeric_eq` (once).

  Its own rounds both sides to 6 decimal places and chops below 1e-15, which accepts
  2^{-98} for 2^{-99} and 1e-7 for 2e-7; every comparison it makes (also inside tuples, sets,
  intervals and equations) goes through this module-level function.
  """
  global _MV_NUMERIC_EQ
  import math_verify  # Imported lazily: sympy + antlr cost ~0.5 s and belong in workers.
  from math_verify import grader

  if _MV_NUMERIC_EQ is None:
    _MV_NUMERIC_EQ = grader.sympy_numeric_eq
    grader.sympy_numeric_eq = _numeric_eq
  return math_verify
