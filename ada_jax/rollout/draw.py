"""The rollout stage of one RL step: the step's prompts, the `draw` callable the adaptive
controller asks for responses, and the fixed-shape training batch built from what it selects.

Data flow (docs/design.md, "One RL step"): `StepPrompts` holds the step's prompts (and
hands DAPO its extra ones, `more_prompts`); `Rollouts` lays the rows the controller
requests out for the slot-pool `sampler.Sampler`, decodes and scores them, and keeps every
response it drew; `make_train_batch` lays the selected responses out for
`rl.update.update_policy`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from ada_jax.data.prompts import PromptSet
from ada_jax.models import decoder as model_lib
from ada_jax.models.tokenizer import Tokenizer, pad_left
from ada_jax.rl import adaptive, train
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
    Only methods that ask call it (`adaptive.run_step`)."""
    for _ in range(-(-k // self.batch_prompts)):
      self._spare.extend(int(i) for i in next(self.iterator))
    got, self._spare = self._spare[:k], self._spare[k:]
    self.indices.extend(got)
    return [self.prompt_set.prompt_ids[i] for i in got]


@dataclasses.dataclass
class Rollouts:
  """The step's `draw` callable for `adaptive.run_step`: sampler + verifier, keeping every
  response it drew, with their timings and row counts.

  Attributes:
    sampler: the rollout engine (slot pool).
    params: the policy's parameters.
    tokenizer: decodes responses for the verifier.
    score: `(texts, answers) -> rewards` (`verifier.RewardPool.score`, shared across
      processes by `distributed.shared_scorer`).
    prompts: the step's prompts; rows index `prompts.indices`.
    key: the step's rollout key; call c samples with `fold_in(key, c)`.
  """

  sampler: sampler.Sampler
  params: Any
  tokenizer: Tokenizer
  score: Callable[[list[str], list[str]], Sequence[float]]
  prompts: StepPrompts
  key: jax.Array
  calls: int = 0
  parts: list = dataclasses.field(default_factory=list)
  time_sample_s: float = 0.0
  time_verify_s: float = 0.0
  rows_computed: int = 0
  rows_useful: int = 0
  tokens: int = 0

  def __call__(self, rows: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Draws one response per row (`rows[i]` indexes the step's prompts).

    Returns:
      (rewards float32[len(rows)], handles): handles index `responses()`.
    """
    out, stats = self.sampler.generate(
      self.params, self.prompts.tokens, rows, jax.random.fold_in(self.key, self.calls)
    )
    self.calls += 1
    start = time.perf_counter()
    texts = self.tokenizer.decode_many(
      [t[:n] for t, n in zip(out["tokens"], out["lengths"], strict=True)]
    )
    answers = self.prompts.answers
    rewards = self.score(texts, [answers[r] for r in rows])
    self.time_verify_s += time.perf_counter() - start
    self.time_sample_s += stats.wall_s
    self.rows_computed += stats.rows_computed
    self.rows_useful += stats.rows_useful
    self.tokens += stats.tokens
    first = sum(len(p["tokens"]) for p in self.parts)
    self.parts.append(out)
    return np.asarray(rewards, np.float32), list(range(first, first + len(rows)))

  def responses(self) -> dict[str, np.ndarray]:
    """Every response drawn: `tokens int32[N, Lr]`, `logprobs float32[N, Lr]`,
    `mask bool[N, Lr]`, `lengths int32[N]`."""
    keys = ("tokens", "logprobs", "mask", "lengths")
    return {k: np.concatenate([p[k] for p in self.parts]) for k in keys}


def make_train_batch(
  result: adaptive.StepResult,
  responses: dict[str, np.ndarray],
  prompt_tokens: Sequence[np.ndarray],
  *,
  rows: int,
  buckets: Sequence[int],
  pad_id: int = 0,
) -> train.TrainBatch:
  """Lays the selected responses out as a fixed-shape training batch.

  Row i: its prompt left-padded to the bucket Lp (`tokenizer.pad_left`), then its response
  (Lr tokens, mask after the stop token); rows beyond the selection are padding with an
  empty loss mask (they add nothing to a token mean). Old log-probs sit at the response
  tokens' columns, as `losses.token_logprobs` aligns them.

  Args:
    result: the adaptive step's selection (handles index `responses`).
    responses: `tokens int32[N, Lr]`, `logprobs float32[N, Lr]`, `mask bool[N, Lr]` of all
      responses drawn this step.
    prompt_tokens: token ids of the step's prompts (indexed by `result.prompt_index`).
    rows: the batch's fixed row count (>= number selected).
    buckets: allowed prompt lengths.
    pad_id: id written into padding (masked out).

  Returns:
    A `train.TrainBatch` of numpy arrays, `[rows, Lp + Lr]`.

  Raises:
    ValueError: more responses selected than `rows`, or a prompt longer than every bucket.
  """
  sel = np.asarray(result.handles, np.int64)
  if len(sel) > rows:
    raise ValueError(f"{len(sel)} responses selected for a {rows}-row batch")
  lr = responses["tokens"].shape[1]
  selected = [prompt_tokens[p] for p in result.prompt_index]
  # No selection (dapo without a mixed group) gives an all-padding batch of the smallest
  # bucket, padded to `rows` below like any short selection.
  prompt_ids, prompt_mask = pad_left(selected or [[pad_id]], pad_id, buckets=buckets)
  lp = prompt_ids.shape[1]
  tokens = np.full((rows, lp + lr), pad_id, np.int32)
  attention = np.zeros((rows, lp + lr), bool)
  loss_mask = np.zeros((rows, lp + lr), bool)
  old = np.zeros((rows, lp + lr), np.float32)
  adv = np.zeros((rows,), np.float32)
  n = len(sel)
  if n:
    tokens[:n, :lp], attention[:n, :lp] = prompt_ids, prompt_mask
    tokens[:n, lp:] = responses["tokens"][sel]
    attention[:n, lp:] = loss_mask[:n, lp:] = responses["mask"][sel]
    old[:n, lp:] = responses["logprobs"][sel]
    adv[:n] = result.advantages
  positions = model_lib.positions_from_mask(attention)
  return train.TrainBatch(
    tokens=tokens,
    positions=positions,
    attention_mask=attention,
    loss_mask=loss_mask,
    advantages=adv,
    old_logprobs=old,
  )
