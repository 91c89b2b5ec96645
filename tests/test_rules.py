"""The rule table: the worked example of docs/design.md "Adding a sampling method" runs as
written, under both schedules, and behaves as the text says."""

import pathlib
import re

import numpy as np
import pytest

from ada_jax.rl import controller, rules
from ada_jax.rl.adaptive import AdaConfig

DESIGN = pathlib.Path(__file__).resolve().parents[1] / "docs" / "design.md"


def _worked_example() -> str:
  section = DESIGN.read_text().split("### Adding a sampling method", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 1, "the section holds one code block"
  return blocks[0]


@pytest.fixture
def pos2():
  scope: dict = {}
  exec(_worked_example(), scope)  # noqa: S102 - the doc's own code, checked as written
  try:
    yield scope["config"]
  finally:
    del rules.RULES["pos2"]


def _draw(streams):
  used = [0] * len(streams)

  def draw(prompts):
    out = []
    for p in prompts.tolist():
      out.append(streams[p][used[p]])
      used[p] += 1
    return np.asarray(out, np.float32)

  return draw, used


@pytest.mark.parametrize("schedule", controller.SCHEDULES)
def test_the_worked_example_is_one_table_entry(pos2, schedule):
  assert pos2.thresholds() == (2, 0) and pos2.is_seq and pos2.min_rows_per_prompt == 4
  # Prompt 0: two positives in round 1; prompt 1: one, then one more in round 2;
  # prompt 2: none in 12.
  streams = [[1, 0, 1, 0] + [0] * 8, [0, 1, 0, 0, 1, 0, 0, 0] + [0] * 4, [0] * 12]
  draw, used = _draw(streams)
  result, _ = controller.run_step(
    pos2, ["a", "b", "c"], controller.DrawEngine(draw), np.random.default_rng(0),
    schedule=schedule,
  )  # fmt: skip
  assert used == [4, 8, 12]
  assert result.stats.pool_size.tolist() == [4, 8, 12]
  if schedule == "rounds":
    assert result.stats.samples_per_round == (12, 8, 4)
  # Seq's own selection and global baseline: prompt 0 keeps its two positives and two
  # negatives, A = r − 1/2.
  kept = result.prompt_index == 0
  np.testing.assert_allclose(result.advantages[kept], [0.5, 0.5, -0.5, -0.5])
  assert result.stats.signal_fraction == pytest.approx(2 / 3)


def test_an_unknown_method_names_the_table():
  with pytest.raises(ValueError, match=r"AdaConfig.method='pos3'.*'grpo', 'dapo'"):
    AdaConfig(method="pos3")
