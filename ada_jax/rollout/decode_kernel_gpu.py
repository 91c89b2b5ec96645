"""Decode attention over the slot cache as one Pallas GPU kernel (Triton lowering).

XLA:GPU's formulation (`layers.attend` over the cache's pieces) costs every layer of every
decode step: a concatenation of the prompt keys and the ring window into a new buffer
(XLA's dot merger), float32 scores written to HBM and read back by the softmax and the
value sum, several small kernels, and a `lax.switch` over window lengths (a conditional
per layer, `slots.slot_attention`). Here one kernel per layer reads each slot's keys and
values once in bf16, keeps the scores in registers (an online softmax over the prompt
columns, then over the blocks of the ring window in ring order), and takes the window's
length as data: no conditional, no concatenation, no score in HBM (issue 51, item 3).

One program per (slot, kv head): its G query heads are the rows of the score tile, padded
to a power of two of at least 16 (Triton's smallest dot), the padding rows masked out of
the loads and the store. Cache columns go in blocks of `column_block` (the largest of 128,
64, 32, 16 dividing the piece), so the kernel applies to pieces whose column counts are
multiples of 16 and whose head dim is a power of two of at least 16 (`applies`: Triton's
tiles are powers of two); elsewhere `slots` keeps XLA's form.

Shape letters as in `models.decoder`: S slots, K kv heads, G query heads per kv head, H
head dim, Lp prompt columns, Lr ring columns.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ada_jax.models.layers import MASK_VALUE
from ada_jax.rollout import decode_kernel

_COLUMN_BLOCKS = (128, 64, 32, 16)


def column_block(columns: int) -> int | None:
  """Cache columns per kernel block for a piece of `columns` columns (None: none divides)."""
  return next((b for b in _COLUMN_BLOCKS if columns % b == 0), None)


def applies(prompt_columns: int, ring_columns: int, head_dim: int) -> bool:
  """Whether the kernel takes pieces of these column counts (both multiples of 16) and
  this head dim (a power of two, at least 16)."""
  pieces = column_block(prompt_columns) is not None and column_block(ring_columns) is not None
  return pieces and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def ring_schedule(column: jax.Array, window: jax.Array, ring: int) -> jax.Array:
  """`int32[2]`: the first ring block the window reads and how many (`column_block`
  columns each; as the TPU kernel's `decode_kernel.ring_schedule`)."""
  return decode_kernel.ring_schedule(column, window, ring, column_block(ring))


def columns_read(column: jax.Array, window: jax.Array, ring: int) -> jax.Array:
  """Ring columns the kernel reads per slot for this window (whole blocks)."""
  return decode_kernel.columns_read(column, window, ring, column_block(ring))


def _kernel(
  schedule_ref, q_ref, pk_ref, pv_ref, pm_ref, rk_ref, rv_ref, rm_ref, o_ref, *, rows, scale
):
  """One (slot, kv head): the prompt's blocks, then the ring window's, one softmax."""
  g, h = q_ref.shape
  real = (jnp.arange(rows) < g)[:, None]
  q = plgpu.load(q_ref.at[pl.ds(0, rows), :], mask=real, other=0.0)

  def update(k_ref, v_ref, m_ref, block):
    def step(i, carry):
      acc, row_max, row_sum = carry
      cols = pl.ds(i * block, block)
      keep = m_ref[cols] != 0
      s = pl.dot(q, k_ref[cols, :], trans_b=True) * scale  # [rows, block] float32
      s = jnp.where(keep[None, :], s, MASK_VALUE)
      new_max = jnp.maximum(row_max, s.max(axis=1))
      p = jnp.exp(s - new_max[:, None])
      alpha = jnp.exp(row_max - new_max)
      v = v_ref[cols, :]
      acc = alpha[:, None] * acc + pl.dot(p.astype(v.dtype), v)
      return acc, new_max, alpha * row_sum + p.sum(axis=1)

    return step

  carry = (
    jnp.zeros((rows, h), jnp.float32),
    jnp.full((rows,), MASK_VALUE, jnp.float32),
    jnp.zeros((rows,), jnp.float32),
  )
  lp, lr = pk_ref.shape[0], rk_ref.shape[0]
  bp, br = column_block(lp), column_block(lr)
  carry = jax.lax.fori_loop(0, lp // bp, update(pk_ref, pv_ref, pm_ref, bp), carry)
  first, count = schedule_ref[0], schedule_ref[1]
  ring_step = update(rk_ref, rv_ref, rm_ref, br)
  carry = jax.lax.fori_loop(0, count, lambda i, c: ring_step((first + i) % (lr // br), c), carry)
  acc, _, row_sum = carry
  plgpu.store(o_ref.at[pl.ds(0, rows), :], (acc / row_sum[:, None]).astype(o_ref.dtype), mask=real)


def decode_attention(
  q: jax.Array,
  prompt: tuple[jax.Array, jax.Array, jax.Array],
  ring: tuple[jax.Array, jax.Array, jax.Array],
  column: jax.Array,
  window: jax.Array,
  *,
  interpret: bool = False,
) -> jax.Array:
  """One decode step's attention of every slot over its prompt and its ring window.

  Equal, up to rounding, to `layers.attend(q, [prompt piece, ring window piece])` as
  `slots.slot_attention` reads them (the same contract as the TPU kernel,
  `decode_kernel.decode_attention`). Runs on one device's shard.

  Args:
    q: `[S, 1, K * G, H]` queries (after RoPE), query heads grouped under their kv head.
    prompt: (keys `[S, K, Lp, H]`, values `[S, K, Lp, H]`, mask `bool[S, Lp]`).
    ring: (keys `[S, K, Lr, H]`, values `[S, K, Lr, H]`, mask `bool[S, Lr]`), this
      step's column already written.
    column: `int32[]` the ring column this step wrote (the window's last column).
    window: `int32[]` in [1, Lr], ring columns to read, ending at `column` (wrapping).
    interpret: run the kernel in Pallas' interpreter (any backend; for tests).

  Returns:
    `[S, 1, K * G, H]` in q's dtype.

  Raises:
    ValueError: Lp or Lr not a multiple of 16, or H not a power of two >= 16 (`applies`).
  """
  pk, pv, pm = prompt
  rk, rv, rm = ring
  s, _, n, h = q.shape
  kh, lp, lr = pk.shape[1], pk.shape[2], rk.shape[2]
  if not applies(lp, lr, h):
    raise ValueError(
      f"prompt ({lp}) and ring ({lr}) columns must be multiples of 16 and the head dim"
      f" ({h}) a power of two >= 16"
    )
  g = n // kh
  q = q.reshape(s, kh, g, h)
  # Bytes, not bits: Triton loads a bool mask as its bytes.
  pm, rm = pm.astype(jnp.int8), rm.astype(jnp.int8)
  kv = lambda cols: pl.BlockSpec((None, None, cols, h), lambda i, k: (i, k, 0, 0))
  mask = lambda cols: pl.BlockSpec((None, cols), lambda i, k: (i, 0))
  heads = pl.BlockSpec((None, None, g, h), lambda i, k: (i, k, 0, 0))
  whole = pl.BlockSpec((2,), lambda i, k: (0,))
  rows = max(16, 1 << (g - 1).bit_length())
  nbytes = lambda *xs: sum(x.size * x.dtype.itemsize for x in xs)
  out = pl.pallas_call(
    functools.partial(_kernel, rows=rows, scale=1.0 / math.sqrt(h)),
    grid=(s, kh),
    in_specs=[whole, heads, kv(lp), kv(lp), mask(lp), kv(lr), kv(lr), mask(lr)],
    out_specs=heads,
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    cost_estimate=pl.CostEstimate(
      flops=4 * s * n * (lp + lr) * h,
      transcendentals=s * n * (lp + lr),
      bytes_accessed=nbytes(pk, pv, pm, rk, rv, rm) + 2 * nbytes(q),
    ),
    interpret=interpret,
  )(ring_schedule(column, window, lr), q, pk, pv, pm, rk, rv, rm)
  return out.reshape(s, 1, n, h)
