"""Per-prompt pure functions of Reinforce-Ada: response selection, advantages, Est budgets.

Pure numpy helpers used by the sampling controller (`ada_jax.adaptive`):

* `select_group`: the "half-then-fill" choice of the n training responses out of a
  prompt's pool (Reinforce-Ada-Seq, docs/design.md "Algorithm").
* `group_advantages`: A_i = r_i - mean, with the mean taken over the prompt's WHOLE pool
  ("global normalization", paper §3) or over the kept group only (GRPO's local
  statistics), an optional division by the standard deviation (+eps), and an optional
  explicit 1/p̄ or 1/sqrt(p̄) weight (paper v3).
* Reinforce-Ada-Est: decayed Beta-prior pass-rate estimates per prompt (`EstState`,
  `est_pass_rates`, `update_est_state`) and the exact integer split of the K*B budget
  (`allocate_budget`: the released rule or the paper's clipped one).

Strategies are plain functions in name->function tables chosen by config strings.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# Which rewards the baseline statistics come from: the whole pool (Reinforce-Ada's global
# normalization) or only the kept responses (GRPO's group statistics). Arguments are
# (selected_rewards, pool_rewards).
BASELINES: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
  "global": lambda selected, pool: pool,
  "local": lambda selected, pool: selected,
}

# Explicit pass-rate weights multiplied onto the advantage; argument is p̄ > 0.
P_WEIGHTS: dict[str, Callable[[float], float]] = {
  "none": lambda p: 1.0,
  "1/p": lambda p: 1.0 / p,
  "1/sqrt_p": lambda p: 1.0 / math.sqrt(p),
}


def select_group(
  pool_rewards: np.ndarray,
  n: int,
  positive_threshold: float = 0.5,
  rng: np.random.Generator | None = None,
) -> np.ndarray:
  """Chooses the n training responses of one prompt from its pool (half-then-fill).

  Takes kp = min(floor(n/2), P) positives and kn = min(n - kp, N) negatives; if
  kp + kn < n the rest is filled from whichever class still has unused responses,
  positives first. The kept group is therefore mixed whenever the pool is mixed (n >= 2)
  and has min(n, pool size) members. Reference: docs/design.md "Algorithm" (Reinforce-Ada-Seq
  selection); the released code keeps the earliest responses of each class.

  Args:
    pool_rewards: float[P] rewards of the pool in arrival order.
    n: target group size, >= 1.
    positive_threshold: a response is positive when its reward is > this value.
    rng: when given, the kept members of each class are a uniformly random subset
      instead of the earliest ones.

  Returns:
    int64[min(n, P)] indices into `pool_rewards`: positives first, then negatives,
    each in arrival order (or random order when `rng` is given).
  """
  rewards = np.asarray(pool_rewards)
  pos = np.flatnonzero(rewards > positive_threshold)
  neg = np.flatnonzero(~(rewards > positive_threshold))
  if rng is not None:
    pos = rng.permutation(pos)
    neg = rng.permutation(neg)
  kp = min(n // 2, pos.size)
  kn = min(n - kp, neg.size)
  short = n - kp - kn
  if short > 0:
    extra = min(short, pos.size - kp)
    kp += extra
    kn += min(short - extra, neg.size - kn)
  return np.concatenate([pos[:kp], neg[:kn]]).astype(np.int64)


def group_advantages(
  selected_rewards: np.ndarray,
  pool_rewards: np.ndarray,
  *,
  baseline: str = "global",
  std_normalize: bool = False,
  eps: float = 1e-6,
  p_weight: str = "none",
) -> np.ndarray:
  """Advantages of one prompt's kept responses.

  A_i = (r_i - mean) [/ (std + eps)] [* w(mean)], where mean and std come from the
  source chosen by `baseline` ("global": the prompt's whole pool for this step, all
  rounds; "local": the kept group). std is the unbiased (ddof=1) sample standard
  deviation, as in verl's GRPO advantage (`torch.std`). A one-element source has mean 0
  and std 1, as in verl (`compute_grpo_outcome_advantage`), so a prompt with a single
  sample (Reinforce-Ada-Est) gets A = r, not 0. A uniform source of two or more gives
  exactly zero advantages, so the std division never blows up.
  Reference: paper §3 "global normalization"; explicit 1/p̄ (1/sqrt p̄) weight: paper v3
  (Reinforce-Ada-Est uses 1/sqrt p̄). Worked examples: pool of 8 with 2 correct,
  p̄ = 0.25, kept 2+2 -> +0.75, +0.75, -0.25, -0.25; GRPO's group [1, 0, 0, 0] with
  `std_normalize` (std 0.5) -> [1.5, -0.5, -0.5, -0.5] (up to eps).

  Args:
    selected_rewards: float[k] rewards of the kept responses.
    pool_rewards: float[P] rewards of every response drawn for the prompt this step.
    baseline: key of `BASELINES`.
    std_normalize: divide by (std + eps).
    eps: the std offset.
    p_weight: key of `P_WEIGHTS`; p̄ is the mean reward of the baseline source (the pass
      rate for 0/1 rewards), floored at eps.

  Returns:
    float32[k] advantages.

  Raises:
    ValueError: unknown `baseline` or `p_weight`, or an empty pool.
  """
  if baseline not in BASELINES:
    raise ValueError(f"baseline must be one of {sorted(BASELINES)}, got {baseline!r}")
  if p_weight not in P_WEIGHTS:
    raise ValueError(f"p_weight must be one of {sorted(P_WEIGHTS)}, got {p_weight!r}")
  selected = np.asarray(selected_rewards, np.float64)
  pool = np.asarray(pool_rewards, np.float64)
  if pool.size == 0:
    raise ValueError("group_advantages needs a non-empty pool")
  source = BASELINES[baseline](selected, pool)
  single = source.size <= 1  # verl: a lone sample's group has mean 0 and std 1
  mean = 0.0 if single else float(source.mean())
  adv = selected - mean
  if std_normalize:
    adv = adv / ((1.0 if single else float(source.std(ddof=1))) + eps)
  p_bar = float(source.mean()) if source.size else 0.0
  adv = adv * P_WEIGHTS[p_weight](max(p_bar, eps))
  return adv.astype(np.float32)


# --- Reinforce-Ada-Est: how many responses each prompt gets ---------------------------
#
# Est state is a plain dict of numpy arrays, so it checkpoints as an ordinary pytree:
#   keys: int64[P] sorted stable prompt keys (see `prompt_keys`),
#   pos:  float64[P] decayed count of positive responses,
#   tot:  float64[P] decayed count of all responses.
EstState = dict[str, np.ndarray]

# Sampling weight w(p̂): released code 1/p̂; paper v3 1/sqrt(p̂) (with [N_min, N_max] clipping).
EST_WEIGHTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
  "1/p": lambda p: 1.0 / p,
  "1/sqrt_p": lambda p: 1.0 / np.sqrt(p),
}


def prompt_keys(prompt_ids: Sequence[Any]) -> np.ndarray:
  """Stable int64 keys for prompt ids (8-byte BLAKE2b of str(id)); same on every host.

  Python's `hash` is salted per process, so it cannot key state shared across hosts or
  restored from a checkpoint.

  Args:
    prompt_ids: B prompt ids (anything with a stable `str`).

  Returns:
    int64[B].
  """
  return np.asarray(
    [
      int.from_bytes(
        hashlib.blake2b(str(i).encode(), digest_size=8).digest(), "little", signed=True
      )
      for i in prompt_ids
    ],
    np.int64,
  ).reshape(-1)


def init_est_state() -> EstState:
  """An empty Est state (no prompt seen yet)."""
  return {"keys": np.zeros(0, np.int64), "pos": np.zeros(0), "tot": np.zeros(0)}


def _lookup(state: EstState, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(found bool[B], pos float64[B], tot float64[B]); unseen keys read as zero counts."""
  for name in ("keys", "pos", "tot"):
    if name not in state:
      raise ValueError(f"Est state lacks field {name!r}; expected keys, pos, tot")
  table = np.asarray(state["keys"], np.int64)
  if table.size == 0:
    zeros = np.zeros(keys.shape)
    return np.zeros(keys.shape, bool), zeros, zeros
  at = np.minimum(np.searchsorted(table, keys), table.size - 1)
  found = table[at] == keys
  pos = np.where(found, np.asarray(state["pos"], np.float64)[at], 0.0)
  tot = np.where(found, np.asarray(state["tot"], np.float64)[at], 0.0)
  return found, pos, tot


def est_pass_rates(state: EstState, keys: np.ndarray, alpha: float, beta: float) -> np.ndarray:
  """Posterior-mean pass rates p̂ = (alpha + n_pos) / (alpha + beta + n_tot).

  Reference: paper §3.3 (Reinforce-Ada-Est), prior Beta(1, 16) by default, so an unseen
  prompt reads p̂ = 1/17 and p̂ is never 0 or 1.

  Args:
    state: Est state (see `EstState`).
    keys: int64[B] prompt keys.
    alpha: Beta prior alpha.
    beta: Beta prior beta.

  Returns:
    float64[B] in (0, 1).
  """
  _, pos, tot = _lookup(state, np.asarray(keys, np.int64))
  return (alpha + pos) / (alpha + beta + tot)


def update_est_state(
  state: EstState, keys: np.ndarray, n_pos: np.ndarray, n_tot: np.ndarray, decay: float
) -> EstState:
  """Folds one step's counts into the state: c <- decay * c + new, per sampled prompt.

  Decay applies when a prompt is sampled again (once per step even if its key repeats
  within the step), so estimates track a policy that moved since the prompt was last
  seen. Returns a new state; the input is not modified.

  Args:
    state: Est state.
    keys: int64[B] prompt keys of this step (may repeat).
    n_pos: float[B] positives drawn for each entry this step.
    n_tot: float[B] responses drawn for each entry this step.
    decay: lambda in [0, 1].

  Returns:
    The new Est state, keys sorted.
  """
  uniq, inv = np.unique(np.asarray(keys, np.int64), return_inverse=True)
  add_pos = np.zeros(uniq.size)
  add_tot = np.zeros(uniq.size)
  np.add.at(add_pos, inv, np.asarray(n_pos, np.float64))
  np.add.at(add_tot, inv, np.asarray(n_tot, np.float64))
  _, old_pos, old_tot = _lookup(state, uniq)
  keep = ~np.isin(np.asarray(state["keys"], np.int64), uniq)
  all_keys = np.concatenate([np.asarray(state["keys"], np.int64)[keep], uniq])
  all_pos = np.concatenate([np.asarray(state["pos"], np.float64)[keep], decay * old_pos + add_pos])
  all_tot = np.concatenate([np.asarray(state["tot"], np.float64)[keep], decay * old_tot + add_tot])
  order = np.argsort(all_keys, kind="stable")
  return {"keys": all_keys[order], "pos": all_pos[order], "tot": all_tot[order]}


# How Est turns weights into integer counts (`allocate_budget`).
EST_SPLITS = ("released", "clipped")


def allocate_budget(
  weights: np.ndarray,
  budget: int,
  n_min: int = 1,
  n_max: int | None = None,
  split: str = "released",
) -> np.ndarray:
  """Splits an integer budget over prompts by weight: Reinforce-Ada-Est's allocation.

  * ``released`` (the authors' released code): every prompt first gets n_min, the other
    budget - B * n_min samples are shared in proportion to the weights, x_i = n_min +
    (budget - B * n_min) * w_i / sum(w); `n_max` must be None. Example: weights 21/5 and
    21, budget 8, n_min 1 -> x = [2.0, 6.0] -> [2, 6].
  * ``clipped`` (paper v3, with [N_min, N_max] = [4, 32]): x_i = clip(c * w_i, n_min,
    n_max) with the scale c (found by bisection) that makes sum(x) = budget.

  Both round by largest remainder: every prompt gets floor(x_i) and the leftover units go
  to the largest fractional parts (ties: the larger weight, then the lower index), never
  past n_max. So the counts sum exactly to the budget, each lies in [n_min, n_max], and a
  larger weight never gets fewer samples.

  Args:
    weights: float[B] positive weights.
    budget: total samples, B * n_min <= budget <= B * n_max.
    n_min: per-prompt minimum, >= 0.
    n_max: per-prompt maximum ('clipped' only), or None for none.
    split: 'released' or 'clipped' (see above).

  Returns:
    int64[B] counts summing to `budget`.

  Raises:
    ValueError: non-positive or non-finite weights, an infeasible budget, an unknown
      `split`, or an `n_max` with the 'released' split.
  """
  if split not in EST_SPLITS:
    raise ValueError(f"split must be one of {list(EST_SPLITS)}, got {split!r}")
  if split == "released" and n_max is not None:
    raise ValueError("the 'released' split has no per-prompt maximum; use split='clipped'")
  w = np.asarray(weights, np.float64)
  b = w.size
  if b == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
    raise ValueError("allocate_budget needs a non-empty array of finite positive weights")
  hi = math.inf if n_max is None else float(n_max)
  if not b * n_min <= budget <= b * hi:
    raise ValueError(
      f"budget={budget} cannot be split over {b} prompts within [{n_min}, {n_max}] each"
    )
  if split == "released":
    x = n_min + (budget - b * n_min) * (w / w.sum())
  else:
    total = lambda c: np.clip(c * w, n_min, hi).sum()
    lo_c, hi_c = 0.0, budget / w.min()
    for _ in range(200):
      mid = 0.5 * (lo_c + hi_c)
      lo_c, hi_c = (mid, hi_c) if total(mid) < budget else (lo_c, mid)
    x = np.clip(hi_c * w, n_min, hi)
  counts = np.floor(x + 1e-9).astype(np.int64)
  frac = x - counts
  left = budget - int(counts.sum())
  # The continuous sum is within rounding of the budget, so `left` is small; the loops
  # settle any remainder exactly while respecting the bounds.
  while left > 0:
    room = np.flatnonzero(counts < hi)
    give = room[np.lexsort((-w[room], -frac[room]))][:left]
    counts[give] += 1
    frac[give] = -1.0
    left -= give.size
  while left < 0:
    room = np.flatnonzero(counts > n_min)
    take = room[np.lexsort((w[room], frac[room]))][:-left]
    counts[take] -= 1
    frac[take] = 2.0
    left += take.size
  return counts
