"""The sampling controller's configuration, `AdaConfig`: which method, which schedule, what
every method shares, and each family's own settings group (`SeqConfig`, `DapoConfig`,
`estimate.EstConfig`; docs/design.md "Algorithm", "Adding a sampling method"). It sits
below the rules and the controller that read it.

Methods (`AdaConfig.method`, one rule each in `rules.RULES`, run by `controller.run_step`):

* ``grpo``: n responses per prompt in one pass, local group statistics.
* ``dapo``: n per prompt; groups with uniform rewards are dropped and further prompts
  are drawn (``more_prompts``) until B mixed groups are collected or the cap on extra
  prompts is hit (DAPO dynamic sampling).
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
"""

from __future__ import annotations

import dataclasses

from ada_jax import bounds
from ada_jax.rl import advantages as adv_lib
from ada_jax.rl import estimate
from ada_jax.rl.estimate import EST_PAPER, EstConfig

__all__ = [
  "AdaConfig",
  "BATCH_ORDERS",
  "DapoConfig",
  "EST_PAPER",
  "EstConfig",
  "SCHEDULES",
  "SELECTIONS",
  "SeqConfig",
]

SCHEDULES = ("rounds", "stream")
SELECTIONS = ("first", "random")
BATCH_ORDERS = ("exit", "prompt")


def _refuse(cls: str, obj, field: str, why: str):
  raise ValueError(f"{cls}.{field}={getattr(obj, field)!r}: {why}")


@dataclasses.dataclass(frozen=True)
class SeqConfig:
  """Reinforce-Ada-Seq's settings (`AdaConfig.seq`, `ada.seq.*` in a config file; the
  rules `rules.Seq`: pos, balance). Validated on construction; what depends on n as well
  (M·R >= n, the thresholds' defaults) is `rules.Seq.check`'s.

  Attributes:
    samples_per_round: M, responses drawn per active prompt per round.
    max_rounds: R, rounds at most; each prompt gets M..R*M samples.
    k_pos: exit needs >= k_pos positives. None: 1 for pos, floor(n/2) for balance.
    k_neg: exit needs >= k_neg negatives. None: 0 for pos, n - floor(n/2) for balance.
    selection: 'first' keeps the earliest responses of each class (released code);
      'random' a uniformly random subset drawn from the step's Generator.
    batch_order: how the kept groups are laid out in the training batch, whose
      mini-batches are cut contiguously: 'exit' (released: verl concatenates the groups
      as prompts exit, round 1's first, the never-exited last, so on a hard mix the last
      mini-batches hold little signal; ties in prompt order, where the released code
      iterates a Python set) or 'prompt' (the step's prompt order, which spreads every
      round's exits over all mini-batches).
    min_exit_chance: beyond the paper (0 = off, the released behaviour): stop drawing for
      a prompt once the chance that it meets the exit rule within its remaining budget
      (R·M responses in all) falls below this probability, e.g. 0.05 = "stop when
      P(exit within the budget) < 5%" (`estimate.exit_chance`); a stopped prompt is
      trained on as one that never exits. The chance comes from a Beta posterior on its
      pass rate: prior Beta(est.alpha, est.beta) plus its decayed counts from earlier
      steps (the Est statistics, kept with `est.decay` and checkpointed), updated by this
      step's graded responses.

  Raises:
    ValueError: naming the bad field.
  """

  samples_per_round: int = bounds.within("[1, 2**16]", 8)
  max_rounds: int = bounds.within("[1, 2**10]", 4)
  k_pos: int | None = bounds.within("[0, 2**16]", None)
  k_neg: int | None = bounds.within("[0, 2**16]", None)
  selection: str = "first"
  batch_order: str = "exit"
  min_exit_chance: float = bounds.within("[0, 1]", 0.0)

  def __post_init__(self):
    bad = lambda field, why: _refuse("SeqConfig", self, field, why)
    if self.samples_per_round < 1:
      bad("samples_per_round", "M must be >= 1")
    if self.max_rounds < 1:
      bad("max_rounds", "R must be >= 1")
    for field in ("k_pos", "k_neg"):
      if getattr(self, field) is not None and getattr(self, field) < 0:
        bad(field, "must be >= 0 or None")
    if self.selection not in SELECTIONS:
      bad("selection", f"expected one of {list(SELECTIONS)}")
    if self.batch_order not in BATCH_ORDERS:
      bad("batch_order", f"expected one of {list(BATCH_ORDERS)}")
    if not 0.0 <= self.min_exit_chance < 1.0:
      bad("min_exit_chance", "a probability in [0, 1): 0 is off")

  @property
  def budget(self) -> int:
    """R·M, the most responses a prompt draws in a step."""
    return self.samples_per_round * self.max_rounds


@dataclasses.dataclass(frozen=True)
class DapoConfig:
  """DAPO's settings (`AdaConfig.dapo`, `ada.dapo.*` in a config file; the rule
  `rules.Dapo`). Validated on construction.

  Attributes:
    max_extra_passes: cap on extra generation passes after the first.
    prompts_per_pass: prompts requested from `more_prompts` per extra pass; None: B, the
      step's prompt count (verl draws a whole generation batch).

  Raises:
    ValueError: naming the bad field.
  """

  max_extra_passes: int = bounds.within("[0, 2**10]", 4)
  prompts_per_pass: int | None = bounds.within("[1, ROWS]", None)

  def __post_init__(self):
    bad = lambda field, why: _refuse("DapoConfig", self, field, why)
    if self.max_extra_passes < 0:
      bad("max_extra_passes", "must be >= 0")
    if self.prompts_per_pass is not None and self.prompts_per_pass < 1:
      bad("prompts_per_pass", "must be >= 1 or None")


@dataclasses.dataclass(frozen=True)
class AdaConfig:
  """The sampling controller's settings: the method, the schedule, what every method shares
  (group size, reward threshold, advantages) and each method's own group. Each field is
  validated on construction; whether the method exists and can run these settings is its
  rule's to say (`rules.rule_for`, which the controller and `config.parse` call).

  Attributes:
    method: a key of `rules.RULES`: 'grpo' | 'dapo' | 'pos' | 'balance' | 'est'.
    schedule: 'rounds' (`controller.drive_rounds`: the released barriers, a prompt retires at the
      end of a round) or 'stream' (`controller.drive_stream`: exits decided as responses
      finish, grading overlapped with decoding).
    n: responses kept per prompt (grpo/dapo: drawn per prompt). Not used by est.
    positive_threshold: a response is positive when reward > this (0/1 rewards: 0.5).
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
    seq: Seq's settings (`SeqConfig`: M, R, the exit thresholds, selection, batch order,
      the exit-chance rule).
    dapo: DAPO's settings (`DapoConfig`).
    est: Est's settings (`estimate.EstConfig`), whose prior and decay the exit-chance rule
      also reads.

  Raises:
    ValueError: naming the bad field.
  """

  method: str = "pos"
  schedule: str = "rounds"
  n: int = bounds.within("[1, 2**16]", 4)
  positive_threshold: float = bounds.within("[-1, 1]", 0.5)
  baseline: str = "global"
  std_normalize: bool = False
  std_eps: float = bounds.within("(0, 1]", 1e-6)
  inverse_p_weight: str | float = bounds.within("[0, 10]", "none")
  seq: SeqConfig = SeqConfig()
  dapo: DapoConfig = DapoConfig()
  est: EstConfig = EstConfig()

  def __post_init__(self):
    bad = lambda field, why: _refuse("AdaConfig", self, field, why)
    if not isinstance(self.method, str) or not self.method:
      bad("method", "name a sampling method (a key of rules.RULES)")
    if self.schedule not in SCHEDULES:
      bad("schedule", f"expected one of {list(SCHEDULES)}")
    if not isinstance(self.n, int) or self.n < 2:
      bad("n", "group size must be an int >= 2 (a group of 1 never carries signal)")
    if self.baseline not in adv_lib.BASELINES:
      bad("baseline", f"expected one of {sorted(adv_lib.BASELINES)}")
    if not self.std_eps > 0:
      bad("std_eps", "must be > 0")
    if self.inverse_p_weight != "none":
      try:
        estimate.objective_alpha(self.inverse_p_weight)
      except ValueError as e:
        bad("inverse_p_weight", f"{e} or none")
    for group, cls in (("seq", SeqConfig), ("dapo", DapoConfig), ("est", EstConfig)):
      if not isinstance(getattr(self, group), cls):
        bad(group, f"expected a {cls.__name__}")
