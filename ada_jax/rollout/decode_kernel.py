"""Decode attention over the slot cache as one Pallas TPU kernel (`decode_attention`).

The XLA formulation (`layers.attend` over the cache's pieces) writes each layer's float32
scores to HBM and reads them back for the softmax and the value sum: for grouped-query
attention with G query heads per kv head that is 4 G bytes per cache column against the
512 bytes of a column's bf16 keys and values (H = 128), 10-25 % of a decode step's HBM
traffic at the paper's sizes (XLA:TPU's cost analysis; docs/tpu.md section 7). Here each
block of keys and values is copied into VMEM once and the scores never leave it, in two
calls (the two-level form of shared-prompt decode, issue 52): an online softmax of each
prompt-cache entry's live rows over its prompt, read once for all of them
(`prompt_attention`: the entry of each grid step a scalar prefetched), then, per slot,
that softmax continued over the blocks of the slot's response ring that the longest live
row has written, read in ring order from the block holding the window's first column (a
window that wraps past column 0 is just a rotation). Blocks no step needs are never
copied: their grid steps repeat the last block's index, which Pallas does not copy again.

Shape letters as in `models.decoder`: S slots, P prompt-cache entries, R rows per entry,
K kv heads, G query heads per kv head, H head dim, Lp prompt columns, Lr ring columns.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ada_jax.models.layers import MASK_VALUE
from ada_jax.rollout import shared_prompt

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


def _online_update(q, k, v, mask, row_max, row_sum, acc, scale):
  """One block of the online softmax: queries `[B, G, H]` against keys and values `[B, L,
  H]` (mask `bool[B, L]`) into the running max, sum and value sum (VMEM refs)."""
  s = jnp.einsum("bgh,blh->bgl", q, k, preferred_element_type=jnp.float32) * scale
  s = jnp.where(mask[:, None, :], s, MASK_VALUE)
  m_new = jnp.maximum(row_max[...], s.max(-1, keepdims=True))
  p = jnp.exp(s - m_new)
  alpha = jnp.exp(row_max[...] - m_new)
  row_sum[...] = alpha * row_sum[...] + p.sum(-1, keepdims=True)
  pv = jnp.einsum("bgl,blh->bgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  acc[...] = alpha * acc[...] + pv
  row_max[...] = m_new


def _prompt_kernel(
  schedule, q_ref, k_ref, v_ref, m_ref, o_ref, lse_ref, row_max, row_sum, acc, *, scale
):
  """One (entry, kv head) over grid steps j, its prompt's blocks: the R rows' G heads as
  R·G query rows. A dead entry computes nothing and writes lse = MASK_VALUE, out = 0."""
  e, j = pl.program_id(0), pl.program_id(2)

  @pl.when(j == 0)
  def _():
    row_max[...] = jnp.full(row_max.shape, MASK_VALUE, jnp.float32)
    row_sum[...] = jnp.zeros(row_sum.shape, jnp.float32)
    acc[...] = jnp.zeros(acc.shape, jnp.float32)

  @pl.when(schedule[0, e] > 0)
  def _():
    _online_update(q_ref[0], k_ref[0], v_ref[0], m_ref[0], row_max, row_sum, acc, scale)

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    total = row_sum[...]
    some = total > 0
    o_ref[0] = jnp.where(some, acc[...] / jnp.where(some, total, 1.0), 0.0).astype(o_ref.dtype)
    lse_ref[0] = jnp.where(some, row_max[...] + jnp.log(jnp.where(some, total, 1.0)), MASK_VALUE)


def _ring_kernel(
  schedule, q_ref, po_ref, plse_ref, k_ref, v_ref, m_ref, o_ref, row_max, row_sum, acc, *, scale
):
  """One (slot block, kv head) over grid steps j, the ring window's blocks, from the
  softmax over the slot's prompt (normalised output and log-sum-exp: max lse, sum 1)."""
  j = pl.program_id(2)

  @pl.when(j == 0)
  def _():
    row_max[...] = plse_ref[:, 0]
    row_sum[...] = jnp.ones(row_sum.shape, jnp.float32)
    acc[...] = po_ref[:, 0].astype(jnp.float32)

  @pl.when(j < schedule[1])
  def _():
    _online_update(q_ref[:, 0], k_ref[:, 0], v_ref[:, 0], m_ref[...], row_max, row_sum, acc, scale)

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    o_ref[:, 0] = (acc[...] / row_sum[...]).astype(o_ref.dtype)


def _scratch(rows: int, g: int, h: int):
  return [
    pltpu.VMEM((rows, g, 1), jnp.float32),
    pltpu.VMEM((rows, g, 1), jnp.float32),
    pltpu.VMEM((rows, g, h), jnp.float32),
  ]


def _nbytes(*xs) -> int:
  return sum(x.size * x.dtype.itemsize for x in xs)


def prompt_attention(q, prompt, rows, *, entry_rows: int, interpret: bool = False):
  """The softmax of every slot's query over its prompt, read once per prompt-cache entry
  for all the entry's live rows (issue 52): grid (entry, kv head, prompt block), the R
  rows' G query heads one block of R·G query rows. A dead entry's steps repeat the block
  index of the last live entry before it, which Pallas does not copy again, so the bytes
  read are the live entries' prompts.

  Args:
    q: `[S, 1, K * G, H]` queries (after RoPE).
    prompt: (keys `[P, K, Lp, H]`, values, mask `bool[P, Lp]`), the prompt cache's entries.
    rows: (`entry` `int32[S]` each slot's entry, `live` `bool[S]` slots whose row goes on).
    entry_rows: R, the most live rows an entry has (`shared_prompt.group_by_entry`).
    interpret: run in Pallas' interpreter.

  Returns:
    (`[S, K, G, H]` each slot's attention over its prompt in q's dtype, `float32[S, K, G,
    1]` its log-sum-exp, MASK_VALUE for a slot whose entry has no live row).
  """
  pk, pv, pm = prompt
  entry, live = rows
  members, rank = shared_prompt.group_by_entry(entry, live, pk.shape[0], entry_rows)
  s, _, n, h = q.shape
  entries, kh, lp = pk.shape[0], pk.shape[1], pk.shape[2]
  g, r = n // kh, members.shape[1]
  grouped = q[jnp.minimum(members, s - 1), 0].reshape(entries, r, kh, g, h)
  grouped = grouped.transpose(0, 2, 1, 3, 4).reshape(entries, kh, r * g, h)
  has_rows = (members < s).any(1)
  # The entry whose blocks a step reads: its own when it has rows, else the last such one's.
  last = jax.lax.cummax(jnp.where(has_rows, jnp.arange(entries), -1))
  schedule = jnp.stack([has_rows.astype(jnp.int32), jnp.maximum(last, 0)]).astype(jnp.int32)
  bp = column_block(lp)
  jp = lp // bp
  at = lambda e, k, j, sch: (
    sch[1, e],
    jnp.where(sch[0, e] > 0, k, kh - 1),
    jnp.where(sch[0, e] > 0, j, jp - 1),
  )
  kv = pl.BlockSpec((1, 1, bp, h), lambda e, k, j, sch: (*at(e, k, j, sch), 0))

  # The mask as [P, 1, Lp]: Mosaic tiles a block's last two dimensions.
  def mask_at(e, k, j, sch):
    read, _, block = at(e, k, j, sch)
    return read, 0, block

  mask = pl.BlockSpec((1, 1, bp), mask_at)
  queries = pl.BlockSpec((1, 1, r * g, h), lambda e, k, j, sch: (e, k, 0, 0))
  lse = pl.BlockSpec((1, 1, r * g, 1), lambda e, k, j, sch: (e, k, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    grid=(entries, kh, jp),
    in_specs=[queries, kv, kv, mask],
    out_specs=[queries, lse],
    scratch_shapes=_scratch(1, r * g, h),
  )
  # Declared for the roofline's step (`plan.programs.live_kv`: every slot live, R rows per
  # live entry, so S / R entries read; XLA cannot see which entries a step reads), the
  # queries and the outputs whole.
  live_entries = min(entries, -(-s // r))
  cost = pl.CostEstimate(
    flops=4 * live_entries * r * n * lp * h,
    transcendentals=live_entries * r * n * lp,
    bytes_accessed=_nbytes(pk, pv, pm) * live_entries // entries + 2 * _nbytes(grouped),
  )
  out, lse_out = pl.pallas_call(
    functools.partial(_prompt_kernel, scale=1.0 / math.sqrt(h)),
    grid_spec=grid_spec,
    out_shape=[
      jax.ShapeDtypeStruct(grouped.shape, q.dtype),
      jax.ShapeDtypeStruct((entries, kh, r * g, 1), jnp.float32),
    ],
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    cost_estimate=cost,
    interpret=interpret,
  )(schedule, grouped, pk, pv, pm[:, None, :])
  slot_rows = lambda x: x.reshape(entries, kh, r, g, -1)[entry, :, jnp.minimum(rank, r - 1)]
  return slot_rows(out), slot_rows(lse_out)


def decode_attention(
  q: jax.Array,
  prompt: tuple[jax.Array, jax.Array, jax.Array],
  rows: tuple[jax.Array, jax.Array],
  ring: tuple[jax.Array, jax.Array, jax.Array],
  column: jax.Array,
  window: jax.Array,
  *,
  entry_rows: int,
  interpret: bool = False,
) -> jax.Array:
  """One decode step's attention of every slot over its prompt and its ring window.

  Equal, up to rounding, to `layers.attend(q, [the slot's prompt, ring window piece])` as
  `attention.slot_attention` reads them. Two calls: `prompt_attention` (each prompt read once
  for its live rows), then the ring's blocks continue that softmax from its output and
  log-sum-exp. Runs on one device's shard (`slots` maps it over the mesh with
  `shard_map`: the shard's slots and the entries they read).

  Args:
    q: `[S, 1, K * G, H]` queries (after RoPE), query heads grouped under their kv head.
    prompt, rows, entry_rows: as `prompt_attention`.
    ring: (keys `[S, K, Lr, H]`, values `[S, K, Lr, H]`, mask `bool[S, Lr]`), this
      step's column already written.
    column: `int32[]` the ring column this step wrote (the window's last column).
    window: `int32[]` in [1, Lr], ring columns to read, ending at `column` (wrapping).
    interpret: run the kernel in Pallas' interpreter (any backend; for tests).

  Returns:
    `[S, 1, K * G, H]` in q's dtype.
  """
  rk, rv, rm = ring
  s, _, n, h = q.shape
  kh, lr = rk.shape[1], rk.shape[2]
  g = n // kh
  prompt_out, prompt_lse = prompt_attention(
    q, prompt, rows, entry_rows=entry_rows, interpret=interpret
  )
  q = q.reshape(s, kh, g, h)
  br = column_block(lr)
  jr = lr // br
  schedule = ring_schedule(column, window, lr)
  ring_block = lambda j, sch: (sch[0] + jnp.minimum(j, sch[1] - 1)) % jr
  sb = SLOT_BLOCK if s % SLOT_BLOCK == 0 else s
  kv = pl.BlockSpec((sb, 1, br, h), lambda i, k, j, sch: (i, k, ring_block(j, sch), 0))
  mask = pl.BlockSpec((sb, br), lambda i, k, j, sch: (i, ring_block(j, sch)))
  heads = pl.BlockSpec((sb, 1, g, h), lambda i, k, j, sch: (i, k, 0, 0))
  lse = pl.BlockSpec((sb, 1, g, 1), lambda i, k, j, sch: (i, k, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    grid=(s // sb, kh, jr),
    in_specs=[heads, heads, lse, kv, kv, mask],
    out_specs=heads,
    scratch_shapes=_scratch(sb, g, h),
  )
  # Declared: every operand whole, the worst case (a window of the whole ring) and what
  # XLA's own per-operand accounting of this call lists; a shorter window reads fewer.
  cost = pl.CostEstimate(
    flops=4 * s * n * lr * h,
    transcendentals=s * n * lr,
    bytes_accessed=_nbytes(rk, rv, rm, prompt_out, prompt_lse) + 2 * _nbytes(q),
  )
  out = pl.pallas_call(
    functools.partial(_ring_kernel, scale=1.0 / math.sqrt(h)),
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    cost_estimate=cost,
    interpret=interpret,
  )(schedule, q, prompt_out, prompt_lse, rk, rv, rm)
  return out.reshape(s, 1, n, h)
