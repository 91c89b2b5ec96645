"""Policy loss against hand-worked numbers: PPO clip, dual clip, log-ratio clamp, modes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ada_jax import testing
from ada_jax.models import decoder as model_lib
from ada_jax.rl import losses

CFG = losses.LossConfig()


def _token_loss(log_ratio, adv, config=CFG):
  lp = jnp.asarray([[log_ratio]], jnp.float32)
  loss, clipped, dual = losses.per_token_pg_loss(
    lp, jnp.zeros_like(lp), jnp.asarray([adv], jnp.float32), config
  )
  return float(loss[0, 0]), bool(clipped[0, 0]), bool(dual[0, 0])


@pytest.mark.parametrize(
  "ratio, adv, want, clipped, dual",
  [
    (1.5, 1.0, -1.28, True, False),  # A>0, ratio above 1+0.28: clipped at 1.28
    (0.5, 1.0, -0.5, False, False),  # A>0, ratio below 1-0.2: pessimistic min keeps 0.5
    (1.2, 1.0, -1.2, False, False),  # inside the clip-higher range (0.8, 1.28)
    (1.5, -1.0, 1.5, False, False),  # A<0, ratio up: unclipped, below the dual cap 10
    (0.5, -1.0, 0.8, True, False),  # A<0, ratio down: clipped at 0.8
    (20.0, -1.0, 10.0, False, True),  # A<0, ratio 20 > c=10: dual clip caps at -A*c
    (20.0, -0.5, 5.0, False, True),  # cap scales with |A|
    (20.0, 2.0, -2.56, True, False),  # A>0: the dual clip never applies
  ],
)
def test_per_token_loss_hand_worked(ratio, adv, want, clipped, dual):
  got, got_clipped, got_dual = _token_loss(math.log(ratio), adv)
  assert got == pytest.approx(want, rel=1e-5)
  assert (got_clipped, got_dual) == (clipped, dual)


def test_log_ratio_is_clamped_before_exp():
  no_dual = losses.LossConfig(dual_clip=None)
  # log-ratio 50 would give e^50 ≈ 5e21; clamped to 20 it is e^20 ≈ 4.85e8.
  assert _token_loss(50.0, -1.0, no_dual)[0] == pytest.approx(math.exp(20.0), rel=1e-5)
  assert _token_loss(50.0, -1.0)[0] == pytest.approx(10.0)  # and the dual cap still holds
  assert _token_loss(-50.0, -1.0)[0] == pytest.approx(0.8)  # ratio ~0 clipped at 0.8
  lp = jnp.asarray([[1e4]], jnp.float32)
  loss, _, _ = losses.per_token_pg_loss(lp, -lp, jnp.asarray([-1.0]), no_dual)
  assert np.isfinite(float(loss[0, 0]))


def test_clipped_tokens_carry_no_gradient():
  log_ratio = jnp.log(jnp.asarray([[1.5, 1.1, 0.5, 0.9]], jnp.float32))
  adv = jnp.asarray([1.0])
  mask = jnp.ones((1, 4), bool)

  def f(lp):
    return losses.policy_loss(lp, jnp.zeros_like(lp), adv, mask, config=CFG, normalizer=4.0)[0]

  grad = np.asarray(jax.grad(f)(log_ratio))[0]
  # d/dlogp of -A·r/N is -A·r/N where unclipped; 0 where the clip is active (ratio 1.5 with
  # A > 0; ratio 0.5 with A > 0 is unclipped by the pessimistic max).
  np.testing.assert_allclose(grad, [0.0, -1.1 / 4, -0.5 / 4, -0.9 / 4], rtol=1e-5)


# Two rows, ratio 1 everywhere: per-token loss = -A. Row 0: A=-1 over 3 tokens, row 1:
# A=-10 over 1 token, row 2: batch padding without response tokens.
_MASK = np.array([[1, 1, 1, 0], [0, 0, 1, 0], [0, 0, 0, 0]], bool)
_ADV = np.array([-1.0, -10.0, 5.0], np.float32)


@pytest.mark.parametrize(
  "mode, want",
  [
    ("token-mean", (3 * 1 + 10) / 4),
    ("seq-mean-token-mean", (1 + 10) / 2),
    ("seq-mean-token-sum", (3 + 10) / 2),
  ],
)
def test_aggregation_modes(mode, want):
  config = losses.LossConfig(aggregation=mode)
  lp = jnp.zeros(_MASK.shape)
  norm = losses.loss_normalizer(jnp.asarray(_MASK), mode)
  loss, sums = losses.policy_loss(
    lp, lp, jnp.asarray(_ADV), jnp.asarray(_MASK), config=config, normalizer=norm
  )
  assert float(loss) == pytest.approx(want)
  assert float(sums["tokens"]) == 4


@pytest.mark.parametrize("mode", sorted(losses.AGGREGATIONS))
def test_micro_batches_sum_to_the_batch_loss(mode):
  rng = np.random.default_rng(0)
  lp = jnp.asarray(rng.normal(-2, 0.3, (6, 5)), jnp.float32)
  old = jnp.asarray(rng.normal(-2, 0.3, (6, 5)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=6), jnp.float32)
  mask = jnp.asarray(np.arange(5)[None] < np.array([1, 5, 2, 3, 5, 4])[:, None])
  config = losses.LossConfig(aggregation=mode, entropy_coeff=0.01)
  ent = jnp.asarray(rng.uniform(0, 3, (6, 5)), jnp.float32)
  norm = losses.loss_normalizer(mask, mode)
  whole, _ = losses.policy_loss(lp, old, adv, mask, config=config, normalizer=norm, entropy=ent)
  parts = sum(
    float(
      losses.policy_loss(
        lp[s], old[s], adv[s], mask[s], config=config, normalizer=norm, entropy=ent[s]
      )[0]
    )
    for s in (slice(0, 2), slice(2, 3), slice(3, 6))
  )
  assert parts == pytest.approx(float(whole), rel=1e-6)
  # A per-part normaliser (the bug the global normaliser avoids) gives another number.
  local = (
    sum(
      float(
        losses.policy_loss(
          lp[s],
          old[s],
          adv[s],
          mask[s],
          config=config,
          normalizer=losses.loss_normalizer(mask[s], mode),
          entropy=ent[s],
        )[0]
      )
      for s in (slice(0, 2), slice(2, 3), slice(3, 6))
    )
    / 3
  )
  assert abs(local - float(whole)) > 1e-3


def test_entropy_bonus_and_k3_kl():
  mask = jnp.asarray([[True, True]])
  lp = jnp.log(jnp.asarray([[0.5, 0.25]]))
  adv = jnp.asarray([0.0])  # isolate the extra terms
  ent = jnp.asarray([[1.0, 3.0]])
  ref = jnp.log(jnp.asarray([[0.5, 0.5]]))
  config = losses.LossConfig(entropy_coeff=0.1, kl_coeff=0.5)
  loss, sums = losses.policy_loss(
    lp, lp, adv, mask, config=config, normalizer=2.0, entropy=ent, ref_logprobs=ref
  )
  # k3 with d = ref - logp: token 0 d=0 -> 0; token 1 d=log 2 -> 2 - log 2 - 1.
  k3 = 1.0 - math.log(2.0)
  assert float(sums["kl"]) == pytest.approx(k3, rel=1e-6)
  assert float(loss) == pytest.approx(-0.1 * 2.0 + 0.5 * k3 / 2, rel=1e-6)
  with pytest.raises(ValueError, match="reference"):
    losses.policy_loss(lp, lp, adv, mask, config=config, normalizer=2.0, entropy=ent)


def test_metrics_are_token_means():
  lp = jnp.log(jnp.asarray([[1.5, 1.0, 0.5, 1.0]]))
  mask = jnp.asarray([[True, True, True, False]])
  _, sums = losses.policy_loss(
    lp,
    jnp.zeros_like(lp),
    jnp.asarray([1.0]),
    mask,
    config=CFG,
    normalizer=3.0,
    entropy=jnp.full((1, 4), 2.0),
  )
  m = losses.finalize_sums(sums)
  assert float(m["clip_frac"]) == pytest.approx(1 / 3)  # only ratio 1.5 is clipped
  assert float(m["approx_kl"]) == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 3, rel=1e-6)
  assert float(m["entropy"]) == pytest.approx(2.0)
  assert float(m["tokens"]) == 3


def test_token_logprobs_alignment_and_entropy():
  config = model_lib.preset("tiny-qwen2")
  params = model_lib.init_params(config, jax.random.key(1))
  tokens, mask = testing.left_padded_batch([6, 3], 6, config.vocab_size, seed=2)
  pos = model_lib.positions_from_mask(jnp.asarray(mask))
  lp, ent = losses.token_logprobs(config, params, tokens, pos, mask)
  logits = np.asarray(model_lib.logits(config, params, tokens, pos, mask), np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
  logp -= logits.max(-1, keepdims=True)
  assert lp.shape == ent.shape == tokens.shape
  np.testing.assert_array_equal(np.asarray(lp[:, 0]), 0.0)
  for t in range(1, 6):
    want = logp[np.arange(2), t - 1, tokens[:, t]]
    np.testing.assert_allclose(np.asarray(lp[:, t]), want, rtol=1e-5, atol=1e-5)
    want_ent = -(np.exp(logp[:, t - 1]) * logp[:, t - 1]).sum(-1)
    np.testing.assert_allclose(np.asarray(ent[:, t]), want_ent, rtol=1e-5)


def test_bad_config_names_the_field():
  with pytest.raises(ValueError, match="LossConfig.aggregation"):
    losses.LossConfig(aggregation="token-sum")
  with pytest.raises(ValueError, match="LossConfig.dual_clip"):
    losses.LossConfig(dual_clip=0.5)


def _unblocked_logprobs(config, params, tokens, pos, mask, temperature):
  """The direct computation the blocked one replaces: the whole [B, T, V] log-softmax."""
  logits = model_lib.logits(config, params, tokens, pos, mask)[:, :-1] / temperature
  logp = jax.nn.log_softmax(logits, -1)
  picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
  return pad(picked), pad(entropy)


@pytest.mark.parametrize(
  "block_size, temperature", [(1, 1.0), (3, 0.5), (4, 1.0), (11, 0.7), (12, 1.0), (64, 1.3)]
)
def test_blocked_logprobs_and_gradients_equal_unblocked(block_size, temperature):
  # T - 1 = 11 scored positions: blocks that divide it, that do not (padding), and one
  # larger than the sequence.
  config = model_lib.preset("tiny-llama")
  params = model_lib.init_params(config, jax.random.key(3))
  tokens, mask = testing.left_padded_batch([12, 7, 9], 12, config.vocab_size, seed=4)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  pos = model_lib.positions_from_mask(mask)
  weights = jax.random.normal(jax.random.key(5), (2,) + tokens.shape)

  def objective(fn):
    def f(p):
      lp, ent = fn(p)
      return jnp.sum(weights[0] * lp * mask) + jnp.sum(weights[1] * ent * mask)

    return f

  blocked = lambda p: losses.token_logprobs(
    config, p, tokens, pos, mask, temperature=temperature, block_size=block_size
  )
  direct = lambda p: _unblocked_logprobs(config, p, tokens, pos, mask, temperature)
  (lp, ent), (lp_want, ent_want) = blocked(params), direct(params)
  np.testing.assert_allclose(np.asarray(lp), np.asarray(lp_want), rtol=0, atol=1e-6)
  # Entropies of a few nats: float32 rounding of the per-block matmul moves the last ulps.
  np.testing.assert_allclose(np.asarray(ent), np.asarray(ent_want), rtol=1e-6, atol=1e-6)
  g_blocked = jax.grad(objective(blocked))(params)
  g_direct = jax.grad(objective(direct))(params)
  for a, b in zip(jax.tree.leaves(g_blocked), jax.tree.leaves(g_direct), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_blocked_logprobs_rejects_bad_block_size():
  config = model_lib.preset("tiny-llama")
  params = model_lib.init_params(config, jax.random.key(3))
  tokens, mask = testing.left_padded_batch([4], 4, config.vocab_size, seed=4)
  pos = model_lib.positions_from_mask(jnp.asarray(mask))
  with pytest.raises(ValueError, match="block_size"):
    losses.token_logprobs(config, params, tokens, pos, mask, block_size=0)
