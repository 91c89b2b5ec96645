"""How the next token is drawn from the logits: temperature, top-k, top-p (`SamplingRule`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
