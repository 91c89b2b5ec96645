"""The rule table: the worked example of docs/design.md "Adding a sampling method" (a rule's
module and its config file) runs as written, under both schedules and from the command line
through a checkpoint, and behaves as the text says."""

import copy
import json
import pathlib
import re
import sys
import types

import numpy as np
import pytest
from absl import flags
from hypothesis import given, settings
from hypothesis import strategies as st

from ada_jax import cli, loop
from ada_jax.rl import controller, estimate, rules
from ada_jax.rl.rules import AdaConfig, SeqConfig

DESIGN = pathlib.Path(__file__).resolve().parents[1] / "docs" / "design.md"


def _worked_example() -> list[str]:
  section = DESIGN.read_text().split("### Adding a sampling method", 1)[1].split("\n### ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 2, "the section holds the rule's module and its config file"
  return blocks


@pytest.fixture
def patient():
  """The doc's rule module, imported as `ada_jax.rl.rules.patient` (as its config imports it),
  and the doc's config file's text."""
  module_text, config_text = _worked_example()
  module = types.ModuleType("ada_jax.rl.rules.patient")
  sys.modules[module.__name__] = module
  try:
    exec(compile(module_text, "ada_jax/rl/rules/patient.py", "exec"), module.__dict__)  # noqa: S102
    yield module, config_text
  finally:
    rules.RULES.pop("pos_patient", None)
    rules.GROUPS.pop("patience", None)
    del sys.modules[module.__name__]


def _patient_config(module, **seq):
  seq = SeqConfig(**{"samples_per_round": 4, "max_rounds": 3, **seq})
  return AdaConfig(method="pos_patient", n=4, seq=seq, patience=module.Patience(rounds=2))


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
def test_the_worked_example_is_one_table_entry(patient, schedule):
  module, _ = patient
  config = _patient_config(module)
  rule = rules.rule_for(config)
  assert isinstance(rule, rules.Seq) and rule.min_rows(config) == 4
  assert rules.thresholds(config) == (1, 0) and rule.settings_of(config).rounds == 2
  # Prompt 0: a positive in round 1; prompt 1: none in 12; prompt 2: its first in round 2.
  streams = [[0, 1, 0, 0] + [0] * 8, [0] * 12, [0, 0, 0, 0, 0, 1, 0, 0] + [0] * 4]
  draw, used = _draw(streams)
  result, state = controller.run_step(
    config, ["a", "b", "c"], controller.DrawEngine(draw), np.random.default_rng(0),
    schedule=schedule,
  )  # fmt: skip
  assert used == [4, 8, 8]  # prompt 1 gave up after 2 rounds instead of drawing 12
  assert result.stats.pool_size.tolist() == [4, 8, 8]
  assert result.stats.rule_metrics == {"ada/gave_up": 1, "ada/gave_up_total": 1}
  assert result.stats.as_metrics()["ada/gave_up"] == 1
  if schedule == "rounds":
    assert result.stats.samples_per_round == (12, 8)
  # Seq's own selection and global baseline: prompt 0 keeps its positive and three
  # negatives, A = r − 1/4; the prompt that gave up is kept with zero advantage.
  np.testing.assert_allclose(
    result.advantages[result.prompt_index == 0], [0.75, -0.25, -0.25, -0.25]
  )
  assert not result.advantages[result.prompt_index == 1].any()
  # The next step starts from this one's state: the total goes on.
  draw, _ = _draw([[0] * 12] * 2)
  again, state = controller.run_step(
    config, ["d", "e"], controller.DrawEngine(draw), np.random.default_rng(0), state,
    schedule=schedule,
  )  # fmt: skip
  assert again.stats.rule_metrics == {"ada/gave_up": 2, "ada/gave_up_total": 3}
  assert isinstance(state, module.PatientState) and int(state.gave_up) == 3


def test_the_worked_example_refuses_bad_settings(patient):
  module, _ = patient
  with pytest.raises(ValueError, match=r"Patience.rounds=0: must be >= 1"):
    module.Patience(rounds=0)
  with pytest.raises(ValueError, match=r"AdaConfig.seq.max_rounds=2: must exceed patience"):
    rules.rule_for(_patient_config(module, max_rounds=2))
  with pytest.raises(ValueError, match=r"AdaConfig.seq.k_pos=0: pos_patient waits"):
    rules.rule_for(_patient_config(module, k_pos=0, k_neg=4))
  with pytest.raises(TypeError, match=r"'patient' is neither a field nor a settings group"):
    AdaConfig(method="pos_patient", patient=module.Patience())
  with pytest.raises(ValueError, match=r"AdaConfig.patience=.*expected a Patience"):
    AdaConfig(method="pos_patient", patience=SeqConfig())


def test_the_worked_example_runs_from_its_config_file_and_resumes(patient, tmp_path, monkeypatch):
  """The doc's two files are the whole method: its config file runs it from the command line
  (`--config.ada.patience.rounds` reaches the rule's own group), its state is checkpointed,
  and a resumed run goes on from it."""
  from test_loop import no_eval, tiny_config

  from configs import tiny_arith_pos

  small = no_eval(tiny_config(steps=2))
  monkeypatch.setattr(tiny_arith_pos, "get_config", lambda: copy.deepcopy(small))
  _, config_text = patient
  path = tmp_path / "tiny_arith_pos_patient.py"
  path.write_text(config_text)
  workdir = tmp_path / "run"

  def run(steps):
    argv = ["main", f"--config={path}", "--config.ada.patience.rounds=1"]
    argv.append(f"--config.rl.steps={steps}")
    fv = flags.FlagValues()
    cli.define_config_file("config", "the experiment", flag_values=fv, sys_argv=argv)
    fv(argv)
    assert fv.config.ada.patience.rounds == 1 and fv.config.ada.method == "pos_patient"
    loop.run(fv.config, str(workdir))

  run(2)
  run(3)  # resumes from checkpoint 2 (`ckpt.every_steps` = 2)
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  rows = [r for r in rows if "ada/gave_up" in r]
  assert [r["step"] for r in rows] == [1, 2, 3]
  gave_up = [r["ada/gave_up"] for r in rows]
  assert gave_up[0] + gave_up[1] > 0, "the tiny policy solves nothing: every prompt gives up"
  assert [r["ada/gave_up_total"] for r in rows] == np.cumsum(gave_up).tolist()


def test_an_unknown_method_names_the_table():
  with pytest.raises(ValueError, match=r"AdaConfig.method='pos3'.*'grpo', 'dapo'"):
    rules.rule_for(AdaConfig(method="pos3"))


# --------------------------------------------------------------- the exit-chance rule


def test_exit_chance_by_hand():
  # pos (k = 1, 0), 8 wrong so far, 24 draws left, posterior Beta(1, 9):
  # 1 - P(no positive) = 1 - B(1, 33) / B(1, 9) = 1 - 9/33.
  assert estimate.exit_chance(0, 8, 24, 1.0, 9.0, 1, 0) == pytest.approx(24 / 33, rel=1e-12)
  # balance (2, 2) with 4 wrong: needs 2 positives in the 4 left; Beta(1, 5):
  # P(X >= 2) = 1 - 5/9 - 4·(1/72)·5 = 1/6.
  assert estimate.exit_chance(0, 4, 4, 1.0, 5.0, 2, 2) == pytest.approx(1 / 6, rel=1e-12)
  assert estimate.exit_chance(1, 3, 0, 1.0, 1.0, 1, 0) == 1.0  # met already, nothing left
  assert estimate.exit_chance(0, 3, 0, 1.0, 1.0, 1, 0) == 0.0  # no draw left
  assert estimate.exit_chance(0, 0, 3, 1.0, 1.0, 2, 2) == 0.0  # 3 draws cannot hold 2 + 2


@settings(max_examples=80, deadline=None)
@given(
  pos=st.integers(0, 6),
  neg=st.integers(0, 6),
  left=st.integers(0, 30),
  alpha=st.floats(0.2, 40.0),
  beta=st.floats(0.2, 40.0),
  k_pos=st.integers(0, 4),
  k_neg=st.integers(0, 4),
)
def test_exit_chance_is_the_beta_binomial_tail(pos, neg, left, alpha, beta, k_pos, k_neg):
  from scipy import stats

  lo, hi = max(0, k_pos - pos), left - max(0, k_neg - neg)
  want = sum(stats.betabinom.pmf(x, left, alpha, beta) for x in range(lo, hi + 1))
  got = estimate.exit_chance(pos, neg, left, alpha, beta, k_pos, k_neg)
  assert got == pytest.approx(want, abs=1e-9) and 0.0 <= got <= 1.0
  # More draws left can only help; a negative more never helps pos's rule (k_neg = 0).
  assert estimate.exit_chance(pos, neg, left + 1, alpha, beta, k_pos, k_neg) >= got - 1e-12


def _hopeless_state(ids, tot=200.0):
  """Est statistics in which the prompts `ids` drew `tot` responses, all wrong."""
  keys = estimate.prompt_keys(ids)
  return estimate.update_est_state(
    estimate.init_est_state(), keys, np.zeros(len(ids)), np.full(len(ids), tot), 1.0
  )


@pytest.mark.parametrize("schedule", controller.SCHEDULES)
def test_a_prompt_that_cannot_exit_is_stopped_after_its_first_round(schedule):
  # "a" has drawn 200 wrong responses before: after its first round (8 more wrong), its
  # chance of a positive in the 24 left is 1 - 224/248 = 0.097 < 0.2. "b" is new (prior
  # Beta(1, 16)): after round 1, 1 - 24/48 = 0.5; round 2, 1 - 32/48 = 0.33; round 3,
  # 1 - 40/48 = 0.17 < 0.2: stopped with 24 drawn.
  cfg = AdaConfig(
    method="pos", n=4, seq=SeqConfig(samples_per_round=8, max_rounds=4, min_exit_chance=0.2)
  )
  state = _hopeless_state(["a"])
  draw, used = _draw([[0] * 32, [0] * 32])
  engine = controller.DrawEngine(draw)
  result, new_state = controller.run_step(
    cfg, ["a", "b"], engine, np.random.default_rng(0), state, schedule=schedule
  )
  assert result.stats.stopped == (0, 1) and used == [8, 24]
  assert result.stats.rule_metrics["ada/stopped_fraction"] == 1.0
  # Trained on as a prompt that never exits: its group of n, zero advantage.
  assert result.stats.rows_selected == 8 and not result.advantages.any()
  # Its outcomes join the statistics it was judged by (decayed by est.decay).
  pos, tot = estimate.counts(new_state, estimate.prompt_keys(["a", "b"]))
  np.testing.assert_allclose(tot, [0.9 * 200 + 8, 24])
  np.testing.assert_array_equal(pos, [0, 0])


def test_the_rule_is_off_by_default_and_only_for_exit_rules():
  cfg = AdaConfig(method="pos", n=4, seq=SeqConfig(samples_per_round=8, max_rounds=4))
  draw, used = _draw([[0] * 32])
  result, state = controller.run_step(
    cfg, ["a"], controller.DrawEngine(draw), np.random.default_rng(0), _hopeless_state(["a"])
  )
  assert used == [32] and result.stats.stopped == () and "keys" in state  # passed through
  for method in ("grpo", "dapo", "est"):
    with pytest.raises(ValueError, match="min_exit_chance.*has none"):
      rules.rule_for(AdaConfig(method=method, seq=SeqConfig(min_exit_chance=0.1)))
  with pytest.raises(ValueError, match=r"min_exit_chance=1\.0"):
    SeqConfig(min_exit_chance=1.0)


def test_a_run_resumed_from_its_saved_statistics_decides_the_same(tmp_path):
  """The statistics the rule reads are the run's Est state, checkpointed: a step after a
  save and restore decides exactly as the uninterrupted run's step."""
  import jax

  from ada_jax import checkpoint
  from ada_jax.models import decoder as model_lib
  from ada_jax.models import sharding
  from ada_jax.rl import train

  cfg = AdaConfig(
    method="balance", n=4, seq=SeqConfig(samples_per_round=4, max_rounds=4, min_exit_chance=0.3)
  )
  ids = [f"q{i}" for i in range(6)]
  rates = np.array([0.0, 0.05, 0.3, 0.6, 0.95, 1.0])

  def step(state, seed):
    gen = np.random.default_rng(seed)
    draw = lambda p: (gen.random(p.size) < rates[p]).astype(np.float32)
    engine = controller.DrawEngine(draw)
    return controller.run_step(cfg, ids, engine, np.random.default_rng(seed), state)

  _, state = step(None, 0)
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  config = model_lib.preset("tiny-llama")
  train_state = train.init_train_state(
    config, train.TrainConfig(), model_lib.init_params(config, jax.random.key(0)), mesh
  )
  manager = checkpoint.make_manager(tmp_path)
  checkpoint.save(
    manager, 1, checkpoint.RunState(train=train_state, rng=jax.random.key(0), method_state=state)
  )
  checkpoint.close(manager)
  target = train.abstract_state(config, train.TrainConfig(), mesh)
  restored = checkpoint.restore(checkpoint.make_manager(tmp_path), target).method_state
  a, _ = step(state, 1)
  b, _ = step(restored, 1)
  assert a.stats.stopped == b.stats.stopped and a.handles == b.handles
  np.testing.assert_array_equal(a.advantages, b.advantages)
