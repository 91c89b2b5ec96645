"""Streaming schedule of the sampling controller: exits decided as responses finish.

`ada_jax.rl.adaptive.run_step` is the `rounds` schedule (the released semantics): a round
of M responses per active prompt is decoded to its last row, graded, and only then does
any prompt retire. `StreamController` is the `stream` schedule for a slot-pool engine that
decodes in segments of a fixed number of decode steps:

* every active prompt keeps rows queued (Seq methods: up to `window` rows not yet graded,
  at most R·M rows in all; GRPO / Est: their fixed quota; DAPO: n per prompt);
* the rows that finish during segment t are graded while segment t + 1 decodes;
* at the boundary after segment t + 1 the exit rule (`pool_meets_exit`) is applied to each
  prompt's graded pool, i.e. exactly the rows that finished by the previous boundary, in
  row-id order; a prompt that meets it retires: its queued rows are dropped and its
  in-flight rows cancelled (the engine refills their slots at once). A prompt exits only
  once its graded pool holds >= n responses, so the half-then-fill selection and the
  global baseline (A = r - p̄ over the pool) are those of `rounds`;
* rows of a retired prompt that finished before it retired (graded after the decision)
  join its pool, as the rest of a round does under `rounds`: they were paid for;
* DAPO: as soon as groups are found uniform, extra prompts (`more_prompts`) join the
  queue, as many as the mixed rate seen so far says are needed to fill the batch, until
  B groups are mixed (the rest are then cancelled) or the cap on extra prompts
  (dapo_max_extra_passes * dapo_prompts_per_pass) is reached.

Decisions depend only on which rows finished in which segment and on their rewards, never
on how fast the grader was: every host of a multi-host run decides the same.

`run_step` is the schedule's entry point, `adaptive.run_step`'s counterpart (chosen by
`AdaConfig.schedule`); the training loop's driver on the slot pool is
`ada_jax.rollout.draw.StreamRollouts`, the simulator's `simulate_stream`.

Differences from `rounds`: a prompt can retire between rounds' worth of rows, so pools are
smaller (fewer samples, the long tail of a prompt's rows cancelled) and a prompt's pool is
the rows that finished first, which under a length budget favours short responses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ada_jax.rl import adaptive
from ada_jax.rl import pools as pools_lib
from ada_jax.rl.adaptive import SEQ_METHODS, AdaConfig, EstState, StepResult, pool_meets_exit

__all__ = ["StreamController", "StreamDecision", "run_step"]


@dataclasses.dataclass(frozen=True)
class StreamDecision:
  """What the engine must do after a boundary.

  Attributes:
    cancel: int64[k] row ids of retired prompts not yet finished (queued: drop; in
      flight: cancel and refill the slot).
    enqueue: int64[m] new row ids, in queue order (ascending; ids issued to a prompt that
      retired at the same boundary are skipped, so ids can have gaps).
    enqueue_prompt: int64[m] the prompt index of each new row.
    exited: int64[e] prompt indices retired at this boundary.
  """

  cancel: np.ndarray
  enqueue: np.ndarray
  enqueue_prompt: np.ndarray
  exited: np.ndarray


class StreamController:
  """One RL step's sampling decisions under the `stream` schedule (module docstring).

  Usage with an engine that decodes segments and a `RewardPool`:

    ctl = StreamController(cfg, b)
    engine.enqueue(*ctl.start())
    while not ctl.done:
      finished = engine.decode_segment()  # row ids finished in this segment
      rewards = pool.collect(ids_of(ctl.awaiting_grades))  # rows of the last segment
      submit(finished)  # graded while the next segment decodes
      d = ctl.boundary(finished, rewards)
      engine.cancel(d.cancel); engine.enqueue(d.enqueue, d.enqueue_prompt)
    result = ctl.result(rng)

  Row ids are assigned here, consecutively from 0, in queue order.

  Args:
    config: validated `AdaConfig` (any method).
    num_prompts: B, the step's prompts.
    quotas: est: int[B] rows per prompt (`estimate.plan_budget`);
      None: n each. Ignored by the other methods (grpo, dapo: n each).
    window: Seq methods: rows per active prompt kept queued or in flight or awaiting
      grades; None: M (`samples_per_round`).
    min_pool: pos / balance: the fewest graded responses a prompt exits with; None: n.
      A larger value (e.g. M) keeps more of `rounds`' signal on easy prompts under `pos`,
      whose exit rule does not ask for a negative.
    more_prompts: dapo: `more_prompts(k)` returns up to k further prompt ids; None: no
      extra prompts.
    prompt_ids: the B prompt ids passed through to `StepResult.prompt_ids` (default
      0..B-1).

  Raises:
    ValueError: a bad argument (named).
  """

  def __init__(
    self,
    config: AdaConfig,
    num_prompts: int,
    *,
    quotas: Sequence[int] | np.ndarray | None = None,
    window: int | None = None,
    min_pool: int | None = None,
    more_prompts: Callable[[int], Sequence[Any]] | None = None,
    prompt_ids: Sequence[Any] | None = None,
  ):
    config.validate()
    if num_prompts < 1:
      raise ValueError(f"num_prompts={num_prompts}: need at least one prompt")
    self.config, self.b = config, num_prompts
    self.seq = config.method in SEQ_METHODS
    self.window = config.samples_per_round if window is None else window
    if self.window < 1:
      raise ValueError(f"window={window}: must be >= 1")
    if quotas is None or config.method != "est":
      quotas = [config.n] * num_prompts
    self.quota = [int(q) for q in np.asarray(quotas).reshape(-1)]
    if len(self.quota) != num_prompts or min(self.quota) < 1:
      raise ValueError(f"quotas: need {num_prompts} ints >= 1, got {list(quotas)}")
    self.min_pool = config.n if min_pool is None else min_pool
    if self.seq and not config.n <= self.min_pool <= config.samples_per_round * config.max_rounds:
      raise ValueError(f"min_pool={min_pool}: must lie in [n, R*M]")
    self.more_prompts = more_prompts
    self.prompt_ids = list(range(num_prompts) if prompt_ids is None else prompt_ids)
    self.max_extra = (
      config.dapo_max_extra_passes * (config.dapo_prompts_per_pass or num_prompts)
      if config.method == "dapo" and more_prompts is not None
      else 0
    )
    self.row_prompt: list[int] = []
    self.live: list[set[int]] = []  # Per prompt: rows queued or in flight.
    self.graded: list[dict[int, float]] = []  # Per prompt: row id -> reward.
    self.awaiting: list[int] = []  # Rows finished in the last segment, to be graded.
    self.active: list[bool] = []
    self.mixed: list[int] = []  # dapo: prompts whose group was found mixed, in order.
    self.exit_boundary: list[int | None] = []  # Seq: boundary of the exit rule; None: never
    self.groups_done = 0  # dapo: groups fully graded.
    self._awaiting_count: list[int] = []  # Per prompt: rows in `awaiting`.
    self.boundaries = 0
    self.rows_cancelled = 0
    self._started = False

  # -------------------------------------------------------------- bookkeeping

  def _add_prompt(self) -> None:
    self.live.append(set())
    self.graded.append({})
    self.active.append(True)
    self.exit_boundary.append(None)
    self._awaiting_count.append(0)

  def _new_rows(self, p: int, k: int, out: list[tuple[int, int]]) -> None:
    for _ in range(k):
      row = len(self.row_prompt)
      self.row_prompt.append(p)
      self.live[p].add(row)
      out.append((row, p))

  def _issued(self, p: int) -> int:
    return len(self.live[p]) + len(self.graded[p]) + self._awaiting_count[p]

  @property
  def awaiting_grades(self) -> np.ndarray:
    """int64[k] rows finished in the last segment, ascending: the rewards the next
    `boundary` call needs, in this order."""
    return np.asarray(self.awaiting, np.int64)

  @property
  def done(self) -> bool:
    """True once every prompt has retired and every finished row is graded."""
    return self._started and not any(self.active) and not self.awaiting

  @property
  def rows_issued(self) -> int:
    """Row ids handed out so far (queued, decoded, cancelled or skipped)."""
    return len(self.row_prompt)

  def start(self) -> tuple[np.ndarray, np.ndarray]:
    """The first rows to queue: (int64 row ids, int64 prompt indices); each prompt's
    window (Seq: min(window, R·M)) or quota, prompt-major."""
    if self._started:
      raise RuntimeError("StreamController.start called twice")
    self._started = True
    out: list[tuple[int, int]] = []
    cap = self.config.samples_per_round * self.config.max_rounds
    for p in range(self.b):
      self._add_prompt()
      self._new_rows(p, min(self.window, cap) if self.seq else self.quota[p], out)
    return _as_arrays(out)

  # ----------------------------------------------------------------- decisions

  def boundary(
    self, finished: Sequence[int] | np.ndarray, rewards: Sequence[float] | np.ndarray
  ) -> StreamDecision:
    """Applies the grades of the previous segment's rows and decides.

    Args:
      finished: row ids that finished in the segment just decoded (any order); they are
        decided on at the next boundary.
      rewards: float[k] rewards of `awaiting_grades` (the rows of the segment before), in
        that order.

    Returns:
      `StreamDecision`.

    Raises:
      ValueError: a wrong number of rewards, a non-finite reward, or a finished id that is
        not a live row.
      RuntimeError: called before `start` or after `done`.
    """
    if not self._started or self.done:
      raise RuntimeError("StreamController.boundary: call start() first; not after done")
    rewards = np.asarray(rewards, np.float64).reshape(-1)
    if rewards.size != len(self.awaiting):
      raise ValueError(f"rewards: {rewards.size} given for {len(self.awaiting)} awaiting rows")
    if not np.all(np.isfinite(rewards)):
      raise ValueError("rewards: a reward is not finite")
    touched = set()  # Only a prompt with new grades can decide anything new.
    for row, r in zip(self.awaiting, rewards.tolist(), strict=True):
      p = self.row_prompt[row]
      self.graded[p][row] = r
      self._awaiting_count[p] -= 1
      touched.add(p)
    self.awaiting = sorted(int(i) for i in np.asarray(finished, np.int64).reshape(-1))
    for row in self.awaiting:
      p = self.row_prompt[row] if 0 <= row < len(self.row_prompt) else -1
      if p < 0 or row not in self.live[p]:
        raise ValueError(f"finished: row {row} is not queued or in flight")
      self.live[p].discard(row)
      self._awaiting_count[p] += 1
    self.boundaries += 1
    cancel: list[int] = []
    new: list[tuple[int, int]] = []
    exited: list[int] = []
    for p in sorted(touched):
      if self.active[p] and self._decide(p, new):
        self.active[p] = False
        exited.append(p)
    if self.config.method == "dapo":
      if len(self.mixed) >= self.b:
        exited += [p for p in range(len(self.active)) if self.active[p]]
        self.active = [False] * len(self.active)
      else:
        self._add_extra_prompts(new)
    fresh = {row for row, _ in new}  # Rows of this boundary never reach the engine.
    for p in exited:
      gone = sorted(self.live[p] - fresh)
      cancel += gone
      self.rows_cancelled += len(gone)
      self.live[p].clear()
    new = [(row, p) for row, p in new if self.active[p]]
    rows, prompts = _as_arrays(new)
    return StreamDecision(np.asarray(cancel, np.int64), rows, prompts, np.asarray(exited))

  def _decide(self, p: int, new: list[tuple[int, int]]) -> bool:
    """Whether prompt p retires now; may append rows to `new`."""
    cfg = self.config
    pending = len(self.live[p]) + self._awaiting_count[p]
    if self.seq:
      graded = [self.graded[p][r] for r in sorted(self.graded[p])]
      if pool_meets_exit(graded, cfg, self.min_pool):
        self.exit_boundary[p] = self.boundaries
        return True
      room = cfg.samples_per_round * cfg.max_rounds - self._issued(p)
      if room == 0 and pending == 0:
        return True  # R·M responses and no exit: stays in the batch, as under `rounds`.
      self._new_rows(p, max(0, min(self.window - pending, room)), new)
      return False
    if pending:
      return False
    if cfg.method == "dapo":
      self.groups_done += 1
      if len(set(self.graded[p].values())) > 1:  # DAPO's filter: std > 0.
        self.mixed.append(p)
    return True

  def _add_extra_prompts(self, new: list[tuple[int, int]]) -> None:
    """DAPO: queues extra prompts until the groups in progress are expected to fill the
    batch at the mixed rate seen so far (floored at 1/8 so that a run of uniform groups
    cannot ask for an unbounded number), within the cap on extra prompts."""
    if not self.groups_done or self.more_prompts is None:
      return
    rate = max(len(self.mixed) / self.groups_done, 0.125)
    target = int(np.ceil((self.b - len(self.mixed)) / rate))
    k = min(target - sum(self.active), self.max_extra - (len(self.active) - self.b))
    if k <= 0:
      return
    for pid in list(self.more_prompts(k))[:k]:
      self.prompt_ids.append(pid)
      self._add_prompt()
      self._new_rows(len(self.active) - 1, self.config.n, new)

  # -------------------------------------------------------------------- result

  def result(self, rng: np.random.Generator) -> StepResult:
    """The step's training responses and statistics, as `adaptive.run_step` returns them.

    Pools are each prompt's graded rows in row-id order (handles: the row ids). Selection,
    advantages and the groups' batch order (Seq: by exit boundary) are `adaptive`'s own:
    pos / balance keep n by half-then-fill with the whole pool as baseline, grpo / est keep
    every row, dapo the first B mixed groups.
    `stats.samples_per_round` holds one entry (the rows graded), `first_round_pass_rate`
    each prompt's first min(window, quota) row ids that finished.

    Args:
      rng: consumed only by `selection='random'`.

    Raises:
      RuntimeError: called before `done`.
    """
    if not self.done:
      raise RuntimeError("StreamController.result: the step is not done")
    cfg = self.config
    num = len(self.active)
    pools = pools_lib.Pools(num)
    # A prompt's first rows by issue order were queued before any decision about it.
    first = [
      self.window if self.seq else (self.quota[p] if p < self.b else cfg.n) for p in range(num)
    ]
    rank, issued = {}, [0] * num
    for row, p in enumerate(self.row_prompt):
      rank[row], issued[p] = issued[p], issued[p] + 1
    for p in range(num):
      rows = sorted(self.graded[p])
      pools.rewards[p] = [self.graded[p][r] for r in rows]
      pools.handles[p] = rows
    first_size = [sum(rank[r] < first[p] for r in self.graded[p]) for p in range(num)]
    pools.samples_per_round.append(sum(len(r) for r in pools.rewards))
    pools.active_per_round.append(sum(1 for r in pools.rewards if r))
    pools.first_round_size = np.asarray(first_size, np.int64)
    order = None
    if self.seq:
      kept = {p: adaptive.select_responses(cfg, pools.rewards[p], rng) for p in range(self.b)}
      order = adaptive.batch_order(cfg, self.exit_boundary[: self.b])
    elif cfg.method == "dapo":
      kept = {p: np.arange(cfg.n) for p in self.mixed[: self.b]}
    else:
      kept = {p: np.arange(len(pools.rewards[p])) for p in range(self.b)}
    return pools_lib.finish(cfg, pools, self.prompt_ids, self.b, kept, order)


def run_step(
  config: AdaConfig,
  prompt_ids: Sequence[Any],
  drive: Callable[[StreamController], None],
  rng: np.random.Generator,
  est_state: EstState | None = None,
  more_prompts: Callable[[int], Sequence[Any]] | None = None,
  features: np.ndarray | None = None,
  *,
  window: int | None = None,
  min_pool: int | None = None,
) -> tuple[StepResult, EstState | None]:
  """One training step's sampling under the `stream` schedule: `adaptive.run_step`'s
  counterpart, with the same arguments and results, except that sampling is `drive`
  (`window` and `min_pool`: `StreamController`'s, None = its defaults).

  `drive(controller)` runs a `StreamController` to `done`: it queues `start()`'s rows,
  decodes in segments, grades the rows that finish and calls `boundary` after each
  segment (`ada_jax.rollout.draw.StreamRollouts` on the slot pool;
  `simulate_stream` without a model). Handles in the result are the controller's row ids.
  Est plans its quotas first and folds the outcomes after (`adaptive.est_step`).

  Raises:
    ValueError: no prompts, or a bad config (named field).
    RuntimeError: `drive` returned before the controller was done.
  """
  if len(prompt_ids) == 0:
    raise ValueError("stream.run_step needs at least one prompt")
  config.validate()
  ids = list(prompt_ids)

  def sample(quotas: np.ndarray | None) -> StepResult:
    ctl = StreamController(
      config,
      len(ids),
      quotas=quotas,
      window=window,
      min_pool=min_pool,
      more_prompts=more_prompts,
      prompt_ids=ids,
    )
    drive(ctl)
    return ctl.result(rng)

  if config.method == "est":
    return adaptive.est_step(config, ids, est_state, features, sample)
  return sample(None), est_state


def _as_arrays(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
  if not pairs:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  rows, prompts = zip(*pairs, strict=True)
  return np.asarray(rows, np.int64), np.asarray(prompts, np.int64)
