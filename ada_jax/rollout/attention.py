"""Decode attention over the pool's two caches (`slots`): one decode step's write of each
layer's new keys and values and its read of the slot's prompt and the window of its
response ring that the longest live row has written (`slot_attention`), in Pallas kernels
where the platform has them (`decode_kernel` on TPU, `decode_kernel_gpu` on GPU) on each
device's row shard (`row_shards`), elsewhere in XLA's form: the prompt read once per
entry for its live rows (`shared_prompt.attend`) or, on XLA:CPU, from each slot's copy
(`slots.copies_prompts`), and the ring's window, merged into one softmax exactly
(`layers.attend_partial`, `layers.merge_partials`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import PartitionSpec as P

from ada_jax.models import layers as layers_lib
from ada_jax.models import sharding as sharding_lib
from ada_jax.models.decoder import ModelConfig
from ada_jax.rollout import decode_kernel, decode_kernel_gpu, shared_prompt
from ada_jax.rollout import slots as slots_lib


def row_shards(
  config: ModelConfig, mesh: jax.sharding.Mesh | None, slots: int, entries: int
) -> int:
  """D, the shards the mesh's row axes split both the slots and the prompt-cache entries
  into (`slots.kv_shardings`) where decode attention is a Pallas kernel (`uses_kernel`), which
  runs on each device's shard: slot block i (S / D slots) holds the rows of entry block i
  (P / D entries), so the kernel reads a prompt on the devices that hold it. 1 without a
  mesh, in XLA's form (XLA partitions its reads of another device's entries itself, and
  any slot takes any row), or when either cache is replicated (the prompt cache then is
  whole on every device)."""
  if mesh is None or not uses_kernel(mesh):
    return 1
  ways = lambda rows: slots_lib.kv_shardings(config, mesh, rows, 1)[1].spec[0]
  axes = ways(slots)
  if axes is None or axes != ways(entries):
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


def ring_windows(ring: int, block: int) -> tuple[int, ...]:
  """The ring window lengths decode attention can read: multiples of `block` up to Lr."""
  return tuple(sorted({min(ring, block * i) for i in range(1, -(-ring // block) + 1)}))


# The Pallas decode-attention kernels by `platforms.Platform.decode_kernel` name.
KERNELS = {"tpu": decode_kernel, "gpu": decode_kernel_gpu}


def uses_kernel(mesh: jax.sharding.Mesh | None) -> str:
  """The `KERNELS` name of the mesh platform's Pallas decode-attention kernel (where XLA's
  formulation writes every layer's float32 scores to HBM and reads them back), or '' for
  `layers.attend` over the pieces (XLA:CPU). `slot_attention` uses it where the kernel
  `applies` to the cache's shapes, else XLA's form."""
  return sharding_lib.platform(mesh).decode_kernel


def slot_attention(
  cache: slots_lib.SlotCache,
  prompts: slots_lib.PromptCache,
  rows: tuple[jax.Array, jax.Array, int],
  mask: jax.Array,
  window: jax.Array,
  block: int,
  config: ModelConfig | None = None,
  mesh: jax.sharding.Mesh | None = None,
):
  """Each layer's write and read of one decode step (`decoder.forward(attention=...)`).

  The new keys and values go to ring column `cache.column` of every slot; attention reads
  the slot's prompt from its prompt-cache entry, once per entry for all its live rows
  (issue 52), or from the slot's copy where it has one (`slots.copies_prompts`), and a
  window of the ring that ends at that column and covers `window` columns (the longest
  live row's response so far), so the bytes read follow the longest live row. In XLA's
  form the prompt part is `shared_prompt.attend` (or the copy) and the window is the
  smallest of `ring_windows(Lr, block)` that covers it, a `lax.switch` over those lengths,
  a window that wraps past column 0 read as its two static ends (or the whole ring, when
  those would overlap). In a Pallas kernel (`uses_kernel`: `decode_kernel` on TPU,
  `decode_kernel_gpu` on GPU, where the kernel `applies` to the shapes) the window is read
  block by block inside the kernel, whole blocks of its column block, on each device's
  slots and the entries they read (`row_shards`).

  Args:
    cache: the slot cache before this step's write.
    prompts: the prompt cache the slots' rows point into.
    rows: (`entry` `int32[S]` each slot's entry, `live` `bool[S]` slots whose row goes on,
      R the most live rows an entry has: `shared_prompt.group_by_entry`).
    mask: `bool[S, Lr]` the ring mask after this step's write.
    window: `int32[]` ring columns the longest live row has written, this step's included.
    block: the XLA path's window granularity (`sampler.attention_block`).
    config, mesh: the model and the mesh the cache is sharded on (`slots.slot_cache_shardings`);
      the kernel runs on each device's shard.

  Returns:
    (`attention(layer)` for `decoder.forward`, prompt and ring columns each slot reads
    `int32[]`).
  """
  c, ring = cache.column, cache.mask.shape[1]
  prompt_len = prompts.mask.shape[1]
  entry, live, entry_rows = rows
  axes = slots_lib.cache_axes(mesh)
  write = lambda old, new, order: jax.lax.dynamic_update_slice_in_dim(
    old, slots_lib.relayout(new, slots_lib.MODEL_AXES, order).astype(old.dtype), c, order.index("s")
  )
  kernel = uses_kernel(mesh)
  head_dim = cache.v[0].shape[slots_lib.KV_AXES.index("h")]
  if kernel and not KERNELS[kernel].applies(prompt_len, ring, head_dim):
    # Once per compile: a bucket or budget off the kernel's grid costs every layer a switch.
    logging.warning(
      "decode attention: the %s kernel does not take %d prompt / %d ring columns at head dim"
      " %d; XLA's form instead (`%s.applies`)",
      kernel, prompt_len, ring, head_dim, KERNELS[kernel].__name__,
    )  # fmt: skip
    kernel = ""
  if kernel:
    window = jnp.clip(window, 1, ring)
    read = KERNELS[kernel].columns_read(c, window, ring)
    on_shards = functools.partial(_on_shards, config, mesh, kernel, entry_rows=entry_rows)

    def kernel_attention(layer):
      def write_and_read(qkv, positions, inv_freq):
        prompt = (prompts.k[layer], prompts.v[layer], prompts.mask)
        ring = (cache.k[layer], cache.v[layer], mask)
        if KERNELS[kernel].WRITES_RING:
          projections = (qkv[:, 0], positions[:, 0], inv_freq)
          return on_shards(projections, prompt, (entry, live), ring, c, window)
        q, k, v = layers_lib.split_heads(qkv, positions, inv_freq)
        ring = (write(ring[0], k, axes[0]), write(ring[1], v, axes[1]), mask)
        return on_shards((q,), prompt, (entry, live), ring, c, window), ring[:2]

      return write_and_read

    return kernel_attention, prompt_len + read
  copied = cache.prompt_mask is not None
  if not copied:
    groups = shared_prompt.group_by_entry(entry, live, prompts.mask.shape[0], entry_rows)
  lengths = ring_windows(ring, block)
  index = jnp.searchsorted(jnp.asarray(lengths), jnp.clip(window, 1, ring))
  n_read = jnp.asarray(lengths)[index]
  wraps = c < n_read - 1
  read = jnp.where(wraps & (n_read < ring), jnp.where(2 * n_read > ring, ring, 2 * n_read), n_read)
  rows = lambda m: m[:, None, :]  # [S, 1 query, columns]

  def attention(layer):
    def write_and_read(*projections):
      q, k, v = layers_lib.split_heads(*projections)
      ring_k, ring_v = write(cache.k[layer], k, axes[0]), write(cache.v[layer], v, axes[1])
      prompt = (prompts.k[layer], prompts.v[layer], prompts.mask)
      own = lambda pieces: layers_lib.attend_partial(q, pieces, axes)  # the ring's part
      whole = lambda: own([(ring_k, ring_v, rows(mask))])

      def window_of(n):
        if n == ring:
          return whole

        def straight():
          cut = lambda x, order: jax.lax.dynamic_slice_in_dim(x, c - n + 1, n, order.index("s"))
          return own([(cut(ring_k, axes[0]), cut(ring_v, axes[1]), rows(cut(mask, "bs")))])

        def two_ends():
          part = lambda a, b: tuple(
            jax.lax.slice_in_dim(x, a, b, axis=order.index("s"))
            for x, order in ((ring_k, axes[0]), (ring_v, axes[1]), (mask, "bs"))
          )
          return own([(k, v, rows(m)) for k, v, m in (part(0, n), part(ring - n, ring))])

        return lambda: jax.lax.cond(c >= n - 1, straight, whole if 2 * n > ring else two_ends)

      ring_part = jax.lax.switch(index, [window_of(n) for n in lengths])
      if copied:  # the prompt's part outside the switch: its copy is not passed into it
        copy = (cache.prompt_k[layer], cache.prompt_v[layer], rows(cache.prompt_mask))
        prompt_part = layers_lib.attend_partial(q, [copy], axes)
        out = layers_lib.merge_partials([prompt_part, ring_part], prompt[1].dtype)
      else:
        out = shared_prompt.attend(q, prompt, entry, *groups[::-1], ring_part, axes)
      return out, (ring_k, ring_v)

    return write_and_read

  return attention, prompt_len + read


def _on_shards(config, mesh, kernel, queries, prompt, rows, ring, column, window, *, entry_rows):
  """`KERNELS[kernel]` on each device's slots and kv heads and the prompt-cache entries
  those slots read (a Pallas call is not partitioned by XLA; `row_shards`), or whole
  without a mesh; in Pallas' interpreter off the platform it is written for. The kernel
  reads `slots.MODEL_AXES` blocks: the caches' pieces are handed over in that order.

  `queries`: (the roped q `[S, 1, N, H]`,) for a kernel that reads the written ring
  (`decode_attention`; returns the attention), or (qkv `[S, K, G + 2, H]`, positions
  `int32[S]`, inv_freq) for one that rotates and writes it (`WRITES_RING`: `decode_step`;
  returns (the attention, (the ring's keys, values) in `slots.cache_axes` order)). `rows`: the
  slots' entries and live flags (`int32[S]`, `bool[S]`).
  """
  module = KERNELS[kernel]
  writes = module.WRITES_RING
  entry_point = module.decode_step if writes else module.decode_attention
  interpret = sharding_lib.platform(mesh).decode_kernel != kernel

  def run(queries, prompt, rows, ring, c, w):
    entry, live = rows
    local = (entry % prompt[2].shape[0], live)  # a row's entry is in its slots' shard
    return entry_point(
      *queries, prompt, local, ring, c, w, entry_rows=entry_rows, interpret=interpret
    )

  key_axes, value_axes = slots_lib.cache_axes(mesh)
  view = lambda k, v, m: (
    slots_lib.relayout(k, key_axes, slots_lib.MODEL_AXES),
    slots_lib.relayout(v, value_axes, slots_lib.MODEL_AXES),
    m,
  )
  prompt, ring = view(*prompt), view(*ring)
  if mesh is None:
    out = run(queries, prompt, rows, ring, column, window)
  else:
    slot_spec = _spec(config, mesh, *ring[2].shape)
    rows_axes, heads = slot_spec["b"], slot_spec["k"]
    entries = prompt[2].shape[0]
    prompt_spec = _spec(config, mesh, entries, prompt[2].shape[1])
    if row_shards(config, mesh, ring[2].shape[0], entries) == 1:
      prompt_spec["b"] = None  # every device reads any entry
    kv = lambda spec: P(*(spec[a] for a in slots_lib.MODEL_AXES))
    m = lambda spec: P(spec["b"], None)
    attention = P(rows_axes, None, heads, None)
    query_spec = (P(rows_axes, heads, None, None), P(rows_axes), P()) if writes else (attention,)
    out = jax.shard_map(
      run,
      mesh=mesh,
      in_specs=(
        query_spec,
        (kv(prompt_spec), kv(prompt_spec), m(prompt_spec)),
        (P(rows_axes), P(rows_axes)),
        (kv(slot_spec), kv(slot_spec), m(slot_spec)),
        P(),
        P(),
      ),
      out_specs=(attention, kv(slot_spec), kv(slot_spec)) if writes else attention,
      check_vma=False,
    )(queries, prompt, rows, ring, column, window)
  if not writes:
    return out
  attention, k, v = out
  return attention, (
    slots_lib.relayout(k, slots_lib.MODEL_AXES, key_axes),
    slots_lib.relayout(v, slots_lib.MODEL_AXES, value_axes),
  )


def _spec(config, mesh, rows: int, columns: int) -> dict:
  """The mesh axes of each `slots.KV_AXES` letter of a cache of `rows` rows
  (`slots.kv_shardings`)."""
  spec = slots_lib.kv_shardings(config, mesh, rows, columns)[0].spec
  return dict(zip(slots_lib.KV_AXES, tuple(spec) + (None,) * 4, strict=False))
