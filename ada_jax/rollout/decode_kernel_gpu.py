"""One decode step's attention of every slot as one Pallas GPU kernel (Triton lowering):
RoPE, the cache write and the read.

XLA:GPU's formulation (`layers.attend` over the cache's pieces) costs every layer of every
decode step: a concatenation of the prompt keys and the ring window into a new buffer
(XLA's dot merger), float32 scores written to HBM and read back by the softmax and the
value sum, several small kernels, and a `lax.switch` over window lengths (a conditional
per layer, `attention.slot_attention`). Here one kernel per layer reads the layer's q, k and v
projections as the qkv gemm wrote them, rotates q and the new key (RoPE), writes the new
key and value into the ring column in place (the ring arrays are aliased to its outputs),
and reads each slot's keys and values once in bf16, keeping the scores in registers (an
online softmax over the new token, the prompt columns of the slot's prompt-cache entry,
then the blocks of the ring window in ring order), the window's length as data: no
conditional, no concatenation, no score in HBM, and no separate RoPE or cache-write
kernels (issue 51, items 2 and 3). A decode
step is launch-bound on GPU (an H100's steps took 1.1-1.2x an H200's, whose bandwidth is
1.4x), so kernels per layer are what it pays for.

One program per (slot, kv head): its G query heads are the rows of the score tile, padded
to a power of two of at least 16 (Triton's smallest dot), the padding rows masked out of
the loads and the store. RoPE's rotate-half pairs the two halves of the head dim, so q
and k are held as their halves and a score is the sum of two dots of H / 2. The new
column is not read back from the cache (a program does not see its own store without a
barrier): its score comes from the registers and the ring's read masks that column out.
Cache columns go in blocks of `column_block` (the largest of 128, 64, 32, 16 dividing the
piece), so the kernel applies to pieces whose column counts are multiples of 16 and whose
head dim is a power of two of at least 32 (`applies`: Triton's tiles are powers of two,
its dots at least 16 deep); elsewhere `slots` keeps XLA's form.

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
# RoPE and the ring's write happen inside (`decode_step`), not in `slots`.
WRITES_RING = True


def column_block(columns: int) -> int | None:
  """Cache columns per kernel block for a piece of `columns` columns (None: none divides)."""
  return next((b for b in _COLUMN_BLOCKS if columns % b == 0), None)


def applies(prompt_columns: int, ring_columns: int, head_dim: int) -> bool:
  """Whether the kernel takes pieces of these column counts (both multiples of 16) and
  this head dim (a power of two, at least 32: two halves of at least 16)."""
  pieces = column_block(prompt_columns) is not None and column_block(ring_columns) is not None
  return pieces and head_dim >= 32 and head_dim & (head_dim - 1) == 0


def ring_schedule(column: jax.Array, window: jax.Array, ring: int) -> jax.Array:
  """`int32[2]`: the first ring block the window reads and how many (`column_block`
  columns each; as the TPU kernel's `decode_kernel.ring_schedule`)."""
  return decode_kernel.ring_schedule(column, window, ring, column_block(ring))


def columns_read(column: jax.Array, window: jax.Array, ring: int) -> jax.Array:
  """Ring columns the kernel reads per slot for this window (whole blocks)."""
  return decode_kernel.columns_read(column, window, ring, column_block(ring))


def _kernel(
  scalars_ref, position_ref, entry_ref, freq_ref, qkv_ref, pk_ref, pv_ref, pm_ref, rk_ref, rv_ref,
  rm_ref, o_ref, ok_ref, ov_ref, *, rows, scale,
):  # fmt: skip
  """One (slot, kv head): RoPE, the new column's write, then one softmax over the new
  token, the prompt's blocks and the ring window's."""
  g, h = qkv_ref.shape[0] - 2, qkv_ref.shape[1]
  half, dt = h // 2, qkv_ref.dtype
  first, count, column = scalars_ref[0], scalars_ref[1], scalars_ref[2]
  real = (jnp.arange(rows) < g)[:, None]
  # As `layers.apply_rope`: float32 angles, cos and sin cast to the activations' dtype.
  angles = position_ref[0].astype(jnp.float32) * freq_ref[...][None, :]
  cos, sin = jnp.cos(angles).astype(dt), jnp.sin(angles).astype(dt)

  def rope(lo, hi):
    return lo * cos - hi * sin, hi * cos + lo * sin

  lo, hi = pl.ds(0, half), pl.ds(half, half)
  q1, q2 = rope(
    *(plgpu.load(qkv_ref.at[pl.ds(0, rows), x], mask=real, other=0.0) for x in (lo, hi))
  )
  k1, k2 = rope(qkv_ref[pl.ds(g, 1), lo], qkv_ref[pl.ds(g, 1), hi])
  v = qkv_ref[pl.ds(g + 1, 1), :]
  here = pl.ds(column, 1)
  ok_ref[here, lo], ok_ref[here, hi], ov_ref[here, :] = k1, k2, v

  def update(k_ref, v_ref, m_ref, block, skip, at=()):
    # `at`: the leading indices of a prompt-cache entry's block, in the same indexer as the
    # columns (Triton's lowering takes one indexer per load).
    def step(i, carry):
      acc, row_max, row_sum = carry
      cols = pl.ds(i * block, block)
      keep = (m_ref[(*at[:1], cols)] != 0) & (i * block + jnp.arange(block) != skip)
      k = lambda part: k_ref[(*at, cols, part)]
      s = pl.dot(q1, k(lo), trans_b=True) + pl.dot(q2, k(hi), trans_b=True)
      s = jnp.where(keep[None, :], s * scale, MASK_VALUE)  # [rows, block] float32
      new_max = jnp.maximum(row_max, s.max(axis=1))
      p = jnp.exp(s - new_max[:, None])
      alpha = jnp.exp(row_max - new_max)
      v = v_ref[(*at, cols, slice(None))]
      acc = alpha[:, None] * acc + pl.dot(p.astype(v.dtype), v)
      return acc, new_max, alpha * row_sum + p.sum(axis=1)

    return step

  # The new token first, from registers: its score, weight 1 and its value.
  f32 = lambda x: x.astype(jnp.float32)
  mine = (f32(q1) * f32(k1)).sum(axis=1) + (f32(q2) * f32(k2)).sum(axis=1)
  mine = jnp.where(rm_ref[column] != 0, mine * scale, MASK_VALUE)
  carry = (jnp.broadcast_to(f32(v), (rows, h)), mine, jnp.ones((rows,), jnp.float32))
  lp, lr = pk_ref.shape[2], rk_ref.shape[0]
  bp, br = column_block(lp), column_block(lr)
  at = (entry_ref[0], pl.program_id(1))  # the slot's entry, the program's kv head
  carry = jax.lax.fori_loop(0, lp // bp, update(pk_ref, pv_ref, pm_ref, bp, -1, at), carry)
  ring_step = update(rk_ref, rv_ref, rm_ref, br, column)
  carry = jax.lax.fori_loop(0, count, lambda i, c: ring_step((first + i) % (lr // br), c), carry)
  acc, _, row_sum = carry
  plgpu.store(o_ref.at[pl.ds(0, rows), :], (acc / row_sum[:, None]).astype(o_ref.dtype), mask=real)


def decode_step(
  qkv: jax.Array,
  positions: jax.Array,
  inv_freq: jax.Array,
  prompt: tuple[jax.Array, jax.Array, jax.Array],
  rows: tuple[jax.Array, jax.Array],
  ring: tuple[jax.Array, jax.Array, jax.Array],
  column: jax.Array,
  window: jax.Array,
  *,
  entry_rows: int = 0,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One decode step's attention of every slot: RoPE, the write of the new key and value
  at ring column `column`, and the read of the prompt and the ring window.

  Equal, up to rounding, to `layers.split_heads`, the ring's `dynamic_update_slice` at
  `column` and `layers.attend(q, [prompt piece, ring window piece])` as
  `attention.slot_attention` computes them in XLA's form. Runs on one device's shard; the ring
  arrays are updated in place (aliased to the outputs).

  Args:
    qkv: `[S, K, G + 2, H]` the layer's projections before RoPE (`layers.Attention`).
    positions: `int32[S]` the new token's position in each slot's row.
    inv_freq: `float32[H // 2]` (`layers.rope_frequencies`).
    prompt: (keys `[P, K, Lp, H]`, values `[P, K, Lp, H]`, mask `bool[P, Lp]`), the
      prompt-cache entries, read whole by each program at its slot's entry.
    rows: (`entry` `int32[S]` each slot's entry, `live` `bool[S]`: unused, as
      `entry_rows`: the TPU kernel's grouping is not this one's).
    ring: (keys `[S, K, Lr, H]`, values `[S, K, Lr, H]` before this step's write, mask
      `bool[S, Lr]` after it: True at `column` for a live slot).
    column: `int32[]` the ring column this step writes (the window's last column).
    window: `int32[]` in [1, Lr], ring columns to read, ending at `column` (wrapping).
    interpret: run the kernel in Pallas' interpreter (any backend; for tests).

  Returns:
    (`[S, 1, K * G, H]` in qkv's dtype, the ring's keys and values with the new column).

  Raises:
    ValueError: Lp or Lr not a multiple of 16, or H not a power of two >= 32 (`applies`).
  """
  pk, pv, pm = prompt
  entry = rows[0].astype(jnp.int32)
  rk, rv, rm = ring
  s, kh, g2, h = qkv.shape
  lp, lr = pk.shape[2], rk.shape[2]
  if not applies(lp, lr, h):
    raise ValueError(
      f"prompt ({lp}) and ring ({lr}) columns must be multiples of 16 and the head dim"
      f" ({h}) a power of two >= 32"
    )
  g = g2 - 2
  # Bytes, not bits: Triton loads a bool mask as its bytes.
  pm, rm = pm.astype(jnp.int8), rm.astype(jnp.int8)
  kv = lambda cols: pl.BlockSpec((None, None, cols, h), lambda i, k: (i, k, 0, 0))
  mask = lambda cols: pl.BlockSpec((None, cols), lambda i, k: (i, 0))
  entries = lambda x: pl.BlockSpec(x.shape, lambda i, k: (0,) * x.ndim)
  whole = lambda n: pl.BlockSpec((n,), lambda i, k: (0,))
  heads = lambda n: pl.BlockSpec((None, None, n, h), lambda i, k: (i, k, 0, 0))
  rows = max(16, 1 << (g - 1).bit_length())
  nbytes = lambda *xs: sum(x.size * x.dtype.itemsize for x in xs)
  scalars = jnp.concatenate([ring_schedule(column, window, lr), column[None]])
  out_shape = jax.ShapeDtypeStruct((s, kh, g, h), qkv.dtype)
  out, rk, rv = pl.pallas_call(
    functools.partial(_kernel, rows=rows, scale=1.0 / math.sqrt(h)),
    grid=(s, kh),
    in_specs=[
      whole(3),
      pl.BlockSpec((1,), lambda i, k: (i,)),
      pl.BlockSpec((1,), lambda i, k: (i,)),
      whole(h // 2),
      heads(g2),
      entries(pk),
      entries(pv),
      entries(pm),
      kv(lr),
      kv(lr),
      mask(lr),
    ],  # fmt: skip
    out_specs=[heads(g), kv(lr), kv(lr)],
    out_shape=[
      out_shape,
      jax.ShapeDtypeStruct(rk.shape, rk.dtype),
      jax.ShapeDtypeStruct(rv.shape, rv.dtype),
    ],
    input_output_aliases={8: 1, 9: 2},
    compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    cost_estimate=pl.CostEstimate(
      flops=4 * s * kh * g * (lp + lr) * h,
      transcendentals=s * kh * g * (lp + lr),
      # Each program reads its slot's entry: S prompts' bytes (an entry's rows may share
      # them in L2; HBM counted as if not).
      bytes_accessed=nbytes(pk, pv, pm) * s // pk.shape[0] + nbytes(rk, rv, rm, qkv, out_shape),
    ),
    interpret=interpret,
  )(scalars, positions.astype(jnp.int32), entry, inv_freq, qkv, pk, pv, pm, rk, rv, rm)
  return out.reshape(s, 1, kh * g, h), rk, rv
