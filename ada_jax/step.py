"""One RL step, top to bottom: prompts -> rollouts -> training batch -> policy update.

The step's data goes down the layers only (docs/design.md "One RL step"):

1. `StepPrompts`: the iterator's B prompts (and DAPO's extra ones, `more_prompts`).
2. `PoolEngine`: one slot pool for the step (`rollout.queue.RolloutPool`) with the
   verifier; Est's learned head reads the prompts' hidden states from its prefill.
3. `rl.controller.run_step`: the one controller, under the schedule's driver (`rounds`:
   each round decoded and graded before it decides; `stream`: a segment's rows graded
   while the next decodes); it returns the selected row ids with their rewards and
   advantages (`StepResult`).
4. `make_train_batch`: the selected rows of the engine's response store, as a fixed-shape
   batch; `rl.update.update_policy`: the mini-batch updates.
5. The step's metrics.

`loop.py` keeps the run (set-up, checkpoints, evaluations, the loop over steps).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from ada_jax import config as config_lib
from ada_jax import distributed
from ada_jax import metrics as metrics_lib
from ada_jax.data import prompts
from ada_jax.data.prompts import PromptSet
from ada_jax.models.tokenizer import Tokenizer
from ada_jax.rl import controller, estimate, train, update
from ada_jax.rollout import sampler


@dataclasses.dataclass
class StepPrompts:
  """The prompts of one RL step, as indices into `prompt_set`, in the order the
  controller sees them: the iterator's batch first, then any DAPO asked for.

  Attributes:
    prompt_set: the training prompts.
    iterator: yields batches of indices into `prompt_set` (`prompts.PromptIterator`).
    batch_prompts: the iterator's batch size B.
    indices: the step's prompts so far.
  """

  prompt_set: PromptSet
  iterator: Iterator[Sequence[int]]
  batch_prompts: int
  indices: list[int] = dataclasses.field(default_factory=list)
  _spare: list[int] = dataclasses.field(default_factory=list)

  def __post_init__(self):
    self.indices = [int(i) for i in next(self.iterator)]

  @property
  def tokens(self) -> list[np.ndarray]:
    return [self.prompt_set.tokens[i] for i in self.indices]

  @property
  def answers(self) -> list[str]:
    return [self.prompt_set.answers[i] for i in self.indices]

  @property
  def ids(self) -> list[str]:
    return [self.prompt_set.prompt_ids[i] for i in self.indices]

  def more_prompts(self, k: int) -> list[str]:
    """k further prompts (DAPO's dynamic sampling): ceil(k / B) whole iterator batches are
    taken, the first k used and the rest kept for the next call; returns their prompt ids.
    Only methods that ask call it (DAPO's rule, `rl.rules.Dapo`)."""
    for _ in range(-(-k // self.batch_prompts)):
      self._spare.extend(int(i) for i in next(self.iterator))
    got, self._spare = self._spare[:k], self._spare[k:]
    self.indices.extend(got)
    return [self.prompt_set.prompt_ids[i] for i in got]


@dataclasses.dataclass
class RolloutCounters:
  """What one step's sampling cost, under either schedule.

  Attributes:
    responses: responses decoded to their end (cancelled rows not counted).
    tokens: their tokens (the stop token included).
    tokens_cancelled: tokens decoded for rows cancelled before their end (stream).
    decode_steps: decode steps of the slot pool (all segments).
    slot_steps: slots × decode steps.
    rows_computed: slot-steps ÷ the budget Lr, rounded up per round (`stream`: per step).
    time_sample_s: seconds in the sampler (prefill, decode, host transfers).
    time_grade_wait_s: seconds the decoder waited for grades: under `rounds` all grading,
      under `stream` only the part not hidden behind the next segment.
  """

  responses: int = 0
  tokens: int = 0
  tokens_cancelled: int = 0
  decode_steps: int = 0
  slot_steps: int = 0
  rows_computed: int = 0
  time_sample_s: float = 0.0
  time_grade_wait_s: float = 0.0

  def add(self, cost: dict[str, float]) -> None:
    """Adds a `RolloutPool.take_counters` account (a round, or a whole stream step)."""
    self.decode_steps += cost["steps"]
    self.slot_steps += cost["slot_steps"]
    self.rows_computed += cost["rows_computed"]

  def metrics(self) -> dict[str, float]:
    """Per-step metrics (`metrics.jsonl` names)."""
    return {
      "response_len_mean": self.tokens / max(self.responses, 1),
      "tokens_per_s": self.tokens / max(self.time_sample_s, 1e-9),
      "time_sample_s": self.time_sample_s,
      "time_grade_wait_s": self.time_grade_wait_s,
      "rows_computed": self.rows_computed,
      "decode_steps": self.decode_steps,
      # Decoded tokens ÷ slot-steps: 1 when no slot ever idles.
      "token_slot_utilization": (self.tokens + self.tokens_cancelled) / max(self.slot_steps, 1),
      "tokens_cancelled": self.tokens_cancelled,
    }


def _fold_in(key: jax.Array, data: int) -> jax.Array:
  """`jax.random.fold_in(key, data)` with `data` put on the device explicitly: the tests run
  the rollouts under `jax_transfer_guard='disallow'`, where an implicit one fails."""
  return jax.random.fold_in(key, jax.device_put(np.uint32(data)))


class PoolEngine:
  """The controller's `Engine` on the slot pool: one `RolloutPool` for the whole step (the
  prompt cache kept across rounds and segments), the verifier, and the step's response
  store keyed by row id.

  `rounds`: each `decode` drains the queue (round c's rows draw from `fold_in(key, c)`,
  numbered from 0 within the round, as `Sampler.generate` numbers a call's rows); `stream`:
  each `decode` is one segment (`sampler.segment_steps` decode steps at most) and the rows
  draw from `fold_in(key, 0)` with their row ids, so GRPO and Est draw exactly the
  responses they draw under `rounds`. Rows are graded by `submit` (texts decoded here) and
  `collect`; under `stream` a segment's rows are graded while the next one decodes.

  Args:
    sampler: the rollout engine.
    params: the policy's parameters.
    tokenizer: decodes responses for the verifier.
    grader: `submit(texts, answers) -> ticket`, `collect(ticket) -> float32[N]`
      (`distributed.SharedGrader`: identical on every process).
    prompts: the step's prompts (the controller's prompt indices index them).
    key: the step's rollout key.
    prompt_len: Lp, the pool's prompt bucket (DAPO's extra prompts must fit it).

  Attributes:
    counters: `RolloutCounters` of the step (complete after `finish`).
    outputs: row id -> (tokens int32[Lr], logprobs float32[Lr], length) of every row that
      finished.
  """

  def __init__(self, sampler, params, tokenizer, grader, prompts: StepPrompts, key, prompt_len):
    self.sampler, self.tokenizer, self.grader, self.prompts = sampler, tokenizer, grader, prompts
    self.key = key
    self.pool = sampler.pool(params, _fold_in(key, 0), prompt_len)
    self.pending: collections.deque[int] = collections.deque()
    self.row_prompt: dict[int, int] = {}
    self.entry_of: dict[int, int] = {}
    self.outputs: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
    self.counters = RolloutCounters()
    self.rounds = 0

  def features(self) -> np.ndarray:
    """float32[B, D] the step's prompts' final-normed hidden states at their last token,
    from the prefill that fills the pool's prompt cache (`RolloutPool.prefill_all`; Est's
    learned head reads them): the prompts stay cached for their rows."""
    return self.pool.prefill_all(self.prompts.tokens, self.entry_of)

  def enqueue(self, rows, prompts):
    self.row_prompt.update(zip(rows.tolist(), prompts.tolist(), strict=True))
    self.pending.extend(rows.tolist())

  def update(self, decision):
    if decision.cancel.size:
      gone = set(decision.cancel.tolist())
      self.pending = collections.deque(r for r in self.pending if r not in gone)
      self.counters.tokens_cancelled += self.pool.cancel_rows(decision.cancel)
    for p in decision.exited.tolist():  # an active prompt keeps its entry for its next rows
      if p in self.entry_of:
        self.pool.release(self.entry_of.pop(p))
    self.enqueue(decision.enqueue, decision.enqueue_prompt)

  def decode(self, *, to_end):
    start = time.perf_counter()
    args = (self.prompts.tokens, self.row_prompt, self.pending, self.entry_of)
    if to_end:
      self.pool.rekey(_fold_in(self.key, self.rounds), base=min(self.pending, default=0))
      self.rounds += 1
      finished = self.pool.drain(*args)
      self.counters.add(self.pool.take_counters())
    else:
      finished = self.pool.advance(*args) if self.pending or self.pool.busy else []
    self.counters.time_sample_s += time.perf_counter() - start
    for row, tokens, logprobs, n in finished:
      self.outputs[row] = (tokens, logprobs, n)
      self.counters.responses += 1
      self.counters.tokens += n
    return [f[0] for f in finished]

  def submit(self, rows):
    start = time.perf_counter()
    texts = self.tokenizer.decode_many([self.outputs[r][0][: self.outputs[r][2]] for r in rows])
    answers = self.prompts.answers
    ticket = self.grader.submit(texts, [answers[self.row_prompt[r]] for r in rows])
    self.counters.time_grade_wait_s += time.perf_counter() - start
    return ticket

  def collect(self, ticket):
    start = time.perf_counter()
    rewards = self.grader.collect(ticket)
    self.counters.time_grade_wait_s += time.perf_counter() - start
    return rewards

  def finish(self) -> None:
    """Counts the decode steps since the last round (`stream`: the whole step)."""
    self.counters.add(self.pool.take_counters())

  def responses(self) -> dict[str, np.ndarray]:
    """The response store by row id (the controller's handles): `tokens int32[N, Lr]`,
    `logprobs float32[N, Lr]`, `mask bool[N, Lr]`, `lengths int32[N]`; rows cancelled or
    never decoded are empty (length 0)."""
    lr, rows = self.sampler.max_new_tokens, len(self.row_prompt)
    out = {
      "tokens": np.zeros((rows, lr), np.int32),
      "logprobs": np.zeros((rows, lr), np.float32),
      "lengths": np.zeros((rows,), np.int32),
    }
    for row, (tokens, logprobs, n) in self.outputs.items():
      out["tokens"][row], out["logprobs"][row], out["lengths"][row] = tokens, logprobs, n
    out["mask"] = np.arange(lr) < out["lengths"][:, None]
    return out


@dataclasses.dataclass(frozen=True)
class StepContext:
  """What every RL step of a run uses and none changes: built once by `train_run`.

  Attributes:
    cfg: the run config.
    prompt_set: the training prompts.
    iterator: the prompt iterator (its position is checkpointed; it advances each step).
    sampler: the rollout engine.
    step_fn: the jitted train step (`train.make_train_step`).
    grader: the verifier pool's grades, identical on every process
      (`distributed.SharedGrader`).
    tokenizer: the run's tokenizer.
    mesh: the device mesh.
    np_rng: the host Generator of the controller's draws (checkpointed; it advances).
    logprob_fn: `update.make_logprob_step` under `train.old_logprobs='recompute'`, else None.
  """

  cfg: config_lib.RunConfig
  prompt_set: prompts.PromptSet
  iterator: prompts.PromptIterator
  sampler: sampler.Sampler
  step_fn: Any
  grader: distributed.SharedGrader
  tokenizer: Tokenizer
  mesh: jax.sharding.Mesh
  np_rng: np.random.Generator
  logprob_fn: Any = None


def rl_step(
  ctx: StepContext, step: int, state: train.TrainState, est: Any, key: jax.Array
) -> tuple[train.TrainState, Any, dict[str, Any]]:
  """One RL step: prompts -> the controller's rollouts -> training batch -> policy update.

  Args:
    ctx: the run's fixed parts.
    step: the RL step (1-based; for log lines).
    state: the train state before the step.
    est: Est's per-prompt statistics (None for the other methods / before the first step).
    key: the step's rollout key, `fold_in(rollout_key, step)`.

  Returns:
    (state, est, metrics): the updated state and statistics and the step's metrics.
  """
  cfg = ctx.cfg
  with metrics_lib.CompileCounter() as compiles:
    step_prompts = StepPrompts(ctx.prompt_set, ctx.iterator, cfg.rl.batch_prompts)
    longest = max(len(t) for t in step_prompts.tokens)
    if cfg.ada.method == "dapo":  # its extra prompts may come from anywhere in the set
      longest = ctx.prompt_set.max_length
    engine = PoolEngine(
      ctx.sampler,
      state.params,
      ctx.tokenizer,
      ctx.grader,
      step_prompts,
      key,
      sampler.bucket_length(longest, cfg.sampler.prompt_buckets),
    )
    # Est's pass-rate head reads the prompts' hidden states off the pool's own prefill.
    features = engine.features() if estimate.needs_features(cfg.ada) else None
    result, est = controller.run_step(
      cfg.ada, step_prompts.ids, engine, ctx.np_rng, est, step_prompts.more_prompts, features
    )
    engine.finish()
    responses = engine.responses()
    # Batch and update.
    start = time.perf_counter()
    skipped = len(result.handles) == 0
    if skipped:
      # dapo when no group is mixed even after its extra passes: there is nothing to train
      # on, and an update on an empty batch would still move the params (Adam's momentum).
      logging.warning(
        "RL step %d: no response selected for training (%s found no group "
        "with mixed rewards); the policy update is skipped",
        step,
        cfg.ada.method,
      )
      tm = {}
    else:
      batch = update.make_train_batch(
        result,
        responses,
        step_prompts.tokens,
        rows=cfg.train_rows,
        buckets=cfg.sampler.prompt_buckets,
      )
      state, tm = update.update_policy(
        ctx.step_fn, state, batch, config=cfg.train, mesh=ctx.mesh, logprob_fn=ctx.logprob_fn
      )
    time_train = time.perf_counter() - start
  s = result.stats
  m = {
    "reward_mean": s.reward_mean,
    # Over every response drawn: biased upward for pos/balance, which stop after
    # successes. The first-round rate is the unbiased one, whichever the method.
    "pass_rate": float(np.mean(s.pool_pass_rate[: cfg.rl.batch_prompts])),
    "first_round_pass_rate": s.first_round_pass_rate,
    "samples_drawn": s.rows_requested,
    "active_prompts_per_round": list(s.active_per_round),
    "zero_signal_frac": s.zero_signal_fraction,
    **engine.counters.metrics(),
    "time_train_s": time_train,
    "compiles": compiles.count,  # XLA compilations during the step
    "update_skipped": float(skipped),  # 1: no response to train on, params unchanged
  }
  m.update(s.as_metrics())
  m.update(
    {
      k: tm[k]
      for k in (
        "loss",
        "entropy",
        "clip_frac",
        "grad_norm",
        "approx_kl",
        "learning_rate",
        "old_logprob_gap",  # sampler–trainer mismatch before the first update
      )
      if k in tm
    }
  )
  return state, est, m
