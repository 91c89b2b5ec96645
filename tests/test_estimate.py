"""Reinforce-Ada-Est's estimators: the power objective's weights, the learned pass-rate head
(loss, gradient, training, calibration), 'head+ema', and the controller with a head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ada_jax.rl import estimate
from ada_jax.rl import pass_rate_head as head_lib
from ada_jax.rl import simulate as sim
from ada_jax.rl.rules import AdaConfig, EstConfig
from ada_jax.testing import rounds_step

# --- The power objective f(p) = (p^α − 1)/α, f'(p) = p^(α−1) --------------------------


def test_objective_weight_hand_worked():
  # α = 0.5 at p = 0.25: α·p^(α−1) = 0.5 · 0.25^(−0.5) = 1.0; the weight is that / α = 2.0,
  # the paper's explicit 1/sqrt(p̄).
  assert 0.5 * estimate.objective_weight(0.25, 0.5) == pytest.approx(1.0)
  assert estimate.objective_weight(0.25, 0.5) == pytest.approx(2.0)
  assert estimate.objective_weight(0.25, 0.0) == pytest.approx(4.0)  # log: 1/p
  assert estimate.objective_weight(0.04, 0.5) == pytest.approx(5.0)  # 1 / 0.2
  # Continuous in α: the log objective is the limit, not a special case.
  assert estimate.objective_weight(0.25, 1e-9) == pytest.approx(4.0, rel=1e-8)
  np.testing.assert_allclose(estimate.objective_weight([0.1, 0.5, 1.0], 1.0), 1.0)  # f = p
  # p̂ is clipped to [p_min, 1] first: 0 would otherwise take the whole budget.
  assert estimate.objective_weight(0.0, 0.0, p_min=1e-3) == pytest.approx(1e3)
  assert estimate.objective_weight(0.0, 0.5, p_min=0.01) == pytest.approx(10.0)


def test_objective_spellings():
  assert estimate.objective_alpha("1/p") == 0.0
  assert estimate.objective_alpha("1/sqrt_p") == 0.5
  assert estimate.objective_alpha(0.3) == 0.3
  assert estimate.objective_alpha("0.75") == 0.75  # a command-line override is a string
  for bad in ("p", "1/p2", 1.5, -0.1, None, "nan"):
    with pytest.raises(ValueError, match="alpha"):
      estimate.objective_alpha(bad)


@settings(max_examples=100, deadline=None)
@given(
  alpha=st.floats(0.0, 1.0),
  p=st.lists(st.floats(1e-3, 1.0), min_size=2, max_size=12),
)
def test_objective_weight_is_the_derivative_and_non_increasing(alpha, p):
  p = np.sort(np.asarray(p))
  w = estimate.objective_weight(p, alpha)
  want = p ** (alpha - 1)
  np.testing.assert_allclose(w, want, rtol=1e-12)
  assert np.all(np.diff(w) <= 1e-12 * w[:-1])  # harder prompts never weigh less
  # f'(p) is the derivative of f = (p^α − 1)/α (log p at α = 0), by central differences.
  h = 1e-6
  # (below α = 1e-9, f equals log p to 1e-8 relative, and expm1(α·log x)/α underflows)
  f = lambda x: np.log(x) if alpha < 1e-9 else np.expm1(alpha * np.log(x)) / alpha
  inside = p < 1 - h
  np.testing.assert_allclose(w[inside], ((f(p + h) - f(p - h)) / (2 * h))[inside], rtol=1e-4)


@pytest.mark.parametrize("name,alpha", [("1/p", 0.0), ("1/sqrt_p", 0.5)])
def test_named_objectives_allocate_as_their_alpha(name, alpha):
  state = estimate.update_est_state(
    estimate.init_est_state(),
    estimate.prompt_keys(list("abcd")),
    np.array([0.0, 1, 4, 7]),
    np.array([8.0, 8, 8, 8]),
    1.0,
  )
  keys = estimate.prompt_keys(list("abcd"))
  by_name = estimate.plan_budget(
    AdaConfig("est", est=EstConfig(weight=name)), state, keys, 32, None
  )[0]
  by_alpha = estimate.plan_budget(
    AdaConfig("est", est=EstConfig(weight=alpha)), state, keys, 32, None
  )[0]
  np.testing.assert_array_equal(by_name, by_alpha)
  p_hat = estimate.est_pass_rates(state, keys, 1.0, 16.0)
  want = estimate.allocate_budget(estimate.objective_weight(p_hat, alpha), 32)
  np.testing.assert_array_equal(by_name, want)
  assert by_name[0] > by_name[-1]  # the hardest prompt gets the most samples


def test_budget_share_per_band_sums_to_one():
  keys = estimate.prompt_keys(list("abc"))
  state = estimate.update_est_state(
    estimate.init_est_state(), keys, np.array([0.0, 40, 80]), np.array([80.0, 80, 80]), 1.0
  )
  counts, p_head, m = estimate.plan_budget(AdaConfig("est"), state, keys, 24, None)
  assert p_head is None
  shares = {k: v for k, v in m.items() if k.startswith("est/budget_share")}
  assert sum(shares.values()) == pytest.approx(1.0)
  # p̂ = 1/97 (< 0.1), 41/97 (0.3..0.7), 81/97 (0.7..0.9).
  assert shares["est/budget_share_p<0.1"] == pytest.approx(counts[0] / 24)
  assert shares["est/budget_share_p<0.7"] == pytest.approx(counts[1] / 24)
  assert shares["est/budget_share_p<0.9"] == pytest.approx(counts[2] / 24)


def test_head_plus_ema_uses_counts_as_pseudo_counts():
  keys = estimate.prompt_keys(["a", "new"])
  state = estimate.update_est_state(
    estimate.init_est_state(), keys[:1], np.array([3.0]), np.array([5.0]), 1.0
  )
  p = estimate.est_pass_rates(state, keys, 1.0, 16.0, prior=np.array([0.5, 0.3]))
  np.testing.assert_allclose(p, [(17 * 0.5 + 3) / (17 + 5), 0.3])  # unseen: the head's own


# --- The pass-rate head ----------------------------------------------------------------

FEATURES = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], np.float32)
N_POS = np.array([1.0, 0.0, 2.0], np.float32)
N_TOT = np.array([2.0, 2.0, 4.0], np.float32)


def _jnp(params):
  return {k: jnp.asarray(v) for k, v in params.items()}


def test_fresh_head_predicts_the_prior_and_its_loss_and_gradient_by_hand():
  params = head_lib.init_params(2, prior_p=0.25, seed=3)
  np.testing.assert_allclose(head_lib.predict(params, FEATURES), 0.25, rtol=1e-6)
  loss, grads = jax.value_and_grad(head_lib.bce_loss)(
    _jnp(params), *map(jnp.asarray, (FEATURES, N_POS, N_TOT))
  )
  # 3 of 8 responses correct, p = 1/4 for all: −(3 log 1/4 + 5 log 3/4) / 8.
  assert float(loss) == pytest.approx(-(3 * np.log(0.25) + 5 * np.log(0.75)) / 8, rel=1e-6)
  # dL/dz_x = (n_tot_x p − n_pos_x) / N = [−0.5, 0.5, −1] / 8.
  dz = np.array([2 * 0.25 - 1, 2 * 0.25 - 0, 4 * 0.25 - 2]) / 8
  assert float(grads["b2"][0]) == pytest.approx(dz.sum(), rel=1e-6)
  hidden = np.asarray(jax.nn.gelu(FEATURES @ params["w1"] + params["b1"]))
  np.testing.assert_allclose(grads["w2"], dz @ hidden, rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(grads["w1"], 0.0)  # w2 = 0: no path to the first layer yet


def test_head_gradient_matches_finite_differences():
  rng = np.random.default_rng(0)
  params = head_lib.init_params(2, prior_p=0.3, seed=1)
  params["w2"] = rng.standard_normal(head_lib.WIDTH).astype(np.float32) * 0.3
  params["b1"] = rng.standard_normal(head_lib.WIDTH).astype(np.float32) * 0.1
  args = [jnp.asarray(x) for x in (FEATURES, N_POS, N_TOT)]
  grads = jax.grad(head_lib.bce_loss)(_jnp(params), *args)
  loss = lambda p: float(head_lib.bce_loss(_jnp(p), *args))
  for name, index in [("w1", (1, 5)), ("b1", (7,)), ("w2", (3,)), ("b2", (0,))]:
    h = 1e-2  # float32: a step large enough to beat rounding, small for the curvature
    up, down = ({k: v.copy() for k, v in params.items()} for _ in range(2))
    up[name][index] += h
    down[name][index] -= h
    num = (loss(up) - loss(down)) / (2 * h)
    assert float(grads[name][index]) == pytest.approx(num, rel=2e-2, abs=1e-5), name


def test_train_head_learns_a_feature_and_is_deterministic():
  cfg = AdaConfig("est", est=EstConfig(estimator="head"))
  rng = np.random.default_rng(0)
  features = rng.standard_normal((64, 8)).astype(np.float32)
  p_true = 1 / (1 + np.exp(-2 * features[:, 0]))
  n_tot = np.full(64, 8.0)
  n_pos = rng.binomial(8, p_true).astype(np.float64)
  flat = head_lib.head_state({}, 8, cfg)
  first = None
  for _ in range(30):
    flat, loss = head_lib.train_head(flat, features, n_pos, n_tot, lr=1e-2, steps=8)
    first = loss if first is None else first
  assert loss < first - 0.1
  pred = head_lib.predict(head_lib.params_from_state(flat, 8, cfg), features)
  assert np.corrcoef(pred, p_true)[0, 1] > 0.9
  again = head_lib.head_state({}, 8, cfg)
  for _ in range(30):
    again, _ = head_lib.train_head(again, features, n_pos, n_tot, lr=1e-2, steps=8)
  for k in flat:
    np.testing.assert_array_equal(flat[k], again[k])
  frozen, _ = head_lib.train_head(flat, features, n_pos, n_tot, lr=1e-2, steps=0)
  for k in flat:
    np.testing.assert_array_equal(frozen[k], flat[k])
  with pytest.raises(ValueError, match="d_model=8"):
    head_lib.head_state(flat, 16, cfg)


def test_calibration_hand_worked():
  # p = 0.2 with 1 of 4 correct, p = 0.8 with 3 of 4.
  m = head_lib.calibration(np.array([0.2, 0.8]), np.array([1.0, 3]), np.array([4.0, 4]))
  assert m["brier"] == pytest.approx((0.64 + 3 * 0.04 + 3 * 0.04 + 0.64) / 8)
  assert m["ece"] == pytest.approx((abs(1 - 0.8) + abs(3 - 3.2)) / 8)
  perfect = head_lib.calibration(np.array([0.5]), np.array([2.0]), np.array([4.0]))
  assert perfect["ece"] == 0.0 and perfect["brier"] == pytest.approx(0.25)


# --- The controller with a head --------------------------------------------------------


def _draw(rates, rng):
  def draw(rows):
    return (rng.random(rows.size) < np.asarray(rates)[rows]).astype(np.float32), [None] * rows.size

  return draw


@pytest.mark.parametrize("estimator", ["head", "head+ema"])
def test_run_step_with_a_head(estimator):
  cfg = AdaConfig("est", est=EstConfig(estimator=estimator, budget_per_prompt=4))
  ids = [f"p{i}" for i in range(6)]
  rates = [0.0, 0.1, 0.3, 0.5, 0.8, 1.0]
  rng = np.random.default_rng(0)
  with pytest.raises(ValueError, match="features"):
    rounds_step(cfg, ids, _draw(rates, rng), rng)
  features = sim.toy_features(np.asarray(rates), np.random.default_rng(1))
  res, state = rounds_step(cfg, ids, _draw(rates, rng), rng, features=features)
  # An untrained head predicts the prior for all, so the first budget is uniform.
  np.testing.assert_array_equal(res.stats.pool_size, 4)
  assert {"est/head_brier", "est/head_ece", "est/head_loss"} <= set(res.stats.rule_metrics)
  assert "est/head_brier" in res.stats.as_metrics()
  assert any(k.startswith("head_") for k in state) and state["keys"].size == 6
  before = head_lib.params_from_state({}, features.shape[1], cfg)
  after = head_lib.params_from_state(state, features.shape[1], cfg)
  assert not np.array_equal(before["w2"], after["w2"])  # it trained on the step's rewards
  res2, state2 = rounds_step(
    cfg, ids, _draw(rates, rng), rng, method_state=state, features=features
  )
  assert res2.stats.pool_size.sum() == 24 and state2["keys"].size == 6


def test_ema_estimator_ignores_features_and_keeps_no_head():
  cfg = AdaConfig("est")
  rng = np.random.default_rng(0)
  _, state = rounds_step(cfg, ["a", "b"], _draw([0.5, 0.5], rng), rng, features=np.zeros((2, 3)))
  assert sorted(state) == ["keys", "pos", "tot"]


def test_head_beats_ema_on_the_first_epoch_of_the_simulator():
  # Every prompt is new on the first epoch: the EMA gives all the prior (GRPO n = 8), the
  # head learns from the toy features which prompts are hard.
  p = sim.sample_pass_rates(np.random.default_rng(0), 2048)
  sf = {
    e: sim.simulate(
      AdaConfig("est", est=EstConfig(budget_per_prompt=8, estimator=e)),
      p,
      batch=256,
      epochs=1,
      warmup_epochs=0,
      seed=0,
    ).signal_fraction
    for e in ("ema", "head")
  }
  assert sf["head"] > sf["ema"] + 0.01, sf


# --- The head's state in the run state: checkpoint round trip, kill -9 ------------------


def test_head_state_round_trips_through_a_checkpoint_exactly(tmp_path):
  from ada_jax import checkpoint
  from ada_jax.models import decoder as model_lib
  from ada_jax.models import sharding
  from ada_jax.rl import train

  cfg = AdaConfig("est", est=EstConfig(estimator="head"))
  rng = np.random.default_rng(0)
  features = rng.standard_normal((16, 8)).astype(np.float32)
  flat, _ = head_lib.train_head(
    head_lib.head_state({}, 8, cfg), features, np.full(16, 2.0), np.full(16, 8.0), lr=1e-2, steps=3
  )
  keys = estimate.prompt_keys(range(16))
  est = {
    **estimate.update_est_state(estimate.init_est_state(), keys, np.ones(16), 8.0, 0.9),
    **flat,
  }
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  model_cfg = model_lib.preset("tiny-llama")
  params = model_lib.init_params(model_cfg, jax.random.key(0))
  state = train.init_train_state(model_cfg, train.TrainConfig(), params, mesh)
  manager = checkpoint.make_manager(tmp_path)
  checkpoint.save(
    manager, 1, checkpoint.RunState(train=state, rng=jax.random.key(1), method_state=est)
  )
  manager.wait_until_finished()
  back = checkpoint.restore(manager, train.abstract_state(model_cfg, train.TrainConfig(), mesh))
  manager.close()
  assert sorted(back.method_state) == sorted(est)
  for k, v in est.items():
    assert back.method_state[k].dtype == v.dtype and back.method_state[k].shape == v.shape, k
    np.testing.assert_array_equal(back.method_state[k], v)
  # The restored Adam moments continue training exactly as the saved ones would.
  a, _ = head_lib.train_head(est, features, np.ones(16), np.full(16, 4.0), lr=1e-2, steps=2)
  b, _ = head_lib.train_head(
    back.method_state, features, np.ones(16), np.full(16, 4.0), lr=1e-2, steps=2
  )
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
