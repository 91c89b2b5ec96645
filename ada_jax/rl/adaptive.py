"""Reinforce-Ada sampling controller: one training step's sampling for B prompts.

Host-side numpy only. Given a `draw` callable (the real sampler + verifier, or a
Bernoulli simulator), `run_step` decides which prompts get how many responses, in how
many rounds, which responses are kept for training and their advantages. Methods, chosen
by `AdaConfig.method` (docs/design.md "Algorithm"):

* ``grpo``: n responses per prompt in one pass, local group statistics.
* ``dapo``: n per prompt; groups with uniform rewards are dropped and further prompts
  are drawn (``more_prompts``) until B mixed groups are collected or the cap on extra
  passes is hit (DAPO dynamic sampling).
* ``pos`` / ``balance`` (Reinforce-Ada-Seq): rounds of M responses per active prompt;
  a prompt retires at the end of the first round whose pool meets its exit rule
  (>= k_pos positives and >= k_neg negatives); at most R rounds; n kept by the
  half-then-fill rule; advantages from the whole pool (global normalization).
* ``est`` (Reinforce-Ada-Est): persistent, decayed Beta-prior pass-rate estimates keyed
  by a stable prompt id; a K*B budget split by weight w(p̂); one pass; all samples kept.
  Defaults are the released code's: K = 8, w = 1/p̂, every prompt 1 sample and the rest
  shared by weight, a single-sample prompt's advantage A = r. The paper's hybrid is
  `est_weight='1/sqrt_p', est_split='clipped', est_n_min=4, est_n_max=32,
  inverse_p_weight='1/sqrt_p'` (`EST_PAPER`).

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
from ada_jax.rl.advantages import (
  EST_SPLITS,
  EST_WEIGHTS,
  EstState,
  allocate_budget,
  est_pass_rates,
  init_est_state,
  prompt_keys,
  update_est_state,
)

__all__ = [
  "AdaConfig",
  "EST_PAPER",
  "DrawFn",
  "EstState",
  "METHODS",
  "prompt_keys",
  "StepResult",
  "StepStats",
  "allocate_budget",
  "est_pass_rates",
  "init_est_state",
  "run_step",
  "update_est_state",
]

DrawFn = Callable[[np.ndarray], tuple[np.ndarray, Sequence[Any]]]
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


@dataclasses.dataclass(frozen=True)
class AdaConfig:
  """Every knob of the sampling controller; validated on construction.

  Attributes:
    method: 'grpo' | 'dapo' | 'pos' | 'balance' | 'est'.
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
    inverse_p_weight: explicit pass-rate weight on advantages: 'none' (released code),
      '1/p' (paper v3 Seq), '1/sqrt_p' (paper v3 Est).
    dapo_max_extra_passes: cap on extra generation passes after the first (dapo).
    dapo_prompts_per_pass: prompts requested from `more_prompts` per extra pass;
      None: B, the step's prompt count (verl draws a whole generation batch).
    est_alpha: Beta prior alpha of the pass-rate estimate (1).
    est_beta: Beta prior beta (16): unseen prompts are presumed hard, p̂ = 1/17.
    est_decay: lambda, the factor on a prompt's old counts each time it is sampled.
    est_budget_per_prompt: K; the step draws round(K * B) samples in all (released: 8,
      compared with GRPO n = 8).
    est_weight: sampling weight w(p̂): '1/p' (released code) or '1/sqrt_p' (paper).
    est_split: how the budget becomes counts (`advantages.allocate_budget`): 'released'
      (est_n_min each, the rest in proportion to w) or 'clipped' (paper: proportional to
      w, clipped to [est_n_min, est_n_max]).
    est_n_min: at least this many samples per prompt (>= 1; released 1, paper 4).
    est_n_max: at most this many ('clipped' only; None: no cap; paper 32).
  """

  method: str = "pos"
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
  inverse_p_weight: str = "none"
  dapo_max_extra_passes: int = 4
  dapo_prompts_per_pass: int | None = None
  est_alpha: float = 1.0
  est_beta: float = 16.0
  est_decay: float = 0.9
  est_budget_per_prompt: float = 8.0
  est_weight: str = "1/p"
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
    if self.selection not in SELECTIONS:
      bad("selection", f"expected one of {list(SELECTIONS)}")
    if self.baseline not in adv_lib.BASELINES:
      bad("baseline", f"expected one of {sorted(adv_lib.BASELINES)}")
    if self.inverse_p_weight not in adv_lib.P_WEIGHTS:
      bad("inverse_p_weight", f"expected one of {sorted(adv_lib.P_WEIGHTS)}")
    if not self.std_eps > 0:
      bad("std_eps", "must be > 0")
    if self.dapo_max_extra_passes < 0:
      bad("dapo_max_extra_passes", "must be >= 0")
    if self.dapo_prompts_per_pass is not None and self.dapo_prompts_per_pass < 1:
      bad("dapo_prompts_per_pass", "must be >= 1 or None")
    if not (self.est_alpha > 0 and self.est_beta > 0):
      bad("est_alpha" if not self.est_alpha > 0 else "est_beta", "Beta prior needs > 0")
    if not 0 <= self.est_decay <= 1:
      bad("est_decay", "lambda must lie in [0, 1]")
    if self.est_weight not in EST_WEIGHTS:
      bad("est_weight", f"expected one of {sorted(EST_WEIGHTS)}")
    if self.est_split not in EST_SPLITS:
      bad("est_split", f"expected one of {list(EST_SPLITS)}")
    if self.est_split == "released" and self.est_n_max is not None:
      bad("est_n_max", "the released split has no cap; set est_split='clipped' or None")
    if self.est_n_min < 1:
      bad("est_n_min", "every prompt needs at least one sample")
    if self.est_budget_per_prompt < self.est_n_min:
      bad("est_budget_per_prompt", f"K must be >= est_n_min={self.est_n_min}")
    if self.est_n_max is not None and self.est_n_max < self.est_budget_per_prompt:
      bad("est_n_max", "must be >= est_budget_per_prompt, or the budget cannot be spent")

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


# The paper's (v3) Est hybrid as AdaConfig overrides: allocation ∝ 1/sqrt(p̂) clipped to
# [N_min, N_max] = [4, 32], and an explicit 1/sqrt(p̄) weight on the advantages.
EST_PAPER: dict[str, Any] = dict(
  est_weight="1/sqrt_p",
  est_split="clipped",
  est_n_min=4,
  est_n_max=32,
  inverse_p_weight="1/sqrt_p",
)


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
    pool_size: int32[P] responses drawn per prompt.
    pool_pass_rate: float32[P] fraction of positive responses in each prompt's pool.
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
  pool_size: np.ndarray
  pool_pass_rate: np.ndarray

  def as_metrics(self, prefix: str = "ada/") -> dict[str, float]:
    """Flat scalar metrics for logging (per-round entries suffixed _r1, _r2, ...).

    `rows_requested`, `zero_signal_fraction`, `reward_mean` and the prompts per round are
    left out: the training loop logs them under its own names (`samples_drawn`,
    `zero_signal_frac`, `reward_mean`, `active_prompts_per_round`), and a figure has one
    name in `metrics.jsonl`.
    """
    out = {
      f"{prefix}{k}": float(getattr(self, k))
      for k in ("rows_selected", "rows_useful", "signal_fraction", "mean_pool_size")
    }
    out[f"{prefix}rounds"] = float(len(self.samples_per_round))
    out[f"{prefix}samples_per_prompt"] = self.rows_requested / max(self.num_prompts, 1)
    for r, s in enumerate(self.samples_per_round, 1):
      out[f"{prefix}samples_r{r}"] = float(s)
    return out


@dataclasses.dataclass(frozen=True)
class StepResult:
  """The responses selected for training (S of them) and the step's statistics.

  Attributes:
    prompt_index: int32[S] index of each response's prompt in `prompt_ids`.
    handles: S opaque response handles, as returned by `draw`.
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


class _Pools:
  """Per-prompt pools of (reward, handle) built up over the rounds of one step."""

  def __init__(self, num_prompts: int):
    self.rewards: list[list[float]] = [[] for _ in range(num_prompts)]
    self.handles: list[list[Any]] = [[] for _ in range(num_prompts)]
    self.samples_per_round: list[int] = []
    self.active_per_round: list[int] = []
    self.first_round_size: np.ndarray | None = None

  def grow(self, num_prompts: int):
    self.rewards += [[] for _ in range(num_prompts - len(self.rewards))]
    self.handles += [[] for _ in range(num_prompts - len(self.handles))]

  def draw_round(self, draw: DrawFn, rows: np.ndarray):
    """Makes one `draw` call for `rows` (prompt index per row) and files the results."""
    rows = np.asarray(rows, np.int64)
    rewards, handles = draw(rows)
    rewards = np.asarray(rewards, np.float32)
    if rewards.shape != rows.shape:
      raise ValueError(f"draw returned rewards of shape {rewards.shape} for {rows.size} rows")
    if not np.all(np.isfinite(rewards)):
      raise ValueError("draw returned a non-finite reward")
    if len(handles) != rows.size:
      raise ValueError(f"draw returned {len(handles)} handles for {rows.size} rows")
    for p, r, h in zip(rows.tolist(), rewards.tolist(), handles, strict=True):
      self.rewards[p].append(r)
      self.handles[p].append(h)
    self.samples_per_round.append(int(rows.size))
    self.active_per_round.append(int(np.unique(rows).size))
    if self.first_round_size is None:
      self.first_round_size = np.asarray([len(r) for r in self.rewards], np.int64)


def _has_spread(rewards: list[float]) -> bool:
  # DAPO's filter (as in verl): drop groups whose rewards are all equal (std 0).
  return len(set(rewards)) > 1


def _finish(
  config: AdaConfig,
  pools: _Pools,
  prompt_ids: Sequence[Any],
  num_base: int,
  kept: dict[int, np.ndarray],
) -> StepResult:
  """Computes advantages for the kept responses and assembles the StepResult.

  Args:
    kept: prompt index -> int64[k] indices into that prompt's pool, in output order.
  """
  idx, handles, rewards, advs = [], [], [], []
  zero_groups = 0
  for p in sorted(kept):
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
    pool_size=sizes,
    pool_pass_rate=np.where(sampled, pos / np.maximum(sizes, 1), 0.0).astype(np.float32),
  )
  return StepResult(
    prompt_index=cat(idx, np.int32),
    handles=handles,
    rewards=cat(rewards, np.float32),
    advantages=advantages,
    prompt_ids=tuple(prompt_ids),
    stats=stats,
  )


def _select(config: AdaConfig, pool: list[float], rng: np.random.Generator) -> np.ndarray:
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


def _run_seq(config, prompt_ids, draw, rng, est_state, more_prompts):
  b = len(prompt_ids)
  k_pos, k_neg = config.thresholds()
  thr = config.positive_threshold
  pools = _Pools(b)
  active = np.arange(b)
  for _ in range(config.max_rounds):
    if active.size == 0:
      break
    pools.draw_round(draw, np.repeat(active, config.samples_per_round))
    # Exit is checked only at the end of a round: every response of the round joins the
    # pool, even those drawn after the threshold was reached (they were already paid for).
    still = []
    for p in active.tolist():
      n_pos = sum(r > thr for r in pools.rewards[p])
      n_neg = len(pools.rewards[p]) - n_pos
      if not (n_pos >= k_pos and n_neg >= k_neg):
        still.append(p)
    active = np.asarray(still, np.int64)
  # Prompts that never exited stay in the batch; uniform pools get zero advantage.
  kept = {p: _select(config, pools.rewards[p], rng) for p in range(b)}
  return _finish(config, pools, prompt_ids, b, kept), est_state


def _run_est(config, prompt_ids, draw, rng, est_state, more_prompts):
  b = len(prompt_ids)
  state = init_est_state() if est_state is None else est_state
  keys = prompt_keys(prompt_ids)
  p_hat = est_pass_rates(state, keys, config.est_alpha, config.est_beta)
  weights = EST_WEIGHTS[config.est_weight](p_hat)
  counts = allocate_budget(
    weights, config.train_rows(b), config.est_n_min, config.est_n_max, config.est_split
  )
  pools = _Pools(b)
  pools.draw_round(draw, np.repeat(np.arange(b), counts))
  kept = {p: np.arange(len(pools.rewards[p])) for p in range(b)}  # Train on all samples.
  result = _finish(config, pools, prompt_ids, b, kept)
  n_pos = np.asarray(
    [sum(r > config.positive_threshold for r in pool) for pool in pools.rewards], np.float64
  )
  new_state = update_est_state(state, keys, n_pos, counts.astype(np.float64), config.est_decay)
  return result, new_state


_METHOD_FNS = {
  "grpo": _run_grpo,
  "dapo": _run_dapo,
  "pos": _run_seq,
  "balance": _run_seq,
  "est": _run_est,
}


def run_step(
  config: AdaConfig,
  prompt_ids: Sequence[Any],
  draw: DrawFn,
  rng: np.random.Generator,
  est_state: EstState | None = None,
  more_prompts: MorePromptsFn | None = None,
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

  Returns:
    (StepResult, est_state after this step).

  Raises:
    ValueError: no prompts, or `draw` answered with the wrong number of rewards/handles
      or a non-finite reward.
  """
  if len(prompt_ids) == 0:
    raise ValueError("run_step needs at least one prompt")
  config.validate()
  return _METHOD_FNS[config.method](config, list(prompt_ids), draw, rng, est_state, more_prompts)
