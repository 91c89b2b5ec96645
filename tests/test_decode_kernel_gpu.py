"""The Pallas GPU decode-attention kernel (`rollout.decode_kernel_gpu`, Triton lowering): in
Pallas' interpreter on the CPU it computes the attention XLA's formulation computes (over
shapes, masks and windows, wrapping or not), and XLA:GPU compiles it ahead of time for an
H200. The pool's tokens through it: tests/test_decode_kernel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ada_jax.models import layers
from ada_jax.rollout import decode_kernel_gpu as kernel


@st.composite
def cases(draw):
  s, k, g = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 5))
  h = draw(st.sampled_from([16, 32]))
  lp, lr = draw(st.sampled_from([16, 48])), draw(st.sampled_from([16, 32, 96]))
  column = draw(st.integers(0, lr - 1))
  window = draw(st.integers(1, lr))
  return s, k, g, h, lp, lr, column, window, draw(st.integers(0, 2**16))


def _window_mask(column, window, ring):
  inside = np.zeros(ring, bool)
  inside[(column - np.arange(window)) % ring] = True
  return inside


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
@example((2, 2, 6, 32, 48, 96, 10, 60, 1))  # wraps past column 0: ring blocks 1, 2, 0 of 32
@example((1, 1, 3, 16, 48, 48, 40, 45, 2))  # 45 of 48 columns, wrapping: blocks 2, 0, 1 of 16
def test_kernel_attends_like_xla_over_the_window(case):
  """The kernel's output equals `layers.attend` over the prompt and the ring window's
  columns (random masks, some rows with no prompt column at all), whether the window wraps
  past column 0 or not; ring blocks the schedule does not read hold NaN, so a block read
  that should not be would poison the output."""
  s, k, g, h, lp, lr, column, window, seed = case
  ks = jax.random.split(jax.random.key(seed), 8)
  normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32)
  q = normal(ks[0], (s, 1, k * g, h))
  prompt = (normal(ks[1], (s, k, lp, h)), normal(ks[2], (s, k, lp, h)))
  prompt_mask = (jax.random.uniform(ks[3], (s, lp)) < 0.6) & (jnp.arange(s) > 0)[:, None]
  ring = (normal(ks[4], (s, k, lr, h)), normal(ks[5], (s, k, lr, h)))
  inside = _window_mask(column, window, lr)
  ring_mask = (jax.random.uniform(ks[6], (s, lr)) < 0.7) & inside[None]
  ring_mask = ring_mask.at[:, column].set(True)  # this step's own column is always live
  first, count = np.asarray(kernel.ring_schedule(jnp.int32(column), jnp.int32(window), lr))
  block = kernel.column_block(lr)
  read = np.zeros(lr, bool)
  for b in (first + np.arange(count)) % (lr // block):
    read[b * block : (b + 1) * block] = True
  assert read[inside].all()
  assert kernel.columns_read(jnp.int32(column), jnp.int32(window), lr) == read.sum()
  poison = lambda x: jnp.where(jnp.asarray(read)[None, None, :, None], x, jnp.nan)
  out = kernel.decode_attention(
    q, (*prompt, prompt_mask), (*map(poison, ring), ring_mask),
    jnp.int32(column), jnp.int32(window), interpret=True,
  )  # fmt: skip
  ref = layers.attend(q, [(*prompt, prompt_mask[:, None]), (*ring, ring_mask[:, None])])
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


def test_kernel_applies_to_multiples_of_16_only():
  assert kernel.column_block(512) == 128 and kernel.column_block(96) == 32
  assert kernel.applies(16, 2048, 128) and kernel.applies(48, 32, 16)
  assert not kernel.applies(16, 12, 128) and not kernel.applies(24, 16, 128)
  assert not kernel.applies(16, 16, 24) and not kernel.applies(16, 16, 8)
  at = lambda column, window: np.asarray(
    kernel.ring_schedule(jnp.int32(column), jnp.int32(window), 512)
  ).tolist()
  assert at(10, 5) == [0, 1]
  assert at(200, 100) == [0, 2]  # columns 101..200 straddle blocks 0 and 1
  assert at(20, 100) == [3, 2]  # columns 433..511 and 0..20: block 3, then block 0
  assert at(5, 512) == [0, 4]
  with pytest.raises(ValueError, match=r"prompt \(16\) and ring \(12\) columns must"):
    z = jnp.zeros((1, 1, 12, 16))
    kernel.decode_attention(
      jnp.zeros((1, 1, 1, 16)), (jnp.zeros((1, 1, 16, 16)),) * 2 + (jnp.ones((1, 16), bool),),
      (z, z, jnp.ones((1, 12), bool)), jnp.int32(0), jnp.int32(1), interpret=True,
    )  # fmt: skip


def test_xla_gpu_compiles_the_kernel_ahead_of_time():
  """For a compile-only H200: one Triton custom call, whose operands are the queries and
  the cache pieces as they are (no concatenation, no float32 copy of a key)."""
  pytest.importorskip("jax_plugins.xla_cuda12", reason="jax-cuda12-plugin (requirements-dev.txt)")
  from ada_jax.plan import compiler, targets

  device = targets.devices_for(targets.target("h200x1"))[0]
  put = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(
    shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device)
  )
  s, k, g, h, lp, lr = 64, 2, 6, 128, 512, 256
  kv = lambda n: (put((s, k, n, h)), put((s, k, n, h)), put((s, n), jnp.bool_))
  fn = jax.jit(kernel.decode_attention)
  program = compiler.compile_program(
    fn, put((s, 1, k * g, h)), kv(lp), kv(lr), put((), jnp.int32), put((), jnp.int32),
    what="decode attention", keep_hlo=True,
  )  # fmt: skip
  calls = [line for line in program.hlo.splitlines() if "custom_call_target" in line]
  assert len(calls) == 1 and "triton" in calls[0], calls
  lines = program.hlo.splitlines()
  assert not [x for x in lines if "concatenate(" in x and "bf16" in x]
  assert not [x for x in lines if "f32[64,2" in x]
