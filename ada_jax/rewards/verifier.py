"""The reward verifier pool: judges in worker processes under a hard per-item timeout.

Symbolic maths on model output can run for hours inside C code (sympy evaluates
`9^{9^{9^{9^{9}}}}` as a big-integer power; one multiplication of such numbers never looks at
Python signals), exhaust memory or crash the parser. So the batched scorer
`RewardPool.score` runs the judges of `ada_jax.rewards.JUDGES` in worker processes: each
item gets a soft in-worker timer and a HARD deadline after which the parent SIGKILLs the
worker, scores the item 0, starts a replacement and goes on with the batch.
`ada_jax.rewards.math_reward` is the same judge in-process, for trusted input and tests.
"""

import dataclasses
import functools
import logging
import multiprocessing as mp
import os
import signal
import time
import weakref
from collections import deque
from collections.abc import Sequence
from multiprocessing import connection as mp_connection

import numpy as np

from ada_jax.rewards.grader import ERROR, JUDGES, MAX_ANSWER_CHARS, NO_BOX, TIMEOUT


class _SoftTimeout(BaseException):
  """Raised by the worker's SIGALRM handler; a BaseException so `except Exception` in
  sympy / math-verify cannot swallow it."""


def _on_alarm(signum, frame):
  raise _SoftTimeout()


def _die_with_parent() -> None:
  # Linux: a worker stuck in C code must not outlive the pool if the trainer is killed.
  try:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def _worker_main(conn, config: "VerifierConfig"):
  """Worker loop: receive (task_id, response, reference), send (task_id, reward, outcome).

  The soft timer (SIGALRM) ends Python-level work; the parent's hard deadline covers the rest.
  """
  _die_with_parent()
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle.
  logging.getLogger("math_verify").setLevel(logging.ERROR)  # Timeouts are ours, not theirs.
  judge = functools.partial(JUDGES[config.judge], max_chars=config.max_answer_chars)
  judge("\\boxed{1}", "2", None)  # Imports and warms sympy/antlr before the first deadline.
  soft_timeout_s = config.timeout_s * (config.soft_timeout_frac or 0.0)  # 0: timer off.
  if config.max_memory_mb:
    import resource

    limit = config.max_memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  signal.signal(signal.SIGALRM, _on_alarm)
  conn.send(("ready", os.getpid()))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):
      return
    if msg is None:
      return
    task_id, response, reference = msg
    try:
      try:
        signal.setitimer(signal.ITIMER_REAL, soft_timeout_s)
        reward, outcome = judge(response, reference, None)
      finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    except _SoftTimeout:  # The timer is one-shot, so it fires at most once per item.
      reward, outcome = 0.0, TIMEOUT
    except Exception:  # noqa: BLE001 — RecursionError, MemoryError, parser errors...
      reward, outcome = 0.0, ERROR
    conn.send((task_id, reward, outcome))


@dataclasses.dataclass(frozen=True)
class VerifierConfig:
  """Reward pool settings.

  Attributes:
    judge: reward function name in `JUDGES` ("math" or "exact").
    num_workers: worker processes; 0 means every core this process may use.
    timeout_s: hard per-item limit in seconds, from dispatch to result; the worker is killed
      and replaced when it passes, and the item scores 0.
    soft_timeout_frac: the in-worker timer fires at this fraction of `timeout_s`, so that
      slow Python-level sympy work ends without killing the worker; None: no soft timer.
    start_method: "forkserver" (default) or "spawn"; never "fork" — the trainer process holds
      JAX/XLA threads and forking it is unsafe.
    startup_timeout_s: limit for a worker to import math-verify and report ready.
    max_memory_mb: address-space limit per worker (MiB), None for none; a hostile answer such
      as 10^{10^{10}} then fails with MemoryError instead of taking the host's memory.
    max_answer_chars: longer box contents score 0 without being parsed.
  """

  judge: str = "math"
  num_workers: int = 0
  timeout_s: float = 5.0
  soft_timeout_frac: float | None = 0.8
  start_method: str = "forkserver"
  startup_timeout_s: float = 120.0
  max_memory_mb: int | None = 4096
  max_answer_chars: int = MAX_ANSWER_CHARS

  def __post_init__(self):
    if self.judge not in JUDGES:
      raise ValueError(f"judge={self.judge!r} not in {sorted(JUDGES)}")
    if self.num_workers < 0:
      raise ValueError(f"num_workers={self.num_workers} must be >= 0")
    if not self.timeout_s > 0:
      raise ValueError(f"timeout_s={self.timeout_s} must be > 0")
    if self.soft_timeout_frac is not None and not 0 < self.soft_timeout_frac <= 1:
      raise ValueError(f"soft_timeout_frac={self.soft_timeout_frac} must be in (0, 1]")
    if self.start_method not in ("forkserver", "spawn"):
      raise ValueError(f"start_method={self.start_method!r} must be 'forkserver' or 'spawn'")


@dataclasses.dataclass
class VerifyStats:
  """Counts for metrics (per batch in `RewardPool.last_stats`, cumulative in `.stats`).

  Attributes:
    items: responses scored.
    correct: responses scored 1.
    no_box: responses without a complete final box (scored 0 without math-verify).
    timeouts: items stopped by the soft timer or the hard deadline (scored 0).
    errors: items whose box is prose or unparseable (`rewards.UngradableAnswer`), whose
      judge raised or whose worker died (scored 0): how often the grader gives up.
    restarts: workers killed or lost and replaced.
  """

  items: int = 0
  correct: int = 0
  no_box: int = 0
  timeouts: int = 0
  errors: int = 0
  restarts: int = 0

  def add(self, other: "VerifyStats") -> None:
    for f in dataclasses.fields(self):
      setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclasses.dataclass(eq=False)
class _Slot:
  """One worker process and what it is doing (task None = idle once ready)."""

  process: mp.process.BaseProcess
  conn: mp_connection.Connection
  ready: bool = False
  task: int | None = None  # Task id in flight; results with another id are stale.
  index: int = -1  # Batch index of the item in flight.
  deadline: float = 0.0  # time.monotonic() limit for startup or for the item in flight.


def _kill(slot: _Slot) -> None:
  slot.process.kill()
  slot.process.join(5.0)
  slot.conn.close()


def _shutdown(slots: list[_Slot]) -> None:
  # Idle workers exit on a None message; busy or starting ones may be stuck in C code.
  for slot in slots:
    try:
      if slot.ready and slot.task is None:
        slot.conn.send(None)
        continue
    except OSError:
      pass
    slot.process.kill()
  deadline = time.monotonic() + 2.0
  for slot in slots:
    slot.process.join(max(0.0, deadline - time.monotonic()))
    if slot.process.is_alive():
      slot.process.kill()
      slot.process.join(5.0)
    slot.conn.close()
  slots.clear()


class RewardPool:
  """Persistent pool of verifier processes with a hard per-item timeout.

  Create once per run (workers import sympy once) and call `score` every RL step; use as a
  context manager or call `close()`. Not thread-safe: one `score` at a time.

  Example:
    with RewardPool(VerifierConfig(num_workers=8)) as pool:
      rewards = pool.score(responses, references)  # float32[N]
      metrics = dataclasses.asdict(pool.last_stats)
  """

  def __init__(self, config: VerifierConfig = VerifierConfig()):
    self.config = config
    try:
      cores = len(os.sched_getaffinity(0))
    except AttributeError:
      cores = os.cpu_count() or 1
    self.num_workers = config.num_workers or cores
    self._ctx = mp.get_context(config.start_method)
    if config.start_method == "forkserver":
      # Forked from a server that already imported these, a replacement worker starts in
      # milliseconds (no effect if this process started the forkserver before).
      self._ctx.set_forkserver_preload(["numpy", "math_verify", "ada_jax.rewards.verifier"])
    self._slots: list[_Slot] = []
    self._next_task = 0
    self.stats = VerifyStats()
    self.last_stats = VerifyStats()
    self._finalizer = weakref.finalize(self, _shutdown, self._slots)
    for _ in range(self.num_workers):
      self._slots.append(self._start())
    try:
      while not all(s.ready for s in self._slots):  # _poll raises past startup_timeout_s.
        self._poll(config.startup_timeout_s, VerifyStats(), None)
    except BaseException:
      self.close()
      raise

  def _start(self) -> _Slot:
    parent, child = self._ctx.Pipe(duplex=True)
    proc = self._ctx.Process(
      target=_worker_main, args=(child, self.config), daemon=True, name="ada_jax-reward"
    )
    proc.start()
    child.close()  # Only the worker holds this end now, so its death reads as EOF here.
    return _Slot(proc, parent, deadline=time.monotonic() + self.config.startup_timeout_s)

  def _replace(self, slot: _Slot, stats: VerifyStats) -> None:
    _kill(slot)
    self._slots[self._slots.index(slot)] = self._start()
    stats.restarts += 1

  @property
  def worker_pids(self) -> list[int]:
    """Process ids of the current workers (changes when one is replaced)."""
    return [s.process.pid for s in self._slots]

  def close(self) -> None:
    """Stops every worker (graceful, then SIGKILL); idempotent."""
    self._finalizer()

  def __enter__(self) -> "RewardPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def score(self, responses: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """Rewards of a batch of responses, in parallel, each under a hard timeout.

    A hung item (past `timeout_s`) is scored 0 and its worker killed and replaced; a worker
    that dies mid-item scores that item 0 and is replaced; the batch always returns.
    Responses with no box marker are scored 0 here, without a round trip.

    Args:
      responses: N model outputs (str; bytes are decoded as UTF-8 with replacement).
      references: N reference answers (LaTeX), `references[i]` for `responses[i]`.

    Returns:
      rewards: float32[N] of 0.0 / 1.0. Counts are in `last_stats` (this batch) and `stats`.

    Raises:
      ValueError: lengths differ, or an item is not a string (index named).
      RuntimeError: the pool is closed.
    """
    if not self._finalizer.alive:
      raise RuntimeError("RewardPool is closed")
    if len(responses) != len(references):
      raise ValueError(f"{len(responses)} responses but {len(references)} references")
    batch = VerifyStats(items=len(responses))
    rewards = np.zeros(len(responses), np.float32)
    todo: deque[tuple[int, str, str]] = deque()
    for i, (resp, ref) in enumerate(zip(responses, references, strict=True)):
      resp, ref = _as_text(resp, "responses", i), _as_text(ref, "references", i)
      if "\\boxed" in resp or "\\fbox" in resp:
        todo.append((i, resp, ref))
      else:
        batch.no_box += 1
    try:
      while todo or any(s.task is not None for s in self._slots):
        self._dispatch(todo, batch)
        waits = [s.deadline for s in self._slots if s.task is not None or not s.ready]
        self._poll(min(waits) - time.monotonic() if waits else 0.05, batch, rewards)
      batch.correct = int(rewards.sum())
    except BaseException:
      # Interrupted mid-batch: results in flight would be stale for the next batch.
      for slot in list(self._slots):
        if slot.task is not None:
          self._replace(slot, batch)
      raise
    finally:
      self.last_stats = batch
      self.stats.add(batch)
    return rewards

  def _dispatch(self, todo: deque, stats: VerifyStats) -> None:
    for slot in list(self._slots):
      if not todo:
        return
      if not slot.ready or slot.task is not None:
        continue
      index, resp, ref = todo.popleft()
      try:
        slot.conn.send((self._next_task, resp, ref))
      except OSError:  # Died while idle: nothing lost, requeue and replace.
        todo.appendleft((index, resp, ref))
        self._replace(slot, stats)
        continue
      slot.task, slot.index = self._next_task, index
      slot.deadline = time.monotonic() + self.config.timeout_s
      self._next_task += 1

  def _poll(self, timeout: float, stats: VerifyStats, rewards: np.ndarray | None) -> None:
    """Waits for results/readiness up to `timeout` s, then enforces deadlines."""
    conns = {s.conn: s for s in self._slots}
    for conn in mp_connection.wait(list(conns), timeout=max(0.0, timeout)):
      slot = conns[conn]
      try:
        msg = conn.recv()
      except (EOFError, OSError):  # The worker died: a crash mid-item, or a broken start.
        if not slot.ready:
          slot.process.join(5.0)
          raise RuntimeError(
            f"reward worker exited during start-up (exit code {slot.process.exitcode})"
          ) from None
        if slot.task is not None:
          stats.errors += 1
        self._replace(slot, stats)
        continue
      if msg[0] == "ready":
        slot.ready = True
      elif msg[0] == slot.task:
        _, reward, outcome = msg
        if rewards is not None:
          rewards[slot.index] = reward
        stats.errors += outcome == ERROR
        stats.timeouts += outcome == TIMEOUT
        stats.no_box += outcome == NO_BOX
        slot.task = None
    now = time.monotonic()
    for slot in list(self._slots):
      if (slot.task is not None or not slot.ready) and now > slot.deadline:
        if slot.task is not None:
          stats.timeouts += 1
        elif not slot.ready:
          raise RuntimeError(
            f"reward worker not ready within startup_timeout_s={self.config.startup_timeout_s}"
          )
        self._replace(slot, stats)


def _as_text(value, field: str, index: int) -> str:
  if isinstance(value, str):
    return value
  if isinstance(value, bytes):
    return value.decode("utf-8", errors="replace")
  raise ValueError(f"{field}[{index}] is {type(value).__name__}, expected str")
