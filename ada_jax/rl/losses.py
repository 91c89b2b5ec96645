"""Token-level clipped policy-gradient loss (docs/design.md "Algorithm" "Loss"), as pure functions.

The objective is the one of the authors' released code (a verl fork), i.e. PPO's clipped
surrogate applied per token with DAPO's asymmetric "clip-higher" range and verl's dual
clip:

  r_t = exp(clamp(log π(y_t) − log π_old(y_t), −20, 20))
  ℓ_t = max(−A·r_t, −A·clip(r_t, 1 − ε_low, 1 + ε_high))        (PPO, Schulman et al. 2017)
  ℓ_t = min(ℓ_t, −A·c)   only where A < 0                         (dual clip, Ye et al. 2020)

with ε_low = 0.2, ε_high = 0.28 (DAPO, Yu et al. 2025) and c = 10. A is the sequence's
advantage broadcast over its response tokens (Reinforce-Ada §3: r_i − p̄ with the pool
mean p̄). Per-token values are aggregated by a mode chosen by name (`AGGREGATIONS`):

* ``token-mean`` (default): Σ_t ℓ_t / (number of valid tokens in the GLOBAL mini-batch).
  The normaliser is passed in, so every micro-batch of a mini-batch, on every device,
  divides by the same total (DAPO's token-level loss; verl's `token-mean`).
* ``seq-mean-token-mean``: mean over sequences of each sequence's token mean (GRPO paper).
* ``seq-mean-token-sum``: mean over sequences of each sequence's token sum (Dr. GRPO-like).

Optional terms: an entropy bonus −β_H·H and a k3 KL penalty β_KL·(e^{ref−logp} − (ref −
logp) − 1) to a frozen reference policy (Schulman's "k3" estimator, as verl's
`low_var_kl`, clamped to ±10), both aggregated the same way as the policy term.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ada_jax import bounds
from ada_jax.models import decoder as model_lib
from ada_jax.models.decoder import ModelConfig, Params


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Hyper-parameters of `policy_loss` (defaults: docs/design.md "Algorithm", the released code).

  Attributes:
    clip_low: ε_low, the ratio's lower clip is 1 − clip_low.
    clip_high: ε_high, the ratio's upper clip is 1 + clip_high (DAPO clip-higher).
    dual_clip: c, caps the loss of negative-advantage tokens at −A·c; None disables it.
    log_ratio_clamp: |log π − log π_old| is clamped to this before exp (numerical guard).
    aggregation: a key of `AGGREGATIONS`.
    entropy_coeff: β_H, weight of the entropy bonus (subtracted from the loss).
    kl_coeff: β_KL, weight of the k3 KL to the reference policy; 0 disables it.
  """

  clip_low: float = bounds.within("[0, 1)", 0.2)
  clip_high: float = bounds.within("[0, 100]", 0.28)
  dual_clip: float | None = bounds.within("(1, 1e6]", 10.0)
  log_ratio_clamp: float = bounds.within("(0, 100]", 20.0)
  aggregation: str = "token-mean"
  entropy_coeff: float = bounds.within("[-100, 100]", 0.0)
  kl_coeff: float = bounds.within("[0, 1e6]", 0.0)

  def __post_init__(self):
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(
        f"LossConfig.aggregation: {self.aggregation!r} is not one of {sorted(AGGREGATIONS)}"
      )
    if not 0 <= self.clip_low < 1:
      raise ValueError(f"LossConfig.clip_low must be in [0, 1), got {self.clip_low}")
    if self.clip_high < 0:
      raise ValueError(f"LossConfig.clip_high must be >= 0, got {self.clip_high}")
    if self.dual_clip is not None and self.dual_clip <= 1:
      raise ValueError(f"LossConfig.dual_clip must be > 1 or None, got {self.dual_clip}")
    if self.log_ratio_clamp <= 0:
      raise ValueError(f"LossConfig.log_ratio_clamp must be > 0, got {self.log_ratio_clamp}")
    if self.kl_coeff < 0:
      raise ValueError(f"LossConfig.kl_coeff must be >= 0, got {self.kl_coeff}")


class Aggregation(NamedTuple):
  """A loss aggregation mode, split so that micro-batches and devices can share a total.

  A sequence is a row's tokens with one segment id (`segments`: a row holds one sequence,
  or several packed ones, `rl.packing`), so a packed batch aggregates exactly as the
  padded one.

  Attributes:
    total: (values f32[B, T], mask bool[B, T], segments int32[B, T]) -> f32[] numerator,
      additive over rows.
    count: (mask bool[B, T], segments int32[B, T]) -> f32[] normaliser, additive over
      rows; computed once over the whole mini-batch and passed to `policy_loss`.
  """

  total: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
  count: Callable[[jax.Array, jax.Array], jax.Array]


def _per_sequence(x: jax.Array, segments: jax.Array) -> jax.Array:
  """`[B, T]` -> `[B, T + 1]`: x summed over each segment id of each row."""
  t = x.shape[1]
  segsum = lambda xi, si: jax.ops.segment_sum(xi, si, num_segments=t + 1)
  return jax.vmap(segsum)(x, segments.astype(jnp.int32))


def _token_sum(values, mask, segments=None):
  return jnp.sum(jnp.where(mask, values, 0.0))


def _seq_token_mean_sum(values, mask, segments):
  per_seq = _per_sequence(jnp.where(mask, values, 0.0), segments)
  counts = _per_sequence(mask.astype(jnp.float32), segments)
  return jnp.sum(per_seq / jnp.maximum(counts, 1.0))


def _tokens(mask, segments=None):
  return jnp.sum(mask, dtype=jnp.float32)


def _sequences(mask, segments):
  # Sequences without a single response token (batch padding) are not of the batch.
  counts = _per_sequence(mask.astype(jnp.float32), segments)
  return jnp.sum(counts > 0, dtype=jnp.float32)


AGGREGATIONS: dict[str, Aggregation] = {
  "token-mean": Aggregation(total=_token_sum, count=_tokens),
  "seq-mean-token-mean": Aggregation(total=_seq_token_mean_sum, count=_sequences),
  "seq-mean-token-sum": Aggregation(total=_token_sum, count=_sequences),
}


def loss_normalizer(
  loss_mask: jax.Array, aggregation: str, segments: jax.Array | None = None
) -> jax.Array:
  """The denominator of `aggregation` over a whole mini-batch: `f32[]`, at least 1.

  Under jit on a sharded `loss_mask` the sum is global (over all devices), which is what
  makes `token-mean` a mean over the global mini-batch.

  Args:
    loss_mask: `bool[B, T]`, True at response tokens of the whole mini-batch.
    aggregation: a key of `AGGREGATIONS`.
    segments: `int32[B, T]` sequence ids, as `token_logprobs` takes them; None: one
      sequence a row.
  """
  segments = loss_mask if segments is None else segments
  return jnp.maximum(AGGREGATIONS[aggregation].count(loss_mask, segments), 1.0)


def token_logprobs(
  config: ModelConfig,
  params: Params,
  tokens: jax.Array,
  positions: jax.Array,
  segments: jax.Array,
  *,
  temperature: float = 1.0,
  remat: bool = False,
  block_size: int = 256,
  self_attend=None,
) -> tuple[jax.Array, jax.Array]:
  """Log-probabilities and entropies of each token given its prefix, under softmax(z / T),
  computed block by block over the sequence so that the `[B, T, V]` logits never exist
  whole.

  The PPO ratio compares these with the sampler's recorded log-probs, which are those of
  the tempered full-vocabulary distribution softmax(z / T) (before top-k / top-p, see
  `sampler.SamplingRule`); recomputing them at the sampler's T is what makes the ratio 1
  for unchanged weights (verl and OpenRLHF divide the logits by the rollout temperature
  the same way). The entropy is that of the same tempered distribution.

  Memory: the logits of `block_size` positions at a time are made from the hidden states,
  reduced to (log-prob of the next token, entropy) and dropped; the backward pass
  recomputes each block's logits (`jax.checkpoint`) instead of keeping them. At the
  paper's shapes (3,072 tokens, a 128,256-token vocabulary) one row's float32 logits take
  1.5 GiB, and the unblocked log-softmax with its backward kept several such copies live.

  Args:
    config: the architecture (static under jit).
    params: the policy parameters.
    tokens: `int32[B, T]` prompt + response, left-padded, or several such sequences
      packed in a row (`rl.packing`).
    positions: `int32[B, T]` RoPE positions (from 0 in each packed sequence).
    segments: `bool[B, T]`, True at real tokens, or `int32[B, T]` the packed sequences'
      ids (0 at padding): a token sees only its own sequence.
    temperature: T > 0 dividing the logits (static); the sampling rule's
      `logprob_temperature`.
    remat: rematerialise each block in the backward pass.
    block_size: positions per logits block (static; memory `B × block_size × V` float32).
    self_attend: the rows' causal attention where it is a kernel's (`flash.self_attend`);
      None for XLA's form (`layers.causal_attend`).

  Returns:
    (logprobs `float32[B, T]`, entropy `float32[B, T]`) where `logprobs[:, t]` is
    log p(tokens[:, t] | tokens[:, <t]) and `entropy[:, t]` the entropy (nats) of that
    next-token distribution; both are 0 at t = 0, which has no prefix. The same alignment
    as the sampler's returned log-probs (the PPO "old" log-probs).

  Raises:
    ValueError: `temperature` <= 0 or `block_size` < 1.
  """
  if not temperature > 0:
    raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
  if block_size < 1:
    raise ValueError(f"token_logprobs: block_size must be >= 1, got {block_size}")
  hidden, table = model_lib.hidden_states(
    config, params, tokens, positions, segments, remat=remat, self_attend=self_attend
  )
  picked, entropy = _blockwise_logprobs(
    config, hidden[:, :-1], table, tokens[:, 1:], temperature, block_size
  )
  pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
  return pad(picked), pad(entropy)


def _blockwise_logprobs(config, hidden, table, targets, temperature, block_size):
  """hidden `[B, T, D]`, table `[V, D]`, targets `int32[B, T]` -> (log p(target), entropy)
  under softmax(logits / temperature), each `float32[B, T]`, from `block_size` positions of
  logits at a time."""
  b, t, d = hidden.shape
  size = min(block_size, t)
  blocks = -(-t // size)
  extra = blocks * size - t  # padded positions: computed, then cut off

  def split(x):
    x = jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(b, blocks, size, *x.shape[2:]).swapaxes(0, 1)

  @jax.checkpoint
  def one_block(h, target):
    z = model_lib.unembed(config, table, h)  # [B, size, V] float32
    if temperature != 1.0:
      z = z / temperature
    logp = jax.nn.log_softmax(z, axis=-1)
    picked = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    return picked, -jnp.sum(jnp.exp(logp) * logp, axis=-1)

  picked, entropy = jax.lax.map(lambda hb: one_block(*hb), (split(hidden), split(targets)))
  merge = lambda x: x.swapaxes(0, 1).reshape(b, blocks * size)[:, :t]
  return merge(picked), merge(entropy)


def per_token_pg_loss(
  logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array, config: LossConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The clipped surrogate per token, before masking and aggregation.

  Args:
    logprobs, old_logprobs: `float32[B, T]` under the current and the sampling policy.
    advantages: `float32[B]`, one per row (broadcast over its tokens), or `float32[B, T]`
      per token (each packed sequence's own over its tokens).
    config: clip ranges.

  Returns:
    (loss `f32[B, T]`, clipped `bool[B, T]` where the ratio clip was active (PPO's
    clip fraction, verl's `pg_clipfrac`), dual_clipped `bool[B, T]` where the dual clip
    was active (verl's `pg_clipfrac_lower`)).
  """
  adv = jnp.asarray(advantages, jnp.float32)
  adv = adv[:, None] if adv.ndim == 1 else adv
  bound = config.log_ratio_clamp
  log_ratio = jnp.clip(logprobs - old_logprobs, -bound, bound)
  ratio = jnp.exp(log_ratio)
  unclipped = -adv * ratio
  clipped_loss = -adv * jnp.clip(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
  loss = jnp.maximum(unclipped, clipped_loss)
  clipped = clipped_loss > unclipped
  if config.dual_clip is None:
    return loss, clipped, jnp.zeros_like(clipped)
  cap = -adv * config.dual_clip
  negative = jnp.broadcast_to(adv < 0, loss.shape)
  dual_clipped = negative & (loss > cap)
  return jnp.where(negative, jnp.minimum(loss, cap), loss), clipped, dual_clipped


def k3_kl(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
  """k3 estimate of KL(π ‖ π_ref) per token, `f32[B, T]`, clamped to [−10, 10].

  k3 = e^{ref − logp} − (ref − logp) − 1 ≥ 0, unbiased with low variance (Schulman,
  "Approximating KL divergence", 2020; verl `low_var_kl`).
  """
  d = jnp.clip(ref_logprobs - logprobs, -20.0, 20.0)
  return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)


def policy_loss(
  logprobs: jax.Array,
  old_logprobs: jax.Array,
  advantages: jax.Array,
  loss_mask: jax.Array,
  *,
  config: LossConfig,
  normalizer: jax.Array | float,
  segments: jax.Array | None = None,
  entropy: jax.Array | None = None,
  ref_logprobs: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """This (micro-)batch's share of the mini-batch loss, and metric sums.

  The loss of a mini-batch is the sum of `policy_loss` over its micro-batches when each
  is given the same `normalizer = loss_normalizer(mini_batch_mask, config.aggregation,
  mini_batch_segments)`.

  Args:
    logprobs: `float32[B, T]` from `token_logprobs` under the current params.
    old_logprobs: `float32[B, T]` from the sampler (same alignment).
    advantages: `float32[B]` sequence advantages, or `float32[B, T]` per token.
    loss_mask: `bool[B, T]`, True at response tokens that carry the loss.
    config: the loss hyper-parameters.
    normalizer: the aggregation's denominator over the whole mini-batch (`f32[]`).
    segments: `int32[B, T]` sequence ids (`token_logprobs`'); None: one sequence a row.
    entropy: `float32[B, T]` per-token entropy; needed when `config.entropy_coeff` > 0,
      else only reported.
    ref_logprobs: `float32[B, T]` under the reference policy; needed when
      `config.kl_coeff` > 0.

  Returns:
    (loss `f32[]`, sums) where sums are token sums over valid tokens, to be divided by
    the mini-batch's token count: 'tokens', 'pg_loss' (unnormalised surrogate sum),
    'clipped', 'dual_clipped', 'approx_kl' (log π_old − log π, verl's `ppo_kl`),
    'abs_log_ratio' (|log π − log π_old|: before the first update, the sampler–trainer
    mismatch), and
    'entropy' / 'kl' when given.

  Raises:
    ValueError: a coefficient is > 0 but its input is missing.
  """
  agg = AGGREGATIONS[config.aggregation]
  mask = loss_mask.astype(bool)
  segments = mask if segments is None else segments
  pg, clipped, dual = per_token_pg_loss(logprobs, old_logprobs, advantages, config)
  total = agg.total(pg, mask, segments)
  sums = {
    "tokens": jnp.sum(mask, dtype=jnp.float32),
    "pg_loss": _token_sum(pg, mask),
    "clipped": _token_sum(clipped.astype(jnp.float32), mask),
    "dual_clipped": _token_sum(dual.astype(jnp.float32), mask),
    "approx_kl": _token_sum(old_logprobs - logprobs, mask),
    "abs_log_ratio": _token_sum(jnp.abs(logprobs - old_logprobs), mask),
  }
  if entropy is not None:
    sums["entropy"] = _token_sum(entropy, mask)
  if config.entropy_coeff:
    if entropy is None:
      raise ValueError("LossConfig.entropy_coeff > 0 needs the per-token entropy")
    total = total - config.entropy_coeff * agg.total(entropy, mask, segments)
  if config.kl_coeff:
    if ref_logprobs is None:
      raise ValueError("LossConfig.kl_coeff > 0 needs reference log-probs")
    kl = k3_kl(logprobs, ref_logprobs)
    sums["kl"] = _token_sum(kl, mask)
    total = total + config.kl_coeff * agg.total(kl, mask, segments)
  return total / normalizer, sums


def finalize_sums(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Token means from `policy_loss` sums: clip_frac, dual_clip_frac, approx_kl, entropy,
  kl (when present), plus the token count."""
  n = jnp.maximum(sums["tokens"], 1.0)
  names = {
    "clipped": "clip_frac",
    "dual_clipped": "dual_clip_frac",
    "approx_kl": "approx_kl",
    "abs_log_ratio": "abs_log_ratio",
    "entropy": "entropy",
    "kl": "kl",
    "pg_loss": "pg_loss_token_mean",
  }
  out = {new: sums[old] / n for old, new in names.items() if old in sums}
  out["tokens"] = sums["tokens"]
  return out
