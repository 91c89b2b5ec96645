"""The rollout pool's two KV caches, owned here whole: the prompt cache (`PromptCache`, one
entry per prefilled prompt) and the slots' cache (`SlotCache`), their axis orders
(`cache_axes`), shapes, shardings, the store of prefilled prompts, the row shards that keep
a row beside its prompt (`row_shards`), the one write per decode step and the bounded
read. No other module
indexes a cache array: the model hands keys and values over in its own order and the
Pallas kernel reads its own (both `MODEL_AXES`), and this module converts.

A slot holds only its row's response: a ring of Lr columns that every slot writes at one
shared column per decode step, a `dynamic_update_slice`, which XLA:TPU performs in place
(per-row write positions, a scatter, made it hold a second copy of the cache, and a
`[B, K, H, S]` key layout a transposed one). Keys carry their RoPE positions, so where a
key sits does not change attention; a per-slot mask says which ring columns are the row's.
The row's prompt stays in its prompt-cache entry (`SlotState.entry`). Decode attention
reads each entry's prompt once for all its live rows and the window of the ring that the
longest live row has written: in Pallas kernels where the platform has them
(`decode_kernel` on TPU, `decode_kernel_gpu` on GPU), on each device's row shard
(`row_shards`), elsewhere `shared_prompt.attend` and `layers.attend_partial` over the
pieces (one softmax, merged exactly).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from absl import logging
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ada_jax.models import layers as layers_lib
from ada_jax.models import sharding as sharding_lib
from ada_jax.models.decoder import ModelConfig
from ada_jax.rollout import decode_kernel, decode_kernel_gpu, shared_prompt

# ----------------------------------------------------------------------------- layout

# Both caches' axis order in `layers.attend`'s letters: b row (a slot, or a prompt entry),
# k kv head, s column, h head dim; the keys' where the platform has no order of its own
# (`cache_axes`). Every shape, write, read and sharding below derives from them, so another
# order is a change of this line alone (tests/test_pool.py decodes the same tokens in two
# others). This one is what the model hands over and the kernel reads (`MODEL_AXES`: no
# transposes) and what XLA:TPU writes in place; another order costs the TPU kernel path a
# transposed copy of every layer's cache per decode step (`_on_shards`).
KV_AXES = "bksh"
# Describes, does not set: the order of `layers.Attention`'s new keys and values and of
# `decode_kernel`'s blocks.
MODEL_AXES = "bksh"
_LOGICAL = {"b": "batch", "k": "kv_heads", "s": "length", "h": "head_dim"}


def cache_axes(mesh: jax.sharding.Mesh | None) -> tuple[str, str]:
  """(the keys' axis order, the values') of both caches on the mesh's platform (JAX's
  default backend without a mesh): `KV_AXES`, the keys in the platform's own order where
  it has one (`platforms.Platform.key_axes`: XLA:CPU's score dot reads `[.., H, S]` keys
  as they lie). Read when traced, never cached."""
  return sharding_lib.platform(mesh).key_axes or KV_AXES, KV_AXES


def _relayout(x: jax.Array, src: str, dst: str) -> jax.Array:
  return x if src == dst else jnp.einsum(f"{src}->{dst}", x)


def kv_shape(config: ModelConfig, rows: int, columns: int, axes: str = "") -> tuple[int, ...]:
  """One layer's keys or values of `rows` rows and `columns` columns in `axes` order
  (`KV_AXES` by default)."""
  sizes = {"b": rows, "k": config.num_kv_heads, "s": columns, "h": config.head_dim}
  return tuple(sizes[a] for a in axes or KV_AXES)


def _empty(config: ModelConfig, rows: int, columns: int, mesh):
  """(keys, values) per layer in `cache_axes(mesh)` order, zeros in the compute dtype, and
  an all-False `bool[rows, columns]` mask."""
  zeros = lambda axes: tuple(
    jnp.zeros(kv_shape(config, rows, columns, axes), config.compute_dtype)
    for _ in range(config.num_layers)
  )
  key_axes, value_axes = cache_axes(mesh)
  return zeros(key_axes), zeros(value_axes), jnp.zeros((rows, columns), bool)


def kv_shardings(
  config: ModelConfig, mesh: jax.sharding.Mesh, rows: int, columns: int, axes: str = ""
) -> tuple[NamedSharding, NamedSharding]:
  """(one layer's keys or values in `axes` order, `KV_AXES` by default; the `bool[rows,
  columns]` mask) sharded: rows over the data axes, kv heads over 'tensor' (each
  replicated when not divisible), columns and head dim whole (`sharding.model_rules`)."""
  rules = sharding_lib.model_rules(config, mesh)
  spec = lambda names, shape: NamedSharding(
    mesh, sharding_lib.logical_to_spec(names, shape, mesh, rules=rules)
  )
  axes = axes or KV_AXES
  kv = spec(tuple(_LOGICAL[a] for a in axes), kv_shape(config, rows, columns, axes))
  return kv, spec(("batch", "length"), (rows, columns))


def _kv_shardings(config, mesh, rows: int, columns: int):
  """(keys' sharding, values', the mask's) of a cache of `rows` rows on `mesh`."""
  key_axes, value_axes = cache_axes(mesh)
  k, mask = kv_shardings(config, mesh, rows, columns, key_axes)
  return k, kv_shardings(config, mesh, rows, columns, value_axes)[0], mask


def row_shards(
  config: ModelConfig, mesh: jax.sharding.Mesh | None, slots: int, entries: int
) -> int:
  """D, the shards the mesh's row axes split both the slots and the prompt-cache entries
  into (`kv_shardings`) where decode attention is a Pallas kernel (`uses_kernel`), which
  runs on each device's shard: slot block i (S / D slots) holds the rows of entry block i
  (P / D entries), so the kernel reads a prompt on the devices that hold it. 1 without a
  mesh, in XLA's form (XLA partitions its reads of another device's entries itself, and
  any slot takes any row), or when either cache is replicated (the prompt cache then is
  whole on every device)."""
  if mesh is None or not uses_kernel(mesh):
    return 1
  ways = lambda rows: kv_shardings(config, mesh, rows, 1)[1].spec[0]
  axes = ways(slots)
  if axes is None or axes != ways(entries):
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


@struct.dataclass
class SlotCache:
  """The pool's own KV cache: each slot's ring of response columns. A slot's prompt is read
  from its row's prompt-cache entry, once per decode step for all the rows that share it
  (`shared_prompt`, issue 52).

  Response token j of a row that started when the ring stood at column c0 sits at ring
  column (c0 + j) mod Lr; a row writes at most Lr - 1 of them (its last token is never
  decoded), so it never overwrites its own columns. All slots write the same column at a
  step (`column`), live or not: a dead slot's column is masked out.

  Attributes:
    k, v: per layer `dtype[S, K, Lr, H]` (in `cache_axes` order), the response ring
      (keys after RoPE).
    mask: `bool[S, Lr]`, True at ring columns that hold the slot's row's response tokens.
    column: `int32[]`, the ring column the next decode step writes.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  mask: jax.Array
  column: jax.Array


def slot_cache_shardings(
  config: ModelConfig, mesh: jax.sharding.Mesh, slots: int, max_new_tokens: int
) -> SlotCache:
  """Shardings of a `SlotCache`: slots over ('data', 'fsdp'), kv heads over 'tensor'
  (`kv_shardings`), the ring column replicated."""
  k, v, mask = _kv_shardings(config, mesh, slots, max_new_tokens)
  layers = config.num_layers
  return SlotCache(
    k=(k,) * layers, v=(v,) * layers, mask=mask, column=sharding_lib.replicated(mesh)
  )


def init_slot_cache(
  config: ModelConfig, slots: int, max_new_tokens: int, mesh: jax.sharding.Mesh | None = None
) -> SlotCache:
  """An empty cache of `slots` slots of `max_new_tokens` ring columns each, the ring at
  column 0 (sharded by `slot_cache_shardings` with a mesh)."""
  k, v, mask = _empty(config, slots, max_new_tokens, mesh)
  return constrain(config, SlotCache(k, v, mask, jnp.zeros((), jnp.int32)), mesh)


def constrain(config: ModelConfig, cache: SlotCache, mesh) -> SlotCache:
  """`cache` constrained to `slot_cache_shardings` inside jit (unchanged without a mesh)."""
  if mesh is None:
    return cache
  sh = slot_cache_shardings(config, mesh, *cache.mask.shape)
  return jax.tree.map(jax.lax.with_sharding_constraint, cache, sh)


@struct.dataclass
class PromptCache:
  """Prefilled prompts, one entry per distinct prompt (P entries).

  Attributes:
    k: per layer, keys after RoPE `dtype[P, K, Lp, H]` (in `cache_axes` order).
    v: per layer, values `dtype[P, K, Lp, H]` (in `cache_axes` order).
    mask: `bool[P, Lp]`, True at real (non-padding) prompt tokens; prompts left-padded.
    hidden: `float32[P, D]`, the final-normed hidden state at each prompt's last token
      (its next-token logits are `decoder.unembed` of it).
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  mask: jax.Array
  hidden: jax.Array


def constrain_prompts(config: ModelConfig, prompts: PromptCache, mesh) -> PromptCache:
  """Entries over ('data', 'fsdp') and kv heads over 'tensor', as the slot cache: a
  replicated prompt cache of a 3B model's 4·P entries of 1,024 columns would take about
  20 GiB on every device."""
  if mesh is None:
    return prompts
  k, v, mask = _kv_shardings(config, mesh, *prompts.mask.shape)
  fit = jax.lax.with_sharding_constraint
  return prompts.replace(
    k=tuple(fit(x, k) for x in prompts.k),
    v=tuple(fit(x, v) for x in prompts.v),
    mask=fit(prompts.mask, mask),
  )


def empty_prompt_cache(
  config: ModelConfig, entries: int, prompt_len: int, mesh: jax.sharding.Mesh | None = None
) -> PromptCache:
  """A prompt cache of `entries` empty entries of `prompt_len` columns (sharded like the
  slot cache when `mesh` is given)."""
  k, v, mask = _empty(config, entries, prompt_len, mesh)
  prompts = PromptCache(k, v, mask, jnp.zeros((entries, config.embed_dim), jnp.float32))
  return constrain_prompts(config, prompts, mesh)


def store_prompts(
  config: ModelConfig, prompts: PromptCache, entries, kvs, mask, hidden, mesh=None
) -> PromptCache:
  """`prompts` with entries `entries` (`int32[N]`; an entry `>= P` is dropped: padding)
  holding N prefilled prompts: per layer their (keys, values) as the model returns them
  (`MODEL_AXES`, `[N, K, Lp, H]`), their `bool[N, Lp]` mask and `float32[N, D]` last
  hidden states (`pool.prefill_prompts`)."""
  key_axes, value_axes = cache_axes(mesh)

  def put(old, new, axes):
    rows = (slice(None),) * axes.index("b") + (entries,)
    return old.at[rows].set(_relayout(new, MODEL_AXES, axes).astype(old.dtype), mode="drop")

  at = lambda old, new: old.at[entries].set(new.astype(old.dtype), mode="drop")
  updated = PromptCache(
    k=tuple(put(old, k, key_axes) for old, (k, _) in zip(prompts.k, kvs, strict=True)),
    v=tuple(put(old, v, value_axes) for old, (_, v) in zip(prompts.v, kvs, strict=True)),
    mask=at(prompts.mask, mask),
    hidden=at(prompts.hidden, hidden),
  )
  return constrain_prompts(config, updated, mesh)


def admit(cache: SlotCache, take: jax.Array) -> SlotCache:
  """The slot cache with slots `take` (`bool[S]`) starting new rows: their ring masked (the
  prompt stays in the prompt cache)."""
  return cache.replace(mask=cache.mask & ~take[:, None])


def in_place_under_cond(mesh: jax.sharding.Mesh | None) -> bool:
  """Whether the slot cache may pass through a `lax.cond` (`pool.run_segment`: a decode
  step no slot needs is skipped, a refill runs only when a slot frees) and stay in place.

  The compilers differ on a cache that passes through a conditional: XLA:TPU writes it in
  place inside the branch, XLA:GPU copies all of it into the branch (1.05x the slot cache
  in temporaries for the skipped step). On GPU the decode step always runs (the idle
  step's write is masked and overwritten by the next row), and on every platform a
  refill's write to the cache (its rings' mask, `admit`) runs outside the conditional, so
  the tokens are the same (tests/test_pool.py).
  """
  return sharding_lib.platform(mesh).cache_in_place_under_cond


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
  cache: SlotCache,
  prompts: PromptCache,
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
  (issue 52), and a window of the ring that ends at that column and covers `window`
  columns (the longest live row's response so far), so the bytes read follow the longest
  live row. In XLA's form the prompt part is `shared_prompt.attend` and the window is the
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
    config, mesh: the model and the mesh the cache is sharded on (`slot_cache_shardings`);
      the kernel runs on each device's shard.

  Returns:
    (`attention(layer)` for `decoder.forward`, prompt and ring columns each slot reads
    `int32[]`).
  """
  c, ring = cache.column, cache.mask.shape[1]
  prompt_len = prompts.mask.shape[1]
  entry, live, entry_rows = rows
  axes = cache_axes(mesh)
  write = lambda old, new, order: jax.lax.dynamic_update_slice_in_dim(
    old, _relayout(new, MODEL_AXES, order).astype(old.dtype), c, order.index("s")
  )
  kernel = uses_kernel(mesh)
  head_dim = cache.v[0].shape[KV_AXES.index("h")]
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
  per_row = sharding_lib.platform(mesh).shared_prompt == "per row"
  if not per_row:
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
      if per_row:  # the prompt's part outside the switch: its copy is not passed into it
        copy = shared_prompt.per_row_piece(prompt, entry, axes)
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
  reads `MODEL_AXES` blocks: the caches' pieces are handed over in that order.

  `queries`: (the roped q `[S, 1, N, H]`,) for a kernel that reads the written ring
  (`decode_attention`; returns the attention), or (qkv `[S, K, G + 2, H]`, positions
  `int32[S]`, inv_freq) for one that rotates and writes it (`WRITES_RING`: `decode_step`;
  returns (the attention, (the ring's keys, values) in `cache_axes` order)). `rows`: the
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

  key_axes, value_axes = cache_axes(mesh)
  view = lambda k, v, m: (
    _relayout(k, key_axes, MODEL_AXES),
    _relayout(v, value_axes, MODEL_AXES),
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
    kv = lambda spec: P(*(spec[a] for a in MODEL_AXES))
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
  return attention, (_relayout(k, MODEL_AXES, key_axes), _relayout(v, MODEL_AXES, value_axes))


def _spec(config, mesh, rows: int, columns: int) -> dict:
  """The mesh axes of each `KV_AXES` letter of a cache of `rows` rows (`kv_shardings`)."""
  spec = kv_shardings(config, mesh, rows, columns)[0].spec
  return dict(zip(KV_AXES, tuple(spec) + (None,) * 4, strict=False))
