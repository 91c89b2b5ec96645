"""The reward pool's worker processes and the thread that feeds them (`verifier.Verifier`).

Each worker runs a judge of `rewards.judges.JUDGES` on one item at a time under a soft
in-worker timer (SIGALRM); the dispatcher thread in the parent enforces the HARD deadline:
past `VerifierConfig.timeout_s` from dispatch it SIGKILLs the worker, scores the item 0
(outcome `TIMEOUT`) and starts a replacement. A worker that dies mid-item scores it 0
(outcome `ERROR`) and is replaced.
"""

import dataclasses
import functools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from multiprocessing import connection as mp_connection
from typing import Any

from ada_jax.rewards.grader import ERROR, TIMEOUT
from ada_jax.rewards.judges import JUDGES


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


def worker_main(conn, config) -> None:
  """Worker loop: receive (task_id, response, reference), send (task_id, reward, outcome).

  `config` is a `verifier.VerifierConfig` (judge, timeouts, memory limit). The soft timer
  (SIGALRM) ends Python-level work; the parent's hard deadline covers the rest.
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


@dataclasses.dataclass(eq=False)
class _Slot:
  """One worker process and what it is doing (task None = idle once ready)."""

  process: mp.process.BaseProcess
  conn: mp_connection.Connection
  ready: bool = False
  task: int | None = None  # Id of the item in flight.
  deadline: float = 0.0  # time.monotonic() limit for startup or for the item in flight.


def _kill(slot: _Slot) -> None:
  slot.process.kill()
  slot.process.join(5.0)
  slot.conn.close()


def shutdown(slots: list[_Slot]) -> None:
  """Stops the workers of `slots` (idle ones by message, the rest by SIGKILL); empties it."""
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


class Dispatcher:
  """The workers, the queue of submitted items and their results, and the thread that
  moves items between them.

  After start-up only the dispatcher thread touches `slots`; `todo`, `results`, `open`,
  `discarded` and `restarts` are shared with the caller's threads under `cond`. Item ids
  are never reused, so a result that arrives for a discarded item is simply dropped.
  `config` is the pool's `verifier.VerifierConfig`, `ctx` its multiprocessing context.

  Raises:
    RuntimeError: a worker did not start (exited, or not ready within startup_timeout_s).
  """

  def __init__(self, config, ctx, num_workers: int):
    self.config, self.ctx = config, ctx
    self.slots: list[_Slot] = []
    self.cond = threading.Condition()
    self.todo: deque[tuple[int, str, str]] = deque()
    self.results: dict[int, tuple[float, str]] = {}
    self.open: set[int] = set()  # Submitted, neither collected nor discarded.
    self.discarded: set[int] = set()  # Discarded while a worker holds them.
    self.next_id = 0
    self.restarts = 0
    self.failure: BaseException | None = None
    self.closed = False
    self.wake_r, self.wake_w = os.pipe()
    os.set_blocking(self.wake_r, False)
    os.set_blocking(self.wake_w, False)
    self.thread: threading.Thread | None = None
    try:
      for _ in range(num_workers):
        self.slots.append(self._start())
      while not all(s.ready for s in self.slots):  # _poll raises past startup_timeout_s.
        self._poll(config.startup_timeout_s)
    except BaseException:
      self.stop()
      raise
    self.thread = threading.Thread(target=self._run, name="ada_jax-reward-dispatch", daemon=True)
    self.thread.start()

  def _start(self) -> _Slot:
    parent, child = self.ctx.Pipe(duplex=True)
    proc = self.ctx.Process(
      target=worker_main, args=(child, self.config), daemon=True, name="ada_jax-reward"
    )
    proc.start()
    child.close()  # Only the worker holds this end now, so its death reads as EOF here.
    return _Slot(proc, parent, deadline=time.monotonic() + self.config.startup_timeout_s)

  def _replace(self, slot: _Slot) -> None:
    _kill(slot)
    self.slots[self.slots.index(slot)] = self._start()
    with self.cond:
      self.restarts += 1

  def wake(self) -> None:
    try:
      os.write(self.wake_w, b"x")
    except (BlockingIOError, OSError):  # Full: a wake-up is already pending; closed: done.
      pass

  def _record(self, task: int, reward: float, outcome: str) -> None:
    with self.cond:
      if task in self.discarded:
        self.discarded.discard(task)
      else:
        self.results[task] = (reward, outcome)
      self.cond.notify_all()

  def _run(self) -> None:
    try:
      while True:
        with self.cond:
          if self.closed:
            return
          self._dispatch()
        waits = [s.deadline for s in self.slots if s.task is not None or not s.ready]
        self._poll(min(waits) - time.monotonic() if waits else None)
    except BaseException as e:  # noqa: BLE001 — reported to every caller by `wait`.
      with self.cond:
        self.failure = e
        self.cond.notify_all()

  def _dispatch(self) -> None:
    """Sends queued items to idle workers (called with `cond` held)."""
    for slot in list(self.slots):
      if not self.todo:
        return
      if not slot.ready or slot.task is not None:
        continue
      task, resp, ref = self.todo.popleft()
      try:
        slot.conn.send((task, resp, ref))
      except OSError:  # Died while idle: nothing lost, requeue and replace.
        self.todo.appendleft((task, resp, ref))
        self._replace(slot)
        continue
      slot.task = task
      slot.deadline = time.monotonic() + self.config.timeout_s

  def _poll(self, timeout: float | None) -> None:
    """Waits up to `timeout` s (None: until woken) for results, then enforces deadlines."""
    conns: dict[Any, _Slot] = {s.conn: s for s in self.slots}
    ready = mp_connection.wait(
      [*conns, self.wake_r], timeout=None if timeout is None else max(0.0, timeout)
    )
    for conn in ready:
      if conn == self.wake_r:
        try:
          while os.read(self.wake_r, 4096):
            pass
        except BlockingIOError:
          pass
        continue
      slot = conns[conn]
      try:
        msg = conn.recv()
      except (EOFError, OSError):  # The worker died: a crash mid-item, or a broken start.
        if not slot.ready:
          slot.process.join(5.0)
          raise RuntimeError(
            f"reward worker exited during start-up (exit code {slot.process.exitcode})"
          ) from None
        task = slot.task
        self._replace(slot)
        if task is not None:
          self._record(task, 0.0, ERROR)
        continue
      if msg[0] == "ready":
        slot.ready = True
      elif msg[0] == slot.task:
        self._record(*msg)
        slot.task = None
    now = time.monotonic()
    for slot in list(self.slots):
      if (slot.task is not None or not slot.ready) and now > slot.deadline:
        if slot.task is None:
          raise RuntimeError(
            f"reward worker not ready within startup_timeout_s={self.config.startup_timeout_s}"
          )
        task = slot.task
        self._replace(slot)
        self._record(task, 0.0, TIMEOUT)

  def discard(self, ids) -> None:
    """Closes the open items among `ids`: queued ones leave the queue, results already in
    are dropped, and a result still being computed is dropped when it arrives."""
    with self.cond:
      drop = self.open.intersection(ids)
      self.open.difference_update(drop)
      queued = {item[0] for item in self.todo if item[0] in drop}
      self.todo = deque(item for item in self.todo if item[0] not in queued)
      for task in drop - queued:
        if self.results.pop(task, None) is None:  # A worker holds it.
          self.discarded.add(task)

  def stop(self) -> None:
    with self.cond:
      if self.closed:
        return
      self.closed = True
      self.cond.notify_all()
    self.wake()
    if self.thread is not None and self.thread is not threading.current_thread():
      # The thread leaves at its next wake-up; a replacement worker it is starting waits
      # for at most the start-up of one process.
      self.thread.join(self.config.startup_timeout_s)
    shutdown(self.slots)
    os.close(self.wake_r)
    os.close(self.wake_w)
