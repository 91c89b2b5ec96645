"""experiments/comparison_stats.py on cases whose answer is known: the seed-clustered mean
and t interval, slopes, the paired per-step difference and the two-level bootstrap."""

import numpy as np
import pytest

from ada_jax import testing


@pytest.fixture(scope="module")
def cs():
  return testing.load_experiment("comparison_stats")


def test_clustered_mean_is_the_mean_of_seed_means_with_their_spread(cs):
  # Seeds' means 1, 2, 3 (unequal lengths: each seed counts once): mean 2, sd 1, se 1/sqrt(3).
  out = cs.clustered_mean([[1.0], [1.0, 3.0], [3.0, 3.0, 3.0]])
  assert out["mean"] == pytest.approx(2.0)
  assert out["se"] == pytest.approx(1 / np.sqrt(3))
  # t_{0.975, 2} = 4.302653 (tables).
  assert out["high"] - out["mean"] == pytest.approx(4.302653 / np.sqrt(3), rel=1e-5)
  assert np.isnan(cs.clustered_mean([[1.0, 2.0]])["se"])
  with pytest.raises(ValueError, match="each with values"):
    cs.clustered_mean([[1.0], []])


def test_paired_difference_recovers_an_exact_line(cs):
  steps = range(1, 33)
  ref = {s: {t: 0.2 + 0.001 * t for t in steps} for s in range(3)}
  # Per seed, the arm leads by a_s + 0.002 t: the difference's slope is 0.002 on every seed.
  arm = {s: {t: ref[s][t] + 0.01 * s + 0.002 * t for t in steps} for s in range(3)}
  out = cs.paired_step_difference(arm, ref)
  assert out["slope"]["mean"] == pytest.approx(0.002)
  assert out["slope"]["se"] == pytest.approx(0.0, abs=1e-12)
  # Mean difference: 0.01 * mean(s) + 0.002 * mean(t) = 0.01 + 0.033.
  assert out["difference"]["mean"] == pytest.approx(0.043)
  assert out["difference"]["se"] == pytest.approx(0.01 / np.sqrt(3))
  # Steps only one arm has are not compared.
  arm[0][99] = 5.0
  assert cs.paired_step_difference(arm, ref)["difference"]["mean"] == pytest.approx(0.043)
  with pytest.raises(ValueError, match="two or more common steps"):
    cs.paired_step_difference({0: {1: 0.0}}, {0: {1: 0.0}})


def test_heldout_difference_of_a_constant_shift_is_that_shift(cs):
  ids = [f"p{i}" for i in range(50)]
  rng = np.random.default_rng(0)
  ref = {s: {i: int(rng.integers(0, 4)) for i in ids} for s in range(3)}
  arm = {s: {i: c + 1 for i, c in ref[s].items()} for s in range(3)}
  out = cs.heldout_difference(arm, ref, k=4)
  assert out["mean"] == out["low"] == pytest.approx(out["high"]) == pytest.approx(0.25)
  assert (out["seeds"], out["problems"]) == (3, 50)
  assert out["per_seed"][1]["low"] == pytest.approx(0.25)


def test_heldout_difference_is_the_t_interval_of_the_seeds_means(cs):
  # Seed means of the difference 0.1, 0.2, 0.3 (every problem of a seed shifted alike).
  ref = {s: {str(i): 0 for i in range(10)} for s in range(3)}
  arm = {s: {str(i): [0.4, 0.8, 1.2][s] for i in range(10)} for s in range(3)}
  out = cs.heldout_difference(arm, ref, k=4)
  assert out["mean"] == pytest.approx(0.2)
  assert out["se"] == pytest.approx(0.1 / np.sqrt(3))
  assert out["high"] - out["mean"] == pytest.approx(4.302653 * 0.1 / np.sqrt(3), rel=1e-5)


def test_heldout_interval_covers_a_true_zero_at_its_level_with_three_seeds(cs):
  """Seeds shift both arms' difference (sd 0.03) and problems add noise: the t interval over
  3 seeds must hold a true zero in about 95 % of trials (a bootstrap over the seeds held it
  in 84 %)."""
  covered = 0
  trials = 300
  for trial in range(trials):
    rng = np.random.default_rng(trial)
    arm, ref = {}, {}
    for s in range(3):
      shift = rng.normal(0, 0.03)
      p = np.clip(0.3 + shift / 2, 0, 1)
      q = np.clip(0.3 - shift / 2, 0, 1)
      arm[s] = {str(i): int(rng.binomial(4, p)) for i in range(100)}
      ref[s] = {str(i): int(rng.binomial(4, q)) for i in range(100)}
    out = cs.heldout_difference(arm, ref, k=4)
    covered += out["low"] <= 0 <= out["high"]
  assert 0.91 <= covered / trials <= 0.99


def test_bootstrap_over_problems_covers_at_about_its_level(cs):
  # One seed of 400 problems per arm, pass rates 0.3 both: the difference's sd is about
  # sqrt(2 * 0.21 / 4 / 400) with k = 4 samples per problem.
  covered, widths = 0, []
  for trial in range(20):
    rng = np.random.default_rng(trial)
    a = rng.binomial(4, 0.3, 400) / 4
    r = rng.binomial(4, 0.3, 400) / 4
    out = cs.bootstrap_difference(a, r, resamples=400, seed=trial)
    covered += out["low"] <= 0 <= out["high"]
    widths.append(out["high"] - out["low"])
  assert covered >= 16
  assert np.median(widths) == pytest.approx(2 * 1.96 * np.sqrt(2 * 0.21 / 4 / 400), rel=0.2)


def test_heldout_difference_refuses_arms_with_nothing_in_common(cs):
  with pytest.raises(ValueError, match="no seed with a problem"):
    cs.heldout_difference({0: {"a": 1}}, {1: {"a": 1}}, k=4)


def test_detectable_difference_grows_with_the_error_and_shrinks_with_seeds(cs):
  # Normal limit: (1.96 + 0.8416) * se.
  assert cs.detectable_difference(1.0, 10_000) == pytest.approx(2.8016, rel=1e-3)
  assert cs.detectable_difference(1.0, 3) > cs.detectable_difference(1.0, 10)
