"""Rounds vs stream at the paper's scale: a slot-pool decode simulator with response lengths.

Extends the Bernoulli-prompt simulator (`ada_jax.rl.simulate`: prompt i has pass rate p_i,
a response is correct with probability p_i) with what decides wall time: response lengths
and a pool of S slots that decodes one token per busy slot per decode step, a finished
row's slot taking the next queued row at once (continuous batching). Counts only, no model.

* Lengths: lognormal with median `median_length`, sigma set so that a fraction `at_budget`
  reaches the token budget, truncated at the budget (a truncated response ends there).
  Lengths and rewards are independent.
* Both schedules run the one controller (`controller.run_step`) on `SimEngine`, the slot
  pool below. `rounds`: each round's rows are decoded to the last one: a round costs its
  makespan in decode steps. `stream`: segments of `segment` decode steps; rows finished
  in a segment are decided on one boundary later. A boundary at which nothing was left to
  decode costs no decode step (the decoder only waits for grades) and is counted as idle.
* Common random numbers: the k-th response drawn for prompt i has the same reward and
  length under both schedules, so their difference is measured with little noise.

Units: lengths and tokens in tokens; "decode steps" are steps of the whole slot pool;
utilisation is decoded tokens / (decode steps * slots).
"""

from __future__ import annotations

import dataclasses
import heapq
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from ada_jax.rl import controller, rules
from ada_jax.rl.rules import AdaConfig, pool_meets_exit
from ada_jax.rl.simulate import PASS_RATE_MIX, _check_pass_rates, method_table, sample_pass_rates

__all__ = [
  "ScheduleResult",
  "SimEngine",
  "SimSlots",
  "StreamSimConfig",
  "length_sigma",
  "drifted_pass_rates",
  "method_rows",
  "simulate_schedule",
]

SCHEDULES = controller.SCHEDULES


def length_sigma(median: float, budget: int, at_budget: float) -> float:
  """Sigma of the lognormal with this median that reaches `budget` with probability
  `at_budget`: ln(budget / median) / Phi^-1(1 - at_budget).

  Raises:
    ValueError: median >= budget, or at_budget not in (0, 0.5).
  """
  if not 0 < median < budget:
    raise ValueError(f"median_length={median}: must lie in (0, budget={budget})")
  if not 0 < at_budget < 0.5:
    raise ValueError(f"at_budget={at_budget}: must lie in (0, 0.5)")
  return float(np.log(budget / median) / statistics.NormalDist().inv_cdf(1 - at_budget))


@dataclasses.dataclass(frozen=True)
class StreamSimConfig:
  """Scale and engine of the simulation (defaults: the paper's scale).

  Attributes:
    batch: B, prompts per RL step.
    slots: S, rows the pool decodes at once.
    budget: response token budget (max new tokens).
    median_length: median response length in tokens.
    at_budget: fraction of responses that reach the budget.
    segment: decode steps between stream boundaries.
    window: stream, pos/balance: rows kept queued / in flight / awaiting grades per
      active prompt; None: M.
    min_pool: stream, pos/balance: graded responses a prompt needs to exit; None: the
      controller's (a round's worth, max(n, M)).
    num_prompts: prompts in the data set (pass rates drawn from `mix`).
    walk_sd: pass rates that move between epochs: each prompt's logit takes a Gaussian
      step of this SD per epoch (0: fixed pass rates).
    drift: and this shift per epoch towards higher pass rates (logit units; learning).
    epochs: passes over them; the first `warmup_epochs` are not scored (Est's statistics).
    seed: seeds pass rates, orders, rewards, lengths and DAPO's extra prompts.
  """

  batch: int = 512
  slots: int = 1024
  budget: int = 2048
  median_length: float = 512.0
  at_budget: float = 0.03
  segment: int = 64
  window: int | None = None
  min_pool: int | None = None
  num_prompts: int = 2048
  walk_sd: float = 0.0
  drift: float = 0.0
  epochs: int = 3
  warmup_epochs: int = 1
  seed: int = 0

  def __post_init__(self):
    for f in ("batch", "slots", "budget", "segment", "num_prompts", "epochs"):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"StreamSimConfig.{f}={v!r}: must be an int >= 1")
    if self.window is not None and self.window < 1:
      raise ValueError(f"StreamSimConfig.window={self.window!r}: must be >= 1 or None")
    if not 0 <= self.warmup_epochs < self.epochs:
      raise ValueError(f"StreamSimConfig.warmup_epochs={self.warmup_epochs}: need < epochs")
    if not self.walk_sd >= 0:
      raise ValueError(f"StreamSimConfig.walk_sd={self.walk_sd!r}: must be >= 0")
    if self.batch > self.num_prompts:
      raise ValueError(f"StreamSimConfig.batch={self.batch}: more than num_prompts")
    length_sigma(self.median_length, self.budget, self.at_budget)


class SimSlots:
  """S decode slots with a FIFO queue; a finished or cancelled row's slot is refilled at
  once. Time is in decode steps; a row of length L occupies a slot for L steps."""

  def __init__(self, slots: int):
    self.slots, self.t, self.free = slots, 0, slots
    self.queue: deque[tuple[int, int]] = deque()
    self.heap: list[tuple[int, int]] = []  # (end step, row) of rows in flight.
    self.start: dict[int, tuple[int, int]] = {}  # row -> (start step, length), in flight.
    self.tokens = 0  # Tokens decoded, cancelled rows' partial tokens included.
    self.tokens_cancelled = 0

  def enqueue(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
    self.queue.extend(zip((int(r) for r in rows), (int(x) for x in lengths), strict=True))

  def cancel(self, rows: Sequence[int]) -> None:
    """Drops queued rows and stops in-flight ones now (their tokens so far are paid)."""
    drop = {int(r) for r in rows}
    self.queue = deque(item for item in self.queue if item[0] not in drop)
    for row in drop & self.start.keys():
      begin, _ = self.start.pop(row)
      self.tokens += self.t - begin
      self.tokens_cancelled += self.t - begin
      self.free += 1  # Its heap entry is skipped when reached.

  def _fill(self, now: int) -> None:
    while self.free and self.queue:
      row, length = self.queue.popleft()
      self.start[row] = (now, length)
      heapq.heappush(self.heap, (now + length, row))
      self.free -= 1

  def run(self, steps: int | None) -> tuple[list[int], int]:
    """Decodes `steps` decode steps (None: until the pool is empty).

    Returns:
      (rows finished, in finishing order; decode steps in which a slot was busy).
    """
    t0 = self.t
    end = None if steps is None else t0 + steps
    self._fill(t0)
    finished, last = [], t0
    while self.heap and (end is None or self.heap[0][0] <= end):
      stop, row = heapq.heappop(self.heap)
      if row not in self.start:
        continue  # Cancelled: its slot was freed then.
      self.tokens += self.start.pop(row)[1]
      finished.append(row)
      self.free += 1
      last = stop
      self._fill(stop)
    if self.start:  # Still decoding at the end of the segment.
      self.t = end  # type: ignore[assignment]
      return finished, steps  # type: ignore[return-value]
    # Idle since `last`: nothing queued or in flight.
    self.t = last if end is None else end
    return finished, last - t0


class _Draws:
  """The k-th response of prompt i: (reward, length), the same whichever schedule asks.

  Prompt i's draws come from Generator([seed, step, i]); DAPO's extra prompts (indices >= B)
  have pass rates from Generator([seed, step, -1]), handed out in order.
  """

  def __init__(self, rates: Sequence[float], sim: StreamSimConfig, step: int, mix):
    self.rates = list(rates)
    self.sim, self.step, self.mix = sim, step, mix
    self.sigma = length_sigma(sim.median_length, sim.budget, sim.at_budget)
    self.u: list[np.ndarray] = []
    self.length: list[np.ndarray] = []
    self.count: list[int] = []  # Draws handed out per prompt.
    self.extra = np.random.default_rng([sim.seed, step, 2**31 - 1])
    self.extra_rates: list[float] = []

  def more_prompts(self, k: int) -> list[str]:
    while len(self.extra_rates) < k:
      self.extra_rates += sample_pass_rates(self.extra, 256, self.mix).tolist()
    first = len(self.rates)
    self.rates += self.extra_rates[:k]
    del self.extra_rates[:k]
    return [f"extra{i}" for i in range(first, first + k)]

  def draw(self, prompts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float32 rewards, int64 lengths) of the next response of each entry of `prompts`."""
    rewards = np.empty(prompts.size, np.float32)
    lengths = np.empty(prompts.size, np.int64)
    for j, p in enumerate(prompts.tolist()):
      while p >= len(self.u):
        self.u.append(np.zeros(0))
        self.length.append(np.zeros(0, np.int64))
        self.count.append(0)
      k = self.count[p]
      if k >= self.u[p].size:
        rng = np.random.default_rng([self.sim.seed, self.step, p, k])
        self.u[p] = np.concatenate([self.u[p], rng.random(64)])
        raw = self.sim.median_length * np.exp(self.sigma * rng.standard_normal(64))
        self.length[p] = np.concatenate(
          [self.length[p], np.clip(np.ceil(raw), 1, self.sim.budget).astype(np.int64)]
        )
      rewards[j] = float(self.u[p][k] < self.rates[p])
      lengths[j] = self.length[p][k]
      self.count[p] = k + 1
    return rewards, lengths


@dataclasses.dataclass
class _Totals:
  steps: int = 0
  prompts: int = 0
  samples: int = 0
  tokens: int = 0
  tokens_cancelled: int = 0
  rows_cancelled: int = 0
  decode_steps: int = 0
  signal: float = 0.0
  boundaries: int = 0
  idle_boundaries: int = 0
  capped_prompts: int = 0
  capped_tokens: int = 0
  stopped: int = 0
  stopped_would_exit: int = 0


class SimEngine:
  """The controller's `Engine` on a `SimSlots`: a row's reward and length are drawn when
  it is queued (`_Draws`, the same k-th response of a prompt under both schedules); a
  decode runs the pool to its end (`rounds`) or one segment (`stream`).

  Attributes:
    stats: the step's cost figures (tokens, decode steps, boundaries, ...), filled by
      `finish`.
  """

  def __init__(self, draws: _Draws, sim: StreamSimConfig):
    self.draws, self.sim, self.pool = draws, sim, SimSlots(sim.slots)
    self.reward_of: dict[int, float] = {}
    self.decode_steps = self.idle = self.updates = self.rows_cancelled = 0

  def enqueue(self, rows, prompts):
    rewards, lengths = self.draws.draw(prompts)
    self.reward_of.update(zip(rows.tolist(), rewards.tolist(), strict=True))
    self.pool.enqueue(rows, lengths)

  @property
  def busy(self):
    return bool(self.pool.queue or self.pool.start)

  def update(self, decision):
    self.updates += 1
    self.rows_cancelled += decision.cancel.size
    self.pool.cancel(decision.cancel)
    self.enqueue(decision.enqueue, decision.enqueue_prompt)

  def decode(self, *, to_end):
    finished, busy = self.pool.run(None if to_end else self.sim.segment)
    self.decode_steps += busy
    self.idle += busy == 0
    return finished

  def submit(self, rows):
    return [self.reward_of[r] for r in rows]

  def collect(self, ticket):
    return ticket

  def stats(self, schedule: str, result) -> dict[str, int]:
    if schedule == "rounds":  # a round's makespan is its barrier
      rounds = len(result.stats.samples_per_round)
      return dict(tokens=self.pool.tokens, decode_steps=self.decode_steps, boundaries=rounds)
    return dict(
      tokens=self.pool.tokens,
      tokens_cancelled=self.pool.tokens_cancelled,
      rows_cancelled=self.rows_cancelled,
      decode_steps=self.decode_steps,
      boundaries=self.updates,
      idle_boundaries=self.idle,
    )


def _step(cfg, schedule, ids, draws: _Draws, sim, rng, method_state):
  engine = SimEngine(draws, sim)
  options = dict(window=sim.window, min_pool=sim.min_pool) if schedule == "stream" else {}
  res, method_state = controller.run_step(
    cfg, ids, engine, rng, method_state, draws.more_prompts, schedule=schedule, **options
  )
  return res, method_state, engine.stats(schedule, res)


def drifted_pass_rates(p0: np.ndarray, sim: StreamSimConfig, epoch: int) -> np.ndarray:
  """The pass rates of epoch `epoch`: logit(p) + epoch·drift + a Gaussian random walk of
  `sim.walk_sd` per epoch (Generator([seed, e, 5]) for the step into epoch e); p0 clipped
  to [1e-6, 1 − 1e-6] first, so 0 and 1 can move. Epoch 0 is `p0` itself."""
  if epoch == 0 or not (sim.walk_sd or sim.drift):
    return p0
  p = np.clip(p0, 1e-6, 1 - 1e-6)
  logit = np.log(p) - np.log1p(-p)
  for e in range(1, epoch + 1):
    step = np.random.default_rng([sim.seed, e, 5]).standard_normal(p0.size)
    logit = logit + sim.drift + sim.walk_sd * step
  return 1.0 / (1.0 + np.exp(-logit))


@dataclasses.dataclass(frozen=True)
class ScheduleResult:
  """Per-step means of one method under one schedule over the scored steps.

  Attributes:
    samples_per_prompt: responses decoded to the end / B (dapo: its extra prompts' too).
    tokens_per_prompt: tokens decoded / B, cancelled rows' partial tokens included.
    tokens_cancelled_per_prompt: tokens of cancelled rows / B.
    rows_cancelled_per_prompt: rows dropped from the queue or cancelled in flight / B.
    decode_steps: slot-pool decode steps per RL step.
    slot_utilisation: tokens decoded / (decode steps * slots).
    signal_fraction: prompts with a non-zero advantage / B (`StepStats.signal_fraction`).
    boundaries: rounds (rounds) or segment boundaries (stream) per step.
    idle_boundaries: stream boundaries with nothing to decode (waiting on grades only).
    capped_prompt_fraction: pos / balance: prompts that drew R·M responses without
      exiting / B (nearly the same prompts under both schedules).
    capped_token_share: their tokens / all tokens decoded: a cost no schedule removes.
    stopped_fraction: prompts the exit-chance rule stopped / B (`min_exit_chance`).
    stopped_would_exit: of those, the fraction that would have met the exit rule had they
      drawn the rest of their R·M budget (their next responses, drawn to the end).
    steps: RL steps scored.
  """

  samples_per_prompt: float
  tokens_per_prompt: float
  tokens_cancelled_per_prompt: float
  rows_cancelled_per_prompt: float
  decode_steps: float
  slot_utilisation: float
  signal_fraction: float
  boundaries: float
  idle_boundaries: float
  capped_prompt_fraction: float
  capped_token_share: float
  stopped_fraction: float
  stopped_would_exit: float
  steps: int

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def simulate_schedule(
  cfg: AdaConfig,
  schedule: str,
  sim: StreamSimConfig = StreamSimConfig(),
  mix=PASS_RATE_MIX,
  pass_rates: np.ndarray | None = None,
) -> ScheduleResult:
  """Runs `cfg` under `schedule` for `sim.epochs` epochs of B-prompt steps; totals its cost.

  Args:
    cfg: controller configuration (any method).
    schedule: 'rounds' or 'stream'.
    sim: scale, lengths and engine.
    mix: Beta mixture of the pass rates (and of DAPO's extra prompts).
    pass_rates: float[P] pass rates; None: `sim.num_prompts` drawn from `mix` with
      Generator(sim.seed).

  Returns:
    `ScheduleResult`.

  Raises:
    ValueError: an unknown schedule or bad pass rates.
  """
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule={schedule!r}: expected one of {list(SCHEDULES)}")
  gen = np.random.default_rng(sim.seed)
  if pass_rates is None:
    pass_rates = sample_pass_rates(gen, sim.num_prompts, mix)
  p_all = _check_pass_rates(pass_rates)
  if p_all.size < sim.batch:
    raise ValueError(f"pass_rates: {p_all.size} prompts, fewer than batch={sim.batch}")
  tot, method_state, step = _Totals(), None, 0
  cap = cfg.seq.budget
  order_rng = np.random.default_rng([sim.seed, 1])
  for epoch in range(sim.epochs):
    order = order_rng.permutation(p_all.size)
    p_epoch = drifted_pass_rates(p_all, sim, epoch)
    for start in range(0, p_all.size - sim.batch + 1, sim.batch):
      ids = order[start : start + sim.batch]
      draws = _Draws(p_epoch[ids], sim, step, mix)
      rng = np.random.default_rng([sim.seed, step, 1])
      res, method_state, stats = _step(
        cfg, schedule, [f"p{i}" for i in ids], draws, sim, rng, method_state
      )
      step += 1
      if epoch < sim.warmup_epochs:
        continue
      tot.steps += 1
      tot.prompts += sim.batch
      tot.samples += res.stats.rows_requested
      tot.signal += res.stats.signal_fraction * sim.batch
      for k, v in stats.items():
        setattr(tot, k, getattr(tot, k) + v)
      if rules.RULES[cfg.method].has_exit_rule:  # Drew R·M without exiting.
        capped = np.flatnonzero(res.stats.pool_size[: sim.batch] >= cap)
        tot.capped_prompts += capped.size
        tot.capped_tokens += sum(int(draws.length[p][: draws.count[p]].sum()) for p in capped)
      for p in res.stats.stopped:  # drawn on to R·M: would it have exited?
        size = int(res.stats.pool_size[p])
        pool = [1.0] * int(res.stats.pool_positives[p])
        pool += [0.0] * (size - len(pool)) + draws.draw(np.full(cap - size, p))[0].tolist()
        tot.stopped += 1
        tot.stopped_would_exit += pool_meets_exit(pool, cfg)
  return ScheduleResult(
    samples_per_prompt=tot.samples / tot.prompts,
    tokens_per_prompt=tot.tokens / tot.prompts,
    tokens_cancelled_per_prompt=tot.tokens_cancelled / tot.prompts,
    rows_cancelled_per_prompt=tot.rows_cancelled / tot.prompts,
    decode_steps=tot.decode_steps / tot.steps,
    slot_utilisation=tot.tokens / max(tot.decode_steps * sim.slots, 1),
    signal_fraction=tot.signal / tot.prompts,
    boundaries=tot.boundaries / tot.steps,
    idle_boundaries=tot.idle_boundaries / tot.steps,
    capped_prompt_fraction=tot.capped_prompts / tot.prompts,
    capped_token_share=tot.capped_tokens / max(tot.tokens, 1),
    stopped_fraction=tot.stopped / tot.prompts,
    stopped_would_exit=tot.stopped_would_exit / max(tot.stopped, 1),
    steps=tot.steps,
  )


def method_rows(
  n: int = 4, samples_per_round: int = 8, max_rounds: int = 4, min_exit_chance: float = 0.0
) -> dict:
  """The compared configurations: `simulate.method_table`'s GRPO n = 4 and 8, DAPO,
  pos, balance, released Est (K = 8) and the paper's Est hybrid (K = 8); with
  `min_exit_chance`, also pos and balance with the exit-chance rule (`*_stop`)."""
  table = method_table(n, samples_per_round, max_rounds, est_budgets=(8.0,))
  keep = ("grpo_n4", "grpo_n8", "dapo_n4", "ada_pos", "ada_balance", "ada_est_k8")
  rows = {k: table[k] for k in (*keep, "ada_est_paper_k8")}
  for name in ("ada_pos", "ada_balance") if min_exit_chance else ():
    seq = dataclasses.replace(table[name].seq, min_exit_chance=min_exit_chance)
    rows[f"{name}_stop"] = dataclasses.replace(table[name], seq=seq)
  return rows
