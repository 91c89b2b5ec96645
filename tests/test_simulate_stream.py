"""The slot-pool simulator of rounds vs stream: the pool's schedule, the length model, and
the two schedules against each other and against the Bernoulli simulator."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ada_jax import testing
from ada_jax.rl import simulate as sim
from ada_jax.rl import simulate_stream as ss
from ada_jax.rl.rules import AdaConfig, EstConfig, SeqConfig

SMALL = ss.StreamSimConfig(
  batch=64, slots=128, budget=256, median_length=64.0, segment=16, num_prompts=256, epochs=2
)


@settings(max_examples=60, deadline=None)
@given(
  lengths=st.lists(st.integers(1, 50), min_size=1, max_size=40),
  slots=st.integers(1, 12),
  segment=st.integers(1, 30),
)
def test_slot_pool_schedule_is_list_scheduling_whatever_the_segments(lengths, slots, segment):
  whole = ss.SimSlots(slots)
  whole.enqueue(range(len(lengths)), lengths)
  finished, makespan = whole.run(None)
  assert sorted(finished) == list(range(len(lengths)))
  assert whole.tokens == sum(lengths) and whole.tokens_cancelled == 0
  # Never faster than the work spread over all slots, or than the longest row.
  assert makespan >= max(max(lengths), -(-sum(lengths) // slots))
  if len(lengths) <= slots:
    assert makespan == max(lengths)
  if slots == 1:
    assert makespan == sum(lengths)
  # Decoding in segments changes nothing without cancellations.
  seg = ss.SimSlots(slots)
  seg.enqueue(range(len(lengths)), lengths)
  got, busy = [], 0
  while len(got) < len(lengths):
    f, b = seg.run(segment)
    got += f
    busy += b
  assert got == finished and busy == makespan


def test_cancel_pays_the_tokens_so_far_and_refills_the_slot():
  pool = ss.SimSlots(2)
  pool.enqueue([0, 1, 2, 3], [10, 100, 5, 7])
  finished, busy = pool.run(8)
  assert finished == [] and busy == 8
  pool.cancel([1, 3])  # Row 1 in flight for 8 steps; row 3 still queued: dropped.
  assert pool.tokens_cancelled == 8
  finished, busy = pool.run(None)
  # Row 2 takes row 1's slot at step 8 and ends at 13; row 0 ends at 10.
  assert finished == [0, 2] and busy == 5
  assert pool.tokens == 8 + 10 + 5


def test_length_model_hits_its_median_and_budget_share():
  sigma = ss.length_sigma(512, 2048, 0.03)
  z = np.random.default_rng(0).standard_normal(200_000)
  lengths = 512 * np.exp(sigma * z)
  assert np.median(lengths) == pytest.approx(512, rel=0.01)
  assert np.mean(lengths >= 2048) == pytest.approx(0.03, abs=0.002)
  with pytest.raises(ValueError, match="median_length"):
    ss.length_sigma(4096, 2048, 0.03)
  with pytest.raises(ValueError, match="at_budget"):
    ss.length_sigma(512, 2048, 0.0)


@pytest.mark.parametrize(
  "field, value",
  [
    ("batch", 0),
    ("slots", 0),
    ("segment", 0),
    ("window", 0),
    ("warmup_epochs", 2),
    ("batch", 300),
    ("median_length", 300.0),
    ("at_budget", 0.7),
  ],
)
def test_bad_sim_config_is_named(field, value):
  with pytest.raises(ValueError, match=field):
    dataclasses.replace(SMALL, **{field: value})


@pytest.mark.parametrize(
  "cfg",
  [AdaConfig(method="grpo", n=4), AdaConfig(method="est", est=EstConfig(budget_per_prompt=4.0))],
  ids=["grpo", "est"],
)
def test_fixed_quota_methods_cost_the_same_under_both_schedules(cfg):
  rounds = ss.simulate_schedule(cfg, "rounds", SMALL)
  stream = ss.simulate_schedule(cfg, "stream", SMALL)
  for f in ("samples_per_prompt", "tokens_per_prompt", "decode_steps", "signal_fraction"):
    assert getattr(stream, f) == getattr(rounds, f), f
  assert stream.tokens_cancelled_per_prompt == 0 and rounds.boundaries == 1
  assert 0 < rounds.slot_utilisation <= 1


def test_rounds_schedule_is_the_bernoulli_simulator_plus_lengths():
  """`rounds` samples like `simulate.pos_closed_form` says; lengths only add the cost."""
  cfg = AdaConfig(method="pos", n=4, seq=SeqConfig(samples_per_round=8, max_rounds=4))
  p = sim.sample_pass_rates(np.random.default_rng(3), 1024)
  sc = dataclasses.replace(SMALL, num_prompts=1024, batch=256, epochs=2)
  got = ss.simulate_schedule(cfg, "rounds", sc, pass_rates=p)
  samples, signal = sim.pos_closed_form(p, 8, 4)
  assert got.samples_per_prompt == pytest.approx(samples, rel=0.05)
  assert got.signal_fraction == pytest.approx(signal, abs=4 * np.sqrt(0.25 / 1024))
  mean_length = got.tokens_per_prompt / got.samples_per_prompt
  # Truncated lognormal, median 64, budget 256, 3 % at the budget: mean ~ 64 e^{s^2/2}.
  sigma = ss.length_sigma(64.0, 256, 0.03)
  assert mean_length == pytest.approx(64 * np.exp(sigma**2 / 2), rel=0.1)


@pytest.mark.parametrize("method", ["pos", "balance"])
def test_stream_cuts_the_barriers(method):
  cfg = AdaConfig(method=method)
  rounds = ss.simulate_schedule(cfg, "rounds", SMALL)
  stream = ss.simulate_schedule(cfg, "stream", SMALL)
  assert stream.decode_steps < 0.9 * rounds.decode_steps
  assert stream.slot_utilisation > rounds.slot_utilisation
  assert stream.samples_per_prompt <= rounds.samples_per_prompt
  assert stream.tokens_cancelled_per_prompt > 0
  # Prompts whose pool never meets the rule draw R·M under both schedules; under stream a
  # prompt that met it with rows still in flight has those cancelled, so its pool is smaller.
  assert 0 < stream.capped_prompt_fraction <= rounds.capped_prompt_fraction + 0.01
  if method == "balance":  # Its exit rule makes the exit pool mixed: no signal is lost.
    assert stream.signal_fraction == pytest.approx(rounds.signal_fraction, abs=0.01)
  again = ss.simulate_schedule(cfg, "stream", SMALL)
  assert again == stream  # A function of the seeds.


def test_dapo_stream_fills_the_batch_sooner():
  cfg = AdaConfig(method="dapo", n=4)
  rounds = ss.simulate_schedule(cfg, "rounds", SMALL)
  stream = ss.simulate_schedule(cfg, "stream", SMALL)
  assert stream.signal_fraction == rounds.signal_fraction == 1.0
  assert stream.decode_steps < rounds.decode_steps


def _experiment():
  return testing.load_experiment("simulate_stream", "simulate_stream_cli")


def test_goal_check_and_table():
  cli = _experiment()
  names = ("grpo_n4", "ada_pos", "ada_balance", "ada_pos_stop", "ada_balance_stop")
  rows = {
    name: {s: ss.simulate_schedule(cfg, s, SMALL) for s in ss.SCHEDULES}
    for name, cfg in ss.method_rows(min_exit_chance=0.3).items()
    if name in names
  }
  check = cli.goal_check(rows)
  ref = rows["grpo_n4"]["rounds"].decode_steps
  for method, goal in cli.GOAL.items():
    assert set(check[method]) == {
      f"{n}/{s}" for n in (method, f"{method}_stop") for s in ss.SCHEDULES
    }
    for key, c in check[method].items():
      r = rows[key.split("/")[0]][key.split("/")[1]]
      assert c["decode_steps_vs_grpo_n4"] == r.decode_steps / ref
      assert c["signal_diff"] == r.signal_fraction - rows[method]["rounds"].signal_fraction
      assert c["meets_goal"] == (
        c["decode_steps_vs_grpo_n4"] <= goal and abs(c["signal_diff"]) <= 0.01
      )
  assert check["ada_pos"]["ada_pos/rounds"]["signal_diff"] == 0.0
  lines = cli.markdown_table(rows)
  assert len(lines) == 2 + 10 and "| grpo_n4 | rounds |" in lines[2] and "1.00×" in lines[2]
  assert next(x for x in lines if x.startswith("| ada_balance | stream |")).endswith("| 2.8× |")
  assert next(x for x in lines if x.startswith("| ada_balance_stop |")).endswith("|  |")


def test_experiment_script_writes_its_results(tmp_path):
  cmd = [
    sys.executable,
    "experiments/simulate_stream.py",
    f"--out_dir={tmp_path}",
    "--num_prompts=128",
    "--batch=64",
    "--slots=64",
    "--budget=256",
    "--median_length=64",
    "--epochs=2",
    "--no_sweep",
  ]
  subprocess.run(cmd, check=True, capture_output=True, timeout=300)

  result = json.loads((tmp_path / "simulate_stream.json").read_text())
  assert result["git_commit"] and result["config"]["slots"] == 64
  rows = result["rows"]["0:0"]
  assert rows["grpo_n4"]["rounds"]["decode_steps_vs_grpo_n4"] == 1.0
  assert {"ada_pos_stop0.05", "ada_balance_stop0.5"} <= set(rows)
  assert set(result["goal_check"]["0:0"]) == {"ada_pos", "ada_balance"}
  assert (tmp_path / "simulate_stream.png").stat().st_size > 0
  assert "2.2×" in (tmp_path / "simulate_stream.md").read_text()
