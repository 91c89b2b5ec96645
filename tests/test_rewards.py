"""Tests for ada_jax.rewards: box extraction, normalisation, equivalence, the judges and
reference answers.
"""

import decimal
import fractions
import math
import time

import hypothesis
import hypothesis.strategies as st
import pytest

from ada_jax.rewards import grader as rewards
from ada_jax.rewards import numbers, references

# ----------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
  "response, expected",
  [
    ("so $\\boxed{5}$.", "5"),
    ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\left\\{ 1, 2 \\right\\}}", "\\left\\{ 1, 2 \\right\\}"),
    ("\\boxed{a_{b_{c}}} tail }", "a_{b_{c}}"),
    ("\\fbox{7}", "7"),
    ("\\boxed {  x+1 }", "x+1"),
    ("answer: \\boxed 5$.", "5"),
    ("\\boxed 12 apples", "12"),
    ("\\boxed{3} and \\fbox{4}", "4"),
    ("\\boxed{\\boxed{6}}", "6"),
    ("no box here", None),
    ("", None),
    ("\\boxed{}", None),
    ("\\boxed{1} cut off \\boxed{2", None),
    ("\\boxedx{3}", None),
    ("\\boxed", None),
    ("\\boxed$5$", None),
  ],
)
def test_last_boxed(response, expected):
  assert rewards.last_boxed(response) == expected


def test_last_boxed_deep_nesting_is_linear():
  inner = "{" * 10_000 + "1" + "}" * 10_000
  t0 = time.perf_counter()
  assert rewards.last_boxed("x \\boxed{" + inner + "} y") == inner
  assert time.perf_counter() - t0 < 1.0


_PLAIN = st.text(alphabet="abc123+-= ", max_size=8)


@st.composite
def _balanced(draw, depth=2):
  parts = draw(st.lists(_PLAIN if depth == 0 else st.one_of(_PLAIN, _balanced(depth=depth - 1))))
  return "{" + "".join(parts) + "}"


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(prefix=_PLAIN, body=_balanced(), suffix=_PLAIN)
def test_last_boxed_recovers_any_balanced_content(prefix, body, suffix):
  inner = body[1:-1].strip()
  got = rewards.last_boxed(prefix + "\\boxed" + body + suffix)
  assert got == (inner or None)


@pytest.mark.parametrize(
  "answer, expected",
  [
    ("1,000", "1000"),
    ("1,450,000", "1450000"),
    ("\\$18.00", "18"),
    ("$5", "5"),
    ("27.0", "27"),
    ("025", "25"),
    ("-0.50", "-0.5"),
    (".5", "0.5"),
    ("18 dollars", "18"),
    ("12 km per hour", "12"),
    ("50%", "50\\%"),
    ("1,3,5", "1,3,5"),  # A list, not a thousands separator.
    ("10,11", "10,11"),
    ("2 n", "2 n"),  # A single letter is a variable, not a unit.
    ("  \\frac{1}{2} ", "\\frac{1}{2}"),
  ],
)
def test_normalize_answer(answer, expected):
  assert rewards.normalize_answer(answer) == expected


# ------------------------------------------------------------------------ equivalence

EQUIVALENCE = [
  ("The answer is $\\boxed{\\frac{14}{3}}$.", "\\frac{14}{3}", 1.0),
  ("\\boxed{14/3}", "\\frac{14}{3}", 1.0),
  ("\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}", 1.0),
  ("\\boxed{(3,\\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
  ("\\boxed{\\text{(C)}}", "\\text{(C)}", 1.0),
  ("\\boxed{[1,2)}", "[1,2)", 1.0),
  ("\\boxed{2,1}", "1,2", 1.0),
  ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
  ("\\boxed{0.5}", "\\frac12", 1.0),
  # GSM8K-style numbers: separators, currency, units, trailing zeros.
  ("\\boxed{1,000}", "1000", 1.0),
  ("\\boxed{\\$1,000.00}", "1000", 1.0),
  ("\\boxed{18 dollars}", "18", 1.0),
  ("\\boxed{18\\text{ dollars}}", "18", 1.0),
  ("\\boxed{18.0}", "18", 1.0),
  ("\\boxed{27}", "27.0", 1.0),
  ("\\boxed{25}", "025", 1.0),
  # Wrong or missing answers.
  ("\\boxed{3}", "2", 0.0),
  ("\\boxed{\\frac{14}{5}}", "\\frac{14}{3}", 0.0),
  ("\\boxed{(3,\\pi)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 0.0),
  ("\\boxed{1001}", "1,000", 0.0),
  ("\\boxed{\\text{(B)}}", "\\text{(C)}", 0.0),
  ("the answer is 18", "18", 0.0),
  ("\\boxed{18} ... actually \\boxed{19", "18", 0.0),
]


@pytest.mark.parametrize("response, reference, expected", EQUIVALENCE)
def test_math_reward(response, reference, expected):
  assert rewards.math_reward(response, reference) == expected


# Answer forms of MATH, Minerva Math and OlympiadBench that math-verify alone grades wrongly
# (the first five), with their neighbours.
NUMBERS_AND_CONSTANTS = [
  ("\\boxed{2^{-98}}", "2^{-99}", 0.0),
  ("\\boxed{1\\times10^{-7}}", "2\\times10^{-7}", 0.0),
  ("\\boxed{1-e^{-1}}", "1-\\frac{1}{\\mathrm{e}}", 1.0),
  ("\\boxed{3.89\\times10^{-10}}", "3.89e-10", 1.0),
  ("\\boxed{14.0 - 1.0i}", "14 - i", 1.0),
  # Small numbers: exact values exactly, also inside tuples, sets, intervals, equations.
  ("\\boxed{1.0\\times10^{-7}}", "2.0\\times10^{-7}", 0.0),
  ("\\boxed{\\frac{1}{2^{99}}}", "2^{-99}", 1.0),
  ("\\boxed{(2^{-98}, 1)}", "(2^{-99}, 1)", 0.0),
  ("\\boxed{\\{2^{-98}, 1\\}}", "\\{2^{-99}, 1\\}", 0.0),
  ("\\boxed{[2^{-98}, 1]}", "[2^{-99}, 1]", 0.0),
  ("\\boxed{x = 2^{-98}}", "x = 2^{-99}", 0.0),
  (
    "\\boxed{\\begin{pmatrix}2^{-98}\\\\2\\end{pmatrix}}",
    "\\begin{pmatrix}2^{-99}\\\\2\\end{pmatrix}",
    0.0,
  ),
  ("\\boxed{10!}", "3628800", 1.0),
  ("\\boxed{\\frac{1}{10!}}", "\\frac{1}{3628801}", 0.0),
  ("\\boxed{1.0000001}", "1", 0.0),
  # Decimals: a decimal reference to its written precision (trailing zeros count) ...
  ("\\boxed{1.63}", "1.6", 1.0),
  ("\\boxed{1.64}", "1.60", 0.0),
  ("\\boxed{1.7}", "1.6", 0.0),
  ("\\boxed{\\frac{8}{5}}", "1.6", 1.0),
  # ... a decimal response to an exact reference with at least 6 significant digits.
  ("\\boxed{0.333333}", "\\frac13", 1.0),
  ("\\boxed{0.333334}", "\\frac13", 0.0),
  ("\\boxed{0.333}", "\\frac13", 0.0),
  ("\\boxed{0.0000333333}", "\\frac{1}{30000}", 1.0),
  ("\\boxed{0.000033}", "\\frac{1}{30000}", 0.0),
  ("\\boxed{1.41421}", "\\sqrt{2}", 1.0),
  ("\\boxed{1.414}", "\\sqrt{2}", 0.0),
  ("\\boxed{3.141590}", "\\pi", 0.0),  # The written 0 is wrong: π = 3.1415927.
  ("\\boxed{1.5\\pi}", "\\frac{3\\pi}{2}", 1.0),
  ("\\boxed{1000.4}", "1000", 0.0),
  # ... also when the decimal's value is whole: its written zeros state its precision.
  ("\\boxed{2849.00}", "\\frac{1000000}{351}", 1.0),
  ("\\boxed{-2849.00}", "-\\frac{1000000}{351}", 1.0),
  ("\\boxed{3.00000}", "\\frac{3000001}{1000000}", 1.0),
  ("\\boxed{100.000}", "\\frac{1000001}{10000}", 1.0),
  ("\\boxed{2849.0}", "\\frac{1000000}{351}", 0.0),  # 5 significant digits: exact only.
  ("\\boxed{2849.01}", "\\frac{1000000}{351}", 0.0),
  ("\\boxed{2849}", "\\frac{1000000}{351}", 0.0),
  ("\\boxed{2.004}", "2.00", 1.0),
  ("\\boxed{2.006}", "2.00", 0.0),
  # Scientific notation, references and responses.
  ("\\boxed{3.89 \\cdot 10^{-10}}", "3.89e-10", 1.0),
  ("\\boxed{3.89e-10}", "3.89\\times 10^{-10}", 1.0),
  ("\\boxed{3.89E-10}", "3.89e-10", 1.0),
  ("\\boxed{3.89 × 10^{-10}}", "3.89e-10", 1.0),
  ("\\boxed{389\\times10^{-12}}", "3.89e-10", 1.0),
  ("\\boxed{0.000000000389}", "3.89e-10", 1.0),
  ("\\boxed{3.88\\times10^{-10}}", "3.89e-10", 0.0),
  ("\\boxed{3.89\\times10^{-11}}", "3.89e-10", 0.0),
  ("\\boxed{9\\times10^{11}}", "9e11", 1.0),
  ("\\boxed{2.998\\times10^{8}}", "3e8", 1.0),  # "3e8" states one digit ...
  ("\\boxed{2.998\\times10^{8}}", "3\\times10^{8}", 0.0),  # ... LaTeX's integer is exact.
  ("\\boxed{4\\times10^{8}}", "3e8", 0.0),
  ("\\boxed{1560}", "1.5e3", 0.0),
  ("\\boxed{10^-7}", "1e-7", 1.0),
  # Constants.
  ("\\boxed{e}", "\\operatorname{e}", 1.0),
  ("\\boxed{\\mathrm{e}^{2}}", "e^2", 1.0),
  ("\\boxed{2e}", "2\\mathrm{e}", 1.0),
  ("\\boxed{e^{3}}", "\\mathrm{e}^{2}", 0.0),
  ("\\boxed{\\frac{\\pi}{2}}", "\\frac{\\mathrm{\\pi}}{2}", 1.0),
  ("\\boxed{π/2}", "\\frac{\\pi}{2}", 1.0),
  # Complex numbers: i is the imaginary unit when the reference contains i, or when it has
  # no variables (then an i in the response can only be the unit).
  ("\\boxed{3 + 4i}", "3+4\\mathrm{i}", 1.0),
  ("\\boxed{4i+3}", "3+4i", 1.0),
  ("\\boxed{3 - 4i}", "3+4i", 0.0),
  ("\\boxed{\\frac{1+i}{2}}", "\\frac12+\\frac{i}{2}", 1.0),
  ("\\boxed{-i}", "i", 0.0),
  ("\\boxed{i^2}", "-1", 1.0),
  ("\\boxed{i^4}", "1", 1.0),
  ("\\boxed{(1+i)(1-i)}", "2", 1.0),
  ("\\boxed{i^2}", "1", 0.0),
  ("\\boxed{i^2 n}", "-n", 0.0),  # A reference with a variable: i is a variable too.
  ("\\boxed{\\sum_{i=1}^{3} i^2}", "14", 1.0),  # A summation index is no unit.
  # Commas in numbers (module docstring's rule): thousands separators only after a first
  # group not starting with 0 and in groups of three; a one-comma number is a decimal
  # against one number, a list against anything else.
  ("\\boxed{111}", "0,111", 0.0),
  ("\\boxed{0.111}", "0,111", 1.0),
  ("\\boxed{1.22}", "1,22", 1.0),
  ("\\boxed{0,5}", "0.5", 1.0),
  ("\\boxed{\\frac12}", "0,5", 1.0),
  ("\\boxed{-0,25}", "-\\frac14", 1.0),
  ("\\boxed{1.63}", "1,6", 1.0),  # The decimal comma states precision as a point does ...
  ("\\boxed{1.64}", "1,60", 0.0),  # ... trailing zeros included.
  ("\\boxed{1,234}", "1234", 1.0),
  ("\\boxed{1.234}", "1,234", 0.0),
  ("\\boxed{0, 1}", "0,1", 1.0),  # MATH writes lists of solutions so.
  ("\\boxed{0 \\text{ and } 1}", "0,1", 1.0),
  ("\\boxed{\\{0, 1\\}}", "0,1", 1.0),
  ("\\boxed{0,1}", "\\{0, 1\\}", 1.0),
  ("\\boxed{2,1}", "1,2", 1.0),
  ("\\boxed{0.1}", "0, 1", 0.0),
  # Words: units and named answers are graded, prose is not.
  ("\\boxed{5\\text{ square units}}", "5", 1.0),
  ("\\boxed{\\text{no solution}}", "\\text{no solution}", 1.0),
  ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", 1.0),
  ("\\boxed{the answer is 5}", "5", 0.0),
  ("\\boxed{\\text{no solution}}", "5", 0.0),
]


@pytest.mark.parametrize("response, reference, expected", NUMBERS_AND_CONSTANTS)
def test_math_reward_numbers_and_constants(response, reference, expected):
  assert rewards.math_reward(response, reference) == expected


@pytest.mark.parametrize(
  "box, reference, reward, outcome",
  [
    ("the answer is 5", "5", 0.0, rewards.ERROR),
    ("\\text{it diverges}", "0", 0.0, rewards.ERROR),
    ("\\text{The answer is } 5", "5", 0.0, rewards.ERROR),
    ("\\frac{}{}", "5", 0.0, rewards.ERROR),  # Unparseable.
    ("\\text{no solution}", "\\text{no solution}", 1.0, rewards.OK),  # A prose reference.
    ("\\text{Evelyn}", "\\text{Bob}", 0.0, rewards.OK),  # One word is a name, not prose.
    ("12 \\mathrm{km} \\mathrm{s}^{-1}", "12", 1.0, rewards.OK),  # Units are not prose.
    ("13 \\text{ square units}", "12", 0.0, rewards.OK),
    # References that cannot be graded: errors too, unless the box is the same string.
    ("5", "", 0.0, rewards.ERROR),
    ("5", "   ", 0.0, rewards.ERROR),
    ("5", "see the worked solution above", 0.0, rewards.ERROR),
    ("\\text{see above}", "see the worked solution above", 0.0, rewards.ERROR),
    ("5", "?", 0.0, rewards.ERROR),
    ("5", "$$", 0.0, rewards.ERROR),
    ("?", "?", 1.0, rewards.OK),
    # MATH's own: "\\text {" (a space) is not read as units, so the words are prose.
    ("8\\sqrt{3}", "8\\sqrt{3} \\text { square inches}", 0.0, rewards.ERROR),
  ],
)
def test_prose_or_unparseable_box_is_an_error(box, reference, reward, outcome):
  assert rewards.JUDGES["math"](f"So \\boxed{{{box}}}.", reference, None, 1000) == (reward, outcome)


# ------------------------------------------------ equivalence: properties over written forms

_PROPERTY = hypothesis.settings(max_examples=20, deadline=None)


def _judge(box: str, reference: str) -> float:
  reward, outcome = rewards.JUDGES["math"](f"\\boxed{{{box}}}", reference, None, 1000)
  assert outcome == rewards.OK, (box, reference)
  return reward


def _exact_forms(kind: str, a: int, b: int) -> list[str]:
  """Spellings of one exact value: a/(b·10^a) (rational), b^{-a} (power), 1/a! (factorial)."""
  if kind == "rational":
    return [
      f"\\frac{{{a}}}{{{b}\\times10^{{{a}}}}}",
      f"\\dfrac{{{a}}}{{{b}}}\\cdot 10^{{-{a}}}",
      f"{a} \\times 10^{{-{a}}} / {b}",
      f"\\frac{{{a * 10}}}{{{b}}} \\times 10^{{-{a + 1}}}",
    ]
  if kind == "power":
    return [
      f"{b}^{{-{a}}}",
      f"\\frac{{1}}{{{b}^{{{a}}}}}",
      f"\\left(\\frac{{1}}{{{b}}}\\right)^{{{a}}}",
    ]
  return [f"\\frac{{1}}{{{a}!}}", f"({a}!)^{{-1}}", f"\\frac{{1}}{{{math.factorial(a)}}}"]


@_PROPERTY
@hypothesis.given(
  kind=st.sampled_from(["rational", "power", "factorial"]),
  a=st.integers(2, 60),
  b=st.integers(2, 97),
  pick=st.randoms(use_true_random=False),
)
def test_exact_small_numbers_compare_exactly(kind, a, b, pick):
  forms = _exact_forms(kind, a, b)
  reference = pick.choice(forms)
  assert _judge(pick.choice(forms), reference) == 1.0
  # The neighbouring value of the same kind, as tiny: never equal.
  others = _exact_forms(kind, a + 1, b) + (
    [] if kind == "factorial" else _exact_forms(kind, a, b + 1)
  )
  assert _judge(pick.choice(others), reference) == 0.0


def _sci_forms(mantissa: str, exponent: int) -> list[str]:
  """Spellings of mantissa·10^exponent, the mantissa's digits kept as written."""
  forms = [
    f"{mantissa}e{exponent}",
    f"{mantissa}E{exponent}",
    f"{mantissa}\\times10^{{{exponent}}}",
    f"{mantissa} \\times 10^{{{exponent}}}",
    f"{mantissa}\\cdot10^{{{exponent}}}",
  ]
  if -8 <= exponent <= 8:
    forms.append(format(decimal.Decimal(mantissa).scaleb(exponent), "f"))
  return forms


def _change_digit(number: str, pick, significant_from: int = 0) -> str:
  """`number` with one of its digits (from the `significant_from`-th on) set to another; the
  first significant digit never becomes 0."""
  at = [i for i, c in enumerate(number) if c.isdigit()][significant_from:]
  index = pick.choice(at)
  old = number[index]
  new = pick.choice([d for d in "0123456789" if d != old and (d != "0" or index != at[0])])
  return number[:index] + new + number[index + 1 :]


@_PROPERTY
@hypothesis.given(
  lead=st.sampled_from("123456789"),
  digits=st.text("0123456789", max_size=5),
  exponent=st.integers(-40, 40),
  pick=st.randoms(use_true_random=False),
)
def test_decimal_reference_compares_to_its_written_digits(lead, digits, exponent, pick):
  mantissa = lead + ("." + digits if digits else "")
  reference = pick.choice(_sci_forms(mantissa, exponent))
  assert _judge(pick.choice(_sci_forms(mantissa, exponent)), reference) == 1.0
  # Any stated digit changed, at any magnitude: wrong.
  wrong = _change_digit(mantissa, pick)
  assert _judge(pick.choice(_sci_forms(wrong, exponent)), reference) == 0.0


def _significant(value: decimal.Decimal, digits: int, sci: bool) -> str:
  """`value` rounded to `digits` significant digits, plain or `m\\times10^{k}`."""
  if sci or not -8 <= value.adjusted() < digits - 1:  # Plain only with a decimal point.
    mantissa, exponent = format(value, f".{digits - 1}e").split("e")
    return f"{mantissa}\\times10^{{{int(exponent)}}}"
  return format(value, f".{digits - 1 - value.adjusted()}f")


@_PROPERTY
@hypothesis.given(
  p=st.integers(1, 10**6),
  q=st.integers(1, 10**5),
  prime=st.sampled_from([3, 7, 11, 13, 17, 19, 23]),
  shift=st.integers(-20, 20),
  digits=st.integers(numbers.MIN_DECIMAL_DIGITS, 10),
  sci=st.booleans(),
  pick=st.randoms(use_true_random=False),
)
def test_decimal_response_to_exact_reference(p, q, prime, shift, digits, sci, pick):
  value = fractions.Fraction(p, q * prime) * fractions.Fraction(10) ** shift
  # Not a finite decimal (those are exact: a decimal then equals the reference exactly).
  hypothesis.assume(value.denominator % prime == 0)
  reference = f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
  with decimal.localcontext(prec=80):
    exact = decimal.Decimal(value.numerator) / value.denominator
  rounded = _significant(exact, digits, sci)
  assert _judge(rounded, reference) == 1.0
  mantissa, _, tail = rounded.partition("\\times")
  first = next(k for k, c in enumerate(c for c in mantissa if c.isdigit()) if c != "0")
  wrong = _change_digit(mantissa, pick, first) + ("\\times" + tail if tail else "")
  assert _judge(wrong, reference) == 0.0
  # Fewer significant digits do not approximate an exact value (module docstring's rule).
  short = _significant(exact, numbers.MIN_DECIMAL_DIGITS - 1, sci)
  assert _judge(short, reference) == 0.0


@_PROPERTY
@hypothesis.given(
  whole=st.integers(1, 10**7),
  zeros=st.integers(1, 6),
  offset=st.integers(1, 99).filter(lambda k: k != 50),
  sign=st.sampled_from(["", "-"]),
)
def test_whole_valued_decimal_keeps_its_written_precision(whole, zeros, offset, sign):
  """ "2849.00" states 6 digits as "2849.01" does: against an exact reference it is right
  within half a unit of its last written digit, offset/100 of that unit away here."""
  hypothesis.assume(len(str(whole)) + zeros >= numbers.MIN_DECIMAL_DIGITS)
  value = whole + fractions.Fraction(offset, 100) / 10**zeros
  reference = f"{sign}\\frac{{{value.numerator}}}{{{value.denominator}}}"
  response = f"{sign}{whole}." + "0" * zeros
  assert _judge(response, reference) == (1.0 if offset < 50 else 0.0)


def _constant_forms(p: int, q: int, k: int) -> list[str]:
  """Spellings of (p/q)·e^k + π (e, π as the maths sets write them)."""
  e = ["e", "\\mathrm{e}", "\\operatorname{e}", "\\text{e}"]
  pi = ["\\pi", "\\mathrm{\\pi}", "π"]
  return [
    f"\\frac{{{p}}}{{{q}}}{e[0]}^{{{k}}} + {pi[0]}",
    f"\\frac{{{p} {e[1]}^{{{k}}}}}{{{q}}}+{pi[1]}",
    f"{pi[2]} + \\dfrac{{{p}}}{{{q}}} \\cdot {e[2]}^{{{k}}}",
    f"\\frac{{{p}}}{{{q}}}\\left({e[3]}^{{{k}}}\\right) + {pi[0]}",
  ]


@_PROPERTY
@hypothesis.given(
  p=st.integers(1, 999),
  q=st.integers(1, 999),
  k=st.integers(-9, 9).filter(bool),
  pick=st.randoms(use_true_random=False),
)
def test_constants_in_any_spelling(p, q, k, pick):
  forms = _constant_forms(p, q, k)
  reference = pick.choice(forms)
  assert _judge(pick.choice(forms), reference) == 1.0
  others = (
    _constant_forms(p + 1, q, k) + _constant_forms(p, q + 1, k) + _constant_forms(p, q, k + 1)
  )
  hypothesis.assume(fractions.Fraction(p + 1, q) != fractions.Fraction(p, q + 1))
  assert _judge(pick.choice(others), reference) == 0.0


def _complex_forms(a: fractions.Fraction, b: fractions.Fraction) -> list[str]:
  """Spellings of a + bi (b ≠ 0), with i as the maths sets write it."""

  def num(x: fractions.Fraction) -> str:
    if x.denominator == 1:
      return str(x.numerator)
    return f"{'-' if x < 0 else ''}\\frac{{{abs(x.numerator)}}}{{{x.denominator}}}"

  sign = "-" if b < 0 else "+"
  forms = [
    f"{num(a)} {sign} {num(abs(b))}i",
    f"{num(b)}\\mathrm{{i}} + {num(a)}",
    f"{num(a)}{sign}{num(abs(b))}\\,\\mathrm{{i}}",
  ]
  if a.denominator == 1 and b.denominator == 1:  # Decimals as written by a solver.
    forms.append(f"{a.numerator}.0 {sign} {abs(b.numerator)}.0i")
  return forms


@_PROPERTY
@hypothesis.given(
  a=st.fractions(min_value=-50, max_value=50, max_denominator=9),
  b=st.fractions(min_value=-50, max_value=50, max_denominator=9).filter(bool),
  pick=st.randoms(use_true_random=False),
)
def test_complex_numbers_with_i_the_imaginary_unit(a, b, pick):
  forms = _complex_forms(a, b)
  reference = pick.choice(forms)
  assert _judge(pick.choice(forms), reference) == 1.0
  others = _complex_forms(a + 1, b) + _complex_forms(a, b + 1 or 2) + _complex_forms(a, -b)
  assert _judge(pick.choice(others), reference) == 0.0


def test_exact_judge():
  judge = rewards.JUDGES["exact"]
  assert judge("so \\boxed{1,234}", "1234", None, 100) == (1.0, rewards.OK)
  assert judge("\\boxed{1234.5}", "1234", None, 100) == (0.0, rewards.OK)
  assert judge("\\boxed{12345}", "12345", None, 4) == (0.0, rewards.NO_BOX)  # Too long.
  assert judge("no box", "1", None, 100) == (0.0, rewards.NO_BOX)
  # The math judge's comma rule, and an empty reference is an error.
  assert judge("\\boxed{111}", "0,111", None, 100) == (0.0, rewards.OK)
  assert judge("\\boxed{0,50}", "0.5", None, 100) == (1.0, rewards.OK)
  assert judge("\\boxed{1.22}", "1,22", None, 100) == (1.0, rewards.OK)
  assert judge("\\boxed{1,22}", "1,22", None, 100) == (1.0, rewards.OK)
  assert judge("\\boxed{1}", " ", None, 100) == (0.0, rewards.ERROR)


# ------------------------------------------------------ commas in numbers, powers of i


def _both_judges(box: str, reference: str) -> float:
  """The math judge's reward, checked equal to the exact judge's for plain numbers."""
  reward = _judge(box, reference)
  assert rewards.JUDGES["exact"](f"\\boxed{{{box}}}", reference, None, 1000) == (
    reward,
    rewards.OK,
  ), (box, reference)
  return reward


@_PROPERTY
@hypothesis.given(
  n=st.integers(1000, 10**15),
  fraction=st.text("0123456789", max_size=4),
  sign=st.sampled_from(["", "-"]),
)
def test_thousands_separators_both_sides(n, fraction, sign):
  tail = "." + fraction if fraction else ""
  grouped, plain = f"{sign}{n:,}{tail}", f"{sign}{n}{tail}"
  assert numbers.THOUSANDS.fullmatch(grouped)
  assert _both_judges(grouped, plain) == 1.0
  assert _both_judges(plain, grouped) == 1.0
  assert _both_judges(f"{sign}{n + 1:,}{tail}", plain) == 0.0
  assert _both_judges(plain, f"{sign}{n + 1:,}{tail}") == 0.0
  # Never read as a decimal comma: 1,234 is not 1.234.
  head, _, rest = f"{n:,}".partition(",")
  assert _judge(f"{sign}{head}.{rest.replace(',', '')}", grouped) == 0.0


@_PROPERTY
@hypothesis.given(
  whole=st.one_of(st.just(0), st.integers(1, 10**6)),
  fraction=st.text("0123456789", min_size=1, max_size=6),
  sign=st.sampled_from(["", "-"]),
)
def test_decimal_commas_both_sides(whole, fraction, sign):
  comma, point = f"{sign}{whole},{fraction}", f"{sign}{whole}.{fraction}"
  # "1,234" is a thousands separator; every other one-comma number a decimal comma.
  hypothesis.assume(not numbers.THOUSANDS.fullmatch(comma))
  assert numbers.decimal_comma(comma) == point
  assert _both_judges(point, comma) == 1.0
  assert _both_judges(comma, point) == 1.0
  # The thousands misreading, and the next value at the written precision: wrong.
  misread = f"{sign}{int(f'{whole}{fraction}')}"
  hypothesis.assume(decimal.Decimal(misread) != decimal.Decimal(point))
  assert _both_judges(misread, comma) == 0.0
  assert _both_judges(comma, misread) == 0.0
  step = decimal.Decimal(1).scaleb(-len(fraction))
  other = format(abs(decimal.Decimal(point)) + step, "f").replace(".", ",")
  assert _judge(f"{sign}{other}", point) == 0.0
  assert _judge(point, f"{sign}{other}") == 0.0


@_PROPERTY
@hypothesis.given(k=st.integers(-40, 40), shift=st.integers(-3, 3), form=st.integers(0, 2))
def test_integer_powers_of_i_both_sides(k, shift, form):
  value = {0: "1", 1: "i", 2: "-1", 3: "-i"}[k % 4]
  power = [f"i^{{{k}}}", f"\\mathrm{{i}}^{{{k}}}", f"(i)^{{{k}}}"][form]
  assert _judge(power, value) == 1.0
  assert _judge(value, power) == 1.0
  assert _judge(power, f"i^{{{k + 4 * shift}}}") == 1.0
  assert _judge(power, {0: "1", 1: "i", 2: "-1", 3: "-i"}[(k + 1) % 4]) == 0.0
  assert _judge(f"i^{{{k + 2}}}", value) == 0.0


# --------------------------------------------------------------------- reference answers


@pytest.mark.parametrize(
  "source, row, expected",
  [
    ("math500", {"answer": "\\frac{14}{3}"}, "\\frac{14}{3}"),
    ("math", {"solution": "So $\\boxed{2}$ and then \\boxed{\\{1,2\\}}."}, "\\{1,2\\}"),
    ("minerva_math", {"solution": "$s=\\boxed{1.6}$ cm"}, "1.6"),
    ("olympiadbench", {"final_answer": ["$\\frac{1}{2 n+2}$"]}, "\\frac{1}{2 n+2}"),
    ("olympiadbench", {"final_answer": ["$69$,$84$"]}, "69,84"),
    ("olympiadbench", {"final_answer": "['$2^{1009}$']"}, "2^{1009}"),
    ("aime24", {"answer": "025"}, "025"),
    ("amc23", {"answer": 27.0}, "27"),
    ("amc23", {"answer": 2.5}, "2.5"),
    ("gsm8k", {"answer": "16 - 3 = <<16-3=13>>13\n#### 1,450"}, "1450"),
    ("gsm8k", {"answer": "#### 0,5"}, "0,5"),  # A decimal comma is kept.
    ("amc23", {"answer": 7}, "7"),
    ("amc23", {"answer": 1e20}, "1e+20"),
    ("olympiadbench", {"final_answer": [3, "$4$"]}, "3, 4"),
  ],
)
def test_reference_answer(source, row, expected):
  assert references.reference_answer(source, row) == expected


@pytest.mark.parametrize(
  "source, row, message",
  [
    ("mmlu", {"answer": "1"}, "unknown source 'mmlu'"),
    ("math500", {"solution": "x"}, "no field 'answer'"),
    ("gsm8k", {"answer": "it is 5"}, "'####'"),
    ("minerva_math", {"solution": "no box"}, "field 'solution'"),
    ("aime24", {"answer": "  "}, "empty reference answer"),
    ("math500", {"answer": None}, "field 'answer' is null"),
    ("aime24", {"answer": ["1", "2"]}, "field 'answer' is a list"),
    ("amc23", {"answer": True}, "field 'answer' is a boolean"),
    ("amc23", {"answer": float("nan")}, "field 'answer' is nan, not a finite number"),
    ("math", {"solution": None}, "field 'solution' is null"),
    ("gsm8k", {"answer": {"text": "#### 5"}}, "field 'answer' is an object"),
    ("olympiadbench", {"final_answer": None}, "field 'final_answer' is null"),
    ("olympiadbench", {"final_answer": ["$1$", None]}, "field 'final_answer' is null"),
    ("olympiadbench", {"final_answer": ["$ $"]}, "empty reference answer"),
  ],
)
def test_reference_answer_errors(source, row, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    references.reference_answer(source, row)


_JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text())
_JSON = st.recursive(
  _JSON_SCALARS, lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=5
)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(value=_JSON)
def test_answer_text_is_a_string_or_a_number_or_refused(value):
  """No JSON value becomes its Python spelling: strings stay, finite numbers keep their
  value, everything else is refused naming the field."""
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  if isinstance(value, str):
    assert references.answer_text(value, "answer") == value
  elif number and math.isfinite(value):
    text = references.answer_text(value, "answer")
    assert float(text) == value and not text.endswith(".0")
    assert isinstance(value, float) or text == str(value)
  else:
    with pytest.raises(ValueError, match="field 'answer' is "):
      references.answer_text(value, "answer")
