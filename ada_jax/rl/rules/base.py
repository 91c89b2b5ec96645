"""What every sampling method shares: the controller's settings (`AdaConfig`), the rule base
(`Rule`, which is GRPO) and a rule's plan for a step (`Plan`). Each method's own settings
group, books and cross-step state live beside its rule (`seq`, `dapo`, `est`); this module
knows none of them: a rule declares its group (`Rule.group`, `Rule.settings`) and
`AdaConfig` holds whatever groups the rules declared (docs/design.md "Adding a sampling
method").

Every method reports `StepStats.first_round_pass_rate`, the fraction of positive
responses among each prompt's first-round samples (drawn before any exit decision),
averaged over the step's B prompts: an unbiased estimate of the policy's mean pass rate
on those prompts, whichever method drew them. `pool_pass_rate` (over every response drawn)
is not: pos and balance stop sampling after successes, which tilts their pools upward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
from flax import serialization

from ada_jax import bounds
from ada_jax.rl import advantages as adv_lib
from ada_jax.rl import estimate

SCHEDULES = ("rounds", "stream")

# The settings groups, by name (`ada.<name>` in a config file): each declared by the rule
# that reads it (`Rule.group`, `Rule.settings`), recorded as the rule's class is defined.
GROUPS: dict[str, type] = {}

S = TypeVar("S")


def refuse(cls: str, obj, field: str, why: str):
  """Raises ValueError('<cls>.<field>=<value>: <why>'), a settings group's refusal."""
  raise ValueError(f"{cls}.{field}={getattr(obj, field)!r}: {why}")


@dataclasses.dataclass(frozen=True, init=False)
class AdaConfig:
  """The sampling controller's settings: the method, the schedule, what every method shares
  (group size, reward threshold, advantages) and the rules' settings groups. Construction
  checks each field's kind and choices (n >= 2, a known schedule and baseline, each group
  of its class); the intervals declared at the fields (`bounds.within`) are the config
  parser's to check (`config.build`); whether the method exists and can run these
  settings is its rule's to say (`rules.rule_for`, which the controller and `config.parse`
  call).

  A group is passed and read by its name: `AdaConfig(method='pos', seq=SeqConfig(M=4))`,
  `config.seq.max_rounds`; a group not passed takes its class's defaults. Which groups
  exist is the rules' to say (`GROUPS`): `seq` (`SeqConfig`: M, R, the exit thresholds,
  selection, batch order, the exit-chance rule), `dapo` (`DapoConfig`), `est`
  (`estimate.EstConfig`, whose prior and decay the exit-chance rule also reads).

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
    groups: group name -> its settings, every declared group (the way `dataclasses.asdict`
      and `dataclasses.replace` see them; set them by name).

  Raises:
    ValueError: naming the bad field (`AdaConfig.n=1: ...`, `AdaConfig.seq: expected a
      SeqConfig`).
    TypeError: a keyword that is neither a field nor a declared group.
  """

  method: str = "pos"
  schedule: str = "rounds"
  n: int = bounds.within("[2, 2**16]", 4)
  positive_threshold: float = bounds.within("[-1, 1]", 0.5)
  baseline: str = "global"
  std_normalize: bool = False
  std_eps: float = bounds.within("(0, 1]", 1e-6)
  inverse_p_weight: str | float = bounds.within("[0, 1]", "none")
  groups: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)

  def __init__(self, *args: Any, groups: Mapping[str, Any] | None = None, **values: Any):
    names = [f.name for f in dataclasses.fields(self) if f.name != "groups"]
    if len(args) > len(names) or set(names[: len(args)]) & set(values):
      raise TypeError(f"AdaConfig: positional arguments are {names}, each given once")
    values |= dict(zip(names, args, strict=False))
    for f in dataclasses.fields(self):
      if f.name != "groups":
        object.__setattr__(self, f.name, values.pop(f.name, f.default))
    given = {**(groups or {}), **values}
    unknown = sorted(set(given) - set(GROUPS))
    if unknown:
      raise TypeError(
        f"AdaConfig: {unknown[0]!r} is neither a field nor a settings group; "
        f"groups: {sorted(GROUPS)}"
      )
    object.__setattr__(
      self, "groups", {k: given[k] if k in given else cls() for k, cls in GROUPS.items()}
    )
    self._check()

  def __getattr__(self, name: str) -> Any:
    groups = self.__dict__.get("groups")
    if groups is None or name not in GROUPS:
      raise AttributeError(f"AdaConfig has no field or settings group {name!r}")
    # A group declared after this config was made reads as its defaults.
    return groups[name] if name in groups else GROUPS[name]()

  def as_dict(self) -> dict[str, Any]:
    """`dataclasses.asdict` with each group where a config file writes it (`seq`, not
    `groups.seq`): the form records and the checkpoint's config record keep."""
    out = dataclasses.asdict(self)
    return out | out.pop("groups")

  def _check(self):
    bad = lambda field, why: refuse("AdaConfig", self, field, why)
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
    for name, value in self.groups.items():
      if not isinstance(value, GROUPS[name]):
        raise ValueError(f"AdaConfig.{name}={value!r}: expected a {GROUPS[name].__name__}")


def declare_group(name: str, settings: type) -> None:
  """Records settings group `name` (`ada.<name>`) with its frozen dataclass `settings`
  (what `Rule.__init_subclass__` does for a rule that declares one). The same class again
  (or one of the same name, a module run twice) replaces it.

  Raises:
    ValueError: a name that is not an identifier, is a field of `AdaConfig`, or is declared
      by another class.
  """
  fields = {f.name for f in dataclasses.fields(AdaConfig)}
  if not isinstance(name, str) or not name.isidentifier() or name in fields:
    raise ValueError(f"settings group {name!r}: must be an identifier other than {sorted(fields)}")
  if not dataclasses.is_dataclass(settings):
    raise ValueError(f"settings group ada.{name}: {settings!r} is not a dataclass")
  old = GROUPS.get(name)
  where = lambda cls: f"{cls.__module__}.{cls.__qualname__}"
  if old is not None and where(old) != where(settings):
    raise ValueError(f"settings group ada.{name} is {where(old)}'s already")
  GROUPS[name] = settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """What a rule prepares before a step (`Rule.plan`) and reads after it (`Rule.fold`).

  Attributes:
    quotas: int64[B] rows per prompt (Est's budget split), or None: n each.
  """

  quotas: np.ndarray | None = None


class Rule(Generic[S]):
  """A fixed quota per prompt, retired once all its rows are graded, every row trained on
  with its group's statistics: GRPO (quota n). The base of the other rules.

  Attributes:
    group, settings: the rule's own settings group, `ada.<group>` of dataclass `settings`
      (None: the rule reads only `AdaConfig`'s shared fields and others' groups). Declared
      on the class; `settings_of(config)` reads it.
    adds_prompts: the rule may ask for prompts beyond the step's B (`more_prompts`), so
      the step's prompt bucket must fit any prompt of the set.
    has_exit_rule: a prompt retires when its pool meets an exit rule (`pool_meets_exit`),
      or with R·M rows drawn (Seq): the stream schedule's smallest exiting pool and the
      simulators' count of prompts that hit the cap read it.

  What a rule carries from step to step (Est's and the exit-chance rule's statistics) is
  its state: `init_state` makes it, `plan` reads it, `fold` returns the next one; the run
  keeps and checkpoints it as `RunState.method_state` without reading it (a pytree of
  arrays: a dict, or a `flax.struct.dataclass` that `restore_state` rebuilds).

  `ctl` below is the `controller.Controller` asking: a rule reads its pools
  (`ctl.graded[p]`: row id -> reward), its counts (`ctl.pending(p)`, `ctl.issued(p)`),
  config and plan (`ctl.plan`, what `plan` returned), keeps its own books of the step in
  `ctl.state` (what `new_state` made), and adds rows with `ctl.new_rows(p, k, new)`.
  """

  group: ClassVar[str | None] = None
  settings: ClassVar[type | None] = None
  adds_prompts = False
  has_exit_rule = False

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if "settings" in cls.__dict__ and cls.settings is not None:
      declare_group(cls.group, cls.settings)

  def settings_of(self, config: AdaConfig) -> S:
    """This rule's settings group of `config` (`config.<group>`)."""
    return getattr(config, self.group)

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

  def max_rows(self, config, num_prompts: int) -> int:
    """The most rows of one of a step's `num_prompts` prompts the controller has in flight
    at once: the rollout pool's bound R on a prompt-cache entry's live rows (decode
    attention reads a prompt once for its R rows, issue 52; rows beyond it would wait)."""
    return self.min_rows(config)

  def init_state(self, config) -> Any:
    """The cross-step state before the first step (None: the rule keeps none)."""
    return None

  def restore_state(self, config, tree: Any) -> Any:
    """The state from what a checkpoint holds of it (nested dicts of arrays,
    `flax.serialization.to_state_dict`'s form; None: none saved): a dict state as it is
    (Est's, whose entries grow), any other type rebuilt on `init_state`'s."""
    init = self.init_state(config)
    if tree is None or isinstance(init, dict):
      return tree
    return serialization.from_state_dict(init, tree)

  def plan(self, config, prompt_ids, state, features) -> Plan:
    """What the step needs before it starts (per-prompt quotas) and `fold` after it, from
    the state the last step left (`init_state`'s before the first)."""
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

  def fold(self, config, prompt_ids, state, features, plan: Plan, result):
    """(the step's result, the state after the step)."""
    return result, state
