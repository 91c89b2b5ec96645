"""One step's response pools and what the sampling controller returns from them.

`ResponsePools` holds each prompt's graded (reward, row id) pairs at the end of a step; `finish`
turns the kept responses into advantages (`advantages.group_advantages`) and assembles the
`StepResult` with its `StepStats` (docs/design.md "Algorithm"). Host-side numpy only; used
by `ada_jax.rl.controller.Controller.result`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from ada_jax.rl import advantages as adv_lib


@dataclasses.dataclass(frozen=True)
class StepStats:
  """Sampling statistics of one step (P = prompts sampled, B = the step's prompts).

  Attributes:
    num_prompts: B, prompts given to the step.
    samples_per_round: responses drawn in each round / pass.
    active_per_round: prompts sampled in each round / pass.
    rows_requested: responses drawn in all (= sum of samples_per_round).
    rows_selected: responses returned for training.
    rows_useful: returned responses with a non-zero advantage.
    zero_signal_fraction: fraction of the returned prompts whose advantages are all zero.
    signal_fraction: prompts with a non-zero advantage / B (dapo: can reach 1 with
      extra prompts).
    mean_pool_size: mean responses drawn per sampled prompt.
    reward_mean: mean reward over every drawn response.
    first_round_pass_rate: fraction of positive responses among each of the B prompts'
      first-round (first-pass) samples, averaged over the B prompts. Those samples are
      drawn before any exit decision, so this estimates the policy's mean pass rate on the
      step's prompts without bias for every method (`pool_pass_rate` is biased upward for
      pos and balance, which stop after successes).
    first_round_all_correct: prompts of the B whose first-round samples are all positive.
    first_round_all_wrong: prompts of the B whose first-round samples are all negative:
      with `first_round_all_correct`, the groups a GRPO of the first round's size would
      have learned nothing from.
    pool_size: int32[P] responses drawn per prompt.
    pool_positives: int32[P] positive responses (reward > `positive_threshold`) in each
      prompt's pool; `pool_pass_rate` is their fraction.
    rule_metrics: the rule's own figures: Est's (`estimate.plan_budget`,
      `estimate.fold_step`: budget share per p̂ band, the head's calibration before it
      trains), Seq's with `min_exit_chance` (prompts stopped); empty for the others.
    stopped: indices of the prompts the exit-chance rule stopped (`rules.Seq`).
  """

  num_prompts: int
  samples_per_round: tuple[int, ...]
  active_per_round: tuple[int, ...]
  rows_requested: int
  rows_selected: int
  rows_useful: int
  zero_signal_fraction: float
  signal_fraction: float
  mean_pool_size: float
  reward_mean: float
  first_round_pass_rate: float
  first_round_all_correct: int
  first_round_all_wrong: int
  pool_size: np.ndarray
  pool_positives: np.ndarray
  rule_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  stopped: tuple[int, ...] = ()

  @property
  def pool_pass_rate(self) -> np.ndarray:
    """float32[P] fraction of positive responses in each prompt's pool (0 where none drawn)."""
    size = self.pool_size
    return np.where(size > 0, self.pool_positives / np.maximum(size, 1), 0.0).astype(np.float32)

  def as_metrics(self, prefix: str = "ada/") -> dict[str, float]:
    """Flat scalar metrics for logging (per-round entries suffixed _r1, _r2, ...).

    `rows_requested`, `zero_signal_fraction`, `reward_mean` and the prompts per round are
    left out: the training loop logs them under its own names (`samples_drawn`,
    `zero_signal_frac`, `reward_mean`, `active_prompts_per_round`), and a figure has one
    name in `metrics.jsonl`.
    """
    out = {
      f"{prefix}{k}": float(getattr(self, k))
      for k in (
        "rows_selected",
        "rows_useful",
        "signal_fraction",
        "mean_pool_size",
        "first_round_all_correct",
        "first_round_all_wrong",
      )
    }
    out[f"{prefix}rounds"] = float(len(self.samples_per_round))
    out[f"{prefix}samples_per_prompt"] = self.rows_requested / max(self.num_prompts, 1)
    for r, s in enumerate(self.samples_per_round, 1):
      out[f"{prefix}samples_r{r}"] = float(s)
    out.update(self.rule_metrics)
    return out


@dataclasses.dataclass(frozen=True)
class StepResult:
  """The responses selected for training (S of them) and the step's statistics.

  Attributes:
    prompt_index: int32[S] index of each response's prompt in `prompt_ids`.
    handles: S row ids of the controller (the engine's responses are stored by them).
    rewards: float32[S].
    advantages: float32[S].
    prompt_ids: the step's prompts, followed (dapo) by those `more_prompts` returned.
    stats: `StepStats`.
  """

  prompt_index: np.ndarray
  handles: list
  rewards: np.ndarray
  advantages: np.ndarray
  prompt_ids: tuple
  stats: StepStats


class ResponsePools:
  """Per-prompt pools of one step: rewards and handles (row ids) in row-id order, the rows
  and prompts of each round (`stream`: one entry) and each prompt's first-round size."""

  def __init__(self, num_prompts: int):
    self.rewards: list[list[float]] = [[] for _ in range(num_prompts)]
    self.handles: list[list[Any]] = [[] for _ in range(num_prompts)]
    self.samples_per_round: list[int] = []
    self.active_per_round: list[int] = []
    self.first_round_size: np.ndarray | None = None


def finish(
  config,
  pools: ResponsePools,
  prompt_ids: Sequence[Any],
  num_base: int,
  kept: dict[int, np.ndarray],
  order: Sequence[int] | None = None,
) -> StepResult:
  """Computes advantages for the kept responses and assembles the StepResult.

  Args:
    kept: prompt index -> int64[k] indices into that prompt's pool, in output order.
    order: the prompts of `kept` in the order their groups are laid out in the training
      batch (mini-batches are cut from it contiguously); None: ascending prompt index.
  """
  idx, handles, rewards, advs = [], [], [], []
  zero_groups = 0
  order = sorted(kept) if order is None else list(order)
  if sorted(order) != sorted(kept):
    raise ValueError(f"order {order} is not a permutation of the kept prompts {sorted(kept)}")
  for p in order:
    pool = np.asarray(pools.rewards[p], np.float32)
    sel = kept[p]
    a = adv_lib.group_advantages(
      pool[sel],
      pool,
      baseline=config.baseline,
      std_normalize=config.std_normalize,
      eps=config.std_eps,
      p_weight=config.inverse_p_weight,
    )
    zero_groups += int(not np.any(a != 0))
    idx.append(np.full(sel.size, p, np.int32))
    handles.extend(pools.handles[p][i] for i in sel.tolist())
    rewards.append(pool[sel])
    advs.append(a)
  cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)
  advantages = cat(advs, np.float32)
  sizes = np.asarray([len(r) for r in pools.rewards], np.int32)
  sampled = sizes > 0
  pos = np.asarray([sum(x > config.positive_threshold for x in r) for r in pools.rewards])
  all_rewards = np.concatenate([np.asarray(r, np.float64) for r in pools.rewards if r] or [[]])
  first = pools.first_round_size
  first_rates = [
    np.mean(np.asarray(pools.rewards[p][: first[p]]) > config.positive_threshold)
    for p in range(num_base)
    if first is not None and first[p] > 0
  ]
  stats = StepStats(
    num_prompts=num_base,
    samples_per_round=tuple(pools.samples_per_round),
    active_per_round=tuple(pools.active_per_round),
    rows_requested=int(sizes.sum()),
    rows_selected=int(advantages.size),
    rows_useful=int(np.count_nonzero(advantages)),
    zero_signal_fraction=zero_groups / len(kept) if kept else 1.0,
    signal_fraction=(len(kept) - zero_groups) / max(num_base, 1),
    mean_pool_size=float(sizes[sampled].mean()) if sampled.any() else 0.0,
    reward_mean=float(all_rewards.mean()) if all_rewards.size else 0.0,
    first_round_pass_rate=float(np.mean(first_rates)) if first_rates else 0.0,
    first_round_all_correct=sum(r == 1.0 for r in first_rates),
    first_round_all_wrong=sum(r == 0.0 for r in first_rates),
    pool_size=sizes,
    pool_positives=pos.astype(np.int32),
  )
  return StepResult(
    prompt_index=cat(idx, np.int32),
    handles=handles,
    rewards=cat(rewards, np.float32),
    advantages=advantages,
    prompt_ids=tuple(prompt_ids),
    stats=stats,
  )


def batch_order(order: str, exit_round: Sequence[int | None]) -> list[int]:
  """The order of a Seq step's B groups in the training batch (`SeqConfig.batch_order`).

  Args:
    order: 'exit' or 'prompt' (`rules.BATCH_ORDERS`).
    exit_round: per prompt, the round (or stream boundary) at whose end it exited; None
      for a prompt that never met the exit rule.

  Returns:
    Prompt indices: 'exit' sorts by exit round, never-exited last, ties in prompt order
    (released verl's `selected_pool_batches`, then a contiguous `data.split`); 'prompt'
    is 0..B-1. Example: exit rounds [None, 2, 1, 1] give [2, 3, 1, 0] under 'exit'.
  """
  b = len(exit_round)
  if order == "prompt":
    return list(range(b))
  last = max([r for r in exit_round if r is not None], default=0) + 1
  return sorted(range(b), key=lambda p: (last if exit_round[p] is None else exit_round[p], p))
