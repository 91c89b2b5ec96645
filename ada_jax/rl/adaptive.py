"""Reinforce-Ada sampling controller: one training step's sampling for B prompts.

Host-side (numpy; Est's learned head trains with JAX). Given a `draw` callable (the real
sampler + verifier, or a Bernoulli simulator), `run_step` decides which prompts get how
many responses, in how many rounds, which responses are kept for training and their
advantages. Methods, chosen by `AdaConfig.method` (docs/design.md "Algorithm"):

* ``grpo``: n responses per prompt in one pass, local group statistics.
* ``dapo``: n per prompt; groups with uniform rewards are dropped and further prompts
  are drawn (``more_prompts``) until B mixed groups are collected or the cap on extra
  passes is hit (DAPO dynamic sampling).
* ``pos`` / ``balance`` (Reinforce-Ada-Seq): rounds of M responses per active prompt;
  a prompt retires at the end of the first round whose pool meets its exit rule
  (>= k_pos positives and >= k_neg negatives); at most R rounds; n kept by the
  half-then-fill rule; advantages from the whole pool (global normalization).
* ``est`` (Reinforce-Ada-Est, `ada_jax.rl.estimate`): per-prompt pass-rate estimates p̂
  (decayed Beta-prior counts keyed by a stable prompt id, a learned head on the prompt's
  hidden state, or both); a K*B budget split by the power objective's weight f'(p̂); one
  pass; all samples kept. Defaults are the released code's: K = 8, EMA estimates, w =
  1/p̂, every prompt 1 sample and the rest shared by weight, a single-sample prompt's
  advantage A = r. The paper's hybrid is `EST_PAPER`.

Every method reports `StepStats.first_round_pass_rate`, the fraction of positive
responses among each prompt's first-round samples (drawn before any exit decision),
averaged over the step's B prompts: an unbiased estimate of the policy's mean pass rate
on those prompts, whichever method drew them. `pool_pass_rate` (over every response drawn)
is not: pos and balance stop sampling after successes, which tilts their pools upward.

Everything is a deterministic function of the inputs and the numpy Generator, with no
dependence on Python's salted `hash`, so every process of a multi-host run makes the same
decisions when it sees the same rewards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ada_jax.rl import advantages as adv_lib
from ada_jax.rl import estimate
from ada_jax.rl.estimate import (
  EST_PAPER,
  EstState,
  allocate_budget,
  est_pass_rates,
  init_est_state,
  prompt_keys,
  update_est_state,
)
from ada_jax.rl.pools import DrawFn, StepResult, StepStats
from ada_jax.rl.pools import Pools as _Pools
from ada_jax.rl.pools import finish as _finish
from ada_jax.rl.pools import has_spread as _has_spread

__all__ = [
  "AdaConfig",
  "EST_PAPER",
  "DrawFn",
  "EstState",
  "METHODS",
  "pool_meets_exit",
  "prompt_keys",
  "StepResult",
  "StepStats",
  "allocate_budget",
  "batch_order",
  "est_pass_rates",
  "est_step",
  "init_est_state",
  "run_step",
  "update_est_state",
]

MorePromptsFn = Callable[[int], Sequence[Any]]

# Default exit thresholds (k_pos, k_neg) per Seq method, as functions of the group size n.
# `pos`: one positive suffices; `balance`: half positives, half negatives.
EXIT_THRESHOLDS: dict[str, Callable[[int], tuple[int, int]]] = {
  "pos": lambda n: (1, 0),
  "balance": lambda n: (n // 2, n - n // 2),
}
SEQ_METHODS = tuple(EXIT_THRESHOLDS)
METHODS = ("grpo", "dapo", *SEQ_METHODS, "est")
SELECTIONS = ("first", "random")
SCHEDULES = ("rounds", "stream")
BATCH_ORDERS = ("exit", "prompt")


@dataclasses.dataclass(frozen=True)
class AdaConfig:
  """Every knob of the sampling controller; validated on construction.

  Attributes:
    method: 'grpo' | 'dapo' | 'pos' | 'balance' | 'est'.
    schedule: 'rounds' (`run_step`: the released barriers, a prompt retires only at the
      end of a round) or 'stream' (`ada_jax.rl.stream`: exits decided as responses
      finish, grading overlapped with decoding).
    n: responses kept per prompt (grpo/dapo: drawn per prompt). Not used by est.
    samples_per_round: M, responses drawn per active prompt per round (pos/balance).
    max_rounds: R, rounds at most (pos/balance); each prompt gets M..R*M samples.
    k_pos: exit needs >= k_pos positives. None: 1 for pos, floor(n/2) for balance.
    k_neg: exit needs >= k_neg negatives. None: 0 for pos, n - floor(n/2) for balance.
    positive_threshold: a response is positive when reward > this (0/1 rewards: 0.5).
    selection: 'first' keeps the earliest responses of each class (released code);
      'random' a uniformly random subset drawn from the step's Generator.
    baseline: 'global' (mean over the whole pool, Reinforce-Ada) or 'local' (mean over
      the kept group, GRPO). For grpo, dapo and est the two coincide.
    std_normalize: divide advantages by the baseline source's std (Bessel-corrected) +
      std_eps. Off by default, as in the released Reinforce-Ada scripts (global
      normalization subtracts the pool mean only). The released GRPO and DAPO baseline
      scripts keep verl's default (on), so the `*_grpo.py` configs turn it on; off there
      gives the Dr.GRPO-style variant.
    std_eps: the std offset (1e-6).
    inverse_p_weight: explicit weight f'(p̄) = p̄^(α−1) on advantages: 'none' (released
      code), '1/p' (α = 0, f'= 1/p̄: paper v3 Seq), '1/sqrt_p' (α = 0.5: paper v3 Est) or
      α in [0, 1] (`estimate.objective_weight`).
    batch_order: how pos / balance lay the kept groups out in the training batch, whose
      mini-batches are cut contiguously: 'exit' (released: verl concatenates the groups
      as prompts exit, round 1's first, the never-exited last, so on a hard mix the last
      mini-batches hold little signal; ties in prompt order, where the released code
      iterates a Python set) or 'prompt' (the step's prompt order, which spreads every
      round's exits over all mini-batches). Other methods keep prompt order.
    dapo_max_extra_passes: cap on extra generation passes after the first (dapo).
    dapo_prompts_per_pass: prompts requested from `more_prompts` per extra pass;
      None: B, the step's prompt count (verl draws a whole generation batch).
    est_alpha: Beta prior alpha of the pass-rate estimate (1).
    est_beta: Beta prior beta (16): unseen prompts are presumed hard, p̂ = 1/17.
    est_decay: lambda, the factor on a prompt's old counts each time it is sampled.
    est_budget_per_prompt: K; the step draws round(K * B) samples in all (released: 8,
      compared with GRPO n = 8).
    est_weight: the objective whose f'(p̂) weights the allocation, spelled as for
      `inverse_p_weight`: '1/p' (α = 0, released code), '1/sqrt_p' (α = 0.5, paper) or α.
    est_estimator: where p̂ comes from: 'ema' (the decayed counts, released code),
      'head' (the learned pass-rate head, `pass_rate_head`) or 'head+ema' (the head's
      prediction as the prior mean, the counts as pseudo-counts). The head needs the
      prompts' hidden states (`run_step`'s `features`).
    est_p_min: p̂ (and p̄) are clipped to [est_p_min, 1] before f' (1e-3).
    est_head_lr: the head's Adam learning rate (1e-2).
    est_head_steps: Adam steps on each step's outcomes (8; 0 freezes the head).
    est_split: how the budget becomes counts (`estimate.allocate_budget`): 'released'
      (est_n_min each, the rest in proportion to w) or 'clipped' (paper: proportional to
      w, clipped to [est_n_min, est_n_max]).
    est_n_min: at least this many samples per prompt (>= 1; released 1, paper 4).
    est_n_max: at most this many ('clipped' only; None: no cap; paper 32).
  """

  method: str = "pos"
  schedule: str = "rounds"
  n: int = 4
  samples_per_round: int = 8
  max_rounds: int = 4
  k_pos: int | None = None
  k_neg: int | None = None
  positive_threshold: float = 0.5
  selection: str = "first"
  baseline: str = "global"
  std_normalize: bool = False
  std_eps: float = 1e-6
  inverse_p_weight: str | float = "none"
  batch_order: str = "exit"
  dapo_max_extra_passes: int = 4
  dapo_prompts_per_pass: int | None = None
  est_alpha: float = 1.0
  est_beta: float = 16.0
  est_decay: float = 0.9
  est_budget_per_prompt: float = 8.0
  est_weight: str | float = "1/p"
  est_estimator: str = "ema"
  est_p_min: float = 1e-3
  est_head_lr: float = 1e-2
  est_head_steps: int = 8
  est_split: str = "released"
  est_n_min: int = 1
  est_n_max: int | None = None

  def __post_init__(self):
    self.validate()

  def validate(self) -> None:
    """Checks every field; raises ValueError naming the first bad one."""

    def bad(field: str, why: str):
      raise ValueError(f"AdaConfig.{field}={getattr(self, field)!r}: {why}")

    if self.method not in METHODS:
      bad("method", f"unknown method, expected one of {list(METHODS)}")
    if self.schedule not in SCHEDULES:
      bad("schedule", f"expected one of {list(SCHEDULES)}")
    if not isinstance(self.n, int) or self.n < 2:
      bad("n", "group size must be an int >= 2 (a group of 1 never carries signal)")
    if self.samples_per_round < 1:
      bad("samples_per_round", "M must be >= 1")
    if self.max_rounds < 1:
      bad("max_rounds", "R must be >= 1")
    for field in ("k_pos", "k_neg"):
      if getattr(self, field) is not None and getattr(self, field) < 0:
        bad(field, "must be >= 0 or None")
    if self.method == "balance" and self.n % 2 and self.k_pos is None and self.k_neg is None:
      bad(
        "n",
        "balance splits n into equal halves by default; use an even n or set "
        "k_pos and k_neg explicitly",
      )
    if self.method in SEQ_METHODS:
      k_pos, k_neg = self.thresholds()
      if k_pos + k_neg < 1:
        bad("k_pos", "k_pos + k_neg must be >= 1, or every prompt exits before sampling")
      m, r = self.samples_per_round, self.max_rounds
      if m * r < self.n or max(m, k_pos + k_neg) < self.n:
        bad(
          "samples_per_round",
          f"with n={self.n}, R={r}, k_pos={k_pos}, k_neg={k_neg} "
          "a pool could hold fewer than n responses; need M*R >= n and "
          "max(M, k_pos + k_neg) >= n",
        )
    if self.batch_order not in BATCH_ORDERS:
      bad("batch_order", f"expected one of {list(BATCH_ORDERS)}")
    if self.selection not in SELECTIONS:
      bad("selection", f"expected one of {list(SELECTIONS)}")
    if self.baseline not in adv_lib.BASELINES:
      bad("baseline", f"expected one of {sorted(adv_lib.BASELINES)}")
    if not self.std_eps > 0:
      bad("std_eps", "must be > 0")
    if self.dapo_max_extra_passes < 0:
      bad("dapo_max_extra_passes", "must be >= 0")
    if self.dapo_prompts_per_pass is not None and self.dapo_prompts_per_pass < 1:
      bad("dapo_prompts_per_pass", "must be >= 1 or None")
    estimate.check_config(self, bad)

  def train_rows(self, num_prompts: int) -> int:
    """Responses a step returns for training at most, for B = `num_prompts`: B·n, or for
    est its whole budget round(K·B) (it trains on every sample). Est draws exactly this
    many, so its training batch and mini-batches have a fixed number of rows, as in verl.
    """
    if self.method == "est":
      return int(round(self.est_budget_per_prompt * num_prompts))
    return num_prompts * self.n

  @property
  def min_rows_per_prompt(self) -> int:
    """The fewest responses one `draw` call asks for any prompt: n (grpo, dapo), M (pos,
    balance) or est_n_min (est). A sampler chunk of C rows is full whenever it may hold
    C // this many prompts."""
    if self.method in SEQ_METHODS:
      return self.samples_per_round
    return self.est_n_min if self.method == "est" else self.n

  def thresholds(self) -> tuple[int, int]:
    """(k_pos, k_neg) exit thresholds with the method's defaults filled in."""
    default = EXIT_THRESHOLDS.get(self.method, EXIT_THRESHOLDS["balance"])(self.n)
    k_pos = default[0] if self.k_pos is None else self.k_pos
    k_neg = default[1] if self.k_neg is None else self.k_neg
    return k_pos, k_neg


def select_responses(config: AdaConfig, pool: list[float], rng: np.random.Generator) -> np.ndarray:
  """The n training responses of a prompt's pool (`advantages.select_group`: half
  positives, half negatives, the rest filled), in pool order; `rng` is used only by
  `selection='random'`. Returns int64[n] indices into `pool`."""
  return adv_lib.select_group(
    np.asarray(pool),
    config.n,
    config.positive_threshold,
    rng if config.selection == "random" else None,
  )


def _run_grpo(config, prompt_ids, draw, rng, est_state, more_prompts):
  b = len(prompt_ids)
  pools = _Pools(b)
  pools.draw_round(draw, np.repeat(np.arange(b), config.n))
  kept = {p: np.arange(config.n) for p in range(b)}
  return _finish(config, pools, prompt_ids, b, kept), est_state


def _run_dapo(config, prompt_ids, draw, rng, est_state, more_prompts):
  b = len(prompt_ids)
  all_ids = list(prompt_ids)
  pools = _Pools(b)
  pools.draw_round(draw, np.repeat(np.arange(b), config.n))
  mixed = [p for p in range(b) if _has_spread(pools.rewards[p])]
  per_pass = config.dapo_prompts_per_pass or b
  for _ in range(config.dapo_max_extra_passes):
    if len(mixed) >= b or more_prompts is None:
      break
    extra = list(more_prompts(per_pass))
    if not extra:  # The data source ran dry: train on what there is.
      break
    start = len(all_ids)
    all_ids += extra
    pools.grow(len(all_ids))
    pools.draw_round(draw, np.repeat(np.arange(start, len(all_ids)), config.n))
    mixed += [p for p in range(start, len(all_ids)) if _has_spread(pools.rewards[p])]
  # As in verl, surplus mixed groups beyond B are dropped so the batch keeps its size.
  kept = {p: np.arange(config.n) for p in mixed[:b]}
  return _finish(config, pools, all_ids, b, kept), est_state


def pool_meets_exit(
  rewards: Sequence[float] | np.ndarray, config: AdaConfig, min_pool: int | None = None
) -> bool:
  """The Reinforce-Ada-Seq exit rule on one prompt's pool of graded responses.

  True when the pool holds >= n responses, >= k_pos positives and >= k_neg negatives
  (positive: reward > `positive_threshold`). Under `rounds` the pool is checked at the end
  of each round and the size condition always holds when the others do (`AdaConfig`
  requires max(M, k_pos + k_neg) >= n), so this is the released rule there; under `stream`
  it keeps a prompt from exiting on fewer than n responses.
  Reference: paper §3 (successive elimination); released `pos` k = (1, 0), `balance`
  (n/2, n/2).

  Args:
    rewards: float[P] rewards of the prompt's graded responses (any order).
    config: a pos or balance `AdaConfig` (its thresholds, n and positive_threshold).
    min_pool: the fewest responses an exiting pool holds; None: n.

  Raises:
    ValueError: `config.method` is not a Seq method.
  """
  if config.method not in SEQ_METHODS:
    raise ValueError(f"config.method={config.method!r}: the exit rule is for {SEQ_METHODS}")
  r = np.asarray(rewards, np.float64)
  k_pos, k_neg = config.thresholds()
  n_pos = int(np.count_nonzero(r > config.positive_threshold))
  return (
    r.size >= (config.n if min_pool is None else min_pool)
    and n_pos >= k_pos
    and r.size - n_pos >= k_neg
  )


def batch_order(config: AdaConfig, exit_round: Sequence[int | None]) -> list[int]:
  """The order of a Seq step's B groups in the training batch (`AdaConfig.batch_order`).

  Args:
    config: a pos or balance config.
    exit_round: per prompt, the round (or stream boundary) at whose end it exited; None
      for a prompt that never met the exit rule.

  Returns:
    Prompt indices: 'exit' sorts by exit round, never-exited last, ties in prompt order
    (released verl's `selected_pool_batches`, then a contiguous `data.split`); 'prompt'
    is 0..B-1. Example: exit rounds [None, 2, 1, 1] give [2, 3, 1, 0] under 'exit'.
  """
  b = len(exit_round)
  if config.batch_order == "prompt":
    return list(range(b))
  last = max([r for r in exit_round if r is not None], default=0) + 1
  return sorted(range(b), key=lambda p: (last if exit_round[p] is None else exit_round[p], p))


def _run_seq(config, prompt_ids, draw, rng, est_state, more_prompts):
  b = len(prompt_ids)
  pools = _Pools(b)
  active = np.arange(b)
  exit_round: list[int | None] = [None] * b
  for r in range(config.max_rounds):
    if active.size == 0:
      break
    pools.draw_round(draw, np.repeat(active, config.samples_per_round))
    # Exit is checked only at the end of a round: every response of the round joins the
    # pool, even those drawn after the threshold was reached (they were already paid for).
    still = []
    for p in active.tolist():
      if pool_meets_exit(pools.rewards[p], config):
        exit_round[p] = r
      else:
        still.append(p)
    active = np.asarray(still, np.int64)
  # Prompts that never exited stay in the batch; uniform pools get zero advantage.
  kept = {p: select_responses(config, pools.rewards[p], rng) for p in range(b)}
  order = batch_order(config, exit_round)
  return _finish(config, pools, prompt_ids, b, kept, order), est_state


def _run_est(config, prompt_ids, draw, rng, est_state, more_prompts, features=None):
  def sample(counts):
    pools = _Pools(len(prompt_ids))
    pools.draw_round(draw, np.repeat(np.arange(len(prompt_ids)), counts))
    kept = {p: np.arange(len(pools.rewards[p])) for p in range(len(prompt_ids))}
    return _finish(config, pools, prompt_ids, len(prompt_ids), kept)  # Trains on all.

  return est_step(config, prompt_ids, est_state, features, sample)


def est_step(
  config: AdaConfig,
  prompt_ids: Sequence[Any],
  est_state: EstState | None,
  features: np.ndarray | None,
  sample: Callable[[np.ndarray], StepResult],
) -> tuple[StepResult, EstState]:
  """Reinforce-Ada-Est's step around a sampler of fixed per-prompt counts: p̂ and the
  budget split (`estimate.plan_budget`), `sample(counts)` (int64[B] rows per prompt; returns
  the `StepResult` with every row kept), then the outcomes folded into the state
  (`estimate.fold_step`). Shared by the `rounds` and `stream` schedules."""
  b = len(prompt_ids)
  state = init_est_state() if est_state is None else est_state
  keys = prompt_keys(prompt_ids)
  counts, p_head, plan = estimate.plan_budget(config, state, keys, config.train_rows(b), features)
  result = sample(counts)
  positive = result.rewards > config.positive_threshold
  n_pos = np.bincount(result.prompt_index, weights=positive, minlength=b).astype(np.float64)
  new_state, fold = estimate.fold_step(
    config, state, keys, n_pos, counts.astype(np.float64), features, p_head
  )
  stats = dataclasses.replace(result.stats, est_metrics={**plan, **fold})
  return dataclasses.replace(result, stats=stats), new_state


_METHOD_FNS = {
  "grpo": _run_grpo,
  "dapo": _run_dapo,
  "pos": _run_seq,
  "balance": _run_seq,
}


def run_step(
  config: AdaConfig,
  prompt_ids: Sequence[Any],
  draw: DrawFn,
  rng: np.random.Generator,
  est_state: EstState | None = None,
  more_prompts: MorePromptsFn | None = None,
  features: np.ndarray | None = None,
) -> tuple[StepResult, EstState | None]:
  """Runs one training step's sampling for B prompts.

  `draw(rows)` gets int64[N] prompt indices (one requested response per entry, rows of
  a prompt contiguous, indices into the step's prompt list extended by dapo's extra
  prompts) and returns (float32[N] rewards, N opaque handles). It is called once per
  round / pass, so the sampler sees all active prompts of a round together.

  Args:
    config: a validated `AdaConfig`.
    prompt_ids: B stable prompt ids (est keys its statistics on them; elsewhere they are
      only passed through to `StepResult.prompt_ids`).
    draw: the sampling + reward callable described above.
    rng: host Generator; consumed only by `selection='random'`.
    est_state: est's statistics from the previous step (None: empty); other methods
      return it unchanged.
    more_prompts: dapo only: `more_prompts(k)` returns up to k further prompt ids; an
      empty answer ends the search. Without it dapo makes no extra passes.
    features: est with a head-based `est_estimator` only: float32[B, d] hidden states of
      the prompts at their last token (`pass_rate_head.prompt_hidden_states`).

  Returns:
    (StepResult, est_state after this step).

  Raises:
    ValueError: no prompts, or `draw` answered with the wrong number of rewards/handles
      or a non-finite reward.
  """
  if len(prompt_ids) == 0:
    raise ValueError("run_step needs at least one prompt")
  config.validate()
  args = (config, list(prompt_ids), draw, rng, est_state, more_prompts)
  if config.method == "est":
    return _run_est(*args, features=features)
  return _METHOD_FNS[config.method](*args)
