"""Decode attention that reads each prompt's keys and values once per step for all the rows
that share it (issue 52), in XLA's form: the live rows of a prompt-cache entry are grouped
as that entry's queries (`group_by_entry`), attend to the entry's prompt columns together
(`layers.attend_partial` with the rows as the query axis), and each row's part is merged
with the softmax over its own response columns (`layers.merge_partials`): the same
attention as one softmax over the row's prompt and response columns, not an approximation.

Shape letters as in `slots`: S slots, P prompt-cache entries, R rows per entry at most, K
kv heads, N query heads, H head dim, Lp prompt columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ada_jax.models import layers as layers_lib


def group_by_entry(entry: jax.Array, live: jax.Array, entries: int, rows: int):
  """The live slots of each prompt-cache entry.

  Args:
    entry: `int32[S]` the prompt-cache entry of each slot's row.
    live: `bool[S]` slots that hold a row.
    entries: P, the prompt cache's entries.
    rows: R, the most live rows an entry may have (the pool's admission keeps to it; a
      slot past it is left out of `members` and its prompt part is another row's).

  Returns:
    (`members` `int32[P, R]`: each entry's live slots in slot order, S where there is
    none; `rank` `int32[S]`: each live slot's place among its entry's, 0 for a free one).
  """
  s = entry.shape[0]
  key = jnp.where(live, entry, entries)  # free slots after every entry
  order = jnp.argsort(key * s + jnp.arange(s))  # by entry, then by slot
  ordered = key[order]
  place = jnp.arange(s) - jnp.searchsorted(ordered, ordered, side="left")
  rank = jnp.zeros((s,), jnp.int32).at[order].set(place.astype(jnp.int32))
  rank = jnp.where(live, rank, 0)
  members = jnp.full((entries, rows), s, jnp.int32)
  members = members.at[key, rank].set(jnp.arange(s, dtype=jnp.int32), mode="drop")
  return members, rank


def attend(q, prompt, entry, rank, members, own, kv_axes="bksh") -> jax.Array:
  """One decode step's attention of every slot over its entry's prompt columns, read once
  per entry, and its own response columns.

  XLA cannot skip an entry with no live row: this reads all P entries and scores P·R
  query rows (about (Q + 2 S)·R / rows per prompt), so where R is small it can read more
  than the rows' own copies would (`slots.copies_prompts`); the kernels skip dead entries.

  Args:
    q: `[S, 1, N, H]` queries (after RoPE).
    prompt: one layer of the prompt cache: (keys `[P, K, Lp, H]`, values, mask `bool[P,
      Lp]`), keys and values in `kv_axes` order.
    entry, rank, members: the slots' entries and `group_by_entry` of them.
    own: the slots' softmax over their own columns, open (`layers.attend_partial`).
    kv_axes: the caches' axis order, or (keys', values') (`slots.cache_axes`).

  Returns:
    `[S, 1, N, H]` in the prompt values' dtype; a free slot's row is some finite value.
  """
  s, rows = q.shape[0], members.shape[1]
  pk, pv, pm = prompt
  grouped = q[jnp.minimum(members, s - 1), 0]  # [P, R, N, H]: the entry's rows as queries
  shared = layers_lib.attend_partial(grouped, [(pk, pv, pm[:, None, :])], kv_axes)
  mine = tuple(x[entry, jnp.minimum(rank, rows - 1)][:, None] for x in shared)
  return layers_lib.merge_partials([mine, own], pv.dtype)
