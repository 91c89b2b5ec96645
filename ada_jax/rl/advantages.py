"""Per-prompt pure functions of Reinforce-Ada: response selection and advantages.

Pure numpy helpers used by the sampling controller (`ada_jax.rl.controller`):

* `select_group`: the "half-then-fill" choice of the n training responses out of a
  prompt's pool (Reinforce-Ada-Seq, docs/design.md "Algorithm").
* `group_advantages`: A_i = r_i - mean, with the mean taken over the prompt's WHOLE pool
  ("global normalization", paper §3) or over the kept group only (GRPO's local
  statistics), an optional division by the standard deviation (+eps), and an optional
  explicit weight f'(p̄) of the power objective (paper v3: 1/p̄, 1/sqrt(p̄);
  `estimate.objective_weight`).

Reinforce-Ada-Est's estimates and budget split are in `ada_jax.rl.estimate`.

Strategies are plain functions in name->function tables chosen by config strings.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ada_jax.rl.estimate import objective_alpha, objective_weight

# Which rewards the baseline statistics come from: the whole pool (Reinforce-Ada's global
# normalization) or only the kept responses (GRPO's group statistics). Arguments are
# (selected_rewards, pool_rewards).
BASELINES: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
  "global": lambda selected, pool: pool,
  "local": lambda selected, pool: selected,
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
  p_weight: str | float = "none",
) -> np.ndarray:
  """Advantages of one prompt's kept responses.

  A_i = (r_i - mean) [/ (std + eps)] [* f'(mean)], where mean and std come from the
  source chosen by `baseline` ("global": the prompt's whole pool for this step, all
  rounds; "local": the kept group). std is the unbiased (ddof=1) sample standard
  deviation, as in verl's GRPO advantage (`torch.std`). A one-element source has mean 0
  and std 1, as in verl (`compute_grpo_outcome_advantage`), so a prompt with a single
  sample (Reinforce-Ada-Est) gets A = r, not 0. A uniform source of two or more gives
  exactly zero advantages, so the std division never blows up.
  Reference: paper §3 "global normalization"; explicit weight f'(p̄) = p̄^(α−1) of the
  power objective (`estimate.objective_weight`; α = 0: 1/p̄, the log objective), paper v3
  (Reinforce-Ada-Est: α = 0.5, i.e. 1/sqrt p̄). Worked examples: pool of 8 with 2 correct,
  p̄ = 0.25, kept 2+2 -> +0.75, +0.75, -0.25, -0.25; GRPO's group [1, 0, 0, 0] with
  `std_normalize` (std 0.5) -> [1.5, -0.5, -0.5, -0.5] (up to eps).

  Args:
    selected_rewards: float[k] rewards of the kept responses.
    pool_rewards: float[P] rewards of every response drawn for the prompt this step.
    baseline: key of `BASELINES`.
    std_normalize: divide by (std + eps).
    eps: the std offset.
    p_weight: 'none', or the objective as `estimate.objective_alpha` reads it ('1/p' =
      α 0, '1/sqrt_p' = α 0.5, or α in [0, 1]); p̄ is the mean reward of the baseline
      source (the pass rate for 0/1 rewards), clipped to [eps, 1].

  Returns:
    float32[k] advantages.

  Raises:
    ValueError: unknown `baseline` or `p_weight`, or an empty pool.
  """
  if baseline not in BASELINES:
    raise ValueError(f"baseline must be one of {sorted(BASELINES)}, got {baseline!r}")
  try:
    alpha = None if p_weight == "none" else objective_alpha(p_weight)
  except ValueError as e:
    raise ValueError(f"p_weight={p_weight!r}: {e} or 'none'") from None
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
  if alpha is not None:
    adv = adv * float(objective_weight(p_bar, alpha, p_min=eps))
  return adv.astype(np.float32)
