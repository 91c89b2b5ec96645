"""The reward verifier pool: judges in worker processes under a hard per-item timeout.

Symbolic maths on model output can run for hours inside C code (sympy evaluates
`9^{9^{9^{9^{9}}}}` as a big-integer power; one multiplication of such numbers never looks at
Python signals), exhaust memory or crash the parser. So the batched scorer
`Verifier.score` runs the judges of `rewards.judges.JUDGES` in worker processes: each
item gets a soft in-worker timer and a HARD deadline after which the parent SIGKILLs the
worker, scores the item 0, starts a replacement and goes on with the batch (the worker
side and its dispatcher thread are in `ada_jax.rewards.workers`).
Grading can also overlap other work: `Verifier.submit` queues items and returns at once,
`Verifier.collect` waits for chosen items; `score` is exactly those two calls.
`ada_jax.rewards.grader.math_reward` is the same judge in-process, for trusted input and tests.
"""

import dataclasses
import multiprocessing as mp
import os
import weakref
from collections.abc import Sequence

import numpy as np

from ada_jax import bounds
from ada_jax.rewards.grader import ERROR, MAX_ANSWER_CHARS, NO_BOX, TIMEOUT
from ada_jax.rewards.judges import JUDGES
from ada_jax.rewards.workers import Dispatcher


@dataclasses.dataclass(frozen=True)
class VerifierConfig:
  """Reward pool settings: the experiment config's `rl.verifier` and `eval.verifier` groups.

  Attributes:
    judge: reward function name in `JUDGES` ("math", "exact" or the authors' "released");
      '' = the caller's default (an evaluation: each benchmark's own judge), which a
      `Verifier` refuses.
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
  num_workers: int = bounds.within("[0, 4096]", 0)
  # Timeouts: a day at most (poll(2) takes milliseconds as a C int: 24.8 days overflow).
  timeout_s: float = bounds.within("(0, 86400]", 5.0)
  soft_timeout_frac: float | None = bounds.within("(0, 1]", 0.8)
  start_method: str = "forkserver"
  startup_timeout_s: float = bounds.within("(0, 86400]", 120.0)
  max_memory_mb: int | None = bounds.within("[64, 2**30]", 4096)
  max_answer_chars: int = bounds.within("[1, 10**8]", MAX_ANSWER_CHARS)

  def __post_init__(self):
    if self.judge not in ("", *JUDGES):
      raise ValueError(f"judge={self.judge!r}: not a judge; known: {sorted(JUDGES)}")
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
  """Counts for metrics (per batch in `Verifier.last_stats`, cumulative in `.stats`).

  Attributes:
    items: responses scored.
    correct: responses scored 1.
    no_box: responses without a complete final box (scored 0 without math-verify).
    timeouts: items stopped by the soft timer or the hard deadline (scored 0).
    errors: items whose box is prose or unparseable (`grader.UngradableAnswer`), whose
      reference is empty, prose or unparseable (`grader.UngradableReference`), whose judge
      raised or whose worker died (scored 0): how often the grader gives up.
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


class Verifier:
  """Persistent pool of verifier processes with a hard per-item timeout.

  Create once per run (workers import sympy once); use as a context manager or call
  `close()`. Two ways in, one code path:

  * `score(responses, references)`: blocks and returns the batch's rewards (it is
    `submit` followed by `collect`).
  * `submit(...)` returns item ids at once and a dispatcher thread feeds the workers while
    the caller goes on (e.g. decodes the next segment); `collect(ids)` waits for those
    items and returns their rewards in the order of `ids`; `done(ids)` asks without
    waiting; `discard(ids)` drops items no longer wanted (a cancelled rollout row).

  Ids are consecutive int64s in submission order (row-id order when rows are submitted as
  they finish), never reused. Every method may be called from any thread.

  Example:
    with Verifier(VerifierConfig(num_workers=8)) as pool:
      ids = pool.submit(responses, references)  # Returns at once.
      ...  # decode the next segment
      rewards = pool.collect(ids)  # float32[N]
      metrics = dataclasses.asdict(pool.last_stats)
  """

  def __init__(self, config: VerifierConfig = VerifierConfig()):
    if not config.judge:
      raise ValueError("VerifierConfig.judge is empty: a reward pool needs a judge")
    self.config = config
    try:
      cores = len(os.sched_getaffinity(0))
    except AttributeError:
      cores = os.cpu_count() or 1
    self.num_workers = config.num_workers or cores
    ctx = mp.get_context(config.start_method)
    if config.start_method == "forkserver":
      # Forked from a server that already imported these, a replacement worker starts in
      # milliseconds (no effect if this process started the forkserver before).
      ctx.set_forkserver_preload(["numpy", "math_verify", "ada_jax.rewards.workers"])
    self.stats = VerifyStats()
    self.last_stats = VerifyStats()
    self._restarts_seen = 0
    self._dispatcher = Dispatcher(config, ctx, self.num_workers)
    self._finalizer = weakref.finalize(self, self._dispatcher.stop)

  @property
  def worker_pids(self) -> list[int]:
    """Process ids of the current workers (changes when one is replaced)."""
    return [s.process.pid for s in self._dispatcher.slots]

  def close(self) -> None:
    """Stops the dispatcher and every worker (graceful, then SIGKILL); idempotent. Items
    not collected are lost; a `collect` waiting in another thread raises RuntimeError."""
    self._finalizer()

  def __enter__(self) -> "Verifier":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def score(self, responses: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """Rewards of a batch of responses, in parallel, each under a hard timeout.

    A hung item (past `timeout_s`) is scored 0 and its worker killed and replaced; a worker
    that dies mid-item scores that item 0 and is replaced; the batch always returns.
    Responses with no box marker are scored 0 here, without a round trip. Interrupted
    (e.g. KeyboardInterrupt), the batch's items are discarded.

    Args:
      responses: N model outputs (str; bytes are decoded as UTF-8 with replacement).
      references: N reference answers (LaTeX), `references[i]` for `responses[i]`.

    Returns:
      rewards: float32[N] of 0.0 / 1.0. Counts are in `last_stats` (this batch) and `stats`.

    Raises:
      ValueError: lengths differ, or an item is not a string (index named).
      RuntimeError: the pool is closed, or a replacement worker failed to start.
    """
    ids = self.submit(responses, references)
    try:
      return self.collect(ids)
    except BaseException:
      self.discard(ids)
      raise

  def submit(self, responses: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """Queues a batch for grading and returns at once; the dispatcher thread grades it.

    Args:
      responses: N model outputs (str; bytes are decoded as UTF-8 with replacement).
      references: N reference answers, `references[i]` for `responses[i]`.

    Returns:
      int64[N] item ids, consecutive and increasing in submission order.

    Raises:
      ValueError: lengths differ, or an item is not a string (index named); nothing is
        queued then.
      RuntimeError: the pool is closed or its dispatcher failed.
    """
    if len(responses) != len(references):
      raise ValueError(f"{len(responses)} responses but {len(references)} references")
    items = [
      (_as_text(resp, "responses", i), _as_text(ref, "references", i))
      for i, (resp, ref) in enumerate(zip(responses, references, strict=True))
    ]
    d = self._dispatcher
    with d.cond:
      self._check_alive()
      first = d.next_id
      d.next_id += len(items)
      for task, (resp, ref) in enumerate(items, first):
        d.open.add(task)
        if "\\boxed" in resp or "\\fbox" in resp:
          d.todo.append((task, resp, ref))
        else:
          d.results[task] = (0.0, NO_BOX)
    d.wake()
    return np.arange(first, first + len(items), dtype=np.int64)

  def done(self, ids: Sequence[int]) -> np.ndarray:
    """bool[N]: which of `ids` are graded (collectable without waiting).

    Raises:
      ValueError: an id that is not open (never submitted, collected or discarded).
    """
    d = self._dispatcher
    with d.cond:
      ids = self._check_open(ids)
      return np.asarray([i in d.results for i in ids], bool)

  def collect(self, ids: Sequence[int], timeout: float | None = None) -> np.ndarray:
    """Waits until every item of `ids` is graded and returns their rewards.

    The items are then closed (a second `collect` of them raises). `last_stats` counts
    these items (restarts: workers replaced since the previous `collect`) and `stats` adds
    them.

    Args:
      ids: item ids from `submit`, any order, no repeats.
      timeout: seconds to wait at most; None waits for as long as grading takes (each item
        is bounded by `timeout_s` from dispatch).

    Returns:
      float32[N] rewards, `rewards[k]` for `ids[k]`.

    Raises:
      ValueError: an id that is not open, or a repeated id.
      TimeoutError: `timeout` passed first; the items stay open.
      RuntimeError: the pool was closed or its dispatcher failed.
    """
    d = self._dispatcher
    with d.cond:
      ids = self._check_open(ids)
      if not d.cond.wait_for(
        lambda: d.closed or d.failure is not None or all(i in d.results for i in ids), timeout
      ):
        raise TimeoutError(
          f"collect: {sum(i not in d.results for i in ids)} of {len(ids)} items not graded "
          f"within timeout={timeout} s"
        )
      self._check_alive()
      graded = [d.results.pop(i) for i in ids]
      d.open.difference_update(ids)
      rewards = np.asarray([r for r, _ in graded], np.float32)
      batch = VerifyStats(
        items=len(ids),
        correct=int(rewards.sum()),
        no_box=sum(o == NO_BOX for _, o in graded),
        timeouts=sum(o == TIMEOUT for _, o in graded),
        errors=sum(o == ERROR for _, o in graded),
        restarts=d.restarts - self._restarts_seen,
      )
      self._restarts_seen = d.restarts
      self.last_stats = batch  # Under the lock: two threads may collect at once.
      self.stats.add(batch)
    return rewards

  def discard(self, ids: Sequence[int]) -> None:
    """Drops items no longer wanted: queued ones are not graded, a result still being
    computed is thrown away when it arrives. Ids not open are ignored, so discarding is
    safe after an interrupted `collect`."""
    self._dispatcher.discard(int(i) for i in np.asarray(ids, np.int64).reshape(-1))

  def _check_alive(self) -> None:
    d = self._dispatcher
    if d.closed:
      raise RuntimeError("Verifier is closed")
    if d.failure is not None:
      raise RuntimeError(f"Verifier dispatcher failed: {d.failure}") from d.failure

  def _check_open(self, ids: Sequence[int]) -> list[int]:
    out = [int(i) for i in np.asarray(ids, np.int64).reshape(-1)]
    self._check_alive()
    if len(set(out)) != len(out):
      raise ValueError("ids: an item id is repeated")
    for i in out:
      if i not in self._dispatcher.open:
        raise ValueError(f"ids: item {i} is not open (never submitted, collected or discarded)")
    return out


def _as_text(value, field: str, index: int) -> str:
  if isinstance(value, str):
    return value
  if isinstance(value, bytes):
    return value.decode("utf-8", errors="replace")
  raise ValueError(f"{field}[{index}] is {type(value).__name__}, expected str")
