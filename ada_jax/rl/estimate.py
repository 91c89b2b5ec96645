"""Reinforce-Ada-Est: per-prompt pass-rate estimates, the power objective, the K·B budget.

Host-side numpy (the learned estimator's maths is in `pass_rate_head`). The paper frames
Reinforce-Ada as maximising J_f = E_x[f(p_θ(x))] with f = log p or f = p^α; Est spends a
budget of K·B samples per step on the step's B prompts in proportion to f'(p̂_x), where
p̂_x comes from an estimator (arXiv 2510.04996, §3.3):

* ``ema``: decayed Beta-prior counts, p̂ = (a + n_pos)/(a + b + n_tot) (released code). A
  prompt never sampled reads the prior mean a/(a + b).
* ``head``: the learned pass-rate head's prediction from the policy's hidden state at the
  prompt's last token (`pass_rate_head`), so an unseen prompt gets its own estimate.
* ``head+ema``: the head's prediction as the prior mean, the prompt's decayed counts as
  pseudo-counts on top: p̂ = ((a + b)·p_head + n_pos)/(a + b + n_tot).

The state is one flat dict of numpy arrays (checkpointed as a pytree, identical on every
process): ``keys`` int64[P] sorted stable prompt keys, ``pos``/``tot`` float64[P] decayed
counts, and, once a head-based estimator has run, the head's parameters and Adam moments
(``head_*`` entries, `pass_rate_head.STATE_PREFIX`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ada_jax import bounds
from ada_jax.rl import pass_rate_head as head_lib

EstState = dict[str, np.ndarray]
# The per-prompt arrays of an Est state (P entries each, P grows as prompts are seen) and
# their dtypes; the head's `head_*` entries have fixed shapes.
COUNT_FIELDS = {"keys": np.int64, "pos": np.float64, "tot": np.float64}

ESTIMATORS = ("ema", "head", "head+ema")
# How Est turns weights into integer counts (`allocate_budget`).
EST_SPLITS = ("released", "clipped")
# The named objectives: f = log p (f'(p) = 1/p, the α → 0 limit) and f = p^0.5.
OBJECTIVES: dict[str, float] = {"1/p": 0.0, "1/sqrt_p": 0.5}
# Pass-rate bands of the budget-share metrics (`plan_budget`): [0, .1), [.1, .3), ...
BANDS = (0.0, 0.1, 0.3, 0.7, 0.9, 1.0)


def objective_alpha(spec: str | float) -> float:
  """α of the power objective named by `spec`: '1/p' -> 0 (log), '1/sqrt_p' -> 0.5, or a
  number (or its string, as a command-line override gives) in [0, 1].

  Raises:
    ValueError: anything else.
  """
  if isinstance(spec, str) and spec in OBJECTIVES:
    return OBJECTIVES[spec]
  try:
    alpha = float(spec)
  except (TypeError, ValueError):
    alpha = math.nan
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"expected {sorted(OBJECTIVES)} or an exponent alpha in [0, 1]")
  return alpha


def objective_weight(p: np.ndarray | float, alpha: float, p_min: float = 1e-3) -> np.ndarray:
  """The weight f'(p) = p^(α−1) of the power objective J = E[f(p)], f(p) = (p^α − 1)/α.

  This f is p^α scaled by the constant 1/α > 0 and shifted (same maximiser, same
  allocation), and it is continuous in α: α → 0 gives log p and f'(p) = 1/p (the
  released '1/p'), α = 0.5 gives 1/sqrt(p) (the paper's Est weight, also its explicit
  1/sqrt(p̄) advantage weight). The unscaled α·p^(α−1) of E[p^α] would instead vanish as
  α → 0 and halve the paper's advantage weight at α = 0.5. Worked: α = 0.5, p = 0.25 ->
  0.25^(−0.5) = 2.0, i.e. α·p^(α−1) = 1.0 times 1/α.

  p is clipped to [p_min, 1] first: for α < 1 the weight grows without bound as p -> 0, and
  an estimate (or a pool) at exactly 0 would otherwise take the whole budget (or blow up
  the advantages). The EMA estimator never goes below 1/(a + b + n_tot), so its default
  estimates are untouched by the default p_min = 1e-3.

  Args:
    p: float[...] pass rates in [0, 1].
    alpha: the objective's exponent in [0, 1].
    p_min: the clip floor, in (0, 1].

  Returns:
    float64[...] weights, >= 1.
  """
  p = np.clip(np.asarray(p, np.float64), p_min, 1.0)
  return p ** (alpha - 1.0)


@dataclasses.dataclass(frozen=True)
class EstConfig:
  """Reinforce-Ada-Est's settings (`AdaConfig.est`, `ada.est.*` in a config file); the
  defaults are the released code's. Validated on construction.

  Attributes:
    alpha: Beta prior alpha of the pass-rate estimate (1); also the exit-chance rule's
      (`SeqConfig.min_exit_chance`).
    beta: Beta prior beta (16): unseen prompts are presumed hard, p̂ = 1/17.
    decay: lambda, the factor on a prompt's old counts each time it is sampled (Est's
      statistics and the exit-chance rule's).
    budget_per_prompt: K; the step draws round(K * B) samples in all (released: 8,
      compared with GRPO n = 8).
    weight: the objective whose f'(p̂) weights the allocation: '1/p' (α = 0, released
      code), '1/sqrt_p' (α = 0.5, paper) or α in [0, 1] (`objective_alpha`).
    estimator: where p̂ comes from: 'ema' (the decayed counts, released code), 'head' (the
      learned pass-rate head, `pass_rate_head`) or 'head+ema' (the head's prediction as
      the prior mean, the counts as pseudo-counts). The head needs the prompts' hidden
      states (`controller.run_step`'s `features`).
    p_min: p̂ (and p̄) are clipped to [p_min, 1] before f' (1e-3).
    head_lr: the head's Adam learning rate (1e-2).
    head_steps: Adam steps on each step's outcomes (8; 0 freezes the head).
    split: how the budget becomes counts (`allocate_budget`): 'released' (n_min each, the
      rest in proportion to w) or 'clipped' (paper: proportional to w, clipped to
      [n_min, n_max]).
    n_min: at least this many samples per prompt (>= 1; released 1, paper 4).
    n_max: at most this many ('clipped' only; None: no cap; paper 32).

  Raises:
    ValueError: naming the first bad field.
  """

  alpha: float = bounds.within("(0, 1e6]", 1.0)
  beta: float = bounds.within("(0, 1e6]", 16.0)
  decay: float = bounds.within("[0, 1]", 0.9)
  budget_per_prompt: float = bounds.within("(0, 2**16]", 8.0)
  weight: str | float = bounds.within("[0, 10]", "1/p")
  estimator: str = "ema"
  p_min: float = bounds.within("(0, 0.5]", 1e-3)
  head_lr: float = bounds.within("(0, 100]", 1e-2)
  head_steps: int = bounds.within("[0, 10**6]", 8)
  split: str = "released"
  n_min: int = bounds.within("[0, 2**16]", 1)
  n_max: int | None = bounds.within("[1, 2**16]", None)

  def __post_init__(self):
    def bad(field: str, why: str):
      raise ValueError(f"EstConfig.{field}={getattr(self, field)!r}: {why}")

    if not (self.alpha > 0 and self.beta > 0):
      bad("alpha" if not self.alpha > 0 else "beta", "Beta prior needs > 0")
    if not 0 <= self.decay <= 1:
      bad("decay", "lambda must lie in [0, 1]")
    try:
      objective_alpha(self.weight)
    except ValueError as e:
      bad("weight", str(e))
    if self.estimator not in ESTIMATORS:
      bad("estimator", f"expected one of {list(ESTIMATORS)}")
    if not 0 < self.p_min <= 1:
      bad("p_min", "the pass-rate clip floor must lie in (0, 1]")
    if not self.head_lr > 0:
      bad("head_lr", "the head's learning rate must be > 0")
    if not isinstance(self.head_steps, int) or self.head_steps < 0:
      bad("head_steps", "must be an int >= 0")
    if self.split not in EST_SPLITS:
      bad("split", f"expected one of {list(EST_SPLITS)}")
    if self.split == "released" and self.n_max is not None:
      bad("n_max", "the released split has no cap; set split='clipped' or None")
    if self.n_min < 1:
      bad("n_min", "every prompt needs at least one sample")
    if self.budget_per_prompt < self.n_min:
      bad("budget_per_prompt", f"K must be >= n_min={self.n_min}")
    if self.n_max is not None and self.n_max < self.budget_per_prompt:
      bad("n_max", "must be >= budget_per_prompt, or the budget cannot be spent")


# The paper's (v3) Est hybrid as AdaConfig overrides: allocation ∝ f'(p̂) with α = 0.5,
# clipped to [N_min, N_max] = [4, 32], and the same f'(p̄) weight on the advantages.
EST_PAPER: dict[str, Any] = dict(
  est=EstConfig(weight="1/sqrt_p", split="clipped", n_min=4, n_max=32),
  inverse_p_weight="1/sqrt_p",
)


def exit_chance(
  pos: int, neg: int, remaining: int, alpha: float, beta: float, k_pos: int, k_neg: int
) -> float:
  """P(a prompt's pool meets the exit rule once its `remaining` draws are graded).

  The pass rate p has the posterior Beta(alpha, beta) (its prior updated by the prompt's
  graded responses); the positives X among the remaining draws are then beta-binomial,
  and the final pool exits iff pos + X >= k_pos and neg + remaining - X >= k_neg (the rule
  only gains from more responses, so exiting within the budget and exiting at its end
  are the same event). Example: pos 0, neg 8, 24 left, Beta(1, 9), k = (1, 0): 1 - P(no
  positive) = 1 - B(1, 33)/B(1, 9) = 1 - 9/33 = 0.727.

  Args:
    pos, neg: graded positives and negatives so far.
    remaining: draws left in the prompt's budget (R·M minus the graded ones), >= 0.
    alpha, beta: the posterior's parameters, > 0.
    k_pos, k_neg: the exit thresholds.

  Returns:
    A probability in [0, 1].
  """
  lo, hi = max(0, k_pos - pos), remaining - max(0, k_neg - neg)
  if lo > hi:
    return 0.0
  log_norm = math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta)
  total = 0.0
  for x in range(lo, hi + 1):
    log_choose = math.lgamma(remaining + 1) - math.lgamma(x + 1) - math.lgamma(remaining - x + 1)
    log_b = (
      math.lgamma(x + alpha)
      + math.lgamma(remaining - x + beta)
      - math.lgamma(remaining + alpha + beta)
    )
    total += math.exp(log_choose + log_b - log_norm)
  return min(1.0, total)


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
  """An empty Est state (no prompt seen yet, no head)."""
  return {name: np.zeros(0, dtype) for name, dtype in COUNT_FIELDS.items()}


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


def counts(state: EstState, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(pos, tot) float64[B]: each key's decayed counts (zero for an unseen key)."""
  _, pos, tot = _lookup(state, np.asarray(keys, np.int64))
  return pos, tot


def est_pass_rates(
  state: EstState, keys: np.ndarray, alpha: float, beta: float, prior: np.ndarray | None = None
) -> np.ndarray:
  """Posterior-mean pass rates p̂ = (alpha + n_pos) / (alpha + beta + n_tot).

  Reference: paper §3.3 (Reinforce-Ada-Est), prior Beta(1, 16) by default, so an unseen
  prompt reads p̂ = 1/17 and p̂ is never 0 or 1. With `prior` (the head's prediction,
  'head+ema'), the prior's mean is `prior` and its strength stays alpha + beta:
  p̂ = ((alpha + beta)·prior + n_pos)/(alpha + beta + n_tot).

  Args:
    state: Est state (see `EstState`).
    keys: int64[B] prompt keys.
    alpha: Beta prior alpha.
    beta: Beta prior beta.
    prior: float[B] prior means in [0, 1], or None for alpha / (alpha + beta).

  Returns:
    float64[B] in [0, 1] ((0, 1) without `prior`).
  """
  _, pos, tot = _lookup(state, np.asarray(keys, np.int64))
  a = alpha if prior is None else (alpha + beta) * np.asarray(prior, np.float64)
  return (a + pos) / (alpha + beta + tot)


def update_est_state(
  state: EstState, keys: np.ndarray, n_pos: np.ndarray, n_tot: np.ndarray, decay: float
) -> EstState:
  """Folds one step's counts into the state: c <- decay * c + new, per sampled prompt.

  Decay applies when a prompt is sampled again (once per step even if its key repeats
  within the step), so estimates track a policy that moved since the prompt was last
  seen. Returns a new state (other entries, e.g. the head's, carried over); the input is
  not modified.

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
  out = {k: v for k, v in state.items() if k not in ("keys", "pos", "tot")}
  out.update(keys=all_keys[order], pos=all_pos[order], tot=all_tot[order])
  return out


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


def plan_budget(
  config, state: EstState, keys: np.ndarray, budget: int, features: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None, dict[str, float]]:
  """Est's sampling plan for one step: p̂ per prompt from `config.est.estimator`, then
  counts ∝ f'(p̂) (`objective_weight` with α = `objective_alpha(config.est.weight)`).

  Args:
    config: an `AdaConfig` with method 'est'.
    state: Est state (a head-based estimator's head is created on first use).
    keys: int64[B] prompt keys.
    budget: round(K·B) samples to split.
    features: float32[B, d] hidden states of the prompts (`pass_rate_head`), required by
      'head' and 'head+ema', ignored by 'ema'.

  Returns:
    (int64[B] counts, float64[B] the head's predictions or None, metrics): the metrics
    give the share of the budget going to each p̂ band (`est/budget_share_p<hi>`) and the
    mean p̂.

  Raises:
    ValueError: a head-based estimator without `features` of B rows.
  """
  p_head = None
  if config.est.estimator == "ema":
    p_hat = est_pass_rates(state, keys, config.est.alpha, config.est.beta)
  else:
    if features is None or np.shape(features)[0] != keys.size:
      raise ValueError(
        f"est.estimator={config.est.estimator!r} needs features float32[{keys.size}, d] "
        "(the prompts' hidden states); got "
        f"{None if features is None else np.shape(features)}"
      )
    params = head_lib.params_from_state(state, np.shape(features)[1], config)
    p_head = head_lib.predict(params, features)
    prior = p_head if config.est.estimator == "head+ema" else None
    p_hat = (
      p_head
      if prior is None
      else est_pass_rates(state, keys, config.est.alpha, config.est.beta, prior)
    )
  weights = objective_weight(p_hat, objective_alpha(config.est.weight), config.est.p_min)
  counts = allocate_budget(weights, budget, config.est.n_min, config.est.n_max, config.est.split)
  band = np.digitize(np.clip(p_hat, 0, 1 - 1e-12), BANDS[1:-1])
  metrics = {
    f"est/budget_share_p<{hi:g}": float(counts[band == i].sum() / max(budget, 1))
    for i, hi in enumerate(BANDS[1:])
  }
  metrics["est/p_hat_mean"] = float(p_hat.mean())
  return counts, p_head, metrics


def fold_step(
  config,
  state: EstState,
  keys: np.ndarray,
  n_pos: np.ndarray,
  n_tot: np.ndarray,
  features: np.ndarray | None,
  p_head: np.ndarray | None,
) -> tuple[EstState, dict[str, float]]:
  """Est's state after one step: counts folded in (`update_est_state`) and, for a
  head-based estimator, the head scored on the step's outcomes before training on them
  (Brier score, expected calibration error, `pass_rate_head.calibration`) and then
  trained on them (`pass_rate_head.train_head`).

  Returns:
    (the new state, metrics 'est/head_brier', 'est/head_ece', 'est/head_loss').
  """
  new_state = update_est_state(state, keys, n_pos, n_tot, config.est.decay)
  if p_head is None:
    return new_state, {}
  metrics = {f"est/head_{k}": v for k, v in head_lib.calibration(p_head, n_pos, n_tot).items()}
  head_state, loss = head_lib.train_head(
    head_lib.head_state(state, np.shape(features)[1], config),
    features,
    n_pos,
    n_tot,
    lr=config.est.head_lr,
    steps=config.est.head_steps,
  )
  new_state.update(head_state)
  metrics["est/head_loss"] = loss
  return new_state, metrics
