"""Decode attention over the slot cache as one Pallas TPU kernel (`decode_attention`).

The XLA formulation (`layers.attend` over the cache's pieces) writes each layer's float32
scores to HBM and reads them back for the softmax and the value sum: for grouped-query
attention with G query heads per kv head that is 4 G bytes per cache column against the
512 bytes of a column's bf16 keys and values (H = 128), 10-25 % of a decode step's HBM
traffic at the paper's sizes (XLA:TPU's cost analysis; docs/tpu.md section 7). Here each
block of keys and values is copied into VMEM once and the scores never leave it: an
online softmax over the slot's prompt columns, then over the blocks of its response ring
that the longest live row has written, read in ring order from the block holding the
window's first column (a window that wraps past column 0 is just a rotation). Blocks
outside the window are never copied: their grid steps repeat the last block's index,
which Pallas does not copy again.

Shape letters as in `models.decoder`: S slots, K kv heads, G query heads per kv head, H
head dim, Lp prompt columns, Lr ring columns.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ada_jax.models.layers import MASK_VALUE

# Cache columns per block (the largest that divides the piece, else the whole piece): a
# key block of 8 slots x 512 columns x 128 dims in bf16 is 1 MiB of VMEM.
_COLUMN_BLOCKS = (512, 256, 128)
# The kernel reads the ring as `slots` wrote it (`decode_attention`), unlike the GPU one.
WRITES_RING = False
SLOT_BLOCK = 8


def column_block(columns: int) -> int:
  """Cache columns per kernel block for a piece of `columns` columns."""
  return next((b for b in _COLUMN_BLOCKS if columns % b == 0), columns)


def applies(prompt_columns: int, ring_columns: int, head_dim: int) -> bool:
  """Whether the kernel takes these shapes: always (a piece no block divides is one block)."""
  return True


def ring_schedule(
  column: jax.Array, window: jax.Array, ring: int, block: int | None = None
) -> jax.Array:
  """`int32[2]`: the first ring block the window reads and how many blocks it reads.

  The window is the `window` columns ending at `column`, wrapping past column 0; its
  blocks (of `block` columns, by default this kernel's `column_block`) are read in ring
  order from the one that holds its first column.
  """
  block = column_block(ring) if block is None else block
  start = (column - window + 1) % ring
  count = jnp.minimum((start % block + window + block - 1) // block, ring // block)
  return jnp.stack([start // block, count]).astype(jnp.int32)


def columns_read(
  column: jax.Array, window: jax.Array, ring: int, block: int | None = None
) -> jax.Array:
  """Ring columns the kernel reads per slot for this window (whole blocks)."""
  block = column_block(ring) if block is None else block
  return ring_schedule(column, window, ring, block)[1] * block


def _kernel(
  schedule,
  q_ref,
  pk_ref,
  pv_ref,
  pm_ref,
  rk_ref,
  rv_ref,
  rm_ref,
  o_ref,
  row_max,
  row_sum,
  acc,
  *,
  prompt_blocks,
  scale,
):
  """One (slot block, kv head) over grid steps j: prompt blocks, then ring blocks."""
  j = pl.program_id(2)

  @pl.when(j == 0)
  def _():
    row_max[...] = jnp.full(row_max.shape, MASK_VALUE, jnp.float32)
    row_sum[...] = jnp.zeros(row_sum.shape, jnp.float32)
    acc[...] = jnp.zeros(acc.shape, jnp.float32)

  def update(k_ref, v_ref, mask_ref):
    q = q_ref[:, 0]  # [Sb, G, H]
    s = jnp.einsum("sgh,slh->sgl", q, k_ref[:, 0], preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask_ref[...][:, None, :], s, MASK_VALUE)
    m_new = jnp.maximum(row_max[...], s.max(-1, keepdims=True))
    p = jnp.exp(s - m_new)
    alpha = jnp.exp(row_max[...] - m_new)
    row_sum[...] = alpha * row_sum[...] + p.sum(-1, keepdims=True)
    v = v_ref[:, 0]
    pv = jnp.einsum("sgl,slh->sgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    acc[...] = alpha * acc[...] + pv
    row_max[...] = m_new

  @pl.when(j < prompt_blocks)
  def _():
    update(pk_ref, pv_ref, pm_ref)

  @pl.when((j >= prompt_blocks) & (j - prompt_blocks < schedule[1]))
  def _():
    update(rk_ref, rv_ref, rm_ref)

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    o_ref[:, 0] = (acc[...] / row_sum[...]).astype(o_ref.dtype)


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
  `slots.slot_attention` reads them. Runs on one device's shard (`slots` maps it over the
  mesh with `shard_map`).

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
  """
  pk, pv, pm = prompt
  rk, rv, rm = ring
  s, _, n, h = q.shape
  kh, lp, lr = pk.shape[1], pk.shape[2], rk.shape[2]
  q = q.reshape(s, kh, n // kh, h)
  bp, br = column_block(lp), column_block(lr)
  jp, jr = lp // bp, lr // br
  schedule = ring_schedule(column, window, lr)
  prompt_block = lambda j: jnp.minimum(j, jp - 1)
  ring_block = lambda j, sch: (sch[0] + jnp.clip(j - jp, 0, sch[1] - 1)) % jr
  sb = SLOT_BLOCK if s % SLOT_BLOCK == 0 else s
  kv = lambda cols, at: pl.BlockSpec((sb, 1, cols, h), lambda i, k, j, sch: (i, k, at(j, sch), 0))
  mask = lambda cols, at: pl.BlockSpec((sb, cols), lambda i, k, j, sch: (i, at(j, sch)))
  at_prompt = lambda j, sch: prompt_block(j)
  heads = pl.BlockSpec((sb, 1, n // kh, h), lambda i, k, j, sch: (i, k, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    grid=(s // sb, kh, jp + jr),
    in_specs=[
      heads,
      kv(bp, at_prompt),
      kv(bp, at_prompt),
      mask(bp, at_prompt),
      kv(br, ring_block),
      kv(br, ring_block),
      mask(br, ring_block),
    ],
    out_specs=heads,
    scratch_shapes=[
      pltpu.VMEM((sb, n // kh, 1), jnp.float32),
      pltpu.VMEM((sb, n // kh, 1), jnp.float32),
      pltpu.VMEM((sb, n // kh, h), jnp.float32),
    ],
  )
  columns = lp + lr
  # XLA counts a custom call by the cost it declares. Declared: every operand whole, the
  # worst case (a window of the whole ring) and what XLA's own per-operand accounting of
  # this call lists; a shorter window reads fewer ring blocks.
  nbytes = lambda *xs: sum(x.size * x.dtype.itemsize for x in xs)
  cost = pl.CostEstimate(
    flops=4 * s * n * columns * h,
    transcendentals=s * n * columns,
    bytes_accessed=nbytes(pk, pv, pm, rk, rv, rm) + 2 * nbytes(q),
  )
  out = pl.pallas_call(
    functools.partial(_kernel, prompt_blocks=jp, scale=1.0 / math.sqrt(h)),
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    cost_estimate=cost,
    interpret=interpret,
  )(schedule, q, pk, pv, pm, rk, rv, rm)
  return out.reshape(s, 1, n, h)
