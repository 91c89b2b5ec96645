"""The reward judges by config name (`rl.verifier.judge`, `eval.verifier.judge`): ours and
the authors'.

'math' and 'exact' are ours (`grader`). 'released' is the training reward of the authors'
verl fork of Reinforce-Ada (its `verl/utils/reward_score/math_verify.py`, reached through
`default_compute_score` for their prompt sets' `data_source`): the text after the LAST
occurrence of `\\boxed{`, brace-matched (none, unclosed or empty: 0), wrapped in
`\\boxed{}` and compared with the boxed reference by stock math-verify's `math_metric`
(gold parsed as LaTeX, prediction as an expression or LaTeX; math-verify's own rule for
numbers, which compares to 6 decimal places, and its own signal timeouts); any exception
scores 0. The authors ran it under a 20 s limit per response (`rl.verifier.timeout_s`).

How 'math' differs: it also reads `\\fbox{}`, takes the last box by brace matching over
the whole response, grades decimals by their written precision and exact values exactly
(`rewards/numbers.py`: 7.19 is not 7.2, and a 6-digit decimal of an exact value counts),
reads notation variants (`3.89e-10`, `\\mathrm{i}`) and scores prose boxes 0 as errors.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

from ada_jax.rewards import grader, numbers
from ada_jax.rewards.grader import ERROR, NO_BOX, OK

_NEEDLE = "\\boxed{"


def released_box(response: str) -> str | None:
  """The content of the last `\\boxed{` of `response`, braces matched, stripped; None when
  there is no `\\boxed{` or its brace never closes (the released `extract_boxed_answer`:
  it looks only at the last occurrence, so an unclosed last box hides earlier ones)."""
  start = response.rfind(_NEEDLE)
  if start < 0:
    return None
  depth = 1
  for i in range(start + len(_NEEDLE), len(response)):
    c = response[i]
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return response[start + len(_NEEDLE) : i].strip()
  return None


@functools.lru_cache(maxsize=1)
def _metric():
  from math_verify.metric import math_metric
  from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

  return math_metric(
    gold_extraction_target=(LatexExtractionConfig(),),
    pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
  )


@contextlib.contextmanager
def _stock_numbers() -> Iterator[None]:
  """math-verify's own numeric comparison while inside, even in a process where `grader`
  has replaced it (`numbers.patched_math_verify`, a module-level swap)."""
  from math_verify import grader as mv_grader

  current = mv_grader.sympy_numeric_eq
  mv_grader.sympy_numeric_eq = numbers.stock_numeric_eq() or current
  try:
    yield
  finally:
    mv_grader.sympy_numeric_eq = current


def judge_released(
  response: str, reference: str, mv_timeout_s: int | None, max_chars: int
) -> tuple[float, str]:
  """The authors' training reward (module docstring): (1.0 or 0.0, outcome code).

  `mv_timeout_s` is not used: stock math-verify keeps its own timeouts, as released.
  Box contents longer than `max_chars` score 0 unparsed (`NO_BOX`), as in 'math'.
  """
  del mv_timeout_s
  pred = released_box(response)
  if not pred or len(pred) > max_chars:
    return 0.0, NO_BOX
  try:
    with _stock_numbers():
      score, _ = _metric()(["\\boxed{" + reference + "}"], ["\\boxed{" + pred + "}"])
  except Exception:  # noqa: BLE001 — released: every failure scores 0
    return 0.0, ERROR
  return float(score), OK


# Reward functions by config name:
#   (response, reference, mv_timeout_s, max_answer_chars) -> (reward, outcome).
JUDGES: dict[str, Callable[[str, str, int | None, int], tuple[float, str]]] = {
  **grader.JUDGES,
  "released": judge_released,
}
