"""The host's view of one slot pool (`pool.py`): the rollout's streaming vocabulary.

`SlotDriver` tracks which prompt-cache entries hold which prompts, the rows waiting for a
slot and the output positions in use. Its calls are what a streaming controller needs:
`prefill` prompts (returning each one's last hidden state, e.g. for a learned pass-rate
head, from the same forward pass that fills the cache), `add_rows` of a prefilled
prompt, `cancel` every row of a prompt (its live slots are refilled at the next step),
`run` one segment, `collect` the rows that finished. A controller can prefill, decide
row counts from the hidden states, then queue rows, with no extra forward pass.

`advance` is the one admit / run / collect step every caller drives: `drain` loops it to
the last row (`Sampler.generate`, evaluation, a `rounds` round), a `stream` step calls it
once per segment (`ada_jax.rollout.engine.SlotEngine`). `take_counters` is the one account of what
the decode loop cost.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ada_jax.models.decoder import Params
from ada_jax.models.tokenizer import pad_left
from ada_jax.rollout import pool as pool_lib


@dataclasses.dataclass
class _Row:
  row_id: int
  entry: int
  position: int
  draw_id: int  # the id its tokens are drawn with (`pool.row_uniforms`)


def response_arrays(
  finished: Sequence[tuple[int, np.ndarray, np.ndarray, int]], rows: int, max_new_tokens: int
) -> dict[str, np.ndarray]:
  """Finished rows (`collect`'s (row id, tokens, logprobs, length) tuples) as arrays by row
  id: `tokens int32[rows, Lr]`, `logprobs float32[rows, Lr]`, `mask bool[rows, Lr]`,
  `lengths int32[rows]`; a row id not among them is empty (length 0)."""
  out = {
    "tokens": np.zeros((rows, max_new_tokens), np.int32),
    "logprobs": np.zeros((rows, max_new_tokens), np.float32),
    "lengths": np.zeros((rows,), np.int32),
  }
  for row, tokens, logprobs, n in finished:
    out["tokens"][row], out["logprobs"][row], out["lengths"][row] = tokens, logprobs, n
  out["mask"] = np.arange(max_new_tokens) < out["lengths"][:, None]
  return out


class SlotDriver:
  """Host driver of one pool (`pool.run_segment`) for prompts of one bucket length.

  Args:
    programs: the bucket's jitted programs and sizes (`sampler.SlotPrograms`).
    params: model parameters.
    key: the rollout key (a row's tokens are `fold_in(fold_in(key, draw id), index)`
      draws; the draw id is the row id unless `rekey` says otherwise).

  Output positions: a row holds one from `add_rows` until `collect` returns it (or it is
  cancelled); at most S rows are live and Q queued, so S + Q positions never run out.
  """

  def __init__(self, programs: Any, params: Params, key: jax.Array):
    self.programs, self.params, self.key = programs, params, key
    self.prompt_len = programs.prompt_len
    e = programs
    self.state = e.init()
    self.prompts = e.empty_prompts()
    self.draw_base = 0
    self._counted: dict[str, float] = {"steps": 0, "kv_read": 0.0, "kv_useful": 0.0}
    self.free_entries = list(range(e.prompt_entries))
    self.free_positions = list(range(e.slots + e.queue_rows))
    self.queued: collections.deque[_Row] = collections.deque()
    self.started: dict[int, _Row] = {}  # output position -> row holding a slot
    self.refs = collections.Counter()  # entry -> rows queued or live (they read its prompt)
    self.released: set[int] = set()
    self.cancel_mask = np.zeros((e.slots,), bool)
    self.segments = 0

  @property
  def room(self) -> int:
    """Rows `add_rows` can take now (queue space and output positions)."""
    return min(self.programs.queue_rows - len(self.queued), len(self.free_positions))

  @property
  def busy(self) -> bool:
    """Rows are queued or still decoding (finished rows may await `collect`)."""
    return bool(self.queued) or bool(np.asarray(self.state.live).any())

  def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[list[int], np.ndarray]:
    """Prefills prompts (one forward pass each) into free prompt-cache entries.

    Returns:
      (their entries, `float32[len(prompts), D]` each prompt's final-normed hidden state
      at its last token).

    Raises:
      ValueError: more prompts than free entries, an empty prompt, or one longer than Lp.
    """
    e = self.programs
    if len(prompts) > len(self.free_entries):
      raise ValueError(f"{len(prompts)} prompts for {len(self.free_entries)} free prompt entries")
    if any(len(p) == 0 for p in prompts):
      raise ValueError("an empty prompt cannot be prefilled")
    entries = [self._free_entry() for _ in prompts]
    # Launches of a fixed `prompts_per_chunk` prompts (one compiled shape); the last one
    # padded with 1-token prompts whose entries are dropped.
    n, hidden = e.prompts_per_chunk, []
    for i in range(0, len(prompts), n):
      chunk = list(prompts[i : i + n])
      where = np.full((n,), e.prompt_entries, np.int32)
      where[: len(chunk)] = entries[i : i + n]
      tokens, mask = pad_left(
        chunk + [[e.pad_id]] * (n - len(chunk)), e.pad_id, length=self.prompt_len
      )
      self.prompts, h = e.prefill(self.params, self.prompts, *e.put((tokens, mask, where)))
      hidden.append(np.asarray(h)[: len(chunk)])
    d = self.programs.embed_dim
    return entries, np.concatenate(hidden) if hidden else np.zeros((0, d), np.float32)

  def _free_entry(self) -> int:
    """Takes a free entry in the row shard (`SlotPrograms.row_shards`) whose entries hold
    the fewest queued or live rows: a row decodes in its entry's shard, so the shards'
    slots fill evenly. The first free entry on one device."""
    e = self.programs
    per_shard = e.prompt_entries // e.row_shards
    if e.row_shards == 1:
      return self.free_entries.pop(0)
    load = np.zeros((e.row_shards,), np.int64)
    free = set(self.free_entries)
    for entry in range(e.prompt_entries):
      if entry not in free:  # + 1: an entry just taken has its rows still to come
        load[entry // per_shard] += max(self.refs[entry], 0) + 1
    shard = min({x // per_shard for x in free}, key=lambda d: (load[d], d))
    entry = next(x for x in self.free_entries if x // per_shard == shard)
    self.free_entries.remove(entry)
    return entry

  def prefill_all(self, prompts: Sequence[Sequence[int]], entry_of: dict[int, int]) -> np.ndarray:
    """Prefills every prompt (index i of `prompts` -> `entry_of[i]`), as many at a time as
    there are free entries, freeing idle ones when none is left: the last ones prefilled
    stay cached for their rows. Returns `float32[len(prompts), D]` their hidden states
    (`prefill`'s), e.g. the features of Est's learned pass-rate head."""
    hidden, todo = [], list(range(len(prompts)))
    while todo:
      if not self.free_entries:
        self.release_idle(entry_of)
      chunk, todo = todo[: len(self.free_entries)], todo[len(self.free_entries) :]
      entries, h = self.prefill([prompts[p] for p in chunk])
      entry_of.update(zip(chunk, entries, strict=True))
      hidden.append(h)
    return np.concatenate(hidden) if hidden else np.zeros((0, self.programs.embed_dim), np.float32)

  def add_rows(self, entry: int, row_ids: Sequence[int]) -> list[int]:
    """Queues rows of the prompt in `entry`; returns their output positions.

    Raises:
      ValueError: the entry holds no prompt, or more rows than `room`.
    """
    if entry in self.free_entries or not 0 <= entry < self.programs.prompt_entries:
      raise ValueError(f"prompt entry {entry} holds no prefilled prompt")
    if len(row_ids) > self.room:
      raise ValueError(f"{len(row_ids)} rows exceed the pool's room ({self.room})")
    if self.refs[entry] + len(row_ids) > self.programs.entry_rows:
      # Decode attention groups at most R rows of an entry: a row past it would be read
      # with another row's prompt part.
      raise ValueError(
        f"{len(row_ids)} rows on entry {entry}, which holds {self.refs[entry]} queued or live,"
        f" exceed the {self.programs.entry_rows} rows an entry may have (entry_rows)"
      )
    rows = [
      _Row(int(r), entry, self.free_positions.pop(0), int(r) - self.draw_base) for r in row_ids
    ]
    self.queued.extend(rows)
    self.refs[entry] += len(rows)
    self.released.discard(entry)
    return [r.position for r in rows]

  def release(self, entry: int) -> None:
    """The caller adds no more rows of `entry`: it is freed once no queued or live row
    needs it (a live row reads its prompt there every decode step)."""
    self.released.add(entry)
    self._free_unused()

  def cancel_rows(self, row_ids: Sequence[int]) -> int:
    """Drops these rows wherever they are: queued ones leave the queue, live ones free
    their slot at the next step (it is refilled at once). Ids of rows that are not queued
    or live (finished, never added) are ignored.

    Returns:
      tokens the dropped live rows had drawn (decoded and discarded).
    """
    ids = {int(r) for r in row_ids}
    if not ids:
      return 0
    for r in [r for r in self.queued if r.row_id in ids]:
      self.refs[r.entry] -= 1
      self.free_positions.append(r.position)
    self.queued = collections.deque(r for r in self.queued if r.row_id not in ids)
    live = [r for r in self.started.values() if r.row_id in ids]
    if not live:
      self._free_unused()
      return 0
    slot_position = np.asarray(self.state.position)
    slot_live = np.asarray(self.state.live)
    lengths = np.asarray(self.state.lengths)
    finished = np.asarray(self.state.finished)
    drawn = 0
    for r in live:
      del self.started[r.position]
      self.refs[r.entry] -= 1
      if finished[r.position]:  # Finished in the last segment, not collected: kept out.
        self.free_positions.append(r.position)
        continue
      self.cancel_mask |= slot_live & (slot_position == r.position)
      drawn += int(lengths[r.position])
      self.free_positions.append(r.position)
    self._free_unused()
    return drawn

  def admit(
    self,
    prompts: Sequence[Sequence[int]],
    row_prompt: Sequence[int],
    pending: collections.deque,
    entry_of: dict[int, int],
  ) -> bool:
    """Moves rows from the front of `pending` (row ids, in order) into the queue while
    there is room, a prompt-cache entry for their prompt and room in that entry (at most
    `entry_rows` rows queued or live per entry: decode attention groups an entry's rows
    for its prompt), prefilling the new prompts in one call.

    Args:
      prompts: token ids of every prompt a row may point at.
      row_prompt: `row_prompt[row]` is the row's index into `prompts`.
      pending: row ids waiting to be queued; those queued are popped.
      entry_of: prompt index -> its entry, for prompts prefilled and not yet freed
        (updated here; `release_idle` drops the freed ones).

    Returns:
      whether rows wait for an entry, or for room in one, held by live rows: the segment
      then returns once one of those has ended (`Queue.wait`), not as soon as the queue
      drains (it would return before a step).
    """
    front = [int(row_prompt[r]) for r in list(pending)[: self.room]]
    missing = {p for p in front if p not in entry_of}
    if len(missing) > len(self.free_entries):  # the cache is kept until an entry is needed
      self.release_idle(entry_of, keep=set(front))
      if not self.queued and front[0] not in entry_of and not self.free_entries:
        # The entries kept for rows behind the first one hold the whole cache and no queued
        # row will free one: free them too, or the first row never gets an entry, no row is
        # queued again and every segment returns at once (a livelock).
        self.release_idle(entry_of)
    take, new, blocked = [], [], False
    free, rows = len(self.free_entries), collections.Counter()
    while pending and len(take) < self.room:
      p = int(row_prompt[pending[0]])
      if p not in entry_of and p not in new:
        if len(new) == free:
          blocked = True
          break
        new.append(p)
      held = self.refs[entry_of[p]] if p in entry_of else 0
      if held + rows[p] >= self.programs.entry_rows:
        blocked = True
        break
      rows[p] += 1
      take.append(pending.popleft())
    if new:
      entries, _ = self.prefill([prompts[p] for p in new])
      entry_of.update(zip(new, entries, strict=True))
    # Queue order is request order: add in runs of one prompt.
    run_entry, run_rows = None, []
    for row in take:
      e = entry_of[int(row_prompt[row])]
      if e != run_entry and run_rows:
        self.add_rows(run_entry, run_rows)
        run_rows = []
      run_entry = e
      run_rows.append(row)
    if run_rows:
      self.add_rows(run_entry, run_rows)
    return blocked

  def release_idle(self, entry_of: dict[int, int], keep: set[int] = frozenset()) -> None:
    """Frees the entries of `entry_of` that no queued or live row needs (their rows have
    all ended), except those of the prompts in `keep`, and drops them from it; a prompt
    that gets rows later is prefilled again."""
    for p, entry in list(entry_of.items()):
      if self.refs[entry] <= 0 and p not in keep:
        self.release(entry)
    for p in [p for p, e in entry_of.items() if e in self.free_entries]:
      del entry_of[p]

  def run(self, more: bool = False, wait: bool = False) -> None:
    """One segment: at most `segment_steps` decode steps; returns early when every row is
    done or, with `more` (the caller has further rows to add), once the queue is drained
    (with `wait`, those rows wait for a live row to end: once the queue is drained and a
    row has ended)."""
    e = self.programs
    q = e.queue_rows
    sent = list(self.queued)[:q]
    arr = lambda f: np.array([f(r) for r in sent] + [0] * (q - len(sent)), np.int32)
    queue = pool_lib.Queue(
      prompt=arr(lambda r: r.entry),
      position=arr(lambda r: r.position),
      row_id=arr(lambda r: r.draw_id),
      count=np.int32(len(sent)),
      more=np.bool_(more or len(self.queued) > q),
      wait=np.bool_(wait and len(self.queued) <= q),
      cancel=self.cancel_mask,
    )
    self.state, started = e.run(self.params, self.state, self.prompts, e.put(queue), self.key)
    self.cancel_mask = np.zeros_like(self.cancel_mask)
    self.segments += 1
    started, waiting = np.asarray(started), collections.deque()
    for i, r in enumerate(self.queued):
      if i < q and started[i]:
        self.started[r.position] = r
      else:
        waiting.append(r)
    self.queued = waiting

  def collect(self) -> list[tuple[int, np.ndarray, np.ndarray, int]]:
    """Rows finished since the last call, as (row id, tokens `int32[Lr]`, logprobs
    `float32[Lr]`, length); their output positions are free again."""
    if not self.started:
      return []
    finished = np.asarray(self.state.finished)
    done = [p for p in self.started if finished[p]]
    if not done:
      return []
    tokens, logprobs = np.asarray(self.state.tokens), np.asarray(self.state.logprobs)
    lengths = np.asarray(self.state.lengths)
    out = []
    for p in done:
      row = self.started.pop(p)
      self.refs[row.entry] -= 1
      out.append((row.row_id, tokens[p], logprobs[p], int(lengths[p])))
      self.free_positions.append(p)
    self._free_unused()
    return out

  def _free_unused(self) -> None:
    for entry in list(self.released):
      if self.refs[entry] <= 0:
        self.released.discard(entry)
        self.free_entries.append(entry)

  def counters(self) -> dict[str, float]:
    """Device counters since the pool started: decode `steps`, `tokens` drawn, `kv_read`
    and `kv_useful` cache columns."""
    s = self.state
    return {
      "steps": int(s.steps),
      "tokens": float(s.tokens_generated),
      "kv_read": float(s.kv_read),
      "kv_useful": float(s.kv_useful),
    }

  def take_counters(self) -> dict[str, float]:
    """What the decode loop cost since the last call (or the pool's start): decode `steps`,
    `slot_steps` (slots × steps), `rows_computed` (slot-steps ÷ the budget Lr, rounded up:
    a row that holds a slot for the whole budget counts 1), `kv_read` and `kv_useful`
    cache columns. A `rounds` step takes them once per round, a `stream` step once."""
    now = self.counters()
    delta = {k: now[k] - self._counted[k] for k in self._counted}
    self._counted = {k: now[k] for k in self._counted}
    slot_steps = int(delta["steps"]) * self.programs.slots
    return {
      "steps": int(delta["steps"]),
      "slot_steps": slot_steps,
      "rows_computed": -(-slot_steps // self.programs.max_new_tokens),
      "kv_read": delta["kv_read"],
      "kv_useful": delta["kv_useful"],
    }

  def rekey(self, key: jax.Array, base: int) -> None:
    """Rows added from now on draw their tokens from `key` with draw ids `row id − base`
    (a `rounds` round keys its rows apart, numbered from 0 as `Sampler.generate` numbers
    a call's rows). Raises RuntimeError while rows are queued or live."""
    if self.busy:
      raise RuntimeError("SlotDriver.rekey: rows are still queued or decoding")
    self.key, self.draw_base = self.programs.put(key), base

  def advance(
    self,
    prompts: Sequence[Sequence[int]],
    row_prompt: Sequence[int] | dict[int, int],
    pending: collections.deque,
    entry_of: dict[int, int],
  ) -> list[tuple[int, np.ndarray, np.ndarray, int]]:
    """One admit / run / collect step: queues rows from `pending` (`admit`), decodes one
    segment (returning early once the queue drains while `pending` has more, and, when
    those wait for a live row to end, once one has) and returns the rows that finished
    (`collect`)."""
    blocked = self.admit(prompts, row_prompt, pending, entry_of)
    self.run(more=bool(pending), wait=blocked)
    return self.collect()

  def drain(
    self,
    prompts: Sequence[Sequence[int]],
    row_prompt: Sequence[int] | dict[int, int],
    pending: collections.deque,
    entry_of: dict[int, int],
  ) -> list[tuple[int, np.ndarray, np.ndarray, int]]:
    """`advance` until every row of `pending` has finished; returns them all."""
    finished = []
    while pending or self.busy:
      finished += self.advance(prompts, row_prompt, pending, entry_of)
    return finished
