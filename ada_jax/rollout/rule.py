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
    elif cdf_block(logits.shape[1]) is None:
      probs = jax.nn.softmax(self.truncated(logits), axis=-1)
      cdf = jnp.cumsum(probs, axis=-1)
      target = u.astype(jnp.float32)[:, None] * cdf[:, -1:]
      tokens = jnp.argmax((cdf >= target) & (probs > 0), axis=-1)
    else:  # the same rule, its cumulative sum in two levels (`_first_reaching`)
      z = self.truncated(logits)
      top = z.max(-1)
      sums = block_sums(z, top)
      tokens, _, _ = _first_reaching(z, top, u * jnp.cumsum(sums, -1)[:, -1], sums)
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


# Tokens per block of the two-level cumulative sum (`_first_reaching`), the largest of these
# that divides V: a cumulative sum over a whole vocabulary is a scan, which XLA:TPU runs in
# log2(V) passes over the logits (14 passes of a 7B's float32 [rows, V / 4] logits per
# decode step, 1.0 GB at 1,856 slots on a v4-32); block sums, their cumulative sum and one
# block's take a few. A vocabulary of at most 1,024, or one none of them divides, is
# summed flat.
CDF_BLOCKS = (1024, 512, 256, 128, 64)


def cdf_block(v: int) -> int | None:
  """The block of `_first_reaching` for V = `v` tokens, or None (summed flat)."""
  if v <= CDF_BLOCKS[0]:
    return None
  return next((b for b in CDF_BLOCKS if v % b == 0), None)


def _first_reaching(z, top, target, sums=None):
  """The inverse-CDF rule on masses exp(z - top): per row the first index whose
  cumulative mass reaches `target` and whose own mass is positive.

  For V with a `cdf_block`, in two levels: the first block whose cumulative mass reaches
  the target and whose own mass is positive holds the token (the last positive token of
  any earlier block would otherwise qualify), then the cumulative sum within that block
  alone, read from z once. This sums in another order than one flat cumulative sum: the
  index is the same except where the target falls within float rounding of a boundary
  between two tokens.

  Args:
    z: `float32[C, V]` (tempered logits; -inf has no mass).
    top: `float32[C]` the masses' scale (exp(z - top) must not overflow).
    target: `float32[C]`.
    sums: `float32[C, V / block]` the blocks' masses, if the caller made them (`block_sums`).

  Returns:
    (`int32[C]` the index where the target is reached, else the last positive one, which a
    flat cumulative sum's last entry would give when rounding leaves the target above the
    total, V for a row without mass; `bool[C]` reached; `float32[C]` z at the index).
  """
  c, v = z.shape
  last = lambda positive: positive.shape[1] - 1 - jnp.argmax(positive[:, ::-1], -1)
  b = cdf_block(v)
  if b is None:
    mass = jnp.exp(z - top[:, None])
    hit = (jnp.cumsum(mass, -1) >= target[:, None]) & (mass > 0)
    reached = hit.any(-1)
    index = jnp.where(reached, jnp.argmax(hit, -1), last(mass > 0))
    at = jnp.take_along_axis(z, index[:, None], -1)[:, 0]
    return jnp.where((mass > 0).any(-1), index, v).astype(jnp.int32), reached, at
  sums = block_sums(z, top) if sums is None else sums
  ends = jnp.cumsum(sums, -1)
  reach = (ends >= target[:, None]) & (sums > 0)
  j = jnp.where(reach.any(-1), jnp.argmax(reach, -1), last(sums > 0))
  cols = j[:, None] * b + jnp.arange(b)
  zb = jnp.take_along_axis(z, cols, -1)  # [C, b]: the one block read again
  mb = jnp.exp(zb - top[:, None])
  before = jnp.take_along_axis(ends - sums, j[:, None], -1)[:, 0]
  hit = (before[:, None] + jnp.cumsum(mb, -1) >= target[:, None]) & (mb > 0)
  k = jnp.where(hit.any(-1), jnp.argmax(hit, -1), last(mb > 0))
  at = jnp.take_along_axis(zb, k[:, None], -1)[:, 0]
  index = jnp.where((sums > 0).any(-1), j * b + k, v).astype(jnp.int32)
  return index, reach.any(-1), at


def block_sums(z: jax.Array, top: jax.Array) -> jax.Array:
  """`float32[C, V / block]`: the masses exp(z - top) summed per `cdf_block` of tokens, in
  one pass (a strided window sum; a reshape would re-lay the logits out on TPU)."""
  b = cdf_block(z.shape[1])
  mass = jnp.exp(z - top[:, None])
  return jax.lax.reduce_window(mass, 0.0, jax.lax.add, (1, b), (1, b), "VALID")


def _draw_vocab_sharded(rule: SamplingRule, logits, u, mesh) -> tuple[jax.Array, jax.Array]:
  """`SamplingRule.draw` on logits split over 'tensor' along the vocabulary.

  The same inverse-CDF rule, its cumulative sum in two levels: each device sums its slice's
  masses, the T sums are all-gathered (`[T, C]` floats), and the device whose range of
  the cumulative mass holds the target returns the first such token of its slice (the
  smallest candidate over 'tensor'; within a slice, `_first_reaching`). Greedy takes the
  first index of the largest logit in the same way. The draws equal `draw`'s on the whole
  logits except where u falls within float rounding of a boundary between two tokens
  (tests/test_sampler.py).
  """
  vocab = logits.shape[1]

  def local(z, u):
    shard = jax.lax.axis_index("tensor")
    first = shard * z.shape[1]  # this slice's first token id
    z = rule.tempered(z.astype(jnp.float32))
    top = jax.lax.pmax(z.max(-1), "tensor")
    if rule.greedy:
      mine = z.max(-1) == top
      token = jax.lax.pmin(jnp.where(mine, first + jnp.argmax(z, -1), vocab), "tensor")
      total = jax.lax.psum(jnp.exp(z - top[:, None]).sum(-1), "tensor")
      at = jnp.take_along_axis(z, jnp.clip(token - first, 0, z.shape[1] - 1)[:, None], -1)[:, 0]
      picked = jax.lax.pmax(jnp.where(mine & (token >= first), at, -jnp.inf), "tensor")
      return token.astype(jnp.int32), picked - (top + jnp.log(total))
    sums = block_sums(z, top) if cdf_block(z.shape[1]) else None
    mine = sums.sum(-1) if sums is not None else jnp.exp(z - top[:, None]).sum(-1)
    slices = jax.lax.all_gather(mine, "tensor")  # [T, C]
    total = slices.sum(0)
    before = (jnp.cumsum(slices, 0) - slices)[shard]
    index, reached, at = _first_reaching(z, top, u.astype(jnp.float32) * total - before, sums)
    token = jax.lax.pmin(jnp.where(reached, first + index, vocab), "tensor")
    # Rounding may leave the target above the last slice's cumulative mass: then the last
    # token with mass (each slice's index is its own last one then), as the whole-
    # vocabulary rule's cdf[-1] would give.
    fallback = jax.lax.pmax(jnp.where(index < z.shape[1], first + index, -1), "tensor")
    token = jnp.where(token == vocab, fallback, token)
    ours = (token >= first) & (token < first + z.shape[1])
    picked = jax.lax.pmax(jnp.where(ours, at, -jnp.inf), "tensor")
    return token.astype(jnp.int32), picked - (top + jnp.log(total))

  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(P(DATA_AXES, "tensor"), P(DATA_AXES)),
    out_specs=(P(DATA_AXES), P(DATA_AXES)),
    check_vma=False,  # pmin / pmax results are the same on every 'tensor' device
  )(logits, u)
