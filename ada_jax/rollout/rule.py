"""How the next token is drawn from the logits: temperature, top-k, top-p (`SamplingRule`)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ada_jax.models.sharding import DATA_AXES


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

  def draw(
    self, logits: jax.Array, u: jax.Array, mesh: jax.sharding.Mesh | None = None
  ) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row from given uniform numbers (the pure part of `sample`).

    Inverse-CDF sampling: the first token whose cumulative mass reaches u·(total mass)
    AND whose own mass is positive, so a token outside the kept set (top-k, top-p, a -inf
    logit, or a probability that underflows to 0) is never drawn, whatever u is in [0, 1)
    (u = 0 would otherwise select token 0). The last kept token's cumulative mass equals
    the total, so some token always qualifies.

    With a `mesh` whose 'tensor' axis splits the vocabulary (no top-k or top-p, which
    rank the whole vocabulary), each device draws from its own slice of the logits and
    only per-row scalars cross devices (`_draw_vocab_sharded`): the gathered `[C, V]`
    float32 logits were the largest temporaries of a 7B's decode loop on GPU.

    Args:
      logits: `float32[C, V]` raw next-token logits.
      u: `float32[C]` uniform numbers in [0, 1) (ignored when greedy).
      mesh: the mesh the logits are on (rows over ('data', 'fsdp'), vocabulary over
        'tensor'), or None.

    Returns:
      (tokens `int32[C]`, logprobs `float32[C]`): the log-probability of each drawn token
      under log_softmax(logits / T) over the full vocabulary (see the class docstring;
      T = 1 when greedy).
    """
    if self.vocab_shards(mesh, logits.shape) > 1:
      return _draw_vocab_sharded(self, logits, u, mesh)
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

  def vocab_shards(self, mesh: jax.sharding.Mesh | None, shape: tuple[int, int]) -> int:
    """How many vocabulary slices `draw` samples from on `mesh` for `[C, V]` logits: the
    'tensor' axis size when it divides V and C splits over the data axes, and neither
    top-k nor top-p ranks the whole vocabulary; else 1 (the logits are drawn whole)."""
    if mesh is None or self.top_k or self.top_p < 1.0:
      return 1
    rows = math.prod(mesh.shape[a] for a in DATA_AXES)
    tensor = mesh.shape["tensor"]
    return tensor if shape[1] % tensor == 0 and shape[0] % rows == 0 else 1

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


def _draw_vocab_sharded(rule: SamplingRule, logits, u, mesh) -> tuple[jax.Array, jax.Array]:
  """`SamplingRule.draw` on logits split over 'tensor' along the vocabulary.

  The same inverse-CDF rule, its cumulative sum in two levels: each device sums its slice's
  masses, the T sums are all-gathered (`[T, C]` floats), and the device whose range of
  the cumulative mass holds the target returns the first such token of its slice (the
  smallest candidate over 'tensor'). Greedy takes the first index of the largest logit in
  the same way. The draws equal `draw`'s on the whole logits except where u falls within
  float rounding of a boundary between two tokens (tests/test_sampler.py).
  """
  vocab = logits.shape[1]

  def local(z, u):
    shard = jax.lax.axis_index("tensor")
    first = shard * z.shape[1]  # this slice's first token id
    z = rule.tempered(z.astype(jnp.float32))
    top = jax.lax.pmax(z.max(-1), "tensor")
    mass = jnp.exp(z - top[:, None])
    sums = jax.lax.all_gather(mass.sum(-1), "tensor")  # [T, C]
    total = sums.sum(0)
    if rule.greedy:
      mine = z.max(-1) == top
      token = jnp.where(mine, first + jnp.argmax(z, -1), vocab)
    else:
      before = (jnp.cumsum(sums, 0) - sums)[shard]
      cdf = before[:, None] + jnp.cumsum(mass, -1)
      hit = (cdf >= (u.astype(jnp.float32) * total)[:, None]) & (mass > 0)
      token = jnp.where(hit.any(-1), first + jnp.argmax(hit, -1), vocab)
      # Rounding may leave the target just above the last slice's cumulative mass: then
      # the last token with mass, as the whole-vocabulary rule's cdf[-1] would give.
      last = first + z.shape[1] - 1 - jnp.argmax((mass > 0)[:, ::-1], -1)
      fallback = jax.lax.pmax(jnp.where((mass > 0).any(-1), last, -1), "tensor")
    token = jax.lax.pmin(token, "tensor")
    if not rule.greedy:
      token = jnp.where(token == vocab, fallback, token)
    at = jnp.clip(token - first, 0, z.shape[1] - 1)
    ours = (token >= first) & (token < first + z.shape[1])
    picked = jnp.take_along_axis(z, at[:, None], -1)[:, 0]
    picked = jax.lax.pmax(jnp.where(ours, picked, -jnp.inf), "tensor")
    return token.astype(jnp.int32), picked - (top + jnp.log(total))

  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(P(DATA_AXES, "tensor"), P(DATA_AXES)),
    out_specs=(P(DATA_AXES), P(DATA_AXES)),
    check_vma=False,  # pmin / pmax results are the same on every 'tensor' device
  )(logits, u)
