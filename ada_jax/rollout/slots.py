"""The rollout pool's two KV caches, owned here: the prompt cache (`PromptCache`, one entry
per prefilled prompt) and the slots' cache (`SlotCache`), their axis orders (`cache_axes`),
shapes, shardings, the store of prefilled prompts and a row's admission. Only this module
and the decode step's read of them (`attention`) index a cache array: the model hands keys
and values over in its own order and the Pallas kernels read their own (both
`MODEL_AXES`), and `relayout` converts.

A slot holds its row's response: a ring of Lr columns that every slot writes at one
shared column per decode step, a `dynamic_update_slice`, which XLA:TPU performs in place
(per-row write positions, a scatter, made it hold a second copy of the cache, and a
`[B, K, H, S]` key layout a transposed one). Keys carry their RoPE positions, so where a
key sits does not change attention; a per-slot mask says which ring columns are the row's.
The row's prompt stays in its prompt-cache entry (`SlotState.entry`), read once per entry
for all its live rows; XLA:CPU, whose decode step is bound by arithmetic, not bytes, gives
each slot a copy of its prompt when its row starts instead (`copies_prompts`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding

from ada_jax.models import sharding as sharding_lib
from ada_jax.models.decoder import ModelConfig

# ----------------------------------------------------------------------------- layout

# Both caches' axis order in `layers.attend`'s letters: b row (a slot, or a prompt entry),
# k kv head, s column, h head dim; the keys' where the platform has no order of its own
# (`cache_axes`). Every shape, write, read and sharding below derives from them, so another
# order is a change of this line alone (tests/test_pool.py decodes the same tokens in two
# others). This one is what the model hands over and the kernel reads (`MODEL_AXES`: no
# transposes) and what XLA:TPU writes in place; another order costs the TPU kernel path a
# transposed copy of every layer's cache per decode step (`attention._on_shards`).
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


def relayout(x: jax.Array, src: str, dst: str) -> jax.Array:
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


@struct.dataclass
class SlotCache:
  """The pool's own KV cache: each slot's ring of response columns. A slot's prompt is read
  from its row's prompt-cache entry, once per decode step for all the rows that share it
  (`shared_prompt`, issue 52), or, where the platform keeps one (`copies_prompts`), from
  the slot's own copy of it, made once when its row starts (`admit`).

  Response token j of a row that started when the ring stood at column c0 sits at ring
  column (c0 + j) mod Lr; a row writes at most Lr - 1 of them (its last token is never
  decoded), so it never overwrites its own columns. All slots write the same column at a
  step (`column`), live or not: a dead slot's column is masked out.

  Attributes:
    k, v: per layer `dtype[S, K, Lr, H]` (in `cache_axes` order), the response ring
      (keys after RoPE).
    mask: `bool[S, Lr]`, True at ring columns that hold the slot's row's response tokens.
    column: `int32[]`, the ring column the next decode step writes.
    prompt_k, prompt_v: per layer `dtype[S, K, Lp, H]` (in `cache_axes` order), each slot's
      copy of its row's prompt-cache entry, or None where the platform reads the entry.
    prompt_mask: `bool[S, Lp]` the copied entries' masks, or None.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  mask: jax.Array
  column: jax.Array
  prompt_k: tuple[jax.Array, ...] | None = None
  prompt_v: tuple[jax.Array, ...] | None = None
  prompt_mask: jax.Array | None = None


def copies_prompts(mesh: jax.sharding.Mesh | None) -> bool:
  """Whether each slot keeps a copy of its row's prompt (`platforms.Platform.shared_prompt`
  'slot copy': XLA:CPU, whose decode step is bound by its arithmetic, not by the bytes it
  reads, and which the per-step gather of every row's prompt cost a quarter of its
  decode time, experiments/README.md "Where the CPU's time goes")."""
  traits = sharding_lib.platform(mesh)
  return traits.shared_prompt == "slot copy" and not traits.decode_kernel


def slot_cache_shardings(
  config: ModelConfig,
  mesh: jax.sharding.Mesh,
  slots: int,
  max_new_tokens: int,
  prompt_len: int = 0,
) -> SlotCache:
  """Shardings of a `SlotCache`: slots over ('data', 'fsdp'), kv heads over 'tensor'
  (`kv_shardings`), the ring column replicated; the slots' prompt copies (`prompt_len`
  columns, 0 for none) as the ring."""
  k, v, mask = _kv_shardings(config, mesh, slots, max_new_tokens)
  layers = config.num_layers
  copies = {}
  if prompt_len:
    pk, pv, pm = _kv_shardings(config, mesh, slots, prompt_len)
    copies = dict(prompt_k=(pk,) * layers, prompt_v=(pv,) * layers, prompt_mask=pm)
  return SlotCache(
    k=(k,) * layers, v=(v,) * layers, mask=mask, column=sharding_lib.replicated(mesh), **copies
  )


def init_slot_cache(
  config: ModelConfig,
  slots: int,
  max_new_tokens: int,
  mesh: jax.sharding.Mesh | None = None,
  prompt_len: int = 0,
) -> SlotCache:
  """An empty cache of `slots` slots of `max_new_tokens` ring columns each, the ring at
  column 0 (sharded by `slot_cache_shardings` with a mesh), with empty prompt copies of
  `prompt_len` columns where the platform keeps them (`copies_prompts`)."""
  k, v, mask = _empty(config, slots, max_new_tokens, mesh)
  copies = {}
  if prompt_len and copies_prompts(mesh):
    pk, pv, pm = _empty(config, slots, prompt_len, mesh)
    copies = dict(prompt_k=pk, prompt_v=pv, prompt_mask=pm)
  return constrain(config, SlotCache(k, v, mask, jnp.zeros((), jnp.int32), **copies), mesh)


def constrain(config: ModelConfig, cache: SlotCache, mesh) -> SlotCache:
  """`cache` constrained to `slot_cache_shardings` inside jit (unchanged without a mesh)."""
  if mesh is None:
    return cache
  prompt_len = 0 if cache.prompt_mask is None else cache.prompt_mask.shape[1]
  sh = slot_cache_shardings(config, mesh, *cache.mask.shape, prompt_len)
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
    return old.at[rows].set(relayout(new, MODEL_AXES, axes).astype(old.dtype), mode="drop")

  at = lambda old, new: old.at[entries].set(new.astype(old.dtype), mode="drop")
  updated = PromptCache(
    k=tuple(put(old, k, key_axes) for old, (k, _) in zip(prompts.k, kvs, strict=True)),
    v=tuple(put(old, v, value_axes) for old, (_, v) in zip(prompts.v, kvs, strict=True)),
    mask=at(prompts.mask, mask),
    hidden=at(prompts.hidden, hidden),
  )
  return constrain_prompts(config, updated, mesh)


def admit(
  cache: SlotCache, take: jax.Array, prompts: PromptCache, entry: jax.Array, mesh=None
) -> SlotCache:
  """The slot cache with slots `take` (`bool[S]`) starting new rows of prompt-cache entries
  `entry` (`int32[S]`, read where `take`): their ring masked, and where the slots keep
  prompt copies (`copies_prompts`) their entries copied in, one slot at a time in a loop
  of as many trips as slots start (a gather of every slot would copy S prompts at every
  step that refills one)."""
  cache = cache.replace(mask=cache.mask & ~take[:, None])
  if cache.prompt_mask is None:
    return cache
  n = take.shape[0]
  starting = jnp.nonzero(take, size=n, fill_value=n)[0]
  key_axes, value_axes = cache_axes(mesh)

  def copy_one(i, copies):
    slot = starting[i]
    src = entry[slot]
    move = lambda dst, new, axis: jax.lax.dynamic_update_slice_in_dim(
      dst, jax.lax.dynamic_slice_in_dim(new, src, 1, axis), slot, axis
    )
    pk, pv, pm = copies
    return (
      tuple(move(d, x, key_axes.index("b")) for d, x in zip(pk, prompts.k, strict=True)),
      tuple(move(d, x, value_axes.index("b")) for d, x in zip(pv, prompts.v, strict=True)),
      move(pm, prompts.mask, 0),
    )

  copies = (cache.prompt_k, cache.prompt_v, cache.prompt_mask)
  pk, pv, pm = jax.lax.fori_loop(0, take.sum(), copy_one, copies)
  return cache.replace(prompt_k=pk, prompt_v=pv, prompt_mask=pm)


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
