"""One RL step, top to bottom: prompts -> rollouts -> training batch -> policy update.

The step's data goes down the layers only (docs/design.md "One RL step"):

1. `StepPrompts`: the iterator's B prompts (and DAPO's extra ones, `more_prompts`).
2. `rollout.engine.SlotEngine`: one slot pool for the step (`rollout.queue.SlotDriver`)
   with the verifier; Est's learned head reads the prompts' hidden states from its prefill.
3. `rl.controller.run_step`: the one controller, under the schedule's driver (`rounds`:
   each round decoded and graded before it decides; `stream`: a segment's rows graded
   while the next decodes); it returns the selected row ids with their rewards and
   advantages (`StepResult`).
4. `make_train_batch`: the selected rows of the engine's response store, as a fixed-shape
   batch; `rl.update.update_policy`: the mini-batch updates.
5. The step's metrics (`StepMetrics`).

`loop.py` keeps the run (set-up, checkpoints, evaluations, the loop over steps).
"""

from __future__ import annotations

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
from ada_jax.models import sharding
from ada_jax.models.tokenizer import Tokenizer
from ada_jax.rl import controller, train, update
from ada_jax.rollout import engine as rollout_engine
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


def _agreed() -> Any:
  """A `StepMetrics` field every process of a run must hold equal (`StepMetrics.agreed`)."""
  return dataclasses.field(metadata={"agreed": True})


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepMetrics:
  """One RL step's metrics, each field under its `metrics.jsonl` name (`as_dict`).

  The fields marked agreed are decided by the controller from the shared grader's rewards
  and the rollouts' counts, so every process of a multi-host run holds the same values;
  the loop compares them after each step (`agreed`, `distributed.assert_same`). A field
  renamed here is renamed everywhere: reading a missing one is an AttributeError, not a
  silent None.

  Attributes:
    reward_mean: mean reward of every response drawn.
    pass_rate: mean per-prompt pass rate over every response drawn: biased upward for
      pos/balance, which stop after successes.
    first_round_pass_rate: the first round's pass rate, unbiased whatever the method.
    samples_drawn: responses requested by the controller.
    active_prompts_per_round: prompts still sampling at each round.
    zero_signal_frac: the fraction of training groups whose advantages are all zero.
    tokens_trained: response tokens the update trained on (its loss mask); 0 if skipped.
    response_len_mean .. tokens_decoded: the rollouts' costs (`RolloutCounters.metrics`).
    time_train_s: seconds of the batch and update.
    compiles: XLA compilations during the step.
    update_skipped: 1.0 when no response was selected (params unchanged), else 0.0.
    ada: the rule's statistics (`StepStats.as_metrics`: `ada/...` and its own figures).
    train: the update's figures (loss, entropy, clip_frac, grad_norm, approx_kl,
      learning_rate, old_logprob_gap); empty for a skipped update.
  """

  reward_mean: float = _agreed()
  pass_rate: float = _agreed()
  first_round_pass_rate: float = _agreed()
  samples_drawn: int = _agreed()
  active_prompts_per_round: list[int] = _agreed()
  zero_signal_frac: float = _agreed()
  tokens_trained: int = 0
  response_len_mean: float = _agreed()
  tokens_per_s: float = 0.0
  time_sample_s: float = 0.0
  time_grade_wait_s: float = 0.0
  rows_computed: int = _agreed()
  decode_steps: int = _agreed()
  token_slot_utilization: float = 0.0
  tokens_cancelled: int = _agreed()
  tokens_decoded: int = 0
  time_train_s: float = 0.0
  compiles: int = 0
  update_skipped: float = 0.0
  ada: dict[str, float] = dataclasses.field(default_factory=dict)
  train: dict[str, float] = dataclasses.field(default_factory=dict)

  def agreed(self) -> list:
    """The values every process must hold equal, in field order."""
    return [getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("agreed")]

  def as_dict(self) -> dict[str, Any]:
    """The flat `metrics.jsonl` row: the fields, then `ada` and `train` spread."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return {k: v for k, v in out.items() if k not in ("ada", "train")} | self.ada | self.train


# The update's figures a step reports (`update.update_policy`'s metrics).
TRAIN_METRICS = (
  "loss",
  "entropy",
  "clip_frac",
  "grad_norm",
  "approx_kl",
  "learning_rate",
  "old_logprob_gap",  # sampler–trainer mismatch before the first update
  "positions",  # token positions the packed mini-batches computed (padding included)
)


def rl_step(
  ctx: StepContext, step: int, state: train.TrainState, method_state: Any, key: jax.Array
) -> tuple[train.TrainState, Any, StepMetrics]:
  """One RL step: prompts -> the controller's rollouts -> training batch -> policy update.

  Args:
    ctx: the run's fixed parts.
    step: the RL step (1-based; for log lines).
    state: the train state before the step.
    method_state: the sampling rule's cross-step state (Est's statistics; None before the
      first step or for a rule that keeps none: `Rule.init_state`).
    key: the step's rollout key, `fold_in(rollout_key, step)`.

  Returns:
    (state, method_state, metrics): the updated train state and rule state and the step's
    `StepMetrics`.
  """
  cfg = ctx.cfg
  with metrics_lib.CompileCounter() as compiles:
    step_prompts = StepPrompts(ctx.prompt_set, ctx.iterator, cfg.rl.batch_prompts)
    longest = max(len(t) for t in step_prompts.tokens)
    if cfg.rule.adds_prompts:  # DAPO's may come from anywhere in the set
      longest = ctx.prompt_set.max_length
    # The pool decodes from one compute-dtype copy of the params, freed by `finish`.
    rollout = ctx.sampler.rollout_params(state.params)
    offload = cfg.train.offload_state and rollout is not state.params
    if offload:  # the masters and moments wait in host memory while the step samples
      state = sharding.to_memory(state, "pinned_host")
    engine = rollout_engine.SlotEngine(
      ctx.sampler,
      rollout,
      ctx.tokenizer,
      ctx.grader,
      step_prompts,
      key,
      sampler.bucket_length(longest, cfg.sampler.prompt_buckets),
    )
    del rollout
    # Est's pass-rate head reads the prompts' hidden states off the pool's own prefill.
    features = engine.features() if cfg.rule.needs_features(cfg.ada) else None
    result, method_state = controller.run_step(
      cfg.ada, step_prompts.ids, engine, ctx.np_rng, method_state, step_prompts.more_prompts,
      features,
    )  # fmt: skip
    engine.finish()
    if offload:
      state = sharding.to_memory(state, "device")
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
      tm, tokens_trained = {}, 0
    else:
      batch = update.make_train_batch(
        result,
        responses,
        step_prompts.tokens,
        rows=cfg.train_rows,
        buckets=cfg.sampler.prompt_buckets,
      )
      tokens_trained = int(batch.loss_mask.sum())
      state, tm = update.update_policy(
        ctx.step_fn, state, batch, config=cfg.train, mesh=ctx.mesh, logprob_fn=ctx.logprob_fn
      )
    time_train = time.perf_counter() - start
  s = result.stats
  m = StepMetrics(
    reward_mean=s.reward_mean,
    pass_rate=float(np.mean(s.pool_pass_rate[: cfg.rl.batch_prompts])),
    first_round_pass_rate=s.first_round_pass_rate,
    samples_drawn=s.rows_requested,
    active_prompts_per_round=list(s.active_per_round),
    zero_signal_frac=s.zero_signal_fraction,
    tokens_trained=tokens_trained,
    **engine.counters.metrics(),
    time_train_s=time_train,
    compiles=compiles.count,
    update_skipped=float(skipped),
    ada=s.as_metrics(),
    train={k: tm[k] for k in TRAIN_METRICS if k in tm},
  )
  return state, method_state, m
