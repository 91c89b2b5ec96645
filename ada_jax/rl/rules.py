"""The sampling methods as rules: one entry of `RULES` per method (docs/design.md "Adding a
sampling method").

A rule answers the questions the one controller (`controller.Controller`) asks about a
prompt, the same under both schedules:

* `first_rows`: how many rows a prompt gets before anything about it is known;
* `decide`: given its graded pool, does it retire now, or how many more rows does it get;
* `after_boundary`: the step-level move once every prompt has been decided on (DAPO asks
  for extra prompts, or stops the search);
* `select`: which responses of each pool are trained on, in which batch order;
* `plan` / `fold`: before the step (per-prompt quotas: Est's budget split) and after it
  (the outcomes folded into Est's statistics).

The pure maths stays in its modules: the exit rule (`pool_meets_exit`), selection
(`advantages.select_group`), the batch order (`pools.batch_order`), the exit chance
(`estimate.exit_chance`) and Est's estimates and split (`estimate`). Host-side numpy;
every decision is a function of the rewards and the row order alone, never of timing, so
every process of a multi-host run decides the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ada_jax.rl import advantages as adv_lib
from ada_jax.rl import estimate
from ada_jax.rl import pools as pools_lib
from ada_jax.rl.adaptive import AdaConfig

Thresholds = Callable[[int], tuple[int, int]]


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
      f"AdaConfig.method={config.method!r}: unknown method, expected one of {list(RULES)}"
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
  defaults as functions of n (`Seq.exit_thresholds`; `balance`'s for a method without them)."""
  rule = RULES.get(config.method)
  default = (rule if isinstance(rule, Seq) else RULES["balance"]).exit_thresholds(config.n)
  k_pos, k_neg = config.seq.k_pos, config.seq.k_neg
  return default[0] if k_pos is None else k_pos, default[1] if k_neg is None else k_neg


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
  if not getattr(RULES.get(config.method), "has_exit_rule", False):
    seq = [m for m, r in RULES.items() if r.has_exit_rule]
    raise ValueError(f"config.method={config.method!r}: the exit rule is for {seq}")
  r = np.asarray(rewards, np.float64)
  k_pos, k_neg = thresholds(config)
  n_pos = int(np.count_nonzero(r > config.positive_threshold))
  return (
    r.size >= (config.n if min_pool is None else min_pool)
    and n_pos >= k_pos
    and r.size - n_pos >= k_neg
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """What a rule prepares before a step (`Rule.plan`) and reads after it (`Rule.fold`).

  Attributes:
    quotas: int64[B] rows per prompt (Est's budget split), or None: n each.
  """

  quotas: np.ndarray | None = None


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


@dataclasses.dataclass
class DapoState:
  """DAPO's books within one step.

  Attributes:
    mixed: prompts whose group was found mixed (rewards not all equal), in that order.
    groups_done: groups fully graded.
  """

  mixed: list[int] = dataclasses.field(default_factory=list)
  groups_done: int = 0


class Rule:
  """A fixed quota per prompt, retired once all its rows are graded, every row trained on
  with its group's statistics: GRPO (quota n). The base of the other rules.

  Attributes:
    adds_prompts: the rule may ask for prompts beyond the step's B (`more_prompts`), so
      the step's prompt bucket must fit any prompt of the set.
    has_exit_rule: a prompt retires when its pool meets an exit rule (`pool_meets_exit`),
      or with R·M rows drawn (Seq): the stream schedule's smallest exiting pool and the
      simulators' count of prompts that hit the cap read it.

  `ctl` below is the `controller.Controller` asking: a rule reads its pools
  (`ctl.graded[p]`: row id -> reward), its counts (`ctl.pending(p)`, `ctl.issued(p)`),
  config and plan (`ctl.plan`, what `plan` returned), keeps its own books of the step in
  `ctl.state` (what `new_state` made), and adds rows with `ctl.new_rows(p, k, new)`.
  """

  adds_prompts = False
  has_exit_rule = False

  def check(self, config: AdaConfig, bad: Callable[[str, str], None]) -> None:
    """Raises (by `bad(field, why)`, the field's path under `AdaConfig`) on settings this
    rule cannot run (`rule_for`). A method without an exit rule ignores the `seq` group but
    refuses its exit-chance rule, which would stop prompts by an exit rule it lacks."""
    if config.seq.min_exit_chance:
      bad(
        "seq.min_exit_chance",
        f"stops prompts that cannot meet an exit rule; {config.method!r} has none",
      )

  def warnings(self, config) -> list[str]:
    """Settings this rule runs but that are likely mistakes, each '<field under ada>=value:
    why' (`RunConfig.warnings`, logged before compiling)."""
    return []

  def needs_features(self, config) -> bool:
    """Whether the step must hand `plan` the prompts' hidden states (`run_step`'s
    `features`)."""
    return False

  def train_rows(self, config, num_prompts: int) -> int:
    """Rows a step trains on at most (the training batch's fixed size): B·n."""
    return num_prompts * config.n

  def min_rows(self, config) -> int:
    """The fewest rows issued to a prompt at once (sizes the sampler's prompt chunks)."""
    return config.n

  def plan(self, config, prompt_ids, est_state, features) -> Plan:
    """What the step needs before it starts (per-prompt quotas) and `fold` after it."""
    return Plan()

  def new_state(self) -> Any:
    """A fresh per-step state, `ctl.state` (None: the rule keeps no books)."""
    return None

  def first_rows(self, ctl, p: int) -> int:
    """Rows prompt p gets before anything about it is known."""
    return ctl.config.n

  def decide(self, ctl, p: int, new: list) -> bool:
    """Whether prompt p (with new grades) retires now; may queue rows into `new`."""
    return ctl.pending(p) == 0

  def after_boundary(self, ctl, new: list) -> list[int]:
    """Prompts retired by the step as a whole (beyond `decide`'s); may queue rows."""
    return []

  def select(self, ctl, pools, rng) -> tuple[dict[int, np.ndarray], list[int] | None]:
    """(prompt -> indices into its pool kept, the prompts' batch order or None: ascending)."""
    return {p: np.arange(len(pools.rewards[p])) for p in range(ctl.b)}, None

  def stats(self, ctl) -> dict[str, Any]:
    """`StepStats` fields the rule's books fill in at the step's end (`Controller.result`)."""
    return {}

  def fold(self, config, prompt_ids, est_state, features, plan: Plan, result):
    """(the step's result, est_state after the step)."""
    return result, est_state


@dataclasses.dataclass(frozen=True)
class Seq(Rule):
  """Reinforce-Ada-Seq (paper §3): a window of rows per active prompt; a prompt retires at
  the first boundary whose graded pool meets the exit rule (`pool_meets_exit`), or with R·M
  rows drawn; n kept by half-then-fill, advantages from the whole pool.

  Attributes:
    exit_thresholds: n -> (k_pos, k_neg) when the config leaves them None.
  """

  exit_thresholds: Thresholds = lambda n: (n // 2, n - n // 2)
  has_exit_rule = True

  def check(self, config, bad):
    k_pos, k_neg = thresholds(config)
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

  def plan(self, config, prompt_ids, est_state, features):
    if not config.seq.min_exit_chance:
      return Plan()
    state = estimate.init_est_state() if est_state is None else est_state
    keys = estimate.prompt_keys(prompt_ids)
    pos, tot = estimate.counts(state, keys)
    alpha, beta = config.est.alpha + pos, config.est.beta + tot - pos
    return Priors(est_state=state, keys=keys, alpha=alpha, beta=beta)

  def new_state(self):
    return SeqState()

  def stats(self, ctl):
    return {"stopped": tuple(sorted(ctl.state.stopped))}

  def fold(self, config, prompt_ids, est_state, features, plan, result):
    if not isinstance(plan, Priors):
      return result, est_state
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
    if pool_meets_exit(graded, cfg, ctl.min_pool):
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
    if estimate.exit_chance(*args, *thresholds(cfg)) >= floor:
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


class Dapo(Rule):
  """DAPO dynamic sampling: n per prompt; a group with uniform rewards is filtered out and
  extra prompts are drawn until B groups are mixed or the cap on extra prompts is reached;
  the first B mixed groups are trained on (as in verl, surplus ones are dropped).

  Extra prompts: under `rounds`, a pass of `dapo.prompts_per_pass` (None: B) prompts once a
  pass is graded, at most `dapo.max_extra_passes` passes (verl's generation batches); under
  `stream`, as soon as groups are found uniform, as many as the mixed rate seen so far says
  are needed (floored at 1/8, so a run of uniform groups cannot ask for an unbounded
  number), within the same total.
  """

  adds_prompts = True

  def new_state(self):
    return DapoState()

  def decide(self, ctl, p, new):
    if ctl.pending(p):
      return False
    ctl.state.groups_done += 1
    if len(set(ctl.graded[p].values())) > 1:  # DAPO's filter: std > 0
      ctl.state.mixed.append(p)
    return True

  def after_boundary(self, ctl, new):
    mixed, done = ctl.state.mixed, ctl.state.groups_done
    if len(mixed) >= ctl.b:
      return [p for p in range(len(ctl.active)) if ctl.active[p]]
    if ctl.more_prompts is None or not done:
      return []
    cfg = ctl.config
    per_pass = cfg.dapo.prompts_per_pass or ctl.b
    extra = len(ctl.active) - ctl.b
    if ctl.schedule == "rounds":
      k = per_pass if extra < cfg.dapo.max_extra_passes * per_pass else 0
    else:
      rate = max(len(mixed) / done, 0.125)
      target = int(np.ceil((ctl.b - len(mixed)) / rate))
      k = min(target - sum(ctl.active), cfg.dapo.max_extra_passes * per_pass - extra)
    if k > 0:
      for pid in list(ctl.more_prompts(k))[:k]:
        ctl.new_rows(ctl.add_prompt(pid), cfg.n, new)
    return []

  def select(self, ctl, pools, rng):
    return {p: np.arange(ctl.config.n) for p in ctl.state.mixed[: ctl.b]}, None


class Est(Rule):
  """Reinforce-Ada-Est (paper §3.3, `estimate`): per-prompt quotas from the pass-rate
  estimates and the K·B budget split before the step, every row trained on, the outcomes
  folded into the statistics after it."""

  def first_rows(self, ctl, p):
    return ctl.quota[p]

  def train_rows(self, config, num_prompts):
    # Est draws exactly its budget and trains on all of it, so its batch has a fixed size.
    return int(round(config.est.budget_per_prompt * num_prompts))

  def min_rows(self, config):
    return config.est.n_min

  def needs_features(self, config):
    return config.est.estimator != "ema"

  def plan(self, config, prompt_ids, est_state, features):
    state = estimate.init_est_state() if est_state is None else est_state
    keys = estimate.prompt_keys(prompt_ids)
    counts, p_head, metrics = estimate.plan_budget(
      config, state, keys, self.train_rows(config, len(prompt_ids)), features
    )
    return Budget(quotas=counts, est_state=state, keys=keys, p_head=p_head, metrics=metrics)

  def fold(self, config, prompt_ids, est_state, features, plan, result):
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


# The sampling methods, by `AdaConfig.method`. A new method is an entry here (a rule
# above or a subclass) plus its settings: docs/design.md "Adding a sampling method".
RULES: dict[str, Rule] = {
  "grpo": Rule(),
  "dapo": Dapo(),
  "pos": Seq(lambda n: (1, 0)),  # one positive suffices
  "balance": Balance(),  # half positives, half negatives
  "est": Est(),
}
