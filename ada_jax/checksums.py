"""Checksums of a tree of arrays, computed where the arrays live: what a checkpoint records
beside its arrays and a restore compares (`checkpoint.save` / `checkpoint.restore`),
because finite is not intact (garbage bytes can decode to finite values)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def _checksums(tree: Any) -> Any:
  """Per array, two uint32 sums of its bit patterns (plain and position-weighted, mod 2^32;
  a Fletcher-style check computed where the array lives, so no host copy): what `save`
  records and `restore` compares, because finite is not intact (garbage bytes can decode to
  finite values)."""

  def one(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
      x = x.astype(jnp.uint8)
    # 8-byte elements bitcast to pairs of uint32 (a trailing axis of 2).
    unsigned = {8: jnp.uint32, 4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)
    weights_ = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.stack([bits.sum(dtype=jnp.uint32), (bits * weights_).sum(dtype=jnp.uint32)])

  return jax.tree.map(one, tree)


def of(tree: Any) -> dict[str, list[int]]:
  """`_checksums` of every array of `tree` by its path (`jax.tree_util.keystr`), as JSON."""
  sums = jax.device_get(_checksums(tree))
  return {
    jax.tree_util.keystr(path): [int(v) for v in np.asarray(leaf)]
    for path, leaf in jax.tree_util.tree_leaves_with_path(sums)
  }
