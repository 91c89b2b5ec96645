"""Tests for ada_jax.rewards.judges: the authors' released training reward next to ours."""

import pytest

from ada_jax.rewards import grader, judges
from ada_jax.rewards.verifier import Verifier, VerifierConfig

RELEASED = judges.JUDGES["released"]
OURS = judges.JUDGES["math"]


@pytest.mark.parametrize(
  "response,box",
  [
    ("so \\boxed{3} then \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{ x^{2} }", "x^{2}"),
    ("\\boxed{3} and at last \\boxed{4", None),  # the last one is unclosed: it hides 3
    ("\\fbox{5}", None),
    ("\\boxed 5", None),
    ("no box", None),
  ],
)
def test_released_box_is_the_last_boxed_brace_matched(response, box):
  assert judges.released_box(response) == box


@pytest.mark.parametrize(
  "response,reference,released,ours",
  [
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),
    ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0, 1.0),
    ("\\boxed{6}", "7", 0.0, 0.0),
    ("\\fbox{5}", "5", 0.0, 1.0),  # ours reads \fbox
    ("\\boxed{7.19}", "7.2", 0.0, 1.0),  # ours: 7.2 states one decimal, 7.19 rounds to it
    ("\\boxed{1.41421}", "\\sqrt{2}", 0.0, 1.0),  # ours: 6 significant digits of √2
    ("\\boxed{}", "1", 0.0, 0.0),
  ],
)
def test_released_judge_against_ours(response, reference, released, ours):
  assert RELEASED(response, reference, None, 1000)[0] == released
  assert OURS(response, reference, None, 1000)[0] == ours


def test_released_judge_uses_stock_numbers_after_ours_patched_them():
  assert grader.math_reward("\\boxed{7.19}", "7.2") == 1.0  # patches math-verify (ours)
  assert RELEASED("\\boxed{7.19}", "7.2", None, 1000) == (0.0, grader.OK)
  assert RELEASED("\\boxed{7.2}", "7.2", None, 1000) == (1.0, grader.OK)
  assert grader.math_reward("\\boxed{7.19}", "7.2") == 1.0  # and ours is back


def test_released_judge_runs_in_the_reward_pool_with_the_released_timeout():
  config = VerifierConfig(judge="released", num_workers=1, timeout_s=20.0)
  with Verifier(config) as pool:
    rewards = pool.score(["\\boxed{7.2}", "\\boxed{7.19}", "\\fbox{7.2}"], ["7.2"] * 3)
  assert rewards.tolist() == [1.0, 0.0, 0.0]
  with pytest.raises(ValueError, match="judge='verl'"):
    VerifierConfig(judge="verl")


def test_paper_configs_use_the_released_judge_and_timeout():
  from configs import llama3b_pos, qwen_math7b_balance, qwen_math15b_grpo, tiny_arith_pos

  for module in (llama3b_pos, qwen_math7b_balance, qwen_math15b_grpo):
    c = module.get_config()
    assert c.rl.verifier.judge == "released" and c.rl.verifier.timeout_s == 20.0
  assert tiny_arith_pos.get_config().rl.verifier.judge == "exact"
