"""Reinforce-Ada-Est (paper §3.3): its rule (`Est`) and its plan (`Budget`); the settings
(`estimate.EstConfig`, `ada.est`), the estimates and the split are `estimate`'s."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ada_jax.rl import estimate
from ada_jax.rl.estimate import EstConfig
from ada_jax.rl.rules.base import Plan, Rule


@dataclasses.dataclass(frozen=True, kw_only=True)
class Budget(Plan):
  """Est's plan: the K·B budget split over the prompts (`quotas`, `estimate.plan_budget`).

  Attributes:
    est_state: the statistics before the step (`estimate.EstState`).
    keys: uint64[B] the prompts' keys into them.
    p_head: float64[B] the pass-rate head's predictions, or None (`est.estimator='ema'`).
    metrics: the plan's `est/*` metrics.
  """

  est_state: dict
  keys: np.ndarray
  p_head: np.ndarray | None
  metrics: dict[str, float]


class Est(Rule[EstConfig]):
  """Reinforce-Ada-Est (paper §3.3, `estimate`): per-prompt quotas from the pass-rate
  estimates and the K·B budget split before the step, every row trained on, the outcomes
  folded into the statistics after it. Its cross-step state is those statistics
  (`estimate.EstState`: the prompts' decayed counts, and the head's weights)."""

  group = "est"
  settings = EstConfig

  def init_state(self, config):
    return estimate.init_est_state()

  def first_rows(self, ctl, p):
    return ctl.quota[p]

  def train_rows(self, config, num_prompts):
    # Est draws exactly its budget and trains on all of it, so its batch has a fixed size.
    return int(round(config.est.budget_per_prompt * num_prompts))

  def min_rows(self, config):
    return config.est.n_min

  def max_rows(self, config, num_prompts):
    # n_max caps a quota; uncapped (the released split), a hard prompt's quota can near the
    # whole budget, and decode attention would score that many query rows per prompt:
    # twice the mean quota decodes it in waves of that many.
    est = config.est
    return est.n_max or max(est.n_min, 2 * math.ceil(est.budget_per_prompt))

  def needs_features(self, config):
    return config.est.estimator != "ema"

  def plan(self, config, prompt_ids, state, features):
    keys = estimate.prompt_keys(prompt_ids)
    counts, p_head, metrics = estimate.plan_budget(
      config, state, keys, self.train_rows(config, len(prompt_ids)), features
    )
    return Budget(quotas=counts, est_state=state, keys=keys, p_head=p_head, metrics=metrics)

  def fold(self, config, prompt_ids, state, features, plan, result):
    positive = result.rewards > config.positive_threshold
    n_pos = np.bincount(result.prompt_index, weights=positive, minlength=len(prompt_ids))
    new_state, fold = estimate.fold_step(
      config,
      plan.est_state,
      plan.keys,
      n_pos.astype(np.float64),
      plan.quotas.astype(np.float64),
      features,
      plan.p_head,
    )
    stats = dataclasses.replace(result.stats, rule_metrics={**plan.metrics, **fold})
    return dataclasses.replace(result, stats=stats), new_state
