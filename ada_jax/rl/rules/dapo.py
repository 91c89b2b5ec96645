"""DAPO's dynamic sampling: its settings (`DapoConfig`, `ada.dapo`), its rule (`Dapo`) and its
books within a step (`DapoState`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ada_jax import bounds
from ada_jax.rl.rules.base import Rule, refuse


@dataclasses.dataclass(frozen=True)
class DapoConfig:
  """DAPO's settings (`AdaConfig.dapo`, `ada.dapo.*` in a config file; the rule
  `Dapo`). Validated on construction.

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
    bad = lambda field, why: refuse("DapoConfig", self, field, why)
    if self.max_extra_passes < 0:
      bad("max_extra_passes", "must be >= 0")
    if self.prompts_per_pass is not None and self.prompts_per_pass < 1:
      bad("prompts_per_pass", "must be >= 1 or None")


@dataclasses.dataclass
class DapoState:
  """DAPO's books within one step.

  Attributes:
    mixed: prompts whose group was found mixed (rewards not all equal), in that order.
    groups_done: groups fully graded.
  """

  mixed: list[int] = dataclasses.field(default_factory=list)
  groups_done: int = 0


class Dapo(Rule[DapoConfig]):
  """DAPO dynamic sampling: n per prompt; a group with uniform rewards is filtered out and
  extra prompts are drawn until B groups are mixed or the cap on extra prompts is reached;
  the first B mixed groups are trained on (as in verl, surplus ones are dropped).

  Extra prompts: under `rounds`, a pass of `dapo.prompts_per_pass` (None: B) prompts once a
  pass is graded, at most `dapo.max_extra_passes` passes (verl's generation batches); under
  `stream`, as soon as groups are found uniform, as many as the mixed rate seen so far says
  are needed (floored at 1/8, so a run of uniform groups cannot ask for an unbounded
  number), within the same total.
  """

  group = "dapo"
  settings = DapoConfig
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
