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

from ada_jax.models import decoder as model_lib
from ada_jax.models import layers
from ada_jax.rollout import decode_kernel_gpu as kernel


@st.composite
def cases(draw):
  s, k, g = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 5))
  h = draw(st.sampled_from([32, 64]))
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
@example((1, 1, 3, 64, 48, 48, 40, 45, 2))  # 45 of 48 columns, wrapping: blocks 2, 0, 1 of 16
def test_kernel_ropes_writes_and_attends_like_xla_over_the_window(case):
  """The kernel's output equals `layers.split_heads`, the ring write at `column` and
  `layers.attend` over the prompt and the ring window's columns (random masks, some rows
  with no prompt column at all, a dead slot whose own column is masked), whether the window
  wraps past column 0 or not; its ring equals the written one. Ring blocks the schedule
  does not read hold NaN and the column written held 1e9, so a read that should not be
  would poison the output."""
  s, k, g, h, lp, lr, column, window, seed = case
  ks = jax.random.split(jax.random.key(seed), 9)
  normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32)
  qkv = normal(ks[0], (s, k, g + 2, h))
  positions = jax.random.randint(ks[7], (s,), 0, 4096)
  inv_freq = layers.rope_frequencies(
    model_lib.preset("tiny-llama").replace(head_dim=h, rope_theta=10000.0)
  )
  # The prompt cache has s + 1 entries; the slots' rows point into them (some share one).
  entry = jax.random.randint(ks[8], (s,), 0, s + 1)
  prompt = (normal(ks[1], (s + 1, k, lp, h)), normal(ks[2], (s + 1, k, lp, h)))
  prompt_mask = (jax.random.uniform(ks[3], (s + 1, lp)) < 0.6) & (jnp.arange(s + 1) > 0)[:, None]
  ring = (normal(ks[4], (s, k, lr, h)), normal(ks[5], (s, k, lr, h)))
  inside = _window_mask(column, window, lr)
  ring_mask = (jax.random.uniform(ks[6], (s, lr)) < 0.7) & inside[None]
  ring_mask = ring_mask.at[:, column].set(jnp.arange(s) != 1)  # slot 1 is dead
  first, count = np.asarray(kernel.ring_schedule(jnp.int32(column), jnp.int32(window), lr))
  block = kernel.column_block(lr)
  read = np.zeros(lr, bool)
  for b in (first + np.arange(count)) % (lr // block):
    read[b * block : (b + 1) * block] = True
  assert read[inside].all()
  assert kernel.columns_read(jnp.int32(column), jnp.int32(window), lr) == read.sum()
  q, new_k, new_v = layers.split_heads(qkv[:, None], positions[:, None], inv_freq)
  written = tuple(
    x.at[:, :, column].set(n[:, :, 0]) for x, n in zip(ring, (new_k, new_v), strict=True)
  )
  poison = lambda x: jnp.where(jnp.asarray(read)[None, None, :, None], x, jnp.nan)
  stale = lambda x: poison(x.at[:, :, column].set(1e9))
  out, ring_k, ring_v = kernel.decode_step(
    qkv, positions, inv_freq, (*prompt, prompt_mask), (entry, jnp.ones((s,), bool)),
    (*map(stale, ring), ring_mask), jnp.int32(column), jnp.int32(window), interpret=True,
  )  # fmt: skip
  copies = (prompt[0][entry], prompt[1][entry], prompt_mask[entry][:, None])
  ref = layers.attend(q, [copies, (*written, ring_mask[:, None])])
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
  for got, want in zip((ring_k, ring_v), written, strict=True):
    np.testing.assert_allclose(got[:, :, column], want[:, :, column], atol=1e-6, rtol=1e-6)
    others = read & (np.arange(lr) != column)
    np.testing.assert_array_equal(got[..., others, :], want[..., others, :])


def test_kernel_applies_to_multiples_of_16_only():
  assert kernel.column_block(512) == 128 and kernel.column_block(96) == 32
  assert kernel.applies(16, 2048, 128) and kernel.applies(48, 32, 32)
  assert not kernel.applies(16, 12, 128) and not kernel.applies(24, 16, 128)
  assert not kernel.applies(16, 16, 48) and not kernel.applies(16, 16, 16)
  at = lambda column, window: np.asarray(
    kernel.ring_schedule(jnp.int32(column), jnp.int32(window), 512)
  ).tolist()
  assert at(10, 5) == [0, 1]
  assert at(200, 100) == [0, 2]  # columns 101..200 straddle blocks 0 and 1
  assert at(20, 100) == [3, 2]  # columns 433..511 and 0..20: block 3, then block 0
  assert at(5, 512) == [0, 4]
  with pytest.raises(ValueError, match=r"prompt \(16\) and ring \(12\) columns must"):
    z = jnp.zeros((1, 1, 12, 32))
    kernel.decode_step(
      jnp.zeros((1, 1, 3, 32)), jnp.zeros((1,), jnp.int32), jnp.ones((16,)),
      (jnp.zeros((1, 1, 16, 32)),) * 2 + (jnp.ones((1, 16), bool),),
      (jnp.zeros((1,), jnp.int32), jnp.ones((1,), bool)),
      (z, z, jnp.ones((1, 12), bool)), jnp.int32(0), jnp.int32(1), interpret=True,
    )  # fmt: skip


def test_xla_gpu_compiles_the_kernel_ahead_of_time():
  """For a compile-only H200: one Triton custom call, whose operands are the projections
  and the cache pieces as they are (no concatenation, no float32 copy of a key), the ring
  written in place (no copy of it)."""
  pytest.importorskip("jax_plugins.xla_cuda12", reason="jax-cuda12-plugin (requirements-dev.txt)")
  from ada_jax.plan import compiler, targets

  device = targets.devices_for(targets.target("h200x1"))[0]
  put = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(
    shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device)
  )
  s, k, g, h, lp, lr = 64, 2, 6, 128, 512, 256
  kv = lambda n, rows=s: (put((rows, k, n, h)),) * 2 + (put((rows, n), jnp.bool_),)
  fn = jax.jit(kernel.decode_step, donate_argnums=(5,))
  rows = (put((s,), jnp.int32), put((s,), jnp.bool_))
  program = compiler.compile_program(
    fn, put((s, k, g + 2, h)), put((s,), jnp.int32), put((h // 2,), jnp.float32),
    kv(lp, s // 4), rows, kv(lr), put((), jnp.int32),
    put((), jnp.int32), what="decode attention", keep_hlo=True,
  )  # fmt: skip
  calls = [line for line in program.hlo.splitlines() if "custom_call_target" in line]
  assert len(calls) == 1 and "triton" in calls[0], calls
  assert "output_to_operand_aliasing" in calls[0]
  lines = program.hlo.splitlines()
  assert not [x for x in lines if "concatenate(" in x and "bf16" in x]
  assert not [x for x in lines if "f32[64,2" in x]
  assert not [x for x in lines if " copy(" in x and f"bf16[{s},{k},{lr},{h}]" in x]
