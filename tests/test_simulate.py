"""The Bernoulli simulator against its closed forms, hand-worked numbers and bad input."""

import numpy as np
import pytest

from ada_jax.rl import simulate as sim
from ada_jax.rl.rules import AdaConfig, SeqConfig


@pytest.fixture(scope="module")
def rates() -> np.ndarray:
  return sim.sample_pass_rates(np.random.default_rng(0), 4096)


def _tolerance(fraction: float, count: int) -> float:
  # Four binomial standard errors of a fraction estimated from `count` prompts.
  return 4 * np.sqrt(fraction * (1 - fraction) / count)


def test_closed_forms_by_hand():
  # p = 1/2: a group of 2 is mixed half the time.
  assert sim.grpo_signal(np.array([0.5]), 2) == pytest.approx(0.5)
  assert sim.grpo_signal(np.array([0.0, 1.0]), 8) == 0.0
  # pos, M=1, R=2, p=1/2: round 2 happens when round 1 failed (1/2): 1 + 1/2 samples;
  # no signal when round 1 succeeds (1/2) or both fail (1/4).
  samples, signal = sim.pos_closed_form(np.array([0.5]), 1, 2)
  assert samples == pytest.approx(1.5)
  assert signal == pytest.approx(0.25)
  assert sim.grpo_n_for_signal(np.array([0.5]), 0.5) == 2
  assert sim.grpo_n_for_signal(np.array([0.0]), 0.1, n_max=16) is None


@pytest.mark.parametrize("n", [4, 16])
def test_grpo_simulation_matches_closed_form(rates, n):
  got = sim.simulate(AdaConfig(method="grpo", n=n), rates, batch=256, epochs=2, seed=3)
  exact = sim.grpo_signal(rates, n)
  assert got.scored_prompts == 4096
  assert got.samples_per_prompt == n
  assert abs(got.signal_fraction - exact) < _tolerance(exact, got.scored_prompts)
  assert got.zero_signal_fraction == pytest.approx(1 - got.signal_fraction)


def test_pos_simulation_matches_closed_form(rates):
  cfg = AdaConfig(method="pos", n=4, seq=SeqConfig(samples_per_round=8, max_rounds=4))
  got = sim.simulate(cfg, rates, batch=256, epochs=2, seed=5)
  samples, signal = sim.pos_closed_form(rates, 8, 4)
  assert abs(got.signal_fraction - signal) < _tolerance(signal, got.scored_prompts)
  assert got.samples_per_prompt == pytest.approx(samples, rel=0.03)
  assert got.active_fraction_per_round[0] == 1.0
  assert got.rows_selected_per_prompt == 4.0


def test_hopeless_prompts_never_carry_signal():
  rates = np.array([0.0, 1.0] * 32)
  for method in ("grpo", "pos", "balance"):
    got = sim.simulate(AdaConfig(method=method), rates, batch=16, epochs=1, warmup_epochs=0)
    assert got.signal_fraction == 0.0, method
  # pos retires always-correct prompts after one round, keeps sampling never-correct ones.
  got = sim.simulate(AdaConfig(method="pos"), rates, batch=16, epochs=1, warmup_epochs=0)
  assert got.samples_per_prompt == pytest.approx((8 + 32) / 2)


def test_adaptive_rows_beat_grpo_n4(rates):
  table = sim.method_table()
  kw = dict(batch=512, epochs=2, seed=1)
  grpo = sim.simulate(table["grpo_n4"], rates, **kw)
  balance = sim.simulate(table["ada_balance"], rates, **kw)
  assert balance.signal_fraction > grpo.signal_fraction + 0.2
  assert balance.samples_per_prompt < 32
  again = sim.simulate(table["ada_balance"], rates, **kw)
  assert again == balance  # deterministic for a seed


def test_trace_step_pools_and_global_advantages():
  cfg = AdaConfig(method="balance", n=4, seq=SeqConfig(samples_per_round=4, max_rounds=3))
  result, rounds = sim.trace_step(cfg, [0.3, 0.0, 1.0], seed=2)
  assert [r.shape[0] for r in rounds] == [3] * len(rounds)
  drawn = [int(np.sum(~np.isnan(r))) for r in rounds]
  assert tuple(drawn) == result.stats.samples_per_round
  for i in range(3):
    pool = np.concatenate([r[i][~np.isnan(r[i])] for r in rounds])
    assert result.stats.pool_size[i] == pool.size
    kept = result.prompt_index == i
    # Global normalization: the baseline is the mean of the WHOLE pool.
    np.testing.assert_allclose(
      result.advantages[kept], result.rewards[kept] - pool.mean(), atol=1e-6
    )
  # Uniform pools (p = 0 or 1) ran all rounds' worth of samples and give zero advantages.
  assert result.stats.pool_size[1] == 12
  assert not np.any(result.advantages[result.prompt_index == 2])


@pytest.mark.parametrize(
  "call, name",
  [
    (lambda r: sim.simulate(AdaConfig(method="grpo"), r, batch=0), "batch"),
    (lambda r: sim.simulate(AdaConfig(method="grpo"), r, batch=65), "batch"),
    (lambda r: sim.simulate(AdaConfig(method="grpo"), r, batch=8, epochs=0), "epochs"),
    (
      lambda r: sim.simulate(AdaConfig(method="grpo"), r, batch=8, epochs=2, warmup_epochs=2),
      "warmup_epochs",
    ),
    (lambda r: sim.simulate(AdaConfig(method="grpo"), r * 2, batch=8), "pass_rates"),
    (lambda r: sim.simulate(AdaConfig(method="grpo"), r[:0], batch=8), "pass_rates"),
    (lambda r: sim.grpo_signal(r, 0), "n"),
    (lambda r: sim.pos_closed_form(r, 8, 0), "max_rounds"),
    (lambda r: sim.pos_closed_form(r, 0, 4), "samples_per_round"),
    (lambda r: sim.sample_pass_rates(np.random.default_rng(0), -1), "size"),
    (lambda r: sim.trace_step(AdaConfig(method="dapo"), r), "cfg"),
    (lambda r: sim.trace_step(AdaConfig(method="ppo"), r), "AdaConfig.method"),
    (lambda r: sim.method_table(n=8, samples_per_round=2, max_rounds=2), "AdaConfig.seq"),
    (lambda r: sim.method_table(n=3), "AdaConfig.n"),  # balance's halves
  ],
)
def test_bad_arguments_are_named(call, name):
  rates = np.linspace(0.05, 0.95, 64)
  with pytest.raises(ValueError, match=rf"^{name}\b"):
    call(rates)


def test_first_round_pass_rate_is_unbiased_for_every_method(rates):
  # The first-round pass rate matches the prompts' true mean pass rate within sampling
  # error for every method; the pool pass rate (every response drawn) reads high for
  # pos, which stops sampling a prompt at its first success.
  table = sim.method_table()
  assert {"grpo_n8", "ada_est_k8", "ada_est_paper_k8"} <= set(table)
  for i, (name, cfg) in enumerate(table.items()):
    got = sim.simulate(cfg, rates, batch=256, epochs=3, seed=20 + i)
    err = got.first_round_pass_rate - got.true_pass_rate
    assert abs(err) < 4 * got.first_round_pass_rate_se + 1e-9, (name, err)
    assert got.first_round_pass_rate_se < 0.01, name
    if name == "ada_pos":
      assert got.pool_pass_rate - got.true_pass_rate > 4 * got.pool_pass_rate_se, name
    if name.startswith("grpo"):  # one round: the two measures are the same responses
      assert got.pool_pass_rate == pytest.approx(got.first_round_pass_rate)
