"""Run state on disk: orbax checkpoints saved and restored (docs/design.md "Run state";
`loop._start` resumes a run from it, else starts it fresh with `start.initial_state`; a
policy's params alone are `saved_params`').

A checkpoint holds the whole run, so that a restarted run continues exactly where the
saved one was (same next batches, same samples, same updates):

  params       the policy (sharded arrays, restored onto the target shardings)
  opt          {'step': int32[], 'opt_state': Adam moments and counts}
  ref_params   the frozen KL reference, only when the run has one
  rng          the root PRNG key's raw data (`jax.random.key_data` of a typed key)
  method_state the sampling rule's cross-step state (`rules.Rule.init_state`: Est's
               statistics, keys int64[P] and pos/tot float64[P] with P growing, and with a
               learned estimator its pass-rate head), only when the rule keeps one: its
               leaves in `flax.serialization.to_state_dict` order, each flattened with one
               zero appended (orbax refuses zero-size arrays)
  host         JSON: the caller's host state (data-iterator position, numpy Generator
               state, ...) and what is needed to rebuild the rest (key impl, each
               method_state leaf's path, shape and dtype)

A checkpoint written before the rules owned their state holds Est's statistics as item
`est` (its size P in the host JSON as `est_size`); it restores as the same dict.

Saves are atomic (orbax writes a temporary folder and renames it when complete), so a run
killed at any moment, even by `kill -9`, restarts from its last complete checkpoint. The
last `keep` checkpoints are kept. Nothing non-finite is saved or restored, so a NaN run
never rotates its last finite checkpoint away. A checkpoint that does not restore (torn or
missing files, garbage, NaN, finite values whose bits differ from the per-array checksums
saved with them) is set aside as `<step>.unreadable` and an older one used
(`restore_latest`); a full disk is one `DiskFullError` (orbax's temporary folder removed).
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import pathlib
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import serialization, traverse_util
from jax.experimental import multihost_utils

from ada_jax import bounds, distributed
from ada_jax import checksums as checksums_lib
from ada_jax.rl.estimate import COUNT_FIELDS as _EST_FIELDS
from ada_jax.rl.train import TrainState


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """When and how many checkpoints are written, and where a run's params come from and go
  (the run config's `ckpt` group).

  Attributes:
    every_steps: save every this many RL steps (the loop also saves at the end and on
      SIGTERM); 0 = only those.
    keep: how many of the latest checkpoints to keep on disk.
    async_save: write in a background thread (the device-to-host copy still blocks).
    init_from: another run's checkpoint folder (or one step of it) whose params start this
      run (`params_step_dir`); '' = none.
    export_hf: write the final policy as a Hugging Face folder `workdir/hf_final`
      (`export_hf`).
  """

  every_steps: int = bounds.within("[0, STEPS]", 10)
  keep: int = bounds.within("[1, 10**6]", 3)
  async_save: bool = False
  init_from: str = ""
  export_hf: bool = False

  def __post_init__(self):
    if self.every_steps < 0:
      raise ValueError(f"CheckpointConfig.every_steps must be >= 0, got {self.every_steps}")
    if self.keep < 1:
      raise ValueError(f"CheckpointConfig.keep must be >= 1, got {self.keep}")


@dataclasses.dataclass
class RunState:
  """Everything a checkpoint restores.

  Attributes:
    train: the `TrainState` (params, optimizer state, update count, reference params).
    rng: the root PRNG key (typed, e.g. `jax.random.key(seed)`, or a raw uint32[2] key).
    method_state: the sampling rule's cross-step state (`rules.Rule.init_state`), or None;
      restored as nested dicts of numpy arrays (`Rule.restore_state` rebuilds its type).
    host: JSON-serialisable host state: RL step, data-iterator position, numpy Generator
      state (`generator_state`), ... Python ints of any size are kept exactly.
  """

  train: TrainState
  rng: jax.Array
  method_state: Any = None
  host: dict[str, Any] = dataclasses.field(default_factory=dict)


class NonFiniteError(RuntimeError):
  """A NaN or infinity in what would be trained on or saved (step and quantity named)."""


class UnreadableCheckpoint(RuntimeError):
  """Checkpoint `step` does not restore: `path` (the file or item folder) and `reason`."""

  def __init__(self, step: int, path: pathlib.Path, reason: str):
    self.step, self.path, self.reason = step, path, reason
    super().__init__(f"checkpoint {step} does not restore: {path}: {reason}")


class DiskFullError(OSError):
  """No space left for a checkpoint; the message names the directory and the bytes."""


def make_manager(
  directory: str | os.PathLike, config: CheckpointConfig = CheckpointConfig()
) -> ocp.CheckpointManager:
  """An orbax `CheckpointManager` over `directory` (created if missing), keeping the last
  `config.keep` steps."""
  options = ocp.CheckpointManagerOptions(
    max_to_keep=config.keep, enable_async_checkpointing=config.async_save, create=True
  )
  return ocp.CheckpointManager(pathlib.Path(directory).absolute(), options=options)


def save(manager: ocp.CheckpointManager, step: int, run: RunState, *, force: bool = True) -> bool:
  """Saves `run` as checkpoint `step` (the RL step count).

  Args:
    manager: from `make_manager`.
    step: the checkpoint's number (use the RL step, so resume knows where it is).
    run: the run state.
    force: save even if the manager's own policy would skip this step.

  Returns:
    Whether a save was started (False when `step` is already saved).

  Raises:
    NonFiniteError: a param, optimizer or reference array holds a NaN or infinity.
    DiskFullError: no space left in the manager's directory (its temporary folder removed).
  """
  if step in manager.all_steps():
    return False
  arrays = {"params": run.train.params, "opt": run.train.opt_state, "ref": run.train.ref_params}
  bad = distributed.nonfinite_leaves(arrays)
  if bad:
    raise NonFiniteError(f"checkpoint {step} not saved: non-finite values in {', '.join(bad[:3])}")
  rng = run.rng
  typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  record, leaves = _leaves(run.method_state)
  meta = {
    "user": run.host,
    "rng_impl": str(jax.random.key_impl(rng)) if typed else None,
    "method_state": record,
    "has_ref": run.train.ref_params is not None,
    "checksums": {name: checksums_lib.of(tree) for name, tree in _summed(run.train).items()},
  }
  items = {
    "params": ocp.args.StandardSave(run.train.params),
    "opt": ocp.args.StandardSave({"step": run.train.step, "opt_state": run.train.opt_state}),
    "rng": ocp.args.StandardSave({"key": np.asarray(jax.random.key_data(rng) if typed else rng)}),
    "host": ocp.args.JsonSave(meta),
  }
  if run.train.ref_params is not None:
    items["ref_params"] = ocp.args.StandardSave(run.train.ref_params)
  if leaves:
    padded = [np.concatenate([x.ravel(), np.zeros(1, x.dtype)]) for x in leaves]
    items["method_state"] = ocp.args.StandardSave(padded)
  threads = threading.active_count()
  try:
    return manager.save(step, args=ocp.args.Composite(**items), force=force)
  except Exception as e:
    _raise_if_disk_full(e, manager, _nbytes(run), threads)
    raise


def _nbytes(run: RunState) -> int:
  return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(run.train))


def _raise_if_disk_full(
  error: BaseException, manager: ocp.CheckpointManager, needed: int, threads: int
) -> None:
  """A `DiskFullError` in place of `error` when a cause in its chain is ENOSPC, once orbax's
  unfinished temporary folders are removed (they would only take more space)."""
  cause = error
  while cause is not None and not (isinstance(cause, OSError) and cause.errno == errno.ENOSPC):
    cause = cause.__cause__ or cause.__context__
  if cause is None and "No space left on device" not in str(error):
    return
  directory = pathlib.Path(manager.directory)
  # orbax's threads writing the other items run on after the first error and would
  # recreate a folder removed at once: remove until they are gone (a few seconds at most).
  deadline = time.monotonic() + 10
  while jax.process_index() == 0 and time.monotonic() < deadline:
    tmps = list(directory.glob("*.orbax-checkpoint-tmp*"))
    for tmp in tmps:
      shutil.rmtree(tmp, ignore_errors=True)
    if not tmps and threading.active_count() <= threads:
      break
    time.sleep(0.1)
  free = shutil.disk_usage(directory).free if directory.exists() else 0
  size = f"it needs about {needed / 2**20:.1f} MiB ({needed} bytes), " if needed else ""
  raise DiskFullError(
    errno.ENOSPC,
    f"no space left on device for a checkpoint in {directory}: {size}{free / 2**20:.1f} "
    "MiB are free; free space and run the same command again (it resumes from checkpoint "
    f"{manager.latest_step()})",
  ) from None


def _leaves(state: Any) -> tuple[list[list] | None, list[np.ndarray]]:
  """([path, shape, dtype] of each leaf, the leaves as numpy arrays) of a rule's state in
  `flax.serialization.to_state_dict` form ((None, []) for None)."""
  if state is None:
    return None, []
  flat = traverse_util.flatten_dict(serialization.to_state_dict(state), sep="/")
  leaves = [np.asarray(v) for v in flat.values()]
  return [[k, list(x.shape), x.dtype.str] for k, x in zip(flat, leaves, strict=True)], leaves


def _unpad(record: list[list], saved: Any) -> dict[str, Any]:
  """The state dict `_leaves` described, from the padded leaves orbax gives back."""
  if isinstance(saved, dict):  # orbax may give a list back as a dict keyed '0', '1', ...
    saved = [saved[k] for k in sorted(saved, key=int)]
  flat = {
    path: np.asarray(x)[: math.prod(shape)].astype(dtype).reshape(shape)
    for (path, shape, dtype), x in zip(record, saved, strict=True)
  }
  return traverse_util.unflatten_dict(flat, sep="/")


def restore(
  manager: ocp.CheckpointManager,
  target: TrainState,
  step: int | None = None,
  *,
  check_host: Callable[[dict[str, Any], int], None] | None = None,
) -> RunState:
  """Restores checkpoint `step` (default: the latest) onto the shardings of `target`.

  Items are read one at a time (host JSON first), so a failure names its folder.

  Args:
    manager: from `make_manager`.
    target: `train.abstract_state(...)`, a `TrainState` of `jax.ShapeDtypeStruct`s with
      shardings; its `ref_params` must be set iff the checkpoint has reference params.
    step: which checkpoint; None = the latest.
    check_host: called with the saved host state and `step` before any array is read (the
      loop's resume-compatibility check, which may raise `config.ConfigError`).

  Returns:
    The `RunState` as saved (method_state as nested dicts of arrays at their saved
    shapes, rng with its key impl).

  Raises:
    FileNotFoundError: no checkpoint (or not `step`) in the manager's directory.
    UnreadableCheckpoint: an item is missing, torn or unreadable, or holds NaN or infinity.
    ValueError: the checkpoint and `target` disagree on reference params.
  """
  step = manager.latest_step() if step is None else step
  if step is None or step not in manager.all_steps():
    raise FileNotFoundError(
      f"no checkpoint {'' if step is None else step} in "
      f"{manager.directory} (steps: {manager.all_steps()})"
    )
  folder = pathlib.Path(manager.directory) / str(step)

  def read(name: str, arg: Any) -> Any:
    path = folder / name
    if not path.is_dir():
      raise UnreadableCheckpoint(step, path, "missing")
    try:
      return manager.restore(step, args=ocp.args.Composite(**{name: arg}))[name]
    except MemoryError:
      raise
    except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
      raise UnreadableCheckpoint(step, path, _reason(e)) from None

  meta = read("host", ocp.args.JsonRestore())
  keys = set(meta if isinstance(meta, dict) else ())
  if not {"user", "has_ref", "rng_impl"} <= keys or not keys & {"method_state", "est_size"}:
    raise UnreadableCheckpoint(step, folder / "host" / "metadata", "not a run-state record")
  if check_host is not None:
    check_host(meta["user"], step)
  if meta["has_ref"] != (target.ref_params is not None):
    raise ValueError(
      f"checkpoint {step} {'has' if meta['has_ref'] else 'has no'} reference "
      "params but the restore target "
      f"{'does not' if meta['has_ref'] else 'does'} (LossConfig.kl_coeff?)"
    )
  items = {
    "params": ocp.args.StandardRestore(target.params),
    "opt": ocp.args.StandardRestore({"step": target.step, "opt_state": target.opt_state}),
    "rng": ocp.args.StandardRestore(),
  }
  if meta["has_ref"]:
    items["ref_params"] = ocp.args.StandardRestore(target.ref_params)
  if meta.get("method_state"):
    items["method_state"] = ocp.args.StandardRestore()
  if meta.get("est_size") is not None:  # written before the rules owned their state
    items["est"] = ocp.args.StandardRestore()
  out = {name: read(name, arg) for name, arg in items.items()}
  for name in ("params", "opt", "ref_params"):
    bad = distributed.nonfinite_leaves(out.get(name))
    if bad:
      more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
      raise UnreadableCheckpoint(step, folder / name, f"NaN or infinity in {bad[0]}{more}")
  key = np.asarray(out["rng"]["key"])
  rng = (
    jax.random.wrap_key_data(key, impl=meta["rng_impl"]) if meta["rng_impl"] else jnp.asarray(key)
  )
  method_state = None
  if meta.get("method_state") is not None:
    method_state = _unpad(meta["method_state"], out.get("method_state", []))
  elif meta.get("est_size") is not None:
    method_state = {
      k: np.asarray(v)[: meta["est_size"]] if k in _EST_FIELDS else np.asarray(v)
      for k, v in out["est"].items()
    }
  train = TrainState(
    step=out["opt"]["step"],
    params=out["params"],
    opt_state=out["opt"]["opt_state"],
    ref_params=out["ref_params"] if meta["has_ref"] else None,
  )
  saved = meta.get("checksums") or {}  # a checkpoint of an older version has none
  for name, tree in _summed(train).items():
    now = checksums_lib.of(tree) if name in saved else {}
    # Arrays both have: a later version may name a tree's leaves otherwise (an optax upgrade).
    bad = [k for k in saved.get(name, {}) if k in now and now[k] != saved[name][k]]
    if bad:
      raise UnreadableCheckpoint(
        step, folder / name, f"checksum mismatch in {bad[:1]}: the bytes changed"
      )
  return RunState(train=train, rng=rng, method_state=method_state, host=meta["user"])


def _summed(state: TrainState) -> dict[str, Any]:
  """The saved items whose arrays carry checksums, by item name."""
  items = {"params": state.params, "opt": {"step": state.step, "opt_state": state.opt_state}}
  if state.ref_params is not None:
    items["ref_params"] = state.ref_params
  return items


def _reason(error: BaseException) -> str:
  """The innermost cause's first line (tensorstore's names the array and the byte range),
  without the spec dump orbax appends."""
  while error.__cause__ is not None:  # orbax raises its own errors `from` tensorstore's
    error = error.__cause__
  text = (str(error).strip().splitlines() or [""])[0].split(" See full TensorStore")[0]
  text = f"{type(error).__name__}: {text}" if text else type(error).__name__
  return text if len(text) <= 300 else text[:297] + "..."


def _set_aside(manager: ocp.CheckpointManager, skipped: list[UnreadableCheckpoint]) -> None:
  """Renames the unreadable checkpoints to `<step>.unreadable[.<time>]` (kept for a look,
  no longer a step: the run saves that step again and rotation ignores them)."""
  if jax.process_index() == 0:
    for e in skipped:
      folder = pathlib.Path(manager.directory) / str(e.step)
      aside = folder.with_name(f"{e.step}.unreadable")
      if aside.exists():
        aside = aside.with_name(f"{aside.name}.{time.time_ns()}")
      folder.rename(aside)
      logging.warning("%s; set aside as %s", e, aside)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("ada_jax: unreadable checkpoints set aside")
  manager.reload()


def restore_latest(
  manager: ocp.CheckpointManager,
  target: TrainState,
  *,
  check_host: Callable[[dict[str, Any], int], None] | None = None,
) -> tuple[RunState, int] | None:
  """The latest complete checkpoint of the run that restores, with its step; None when the
  run has none (the first of the start order, `loop._start`). Newer checkpoints that do not
  restore (`UnreadableCheckpoint`) are set aside as `<step>.unreadable`, each named in a
  warning.

  Args:
    manager: this run's manager.
    target: `train.abstract_state(...)` (shapes, dtypes and shardings of the state).
    check_host: see `restore`; its error ends the search (no older checkpoint is tried).

  Raises:
    UnreadableCheckpoint: checkpoints exist but none restores (the latest one's error,
      nothing set aside).
  """
  skipped = []
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      run = restore(manager, target, step, check_host=check_host)
    except UnreadableCheckpoint as e:
      skipped.append(e)
      continue
    if skipped:
      _set_aside(manager, skipped)
    return run, step
  if skipped:
    e = skipped[0]
    older = f" (nor do the {len(skipped) - 1} older ones)" if len(skipped) > 1 else ""
    raise UnreadableCheckpoint(e.step, e.path, e.reason + older)
  return None


def close(manager: ocp.CheckpointManager) -> None:
  """Waits for pending (async) saves to be complete on disk, then closes the manager.

  Raises:
    DiskFullError: a pending save ran out of space (its temporary folder removed).
  """
  threads = threading.active_count()
  try:
    manager.wait_until_finished()
  except Exception as e:
    _raise_if_disk_full(e, manager, 0, threads)
    raise
  manager.close()
