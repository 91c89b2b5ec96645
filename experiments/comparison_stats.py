"""Interval estimates of the real-model comparison (experiments/smollm2_learning.py), written
before its data: seeds are the clusters (a seed gives every arm the same prompt order,
initial weights and held-out sampling key), so every interval treats a seed's figures as one
draw.

- `clustered_mean`: a per-step figure averaged per seed, then over seeds; its standard error
  is the spread of the seeds' means (S - 1 degrees of freedom), its interval Student's t.
- `paired_step_difference`: an arm's per-step figure minus the reference arm's on the same
  seed and step; the mean difference and its slope against the step (least squares per
  seed), each with the seed-clustered error of `clustered_mean`.
- `heldout_difference`: held-out Avg@k of an arm minus the reference's from per-problem
  correct counts, paired by seed and problem: each seed's mean difference is one draw, and
  the interval is `clustered_mean`'s t interval over seeds (S - 1 degrees of freedom). A
  bootstrap over three seeds would not do: resampling them has only 10 distinct draws,
  the all-lowest and all-highest each 1/27 > 2.5 %, so its 95 % percentile interval is
  about the range of the seeds and covers a true zero far less often (84 % in a simulation
  of 3 seeds x 300 problems). Beside it, per seed, the within-seed interval of a paired
  bootstrap over problems (`bootstrap_difference`), which is what one seed can say.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats


def clustered_mean(per_seed: Sequence[Sequence[float]], level: float = 0.95) -> dict[str, float]:
  """The mean over seeds of each seed's mean, with its standard error and t interval.

  Args:
    per_seed: one sequence of values per seed (steps, say); empty seeds are refused.
    level: the interval's coverage.

  Returns:
    `mean`, `se` (the standard deviation of the seeds' means / sqrt(S); NaN for one seed),
    `low`, `high` (mean -/+ t_{S-1} se), `seeds`.

  Raises:
    ValueError: no seeds, or a seed without values.
  """
  if not per_seed or any(len(v) == 0 for v in per_seed):
    raise ValueError("clustered_mean needs at least one seed, each with values")
  means = np.array([np.mean(v) for v in per_seed], float)
  s = len(means)
  mean = float(means.mean())
  se = float(means.std(ddof=1) / np.sqrt(s)) if s > 1 else float("nan")
  half = float(stats.t.ppf(0.5 + level / 2, s - 1) * se) if s > 1 else float("nan")
  return {"mean": mean, "se": se, "low": mean - half, "high": mean + half, "seeds": s}


def slope(steps: Sequence[float], values: Sequence[float]) -> float:
  """Least-squares slope of `values` against `steps`.

  Raises:
    ValueError: fewer than two distinct steps, or lengths that differ.
  """
  x, y = np.asarray(steps, float), np.asarray(values, float)
  if x.shape != y.shape or np.unique(x).size < 2:
    raise ValueError("slope needs two or more distinct steps and one value per step")
  return float(np.polyfit(x, y, 1)[0])


def paired_step_difference(
  arm: Mapping[int, Mapping[int, float]],
  reference: Mapping[int, Mapping[int, float]],
  level: float = 0.95,
) -> dict[str, dict[str, float]]:
  """An arm's per-step figure minus the reference arm's, paired by seed and step.

  Args:
    arm, reference: seed -> {step: value}; only seeds and steps both have are compared.
    level: the intervals' coverage.

  Returns:
    `difference` (`clustered_mean` of the per-step differences) and `slope` (of each
    seed's differences against the step, per step, then `clustered_mean` over seeds).

  Raises:
    ValueError: no seed with two or more steps in common.
  """
  diffs, slopes = [], []
  for seed in sorted(set(arm) & set(reference)):
    steps = sorted(set(arm[seed]) & set(reference[seed]))
    if len(steps) < 2:
      continue
    d = [arm[seed][t] - reference[seed][t] for t in steps]
    diffs.append(d)
    slopes.append([slope(steps, d)])
  if not diffs:
    raise ValueError("paired_step_difference: no seed with two or more common steps")
  return {"difference": clustered_mean(diffs, level), "slope": clustered_mean(slopes, level)}


def _paired(
  arm: Mapping[int, Mapping[str, int]], reference: Mapping[int, Mapping[str, int]], k: int
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
  """seed -> (arm, reference) pass rates (correct / k) on the problems both have there."""
  out = {}
  for s in sorted(set(arm) & set(reference)):
    ids = sorted(set(arm[s]) & set(reference[s]))
    if ids:
      out[s] = (
        np.array([arm[s][i] for i in ids], float) / k,
        np.array([reference[s][i] for i in ids], float) / k,
      )
  return out


def bootstrap_difference(
  a: np.ndarray, r: np.ndarray, *, resamples: int = 4000, level: float = 0.95, seed: int = 0
) -> dict[str, float]:
  """One seed's mean paired difference `a - r` (per-problem pass rates) with the percentile
  interval of a bootstrap over problems: the within-seed uncertainty only.

  Raises:
    ValueError: no problems, or arrays of different lengths.
  """
  if a.size == 0 or a.shape != r.shape:
    raise ValueError("bootstrap_difference needs paired, non-empty per-problem arrays")
  d = a - r
  rng = np.random.default_rng(seed)
  draws = d[rng.integers(d.size, size=(resamples, d.size))].mean(1)
  low, high = np.quantile(draws, [0.5 - level / 2, 0.5 + level / 2])
  return {"difference": float(d.mean()), "low": float(low), "high": float(high)}


def heldout_difference(
  arm: Mapping[int, Mapping[str, int]],
  reference: Mapping[int, Mapping[str, int]],
  k: int,
  level: float = 0.95,
) -> dict:
  """Held-out Avg@k of an arm minus the reference's, paired by seed and problem (module
  docstring): the t interval over seeds, and each seed's own bootstrap interval.

  Args:
    arm, reference: seed -> {problem id: correct count of k}; the problems both arms have
      on a seed are compared (the same held-out set and key per seed, so all of them).
    k: samples per problem.
    level: the intervals' coverage.

  Returns:
    `clustered_mean`'s fields for the difference (`mean`, `se`, `low`, `high`, `seeds`;
    NaN se and bounds for one seed), `arm` and `reference` (their Avg@k, mean over seeds),
    `problems` (the fewest a seed compared) and `per_seed` (seed -> `bootstrap_difference`).

  Raises:
    ValueError: no seed with a problem in common.
  """
  pairs = _paired(arm, reference, k)
  if not pairs:
    raise ValueError("heldout_difference: no seed with a problem both arms evaluated")
  out = clustered_mean([a - r for a, r in pairs.values()], level)
  out.update(
    arm=float(np.mean([a.mean() for a, _ in pairs.values()])),
    reference=float(np.mean([r.mean() for _, r in pairs.values()])),
    problems=int(min(a.size for a, _ in pairs.values())),
    per_seed={s: bootstrap_difference(a, r, level=level) for s, (a, r) in pairs.items()},
  )
  return out


def detectable_difference(se: float, seeds: int, level: float = 0.95, power: float = 0.8) -> float:
  """The smallest true difference a two-sided t test at `level` would find with `power`,
  given the standard error `se` of a mean over `seeds` clusters (t_{S-1} quantiles): what
  the comparison could have seen."""
  df = max(seeds - 1, 1)
  return float((stats.t.ppf(0.5 + level / 2, df) + stats.t.ppf(power, df)) * se)
