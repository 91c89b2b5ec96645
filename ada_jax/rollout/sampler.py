"""Rollout engine: a jit-compiled chunk decoder with static shapes and masked rows.

`generate` is the pure chunk function: it prefills P prompts once, gathers each of the C
rows' cache from its prompt (rows of one prompt share one prefill), then decodes in a
`lax.while_loop` over a preallocated KV cache until every row has emitted a stop token or
the token budget is spent. Rows with `row_mask=False` are done from step 0: they never
hold the loop open and their outputs are zero/masked. That is how the adaptive controller
retires prompts without changing shapes (docs/design.md "Sampler").

`Sampler` is the host-side driver: it packs any number of rows into chunks of C (at most
P distinct prompts each), left-pads prompts to a fixed bucket length, launches only chunks
that hold real rows and reports rows computed vs useful. Prompt-length buckets and the
static chunk sizes bound the number of compiles; the row mask, the active set and the RNG
are traced values and never recompile.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding

from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding as sharding_lib
from ada_jax.models.decoder import KVCache, ModelConfig, Params
from ada_jax.models.tokenizer import pad_left


@dataclasses.dataclass(frozen=True)
class SamplingRule:
  """How the next token is drawn from the logits (static under jit).

  Temperature is applied first, then top-k, then top-p (nucleus) on the tempered
  distribution, the order of Hugging Face `generate` and vLLM.

  What the PPO ratio means: the recorded log-prob of a drawn token is log softmax(z / T)
  over the FULL vocabulary, the tempered distribution before top-k / top-p truncation
  (as verl and OpenRLHF record and recompute it). `losses.token_logprobs` with
  `temperature=rule.logprob_temperature` recomputes exactly that quantity on the training
  path, so with unchanged weights the ratio is 1. Top-k / top-p only choose which tokens
  can be drawn; they do not renormalise the log-prob.

  Attributes:
    temperature: > 0 divides the logits; 0 means greedy (argmax).
    top_k: keep the k most likely tokens; 0 keeps all. Must not exceed the vocabulary
      (`Sampler` checks it against the model).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1 keeps all.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"SamplingRule.temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"SamplingRule.top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingRule.top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def logprob_temperature(self) -> float:
    """T of the recorded log-probs, log softmax(z / T): the temperature, or 1 when greedy.
    The trainer must recompute log-probs and entropy at this T (`TrainConfig.temperature`)."""
    return 1.0 if self.greedy else float(self.temperature)

  def check_vocab(self, vocab_size: int) -> None:
    """Raises ValueError naming `top_k` when it exceeds `vocab_size` (tokens)."""
    if self.top_k > vocab_size:
      raise ValueError(
        f"SamplingRule.top_k ({self.top_k}) exceeds the model's vocabulary "
        f"({vocab_size} tokens); use top_k <= {vocab_size}, or 0 to keep all"
      )

  def tempered(self, logits: jax.Array) -> jax.Array:
    """`float32[C, V]` logits divided by the temperature (unchanged when greedy)."""
    return logits if self.greedy else logits / self.temperature

  def truncated(self, logits: jax.Array) -> jax.Array:
    """Tempered logits with the tokens outside top-k / top-p set to -inf, `float32[C, V]`."""
    logits = self.tempered(logits)
    if self.top_k:
      kth = jax.lax.top_k(logits, self.top_k)[0][:, -1:]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    if self.top_p < 1.0:
      order = jnp.argsort(-logits, axis=-1)
      sorted_probs = jnp.take_along_axis(jax.nn.softmax(logits, -1), order, -1)
      # Keep a token when the mass strictly before it is below top_p (the top token always).
      keep_sorted = jnp.cumsum(sorted_probs, -1) - sorted_probs < self.top_p
      keep = (
        jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
      )
      logits = jnp.where(keep, logits, -jnp.inf)
    return logits

  def draw(self, logits: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row from given uniform numbers (the pure part of `sample`).

    Inverse-CDF sampling: the first token whose cumulative mass reaches u·(total mass)
    AND whose own mass is positive, so a token outside the kept set (top-k, top-p, a -inf
    logit, or a probability that underflows to 0) is never drawn, whatever u is in [0, 1)
    (u = 0 would otherwise select token 0). The last kept token's cumulative mass equals
    the total, so some token always qualifies.

    Args:
      logits: `float32[C, V]` raw next-token logits.
      u: `float32[C]` uniform numbers in [0, 1) (ignored when greedy).

    Returns:
      (tokens `int32[C]`, logprobs `float32[C]`): the log-probability of each drawn token
      under log_softmax(logits / T) over the full vocabulary (see the class docstring;
      T = 1 when greedy).
    """
    logits = logits.astype(jnp.float32)
    tempered = self.tempered(logits)
    if self.greedy:
      tokens = jnp.argmax(logits, -1)
    else:
      probs = jax.nn.softmax(self.truncated(logits), axis=-1)
      cdf = jnp.cumsum(probs, axis=-1)
      target = u.astype(jnp.float32)[:, None] * cdf[:, -1:]
      tokens = jnp.argmax((cdf >= target) & (probs > 0), axis=-1)
    picked = jnp.take_along_axis(tempered, tokens[:, None], -1)[:, 0]
    return tokens.astype(jnp.int32), picked - jax.nn.logsumexp(tempered, axis=-1)

  def sample(self, rng: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row: `draw` with one uniform number per row from `rng`.

    One uniform per row against the cumulative distribution instead of Gumbel noise for
    every vocabulary entry (V random numbers per row per step dominated decode time on CPU
    at V = 128k).

    Args:
      rng: PRNG key (one uniform draw per row).
      logits: `float32[C, V]` raw next-token logits.

    Returns:
      (tokens `int32[C]`, logprobs `float32[C]`), as `draw`.
    """
    return self.draw(logits, jax.random.uniform(rng, (logits.shape[0],)))


@struct.dataclass
class Rollout:
  """Sampled responses of one chunk (or of all rows, from `Sampler.generate`).

  Attributes:
    tokens: `int32[C, Lr]` response tokens, 0 after the stop token and for masked rows.
    logprobs: `float32[C, Lr]` log-probs of the sampled tokens under log_softmax(logits/T)
      over the full vocabulary (`SamplingRule`), 0 where `mask` is False; these are the
      PPO "old" log-probs.
    mask: `bool[C, Lr]` True for generated tokens up to and including the stop token.
    lengths: `int32[C]` number of generated tokens (`mask.sum(-1)`).
  """

  tokens: jax.Array
  logprobs: jax.Array
  mask: jax.Array
  lengths: jax.Array


@struct.dataclass
class _DecodeState:
  """Carry of the decode loop. i: `int32[]` step; logits: `float32[C, V]` next-token logits;
  done: `bool[C]`; positions: `int32[C]` RoPE position of the next token; rng: key; out:
  the `Rollout` buffers being filled; cache: the rows' KV cache."""

  i: jax.Array
  logits: jax.Array
  done: jax.Array
  positions: jax.Array
  rng: jax.Array
  out: Rollout
  cache: KVCache


def _constrain(x, sharding):
  return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def generate(
  config: ModelConfig,
  params: Params,
  prompt_tokens: jax.Array,
  prompt_mask: jax.Array,
  row_prompt: jax.Array,
  row_mask: jax.Array,
  rng: jax.Array,
  *,
  rule: SamplingRule,
  max_new_tokens: int,
  stop_ids: tuple[int, ...],
  mesh: jax.sharding.Mesh | None = None,
) -> Rollout:
  """Generates one chunk of C rows (pure; jit with `rule`, `max_new_tokens`, `stop_ids` and
  `mesh` static).

  Args:
    config: the model architecture.
    params: model parameters.
    prompt_tokens: `int32[P, Lp]` left-padded prompts (P distinct prompts of the chunk).
    prompt_mask: `bool[P, Lp]` True at real prompt tokens.
    row_prompt: `int32[C]` index into P of each row's prompt.
    row_mask: `bool[C]` False for padding rows (done from step 0, outputs zeroed).
    rng: PRNG key; folded with the step index, one categorical draw per row per step.
    rule: the sampling rule.
    max_new_tokens: Lr, the response token budget.
    stop_ids: tokens that end a row (kept in the response, then the row is done).
    mesh: when given, the cache and outputs are sharded by `sharding.kv_cache_shardings` /
      the rule table: rows over ('data', 'fsdp'), kv heads over 'tensor' when they divide.

  Returns:
    A `Rollout` with `[C, Lr]` arrays.
  """
  prompt_tokens, prompt_mask = jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask)
  c, lp = row_prompt.shape[0], prompt_tokens.shape[1]
  positions = model_lib.positions_from_mask(prompt_mask)
  last_logits, cache = model_lib.prefill(
    config, params, prompt_tokens, positions, prompt_mask, cache_len=lp + max_new_tokens
  )
  cache = model_lib.gather_cache_rows(cache, row_prompt)
  if mesh is not None:  # every sharding from the rule table (`sharding.model_rules`)
    shardings = sharding_lib.kv_cache_shardings(config, mesh, c, lp + max_new_tokens)
    cache = cache.replace(
      k=tuple(map(_constrain, cache.k, shardings.k)),
      v=tuple(map(_constrain, cache.v, shardings.v)),
      mask=_constrain(cache.mask, shardings.mask),
    )
  out_sharding = (
    None
    if mesh is None
    else NamedSharding(
      mesh, sharding_lib.logical_to_spec(("batch", "length"), (c, max_new_tokens), mesh)
    )
  )
  stop = jnp.asarray(stop_ids, jnp.int32)
  zeros = lambda dtype: _constrain(jnp.zeros((c, max_new_tokens), dtype), out_sharding)
  state = _DecodeState(
    i=jnp.zeros((), jnp.int32),
    logits=last_logits[row_prompt],
    done=~row_mask,
    positions=prompt_mask.sum(-1).astype(jnp.int32)[row_prompt],
    rng=rng,
    out=Rollout(
      tokens=zeros(jnp.int32),
      logprobs=zeros(jnp.float32),
      mask=zeros(bool),
      lengths=jnp.zeros((c,), jnp.int32),
    ),
    cache=cache,
  )

  def cond(s: _DecodeState):
    return (s.i < max_new_tokens) & ~jnp.all(s.done)

  def body(s: _DecodeState) -> _DecodeState:
    token, logprob = rule.sample(jax.random.fold_in(s.rng, s.i), s.logits)
    live = ~s.done
    token = jnp.where(live, token, 0)
    out = Rollout(
      tokens=s.out.tokens.at[:, s.i].set(token),
      logprobs=s.out.logprobs.at[:, s.i].set(jnp.where(live, logprob, 0.0)),
      mask=s.out.mask.at[:, s.i].set(live),
      lengths=s.out.lengths + live,
    )
    done = s.done | jnp.isin(token, stop)
    # Finished rows still flow through the step (static shapes) but their token is marked
    # as padding, so no live row ever attends to it.
    logits, cache = model_lib.decode(
      config, params, token[:, None], s.positions[:, None], s.cache, attention_mask=live[:, None]
    )
    return _DecodeState(
      i=s.i + 1,
      logits=logits[:, 0],
      done=done,
      positions=s.positions + 1,
      rng=s.rng,
      out=out,
      cache=cache,
    )

  return jax.lax.while_loop(cond, body, state).out


# ----------------------------------------------------------------------------- host driver


@dataclasses.dataclass
class SampleStats:
  """What one `Sampler.generate` call cost. rows_computed: rows launched (chunks × C);
  rows_useful: rows requested; tokens: response tokens generated in useful rows;
  chunks: chunk launches; wall_s: seconds including the host transfer."""

  rows_computed: int = 0
  rows_useful: int = 0
  tokens: int = 0
  chunks: int = 0
  wall_s: float = 0.0


def check_context_length(
  config: ModelConfig, prompt_buckets: Sequence[int], max_new_tokens: int, *, prefix: str = ""
) -> None:
  """Raises unless the longest padded prompt plus the response budget fits the model.

  A row holds at most max(prompt_buckets) prompt tokens then `max_new_tokens` response
  tokens (its KV cache has that many slots); past `config.max_position_embeddings` the
  model runs on positions it was never trained for, silently.

  Args:
    config: the architecture (its `max_position_embeddings`).
    prompt_buckets: padded prompt lengths (tokens).
    max_new_tokens: response budget (tokens).
    prefix: prepended to the field names in the message (e.g. 'config.sampler.').

  Raises:
    ValueError: the sum exceeds `max_position_embeddings`; the message names the fields.
  """
  longest = max(prompt_buckets, default=0)
  total = longest + max_new_tokens
  limit = config.max_position_embeddings
  if total > limit:
    raise ValueError(
      f"{prefix}prompt_buckets (largest {longest}) + {prefix}max_new_tokens "
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


def fit_prompts_per_chunk(
  prompts_per_chunk: int, chunk_rows: int, mesh: jax.sharding.Mesh | None
) -> int:
  """`prompts_per_chunk` rounded up to a multiple of the mesh's row axes ('data' x
  'fsdp', over which a chunk's prompts are split), at most `chunk_rows`; unchanged
  without a mesh."""
  if mesh is None:
    return prompts_per_chunk
  dp = mesh.shape["data"] * mesh.shape["fsdp"]
  return min(-(-prompts_per_chunk // dp) * dp, chunk_rows)


class Sampler:
  """Host driver around the jitted `generate`: packs rows into static chunks.

  Args:
    config: model architecture.
    rule: the sampling rule.
    max_new_tokens: response budget Lr (tokens).
    stop_ids: tokens that end a response (e.g. Llama 3 Instruct's <|eot_id|>, <|end_of_text|>).
    chunk_rows: C, rows per launch.
    prompts_per_chunk: P, distinct prompts per launch (prefills per chunk).
    prompt_buckets: allowed padded prompt lengths (tokens); one compile per bucket used.
    pad_id: token id used for left padding.
    mesh: optional mesh; rows are sharded over ('data', 'fsdp'), so C must divide evenly.

  Raises:
    ValueError: a bad size, `rule.top_k` above the vocabulary, or the largest prompt
      bucket plus `max_new_tokens` beyond the model's positions (`check_context_length`).

  Attributes:
    compiles: number of times `generate` was traced (one per new static shape).
  """

  def __init__(
    self,
    config: ModelConfig,
    *,
    rule: SamplingRule = SamplingRule(),
    max_new_tokens: int,
    stop_ids: Sequence[int],
    chunk_rows: int = 64,
    prompts_per_chunk: int = 8,
    prompt_buckets: Sequence[int] = (64, 128, 256, 512, 1024),
    pad_id: int = 0,
    mesh: jax.sharding.Mesh | None = None,
  ):
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    rule.check_vocab(config.vocab_size)
    check_context_length(config, prompt_buckets, max_new_tokens)
    if not 1 <= prompts_per_chunk <= chunk_rows:
      raise ValueError(
        f"prompts_per_chunk ({prompts_per_chunk}) must be in [1, chunk_rows={chunk_rows}]"
      )
    if mesh is not None:
      rows_axes = mesh.shape["data"] * mesh.shape["fsdp"]
      for name, value in (("chunk_rows", chunk_rows), ("prompts_per_chunk", prompts_per_chunk)):
        if value % rows_axes:
          raise ValueError(
            f"{name} ({value}) must be a multiple of the mesh's data×fsdp size ({rows_axes})"
          )
    self.config, self.rule, self.max_new_tokens = config, rule, max_new_tokens
    self.stop_ids = tuple(int(t) for t in stop_ids)
    self.chunk_rows, self.prompts_per_chunk = chunk_rows, prompts_per_chunk
    self.prompt_buckets, self.pad_id, self.mesh = tuple(prompt_buckets), pad_id, mesh
    self.compiles = 0

    def counted(*args):
      self.compiles += 1  # runs at trace time only
      return generate(
        config, *args, rule=rule, max_new_tokens=max_new_tokens, stop_ids=self.stop_ids, mesh=mesh
      )

    # Replicated outputs: every process of a multi-host run can read the whole chunk (the
    # controller on every host needs every response), at the cost of one small all-gather.
    self._generate = jax.jit(
      counted, out_shardings=None if mesh is None else sharding_lib.replicated(mesh)
    )

  def _pack(self, row_prompt: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Splits rows (in order) into chunks of <= C rows and <= P distinct prompts.
    Returns per chunk (row indices, their prompt ids)."""
    chunks, rows, prompts = [], [], set()
    for r, p in enumerate(row_prompt):
      if len(rows) == self.chunk_rows or (
        p not in prompts and len(prompts) == self.prompts_per_chunk
      ):
        chunks.append(np.asarray(rows))
        rows, prompts = [], set()
      rows.append(r)
      prompts.add(p)
    if rows:
      chunks.append(np.asarray(rows))
    return [(c, row_prompt[c]) for c in chunks]

  def generate(
    self,
    params: Params,
    prompts: Sequence[Sequence[int]],
    row_prompt: Sequence[int] | np.ndarray,
    rng: jax.Array,
  ) -> tuple[dict[str, np.ndarray], SampleStats]:
    """Samples one response per row.

    Args:
      params: model parameters (placed as the caller wants; e.g. sharded).
      prompts: token ids of each distinct prompt (unpadded lists).
      row_prompt: `int[R]` prompt index of each requested row; repeat an index for several
        responses to the same prompt (they share one prefill when they land in one chunk).
      rng: PRNG key for this call; chunk j uses `fold_in(rng, j)`.

    Returns:
      (arrays, stats): numpy `tokens int32[R, Lr]`, `logprobs float32[R, Lr]`,
      `mask bool[R, Lr]`, `lengths int32[R]` in the order of `row_prompt`; and `SampleStats`.

    Raises:
      ValueError: an empty prompt, a prompt index out of range, or a prompt longer than the
        largest bucket.
    """
    start = time.perf_counter()
    row_prompt = np.asarray(row_prompt, np.int64)
    if row_prompt.size and (row_prompt.min() < 0 or row_prompt.max() >= len(prompts)):
      raise ValueError(f"row_prompt holds indices outside [0, {len(prompts)})")
    for i, p in enumerate(prompts):
      if len(p) == 0:
        raise ValueError(f"prompt {i} is empty")
    r, lr = len(row_prompt), self.max_new_tokens
    out = {
      "tokens": np.zeros((r, lr), np.int32),
      "logprobs": np.zeros((r, lr), np.float32),
      "mask": np.zeros((r, lr), bool),
      "lengths": np.zeros((r,), np.int32),
    }
    stats = SampleStats(rows_useful=r)
    pending = []
    for j, (rows, prompt_ids) in enumerate(self._pack(row_prompt)):
      uniq, local = np.unique(prompt_ids, return_inverse=True)
      lp = bucket_length(max(len(prompts[p]) for p in uniq), self.prompt_buckets)
      # Unused prompt slots of the chunk are all padding (empty sequences).
      chunk = [prompts[p] for p in uniq] + [[]] * (self.prompts_per_chunk - len(uniq))
      tokens, mask = pad_left(chunk, self.pad_id, length=lp)
      row_local = np.zeros((self.chunk_rows,), np.int32)
      row_local[: len(rows)] = local
      row_mask = np.arange(self.chunk_rows) < len(rows)
      result = self._generate(
        params, *self._place(tokens, mask, row_local, row_mask), jax.random.fold_in(rng, j)
      )
      pending.append((rows, result))  # launch every chunk before fetching any (async)
      stats.rows_computed += self.chunk_rows
      stats.chunks += 1
    for rows, result in pending:
      n = len(rows)
      for key in out:
        out[key][rows] = np.asarray(getattr(result, key))[:n]
    stats.tokens = int(out["lengths"].sum())
    stats.wall_s = time.perf_counter() - start
    return out, stats

  def _place(self, *arrays: np.ndarray) -> tuple[Any, ...]:
    if self.mesh is None:
      return tuple(jnp.asarray(a) for a in arrays)
    rows = sharding_lib.batch_sharding(self.mesh)
    return tuple(jax.device_put(a, rows) for a in arrays)
