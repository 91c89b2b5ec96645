"""Run state on disk: orbax checkpoints, resume order, preemption, final export (docs/design.md
"Run state").

A checkpoint holds the whole run, so that a restarted run continues exactly where the
saved one was (same next batches, same samples, same updates):

  params       the policy (sharded arrays, restored onto the target shardings)
  opt          {'step': int32[], 'opt_state': Adam moments and counts}
  ref_params   the frozen KL reference, only when the run has one
  rng          the root PRNG key's raw data (`jax.random.key_data` of a typed key)
  est          Reinforce-Ada-Est statistics (keys int64[P], pos/tot float64[P]), P grows;
               with a learned estimator also its pass-rate head and Adam moments
               (fixed-shape `head_*` arrays, `rl.pass_rate_head`)
  host         JSON: the caller's host state (data-iterator position, numpy Generator
               state, ...) and what is needed to rebuild the rest (key impl, P)

Saves are atomic (orbax writes a temporary folder and renames it when complete), so a run
killed at any moment, even by `kill -9`, restarts from its last complete checkpoint. The
last `keep` checkpoints are kept.

Preemption and Ctrl-C: `stop_signals` turns SIGTERM and a first SIGINT into a flag; the
loop polls `stop_requested` at each step boundary, saves, waits for the write, and returns;
`ada_jax.main` then exits with code 75 ("stopped, resumable").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from ada_jax.models import weights
from ada_jax.models.decoder import ModelConfig, Params
from ada_jax.models.tokenizer import Tokenizer
from ada_jax.rl.train import TrainState

EstState = dict[str, np.ndarray]
_EST_FIELDS = {"keys": np.int64, "pos": np.float64, "tot": np.float64}


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

  every_steps: int = 10
  keep: int = 3
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
    est: Reinforce-Ada-Est statistics (`adaptive.EstState`), or None.
    host: JSON-serialisable host state: RL step, data-iterator position, numpy Generator
      state (`generator_state`), ... Python ints of any size are kept exactly.
  """

  train: TrainState
  rng: jax.Array
  est: EstState | None = None
  host: dict[str, Any] = dataclasses.field(default_factory=dict)


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
  """
  if step in manager.all_steps():
    return False
  rng = run.rng
  typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  meta = {
    "user": run.host,
    "rng_impl": str(jax.random.key_impl(rng)) if typed else None,
    "est_size": None if run.est is None else int(np.asarray(run.est["keys"]).shape[0]),
    "has_ref": run.train.ref_params is not None,
  }
  items = {
    "params": ocp.args.StandardSave(run.train.params),
    "opt": ocp.args.StandardSave({"step": run.train.step, "opt_state": run.train.opt_state}),
    "rng": ocp.args.StandardSave({"key": np.asarray(jax.random.key_data(rng) if typed else rng)}),
    "host": ocp.args.JsonSave(meta),
  }
  if run.train.ref_params is not None:
    items["ref_params"] = ocp.args.StandardSave(run.train.ref_params)
  if run.est is not None:
    items["est"] = ocp.args.StandardSave(_pad_est(run.est))
  return manager.save(step, args=ocp.args.Composite(**items), force=force)


def _pad_est(est: EstState) -> EstState:
  # orbax refuses zero-size arrays and P starts at 0: store P + 1 entries, P in the JSON.
  # Other entries (the pass-rate head's) have fixed, non-empty shapes and go as they are.
  out = {k: np.asarray(v) for k, v in est.items() if k not in _EST_FIELDS}
  for name, dtype in _EST_FIELDS.items():
    if name not in est:
      raise ValueError(f"Est state lacks field {name!r}; expected {sorted(_EST_FIELDS)}")
    out[name] = np.concatenate([np.asarray(est[name], dtype), np.zeros(1, dtype)])
  return out


def restore(
  manager: ocp.CheckpointManager, target: TrainState, step: int | None = None
) -> RunState:
  """Restores checkpoint `step` (default: the latest) onto the shardings of `target`.

  Args:
    manager: from `make_manager`.
    target: `train.abstract_state(...)`, a `TrainState` of `jax.ShapeDtypeStruct`s with
      shardings; its `ref_params` must be set iff the checkpoint has reference params.
    step: which checkpoint; None = the latest.

  Returns:
    The `RunState` as saved (est arrays at their saved length P, rng with its key impl).

  Raises:
    FileNotFoundError: no checkpoint (or not `step`) in the manager's directory.
    ValueError: the checkpoint and `target` disagree on reference params.
  """
  step = manager.latest_step() if step is None else step
  if step is None or step not in manager.all_steps():
    raise FileNotFoundError(
      f"no checkpoint {'' if step is None else step} in "
      f"{manager.directory} (steps: {manager.all_steps()})"
    )
  meta = manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))["host"]
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
  if meta["est_size"] is not None:
    items["est"] = ocp.args.StandardRestore()
  out = manager.restore(step, args=ocp.args.Composite(**items))
  key = np.asarray(out["rng"]["key"])
  rng = (
    jax.random.wrap_key_data(key, impl=meta["rng_impl"]) if meta["rng_impl"] else jnp.asarray(key)
  )
  est = None
  if meta["est_size"] is not None:
    est = {
      k: np.asarray(v)[: meta["est_size"]] if k in _EST_FIELDS else np.asarray(v)
      for k, v in out["est"].items()
    }
  train = TrainState(
    step=out["opt"]["step"],
    params=out["params"],
    opt_state=out["opt"]["opt_state"],
    ref_params=out["ref_params"] if meta["has_ref"] else None,
  )
  return RunState(train=train, rng=rng, est=est, host=meta["user"])


def params_step_dir(path: str | os.PathLike) -> pathlib.Path:
  """The step folder whose `params` `restore_params` reads: `path` itself when it is one
  step's folder, else the latest step of the checkpoint directory `path`.

  Raises:
    FileNotFoundError: `path` holds no checkpoint; the message lists the steps saved next
      to it, or points at `path/checkpoints` when `path` is a run folder.
  """

  def saved_steps(folder: pathlib.Path) -> list[int]:
    if not folder.is_dir():
      return []
    return sorted(
      int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / "params").is_dir()
    )

  path = pathlib.Path(path).absolute()
  if (path / "params").is_dir():
    return path
  steps = saved_steps(path)
  if steps:
    return path / str(steps[-1])
  nearby = saved_steps(path.parent)
  hint = f"; {path.parent} holds steps {nearby}" if nearby else ""
  if saved_steps(path / "checkpoints"):
    hint = f"; it is a run folder: use {path / 'checkpoints'}"
  raise FileNotFoundError(f"{path} holds no checkpoint (no <step>/params){hint}")


def restore_params(path: str | os.PathLike, target: Params) -> Params:
  """Only the policy params of another run's checkpoint (for `init_from`).

  Args:
    path: a checkpoint directory of `make_manager` (its latest step is used) or one step's
      folder in it.
    target: params tree of `jax.ShapeDtypeStruct`s with shardings.

  Raises:
    FileNotFoundError: `path` holds no checkpoint (see `params_step_dir`).
  """
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(params_step_dir(path) / "params", target)


def save_params(folder: str | os.PathLike, params: Params) -> None:
  """Writes `params` as `folder/params`, the layout `restore_params(folder, ...)` reads
  (and `ckpt.init_from` accepts)."""
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(pathlib.Path(folder).absolute() / "params", params)


def resume(
  manager: ocp.CheckpointManager,
  target: TrainState,
  *,
  start: Callable[[Params | None], RunState],
  init_from: str | None = None,
  pretrained: str | None = None,
) -> tuple[RunState, str]:
  """Where a run's state comes from, in this order (docs/design.md "Run state"):

  1. the latest complete checkpoint in the run's own directory (a restart after
     preemption or a crash continues the same run);
  2. else `init_from`: the params of another run's checkpoint, fresh optimizer and step 0;
  3. else `pretrained`: a Hugging Face folder (`weights.load_hf`), fresh optimizer;
  4. else `start(None)`, which makes the initial params itself (random or warm-started).

  Args:
    manager: this run's manager.
    target: `train.abstract_state(...)` (shapes, dtypes and shardings of the state).
    start: builds a fresh `RunState` from initial params (the loop's init: optimizer state,
      root key from the seed, empty Est, data position 0).
    init_from: path for step 2, or None.
    pretrained: HF folder (or Hub id) for step 3, or None.

  Returns:
    (run state, source) with source 'checkpoint:<step>', 'init_from:<path>',
    'pretrained:<path>' or 'scratch'.

  Raises:
    weights.CheckpointError: the pretrained folder is missing or does not match `target`.
    FileNotFoundError: `init_from` holds no checkpoint.
  """
  latest = manager.latest_step()
  if latest is not None:
    return restore(manager, target, latest), f"checkpoint:{latest}"
  if init_from:
    try:
      params = restore_params(init_from, target.params)
    except FileNotFoundError as e:
      raise FileNotFoundError(f"config.ckpt.init_from: {e}") from None
    return start(params), f"init_from:{init_from}"
  if pretrained:
    dtype = jax.tree.leaves(target.params)[0].dtype
    shardings = jax.tree.map(lambda s: s.sharding, target.params)
    expected = jax.tree.map(lambda s: s.shape, target.params)
    try:
      _, params = weights.load_hf(pretrained, dtype=dtype, shardings=shardings)
    except (KeyError, TypeError) as e:
      raise weights.CheckpointError(
        f"{pretrained}: its architecture does not match the configured model ({e!r})"
      ) from None
    got = jax.tree.map(lambda x: x.shape, params)
    if got != expected:
      raise weights.CheckpointError(
        f"{pretrained}: parameter shapes differ from the configured model's"
      )
    return start(params), f"pretrained:{pretrained}"
  return start(None), "scratch"


def export_hf(
  config: ModelConfig, params: Params, path: str | os.PathLike, tokenizer: Tokenizer | None = None
) -> None:
  """Writes the final policy as a Hugging Face folder (`weights.save_hf`) and, when given,
  the run's tokenizer with its chat template and a generation_config.json holding the run's
  stop ids (`Tokenizer.save`), so that transformers and inference servers load the folder
  as is and stop where the sampler did."""
  weights.save_hf(config, params, path)
  if tokenizer is not None:
    tokenizer.save(path)


# ----------------------------------------------------------------------------- host state


def generator_state(gen: np.random.Generator) -> dict[str, Any]:
  """The JSON-able state of a numpy Generator (its `bit_generator.state`)."""
  return gen.bit_generator.state


def generator_from_state(state: dict[str, Any]) -> np.random.Generator:
  """A numpy Generator continuing exactly from `generator_state`'s output.

  Raises:
    ValueError: an unknown bit generator name.
  """
  name = state.get("bit_generator")
  bit_gen_cls = getattr(np.random, str(name), None)
  if bit_gen_cls is None or not isinstance(bit_gen_cls, type):
    raise ValueError(f"generator state: unknown bit_generator {name!r}")
  bit_gen = bit_gen_cls()
  bit_gen.state = state
  return np.random.Generator(bit_gen)


# ----------------------------------------------------------------------------- preemption


class StopRequest(threading.Event):
  """The event `stop_signals` yields; `signal_name` is the first signal that set it
  ('SIGTERM', 'SIGINT'), None while unset."""

  signal_name: str | None = None

  def request(self, signum: int) -> None:
    if not self.is_set():
      self.signal_name = signal.Signals(signum).name
    self.set()


@contextlib.contextmanager
def stop_signals() -> Iterator[StopRequest]:
  """While active, SIGTERM and a first Ctrl-C (SIGINT) set the yielded event instead of
  killing the process; a second Ctrl-C interrupts at once (KeyboardInterrupt). The event
  names the signal (`StopRequest.signal_name`). The previous handlers come back on exit (a
  notebook's interrupt keeps working afterwards).

  The loop polls `stop_requested(event)` between steps, saves a checkpoint, waits for it
  (`close`) and returns; `ada_jax.main` then exits with its "stopped, resumable" code.
  Outside the main thread, where Python cannot install handlers, the event is never set.
  """
  event = StopRequest()
  if threading.current_thread() is not threading.main_thread():
    yield event
    return

  def on_sigint(signum, frame):
    if event.is_set():
      raise KeyboardInterrupt
    event.request(signum)
    print(
      "\nCtrl-C: stopping after this RL step with a checkpoint (Ctrl-C again to abort)",
      file=sys.stderr,
      flush=True,
    )

  previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
  signal.signal(signal.SIGTERM, lambda signum, frame: event.request(signum))
  signal.signal(signal.SIGINT, on_sigint)
  try:
    yield event
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def stop_requested(event: threading.Event) -> bool:
  """Whether any process has been asked to stop.

  With several processes the flags are combined (an all-gather), so that every process
  stops after the same step and all of them take part in the final save, even when the
  signals arrive at different times.
  """
  flag = event.is_set()
  if jax.process_count() > 1:
    flag = bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))
  return flag


def close(manager: ocp.CheckpointManager) -> None:
  """Waits for pending (async) saves to be complete on disk, then closes the manager."""
  manager.wait_until_finished()
  manager.close()
