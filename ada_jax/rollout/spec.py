"""The rollout's config group (`config.sampler`): `SamplerSpec`."""

from __future__ import annotations

import dataclasses

from ada_jax import bounds
from ada_jax.rollout.rule import SamplingRule


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
  """Rollouts (docs/design.md "Sampler"); the experiment config's `sampler` group.

  Attributes:
    temperature, top_k, top_p: the sampling rule (`SamplingRule`).
    max_new_tokens: response budget Lr (tokens).
    chunk_rows: S, slots of the pool (rows decoding at once).
    prompts_per_chunk: P, prompts prefilled per S rows; 0 = S // the method's fewest rows
      per prompt, rounded up to the mesh's row axes (`sampler.prompts_per_chunk`); the
      prompt cache holds this × queue_rows / chunk_rows prompts.
    prompt_buckets: padded prompt lengths (tokens), one compile each.
    segment_steps: decode steps per device call, after which the host may add, cancel
      and collect rows (under `ada.schedule='stream'`, decide); 0 = derived:
      max_new_tokens under 'rounds', max_new_tokens // 32 (at least 1) under 'stream'
      (`config.RunConfig`).
    queue_rows: Q, rows queued per device call; 0 = 4 × chunk_rows.
    attention_block: decode attention reads the response ring in windows of whole blocks
      of this many columns, up to the longest live row; 0 = a sixteenth of the budget Lr
      (at least 16; `Sampler._block`).
  """

  temperature: float = bounds.within("[0, 100]", 1.0)
  top_k: int = bounds.within("[0, TOKENS]", 0)
  top_p: float = bounds.within("(0, 1]", 1.0)
  max_new_tokens: int = bounds.within("[1, TOKENS]", 2048)
  chunk_rows: int = bounds.within("[1, ROWS]", 64)
  prompts_per_chunk: int = bounds.within("[0, ROWS]", 0)
  prompt_buckets: tuple[int, ...] = bounds.within("[1, TOKENS]", (128, 256, 512, 1024))
  segment_steps: int = bounds.within("[0, TOKENS]", 0)
  queue_rows: int = bounds.within("[0, 16 * ROWS]", 0)
  attention_block: int = bounds.within("[0, TOKENS]", 0)

  def __post_init__(self):
    self.rule  # noqa: B018 -- SamplingRule checks temperature, top_k, top_p
    for name in ("max_new_tokens", "chunk_rows"):
      if getattr(self, name) < 1:
        raise ValueError(f"SamplerSpec.{name} must be >= 1, got {getattr(self, name)}")
    for name in ("prompts_per_chunk", "segment_steps", "queue_rows", "attention_block"):
      if getattr(self, name) < 0:
        raise ValueError(
          f"SamplerSpec.{name} must be >= 0 (0 = derived), got {getattr(self, name)}"
        )

  @property
  def rule(self) -> SamplingRule:
    """The sampling rule; the trainer recomputes log-probs at its `logprob_temperature`."""
    return SamplingRule(self.temperature, self.top_k, self.top_p)

  def with_slots(self, slots: int) -> SamplerSpec:
    """This spec at `slots` slots, its queue and prompts per launch scaled with them where
    it sets them (0 stays derived): the sizes `ada_jax.plan` tries."""
    scale = lambda n: max(1, round(n * slots / self.chunk_rows)) if n else 0
    return dataclasses.replace(
      self,
      chunk_rows=slots,
      queue_rows=scale(self.queue_rows),
      prompts_per_chunk=scale(self.prompts_per_chunk),
    )
