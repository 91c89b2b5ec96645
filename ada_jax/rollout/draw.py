"""The rollout stage of one RL step: the step's prompts, the sampling the controller asks
for under each schedule, and the fixed-shape training batch built from what it selects.

Data flow (docs/design.md, "One RL step"): `StepPrompts` holds the step's prompts (and
hands DAPO its extra ones, `more_prompts`). Under `ada.schedule = 'rounds'`, `Rollouts` is
the `draw` of `rl.adaptive.run_step`: it lays each round's rows out for the slot-pool
`sampler.Sampler`, decodes them to the last one, then grades them while the accelerator
waits. Under 'stream', `StreamRollouts` drives `rl.stream.run_step`'s controller on one
slot pool for the whole step: rows are queued and cancelled between segments and the rows
of one segment are graded while the next decodes. Both keep every response they drew and
the same `RolloutCounters`; `make_train_batch` lays the selected responses out for
`rl.update.update_policy`.
"""

from __future__ import annotations

import collections
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
from ada_jax.rl.stream import StreamController
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
class RolloutCounters:
  """What one step's sampling cost, under either schedule.

  Attributes:
    responses: responses decoded to their end (cancelled rows not counted).
    tokens: their tokens (the stop token included).
    tokens_cancelled: tokens decoded for rows cancelled before their end (stream).
    decode_steps: decode steps of the slot pool (all segments).
    slot_steps: slots × decode steps.
    rows_computed: slot-steps ÷ the budget Lr, rounded up per sampler call.
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


@dataclasses.dataclass
class Rollouts:
  """The step's `draw` callable for `adaptive.run_step` (`rounds`): sampler + verifier,
  keeping every response it drew and what it cost (`counters`).

  Attributes:
    sampler: the rollout engine (slot pool).
    params: the policy's parameters.
    tokenizer: decodes responses for the verifier.
    score: `(texts, answers) -> rewards` (`distributed.SharedGrader.score`: identical on
      every process).
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
  counters: RolloutCounters = dataclasses.field(default_factory=RolloutCounters)

  def __call__(self, rows: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Draws one response per row (`rows[i]` indexes the step's prompts).

    Returns:
      (rewards float32[len(rows)], handles): handles index `responses()`.
    """
    out, stats = self.sampler.generate(
      self.params, self.prompts.tokens, rows, _fold_in(self.key, self.calls)
    )
    self.calls += 1
    start = time.perf_counter()
    texts = self.tokenizer.decode_many(
      [t[:n] for t, n in zip(out["tokens"], out["lengths"], strict=True)]
    )
    answers = self.prompts.answers
    rewards = self.score(texts, [answers[r] for r in rows])
    c = self.counters
    c.time_grade_wait_s += time.perf_counter() - start
    c.time_sample_s += stats.wall_s
    c.rows_computed += stats.rows_computed
    c.slot_steps += stats.slot_steps
    c.decode_steps += stats.slot_steps // self.sampler.slots
    c.responses += len(rows)
    c.tokens += stats.tokens
    first = sum(len(p["tokens"]) for p in self.parts)
    self.parts.append(out)
    return np.asarray(rewards, np.float32), list(range(first, first + len(rows)))

  def responses(self) -> dict[str, np.ndarray]:
    """Every response drawn: `tokens int32[N, Lr]`, `logprobs float32[N, Lr]`,
    `mask bool[N, Lr]`, `lengths int32[N]`."""
    keys = ("tokens", "logprobs", "mask", "lengths")
    return {k: np.concatenate([p[k] for p in self.parts]) for k in keys}


@dataclasses.dataclass
class StreamRollouts:
  """The `drive` of `rl.stream.run_step` (`stream`): one slot pool for the whole step.

  Per segment: queue the controller's rows (prefilling their prompts), decode one
  segment (`sampler.segment_steps` decode steps at most), collect the rows that finished,
  wait for the grades of the rows of the segment before (submitted to the grader before
  this segment started, so graded while it decoded), submit this segment's rows, then the
  controller's boundary: its cancelled rows leave the queue or their slots, its new rows
  join the queue. Row r's tokens are `fold_in(fold_in(fold_in(key, 0), r), index)` draws,
  r the controller's row id, so the step depends on the seeds alone, and GRPO and Est
  draw exactly the responses they draw under `rounds`.

  Attributes:
    sampler: the rollout engine.
    params: the policy's parameters.
    tokenizer: decodes responses for the verifier.
    grader: `submit(texts, answers) -> ticket`, `collect(ticket) -> float32[N]`
      (`distributed.SharedGrader`).
    prompts: the step's prompts (the controller's prompt indices index them).
    key: the step's rollout key.
    row_prompt: after the step, each row id's prompt index (rows cancelled included).
    prompt_len: Lp, the prompt bucket of the pool; None: the bucket of the step's prompts
      (DAPO's extra prompts must fit it: pass the bucket of the whole prompt set).
  """

  sampler: sampler.Sampler
  params: Any
  tokenizer: Tokenizer
  grader: Any
  prompts: StepPrompts
  key: jax.Array
  prompt_len: int | None = None
  counters: RolloutCounters = dataclasses.field(default_factory=RolloutCounters)
  outputs: dict = dataclasses.field(default_factory=dict)
  row_prompt: list[int] = dataclasses.field(default_factory=list)

  def __call__(self, ctl: StreamController) -> None:
    """Runs `ctl` to `done`.

    Raises:
      ValueError: a prompt longer than `prompt_len`.
    """
    lp = self.prompt_len or sampler.bucket_length(
      max(len(t) for t in self.prompts.tokens), self.sampler.prompt_buckets
    )
    # `Rollouts`' first key: the first rows (all of GRPO's and Est's, a Seq method's first
    # window) carry the row ids, so the tokens, that `rounds` draws for them.
    pool = self.sampler.pool(self.params, _fold_in(self.key, 0), lp)
    c = self.counters
    pending: collections.deque[int] = collections.deque(ctl.start()[0].tolist())
    entry_of: dict[int, int] = {}
    ticket = self.grader.submit([], [])
    while not ctl.done:
      finished = []
      if pending or pool.busy:
        start = time.perf_counter()
        if pending and not pool.free_entries:
          pool.release_idle(entry_of)  # prompts whose rows all started are prefilled again
        pool.admit(self.prompts.tokens, ctl.row_prompt, pending, entry_of)
        pool.run(more=bool(pending))
        finished = sorted(pool.collect(), key=lambda f: f[0])
        c.time_sample_s += time.perf_counter() - start
      elif not ctl.awaiting:
        raise RuntimeError("StreamRollouts: nothing to decode or grade, but not done")
      start = time.perf_counter()
      rewards = self.grader.collect(ticket)
      c.time_grade_wait_s += time.perf_counter() - start
      texts = self.tokenizer.decode_many([tokens[:n] for _, tokens, _, n in finished])
      answers = self.prompts.answers
      ticket = self.grader.submit(texts, [answers[ctl.row_prompt[f[0]]] for f in finished])
      for row, tokens, logprobs, n in finished:
        self.outputs[row] = (tokens, logprobs, n)
        c.responses += 1
        c.tokens += n
      d = ctl.boundary([f[0] for f in finished], rewards)
      if d.cancel.size:
        gone = set(d.cancel.tolist())
        pending = collections.deque(r for r in pending if r not in gone)
        c.tokens_cancelled += pool.cancel_rows(d.cancel)
      for p in d.exited.tolist():  # an active prompt keeps its entry for its next rows
        if p in entry_of:
          pool.release(entry_of.pop(p))
      pending.extend(d.enqueue.tolist())
    counts = pool.counters()
    c.decode_steps = counts["steps"]
    c.slot_steps = counts["steps"] * self.sampler.slots
    c.rows_computed = -(-c.slot_steps // self.sampler.max_new_tokens)
    self.row_prompt = list(ctl.row_prompt)

  def responses(self) -> dict[str, np.ndarray]:
    """Every response by row id (the controller's handles): `tokens int32[N, Lr]`,
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
