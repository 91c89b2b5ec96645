"""The controller's engine on the slot pool: one `SlotDriver` per RL step with the
verifier, the step's response store keyed by row id, and what the step's sampling cost.

`rl.controller` drives a `SlotEngine` through its `Engine` calls (enqueue, update, decode,
submit, collect) under either schedule; the engine knows nothing of the algorithm: rows
are ids, prompts are indices into `prompts.tokens`, a decision is rows to cancel and to
queue. Built by `ada_jax.step.rl_step`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import jax
import numpy as np

from ada_jax.models.tokenizer import Tokenizer
from ada_jax.rollout.queue import response_arrays


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
    """Adds a `SlotDriver.take_counters` account (a round, or a whole stream step)."""
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
      # Every token the step decoded (finished responses and cancelled rows): its
      # sampling cost in tokens, summed over steps for curves against decode spent.
      "tokens_decoded": self.tokens + self.tokens_cancelled,
    }


def _fold_in(key: jax.Array, data: int) -> jax.Array:
  """`jax.random.fold_in(key, data)` with `data` put on the device explicitly: the tests run
  the rollouts under `jax_transfer_guard='disallow'`, where an implicit one fails."""
  return jax.random.fold_in(key, jax.device_put(np.uint32(data)))


class SlotEngine:
  """The controller's `Engine` on the slot pool: one `SlotDriver` for the whole step (the
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
    params: the step's rollout copy of the policy's parameters (`Sampler.rollout_params`,
      made once per step by `ada_jax.step.rl_step`; freed with the pool by `finish`).
    tokenizer: decodes responses for the verifier.
    grader: `submit(texts, answers) -> ticket`, `collect(ticket) -> float32[N]`
      (`distributed.SharedGrader`: identical on every process).
    prompts: the step's prompts: `tokens` and `answers` lists the controller's prompt
      indices index (`step.StepPrompts`; DAPO's extra prompts are appended as it asks).
    key: the step's rollout key.
    prompt_len: Lp, the pool's prompt bucket (DAPO's extra prompts must fit it).

  Attributes:
    counters: `RolloutCounters` of the step (complete after `finish`).
    outputs: row id -> (tokens int32[Lr], logprobs float32[Lr], length) of every row that
      finished.
  """

  def __init__(
    self, sampler, params, tokenizer: Tokenizer, grader, prompts: Any, key, prompt_len: int
  ):
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
    from the prefill that fills the pool's prompt cache (`SlotDriver.prefill_all`; Est's
    learned head reads them): the prompts stay cached for their rows."""
    return self.pool.prefill_all(self.prompts.tokens, self.entry_of)

  @property
  def busy(self) -> bool:
    """Rows are waiting for the pool, queued in it or decoding."""
    return bool(self.pending) or self.pool.busy

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
      finished = self.pool.advance(*args) if self.busy else []
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
    """Counts the decode steps since the last round (`stream`: the whole step), then drops
    the pool: its rollout copy of the weights and its slot and prompt caches are freed
    before the policy update, which `ada_jax.plan` counts without them."""
    self.counters.add(self.pool.take_counters())
    self.pool = None

  def responses(self) -> dict[str, np.ndarray]:
    """The response store by row id (the controller's handles): `tokens int32[N, Lr]`,
    `logprobs float32[N, Lr]`, `mask bool[N, Lr]`, `lengths int32[N]`; rows cancelled or
    never decoded are empty (length 0)."""
    finished = [(row, *output) for row, output in self.outputs.items()]
    return response_arrays(finished, len(self.row_prompt), self.sampler.max_new_tokens)
