"""The splash-attention kernel (`models.flash`, in Pallas' interpreter on CPU) computes
`layers.causal_attend`'s attention at every real token, forward and backward, on one
device and over the 2x2x2 mesh; the train step and the prompt prefill with it are the
steps without it; the platforms that take it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ada_jax import platforms, testing
from ada_jax.models import decoder as model_lib
from ada_jax.models import flash, layers, sharding
from ada_jax.rl import losses, packing, train, update


def _segments(lengths, width):
  """`int32[width]` ids 1, 2, ... of sequences of `lengths` packed from column 0, 0 after."""
  ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(width)])
  return ids[:width].astype(np.int32)


def _qkv(b, t, kv_heads, group, h, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, t, kv_heads * group, h))
  k, v = (jax.random.normal(x, (b, kv_heads, t, h)) for x in ks[1:])
  return q, k, v


@settings(max_examples=6, deadline=None)
@given(
  lengths=st.lists(st.integers(1, 80), min_size=1, max_size=4),
  kv_heads=st.sampled_from([1, 2]),
  group=st.sampled_from([1, 3]),
)
def test_splash_is_causal_attend_at_every_real_token(lengths, kv_heads, group):
  """Outputs and the gradients of a weighted sum of the real tokens' outputs (w.r.t. q, k
  and v) within float32 round-off, for packed rows of any segment lengths."""
  t, h = 128, 16
  segments = np.stack([_segments(lengths, t), _segments(lengths[::-1], t)])
  real = segments > 0
  q, k, v = _qkv(2, t, kv_heads, group, h)
  weights = jax.random.normal(jax.random.key(9), q.shape) * real[:, :, None, None]
  kernel = lambda q, k, v: flash.splash_attend(q, k, v, segments, interpret=True)
  xla = lambda q, k, v: layers.causal_attend(q, k, v, segments, block=t)
  np.testing.assert_allclose(
    np.asarray(kernel(q, k, v))[real], np.asarray(xla(q, k, v))[real], atol=2e-5
  )
  loss = lambda f: lambda *a: jnp.sum(f(*a) * weights)
  got = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(xla), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("kv_heads", [2, 1])  # 1: heads whole on every device
def test_on_the_mesh_is_the_one_device_kernel(kv_heads):
  mesh = sharding.make_mesh(2, 2, 2)
  config = dataclasses.replace(
    model_lib.preset("tiny-llama"), num_kv_heads=kv_heads, num_heads=2 * kv_heads
  )
  q, k, v = _qkv(4, 128, kv_heads, 2, 16, seed=1)
  segments = np.stack([_segments(n, 128) for n in ([128], [5, 60], [127], [1, 2, 3])])
  want = flash.splash_attend(q, k, v, segments, interpret=True)
  got = jax.jit(flash.on_mesh(config, mesh, interpret=True))(q, k, v, segments)
  np.testing.assert_allclose(got, want, atol=1e-6)


def test_platforms_that_take_the_kernel(monkeypatch):
  config = model_lib.preset("tiny-llama")
  assert platforms.of("tpu").self_attention == "splash"
  assert platforms.of("gpu").self_attention == platforms.of("cpu").self_attention == ""
  assert flash.self_attend(config, None, 128) is None  # XLA:CPU: XLA's form
  _kernel_on_cpu(monkeypatch)
  assert flash.self_attend(config, None, 128) is not None
  assert flash.self_attend(config, None, 120) is None  # not a multiple of 128
  with pytest.raises(ValueError, match="multiple of 128 tokens, not 120"):
    flash.splash_attend(*_qkv(1, 120, 1, 1, 16), np.ones((1, 120), bool), interpret=True)


def _kernel_on_cpu(monkeypatch):
  cpu = dataclasses.replace(platforms.PLATFORMS["cpu"], self_attention="splash")
  monkeypatch.setitem(platforms.PLATFORMS, "cpu", cpu)


def test_a_step_with_the_kernel_is_the_step_without(monkeypatch):
  """Packed rows of 128 positions on 8 fake devices, remat's scan included: loss, metrics,
  gradients and the recomputed old log-probs within float32 round-off of XLA's attention."""
  config = model_lib.preset("tiny-llama")
  params = model_lib.init_params(config, jax.random.key(0))
  prompts, responses = [30, 3, 17, 40, 9, 28, 22, 5] * 2, [60, 90, 11, 70, 4, 88, 33, 1] * 2
  batch = testing.rl_batch(config, params, prompts, responses, prompt_len=40, response_len=88)
  packed = packing.pack(batch, 4)
  assert packed.tokens.shape[1] == 128 and packed.rows < batch.rows
  mesh = sharding.make_mesh(2, 2, 2)
  tc = train.TrainConfig(
    loss=losses.LossConfig(entropy_coeff=0.01), micro_batch_size=4, num_minibatches=1, remat=True
  )
  placed = sharding.place_batch(packed, mesh)
  out, logprobs = {}, {}
  for name in ("xla", "kernel"):
    if name == "kernel":
      _kernel_on_cpu(monkeypatch)
      assert flash.self_attend(config, mesh, 128) is not None
    step = lambda p, b: train.loss_and_grads(p, b, model_config=config, config=tc, mesh=mesh)
    out[name] = jax.device_get(jax.jit(step)(params, placed))
    recompute = update.make_logprob_step(config, tc, mesh)
    logprobs[name] = jax.device_get(recompute(params, placed))
    # The kernel is in both programs exactly when the platform takes it.
    for fn in (step, recompute):
      assert ("pallas_call" in str(jax.make_jaxpr(fn)(params, placed))) == (name == "kernel")
  (loss_x, grads_x, sums_x), (loss_k, grads_k, sums_k) = out["xla"], out["kernel"]
  # The recomputed old log-probs take the same attention as the step (a ratio of 1).
  np.testing.assert_allclose(logprobs["kernel"], logprobs["xla"], atol=1e-5)
  assert np.abs(logprobs["xla"]).sum() > 0
  assert loss_k == pytest.approx(loss_x, rel=1e-5, abs=1e-6)
  for key in sums_x:
    assert sums_k[key] == pytest.approx(sums_x[key], rel=1e-5, abs=1e-5), key
  largest = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(grads_x))
  for a, b in zip(jax.tree.leaves(grads_x), jax.tree.leaves(grads_k), strict=True):
    assert float(np.max(np.abs(a - b))) <= 1e-4 * largest


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
def test_prefill_with_the_kernel_is_the_prefill_without(monkeypatch, mesh_shape):
  """One launch of 4 prompts (on the mesh one per data-parallel device per step of its
  scan): the same cache at every real column and the same last hidden states."""
  from ada_jax.rollout import pool as pool_lib
  from ada_jax.rollout import slots as slots_lib

  config = model_lib.preset("tiny-llama", dtype="float32")
  params = model_lib.init_params(config, jax.random.key(1))
  mesh = sharding.make_mesh(*mesh_shape) if mesh_shape else None
  tokens, mask = testing.left_padded_batch([128, 1, 70, 3], 128, config.vocab_size)
  entries = jnp.array([2, 0, 3, 1])
  prefill = lambda: jax.jit(
    lambda c, t, m, e: pool_lib.prefill_prompts(config, params, c, t, m, e, mesh)
  )(slots_lib.empty_prompt_cache(config, 4, 128, mesh), tokens, mask, entries)
  want = jax.device_get(prefill())
  _kernel_on_cpu(monkeypatch)
  assert flash.self_attend(config, mesh, 128) is not None
  got = jax.device_get(prefill())
  np.testing.assert_allclose(got[1], want[1], atol=1e-5)  # last hidden states
  cache_x, cache_k = want[0], got[0]
  np.testing.assert_array_equal(cache_k.mask, cache_x.mask)
  real = cache_x.mask[:, None, :, None]  # the prompts' real columns, [P, 1, Lp, 1]
  for axes, got_kv, want_kv in zip(
    slots_lib.cache_axes(mesh), (cache_k.k, cache_k.v), (cache_x.k, cache_x.v), strict=True
  ):
    as_model = lambda x, axes=axes: np.where(real, np.einsum(f"{axes}->bksh", x), 0)
    for a, b in zip(got_kv, want_kv, strict=True):
      np.testing.assert_allclose(as_model(a), as_model(b), atol=1e-5)
