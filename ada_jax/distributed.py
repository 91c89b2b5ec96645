"""Multi-host runs on JAX's own multi-controller runtime (docs/design.md "Distribution").

Every host runs one process with the same program: `initialize` connects the processes
through `jax.distributed.initialize` (TPU VMs and Slurm / Open MPI clusters are detected by
JAX; elsewhere a coordinator address, process count and process id come from the
environment). After it, `jax.devices()` lists the devices of every process and one `Mesh`
spans them all.

The processes must launch identical jit calls in the same order. They do, because every
process runs the same adaptive controller on the same prompts with the same seeded host
RNG, and the only outside input of that controller, the rewards, is made identical here:
`SharedGrader` has each process grade one block of the responses and all-gathers the
blocks, so a verifier timeout on one host cannot make the hosts disagree (and the
verifier work is split across hosts). `assert_same` compares a fingerprint of the
controller state across processes after each step and stops the run at the first
divergence instead of letting it deadlock in mismatched collectives later.

Failure of a peer: a process killed mid-step closes its sockets, so the survivors'
next collective fails at once (gloo on CPU; ICI/NCCL errors on accelerators), and a
process that stops answering is declared dead by the coordination service after
`heartbeat_timeout_s`, which then terminates the others. `exit_on_failure` turns the
resulting Python exception into one clear log line and a non-zero exit without waiting on
the shutdown barrier of a runtime whose peer is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging as std_logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """How this process joins a multi-process run.

  Attributes:
    mode: 'off' = one process, never call `jax.distributed.initialize`; 'on' = always call
      it (arguments left unset are auto-detected by JAX: TPU VM metadata, Slurm, Open
      MPI); 'auto' = call it when a coordinator address is given or JAX detects a
      cluster, else run as one process.
    coordinator_address: 'host:port' of process 0 ('' = auto-detect). On a GPU cluster:
      the first host's address and any free port, the same on every process.
    num_processes: total processes (0 = auto-detect).
    process_id: this process's index in [0, num_processes) (-1 = auto-detect).
    local_device_ids: restrict this process to these local accelerators (() = all).
    init_timeout_s: seconds to wait for every process to connect.
    heartbeat_timeout_s: a process silent this long is declared dead and the others are
      terminated (the bound on how long a survivor can wait for a dead peer).
    shutdown_timeout_s: seconds a finishing process waits for the others at exit.
    cpu_collectives: cross-process collectives of the CPU backend ('gloo' or 'mpi');
      only the CPU backend reads it.
  """

  mode: str = "auto"
  coordinator_address: str = ""
  num_processes: int = 0
  process_id: int = -1
  local_device_ids: tuple[int, ...] = ()
  init_timeout_s: int = 300
  heartbeat_timeout_s: int = 100
  shutdown_timeout_s: int = 300
  cpu_collectives: str = "gloo"

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"DistributedConfig.mode {self.mode!r}: use one of {MODES}")
    if self.num_processes < 0:
      raise ValueError(f"DistributedConfig.num_processes must be >= 0, got {self.num_processes}")
    if self.num_processes and not -1 <= self.process_id < self.num_processes:
      raise ValueError(
        f"DistributedConfig.process_id {self.process_id} is outside "
        f"[0, num_processes={self.num_processes})"
      )
    for name in ("init_timeout_s", "heartbeat_timeout_s", "shutdown_timeout_s"):
      if getattr(self, name) < 1:
        raise ValueError(f"DistributedConfig.{name} must be >= 1 s, got {getattr(self, name)}")
    if self.cpu_collectives not in ("gloo", "mpi"):
      raise ValueError(
        f"DistributedConfig.cpu_collectives {self.cpu_collectives!r}: use 'gloo' or 'mpi'"
      )

  @classmethod
  def from_env(cls, environ: Mapping[str, str] | None = None) -> DistributedConfig:
    """The configuration given by environment variables (unset ones keep the defaults).

    `ADA_JAX_DISTRIBUTED` (mode), `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
    `JAX_PROCESS_ID`, `JAX_LOCAL_DEVICE_IDS` (comma-separated), `ADA_JAX_INIT_TIMEOUT_S`,
    `ADA_JAX_HEARTBEAT_TIMEOUT_S`, `ADA_JAX_SHUTDOWN_TIMEOUT_S`, `ADA_JAX_CPU_COLLECTIVES`.

    Raises:
      ValueError: a variable that does not parse, named.
    """
    env = os.environ if environ is None else environ
    kwargs: dict[str, Any] = {}
    names = {
      "mode": "ADA_JAX_DISTRIBUTED",
      "coordinator_address": "JAX_COORDINATOR_ADDRESS",
      "num_processes": "JAX_NUM_PROCESSES",
      "process_id": "JAX_PROCESS_ID",
      "local_device_ids": "JAX_LOCAL_DEVICE_IDS",
      "init_timeout_s": "ADA_JAX_INIT_TIMEOUT_S",
      "heartbeat_timeout_s": "ADA_JAX_HEARTBEAT_TIMEOUT_S",
      "shutdown_timeout_s": "ADA_JAX_SHUTDOWN_TIMEOUT_S",
      "cpu_collectives": "ADA_JAX_CPU_COLLECTIVES",
    }
    for field, var in names.items():
      raw = env.get(var, "").strip()
      if not raw:
        continue
      try:
        if field == "local_device_ids":
          kwargs[field] = tuple(int(x) for x in raw.split(","))
        elif isinstance(getattr(cls, field), int):
          kwargs[field] = int(raw)
        else:
          kwargs[field] = raw
      except ValueError:
        raise ValueError(
          f"environment variable {var}={raw!r} is not valid for DistributedConfig.{field}"
        ) from None
    try:
      return cls(**kwargs)
    except ValueError as e:
      raise ValueError(f"{e} (from the environment: {sorted(names.values())})") from None


def initialize(config: DistributedConfig = DistributedConfig()) -> bool:
  """Joins the multi-process run described by `config` (call before any other JAX use).

  Args:
    config: see `DistributedConfig`.

  Returns:
    True when the multi-controller runtime was started (even with one process, as on a
    single-host TPU VM), False when this stays a plain single-process run.

  Raises:
    RuntimeError: JAX's backend was already initialised (a JAX computation or
      `jax.devices()` ran first), or the coordinator could not be reached in time.
    ValueError: inconsistent process count / id (JAX's message).
  """
  if config.mode == "off" or jax.distributed.is_initialized():
    return jax.distributed.is_initialized()
  jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
  explicit = bool(config.coordinator_address or config.num_processes)
  kwargs = dict(
    coordinator_address=config.coordinator_address or None,
    num_processes=config.num_processes or None,
    process_id=None if config.process_id < 0 else config.process_id,
    local_device_ids=list(config.local_device_ids) or None,
    initialization_timeout=config.init_timeout_s,
    heartbeat_timeout_seconds=config.heartbeat_timeout_s,
    shutdown_timeout_seconds=config.shutdown_timeout_s,
  )
  try:
    jax.distributed.initialize(**kwargs)
  except ValueError as e:
    # JAX found no cluster environment to take the missing arguments from: in 'auto'
    # mode that simply means a single-process run (a laptop, one GPU box).
    if config.mode == "auto" and not explicit and "coordinator_address" in str(e):
      logging.info("no multi-process cluster detected: running as one process")
      return False
    raise
  logging.warning(
    "joined the multi-process run: process %d of %d", jax.process_index(), jax.process_count()
  )
  return True


# ----------------------------------------------------------------------------- host values


def allgather(x: np.ndarray) -> np.ndarray:
  """`[process_count, *x.shape]`: every process's `x` (same shape and dtype everywhere)."""
  if jax.process_count() == 1:
    return np.asarray(x)[None]
  return np.asarray(multihost_utils.process_allgather(np.asarray(x)))


def block_of(n: int, process: int | None = None, count: int | None = None) -> slice:
  """The contiguous block of `n` items that `process` (default: this one) handles: blocks
  of ceil(n / count), the last ones shorter or empty."""
  process = jax.process_index() if process is None else process
  count = jax.process_count() if count is None else count
  size = -(-n // count)
  return slice(min(process * size, n), min((process + 1) * size, n))


class SharedGrader:
  """A `verifier.Verifier` whose rewards are identical on every process, each response
  graded once: process p grades block p of each batch (`block_of`), and `collect`
  all-gathers the blocks. With one process it is the pool itself.

  `submit` returns at once (grading runs in the pool's workers, e.g. while the next
  segment decodes); `collect` is a collective when there are several processes, so every
  process must call it for the same tickets in the same order, as identical controllers do.

  Args:
    pool: an object with `submit(responses, references) -> ids` and
      `collect(ids) -> float[k]` (`Verifier`).
  """

  def __init__(self, pool: Any):
    self.pool = pool

  def submit(self, responses: Sequence[str], references: Sequence[str]) -> tuple[Any, int]:
    """Queues a batch of N responses (this process's block of it) for grading.

    Returns:
      a ticket for `collect`.

    Raises:
      ValueError: lengths differ (before anything is queued).
    """
    if len(responses) != len(references):
      raise ValueError(f"{len(responses)} responses but {len(references)} references")
    n = len(responses)
    mine = block_of(n)
    ids = self.pool.submit(list(responses[mine]), list(references[mine])) if n else None
    return ids, n

  def collect(self, ticket: tuple[Any, int]) -> np.ndarray:
    """Waits for a batch's grades: `float32[N]`, the same on every process."""
    ids, n = ticket
    local = np.asarray(self.pool.collect(ids) if n else [], np.float32)
    if jax.process_count() == 1 or n == 0:
      return local
    out = np.zeros(-(-n // jax.process_count()), np.float32)  # all-gathered: one shape
    out[: local.size] = local
    return allgather(out).reshape(-1)[:n]

  def score(self, responses: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """`collect(submit(...))`: `float32[N]` rewards, identical on every process."""
    return self.collect(self.submit(responses, references))


# ----------------------------------------------------------------------------- agreement


class DivergenceError(RuntimeError):
  """The processes of one run disagree on a value that must be identical."""


def fingerprint(value: Any) -> str:
  """A hex digest of a nested structure of dicts, lists, numpy arrays and scalars.

  Equal values give equal digests on any process (dict keys are sorted; arrays contribute
  dtype, shape and bytes; floats their exact bits), so comparing digests across processes
  compares the values.
  """
  h = hashlib.blake2b(digest_size=16)
  _feed(h, value)
  return h.hexdigest()


def _feed(h, value) -> None:
  if isinstance(value, Mapping):
    h.update(b"{")
    for key in sorted(value, key=str):
      _feed(h, str(key))
      _feed(h, value[key])
    h.update(b"}")
  elif isinstance(value, (list, tuple)):
    h.update(b"[")
    for item in value:
      _feed(h, item)
    h.update(b"]")
  elif isinstance(value, (np.ndarray, np.generic, jax.Array)):
    arr = np.ascontiguousarray(np.asarray(value))
    h.update(f"{arr.dtype.str}{arr.shape}".encode())
    h.update(arr.tobytes())
  elif isinstance(value, float):
    h.update(np.float64(value).tobytes())
  else:
    h.update(json.dumps(value).encode())


def assert_same(what: str, value: Any) -> str:
  """Checks that `value` is identical on every process (an all-gather of a 16-byte digest).

  Args:
    what: a name for the error message (e.g. 'controller state after RL step 12').
    value: anything `fingerprint` takes.

  Returns:
    The fingerprint (the same on every process).

  Raises:
    DivergenceError: naming the processes whose value differs from process 0's.
  """
  digest = fingerprint(value)
  if jax.process_count() == 1:
    return digest
  raw = np.frombuffer(bytes.fromhex(digest), np.uint8)
  everyone = allgather(raw)
  differ = [p for p in range(len(everyone)) if not np.array_equal(everyone[p], everyone[0])]
  if differ:
    raise DivergenceError(
      f"{what}: processes {differ} disagree with process 0 (fingerprints "
      f"{[bytes(r).hex() for r in everyone]}); their runs have diverged"
    )
  return digest


def local_fingerprint(tree: Any) -> str:
  """Fingerprint of the data this process holds of a pytree of (sharded) arrays: each leaf's
  distinct addressable shards with their indices. Processes that hold the same shards
  (parameters replicated over processes, i.e. pure data parallelism) get equal digests
  exactly when their copies are bit-identical."""
  parts = []
  for leaf in jax.tree.leaves(tree):
    if not isinstance(leaf, jax.Array):
      parts.append(np.asarray(leaf))
      continue
    seen = {}
    for shard in leaf.addressable_shards:
      key = str(tuple((s.start, s.stop) for s in shard.index))
      if key not in seen:
        seen[key] = np.asarray(shard.data)
    parts.append(seen)
  return fingerprint(parts)


# Odd multipliers of the four 32-bit lanes of `content_digest` (murmur3's finaliser mixes).
_LANES = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)


@jax.jit
def _lane_sums(leaves: list[jax.Array]) -> list[jax.Array]:
  out = []
  for x in leaves:
    size = x.dtype.itemsize
    if size == 8:
      x = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
    elif size in (1, 2, 4):
      x = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size])
    words = x.reshape(-1).astype(jnp.uint32)
    index = jnp.arange(words.size, dtype=jnp.uint32)
    lanes = []
    for c in _LANES:
      h = (words ^ (index * jnp.uint32(c))) * jnp.uint32(0xCC9E2D51)
      h = (h ^ (h >> 15)) * jnp.uint32(c)
      lanes.append(jnp.sum(h ^ (h >> 13), dtype=jnp.uint32))
    out.append(jnp.stack(lanes))
  return out


def content_digest(tree: Any) -> str:
  """A hex digest of the values of a pytree of (sharded) arrays, the same on every process:
  each leaf's bits, mixed with their positions, summed on the devices in four 32-bit lanes
  (one pass over the data, a few bytes to the host), then hashed with the leaves' paths,
  shapes and dtypes. Any changed bit changes it (up to a 2^-128 chance); it identifies
  weights in results caches. A collective with several processes: all must call it."""
  named = jax.tree_util.tree_leaves_with_path(tree)
  sums = _lane_sums([jnp.asarray(x) if not isinstance(x, jax.Array) else x for _, x in named])
  parts = [
    (jax.tree_util.keystr(path), str(x.dtype), tuple(x.shape), _replicated(s).tolist())
    for (path, x), s in zip(named, sums, strict=True)
  ]
  return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


@jax.jit
def _finite_flags(leaves: list[jax.Array]) -> jax.Array:
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def nonfinite_leaves(tree: Any) -> list[str]:
  """Paths (`jax.tree_util.keystr`) of the floating-point leaves of `tree` holding a NaN
  or an infinity; one small device reduction and one transfer, for sharded arrays too."""
  named = [
    (jax.tree_util.keystr(path), x)
    for path, x in jax.tree_util.tree_leaves_with_path(tree)
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
  ]
  if not named:
    return []
  flags = _finite_flags([x for _, x in named])
  flags = _replicated(flags)
  return [name for (name, _), ok in zip(named, flags, strict=True) if not ok]


def _replicated(x: jax.Array) -> np.ndarray:
  return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


# ----------------------------------------------------------------------------- failure


@contextlib.contextmanager
def exit_on_failure() -> Iterator[None]:
  """Around a multi-process run: an exception ends this process at once with exit code 1.

  A failed collective usually means a peer died; waiting for JAX's shutdown barrier would
  then only add `shutdown_timeout_s` and a crash report. One process: exceptions pass
  through unchanged.
  """
  try:
    yield
  except Exception as e:  # noqa: BLE001 - every failure ends the run the same way
    if jax.process_count() == 1:
      raise
    logging.exception("process %d of %d failed", jax.process_index(), jax.process_count())
    print(
      f"ada_jax: process {jax.process_index()} of {jax.process_count()} stops: "
      f"{type(e).__name__}: {e}\nIf another process died first (killed, preempted, out of "
      "memory), this failure is the consequence: see that process's log.",
      file=sys.stderr,
      flush=True,
    )
    std_logging.shutdown()
    os._exit(1)
