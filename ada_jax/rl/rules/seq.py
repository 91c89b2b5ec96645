"""Reinforce-Ada-Seq (paper §3): its settings (`SeqConfig`, `ada.seq`), its rule (`Seq`:
pos; `Balance`), its books within a step (`SeqState`) and the exit-chance rule's plan
(`Priors`, from Est's statistics: the rule's cross-step state when that rule is on).

The pure maths stays in its modules: selection (`advantages.select_group`), the batch
order (`pools.batch_order`), the exit chance (`estimate.exit_chance`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from ada_jax import bounds
from ada_jax.rl import advantages as adv_lib
from ada_jax.rl import estimate
from ada_jax.rl import pools as pools_lib
from ada_jax.rl.rules.base import Plan, Rule, refuse

Thresholds = Callable[[int], tuple[int, int]]
SELECTIONS = ("first", "random")
BATCH_ORDERS = ("exit", "prompt")


@dataclasses.dataclass(frozen=True)
class SeqConfig:
  """Reinforce-Ada-Seq's settings (`AdaConfig.seq`, `ada.seq.*` in a config file; the
  rules `Seq`: pos, balance). Validated on construction; what depends on n as well
  (M·R >= n, the thresholds' defaults) is `Seq.check`'s.

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
    bad = lambda field, why: refuse("SeqConfig", self, field, why)
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Priors(Plan):
  """Seq's plan with the exit-chance rule on (`SeqConfig.min_exit_chance`): each prompt's
  pass-rate prior, Beta(est.alpha, est.beta) plus its decayed counts from the steps that
  sampled it before (the Est statistics, `estimate`).

  Attributes:
    est_state: the statistics before the step (`estimate.EstState`).
    keys: uint64[B] the prompts' keys into them (`estimate.prompt_keys`).
    alpha, beta: float64[B] each prompt's Beta posterior before the step's responses.
  """

  est_state: dict
  keys: np.ndarray
  alpha: np.ndarray
  beta: np.ndarray


@dataclasses.dataclass
class SeqState:
  """Seq's books within one step.

  Attributes:
    exit_boundary: prompt -> the boundary (round, under `rounds`) at whose end it met the
      exit rule; absent: it never did.
    stopped: prompts retired by the exit-chance rule, in the order they stopped.
  """

  exit_boundary: dict[int, int] = dataclasses.field(default_factory=dict)
  stopped: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Seq(Rule[SeqConfig]):
  """Reinforce-Ada-Seq (paper §3): a window of rows per active prompt; a prompt retires at
  the first boundary whose graded pool meets the exit rule (`meets_exit`), or with R·M
  rows drawn; n kept by half-then-fill, advantages from the whole pool.

  Attributes:
    exit_thresholds: n -> (k_pos, k_neg) when the config leaves them None.
  """

  exit_thresholds: Thresholds = lambda n: (n // 2, n - n // 2)
  group = "seq"
  settings = SeqConfig
  has_exit_rule = True

  def thresholds(self, config) -> tuple[int, int]:
    """(k_pos, k_neg): `seq.k_pos` and `seq.k_neg`, or where None this rule's defaults as
    functions of n (`exit_thresholds`)."""
    default = self.exit_thresholds(config.n)
    k_pos, k_neg = config.seq.k_pos, config.seq.k_neg
    return default[0] if k_pos is None else k_pos, default[1] if k_neg is None else k_neg

  def meets_exit(self, rewards, config, min_pool: int | None = None) -> bool:
    """The exit rule on one prompt's pool of graded responses (`rules.pool_meets_exit`).

    Args:
      rewards: float[P] rewards of the prompt's graded responses (any order).
      config: its `AdaConfig` (thresholds, n, positive_threshold).
      min_pool: the fewest responses an exiting pool holds; None: n.
    """
    r = np.asarray(rewards, np.float64)
    k_pos, k_neg = self.thresholds(config)
    n_pos = int(np.count_nonzero(r > config.positive_threshold))
    return (
      r.size >= (config.n if min_pool is None else min_pool)
      and n_pos >= k_pos
      and r.size - n_pos >= k_neg
    )

  def check(self, config, bad):
    k_pos, k_neg = self.thresholds(config)
    if k_pos + k_neg < 1:
      bad("seq.k_pos", "k_pos + k_neg must be >= 1, or every prompt exits before sampling")
    m, r = config.seq.samples_per_round, config.seq.max_rounds
    if m * r < config.n or max(m, k_pos + k_neg) < config.n:
      bad(
        "seq.samples_per_round",
        f"with n={config.n}, R={r}, k_pos={k_pos}, k_neg={k_neg} "
        "a pool could hold fewer than n responses; need M*R >= n and "
        "max(M, k_pos + k_neg) >= n",
      )

  def min_rows(self, config):
    return config.seq.samples_per_round

  def warnings(self, config):
    m, n = config.seq.samples_per_round, config.n
    if m <= 16 * n:
      return []
    return [
      f"seq.samples_per_round={m} draws {m} responses per active prompt per round to keep "
      f"n={n} ({m // n}x GRPO's rows per round; the paper: M=8, n=4): each step costs that "
      "much more decoding"
    ]

  def init_state(self, config):
    # The exit-chance rule's priors are Est's statistics (`estimate`), kept only when it is on.
    return estimate.init_est_state() if config.seq.min_exit_chance else None

  def plan(self, config, prompt_ids, state, features):
    if not config.seq.min_exit_chance:
      return Plan()
    keys = estimate.prompt_keys(prompt_ids)
    pos, tot = estimate.counts(state, keys)
    alpha, beta = config.est.alpha + pos, config.est.beta + tot - pos
    return Priors(est_state=state, keys=keys, alpha=alpha, beta=beta)

  def new_state(self):
    return SeqState()

  def stats(self, ctl):
    return {"stopped": tuple(sorted(ctl.state.stopped))}

  def fold(self, config, prompt_ids, state, features, plan, result):
    if not isinstance(plan, Priors):
      return result, state
    b = len(prompt_ids)
    s = result.stats
    new_state = estimate.update_est_state(
      plan.est_state,
      plan.keys,
      s.pool_positives[:b].astype(np.float64),
      s.pool_size[:b].astype(np.float64),
      config.est.decay,
    )
    stopped = {"ada/stopped_fraction": len(result.stats.stopped) / b}
    stats = dataclasses.replace(result.stats, rule_metrics={**result.stats.rule_metrics, **stopped})
    return dataclasses.replace(result, stats=stats), new_state

  def first_rows(self, ctl, p):
    return min(ctl.window, ctl.config.seq.budget)

  def decide(self, ctl, p, new):
    cfg = ctl.config
    graded = [ctl.graded[p][r] for r in sorted(ctl.graded[p])]
    if self.meets_exit(graded, cfg, ctl.min_pool):
      ctl.state.exit_boundary[p] = ctl.boundaries
      return True
    pending = ctl.pending(p)
    room = cfg.seq.budget - ctl.issued(p)
    if room == 0 and pending == 0:
      return True  # R·M responses and no exit: trained on as it is (zero advantage if uniform)
    # The exit-chance rule decides once a round's worth is graded (min_pool: M under
    # `stream`, a round under `rounds`): every prompt explores that much.
    if (
      isinstance(ctl.plan, Priors) and len(graded) >= ctl.min_pool and self.hopeless(ctl, p, graded)
    ):
      ctl.state.stopped.append(p)  # trained on as a prompt that never exits
      return True
    ctl.new_rows(p, max(0, min(ctl.window - pending, room)), new)
    return False

  def hopeless(self, ctl, p: int, graded: Sequence[float]) -> bool:
    """Whether prompt p stops: the chance that it exits within its R·M budget
    (`estimate.exit_chance` on its prior from `plan` updated by its graded pool) is below
    `seq.min_exit_chance`, and its pool already has signal (both classes) or the chance that it
    gets any is below it too: a uniform pool with a fair chance of a first response of the
    other class (for balance, a lone positive) keeps drawing."""
    cfg, alpha, beta = ctl.config, ctl.plan.alpha, ctl.plan.beta
    r = np.asarray(graded, np.float64)
    pos = int(np.count_nonzero(r > cfg.positive_threshold))
    neg = r.size - pos
    args = (pos, neg, cfg.seq.budget - r.size, alpha[p] + pos, beta[p] + neg)
    floor = cfg.seq.min_exit_chance
    if estimate.exit_chance(*args, *self.thresholds(cfg)) >= floor:
      return False
    return bool(pos and neg) or estimate.exit_chance(*args, 1, 1) < floor

  def select(self, ctl, pools, rng):
    cfg = ctl.config
    rng = rng if cfg.seq.selection == "random" else None
    kept = {
      p: adv_lib.select_group(np.asarray(pools.rewards[p]), cfg.n, cfg.positive_threshold, rng)
      for p in range(ctl.b)
    }
    exits = [ctl.state.exit_boundary.get(p) for p in range(ctl.b)]
    return kept, pools_lib.batch_order(cfg.seq.batch_order, exits)


class Balance(Seq):
  """Seq whose default thresholds split n into equal halves (released `balance`)."""

  def check(self, config, bad):
    if config.n % 2 and config.seq.k_pos is None and config.seq.k_neg is None:
      bad(
        "n",
        "balance splits n into equal halves by default; use an even n or set "
        "seq.k_pos and seq.k_neg explicitly",
      )
    super().check(config, bad)
