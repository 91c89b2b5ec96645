"""Guards around a run's state (docs/design.md "Run state"): one process per workdir, a
resume that keeps the config the run was started with, finite numbers only, and a clean
stop on SIGTERM or Ctrl-C in every phase.

- `hold_workdir`: an exclusive `fcntl.flock` on `<workdir>/.lock.p<process index>`. The
  kernel drops the lock when its process ends, however it ends (a `kill -9` included), so
  it is never left stale; the file names the holder (pid, host, start time) for the
  refusal message. With several processes each takes its own index's file, so a second
  multi-host job on the same workdir is refused on every host.
- `config_record` / `check_resume`: the run's config (with the resolved architecture) is
  saved in every checkpoint; a resume compares it with the current one and refuses a
  change of anything but `RESUMABLE` (folders, `LOCATIONS`, are compared by the
  fingerprint of the prompts read from them, `prompts_record`).
- `check_step`: a non-finite loss, gradient norm or update stops the run before it is
  saved (`checkpoint.save` refuses non-finite state too).
- `run_keys`: the run's root key (checkpointed) split once into named keys (`RunKeys`).
- `stop_signals`: SIGTERM and a first Ctrl-C during the RL loop set a flag that the loop
  polls between steps (save, then exit 75); during a phase with nothing to save (set-up,
  warm start, held-out evaluations: `StopRequest.enter`) they stop at once with `Stopped`
  (exit 75 too). The flag is also checked at every phase boundary, so a Ctrl-C whose
  exception was swallowed (e.g. raised inside a garbage-collection callback) still stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import math
import os
import pathlib
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from ada_jax import checkpoint, distributed
from ada_jax.config import RENAMED, ConfigError, as_dict

# ----------------------------------------------------------------------------- the lock


@contextlib.contextmanager
def hold_workdir(
  workdir: str | os.PathLike, process_index: int | None = None
) -> Iterator[pathlib.Path]:
  """Holds `workdir` for this process while the block runs (see module docstring).

  Args:
    workdir: the run directory (created if missing).
    process_index: whose lock file; default `jax.process_index()`.

  Yields:
    The lock file.

  Raises:
    ConfigError: another live process holds it; the message names the holder.
  """
  index = jax.process_index() if process_index is None else process_index
  path = pathlib.Path(workdir) / f".lock.p{index}"
  path.parent.mkdir(parents=True, exist_ok=True)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 1000, 0).decode(errors="replace").strip() or "another process"
      raise ConfigError(
        f"--workdir={workdir} is in use by {holder} (lock {path.name}): one run per workdir; "
        "wait for it to end, stop it, or use another --workdir"
      ) from None
    except OSError as e:  # a file system without flock (some network mounts)
      logging.warning("%s: cannot lock (%s); not guarding against a second run", path, e)
    now = datetime.datetime.now().isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()} since {now}\n".encode(), 0)
    yield path
  finally:
    os.close(fd)  # releases the lock


# ----------------------------------------------------------------------------- resume

# Config fields a resumed run may change (prefixes of dotted names): how long it runs, how
# often it logs, saves and evaluates, how many checkpoints it keeps, its held-out
# evaluation, the verifier's worker count and the device layout. Anything else changes
# what the run is and needs a new workdir (docs/design.md "Run state").
RESUMABLE = (
  "rl.steps",
  "rl.verifier.num_workers",
  "ckpt.every_steps",
  "ckpt.keep",
  "ckpt.async_save",
  "ckpt.export_hf",
  "eval",
  "mesh",
)
# `train`'s loss, optimizer and temperature are copies of other groups (`config._FILLED`).
_COPIES = ("train.loss", "train.optim", "train.temperature")
# Where the files were found, not what they hold: a path the configs resolve at parse
# (`shared_path` of configs/common.py) changes when a `../shared` folder appears or the checkout
# moves. A resume compares the training prompts' fingerprint (`prompts_record`) instead.
LOCATIONS = (
  "data.manual_dir",
  "data.data_dir",
  "tokenizer.dir",
  "eval.manual_dir",
  "eval.data_dir",
)


def config_record(cfg: Any, architecture: Any) -> dict[str, Any]:
  """The run's config as flat JSON: `{'optim.learning_rate': 3e-4, ...}`, plus the model
  the run built (`architecture.<field>` of its `ModelConfig`).

  Args:
    cfg: the `config.RunConfig`.
    architecture: the resolved `decoder.ModelConfig`.
  """
  tree = {**as_dict(cfg), "architecture": dataclasses.asdict(architecture)}
  flat = _flatten(json.loads(json.dumps(tree, default=str)))
  return {k: v for k, v in flat.items() if not k.startswith(_COPIES)}


def prompts_record(ps: Any) -> dict[str, Any]:
  """`{'data.prompts_sha256': ...}`: a fingerprint of the training prompts as the run reads
  them (their token ids and reference answers, in order), which a resume compares in place
  of the folders they came from (`LOCATIONS`).

  Args:
    ps: the run's `data.prompts.PromptSet`.
  """
  digest = hashlib.sha256()
  for tokens, answer in zip(ps.tokens, ps.answers, strict=True):
    digest.update(np.asarray(tokens, np.int64).tobytes())
    digest.update(b"\0" + str(answer).encode() + b"\0")
  return {"data.prompts_sha256": digest.hexdigest()}


def tokenizer_record(tok: Any) -> dict[str, Any]:
  """`{'tokenizer.resolved.stop_ids': [...], 'tokenizer.resolved.pad_id': ...}`: the stop and
  pad ids the run samples with, as resolved from the config and the model folder's files
  (`generation_config.json`), so that a resume after a folder changed in place is refused
  instead of sampling other responses under the old record. The chat template is covered by
  `prompts_record` (it changes the prompts' tokens).

  Args:
    tok: the run's `models.tokenizer.Tokenizer`.
  """
  return {
    "tokenizer.resolved.stop_ids": [int(i) for i in tok.eos_ids],
    "tokenizer.resolved.pad_id": int(tok.pad_id),
  }


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      out.update(_flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def check_resume(saved: Mapping[str, Any] | None, current: Mapping[str, Any], step: int) -> None:
  """Refuses to resume checkpoint `step` (made with config `saved`) under `current` when
  a field outside `RESUMABLE` differs. Fields only one side has (a newer or older code
  version's) are not compared; a checkpoint without a record is accepted with a warning.

  Raises:
    ConfigError: naming every changed field with its old and new value.
  """
  if saved is None:
    logging.warning("checkpoint %d has no saved config: resuming without comparing", step)
    return
  saved = {RENAMED.get(k, k): v for k, v in saved.items()}
  changed = [
    k for k in sorted(set(saved) & set(current)) if saved[k] != current[k] and k not in LOCATIONS
  ]
  refused = [k for k in changed if not any(k == p or k.startswith(p + ".") for p in RESUMABLE)]
  if refused:
    diffs = "; ".join(f"{_described(k)}: {saved[k]!r} -> {current[k]!r}" for k in refused)
    raise ConfigError(
      f"the workdir's checkpoint {step} is of a run with another config ({diffs}); a "
      f"resume may change only {', '.join(RESUMABLE)}: restore the other fields, or "
      "start a new run in another --workdir (ckpt.init_from=<this workdir>/checkpoints "
      "starts it from these weights)"
    )


def _described(key: str) -> str:
  """A record key as a user knows it: a config field, the architecture, the tokenizer."""
  if key.startswith("architecture."):
    return f"config.model, architecture {key.removeprefix('architecture.')}"
  if key.startswith("tokenizer.resolved."):
    return f"the model folder's tokenizer {key.removeprefix('tokenizer.resolved.')}"
  return f"config.{key}"


# ----------------------------------------------------------------------------- numbers


def check_step(step: int, metrics: Mapping[str, Any], params: Any) -> None:
  """Stops the run at RL step `step` when its loss or gradient norm (in `metrics`, absent
  for a skipped update) is NaN or infinite, or its update left a non-finite param.

  Raises:
    checkpoint.NonFiniteError: naming the step and the quantity.
  """
  what = next(
    (
      f"the {name} is {value}"
      for name in ("loss", "grad_norm")
      if (value := metrics.get(name)) is not None and not math.isfinite(float(value))
    ),
    None,
  )
  if what is None and (bad := distributed.nonfinite_leaves(params)):
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    what = f"the update left non-finite params ({bad[0]}{more})"
  if what is not None:
    raise checkpoint.NonFiniteError(
      f"RL step {step}: {what}; stopped before saving it (the checkpoints on disk are "
      "finite). A rerun would repeat it: start a new run with a smaller "
      "optim.learning_rate (or other data) in another --workdir, with "
      "ckpt.init_from=<this workdir>/checkpoints to keep the weights trained so far"
    )


# ----------------------------------------------------------------------------- keys


@dataclasses.dataclass(frozen=True)
class RunKeys:
  """The run's root key (`jax.random.key(config.seed)`, checkpointed) split once.

  Attributes:
    init: the random init (`start.initial_params`' step 3).
    rollout: the RL steps' rollouts (step s: `fold_in(rollout, s)`).
    eval: the held-out evaluations' sampling.
  """

  init: jax.Array
  rollout: jax.Array
  eval: jax.Array


def run_keys(root: jax.Array) -> RunKeys:
  """`RunKeys` of a root key: its three-way split, in the order init, rollout, eval."""
  init, rollout, eval_key = jax.random.split(root, 3)
  return RunKeys(init, rollout, eval_key)


# ----------------------------------------------------------------------------- host state


@dataclasses.dataclass
class Progress:
  """The run's host-side state, saved in every checkpoint as its JSON `host` item
  (`checkpoint.RunState.host`): how far the run is and what it measured off the device.

  Attributes:
    step: the last RL step done (0: none yet).
    iterator: the prompt iterator's position (`PromptIterator.state`, as JSON lists).
    np_rng: the host Generator's state (`generator_state`).
    config: the config record the run was last saved with (`config_record` and
      `prompts_record`), compared with the current one on a resume (`check_resume`).
    warmstart: the supervised warm start's summary, when the run made one.
    before_rl: the held-out metrics before RL (flat; {} without benchmarks); None until
      measured (a stop during that evaluation measures it again).
    before_rl_eval: the evaluation settings `before_rl` was measured with.
  """

  step: int = 0
  iterator: dict[str, Any] = dataclasses.field(default_factory=dict)
  np_rng: dict[str, Any] = dataclasses.field(default_factory=dict)
  config: dict[str, Any] | None = None
  warmstart: dict[str, Any] | None = None
  before_rl: dict[str, Any] | None = None
  before_rl_eval: dict[str, Any] | None = None

  @classmethod
  def from_host(cls, host: Mapping[str, Any]) -> Progress:
    """From a checkpoint's host JSON (keys it does not know, e.g. a newer version's, are
    left out; missing ones keep their defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in host.items() if k in names})

  def to_host(self) -> dict[str, Any]:
    """The checkpoint's host JSON (unset fields left out)."""
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


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


# ----------------------------------------------------------------------------- signals


class Stopped(BaseException):  # noqa: N818 -- like KeyboardInterrupt, not an error
  """A signal stopped the run in a phase with nothing to save (set-up, warm start, held-out
  evaluation); the same command resumes. A BaseException, as KeyboardInterrupt is, so
  that no `except Exception` on the way out swallows it.

  Attributes:
    signal_name: 'SIGTERM' or 'SIGINT'.
    phase: what was running, e.g. 'the warm start'.
  """

  def __init__(self, signal_name: str | None, phase: str):
    self.signal_name, self.phase = signal_name or "a signal", phase
    super().__init__(f"stopped by {self.signal_name} during {phase}")


class StopRequest(threading.Event):
  """The event `stop_signals` yields. `signal_name`: the first signal that set it ('SIGTERM',
  'SIGINT'), None while unset. `phase`: while not None, a signal raises `Stopped(phase)` at
  once; None (the RL loop), it only sets the event."""

  signal_name: str | None = None
  phase: str | None = None

  def request(self, signum: int) -> None:
    if not self.is_set():
      self.signal_name = signal.Signals(signum).name
    self.set()
    if self.phase is not None:
      raise Stopped(self.signal_name, self.phase)

  def enter(self, phase: str | None) -> None:
    """Starts `phase` (None: a part where signals only set the event, to be polled).

    Raises:
      Stopped: the event was set before (a signal whose exception was swallowed, or one
        that came while signals were only polled), naming the phase it came in.
    """
    if self.is_set():
      raise Stopped(self.signal_name, self.phase or phase or "the run")
    self.phase = phase


@contextlib.contextmanager
def stop_signals(phase: str | None = None) -> Iterator[StopRequest]:
  """While active, SIGTERM and a first Ctrl-C (SIGINT) set the yielded event instead of
  killing the process (and raise `Stopped` while `event.phase` is set, starting at
  `phase`); a second Ctrl-C interrupts at once (KeyboardInterrupt). The previous handlers
  come back on exit (a notebook's interrupt keeps working afterwards).

  The loop polls `stop_requested(event)` between steps, saves a checkpoint, waits for it
  (`checkpoint.close`) and returns; `ada_jax.main` then exits with its "stopped, resumable"
  code. Outside the main thread, where Python cannot install handlers, the event is never
  set.
  """
  event = StopRequest()
  if threading.current_thread() is not threading.main_thread():
    yield event
    return

  def on_sigint(signum, frame):
    if event.is_set():
      raise KeyboardInterrupt
    if event.phase is None:
      print(
        "\nCtrl-C: stopping after this RL step with a checkpoint (Ctrl-C again to abort)",
        file=sys.stderr,
        flush=True,
      )
    event.request(signum)

  previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
  event.phase = phase
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
