"""The one sampling controller of an RL step, and the two schedules that drive it.

`Controller` is a state machine over rows (responses) with ids 0, 1, ... in queue order:
`start()` gives the first rows to queue, `boundary(finished, rewards)` applies grades and
answers with a `Decision` (rows to cancel, rows to queue, prompts retired), and
`result(rng)` returns the step's `StepResult`. What a method does at each of these points
is its rule (`rules.RULES`); the controller only keeps the books.

The schedules are two drivers of the same controller over an `Engine` (the slot pool with
the verifier, `ada_jax.rollout.engine.SlotEngine`; or a simulator's, `simulate`, `simulate_stream`):

* `rounds` (`drive_rounds`, the released barriers): every queued row is decoded to its
  end and graded before the boundary, so a prompt retires only at the end of a round.
* `stream` (`drive_stream`): the engine decodes segments of a few decode steps; the rows
  that finish in segment t are graded while segment t + 1 decodes and decided on at the
  boundary after it. A prompt that retires has its queued rows dropped and its rows in
  flight cancelled (their slots are refilled at once); its rows that finished before it
  retired still join its pool, as the rest of a round does under `rounds`.

`run_step` is the step: the rule's plan (Est's quotas), the controller under the
schedule's driver, the result and the rule's fold. Decisions depend only on which rows
finished at which boundary and on their rewards, never on how fast the grader was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ada_jax.rl import pools as pools_lib
from ada_jax.rl import rules
from ada_jax.rl.pools import StepResult
from ada_jax.rl.rules import SCHEDULES, AdaConfig, Plan

MorePromptsFn = Callable[[int], Sequence[Any]]


@dataclasses.dataclass(frozen=True)
class Decision:
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


class Controller:
  """One RL step's sampling decisions (module docstring), for any method and schedule.

  Args:
    config: the `AdaConfig`; its rule is `rules.rule_for(config)`, which checks it.
    num_prompts: B, the step's prompts.
    schedule: 'rounds' (a boundary's rewards are those of the rows it reports finished) or
      'stream' (those of the rows the boundary before reported: `awaiting_grades`); None:
      `config.schedule`.
    window: stream, Seq rules: rows per active prompt queued, in flight or awaiting
      grades; None: M (`seq.samples_per_round`), the only value under `rounds`.
    min_pool: stream, Seq rules: the fewest graded responses a prompt exits with; None: a
      round's worth, max(n, M) (at most R·M), so that an easy prompt exits on as many
      responses as under `rounds` and keeps its signal; under `rounds` it is n (a round's
      pool always holds M).
    more_prompts: `more_prompts(k)` returns up to k further prompt ids (DAPO); None: none.
    prompt_ids: the B prompt ids passed through to `StepResult.prompt_ids` (default 0..B-1).
    plan: what the rule's `plan` prepared for the step (`rules.Plan`: Est's quotas, Seq's
      pass-rate priors), read by its hooks as `ctl.plan`; None: `rules.Plan()`, n rows per
      prompt.

  Attributes:
    state: the rule's books of the step (`Rule.new_state`: `rules.SeqState`,
      `rules.DapoState`, or None).

  Raises:
    ValueError: a bad argument (named).
  """

  def __init__(
    self,
    config: AdaConfig,
    num_prompts: int,
    *,
    schedule: str | None = None,
    window: int | None = None,
    min_pool: int | None = None,
    more_prompts: MorePromptsFn | None = None,
    prompt_ids: Sequence[Any] | None = None,
    plan: Plan | None = None,
  ):
    rule = rules.rule_for(config)
    if num_prompts < 1:
      raise ValueError(f"num_prompts={num_prompts}: need at least one prompt")
    self.schedule = config.schedule if schedule is None else schedule
    if self.schedule not in SCHEDULES:
      raise ValueError(f"schedule={schedule!r}: expected one of {list(SCHEDULES)}")
    if self.schedule == "rounds" and (window, min_pool) != (None, None):
      raise ValueError("window and min_pool are stream options; rounds uses M and n")
    self.config, self.b, self.rule = config, num_prompts, rule
    self.window = config.seq.samples_per_round if window is None else window
    if self.window < 1:
      raise ValueError(f"window={window}: must be >= 1")
    cap = config.seq.budget
    self.plan = Plan() if plan is None else plan
    quotas = [config.n] * num_prompts if self.plan.quotas is None else self.plan.quotas
    self.quota = [int(q) for q in np.asarray(quotas).reshape(-1)]
    if len(self.quota) != num_prompts or min(self.quota) < 1:
      raise ValueError(f"plan.quotas: need {num_prompts} ints >= 1, got {list(quotas)}")
    default_pool = config.n
    if self.schedule == "stream":
      default_pool = min(max(config.n, config.seq.samples_per_round), cap)
    self.min_pool = default_pool if min_pool is None else min_pool
    if self.rule.has_exit_rule and not config.n <= self.min_pool <= cap:
      raise ValueError(f"min_pool={min_pool}: must lie in [n, R*M]")
    self.more_prompts, self.state = more_prompts, self.rule.new_state()
    self.prompt_ids = list(range(num_prompts) if prompt_ids is None else prompt_ids)
    self.row_prompt: list[int] = []
    self.live: list[set[int]] = []  # Per prompt: rows queued or in flight.
    self.graded: list[dict[int, float]] = []  # Per prompt: row id -> reward.
    self.awaiting: list[int] = []  # stream: rows finished at the last boundary, ungraded.
    self.active: list[bool] = []
    self.issued_per_batch: list[list[int]] = []  # Rows issued by start and each boundary.
    self._awaiting_count: list[int] = []  # Per prompt: rows in `awaiting`.
    self.boundaries = 0
    self.rows_cancelled = 0
    self._started = False

  # ------------------------------------------------------------ what rules use

  def add_prompt(self, prompt_id: Any | None = None) -> int:
    """Adds a prompt (the step's own at start; DAPO's extra ones later); returns its index."""
    if len(self.active) >= self.b:
      self.prompt_ids.append(prompt_id)
    self.live.append(set())
    self.graded.append({})
    self.active.append(True)
    self._awaiting_count.append(0)
    return len(self.active) - 1

  def new_rows(self, p: int, k: int, out: list[tuple[int, int]]) -> None:
    """Issues k row ids to prompt p, appending (row, p) to `out`."""
    for _ in range(k):
      row = len(self.row_prompt)
      self.row_prompt.append(p)
      self.live[p].add(row)
      out.append((row, p))

  def pending(self, p: int) -> int:
    """Rows of prompt p queued, in flight or finished and not yet graded."""
    return len(self.live[p]) + self._awaiting_count[p]

  def issued(self, p: int) -> int:
    """Rows issued to prompt p so far."""
    return self.pending(p) + len(self.graded[p])

  # ---------------------------------------------------------------- the state

  @property
  def awaiting_grades(self) -> np.ndarray:
    """stream: int64[k] rows finished at the last boundary, ascending: the rewards the next
    `boundary` call takes, in this order."""
    return np.asarray(self.awaiting, np.int64)

  @property
  def done(self) -> bool:
    """True once every prompt has retired and every finished row is graded."""
    return self._started and not any(self.active) and not self.awaiting

  def start(self) -> tuple[np.ndarray, np.ndarray]:
    """The first rows to queue: (int64 row ids, int64 prompt indices), prompt-major, each
    prompt's `Rule.first_rows`."""
    if self._started:
      raise RuntimeError("Controller.start called twice")
    self._started = True
    out: list[tuple[int, int]] = []
    for p in range(self.b):
      self.add_prompt()
      self.new_rows(p, self.rule.first_rows(self, p), out)
    self.issued_per_batch.append([p for _, p in out])
    return _as_arrays(out)

  def boundary(
    self, finished: Sequence[int] | np.ndarray, rewards: Sequence[float] | np.ndarray
  ) -> Decision:
    """Takes the rows that finished since the last boundary and a batch of grades, and
    decides (each prompt with new grades: `Rule.decide`; then `Rule.after_boundary`).

    Args:
      finished: row ids that finished in the segment (or round) just decoded, any order.
      rewards: float[k]; `rounds`: of `finished` sorted ascending; `stream`: of
        `awaiting_grades` (the rows the boundary before took), in that order.

    Returns:
      `Decision`.

    Raises:
      ValueError: a wrong number of rewards, a non-finite reward, or a finished id that is
        not a live row.
      RuntimeError: called before `start` or after `done`.
    """
    if not self._started or self.done:
      raise RuntimeError("Controller.boundary: call start() first; not after done")
    done_now = sorted(int(i) for i in np.asarray(finished, np.int64).reshape(-1))
    for row in done_now:
      p = self.row_prompt[row] if 0 <= row < len(self.row_prompt) else -1
      if p < 0 or row not in self.live[p]:
        raise ValueError(f"finished: row {row} is not queued or in flight")
    if self.schedule == "rounds":  # the barrier: this round's rows are graded now
      self._take_finished(done_now)
    # float32, the verifier's dtype, whichever schedule hands them over.
    rewards = np.asarray(rewards, np.float32).reshape(-1)
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
    self.awaiting = []
    if self.schedule == "stream":
      self._take_finished(done_now)
    self.boundaries += 1
    new: list[tuple[int, int]] = []
    exited = [p for p in sorted(touched) if self.active[p] and self.rule.decide(self, p, new)]
    for p in exited:
      self.active[p] = False
    more = self.rule.after_boundary(self, new)
    for p in more:
      self.active[p] = False
    fresh = {row for row, _ in new}  # Rows of this boundary never reach the engine.
    cancel: list[int] = []
    for p in exited + more:
      gone = sorted(self.live[p] - fresh)
      cancel += gone
      self.rows_cancelled += len(gone)
      self.live[p].clear()
    new = [(row, p) for row, p in new if self.active[p]]
    if new:
      self.issued_per_batch.append([p for _, p in new])
    rows, prompts = _as_arrays(new)
    return Decision(
      np.asarray(cancel, np.int64), rows, prompts, np.asarray(exited + more, np.int64)
    )

  def _take_finished(self, rows: list[int]) -> None:
    for row in rows:
      p = self.row_prompt[row]
      self.live[p].discard(row)
      self._awaiting_count[p] += 1
    self.awaiting = rows

  # -------------------------------------------------------------------- result

  def result(self, rng: np.random.Generator) -> StepResult:
    """The step's training responses (handles: row ids) and statistics.

    ResponsePools are each prompt's graded rows in row-id order; the rule selects from them
    (`Rule.select`) and `pools.finish` computes the advantages. Under `rounds`
    `stats.samples_per_round` holds each round's rows; under `stream` one entry, the rows
    graded. `first_round_pass_rate` reads each prompt's first `Rule.first_rows` row ids
    that were graded (drawn before any decision about it).

    Args:
      rng: consumed only by `seq.selection='random'`.

    Raises:
      RuntimeError: called before `done`.
    """
    if not self.done:
      raise RuntimeError("Controller.result: the step is not done")
    num = len(self.active)
    pools = pools_lib.ResponsePools(num)
    first = [self.rule.first_rows(self, p) for p in range(num)]
    rank, issued = {}, [0] * num
    for row, p in enumerate(self.row_prompt):
      rank[row], issued[p] = issued[p], issued[p] + 1
    for p in range(num):
      rows = sorted(self.graded[p])
      pools.rewards[p] = [self.graded[p][r] for r in rows]
      pools.handles[p] = rows
    if self.schedule == "rounds":
      pools.samples_per_round = [len(batch) for batch in self.issued_per_batch]
      pools.active_per_round = [len(set(batch)) for batch in self.issued_per_batch]
    else:
      pools.samples_per_round = [sum(len(r) for r in pools.rewards)]
      pools.active_per_round = [sum(1 for r in pools.rewards if r)]
    size = [sum(rank[r] < first[p] for r in self.graded[p]) for p in range(num)]
    pools.first_round_size = np.asarray(size, np.int64)
    kept, order = self.rule.select(self, pools, rng)
    result = pools_lib.finish(self.config, pools, self.prompt_ids, self.b, kept, order)
    stats = self.rule.stats(self)
    if not stats:
      return result
    return dataclasses.replace(result, stats=dataclasses.replace(result.stats, **stats))


class Engine(Protocol):
  """What a schedule's driver needs of the rollout side: decode rows, grade them.

  Row ids are the controller's. `decode` returns the rows that finished (any order);
  `submit` starts grading rows (by id) and returns a ticket, `collect` waits for its float
  rewards, in the submitted order; `busy` says rows are queued or decoding.
  """

  @property
  def busy(self) -> bool: ...

  def enqueue(self, rows: np.ndarray, prompts: np.ndarray) -> None: ...

  def update(self, decision: Decision) -> None: ...

  def decode(self, *, to_end: bool) -> Sequence[int]: ...

  def submit(self, rows: Sequence[int]) -> Any: ...

  def collect(self, ticket: Any) -> Sequence[float]: ...


def drive_rounds(ctl: Controller, engine: Engine) -> None:
  """The `rounds` schedule: decode every queued row to its end, grade them all, decide."""
  engine.enqueue(*ctl.start())
  while not ctl.done:
    finished = sorted(int(r) for r in engine.decode(to_end=True))
    d = ctl.boundary(finished, engine.collect(engine.submit(finished)))
    engine.update(d)


def drive_stream(ctl: Controller, engine: Engine) -> None:
  """The `stream` schedule: decode one segment; collect the grades of the segment before
  (graded while this one decoded), submit this segment's rows, decide."""
  engine.enqueue(*ctl.start())
  ticket = engine.submit([])
  while not ctl.done:
    finished = sorted(int(r) for r in engine.decode(to_end=False))
    if not finished and not ctl.awaiting and not engine.busy:
      raise RuntimeError("drive_stream: nothing to decode or grade, but the step is not done")
    rewards = engine.collect(ticket)
    ticket = engine.submit(finished)
    engine.update(ctl.boundary(finished, rewards))


DRIVERS = {"rounds": drive_rounds, "stream": drive_stream}


def run_step(
  config: AdaConfig,
  prompt_ids: Sequence[Any],
  engine: Engine,
  rng: np.random.Generator,
  method_state: Any = None,
  more_prompts: MorePromptsFn | None = None,
  features: np.ndarray | None = None,
  *,
  schedule: str | None = None,
  window: int | None = None,
  min_pool: int | None = None,
) -> tuple[StepResult, Any]:
  """One training step's sampling for B prompts.

  Args:
    config: the `AdaConfig` (checked by its rule, `rules.rule_for`).
    prompt_ids: B stable prompt ids (Est keys its statistics on them; elsewhere they are
      passed through to `StepResult.prompt_ids`).
    engine: decodes and grades the controller's rows (`Engine`).
    rng: host Generator; consumed only by `seq.selection='random'`.
    method_state: the rule's cross-step state as the previous step left it (Est's
      statistics; None before the first step: the rule's `init_state`).
    more_prompts: `more_prompts(k)` returns up to k further prompt ids (DAPO); an empty
      answer ends the search. Without it DAPO makes no extra passes.
    features: Est with a head-based `est.estimator`: float32[B, d] the prompts' hidden
      states at their last token (the slot pool's prefill: `queue.SlotDriver.prefill`).
    schedule, window, min_pool: `Controller`'s (None: the config's schedule, defaults).

  Returns:
    (StepResult, the rule's state after this step).

  Raises:
    ValueError: no prompts, a bad config (named field), or the engine answered with a
      wrong number of rewards or a non-finite one.
  """
  if len(prompt_ids) == 0:
    raise ValueError("run_step needs at least one prompt")
  rule = rules.rule_for(config)
  ids = list(prompt_ids)
  state = rule.init_state(config) if method_state is None else method_state
  plan = rule.plan(config, ids, state, features)
  ctl = Controller(
    config,
    len(ids),
    schedule=schedule,
    window=window,
    min_pool=min_pool,
    more_prompts=more_prompts,
    prompt_ids=ids,
    plan=plan,
  )
  DRIVERS[ctl.schedule](ctl, engine)
  return rule.fold(config, ids, state, features, plan, ctl.result(rng))


class DrawEngine:
  """An `Engine` around `draw(prompts) -> float rewards[N]`, one call per decode (rounds:
  per round), every queued row finishing at once: the Bernoulli simulator's and the tests'.
  Raises ValueError when `draw` answers with the wrong number of rewards."""

  def __init__(self, draw: Callable[[np.ndarray], Sequence[float]]):
    self.draw, self.queued, self.rewards = draw, [], {}

  @property
  def busy(self):
    return bool(self.queued)

  def enqueue(self, rows, prompts):
    self.queued += list(zip(np.asarray(rows).tolist(), np.asarray(prompts).tolist(), strict=True))

  def update(self, decision):
    gone = set(decision.cancel.tolist())
    self.queued = [q for q in self.queued if q[0] not in gone]
    self.enqueue(decision.enqueue, decision.enqueue_prompt)

  def decode(self, *, to_end):
    rows = [r for r, _ in self.queued]
    if rows:
      rewards = np.asarray(self.draw(np.asarray([p for _, p in self.queued], np.int64)))
      if rewards.shape != (len(rows),):
        raise ValueError(f"draw returned rewards of shape {rewards.shape} for {len(rows)} rows")
      self.rewards.update(zip(rows, rewards.tolist(), strict=True))
    self.queued = []
    return rows

  def submit(self, rows):
    return [self.rewards.pop(int(r)) for r in rows]

  def collect(self, ticket):
    return ticket


def _as_arrays(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
  if not pairs:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  rows, prompts = zip(*pairs, strict=True)
  return np.asarray(rows, np.int64), np.asarray(prompts, np.int64)
