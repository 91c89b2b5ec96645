"""The sampling methods as rules: one entry of `RULES` per method, each rule in its own module
with its settings group, its books and its cross-step state (docs/design.md "Adding a
sampling method"). `base` holds what they share: `AdaConfig`, `Rule` (GRPO), `Plan`.

Methods (`AdaConfig.method`, run by `controller.run_step`):

* ``grpo`` (`base.Rule`): n responses per prompt in one pass, local group statistics.
* ``dapo`` (`dapo.Dapo`, `ada.dapo`): n per prompt; groups with uniform rewards are dropped
  and further prompts are drawn (``more_prompts``) until B mixed groups are collected or
  the cap on extra prompts is hit (DAPO dynamic sampling).
* ``pos`` / ``balance`` (`seq.Seq`, Reinforce-Ada-Seq, `ada.seq`): rounds of M responses per
  active prompt; a prompt retires at the end of the first round whose pool meets its exit
  rule (>= k_pos positives and >= k_neg negatives); at most R rounds; n kept by the
  half-then-fill rule; advantages from the whole pool (global normalization).
* ``est`` (`est.Est`, Reinforce-Ada-Est, `ada.est`, `ada_jax.rl.estimate`): per-prompt
  pass-rate estimates p̂ (decayed Beta-prior counts keyed by a stable prompt id, a learned
  head on the prompt's hidden state, or both); a K*B budget split by the power objective's
  weight f'(p̂); one pass; all samples kept. Defaults are the released code's: K = 8, EMA
  estimates, w = 1/p̂, every prompt 1 sample and the rest shared by weight, a
  single-sample prompt's advantage A = r. The paper's hybrid is `EST_PAPER`.

A rule answers the questions the one controller (`controller.Controller`) asks about a
prompt, the same under both schedules (`first_rows`, `decide`, `after_boundary`, `select`;
`plan` / `fold` around the step). Host-side numpy; every decision is a function of the
rewards and the row order alone, never of timing, so every process of a multi-host run
decides the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ada_jax.rl.estimate import EST_PAPER, EstConfig
from ada_jax.rl.rules.base import GROUPS, SCHEDULES, AdaConfig, Plan, Rule, declare_group
from ada_jax.rl.rules.dapo import Dapo, DapoConfig, DapoState
from ada_jax.rl.rules.est import Budget, Est
from ada_jax.rl.rules.seq import BATCH_ORDERS, SELECTIONS, Balance, Priors, Seq, SeqConfig, SeqState

__all__ = [
  "AdaConfig",
  "BATCH_ORDERS",
  "Balance",
  "Budget",
  "Dapo",
  "DapoConfig",
  "DapoState",
  "EST_PAPER",
  "Est",
  "EstConfig",
  "GROUPS",
  "Plan",
  "Priors",
  "RULES",
  "Rule",
  "SCHEDULES",
  "SELECTIONS",
  "Seq",
  "SeqConfig",
  "SeqState",
  "declare_group",
  "pool_meets_exit",
  "rule_for",
  "thresholds",
]

# The sampling methods, by `AdaConfig.method`. A new method is an entry here (a rule
# above or a subclass) in its own module: docs/design.md "Adding a sampling method".
RULES: dict[str, Rule] = {
  "grpo": Rule(),
  "dapo": Dapo(),
  "pos": Seq(lambda n: (1, 0)),  # one positive suffices
  "balance": Balance(),  # half positives, half negatives
  "est": Est(),
}


def rule_for(config: AdaConfig) -> Rule:
  """The rule of `config.method`, once it has checked that it can run `config`
  (`Rule.check`: the settings that depend on each other, such as Seq's M·R >= n).

  Raises:
    ValueError: an unknown method, or settings the rule cannot run, naming the field
      (`AdaConfig.method=...`, `AdaConfig.seq.samples_per_round=...`).
  """
  rule = RULES.get(config.method)
  if rule is None:
    raise ValueError(
      f"AdaConfig.method={config.method!r}: unknown method, expected one of {list(RULES)} "
      "(a rule in a module of its own joins the table when that module is imported, e.g. "
      "by the config file)"
    )

  def bad(field: str, why: str):
    value = config
    for part in field.split("."):
      value = getattr(value, part)
    raise ValueError(f"AdaConfig.{field}={value!r}: {why}")

  rule.check(config, bad)
  return rule


def thresholds(config: AdaConfig) -> tuple[int, int]:
  """(k_pos, k_neg) of a config: `seq.k_pos` and `seq.k_neg`, or where None its Seq rule's
  defaults as functions of n (`Seq.thresholds`; `balance`'s for a method without them)."""
  rule = RULES.get(config.method)
  return (rule if getattr(rule, "has_exit_rule", False) else RULES["balance"]).thresholds(config)


def pool_meets_exit(
  rewards: Sequence[float] | np.ndarray, config, min_pool: int | None = None
) -> bool:
  """The Reinforce-Ada-Seq exit rule on one prompt's pool of graded responses.

  True when the pool holds >= `min_pool` responses, >= k_pos positives and >= k_neg
  negatives (positive: reward > `positive_threshold`). Under `rounds` the pool is checked
  at the end of each round and the size condition always holds when the others do
  (`Seq.check` requires max(M, k_pos + k_neg) >= n), so this is the released rule there;
  under `stream` it keeps a prompt from exiting on fewer than n responses.
  Reference: paper §3 (successive elimination); released `pos` k = (1, 0), `balance`
  (n/2, n/2).

  Args:
    rewards: float[P] rewards of the prompt's graded responses (any order).
    config: an `AdaConfig` of a Seq method (its thresholds, n and positive_threshold).
    min_pool: the fewest responses an exiting pool holds; None: n.

  Raises:
    ValueError: `config.method` has no exit rule.
  """
  rule = RULES.get(config.method)
  if not getattr(rule, "has_exit_rule", False):
    seq = [m for m, r in RULES.items() if r.has_exit_rule]
    raise ValueError(f"config.method={config.method!r}: the exit rule is for {seq}")
  return rule.meets_exit(rewards, config, min_pool)
