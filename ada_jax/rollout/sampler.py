"""Rollout engine, host side: `Sampler`, its compiled pool functions and `generate`.

The device loop is `pool.py`; the host's queue of one pool is `queue.SlotDriver`.
`Sampler.generate` is the batch call the RL step, evaluation and prompt selection use:
any number of rows (responses) of any prompts, returned in request order. Row i's tokens
depend only on (rng, i, token index), never on the pool size, the schedule or the mesh.
Shapes are fixed per prompt bucket (slots S, queue Q, prompt entries P, budget Lr), so
nothing recompiles after the first call of each bucket.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ada_jax.models import decoder as model_lib
from ada_jax.models import layers as layers_lib
from ada_jax.models import sharding as sharding_lib
from ada_jax.models.decoder import ModelConfig, Params
from ada_jax.rollout import attention as attention_lib
from ada_jax.rollout import pool as pool_lib
from ada_jax.rollout import slots as slots_lib
from ada_jax.rollout.queue import SlotDriver, response_arrays
from ada_jax.rollout.rule import SamplingRule as SamplingRule
from ada_jax.rollout.spec import SamplerSpec


@dataclasses.dataclass
class SampleStats:
  """What one `Sampler.generate` call cost.

  Attributes:
    rows_computed: decode work in rows: slot-steps ÷ the budget Lr, rounded up (a row that
      holds a slot for the whole budget counts 1).
    rows_useful: rows requested.
    tokens: response tokens generated in requested rows.
    chunks: segments run (device calls of the decode loop).
    wall_s: seconds, including the host transfers.
    slot_steps: slots × decode steps.
    kv_read: cache columns read by decode attention (summed over slots and steps).
    kv_useful: of those, columns holding a live row's real tokens.
  """

  rows_computed: int = 0
  rows_useful: int = 0
  tokens: int = 0
  chunks: int = 0
  wall_s: float = 0.0
  slot_steps: int = 0
  kv_read: float = 0.0
  kv_useful: float = 0.0

  @property
  def token_slot_utilization(self) -> float:
    """Useful tokens ÷ slot-steps (1 = no slot ever idle)."""
    return self.tokens / max(self.slot_steps, 1)


@dataclasses.dataclass(frozen=True)
class SlotPrograms:
  """One prompt bucket's rollout engine: its jitted pool functions and the sizes they were
  built for (`Sampler.programs`), all a `queue.SlotDriver` needs.

  Attributes:
    init: `() -> pool.SlotState`, an empty pool (`pool.init_pool`).
    empty_prompts: `() -> slots.PromptCache`, an empty prompt cache.
    prefill: `(params, prompts, tokens, mask, entries) -> (prompts, hidden)`
      (`pool.prefill_prompts`; the prompt cache is donated).
    run: `(params, state, prompts, queue, key) -> (state, started)` (`pool.run_segment`;
      the state is donated).
    prompt_len: Lp, the bucket (tokens).
    slots: S, rows decoding at once.
    queue_rows: Q, rows queued per segment.
    prompt_entries: P, prompts the prompt cache holds.
    entry_rows: R, rows of one entry queued or live at once at most (the driver's
      admission keeps to it; decode attention groups them for their prompt).
    row_shards: D, the blocks of slots and of entries on the same devices
      (`attention.row_shards`): a row decodes in its entry's block.
    prompts_per_chunk: prompts per prefill launch.
    max_new_tokens: Lr, the response budget (tokens).
    pad_id: the padding token.
    embed_dim: the model's hidden size (of the prefill's hidden states).
    mesh: the mesh the programs run on, or None.
  """

  init: Any
  empty_prompts: Any
  prefill: Any
  run: Any
  prompt_len: int
  slots: int
  queue_rows: int
  prompt_entries: int
  entry_rows: int
  row_shards: int
  prompts_per_chunk: int
  max_new_tokens: int
  pad_id: int
  embed_dim: int
  mesh: jax.sharding.Mesh | None = None

  def put(self, host):
    """Host inputs of a program (numpy arrays, the key), put explicitly where it reads them
    (replicated over the mesh): the tests run the step paths under
    `jax_transfer_guard='disallow'`, so an implicit transfer in the decode loop fails a test
    instead of costing a TPU run. Over several processes they are passed as they are (jit
    takes a host value as the same global value on every process; `device_put` to a
    sharding with other processes' devices would all-gather each value to compare it)."""
    if self.mesh is None:
      return jax.device_put(host)
    if self.mesh.devices.size != len(self.mesh.local_devices):
      return host
    return jax.device_put(host, NamedSharding(self.mesh, PartitionSpec()))


def check_context_length(
  config: ModelConfig, prompt_buckets: Sequence[int], max_new_tokens: int
) -> None:
  """Raises unless the longest padded prompt plus the response budget fits the model.

  A row holds at most max(prompt_buckets) prompt tokens then `max_new_tokens` response
  tokens (its KV cache has that many columns); past `config.max_position_embeddings` the
  model runs on positions it was never trained for, silently.

  Args:
    config: the architecture (its `max_position_embeddings`).
    prompt_buckets: padded prompt lengths (tokens).
    max_new_tokens: response budget (tokens).

  Raises:
    ValueError: the sum exceeds `max_position_embeddings`; the message names the fields.
  """
  longest = max(prompt_buckets, default=0)
  total = longest + max_new_tokens
  limit = config.max_position_embeddings
  if total > limit:
    raise ValueError(
      f"prompt_buckets (largest {longest}) + max_new_tokens "
      f"({max_new_tokens}) = {total} tokens exceed the model's max_position_embeddings "
      f"({limit}); lower them so that their sum is at most {limit}"
    )


def bucket_length(length: int, buckets: Sequence[int]) -> int:
  """Smallest bucket >= length. Raises ValueError if the prompt is longer than all."""
  for b in sorted(buckets):
    if length <= b:
      return b
  raise ValueError(
    f"prompt of {length} tokens exceeds the largest prompt bucket "
    f"({max(buckets)}); raise sampler.prompt_buckets or drop long prompts"
  )


def prompts_per_chunk(
  spec: SamplerSpec, rows_per_prompt: int, mesh: jax.sharding.Mesh | None = None
) -> int:
  """P, distinct prompts per launch of a sampler group: `spec.prompts_per_chunk`, or when
  that is 0, C // `rows_per_prompt` (at least 1: a chunk of C rows then fills before it
  runs out of prompt slots; GRPO n = 4 with C = 256: 64), rounded up to a multiple of the
  mesh's row axes ('data' x 'fsdp') and at most C. The one derivation of the training
  sampler (rows per prompt: `RunConfig.min_rows_per_prompt`), the evaluation's (k, or 1
  for greedy) and the prompt selection's."""
  if spec.prompts_per_chunk:
    return spec.prompts_per_chunk
  ppc = max(1, spec.chunk_rows // rows_per_prompt)
  if mesh is None:
    return ppc
  dp = mesh.shape["data"] * mesh.shape["fsdp"]
  return min(-(-ppc // dp) * dp, spec.chunk_rows)


class Sampler:
  """The rollout engine: a slot pool fed from a queue, with prompt-shared prefill.

  Args:
    config: model architecture.
    rule: the sampling rule (None: temperature 1, no truncation).
    max_new_tokens: response budget Lr (tokens).
    stop_ids: tokens that end a response (e.g. Llama 3 Instruct's <|eot_id|>, <|end_of_text|>).
    chunk_rows: S, slots decoding at once.
    prompts_per_chunk: prompts prefilled per S rows; the prompt cache holds
      `prompts_per_chunk × (queue_rows + 2 chunk_rows) / chunk_rows` of them (P): the
      prompts of the queued rows and of the live ones.
    prompt_buckets: allowed padded prompt lengths (tokens); one compile per bucket used.
    pad_id: token id used for left padding.
    mesh: optional mesh; slots are sharded over ('data', 'fsdp'), so S must divide evenly.
    segment_steps: decode steps per device call before the host may add or cancel rows;
      0 = the budget Lr.
    queue_rows: Q, rows queued per device call; 0 = 4 S.
    attention_block: decode attention reads the response columns in blocks of this size,
      up to the longest live row; 0 = a sixteenth of the budget (at least 16).
    entry_rows: R, the most rows of one prompt decoding at once: decode attention reads a
      prompt's keys and values once per step for its R rows, and a prompt's rows beyond R
      wait for one of them to end (the caller's most rows per prompt in flight:
      `RunConfig.max_rows_per_prompt`, the evaluation's k); 0 = the rows per prompt of a
      chunk, ceil(S / prompts_per_chunk).

  Raises:
    ValueError: a bad size (naming it), `rule.top_k` above the vocabulary, or the largest
      prompt bucket plus `max_new_tokens` beyond the model's positions.

  Attributes:
    compiles: number of times the pool functions were traced (one set per prompt bucket).
    copies: rollout copies made (`rollout_params`): one per RL step, evaluation or prompt
      selection when the parameters are stored in another dtype than the compute dtype.
  """

  def __init__(
    self,
    config: ModelConfig,
    *,
    rule: SamplingRule | None = None,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    chunk_rows: int = 64,
    prompts_per_chunk: int = 8,
    prompt_buckets: Sequence[int] = (64, 128, 256, 512, 1024),
    pad_id: int = 0,
    mesh: jax.sharding.Mesh | None = None,
    segment_steps: int = 0,
    queue_rows: int = 0,
    attention_block: int = 0,
    entry_rows: int = 0,
  ):
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    rule = rule or SamplingRule()
    rule.check_vocab(config.vocab_size)
    check_context_length(config, prompt_buckets, max_new_tokens)
    if not 1 <= prompts_per_chunk <= chunk_rows:
      raise ValueError(
        f"prompts_per_chunk ({prompts_per_chunk}) must be in [1, chunk_rows={chunk_rows}]"
      )
    for name, value in (
      ("segment_steps", segment_steps),
      ("queue_rows", queue_rows),
      ("attention_block", attention_block),
      ("entry_rows", entry_rows),
    ):
      if value < 0:
        raise ValueError(f"{name} must be >= 0 (0 = derived), got {value}")
    if mesh is not None:
      rows_axes = mesh.shape["data"] * mesh.shape["fsdp"]
      if chunk_rows % rows_axes:
        raise ValueError(
          f"chunk_rows ({chunk_rows}) must be a multiple of the mesh's data×fsdp size ({rows_axes})"
        )
    self.config, self.rule, self.max_new_tokens = config, rule, max_new_tokens
    self.stop_ids = tuple(int(t) for t in stop_ids)
    self.slots = self.chunk_rows = chunk_rows
    self.queue_rows = queue_rows or 4 * chunk_rows
    self.entry_rows = min(entry_rows or -(-chunk_rows // prompts_per_chunk), chunk_rows)
    # An entry lives until its last row ends (the rows read it every step): the queued
    # rows' prompts and the live rows', whose rows of a prompt end one by one (twice a
    # chunk's prompts: a lognormal schedule then decodes the steps it did with the prompt
    # copied into the slot at refill, experiments/bench_rollout.py).
    rows = self.queue_rows + 2 * chunk_rows
    self.prompt_entries = -(-prompts_per_chunk * rows // chunk_rows)
    self.prompts_per_chunk = prompts_per_chunk
    self.segment_steps = segment_steps or max_new_tokens
    self.attention_block = attention_block
    self.prompt_buckets, self.pad_id, self.mesh = tuple(prompt_buckets), pad_id, mesh
    self.compiles = self.copies = 0
    self._fns: dict[int, SlotPrograms] = {}
    self._cast = None

  @classmethod
  def from_spec(
    cls,
    config: ModelConfig,
    spec: SamplerSpec,
    *,
    stop_ids: Sequence[int],
    rows_per_prompt: int,
    max_rows_per_prompt: int = 0,
    pad_id: int = 0,
    mesh: jax.sharding.Mesh | None = None,
    rule: SamplingRule | None = None,
  ) -> Sampler:
    """The sampler of a sampler group (`config.sampler`, `config.eval.sampler`): its rule
    (or `rule`, e.g. greedy), budget, slots, buckets and pool sizes; its prompts per
    chunk from `prompts_per_chunk(spec, rows_per_prompt, mesh)` (the fewest rows a prompt
    is issued at once); its `entry_rows` from `max_rows_per_prompt` (the most in flight;
    0: `rows_per_prompt`). Raises ValueError as `Sampler`."""
    return cls(
      config,
      rule=rule or spec.rule,
      max_new_tokens=spec.max_new_tokens,
      stop_ids=stop_ids,
      chunk_rows=spec.chunk_rows,
      prompts_per_chunk=prompts_per_chunk(spec, rows_per_prompt, mesh),
      prompt_buckets=spec.prompt_buckets,
      pad_id=pad_id,
      mesh=mesh,
      segment_steps=spec.segment_steps,
      queue_rows=spec.queue_rows,
      attention_block=spec.attention_block,
      entry_rows=max_rows_per_prompt or rows_per_prompt,
    )

  def _block(self) -> int:
    return self.attention_block or max(16, -(-self.max_new_tokens // 16))

  def programs(self, prompt_len: int) -> SlotPrograms:
    """The jitted pool functions for prompts padded to `prompt_len` (built once per
    bucket; each compiles on its first call, or when lowered ahead of time: `plan.programs`)."""
    if prompt_len in self._fns:
      return self._fns[prompt_len]
    cfg, mesh = self.config, self.mesh

    def counted(fn, name):
      def traced(*args):
        self.compiles += 1  # runs at trace time only
        return fn(*args)

      traced.__name__ = name  # XLA's module name: jit_<name>
      return traced

    init = jax.jit(
      counted(
        lambda: pool_lib.init_pool(
          cfg,
          slots=self.slots,
          outputs=self.slots + self.queue_rows,
          max_new_tokens=self.max_new_tokens,
          prompt_len=prompt_len,
          mesh=mesh,
        ),
        "init_pool",
      )
    )
    empty = jax.jit(
      counted(
        lambda: slots_lib.empty_prompt_cache(cfg, self.prompt_entries, prompt_len, mesh),
        "empty_prompt_cache",
      )
    )
    prefill = jax.jit(
      counted(lambda *a: pool_lib.prefill_prompts(cfg, *a, mesh=mesh), "prefill_prompts"),
      donate_argnums=(1,),
    )
    run = jax.jit(
      counted(
        lambda params, state, prompts, queue, key: pool_lib.run_segment(
          cfg,
          params,
          state,
          prompts,
          queue,
          key,
          rule=self.rule,
          stop_ids=self.stop_ids,
          segment_steps=self.segment_steps,
          attention_block=self._block(),
          entry_rows=self.entry_rows,
          mesh=mesh,
        ),
        "run_segment",
      ),
      donate_argnums=(1,),
    )
    self._fns[prompt_len] = SlotPrograms(
      init,
      empty,
      prefill,
      run,
      prompt_len=prompt_len,
      slots=self.slots,
      queue_rows=self.queue_rows,
      prompt_entries=self.prompt_entries,
      entry_rows=self.entry_rows,
      row_shards=attention_lib.row_shards(cfg, mesh, self.slots, self.prompt_entries),
      prompts_per_chunk=self.prompts_per_chunk,
      max_new_tokens=self.max_new_tokens,
      pad_id=self.pad_id,
      embed_dim=cfg.embed_dim,
      mesh=mesh,
    )
    return self._fns[prompt_len]

  def rollout_params(self, params: Params) -> Params:
    """The weights the pool decodes from: `params` fused (`decoder.fuse`: q, k, v and
    gate, up each one array, as their matmuls read them on the mesh's platform), cast to
    the compute dtype (`ModelConfig.dtype`) and laid out for decoding
    (`sharding.rollout_param_shardings`: whole along 'fsdp', split over 'tensor');
    `params` themselves when they already are all three (a copy made before).

    The decode loop reads every weight at every step, so it must read this copy, never
    cast, stack or gather the float32 masters inside the loop. A caller makes the copy
    once per RL step (`ada_jax.step.rl_step`; `SlotEngine.finish` frees it with the pool
    before the update), evaluation or prompt selection and passes it to every `pool` /
    `generate` call; `pool` makes one itself when given the masters.

    Args:
      params: the parameter tree (`param_dtype` leaves, placed on the mesh's
        `sharding.param_shardings` when the sampler has a mesh).

    Returns:
      The fused tree in `config.compute_dtype`, new buffers (counted in `copies`) unless
      `params` already was that copy.
    """
    dtype = self.config.compute_dtype
    c = self.config
    layout = layers_lib.made_layout(
      sharding_lib.platform(self.mesh).fused_layout, c.embed_dim, c.head_dim
    )
    shardings = None
    if self.mesh is not None:
      shardings = sharding_lib.rollout_param_shardings(self.config, self.mesh)
    if model_lib.fused_layout(params) == layout:
      leaves = jax.tree.leaves(params)
      laid_out = shardings is None or all(
        isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sh, x.ndim)
        for x, sh in zip(leaves, jax.tree.leaves(shardings), strict=True)
      )
      if laid_out and all(leaf.dtype == dtype for leaf in leaves):
        return params
    if self._cast is None:
      cast = lambda p: jax.tree.map(lambda x: x.astype(dtype), p)
      self._cast = jax.jit(lambda p: model_lib.fuse(cast(p), layout), out_shardings=shardings)
    self.copies += 1
    return self._cast(params)

  def pool(self, params: Params, key: jax.Array, prompt_len: int) -> SlotDriver:
    """An empty `SlotDriver` for prompts padded to `prompt_len` (a prompt bucket),
    decoding from `rollout_params(params)`."""
    if prompt_len not in self.prompt_buckets:
      raise ValueError(
        f"prompt_len ({prompt_len}) is not one of prompt_buckets {self.prompt_buckets}"
      )
    programs = self.programs(prompt_len)
    return SlotDriver(programs, self.rollout_params(params), programs.put(key))

  def generate(
    self,
    params: Params,
    prompts: Sequence[Sequence[int]],
    row_prompt: Sequence[int] | np.ndarray,
    rng: jax.Array,
  ) -> tuple[dict[str, np.ndarray], SampleStats]:
    """Samples one response per row.

    Args:
      params: model parameters (placed as the caller wants; e.g. sharded): best the
        `rollout_params` copy, else one is made for this call.
      prompts: token ids of each distinct prompt (unpadded lists).
      row_prompt: `int[R]` prompt index of each requested row; repeat an index for several
        responses to the same prompt (they share one prefill while the prompt is cached).
      rng: PRNG key for this call; row i's tokens are drawn from `fold_in(fold_in(rng, i),
        token index)` (`pool.row_uniforms`).

    Returns:
      (arrays, stats): numpy `tokens int32[R, Lr]`, `logprobs float32[R, Lr]`,
      `mask bool[R, Lr]`, `lengths int32[R]` in the order of `row_prompt`; and `SampleStats`.

    Raises:
      ValueError: an empty prompt, a prompt index out of range, or a prompt longer than the
        largest bucket.
    """
    start = time.perf_counter()
    row_prompt = np.asarray(row_prompt, np.int64).reshape(-1)
    if row_prompt.size and (row_prompt.min() < 0 or row_prompt.max() >= len(prompts)):
      raise ValueError(f"row_prompt holds indices outside [0, {len(prompts)})")
    for i, p in enumerate(prompts):
      if len(p) == 0:
        raise ValueError(f"prompt {i} is empty")
    r, lr = len(row_prompt), self.max_new_tokens
    stats = SampleStats(rows_useful=r)
    if r == 0:
      return response_arrays([], 0, lr), stats
    lp = bucket_length(max(len(prompts[p]) for p in set(row_prompt.tolist())), self.prompt_buckets)
    pool = self.pool(params, rng, lp)
    finished = pool.drain(prompts, row_prompt, collections.deque(range(r)), {})
    out = response_arrays(finished, r, lr)
    c = pool.take_counters()
    stats.slot_steps, stats.rows_computed = c["slot_steps"], c["rows_computed"]
    stats.kv_read, stats.kv_useful = c["kv_read"], c["kv_useful"]
    stats.chunks = pool.segments
    stats.tokens = int(out["lengths"].sum())
    stats.wall_s = time.perf_counter() - start
    return out, stats
