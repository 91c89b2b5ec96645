"""The device half of the rollout engine: a slot pool decoded in one jit-compiled loop.

S slots decode at once. A queue of pending rows (each: its prompt's entry in a prompt
cache, its output position, its row id) feeds them: when a row ends (stop token or the
token budget), the next pending row takes its slot at the next step. `prefill_prompts`
fills the prompt cache once per distinct prompt, and a row reads its prompt there: decode
attention reads each entry once per step for all its live rows (`attention.slot_attention`,
`shared_prompt`), and the response columns only up to the longest live row; a row's
tokens depend only on (rollout key, row id, token index), never on its slot, the pool
size or the device count.

Every shape is static (S, queue length Q, prompt-cache entries P, prompt bucket Lp,
budget Lr): the queue contents, its fill level, cancellations and the RNG are traced
values, so nothing recompiles after warm-up. `run_segment` returns after at most
`segment_steps` steps, when the pool and queue are empty, or, when the host says it has
more rows (`Queue.more`), as soon as the queue is drained, so that the host can add,
cancel and collect rows (`sampler.SlotDriver`) while the live rows keep their slots.

The prompt and slot caches, their layouts, writes and reads are `slots.py`'s.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from ada_jax.models import decoder as model_lib
from ada_jax.models import flash
from ada_jax.models import layers as layers_lib
from ada_jax.models import sharding as sharding_lib
from ada_jax.models.decoder import ModelConfig, Params
from ada_jax.rollout import attention as attention_lib
from ada_jax.rollout import slots as slots_lib
from ada_jax.rollout.rule import SamplingRule
from ada_jax.rollout.slots import PromptCache


@struct.dataclass
class Queue:
  """Rows waiting for a slot, in the order they start (padded to Q entries).

  Attributes:
    prompt: `int32[Q]` prompt-cache entry of each row.
    position: `int32[Q]` output position of each row (index into `SlotState.tokens`).
    row_id: `int32[Q]` the row's id: its tokens are drawn from `fold_in(fold_in(key,
      row_id), token index)`.
    count: `int32[]` rows queued; entries `>= count` are padding.
    more: `bool[]` the host holds further rows: return as soon as the queue is drained.
    wait: `bool[]` those rows wait for a live row to end (room in their prompt-cache entry,
      or a free entry; `SlotDriver.admit`): with `more`, return once the queue is drained
      and a row has ended in this segment.
    cancel: `bool[S]` live slots whose rows are dropped before the first step (their
      slots are refilled at once).
  """

  prompt: jax.Array
  position: jax.Array
  row_id: jax.Array
  count: jax.Array
  more: jax.Array
  wait: jax.Array
  cancel: jax.Array


@struct.dataclass
class SlotState:
  """The pool between segments (S slots, O output positions, budget Lr).

  Attributes:
    cache: the slots' `SlotCache` (Lr ring columns per slot).
    entry: `int32[S]` the prompt-cache entry of the slot's row (its prompt is read there).
    logits: `float32[S, V]` next-token logits of each slot.
    live: `bool[S]` the slot holds an unfinished row.
    position: `int32[S]` output position of the slot's row.
    row_id: `int32[S]` id of the slot's row (RNG).
    prompt_len: `int32[S]` real prompt tokens of the slot's row.
    length: `int32[S]` tokens generated so far by the slot's row.
    tokens: `int32[O, Lr]` response tokens by output position, 0 after the stop token.
    logprobs: `float32[O, Lr]` their log-probs under log_softmax(logits / T) (`SamplingRule`).
    lengths: `int32[O]` tokens generated (the stop token included).
    finished: `bool[O]` the row ended (stop token or budget).
    steps: `int32[]` decode steps run (all segments).
    tokens_generated: `float32[]` tokens drawn by live rows (all segments).
    kv_read: `float32[]` cache columns read by decode attention, summed over slots and steps.
    kv_useful: `float32[]` of those, columns holding real tokens of a live row.
  """

  cache: slots_lib.SlotCache
  entry: jax.Array
  logits: jax.Array
  live: jax.Array
  position: jax.Array
  row_id: jax.Array
  prompt_len: jax.Array
  length: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  lengths: jax.Array
  finished: jax.Array
  steps: jax.Array
  tokens_generated: jax.Array
  kv_read: jax.Array
  kv_useful: jax.Array


def _constrain(x, sharding):
  return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def output_table(config: ModelConfig, params: Params) -> jax.Array:
  """The `[V, D]` output projection: the input embedding when tied, else `lm_head`."""
  return params["embed"] if config.tie_embeddings else params["lm_head"]


# Queries per block of the prefill's causal attention (`layers.causal_attend`).
PREFILL_QUERY_BLOCK = 256


def prefill_prompts(
  config: ModelConfig,
  params: Params,
  prompts: PromptCache,
  tokens: jax.Array,
  mask: jax.Array,
  entries: jax.Array,
  mesh: jax.sharding.Mesh | None = None,
) -> tuple[PromptCache, jax.Array]:
  """Prefills prompts once each and stores them in prompt-cache entries (pure; jit it).

  With a mesh the N prompts go through the model in N / (data x fsdp) steps of one prompt
  per data-parallel device (a `lax.scan`), each step's keys and values stored before the
  next starts, and causal attention runs `PREFILL_QUERY_BLOCK` queries at a time (or as
  the platform's kernel, `flash.self_attend`, whose scores stay in VMEM): the
  launch's temporaries are one prompt's activations and one block's scores per device,
  not every prompt's at once (XLA:TPU, docs/tpu.md section 7). Without a mesh all N run
  in one step.

  Args:
    config: the architecture.
    params: model parameters.
    prompts: the prompt cache (P entries of Lp columns).
    tokens: `int32[N, Lp]` left-padded prompts.
    mask: `bool[N, Lp]` True at real tokens.
    entries: `int32[N]` entry of each prompt; an entry `>= P` drops that prompt (padding).
    mesh: when given, the prompts' rows are split over ('data', 'fsdp') and the cache
      keeps its sharding (`slots.constrain_prompts`).

  Returns:
    (the updated cache, `float32[N, D]` each prompt's final-normed hidden state at its last
    token: the input of a pass-rate head, or of `decoder.unembed` for the next-token
    logits), from the one forward pass that also fills the cache; replicated over the
    mesh, when given, so that every process reads it.
  """
  n = tokens.shape[0]
  group = n if mesh is None else sharding_lib.data_parallel_size(mesh)
  if n % group:
    group = n
  positions = model_lib.positions_from_mask(mask)
  # The platform's kernel, else XLA's form a block of queries at a time.
  attend = flash.self_attend(config, mesh, tokens.shape[1]) or functools.partial(
    layers_lib.causal_attend, block=PREFILL_QUERY_BLOCK
  )

  def step(prompts, inputs):
    tokens, mask, positions, entries = inputs
    if mesh is not None:
      rows = sharding_lib.batch_sharding(mesh)
      tokens, mask, positions = (_constrain(x, rows) for x in (tokens, mask, positions))

    def causal(*projections):
      q, k, v = layers_lib.split_heads(*projections)
      return attend(q, k, v, mask), (k, v)

    hidden, kvs = model_lib.forward(
      config, params, tokens, positions, lambda layer: causal, last_only=True, head=False
    )
    hidden = hidden[:, 0].astype(jnp.float32)
    return slots_lib.store_prompts(config, prompts, entries, kvs, mask, hidden, mesh), hidden

  steps = lambda x: x.reshape(n // group, group, *x.shape[1:])
  prompts, hidden = jax.lax.scan(
    step, prompts, tuple(map(steps, (tokens, mask, positions, entries)))
  )
  hidden = hidden.reshape(n, -1)
  if mesh is not None:  # every process reads every prompt's hidden state (the host queue)
    hidden = _constrain(hidden, sharding_lib.replicated(mesh))
  return prompts, hidden


def init_pool(
  config: ModelConfig,
  *,
  slots: int,
  outputs: int,
  max_new_tokens: int,
  prompt_len: int,
  mesh: jax.sharding.Mesh | None = None,
) -> SlotState:
  """An empty pool: S = `slots` free slots, `outputs` output positions, a `SlotCache` of
  `max_new_tokens` ring columns per slot (and `prompt_len` prompt columns where the slots
  keep their prompt's copy, `slots.copies_prompts`)."""
  cache = slots_lib.init_slot_cache(config, slots, max_new_tokens, mesh, prompt_len)
  zeros = lambda shape, dtype=jnp.int32: jnp.zeros(shape, dtype)
  return SlotState(
    cache=cache,
    entry=zeros((slots,)),
    logits=zeros((slots, config.vocab_size), jnp.float32),
    live=zeros((slots,), bool),
    position=zeros((slots,)),
    row_id=zeros((slots,)),
    prompt_len=zeros((slots,)),
    length=zeros((slots,)),
    tokens=zeros((outputs, max_new_tokens)),
    logprobs=zeros((outputs, max_new_tokens), jnp.float32),
    lengths=zeros((outputs,)),
    finished=zeros((outputs,), bool),
    steps=zeros(()),
    tokens_generated=zeros((), jnp.float32),
    kv_read=zeros((), jnp.float32),
    kv_useful=zeros((), jnp.float32),
  )


def _start_rows(config, params, s: SlotState, prompts: PromptCache, queue: Queue, take, qi):
  """The pool's bookkeeping for slots `take` (bool[S]) starting queue rows `qi` (int32[S]):
  their first logits (from the prompt's last hidden state), ids, counters and output rows
  reset. Reads no slot cache (`s.cache` may be None)."""
  entry = queue.prompt[qi]
  put = lambda old, new: jnp.where(take.reshape(-1, *[1] * (new.ndim - 1)), new, old)
  logits = model_lib.unembed(
    config, output_table(config, params), prompts.hidden[entry].astype(config.compute_dtype)
  )
  position = jnp.where(take, queue.position[qi], s.position)
  out_rows = jnp.where(take, position, s.tokens.shape[0])  # out of range: dropped
  return s.replace(
    entry=jnp.where(take, entry, s.entry),
    logits=put(s.logits, logits),
    live=s.live | take,
    position=position,
    row_id=jnp.where(take, queue.row_id[qi], s.row_id),
    prompt_len=jnp.where(take, prompts.mask[entry].sum(-1).astype(jnp.int32), s.prompt_len),
    length=jnp.where(take, 0, s.length),
    tokens=s.tokens.at[out_rows].set(0, mode="drop"),
    logprobs=s.logprobs.at[out_rows].set(0.0, mode="drop"),
    lengths=s.lengths.at[out_rows].set(0, mode="drop"),
    finished=s.finished.at[out_rows].set(False, mode="drop"),
  )


def _refill(config, params, s: SlotState, prompts: PromptCache, queue: Queue, take, qi, mesh):
  """Slots `take` (bool[S]) start queue rows `qi` (int32[S]), when any does: their ring
  masked and their prompt copied in where slots keep copies (`slots.admit`, outside the
  conditional: XLA:GPU copies a cache passed through one, `slots.in_place_under_cond`)
  and their bookkeeping reset (`_start_rows`)."""
  start = lambda r: _start_rows(config, params, r, prompts, queue, take, qi)
  cache = slots_lib.admit(s.cache, take, prompts, queue.prompt[qi], mesh)
  rest = jax.lax.cond(jnp.any(take), start, lambda r: r, s.replace(cache=None))
  return rest.replace(cache=cache)


def row_uniforms(key: jax.Array, row_id: jax.Array, index: jax.Array) -> jax.Array:
  """`float32[S]` uniform numbers in [0, 1), one per row: `fold_in(fold_in(key, row id),
  token index)`, so a row's draws never depend on which slot or step produced them."""
  draw = lambda r, j: jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, r), j))
  return jax.vmap(draw)(row_id, index)


def decode_step(
  config: ModelConfig,
  params: Params,
  s: SlotState,
  prompts: PromptCache,
  token: jax.Array,
  still: jax.Array,
  *,
  attention_block: int,
  entry_rows: int,
  mesh: jax.sharding.Mesh | None = None,
) -> SlotState:
  """One decode step of the pool (pure): the slots' new tokens go through the model, their
  keys and values into the slot cache's ring column, their next-token logits into `logits`.

  Args:
    s: the pool after this step's draw (`length` counts the new token).
    prompts: the prompt cache the slots' rows point into (`s.entry`).
    token: `int32[S]` the token each slot drew.
    still: `bool[S]` slots whose row goes on (its token is decoded; others are masked).
    attention_block: ring window granularity (`attention.ring_windows`).
    entry_rows: the most live rows a prompt-cache entry has (`shared_prompt.group_by_entry`).
    mesh: when given, the cache keeps `slots.slot_cache_shardings`.
  """
  n_slots = still.shape[0]
  c = s.cache
  mask = jax.lax.dynamic_update_slice(c.mask, still[:, None], (0, c.column))
  window = jnp.max(jnp.where(still, s.length, 1))  # ring columns of the longest live row
  attention, read = attention_lib.slot_attention(
    c, prompts, (s.entry, still, entry_rows), mask, window, attention_block, config, mesh
  )
  logits, kvs = model_lib.forward(
    config, params, token[:, None], (s.prompt_len + s.length - 1)[:, None], attention
  )
  cache = c.replace(
    k=tuple(k for k, _ in kvs),
    v=tuple(v for _, v in kvs),
    mask=mask,
    column=(c.column + 1) % c.mask.shape[1],
  )
  real = s.prompt_len + s.length  # the row's real tokens, the new one included
  return s.replace(
    cache=slots_lib.constrain(config, cache, mesh),
    logits=logits[:, 0],
    kv_read=s.kv_read + (n_slots * read).astype(jnp.float32),
    kv_useful=s.kv_useful + jnp.where(still, real, 0).sum().astype(jnp.float32),
  )


def draw_and_decode(
  config: ModelConfig,
  params: Params,
  s: SlotState,
  prompts: PromptCache,
  key: jax.Array,
  *,
  rule: SamplingRule,
  stop_ids: tuple[int, ...],
  attention_block: int,
  entry_rows: int,
  mesh: jax.sharding.Mesh | None = None,
) -> SlotState:
  """One step of the decode loop after its refill (pure): every live slot draws a token
  (`rule.draw` with `row_uniforms`), rows that drew a stop token or reached the budget Lr
  finish, and one decode step runs for the slots still live. `run_segment`'s loop body
  with `_refill`; `plan.programs.decode_step_program` loops it alone for the roofline.

  Args:
    s: the pool after this step's refill.
    prompts: the prompt cache its rows point into.
    key: the rollout key.
    rule, stop_ids, attention_block, entry_rows, mesh: as `run_segment`.
  """
  budget, n_out = s.tokens.shape[1], s.tokens.shape[0]
  u = row_uniforms(key, s.row_id, s.length)
  token, logprob = rule.draw(s.logits, u, mesh)
  live = s.live
  token = jnp.where(live, token, 0)
  rows = jnp.where(live, s.position, n_out)  # finished slots write nowhere
  length = s.length + live
  ends = live & (jnp.isin(token, jnp.asarray(stop_ids, jnp.int32)) | (length >= budget))
  still = live & ~ends
  s = s.replace(
    tokens=s.tokens.at[rows, s.length].set(token, mode="drop"),
    logprobs=s.logprobs.at[rows, s.length].set(jnp.where(live, logprob, 0.0), mode="drop"),
    lengths=s.lengths.at[rows].set(length, mode="drop"),
    finished=s.finished.at[jnp.where(ends, s.position, n_out)].set(True, mode="drop"),
    live=still,
    length=length,
    steps=s.steps + 1,
    tokens_generated=s.tokens_generated + live.sum(),
  )
  decode = lambda s: decode_step(
    config, params, s, prompts, token, still, attention_block=attention_block,
    entry_rows=entry_rows, mesh=mesh,
  )  # fmt: skip
  went_on = jnp.any(still)
  if slots_lib.in_place_under_cond(mesh):
    return jax.lax.cond(went_on, decode, lambda s: s, s)
  # The step's cache write lands at the unchanged column: masked, then overwritten.
  stepped, keep = decode(s), lambda new, old: jnp.where(went_on, new, old)
  return stepped.replace(
    cache=stepped.cache.replace(column=keep(stepped.cache.column, s.cache.column)),
    kv_read=keep(stepped.kv_read, s.kv_read),
    kv_useful=keep(stepped.kv_useful, s.kv_useful),
  )


def run_segment(
  config: ModelConfig,
  params: Params,
  state: SlotState,
  prompts: PromptCache,
  queue: Queue,
  key: jax.Array,
  *,
  rule: SamplingRule,
  stop_ids: tuple[int, ...],
  segment_steps: int,
  attention_block: int,
  entry_rows: int,
  mesh: jax.sharding.Mesh | None = None,
) -> tuple[SlotState, jax.Array]:
  """Decodes the pool for one segment (pure; jit with everything after `key` static).

  Each step: free slots take the next queued rows (in queue order among the rows of
  their row shard: a row decodes on the devices that hold its prompt's entry,
  `attention.row_shards`), then `draw_and_decode`: every live slot draws one token, rows
  that drew a stop token or reached the budget Lr finish, and one decode step runs for
  the slots still live, attending over the cache blocks up to the longest of them.

  Args:
    config, params: the model.
    state: the pool (`init_pool`, or the previous segment's).
    prompts: the prompt cache the queued rows point into.
    queue: the rows to start; `queue.cancel` drops live rows first.
    key: the rollout key (`row_uniforms`).
    rule: the sampling rule.
    stop_ids: tokens that end a row (kept in the response).
    segment_steps: at most this many steps.
    attention_block: decode attention reads the response ring in windows of whole blocks
      of this many columns (`ring_windows`).
    entry_rows: the most rows of one prompt-cache entry live at once (the host driver's
      admission keeps to it): decode attention groups each entry's rows for its prompt.
    mesh: when given, the slot cache is sharded by `slots.slot_cache_shardings` and the
      outputs replicated (every process reads every row).

  Returns:
    (the pool after the segment, `bool[Q]` the queue rows started, i.e. consumed).
  """

  n_slots, n_queue = state.live.shape[0], queue.prompt.shape[0]
  d = attention_lib.row_shards(config, mesh, n_slots, prompts.mask.shape[0])
  shard, rank, count = _queue_by_shard(queue, prompts.mask.shape[0] // d, d)
  order = jnp.zeros((d, n_queue), jnp.int32).at[shard, rank].set(jnp.arange(n_queue), mode="drop")

  def cond(carry):
    i, head, ended, s = carry
    pending = jnp.any(head < count)
    early = ~pending & queue.more & (ended | ~queue.wait)
    return (i < segment_steps) & (jnp.any(s.live) | pending) & ~early

  def body(carry):
    i, head, ended, s = carry
    free = (~s.live).reshape(d, n_slots // d)
    nxt = head[:, None] + jnp.cumsum(free, 1) - 1
    take = free & (nxt < count[:, None])
    qi = order[jnp.arange(d)[:, None], jnp.clip(nxt, 0, n_queue - 1)]
    s = _refill(config, params, s, prompts, queue, take.reshape(-1), qi.reshape(-1), mesh)
    head = head + take.sum(1, dtype=jnp.int32)
    live = s.live
    s = draw_and_decode(
      config, params, s, prompts, key, rule=rule, stop_ids=stop_ids,
      attention_block=attention_block, entry_rows=entry_rows, mesh=mesh,
    )  # fmt: skip
    return i + 1, head, ended | jnp.any(live & ~s.live), s

  state = state.replace(live=state.live & ~queue.cancel)
  start = (jnp.zeros((), jnp.int32), jnp.zeros((d,), jnp.int32), jnp.zeros((), bool), state)
  _, head, _, state = jax.lax.while_loop(cond, body, start)
  started = (shard < d) & (rank < head[jnp.minimum(shard, d - 1)])
  if mesh is not None:  # every process reads the outputs and the slots' bookkeeping
    rep = sharding_lib.replicated(mesh)
    host_read = [f.name for f in dataclasses.fields(state) if f.name not in ("cache", "logits")]
    state = state.replace(**{f: _constrain(getattr(state, f), rep) for f in host_read})
    started = _constrain(started, rep)
  return state, started


def _queue_by_shard(queue: Queue, entries_per_shard: int, shards: int):
  """Each queued row's row shard (its entry's: `attention.row_shards`; `shards` for padding),
  its place in queue order among its shard's rows, and `int32[D]` rows per shard."""
  real = jnp.arange(queue.prompt.shape[0]) < queue.count
  shard = jnp.where(real, queue.prompt // entries_per_shard, shards)
  ones = (shard[:, None] == jnp.arange(shards)).astype(jnp.int32)  # [Q, D]
  rank = jnp.take_along_axis(jnp.cumsum(ones, 0) - 1, jnp.minimum(shard, shards - 1)[:, None], 1)
  return shard, rank[:, 0], ones.sum(0)
