"""Device mesh, the one logical-axis rule table, and placement of params and batches (the
KV caches take these rules in `rollout.slots`).

Every array in the system names its dimensions with logical axes: parameters carry them in
`model.logical_axes` ('vocab', 'embed', 'heads', 'kv_heads', 'head_dim', 'mlp'),
activations and batches use 'batch' and 'length'. `RULES` maps each logical name to mesh
axes of a `Mesh` with axes ('data', 'fsdp', 'tensor') (docs/design.md "Distribution"):

* rows of batches, activations and KV caches are split over ('data', 'fsdp');
* parameters are split over 'fsdp' along their model width (ZeRO-3 style, gathered by
  XLA's SPMD partitioner where a matmul needs them) and over 'tensor' along heads, MLP
  width and vocabulary (Megatron-style tensor parallelism).

A dimension that its mesh axes do not divide evenly is replicated instead (e.g. the tiny
test models have 2 kv heads, a mesh may have tensor=4), so any model runs on any mesh;
only batch rows, whose split is a configuration choice, raise an error when they do not
divide (`check_rows`). Query heads follow their kv heads (`model_rules`): attention groups
each query head under its kv head, so when the kv heads cannot be split over 'tensor'
(Qwen2.5-Math-1.5B's 2 kv heads on tensor=4) the query heads are not split either, and
attention runs replicated over 'tensor' instead of making XLA re-shard (fully
rematerialise) the q/k/v projections and the KV cache at every step.

The mesh uses `AxisType.Auto`: shardings are given at the jit boundary (params, batch,
cache) and XLA propagates them through the model, which carries no annotations of its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ada_jax import bounds, platforms
from ada_jax.models import decoder as model_lib
from ada_jax.models.decoder import ModelConfig, Params

AXES = ("data", "fsdp", "tensor")
# Rows are split over every data-parallel axis: 'fsdp' shards parameters *and* rows.
DATA_AXES = ("data", "fsdp")

# Logical axis name -> mesh axis (or tuple of mesh axes), None = replicated. The one table.
RULES: dict[str, str | tuple[str, ...] | None] = {
  # activations and batches
  "batch": DATA_AXES,
  "length": None,
  # parameters (names from model.logical_axes)
  "vocab": "tensor",
  "embed": "fsdp",
  "heads": "tensor",
  "kv_heads": "tensor",
  "head_dim": None,
  "mlp": "tensor",
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes (the run config's `mesh` group), as `make_mesh` takes them: one may
  be -1 (all remaining devices)."""

  data: int = bounds.within("[-1, 2**16]", -1)
  fsdp: int = bounds.within("[-1, 2**16]", 1)
  tensor: int = bounds.within("[-1, 2**16]", 1)


def make_mesh(
  data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
  """A `Mesh` with axes ('data', 'fsdp', 'tensor').

  Args:
    data, fsdp, tensor: axis sizes; one of them may be -1, meaning "all remaining devices".
    devices: the devices to use (default: all devices of all processes).

  Returns:
    The mesh, with `AxisType.Auto` axes (sharding propagated by XLA from the jit boundary).

  Raises:
    ValueError: a size is 0 or below -1, more than one -1, or the sizes' product does not
      equal the number of devices (the message names `mesh.data`, `mesh.fsdp`,
      `mesh.tensor`).
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
  for name, size in sizes.items():
    if not isinstance(size, int) or size == 0 or size < -1:
      raise ValueError(f"mesh.{name} must be a positive int or -1, got {size!r}")
  fill = [name for name, size in sizes.items() if size == -1]
  if len(fill) > 1:
    raise ValueError(f"only one mesh axis may be -1, got {fill} (mesh.{', mesh.'.join(fill)})")
  known = math.prod(size for size in sizes.values() if size != -1)
  if fill:
    if len(devices) % known:
      raise ValueError(
        f"mesh.{fill[0]}=-1: {len(devices)} devices are not divisible by the "
        f"other axes' product {known} ({_describe(sizes)})"
      )
    sizes[fill[0]] = len(devices) // known
  if math.prod(sizes.values()) != len(devices):
    raise ValueError(
      f"mesh {_describe(sizes)} needs {math.prod(sizes.values())} devices, "
      f"but there are {len(devices)}"
    )
  shape = tuple(sizes[a] for a in AXES)
  return jax.make_mesh(
    shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES), devices=devices
  )


def _describe(sizes: dict[str, int]) -> str:
  return ", ".join(f"mesh.{name}={size}" for name, size in sizes.items())


def data_parallel_size(mesh: Mesh) -> int:
  """How many ways batch rows are split: data × fsdp."""
  return math.prod(mesh.shape[a] for a in DATA_AXES)


def model_rules(config: ModelConfig, mesh: Mesh) -> dict[str, str | tuple[str, ...] | None]:
  """`RULES` for one model on one mesh: 'heads' (query heads) is replicated when 'kv_heads'
  cannot be split (the kv heads' count not divisible by the 'tensor' size); see the module
  docstring. Every model-dependent sharding (params, KV cache) goes through this."""
  rules = dict(RULES)
  target = rules["kv_heads"]
  axes = (target,) if isinstance(target, str) else tuple(target or ())
  if config.num_kv_heads % math.prod(mesh.shape[a] for a in axes):
    rules["heads"] = None
  return rules


def logical_to_spec(
  axes: Sequence[str | None],
  shape: Sequence[int],
  mesh: Mesh,
  *,
  rules: Mapping[str, str | tuple[str, ...] | None] | None = None,
) -> P:
  """`PartitionSpec` for an array with logical `axes`, by `RULES` (or `model_rules`).

  A dimension is replicated (None) when its mesh axes do not divide its size, when the
  mesh axes have size 1, or when an earlier dimension already used one of them (a mesh
  axis may appear once per spec).

  Args:
    axes: one logical name (or None) per dimension.
    shape: the array's shape.
    mesh: the mesh.
    rules: the table to use; default `RULES`.

  Raises:
    ValueError: an unknown logical name, or len(axes) != len(shape).
  """
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
  rules = RULES if rules is None else rules
  used: set[str] = set()
  spec = []
  for name, size in zip(axes, shape, strict=True):
    if name is not None and name not in rules:
      raise ValueError(f"logical axis {name!r} has no sharding rule (known: {sorted(rules)})")
    target = rules.get(name) if name is not None else None
    mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
    mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1)
    ways = math.prod(mesh.shape[a] for a in mesh_axes)
    if not mesh_axes or size % ways or used & set(mesh_axes):
      spec.append(None)
      continue
    used.update(mesh_axes)
    spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  return P(*spec)


def param_specs(config: ModelConfig, mesh: Mesh, fused: str = "") -> Params:
  """`PartitionSpec` of every parameter (the params tree, or the one `decoder.fuse`d in
  layout `fused`)."""
  shapes = model_lib.param_shapes(config, fused)
  axes = model_lib.logical_axes(config, fused)
  rules = model_rules(config, mesh)
  return jax.tree.map(
    lambda a, s: logical_to_spec(a, s.shape, mesh, rules=rules),
    axes,
    shapes,
    is_leaf=lambda x: isinstance(x, tuple),
  )


def param_shardings(config: ModelConfig, mesh: Mesh) -> Params:
  """`NamedSharding` of every parameter (the params tree), e.g. for `weights.load_hf`."""
  return jax.tree.map(
    lambda s: NamedSharding(mesh, s), param_specs(config, mesh), is_leaf=lambda x: isinstance(x, P)
  )


def platform(mesh: Mesh | None) -> platforms.Platform:
  """The traits of the mesh's devices' platform, or of JAX's default backend without a
  mesh: the compilers differ where a layout choice depends on it (`platforms`)."""
  return platforms.of(mesh.devices.flat[0].platform if mesh is not None else jax.default_backend())


def rollout_param_shardings(config: ModelConfig, mesh: Mesh) -> Params:
  """`NamedSharding` of every leaf of the samplers' rollout copy (`Sampler.rollout_params`,
  a `decoder.fuse`d tree): the parameters' specs without 'fsdp', i.e. whole along the
  model width and split over 'tensor' only.

  The decode loop reads every weight at every step. From weights split over 'fsdp' the
  SPMD partitioner either all-gathers each weight inside the loop (XLA:GPU, and XLA:TPU on
  small models) or keeps the weights and moves every layer's activations between the fsdp
  devices (XLA:TPU on the paper's models: an all-gather and a reduce-scatter or all-reduce
  per matmul, the 7B's MLP partial sums 14.5 MB per layer at 768 slots). Whole along
  'fsdp', the copy is gathered once per RL step when it is made, and a decode step's
  matmuls are local to each device's rows: no weight and no activation crosses 'fsdp'
  while decoding (tests/test_aot.py, tests/test_aot_gpu.py read the compiled loops), at
  'fsdp' times the copy's bytes per device (docs/tpu.md section 7 weighs the two).

  Args:
    config: the model config.
    mesh: the mesh.

  Returns:
    A params-shaped tree of `NamedSharding`s, `decoder.fuse`d in the mesh platform's
    `fused_layout`.
  """
  no_fsdp = lambda s: P(*(None if axis == "fsdp" else axis for axis in s))
  return jax.tree.map(
    lambda s: NamedSharding(mesh, no_fsdp(s)),
    param_specs(config, mesh, fused=platform(mesh).fused_layout),
    is_leaf=lambda x: isinstance(x, P),
  )


def abstract(shapes: Any, shardings: Any) -> Any:
  """A restore target: `jax.ShapeDtypeStruct`s of `shapes` (any tree of arrays or structs)
  carrying the matching `shardings` leaf."""
  return jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
  )


def abstract_params(config: ModelConfig, mesh: Mesh) -> Params:
  """The parameter tree as `jax.ShapeDtypeStruct`s with their shardings, allocating
  nothing: the target for `saved_params.restore_params`."""
  return abstract(model_lib.param_shapes(config), param_shardings(config, mesh))


def place_params(params: Params, shardings: Params) -> Params:
  """Puts (host or device) params onto their shardings (same tree structure)."""
  return jax.device_put(params, shardings)


def gather_embedding(params: Params, mesh: Mesh) -> Params:
  """Inside jit: the input embedding table made whole along D (all-gathered over 'fsdp').

  The token lookup is a gather, which XLA's SPMD partitioner cannot run on a table split
  along D while the rows of the batch are split over that same 'fsdp' axis: it falls back
  to replicating the activations ("involuntary full rematerialization"). Gathering the
  table first, as FSDP does for every weight before use, keeps activations row-sharded;
  in the backward pass the constraint's transpose reduce-scatters the table's gradient.

  Args:
    params: the params tree (`params['embed']` is `[V, D]`).
    mesh: the mesh.

  Returns:
    The same tree with `embed` constrained to its spec without 'fsdp'.
  """
  table = params["embed"]
  spec = logical_to_spec(("vocab", "embed"), table.shape, mesh)
  whole = P(*(None if axis == "fsdp" else axis for axis in spec))
  return {**params, "embed": jax.lax.with_sharding_constraint(table, NamedSharding(mesh, whole))}


def replicated(mesh: Mesh) -> NamedSharding:
  """Sharding of scalars and other small replicated values."""
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows over ('data', 'fsdp'), every other dimension replicated.

  One sharding serves arrays of any rank >= 1 (a spec shorter than the rank replicates
  the trailing dimensions), so it can be a pytree prefix for a whole batch.
  """
  return NamedSharding(mesh, P(_row_axes(mesh)))


def _row_axes(mesh: Mesh) -> tuple[str, ...] | None:
  axes = tuple(a for a in DATA_AXES if mesh.shape[a] > 1)
  return axes or None


def check_rows(rows: int, mesh: Mesh, what: str) -> None:
  """Raises unless `rows` splits evenly over the data-parallel axes.

  Args:
    rows: number of batch rows.
    mesh: the mesh.
    what: the name of the configuration field or quantity, quoted in the error.

  Raises:
    ValueError: rows % (data × fsdp) != 0 (checked on the host, before any compile).
  """
  dp = data_parallel_size(mesh)
  if rows % dp:
    raise ValueError(
      f"{what} ({rows} rows) is not divisible by the data-parallel size "
      f"{dp} (mesh.data={mesh.shape['data']} × mesh.fsdp={mesh.shape['fsdp']})"
    )


def local_rows(rows: int, mesh: Mesh) -> np.ndarray:
  """Sorted indices of the rows of a `[rows, ...]` batch that this process's devices hold
  under `batch_sharding(mesh)`: the rows it passes to `place_batch` (all of them with one
  process)."""
  starts = set()
  for index in batch_sharding(mesh).addressable_devices_indices_map((rows,)).values():
    s = index[0]
    starts.add((s.start or 0, rows if s.stop is None else s.stop))
  return np.concatenate([np.arange(a, b) for a, b in sorted(starts)])


def place_batch(batch: Any, mesh: Mesh, what: str = "batch") -> Any:
  """Puts a host batch (pytree of numpy arrays with a leading row axis) onto the mesh.

  Each process passes its own rows (`jax.make_array_from_process_local_data`); with one
  process those are all rows. The global batch has `process_count` times the local rows.

  Args:
    batch: pytree of arrays `[rows, ...]`, the same `rows` for every leaf.
    mesh: the mesh.
    what: name quoted in errors.

  Returns:
    The same pytree of global `jax.Array`s sharded by `batch_sharding`.

  Raises:
    ValueError: leaves disagree on rows, or the global rows do not divide over data × fsdp.
  """
  leaves = [np.asarray(x) for x in jax.tree.leaves(batch)]
  rows = {x.shape[0] if x.ndim else None for x in leaves}
  if len(rows) != 1 or None in rows:
    raise ValueError(f"{what}: every field needs the same leading row count, got {rows}")
  check_rows(rows.pop() * jax.process_count(), mesh, what)
  sharding = batch_sharding(mesh)
  return jax.tree.map(
    lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch
  )


def constrain(x: jax.Array, axes: Sequence[str | None], mesh: Mesh) -> jax.Array:
  """`with_sharding_constraint` of an activation by its logical axes (inside jit)."""
  return jax.lax.with_sharding_constraint(
    x, NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh))
  )


def host_copy(tree: Any) -> Any:
  """A pytree of arrays made readable on this host.

  With several processes, arrays sharded across them are gathered into whole numpy arrays
  on every process (a collective: all processes must call it; host memory for the whole
  tree). With one process the tree is returned as is: its arrays are readable already.
  """
  if jax.process_count() == 1:
    return tree
  return multihost_utils.process_allgather(tree, tiled=True)


def to_memory(tree: Any, memory_kind: str) -> Any:
  """Every array of `tree` on its sharding in `memory_kind` ('pinned_host': the host's
  pinned memory; 'device': the accelerator's), its old buffers freed as soon as the copies
  are made (XLA cannot donate across memory kinds). Host memory holds a train state
  between uses only: no program reads it there (`train.TrainConfig.offload_state`).

  Raises:
    ValueError: an unknown memory kind for these devices.
  """

  def move(x):
    if x.sharding.memory_kind == memory_kind:
      return x
    y = jax.device_put(x, x.sharding.with_memory_kind(memory_kind))
    x.delete()  # freed once the copy that reads it is done
    return y

  return jax.tree.map(move, tree)
