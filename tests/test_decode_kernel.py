"""The Pallas TPU decode-attention kernel (`rollout.decode_kernel`), in Pallas' interpreter
on the CPU: the attention XLA's formulation computes, for windows that wrap and windows
that do not; and both Pallas kernels (TPU and GPU) through the whole slot pool: the same
tokens (one device and a mesh)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ada_jax.models import decoder as model_lib
from ada_jax.models import layers, sharding
from ada_jax.rollout import attention, decode_kernel, decode_kernel_gpu
from ada_jax.rollout import sampler as sampler_lib

S, K, G, H, LP, LR = 8, 2, 3, 128, 256, 1024
# The slots' prompt-cache entries (of 5; entries 1 and 4 have no live row, slot 6 is free):
# entry 2's three rows share its prompt, read once.
ENTRY = np.array([0, 2, 3, 2, 0, 2, 1, 3], np.int32)
LIVE = np.array([1, 1, 1, 1, 1, 1, 0, 1], bool)
P, R = 5, 3


@pytest.fixture(scope="module")
def cache():
  ks = jax.random.split(jax.random.key(0), 7)
  normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32)
  return dict(
    q=normal(ks[0], (S, 1, K * G, H)),
    prompt=(normal(ks[1], (P, K, LP, H)), normal(ks[2], (P, K, LP, H))),
    prompt_mask=(jax.random.uniform(ks[3], (P, LP)) < 0.6).at[:, -1].set(True),
    ring=(normal(ks[4], (S, K, LR, H)), normal(ks[5], (S, K, LR, H))),
    ring_mask=jax.random.uniform(ks[6], (S, LR)) < 0.6,
  )


def _window_mask(column, window):
  inside = np.zeros(LR, bool)
  inside[(column - np.arange(window)) % LR] = True
  return inside


@pytest.mark.parametrize(
  "column, window", [(0, 1), (5, 3), (600, 256), (100, 100), (3, 700), (1000, 1024), (511, 512)]
)
def test_kernel_attends_like_xla_over_the_window(cache, column, window):
  """The kernel's output equals `layers.attend` over each live slot's own copy of its
  entry's prompt and the ring window's columns, whether the window wraps past column 0 or
  not (three rows share one entry's prompt, two entries have no live row); ring blocks
  outside the window hold NaN (masked), so a block read that should not be would poison
  the output."""
  c = cache
  inside = _window_mask(column, window)
  ring_mask = c["ring_mask"] & inside[None]
  schedule = np.asarray(decode_kernel.ring_schedule(jnp.int32(column), jnp.int32(window), LR))
  block = decode_kernel.column_block(LR)
  read = np.zeros(LR, bool)
  for b in (schedule[0] + np.arange(schedule[1])) % (LR // block):
    read[b * block : (b + 1) * block] = True
  assert read[inside].all()
  poison = lambda x: jnp.where(jnp.asarray(read)[None, None, :, None], x, jnp.nan)
  out = decode_kernel.decode_attention(
    c["q"], (*c["prompt"], c["prompt_mask"]), (jnp.asarray(ENTRY), jnp.asarray(LIVE)),
    (*map(poison, c["ring"]), ring_mask), jnp.int32(column), jnp.int32(window),
    entry_rows=R, interpret=True,
  )  # fmt: skip
  copies = (*(x[ENTRY] for x in c["prompt"]), c["prompt_mask"][ENTRY][:, None])
  ref = layers.attend(c["q"], [copies, (*c["ring"], ring_mask[:, None])])
  np.testing.assert_allclose(out[LIVE], ref[LIVE], atol=2e-5, rtol=2e-5)
  assert np.isfinite(np.asarray(out)).all()


def test_kernel_schedule_reads_only_the_windows_blocks():
  """Blocks of 512 ring columns: a window inside one block reads one, a wrapping one the
  blocks at both ends, the whole ring all of them."""
  at = lambda column, window: np.asarray(
    decode_kernel.ring_schedule(jnp.int32(column), jnp.int32(window), 2048)
  ).tolist()
  assert decode_kernel.column_block(2048) == 512
  assert at(10, 5) == [0, 1]
  assert at(600, 200) == [0, 2]  # columns 401..600 straddle blocks 0 and 1
  assert at(100, 300) == [3, 2]  # columns 1849..2047 and 0..100: blocks 3, then 0
  assert at(5, 2048) == [0, 4]
  assert decode_kernel.column_block(24) == 24  # a budget no block divides: one block


@pytest.fixture(scope="module")
def tiny():
  config = model_lib.preset("tiny-llama")
  return config, model_lib.init_params(config, jax.random.key(0))


# Per kernel: the model and the pool's sizes. The GPU kernel takes Lp and Lr in multiples
# of 16 (a ring of 48 is 3 blocks of 16) and head dims of at least 32 (a Qwen 2: its qkv
# bias goes into the projections the kernel rotates); the TPU one any (a ring of 20 is
# one block).
POOLS = {
  "tpu": dict(max_new_tokens=20, prompt_buckets=(8,), chunk_rows=8, segment_steps=7, rows=16),
  "gpu": dict(max_new_tokens=48, prompt_buckets=(16,), chunk_rows=4, segment_steps=16, rows=10),
}
MODELS = {"tpu": ("tiny-llama", {}), "gpu": ("tiny-qwen2", {"head_dim": 32})}


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_pool_draws_the_same_tokens_through_the_kernel(monkeypatch, kernel, mesh_shape):
  """The pool's decode attention as a Pallas kernel (what a TPU or a GPU runs, here
  interpreted; the GPU one rotating and writing the new key itself) or as XLA's pieces
  (what a CPU runs): the same tokens and log-probs within float rounding, over refills and
  ring windows of every length, wrapping; on a 2 x 2 x 2 mesh the kernel runs on each
  device's slots and kv heads."""
  name, overrides = MODELS[kernel]
  config = model_lib.preset(name, **overrides)
  params = model_lib.init_params(config, jax.random.key(0))
  mesh = sharding.make_mesh(*mesh_shape) if mesh_shape else None
  pool = dict(POOLS[kernel])
  rows = np.random.default_rng(2).integers(0, 4, pool.pop("rows"))
  prompts = [[5, 6, 7, 8, 9], [11, 12], [13], [20, 21, 22, 23, 24, 25, 26]]
  kw = dict(stop_ids=tuple(range(3, 512, 16)), prompts_per_chunk=4, attention_block=4) | pool
  draw = lambda: sampler_lib.Sampler(config, mesh=mesh, **kw).generate(
    params, prompts, rows, jax.random.key(5)
  )
  xla, _ = draw()
  monkeypatch.setattr(attention, "uses_kernel", lambda mesh: kernel)
  module, calls = attention.KERNELS[kernel], []
  entry = "decode_step" if module.WRITES_RING else "decode_attention"
  run = getattr(module, entry)
  monkeypatch.setattr(module, entry, lambda *a, **k: calls.append(1) or run(*a, **k))
  through, _ = draw()
  assert calls and len(set(xla["lengths"].tolist())) > 2
  assert xla["lengths"].max() > 16  # a window over more than one block of either kernel
  np.testing.assert_array_equal(through["tokens"], xla["tokens"])
  np.testing.assert_array_equal(through["lengths"], xla["lengths"])
  np.testing.assert_allclose(through["logprobs"], xla["logprobs"], atol=1e-4)


def test_a_ring_the_gpu_kernel_does_not_take_keeps_xlas_form(tiny, monkeypatch):
  """A ring of 12 columns (not a multiple of 16): the GPU platform's pool attends in XLA's
  form, the kernel is never called, and the log says so."""
  from absl import logging

  config, params = tiny
  said = []
  monkeypatch.setattr(logging, "warning", lambda msg, *args: said.append(msg % args))
  monkeypatch.setattr(attention, "uses_kernel", lambda mesh: "gpu")
  calls = []
  monkeypatch.setattr(decode_kernel_gpu, "decode_step", lambda *a, **k: calls.append(1))
  kw = dict(
    max_new_tokens=12, stop_ids=(3,), prompt_buckets=(16,), chunk_rows=4, prompts_per_chunk=1
  )
  out, _ = sampler_lib.Sampler(config, **kw).generate(params, [[5, 6]], [0, 0], jax.random.key(1))
  assert out["tokens"].shape == (2, 12) and not calls
  assert any("gpu kernel does not take 16 prompt / 12 ring columns" in m for m in said), said
