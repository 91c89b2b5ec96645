"""Tests for ada_jax.rewards: box extraction, normalisation, equivalence, the judges and
reference answers.
"""

import time

import hypothesis
import hypothesis.strategies as st
import pytest

from ada_jax import rewards

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


def test_exact_judge():
  judge = rewards.JUDGES["exact"]
  assert judge("so \\boxed{1,234}", "1234", None, 100) == (1.0, rewards.OK)
  assert judge("\\boxed{1234.5}", "1234", None, 100) == (0.0, rewards.OK)
  assert judge("\\boxed{12345}", "12345", None, 4) == (0.0, rewards.NO_BOX)  # Too long.
  assert judge("no box", "1", None, 100) == (0.0, rewards.NO_BOX)


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
  ],
)
def test_reference_answer(source, row, expected):
  assert rewards.reference_answer(source, row) == expected


@pytest.mark.parametrize(
  "source, row, message",
  [
    ("mmlu", {"answer": "1"}, "unknown source 'mmlu'"),
    ("math500", {"solution": "x"}, "no field 'answer'"),
    ("gsm8k", {"answer": "it is 5"}, "'####'"),
    ("minerva_math", {"solution": "no box"}, "field 'solution'"),
    ("aime24", {"answer": "  "}, "empty reference answer"),
  ],
)
def test_reference_answer_errors(source, row, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    rewards.reference_answer(source, row)
