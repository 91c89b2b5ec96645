"""Tests for the Reinforce-Ada sampling methods under `rounds` (ada_jax.rl.rules, the
controller, ada_jax.rl.advantages).

Hand-worked cases from docs/design.md "Algorithm" with scripted reward streams, then hypothesis
property tests on random reward streams.
"""

import dataclasses
import io
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ada_jax.rl import advantages as adv_lib
from ada_jax.rl import estimate, pools, rules
from ada_jax.rl.rules import AdaConfig, DapoConfig, EstConfig, SeqConfig
from ada_jax.testing import rounds_step


class Scripted:
  """A draw callable that serves each prompt's rewards from a fixed stream, in order.

  Handles are (prompt index, position in that prompt's stream), so tests can tell which
  responses were kept. Records every call's rows.
  """

  def __init__(self, streams):
    self.streams = {p: list(s) for p, s in enumerate(streams)}
    self.used = {p: 0 for p in self.streams}
    self.calls = []

  def __call__(self, rows):
    self.calls.append(np.asarray(rows).copy())
    rewards, handles = [], []
    for p in np.asarray(rows).tolist():
      k = self.used[p]
      rewards.append(self.streams[p][k])
      handles.append((p, k))
      self.used[p] = k + 1
    return np.asarray(rewards, np.float32), handles

  def add(self, streams):
    for s in streams:
      self.streams[len(self.streams)] = list(s)
      self.used[len(self.used)] = 0


def _rng():
  return np.random.default_rng(0)


def _ids(b):
  return [f"q{i}" for i in range(b)]


def _group(result, p):
  sel = result.prompt_index == p
  return (
    result.rewards[sel],
    result.advantages[sel],
    [h for h, s in zip(result.handles, sel, strict=True) if s],
  )


# --- Hand-worked cases ----------------------------------------------------------------


@pytest.mark.parametrize("method", ["pos", "balance"])
def test_two_of_eight_keeps_two_and_two_with_global_advantages(method):
  draw = Scripted([[1, 0, 0, 1, 0, 0, 0, 0] + [0] * 24])
  res, _ = rounds_step(AdaConfig(method=method), _ids(1), draw, _rng())
  rewards, advs, handles = _group(res, 0)
  np.testing.assert_array_equal(rewards, [1, 1, 0, 0])
  np.testing.assert_allclose(advs, [0.75, 0.75, -0.25, -0.25], atol=1e-7)
  assert handles == [(0, 0), (0, 3), (0, 1), (0, 2)]  # earliest of each class
  assert res.stats.samples_per_round == (8,)  # exits after the first round
  assert res.stats.pool_pass_rate[0] == pytest.approx(0.25)


def test_one_positive_in_eight_keeps_it_with_three_negatives():
  draw = Scripted([[0, 0, 0, 0, 0, 1, 0, 0] + [0] * 24])
  res, _ = rounds_step(AdaConfig(method="pos"), _ids(1), draw, _rng())
  rewards, advs, _ = _group(res, 0)
  np.testing.assert_array_equal(rewards, [1, 0, 0, 0])
  np.testing.assert_allclose(advs, [0.875, -0.125, -0.125, -0.125], atol=1e-7)
  # balance needs a second positive; with one round only it keeps the 1 + 3 it has.
  draw = Scripted([[0, 0, 0, 0, 0, 1, 0, 0]])
  res, _ = rounds_step(
    AdaConfig(method="balance", seq=SeqConfig(max_rounds=1)), _ids(1), draw, _rng()
  )
  np.testing.assert_array_equal(_group(res, 0)[0], [1, 0, 0, 0])


@pytest.mark.parametrize("method", ["pos", "balance"])
@pytest.mark.parametrize("opts", [{}, {"std_normalize": True, "inverse_p_weight": "1/p"}])
def test_all_negative_pool_after_r_rounds_gives_n_zero_advantages(method, opts):
  draw = Scripted([[0] * 32])
  res, _ = rounds_step(AdaConfig(method=method, **opts), _ids(1), draw, _rng())
  rewards, advs, _ = _group(res, 0)
  assert res.stats.samples_per_round == (8, 8, 8, 8)
  assert rewards.shape == (4,) and not rewards.any()
  assert np.all(advs == 0) and np.all(np.isfinite(advs))
  assert res.stats.zero_signal_fraction == 1.0 and res.stats.signal_fraction == 0.0


def test_pos_retires_after_first_round_containing_a_positive():
  streams = [
    [0] * 8 + [0, 0, 0, 0, 0, 0, 1, 0] + [1] * 16,  # first positive in round 2
    [0, 1] + [0] * 30,  # first positive in round 1
    [0] * 16 + [0] * 7 + [1] + [1] * 8,  # first positive in round 3
  ]
  draw = Scripted(streams)
  res, _ = rounds_step(AdaConfig(method="pos"), _ids(3), draw, _rng())
  assert res.stats.active_per_round == (3, 2, 1)
  assert res.stats.samples_per_round == (24, 16, 8)
  np.testing.assert_array_equal(res.stats.pool_size, [16, 8, 24])
  # Rows of a prompt are contiguous in each call (the sampler shares their prefill).
  np.testing.assert_array_equal(draw.calls[1], [0] * 8 + [2] * 8)
  for p in range(3):
    np.testing.assert_array_equal(_group(res, p)[0], [1, 0, 0, 0])
  metrics = res.stats.as_metrics()
  assert metrics["ada/samples_r2"] == 16 and metrics["ada/samples_r3"] == 8
  assert metrics["ada/samples_per_prompt"] == 16 and metrics["ada/rows_selected"] == 12


@pytest.mark.parametrize("method", ["pos", "balance"])
def test_seq_batch_in_exit_order_as_released_or_in_prompt_order(method):
  """4 prompts, M = 4, R = 2, n = 2: prompt 0 never exits, 1 exits in round 2, 2 and 3 in
  round 1. Released verl concatenates groups as prompts exit (never-exited last) and cuts
  contiguous mini-batches: with 2 prompts per mini-batch the first update holds prompts
  2 and 3 (all signal), the second 1 and 0 (prompt 0 uniform: zero advantage)."""
  streams = [
    [0] * 8,  # never a positive: never exits, zero advantage
    [0, 0, 0, 0, 1, 0, 0, 0],  # exits in round 2 (both rules need a positive)
    [1, 0, 0, 0] + [0] * 4,  # round 1
    [0, 1, 0, 0] + [0] * 4,  # round 1
  ]
  seq = SeqConfig(samples_per_round=4, max_rounds=2)
  exit_res, _ = rounds_step(AdaConfig(method, n=2, seq=seq), _ids(4), Scripted(streams), _rng())
  np.testing.assert_array_equal(exit_res.prompt_index, [2, 2, 3, 3, 1, 1, 0, 0])
  prompt_res, _ = rounds_step(
    AdaConfig(method, n=2, seq=dataclasses.replace(seq, batch_order="prompt")),
    _ids(4),
    Scripted(streams),
    _rng(),
  )
  np.testing.assert_array_equal(prompt_res.prompt_index, [0, 0, 1, 1, 2, 2, 3, 3])
  # The same groups, handles and advantages either way, only laid out differently.
  for p in range(4):
    for a, b in zip(_group(exit_res, p), _group(prompt_res, p), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Per-mini-batch share of rows with a non-zero advantage (2 mini-batches of 4 rows).
  share = lambda r: [float(np.mean(r.advantages[i : i + 4] != 0)) for i in (0, 4)]
  assert share(exit_res) == [1.0, 0.5] and share(prompt_res) == [0.5, 1.0]


def test_batch_order_ties_keep_prompt_order_and_never_exited_go_last():
  assert pools.batch_order("exit", [None, 2, 1, 1]) == [2, 3, 1, 0]
  assert pools.batch_order("exit", [3, None, 0, None, 0]) == [2, 4, 0, 1, 3]
  assert pools.batch_order("exit", [None, None]) == [0, 1]
  assert pools.batch_order("prompt", [None, 2, 1, 1]) == [0, 1, 2, 3]
  with pytest.raises(ValueError, match="SeqConfig.batch_order"):
    SeqConfig(batch_order="shuffled")


def test_pos_all_positive_first_round_exits_with_zero_signal():
  draw = Scripted([[1] * 32])
  res, _ = rounds_step(AdaConfig(method="pos"), _ids(1), draw, _rng())
  assert res.stats.samples_per_round == (8,)
  assert np.all(_group(res, 0)[1] == 0)


def test_balance_n4_needs_two_positives_and_two_negatives():
  assert rules.thresholds(AdaConfig(method="balance", n=4)) == (2, 2)
  assert rules.thresholds(AdaConfig(method="pos", n=4)) == (1, 0)
  streams = [
    [1] + [0] * 7 + [0, 0, 1, 0, 0, 0, 0, 0] + [0] * 16,  # 1 pos in r1, 2nd in r2
    [1] * 8 + [1] * 7 + [0] + [0] + [1] * 7 + [1] * 8,  # 1 neg in r2, 2nd in r3
    [1, 1, 0, 0, 1, 1, 1, 1] + [1] * 24,  # 2 + 2 in r1
  ]
  draw = Scripted(streams)
  res, _ = rounds_step(AdaConfig(method="balance"), _ids(3), draw, _rng())
  np.testing.assert_array_equal(res.stats.pool_size, [16, 24, 8])
  assert res.stats.active_per_round == (3, 2, 1)
  r1, a1, _ = _group(res, 1)
  np.testing.assert_array_equal(r1, [1, 1, 0, 0])
  np.testing.assert_allclose(a1, [2 / 24, 2 / 24, -22 / 24, -22 / 24], atol=1e-6)


def test_grpo_local_mean_and_std_option():
  draw = Scripted([[1, 0, 0, 0], [1, 1, 1, 1]])
  res, _ = rounds_step(AdaConfig(method="grpo"), _ids(2), draw, _rng())
  np.testing.assert_allclose(_group(res, 0)[1], [0.75, -0.25, -0.25, -0.25])
  assert np.all(_group(res, 1)[1] == 0)
  assert res.stats.zero_signal_fraction == 0.5
  draw = Scripted([[1, 0, 0, 0]])
  res, _ = rounds_step(AdaConfig(method="grpo", std_normalize=True), _ids(1), draw, _rng())
  # verl: mean 1/4, torch.std (Bessel) = sqrt(0.75 / 3) = 1/2, + 1e-6.
  np.testing.assert_allclose(_group(res, 0)[1], [1.5, -0.5, -0.5, -0.5], rtol=1e-5)
  np.testing.assert_allclose(
    _group(res, 0)[1], np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6), rtol=1e-7
  )


@pytest.mark.parametrize("method", ["grpo", "dapo"])
def test_shipped_grpo_configs_are_the_released_baselines(method):
  from ada_jax import config as config_lib
  from configs import common, llama3b_grpo, qwen_math7b_grpo, qwen_math15b_grpo, tiny_arith_grpo

  for module in (tiny_arith_grpo, llama3b_grpo, qwen_math7b_grpo, qwen_math15b_grpo):
    c = module.get_config()
    c.ada.method = method
    cfg = config_lib.parse(c)
    assert cfg.ada.std_normalize and cfg.loss.dual_clip == 3.0
    assert cfg.optim.weight_decay == 0.01 and cfg.optim.warmup_steps == 0
  draw = Scripted([[1, 0, 0, 0]])
  res, _ = rounds_step(cfg.ada, _ids(1), draw, _rng())
  np.testing.assert_allclose(res.advantages, [1.5, -0.5, -0.5, -0.5], rtol=1e-5)
  # The Dr.GRPO-style variant stays one override away.
  c = common.released_baseline(tiny_arith_grpo.get_config(), method)
  c.ada.std_normalize = False
  res, _ = rounds_step(config_lib.parse(c).ada, _ids(1), Scripted([[1, 0, 0, 0]]), _rng())
  np.testing.assert_allclose(res.advantages, [0.75, -0.25, -0.25, -0.25], rtol=1e-6)


@pytest.mark.parametrize("std_normalize", [False, True])
def test_a_single_sample_has_group_mean_zero(std_normalize):
  # verl: a prompt with one response has mean 0 and std 1, so A = r (Est's lone samples).
  for r in (1.0, 0.0):
    a = adv_lib.group_advantages(np.array([r]), np.array([r]), std_normalize=std_normalize)
    np.testing.assert_allclose(a, [r], rtol=1e-5)


def test_advantage_options_on_two_of_eight():
  pool = np.array([1, 0, 0, 1, 0, 0, 0, 0], np.float32)
  sel = np.array([1, 1, 0, 0], np.float32)
  np.testing.assert_allclose(
    adv_lib.group_advantages(sel, pool, p_weight="1/p"), [3, 3, -1, -1], rtol=1e-6
  )
  np.testing.assert_allclose(
    adv_lib.group_advantages(sel, pool, p_weight="1/sqrt_p"), [1.5, 1.5, -0.5, -0.5], rtol=1e-6
  )  # f'(p) = p^-0.5 = 2 at p = 1/4 (the paper's 1/sqrt(p̄))
  np.testing.assert_allclose(
    adv_lib.group_advantages(sel, pool, p_weight=0.5), [1.5, 1.5, -0.5, -0.5], rtol=1e-6
  )
  np.testing.assert_allclose(
    adv_lib.group_advantages(sel, pool, baseline="local"), [0.5, 0.5, -0.5, -0.5]
  )
  std = np.std(pool, ddof=1)
  np.testing.assert_allclose(
    adv_lib.group_advantages(sel, pool, std_normalize=True),
    np.array([0.75, 0.75, -0.25, -0.25]) / (std + 1e-6),
    rtol=1e-6,
  )
  with pytest.raises(ValueError, match="baseline"):
    adv_lib.group_advantages(sel, pool, baseline="median")


def test_dapo_drops_uniform_groups_and_draws_more_prompts():
  draw = Scripted([[0, 0, 0, 0], [1, 0, 1, 0]])
  asked = []

  def more_prompts(k):
    asked.append(k)
    draw.add([[1, 1, 1, 1], [0, 1, 0, 0]])
    return [f"extra{len(asked)}a", f"extra{len(asked)}b"]

  res, _ = rounds_step(AdaConfig(method="dapo"), _ids(2), draw, _rng(), more_prompts=more_prompts)
  assert asked == [2]  # one extra pass collects the second mixed group
  assert res.prompt_ids == ("q0", "q1", "extra1a", "extra1b")
  np.testing.assert_array_equal(res.prompt_index, [1] * 4 + [3] * 4)
  np.testing.assert_allclose(_group(res, 3)[1], [-0.25, 0.75, -0.25, -0.25])
  assert res.stats.samples_per_round == (8, 8)
  assert res.stats.signal_fraction == 1.0 and res.stats.zero_signal_fraction == 0.0


def test_dapo_stops_at_the_cap_of_extra_passes():
  draw = Scripted([[0] * 4])
  calls = []

  def more_prompts(k):
    calls.append(k)
    draw.add([[1] * 4])
    return ["x"]

  cfg = AdaConfig(method="dapo", dapo=DapoConfig(max_extra_passes=2))
  res, _ = rounds_step(cfg, _ids(1), draw, _rng(), more_prompts=more_prompts)
  assert len(calls) == 2 and res.stats.samples_per_round == (4, 4, 4)
  assert res.rewards.size == 0 and res.stats.signal_fraction == 0.0
  res, _ = rounds_step(cfg, _ids(1), Scripted([[0] * 4]), _rng())  # no source: one pass
  assert res.stats.samples_per_round == (4,)


def test_draw_with_wrong_answer_size_fails_clearly():
  bad = lambda rows: (np.zeros(rows.size - 1, np.float32), [None] * rows.size)
  with pytest.raises(ValueError, match="draw returned rewards"):
    rounds_step(AdaConfig(method="grpo"), _ids(2), bad, _rng())


def test_random_selection_is_deterministic_per_seed():
  stream = [[1, 0, 1, 0, 1, 0, 1, 0] + [0] * 24]
  cfg = AdaConfig(method="pos", seq=SeqConfig(selection="random"))
  a, _ = rounds_step(cfg, _ids(1), Scripted(stream), np.random.default_rng(3))
  b, _ = rounds_step(cfg, _ids(1), Scripted(stream), np.random.default_rng(3))
  assert a.handles == b.handles
  np.testing.assert_array_equal(a.rewards, [1, 1, 0, 0])


# --- Reinforce-Ada-Est ----------------------------------------------------------------


def test_allocation_hand_cases():
  # Released: one each, the other 8 - 2 = 6 by weight: 6 * [1/6, 5/6] = [1, 5] -> [2, 6].
  np.testing.assert_array_equal(estimate.allocate_budget(np.array([21 / 5, 21]), 8), [2, 6])
  # One factor for all, floor 1 (the clipped rule) gives [1.33, 6.67] -> [1, 7] instead.
  np.testing.assert_array_equal(
    estimate.allocate_budget(np.array([21 / 5, 21]), 8, split="clipped"), [1, 7]
  )
  # 1 + 5 * [1/4, 1/4, 1/2] = [2.25, 2.25, 3.5] -> [2, 2, 3], the leftover to the 0.5.
  np.testing.assert_array_equal(estimate.allocate_budget(np.array([1.0, 1, 2]), 8), [2, 2, 4])
  # Equal fractional parts: the leftover goes to the lower index.
  np.testing.assert_array_equal(estimate.allocate_budget(np.array([1.0, 1, 1]), 10), [4, 3, 3])
  # 1 + 8 * [1/101, 100/101] = [1.08, 8.92] -> [1, 9].
  np.testing.assert_array_equal(estimate.allocate_budget(np.array([1.0, 100]), 10), [1, 9])
  # Clipping at n_max moves the surplus to the other prompts.
  np.testing.assert_array_equal(
    estimate.allocate_budget(np.array([1.0, 1, 100]), 12, 1, 6, "clipped"), [3, 3, 6]
  )
  np.testing.assert_array_equal(
    estimate.allocate_budget(np.array([1.0, 50, 100]), 12, 2, 6, "clipped"), [2, 4, 6]
  )
  with pytest.raises(ValueError, match="cannot be split"):
    estimate.allocate_budget(np.ones(3), 2)
  with pytest.raises(ValueError, match="cannot be split"):
    estimate.allocate_budget(np.ones(3), 20, 1, 6, "clipped")
  with pytest.raises(ValueError, match="no per-prompt maximum"):
    estimate.allocate_budget(np.ones(3), 6, 1, 6)
  with pytest.raises(ValueError, match="split"):
    estimate.allocate_budget(np.ones(3), 6, split="even")


@settings(max_examples=150, deadline=None)
@given(
  w=st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=40),
  n_min=st.integers(0, 3),
  extra=st.integers(0, 200),
  n_max_extra=st.one_of(st.none(), st.integers(0, 20)),
)
def test_allocation_sums_to_budget_within_bounds(w, n_min, extra, n_max_extra):
  w = np.asarray(w)
  n_max = None if n_max_extra is None else n_min + n_max_extra
  budget = w.size * n_min + (extra if n_max is None else min(extra, w.size * (n_max - n_min)))
  counts = estimate.allocate_budget(w, budget, n_min, n_max, "clipped")
  if n_max is None:
    released = estimate.allocate_budget(w, budget, n_min)
    assert released.sum() == budget and released.min() >= n_min
    # Largest remainder: each count is its exact share rounded down or up.
    share = n_min + (budget - w.size * n_min) * w / w.sum()
    assert np.all(np.abs(released - share) < 1 + 1e-9)
    heavier = w[:, None] > w[None, :]
    assert np.all(released[:, None] >= released[None, :], where=heavier)
  assert counts.sum() == budget
  assert counts.min() >= n_min and (n_max is None or counts.max() <= n_max)
  # A strictly larger weight never gets fewer samples (equal weights may differ by one).
  heavier = w[:, None] > w[None, :]
  assert np.all(counts[:, None] >= counts[None, :], where=heavier)


def test_est_state_updates_and_steers_the_budget():
  cfg = AdaConfig(method="est", est=EstConfig(budget_per_prompt=4))
  ids = ["easy", "hard"]
  res, state = rounds_step(cfg, ids, Scripted([[1, 1, 1, 1], [0, 0, 0, 0]]), _rng())
  assert res.stats.samples_per_round == (8,)  # unseen prompts share the prior: 4 + 4
  assert res.stats.rows_selected == res.rewards.size == 8
  keys = estimate.prompt_keys(ids)
  np.testing.assert_allclose(
    estimate.est_pass_rates(state, keys, 1.0, 16.0), [5 / 21, 1 / 21], rtol=1e-12
  )
  # Released rule w = 1/p̂: weights 21/5 and 21, budget 8: 1 each, then 6 * [1/6, 5/6].
  draw = Scripted([[1] * 8, [0, 0, 0, 0, 0, 1, 0, 0]])
  res, state = rounds_step(cfg, ids, draw, _rng(), method_state=state)
  np.testing.assert_array_equal(res.stats.pool_size, [2, 6])
  # Decayed counts: pos 0.9*4 + 2 = 5.6, tot 0.9*4 + 2 = 5.6 for "easy".
  i = int(np.flatnonzero(state["keys"] == keys[0])[0])
  assert state["pos"][i] == pytest.approx(5.6) and state["tot"][i] == pytest.approx(5.6)
  # All samples are trained on, against their prompt's mean.
  np.testing.assert_allclose(_group(res, 1)[1], np.array([0] * 5 + [1]) - 1 / 6, atol=1e-6)
  assert not np.any(_group(res, 0)[1])
  # The state is plain arrays: it survives an npz round trip unchanged.
  buf = io.BytesIO()
  np.savez(buf, **state)
  buf.seek(0)
  loaded = dict(np.load(buf))
  for k in state:
    np.testing.assert_array_equal(loaded[k], state[k])


def test_est_released_defaults_and_single_sample_advantage():
  cfg = AdaConfig(method="est")
  assert (cfg.est.budget_per_prompt, cfg.est.weight, cfg.est.split) == (8.0, "1/p", "released")
  grpo = AdaConfig(method="grpo", n=8)
  assert rules.RULES["est"].train_rows(cfg, 64) == 512 == rules.RULES["grpo"].train_rows(grpo, 64)
  # p̂ = 41/57 (easy) vs 1/17 (unseen): weights 1.39 and 17, budget 16: 1 each, then
  # 14 * [0.076, 0.924] = [1.06, 12.94] -> [2, 13], the leftover to the 0.94 -> [2, 14].
  state = estimate.update_est_state(
    estimate.init_est_state(), estimate.prompt_keys(["e"]), np.array([40.0]), np.array([40.0]), 1.0
  )
  res, _ = rounds_step(cfg, ["e", "new"], Scripted([[1] * 2, [0] * 14]), _rng(), method_state=state)
  np.testing.assert_array_equal(res.stats.pool_size, [2, 14])
  # Budget 3 over 3 prompts: one sample each; a lone sample's advantage is its reward.
  cfg = AdaConfig(method="est", est=EstConfig(budget_per_prompt=1))
  res, _ = rounds_step(cfg, _ids(3), Scripted([[1], [0], [1]]), _rng())
  np.testing.assert_array_equal(res.stats.pool_size, [1, 1, 1])
  np.testing.assert_allclose(res.advantages, [1.0, 0.0, 1.0])
  assert res.stats.zero_signal_fraction == pytest.approx(1 / 3)


def test_est_paper_variant_clips_and_weights():
  assert rules.RULES["est"].train_rows(AdaConfig(method="est", **estimate.EST_PAPER), 10) == 80
  cfg = AdaConfig(
    method="est",
    est=EstConfig(weight="1/sqrt_p", split="clipped", n_min=2, n_max=6, budget_per_prompt=4),
    inverse_p_weight="1/sqrt_p",
  )
  state = estimate.update_est_state(
    estimate.init_est_state(),
    estimate.prompt_keys(["a", "b", "c"]),
    np.array([40.0, 0, 20]),
    np.array([40.0, 40, 40]),
    1.0,
  )
  streams = [[1] * 6, [0] * 5 + [1], [1, 0] * 3]
  res, _ = rounds_step(cfg, ["a", "b", "c"], Scripted(streams), _rng(), method_state=state)
  assert res.stats.pool_size.sum() == 12
  assert res.stats.pool_size.min() >= 2 and res.stats.pool_size.max() <= 6
  assert res.stats.pool_size[1] == 6  # hardest prompt hits the cap
  p = res.stats.pool_pass_rate
  r, a, _ = _group(res, 2)
  np.testing.assert_allclose(a, (r - p[2]) / np.sqrt(p[2]), rtol=1e-5)


# --- Config validation ----------------------------------------------------------------


@pytest.mark.parametrize(
  "cls, kwargs, field",
  [
    (AdaConfig, {"method": ""}, "method"),
    (AdaConfig, {"schedule": "async"}, "schedule"),
    (AdaConfig, {"n": 1}, "n"),
    (AdaConfig, {"baseline": "median"}, "baseline"),
    (AdaConfig, {"inverse_p_weight": "1/p2"}, "inverse_p_weight"),
    (AdaConfig, {"inverse_p_weight": -0.1}, "inverse_p_weight"),
    (AdaConfig, {"seq": EstConfig()}, "seq"),
    (SeqConfig, {"samples_per_round": 0}, "samples_per_round"),
    (SeqConfig, {"max_rounds": 0}, "max_rounds"),
    (SeqConfig, {"k_pos": -1}, "k_pos"),
    (SeqConfig, {"k_neg": -2}, "k_neg"),
    (SeqConfig, {"selection": "best"}, "selection"),
    (SeqConfig, {"min_exit_chance": 1.0}, "min_exit_chance"),
    (EstConfig, {"decay": 1.5}, "decay"),
    (EstConfig, {"weight": "p"}, "weight"),
    (EstConfig, {"weight": 1.5}, "weight"),
    (EstConfig, {"estimator": "value"}, "estimator"),
    (EstConfig, {"p_min": 0.0}, "p_min"),
    (EstConfig, {"head_lr": 0.0}, "head_lr"),
    (EstConfig, {"head_steps": -1}, "head_steps"),
    (EstConfig, {"n_min": 0}, "n_min"),
    (EstConfig, {"n_max": 2, "split": "clipped"}, "n_max"),
    (EstConfig, {"n_max": 16}, "n_max"),
    (EstConfig, {"split": "even"}, "split"),
    (EstConfig, {"alpha": 0.0}, "alpha"),
    (EstConfig, {"beta": -1.0}, "beta"),
    (DapoConfig, {"max_extra_passes": -1}, "max_extra_passes"),
    (DapoConfig, {"prompts_per_pass": 0}, "prompts_per_pass"),
  ],
)
def test_malformed_config_fails_naming_the_field(cls, kwargs, field):
  """AdaConfig and each method's own group (EstConfig, DapoConfig) name the bad field."""
  with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}="):
    cls(**kwargs)


@pytest.mark.parametrize(
  "kwargs, field",
  [
    ({"method": "ppo"}, "method"),
    ({"method": "balance", "n": 5}, "n"),
    ({"method": "pos", "n": 4, "seq": SeqConfig(samples_per_round=2)}, "seq.samples_per_round"),
    ({"method": "balance", "seq": SeqConfig(k_pos=0, k_neg=0)}, "seq.k_pos"),
    ({"method": "grpo", "seq": SeqConfig(min_exit_chance=0.1)}, "seq.min_exit_chance"),
    ({"method": "est", "seq": SeqConfig(min_exit_chance=0.1)}, "seq.min_exit_chance"),
  ],
)
def test_a_rule_refuses_settings_it_cannot_run_naming_the_field(kwargs, field):
  """Fields valid one by one that the method cannot run together: refused by its rule
  (`rules.rule_for`) when the controller starts, naming the field's path."""
  config = AdaConfig(**kwargs)
  with pytest.raises(ValueError, match=rf"AdaConfig\.{re.escape(field)}="):
    rules.rule_for(config)
  with pytest.raises(ValueError, match=rf"AdaConfig\.{re.escape(field)}="):
    rounds_step(config, _ids(1), Scripted([[1.0] * 64]), _rng())


def test_odd_n_balance_is_fine_with_explicit_thresholds():
  cfg = AdaConfig(method="balance", n=5, seq=SeqConfig(k_pos=2, k_neg=3))
  assert rules.thresholds(cfg) == (2, 3)


# --- Properties on random reward streams ----------------------------------------------


@st.composite
def seq_case(draw):
  method = draw(st.sampled_from(["pos", "balance", "grpo"]))
  n = draw(st.sampled_from([2, 4, 6]))
  m = draw(st.integers(n, n + 6))
  r = draw(st.integers(1, 4))
  b = draw(st.integers(1, 5))
  kind = st.sampled_from(["zeros", "ones", "coin", "rare", "common"])
  streams = []
  for _ in range(b):
    k = draw(kind)
    size = max(m * r, n)
    if k in ("zeros", "ones"):
      streams.append([float(k == "ones")] * size)
    else:
      p = {"coin": 0.5, "rare": 0.08, "common": 0.92}[k]
      seed = draw(st.integers(0, 2**31))
      streams.append((np.random.default_rng(seed).random(size) < p).astype(float).tolist())
  opts = draw(
    st.fixed_dictionaries(
      {
        "std_normalize": st.booleans(),
        "inverse_p_weight": st.sampled_from(["none", "1/p", "1/sqrt_p", 0.25, "0.75"]),
        "baseline": st.sampled_from(["global", "local"]),
      }
    )
  )
  cfg = AdaConfig(method=method, n=n, **opts, seq=SeqConfig(samples_per_round=m, max_rounds=r))
  return cfg, streams


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq_case())
def test_seq_and_grpo_properties(case):
  cfg, streams = case
  draw = Scripted(streams)
  res, _ = rounds_step(cfg, _ids(len(streams)), draw, _rng())
  k_pos, k_neg = rules.thresholds(cfg)
  for p, stream in enumerate(streams):
    drawn = draw.used[p]
    pool = np.asarray(stream[:drawn])
    rewards, advs, handles = _group(res, p)
    assert rewards.size == cfg.n  # groups are always of size n
    assert all(h[0] == p and h[1] < drawn for h in handles) and len(set(handles)) == cfg.n
    pool_mixed = 0 < pool.sum() < pool.size
    if pool_mixed:
      assert 0 < rewards.sum() < rewards.size  # mixed whenever the pool is mixed
    assert np.all(advs == 0) == (not pool_mixed)  # zero exactly when the pool is uniform
    assert np.all(np.isfinite(advs))
    if cfg.method == "grpo":
      assert drawn == cfg.n
      continue
    m = cfg.seq.samples_per_round
    assert drawn <= cfg.seq.max_rounds * m and drawn % m == 0
    # The prompt stopped at the first round whose pool met the exit rule.
    met = [
      (stream[: j * m].count(1.0) >= k_pos and stream[: j * m].count(0.0) >= k_neg)
      for j in range(1, cfg.seq.max_rounds + 1)
    ]
    expected_rounds = met.index(True) + 1 if any(met) else cfg.seq.max_rounds
    assert drawn == expected_rounds * m
  assert res.stats.rows_requested == sum(draw.used.values())
  assert sum(res.stats.samples_per_round) == res.stats.rows_requested


@settings(max_examples=60, deadline=None)
@given(
  b=st.integers(1, 6),
  k=st.sampled_from([1.0, 2.5, 4.0]),
  seed=st.integers(0, 2**31),
  steps=st.integers(1, 3),
)
def test_est_properties(b, k, seed, steps):
  cfg = AdaConfig(method="est", est=EstConfig(budget_per_prompt=k))
  gen = np.random.default_rng(seed)
  p_true = gen.choice([0.0, 1.0, 0.1, 0.5], size=b)
  draw = lambda rows: ((gen.random(rows.size) < p_true[rows]).astype(np.float32), list(rows))
  state = None
  for _ in range(steps):
    res, state = rounds_step(cfg, _ids(b), draw, _rng(), method_state=state)
    assert res.stats.rows_requested == int(round(k * b)) == res.rewards.size
    assert res.stats.pool_size.min() >= 1
    for p in range(b):
      rewards, advs, _ = _group(res, p)
      if rewards.size == 1:  # verl's lone sample: mean 0, A = r
        np.testing.assert_array_equal(advs, rewards)
      else:
        assert np.all(advs == 0) == (rewards.min() == rewards.max())
  assert np.all(np.diff(state["keys"]) > 0)


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 5), seed=st.integers(0, 2**31), cap=st.integers(0, 3))
def test_dapo_properties(b, seed, cap):
  gen = np.random.default_rng(seed)
  rates = list(gen.choice([0.0, 1.0, 0.3], size=b))

  def more(k):
    rates.extend(gen.choice([0.0, 1.0, 0.3], size=k))
    return [f"x{len(rates) - k + i}" for i in range(k)]

  def draw(rows):
    return (gen.random(rows.size) < np.asarray(rates)[rows]).astype(np.float32), list(rows)

  cfg = AdaConfig(method="dapo", dapo=DapoConfig(max_extra_passes=cap))
  res, _ = rounds_step(cfg, _ids(b), draw, _rng(), more_prompts=more)
  groups = np.unique(res.prompt_index)
  assert groups.size <= b and len(res.stats.samples_per_round) <= cap + 1
  for p in groups:
    rewards, advs, _ = _group(res, p)
    assert rewards.size == cfg.n and 0 < rewards.sum() < cfg.n and np.all(advs != 0)


def test_first_round_pass_rate_counts_only_draws_before_any_exit():
  # pos, M = 8: prompt 0 misses in round 1 and hits once in round 2; prompt 1 hits in
  # round 1 and exits. First-round rates 0 and 1/8; pool rates 1/16 and 1/8.
  streams = [[0] * 8 + [1] + [0] * 7, [1] + [0] * 7]
  res, _ = rounds_step(AdaConfig(method="pos"), _ids(2), Scripted(streams), _rng())
  assert res.stats.first_round_pass_rate == pytest.approx((0 + 1 / 8) / 2)
  np.testing.assert_allclose(res.stats.pool_pass_rate, [1 / 16, 1 / 8])
  # Prompt 0's first round is all wrong (later rescued), prompt 1's mixed.
  assert (res.stats.first_round_all_wrong, res.stats.first_round_all_correct) == (1, 0)
  # dapo: only the step's own B prompts count, not the extra ones drawn to fill the batch.
  draw = Scripted([[1, 1, 1, 1], [1, 0, 0, 0]])
  more = lambda k: (draw.add([[0, 0, 0, 0]] * k), [f"x{i}" for i in range(k)])[1]
  cfg = AdaConfig(method="dapo", dapo=DapoConfig(max_extra_passes=1))
  res, _ = rounds_step(cfg, _ids(2), draw, _rng(), more_prompts=more)
  assert len(res.prompt_ids) == 4
  assert res.stats.first_round_pass_rate == pytest.approx((1 + 1 / 4) / 2)
  assert (res.stats.first_round_all_wrong, res.stats.first_round_all_correct) == (0, 1)
  assert res.stats.as_metrics()["ada/first_round_all_correct"] == 1.0
