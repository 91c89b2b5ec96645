"""The boundary between experiment configs (ml_collections) and the library (dataclasses).

An experiment file's `get_config()` returns a ConfigDict with nested groups; `parse`
turns it, once, into a `RunConfig` of small frozen dataclasses (docs/design.md "Architecture").
Every key
must be a field of its group's dataclass, every value passes that dataclass's own checks,
and the cross-group rules (`RunConfig.check`) hold, all before anything is compiled; an
error names the offending `config.group.field`.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import typing
from collections.abc import Mapping
from typing import Any

from ada_jax import bounds
from ada_jax.bounds import ConfigError
from ada_jax.checkpoint import CheckpointConfig
from ada_jax.data.prompts import DataConfig
from ada_jax.eval.benchmarks import EvalConfig
from ada_jax.models.sharding import MeshConfig
from ada_jax.models.tokenizer import TokenizerConfig
from ada_jax.models.weights import ModelSpec
from ada_jax.rewards.verifier import VerifierConfig
from ada_jax.rl import rules
from ada_jax.rl.losses import LossConfig
from ada_jax.rl.rules import AdaConfig, DapoConfig, EstConfig, SeqConfig
from ada_jax.rl.train import OptimConfig, TrainConfig
from ada_jax.rl.warmstart import WarmStartConfig
from ada_jax.rollout.sampler import prompts_per_chunk
from ada_jax.rollout.spec import SamplerSpec

# Fields a later version moved, old name -> new: Est's and DAPO's settings became their own
# groups (`ada.est_decay` -> `ada.est.decay`), then Seq's (`ada.samples_per_round` ->
# `ada.seq.samples_per_round`). A checkpoint saved before is compared under the new names
# (`runstate.check_resume`), so it resumes, or is refused naming the field as it is now
# spelt; a config file or flag with an old name is refused naming the new one (`build`).
RENAMED = {
  **{
    f"ada.{group}_{f.name}": f"ada.{group}.{f.name}"
    for group, cls in (("est", EstConfig), ("dapo", DapoConfig))
    for f in dataclasses.fields(cls)
  },
  **{f"ada.{f.name}": f"ada.seq.{f.name}" for f in dataclasses.fields(SeqConfig)},
}


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """The run's own group (`rl`).

  Attributes:
    steps: RL steps to run.
    batch_prompts: B, prompts per RL step.
    verifier: the training reward (`rewards.verifier.VerifierConfig`): its `judge`
      (`rewards.judges.JUDGES`: 'math' (ours), 'exact', or 'released', the authors'
      training reward: last `\\boxed{`, stock math-verify), `num_workers` (0 = all
      cores; 'exact' runs in-process), the hard per-response `timeout_s`, ...
  """

  steps: int = bounds.within("[1, STEPS]", 100)
  batch_prompts: int = bounds.within("[1, ROWS]", 512)
  verifier: VerifierConfig = VerifierConfig()

  def __post_init__(self):
    if not self.verifier.judge:
      raise ValueError("RLConfig.verifier.judge is empty: training needs a judge")
    # Here, not in `RunConfig.check`: `RunConfig.__post_init__` divides by the batch.
    for name in ("steps", "batch_prompts"):
      if isinstance(getattr(self, name), int) and getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


# Fields of a module's config that the run fills from another group (one source each):
# the trainer's loss, optimizer and log-prob temperature, and its number of updates.
_FILLED = {
  "train": {
    "loss": "config.loss",
    "optim": "config.optim",
    "temperature": "config.sampler.temperature",
    "num_minibatches": "config.train.mini_batch_prompts (updates = rows / (it × ada.n))",
  }
}


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A whole experiment, checked. Groups mirror the config file's; each is the frozen
  config dataclass of the module that uses it (`train.loss`, `train.optim` and
  `train.temperature` are filled from the `loss`, `optim` and `sampler` groups, and
  `train.num_minibatches` is derived from `train.mini_batch_prompts`)."""

  seed: int = bounds.within("[0, 2**63)", 0)
  model: ModelSpec = ModelSpec(preset="tiny-llama")
  tokenizer: TokenizerConfig = TokenizerConfig()
  data: DataConfig = DataConfig()
  sampler: SamplerSpec = SamplerSpec()
  ada: AdaConfig = AdaConfig()
  rl: RLConfig = RLConfig()
  loss: LossConfig = LossConfig()
  optim: OptimConfig = OptimConfig()
  train: TrainConfig = TrainConfig()
  ckpt: CheckpointConfig = CheckpointConfig()
  warmstart: WarmStartConfig | None = None
  eval: EvalConfig = EvalConfig(benchmarks=(), k=4)
  mesh: MeshConfig = MeshConfig()

  def __post_init__(self):
    try:
      rules.rule_for(self.ada)
    except ValueError as e:
      raise ConfigError(f"config.ada: {e}") from None
    # `train` is the trainer's whole config: its loss and optimizer are the run's `loss`
    # and `optim` groups, its temperature the sampler's (PPO ratio consistency).
    train = dataclasses.replace(
      self.train,
      loss=self.loss,
      optim=self.optim,
      temperature=self.sampler.rule.logprob_temperature,
      num_minibatches=max(1, self.train_rows // self.mini_batch_rows),
    )
    object.__setattr__(self, "train", train)
    if self.ada.schedule == "stream" and not self.sampler.segment_steps:
      # Decisions every 1/32 of the budget (64 steps at 2,048: experiments/simulate_stream.py),
      # not once per budget, which would make every decision lag a whole response.
      steps = max(1, self.sampler.max_new_tokens // 32)
      object.__setattr__(self, "sampler", dataclasses.replace(self.sampler, segment_steps=steps))

  @property
  def rule(self) -> rules.Rule:
    """The sampling method's rule (`rules.RULES[ada.method]`)."""
    return rules.RULES[self.ada.method]

  @property
  def train_rows(self) -> int:
    """Rows of the RL training batch: B·n, or K·B for est (`Rule.train_rows`)."""
    return self.rule.train_rows(self.ada, self.rl.batch_prompts)

  @property
  def min_rows_per_prompt(self) -> int:
    """The fewest rows the controller issues any prompt at once (`Rule.min_rows`: n for
    grpo and dapo, M for pos and balance, est.n_min for est). A sampler chunk of C rows is
    full whenever it may hold C // this many prompts."""
    return self.rule.min_rows(self.ada)

  @property
  def max_rows_per_prompt(self) -> int:
    """The most rows of one prompt decoding at once (`Rule.max_rows`: n for grpo and dapo,
    M for pos and balance, est.n_max or twice est's mean quota): the rollout pool's rows
    per prompt-cache entry, read together for their prompt (issue 52)."""
    return self.rule.max_rows(self.ada, self.rl.batch_prompts)

  @property
  def mini_batch_rows(self) -> int:
    """Rows of one mini-batch: `train.mini_batch_prompts` × `ada.n` (verl's
    ppo_mini_batch_size × rollout.n), or the whole training batch when that is 0."""
    if not self.train.mini_batch_prompts:
      return self.train_rows
    return self.train.mini_batch_prompts * self.ada.n

  @property
  def prompts_per_chunk(self) -> int:
    """P, distinct prompts per sampler launch before the mesh rounds it up
    (`rollout.sampler.prompts_per_chunk` with the method's fewest rows per prompt)."""
    return prompts_per_chunk(self.sampler, self.min_rows_per_prompt)

  def check(self) -> None:
    """Cross-group rules. Raises ConfigError naming the config field."""
    if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
      raise ConfigError(f"config.seed must be an int in [0, 2**63), got {self.seed!r}")
    if self.sampler.temperature == 0:
      raise ConfigError(
        "config.sampler.temperature=0 (greedy rollouts): every response of a prompt is the "
        "same, so no group has mixed rewards and RL trains nothing; use a temperature > 0"
      )
    buckets = self.sampler.prompt_buckets
    if not buckets or min(buckets) < 1:
      raise ConfigError(f"config.sampler.prompt_buckets={buckets!r}: need lengths >= 1")
    if max(buckets) < self.data.max_prompt_tokens:
      raise ConfigError(
        f"config.sampler.prompt_buckets (largest {max(buckets)}) must hold "
        f"config.data.max_prompt_tokens ({self.data.max_prompt_tokens}), the longest prompt "
        "kept: raise the largest bucket or lower max_prompt_tokens"
      )
    for axis in ("data", "fsdp", "tensor"):
      size = getattr(self.mesh, axis)
      if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
        raise ConfigError(f"config.mesh.{axis}={size!r}: must be -1 (the rest) or in [1, 2**16]")
    if self.train_rows % self.mini_batch_rows:
      raise ConfigError(
        f"config.train.mini_batch_prompts ({self.train.mini_batch_prompts}) × ada.n "
        f"({self.ada.n}) = {self.mini_batch_rows} rows must divide the training batch "
        f"({self.train_rows} rows: rl.batch_prompts × ada.n, or est's K·B); 0 = one update"
      )
    rows = self.min_rows_per_prompt
    if self.prompts_per_chunk * rows < self.sampler.chunk_rows:
      raise ConfigError(
        f"config.sampler.prompts_per_chunk ({self.sampler.prompts_per_chunk}: the config's "
        f"or its ':host' settings', set with their chunk_rows) × {rows} rows per prompt "
        f"({self.ada.method}) leaves chunks of config.sampler.chunk_rows "
        f"({self.sampler.chunk_rows}) part empty: set it too, to at least "
        f"{-(-self.sampler.chunk_rows // rows)}, or to 0 to derive it"
      )
    if self.warmstart is not None and (self.tokenizer.dir or self.model.hf_dir):
      raise ConfigError(
        "config.warmstart (the arithmetic warm start) needs the arithmetic "
        "tokenizer: leave tokenizer.dir and model.hf_dir empty"
      )

  def warnings(self) -> list[str]:
    """Settings that run but are likely mistakes (the loop logs them before compiling)."""
    return [f"config.ada.{w}" for w in self.rule.warnings(self.ada)]


def as_dict(run: RunConfig) -> dict[str, Any]:
  """`dataclasses.asdict` of a run's config with each settings group where a config file
  writes it (`ada.seq`, not `ada.groups.seq`): the form results JSON and the checkpoint's
  config record (`runstate.config_record`) keep."""
  return {**dataclasses.asdict(run), "ada": run.ada.as_dict()}


def check_range(cls: type, name: str, value: Any, path: str) -> None:
  """Refuses a number (or a tuple item) of field `cls.name` outside the interval declared
  at the field (`bounds.within`).

  Raises:
    ConfigError: naming `config.<path>`, the value and the interval.
  """
  interval = bounds.of(cls, name)
  if interval is not None and bounds.outside(interval, value):
    raise ConfigError(f"config.{path}.{name}={value!r}: must be in {bounds.written(interval)}")


def check_workdir(workdir: str | None, flag: str = "--workdir") -> pathlib.Path:
  """The absolute path of a `--workdir` value, refused when empty (an unset shell variable
  would write into the current directory) or naming something that is not a directory.

  Raises:
    ConfigError: naming the flag and the value.
  """
  if not workdir or not workdir.strip():
    raise ConfigError(f"{flag} is empty: name the run's directory ({flag}=DIR)")
  path = pathlib.Path(workdir).absolute()
  if path.exists() and not path.is_dir():
    raise ConfigError(f"{flag}={workdir}: not a directory")
  return path


def _fields(cls) -> dict[str, Any]:
  """Field name -> type of a config group; `AdaConfig`'s settings groups count as its fields
  (`ada.seq`, ...: whichever the rules declared, `rules.GROUPS`), its `groups` does not."""
  hints = typing.get_type_hints(cls)
  out = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
  if cls is AdaConfig:
    del out["groups"]
    out |= rules.GROUPS
  return out


def _defaults(cls) -> dict[str, Any]:
  """Field name -> default of a config group (`_fields`'s names)."""
  out = {f.name: f.default for f in dataclasses.fields(cls)}
  if cls is AdaConfig:
    out |= {name: group() for name, group in rules.GROUPS.items()}
  return out


def _dataclass_of(annotation) -> type | None:
  for candidate in (annotation, *typing.get_args(annotation)):
    if dataclasses.is_dataclass(candidate):
      return candidate
  return None


def build(cls, group: Mapping[str, Any] | None, path: str, base: Any = None):
  """Builds dataclass `cls` from a config group; nested groups become nested dataclasses,
  each from its field's default (`eval.sampler` keeps `EvalConfig`'s 4,096-token budget
  when a config sets only its chunk size); `base`: the default the group replaces fields
  of, None: `cls`'s own defaults.

  Raises:
    ConfigError: `config.<path>.<key>` is not a field of `cls`, or `cls` rejects a value.
  """
  if group is None:
    return None
  fields = _fields(cls)
  defaults = _defaults(cls)
  kwargs = {}
  for key, value in dict(group).items():
    if key not in fields:
      moved = RENAMED.get(f"{path}.{key}")
      if moved:
        raise ConfigError(f"config.{path}.{key} moved to config.{moved}")
      raise ConfigError(f"config.{path}.{key}: unknown field; {cls.__name__} has {sorted(fields)}")
    sub = _dataclass_of(fields[key])
    if sub is not None and isinstance(value, Mapping):
      default = defaults[key] if dataclasses.is_dataclass(defaults[key]) else None
      value = build(sub, value, f"{path}.{key}", default)
    elif isinstance(value, list):
      value = tuple(value)
    elif isinstance(value, Mapping):
      value = dict(value)
    _check_finite(value, f"config.{path}.{key}")
    kwargs[key] = value
  try:
    out = cls(**kwargs) if base is None else dataclasses.replace(base, **kwargs)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.{path}: {e}") from None
  for key, value in kwargs.items():  # after the group's own checks, whose words are sharper
    check_range(cls, key, value, path)
  return out


def _check_finite(value: Any, name: str) -> None:
  """NaN and infinities pass every `x <= 0` check (NaN compares false), so they are refused
  here, for every float field alike."""
  items = value if isinstance(value, tuple) else (value,)
  for x in items:
    if isinstance(x, float) and not math.isfinite(x):
      raise ConfigError(f"{name}={value!r}: must be a finite number")


def complete(config: Any) -> None:
  """Adds to an experiment ConfigDict, in place, every field of its groups' dataclasses it
  lacks, with the value `parse` would take for it (a None default as a typed placeholder),
  so that every field can be set from the command line (`--config.ada.seq.k_pos=2`,
  `--config.eval.sampler.temperature=0.6`): ml_collections' flags override only fields the
  dict has, of a type other than None. A group the config sets to None (no warm start)
  stays None. `cli` calls it on every `--config` file as it loads."""
  from ml_collections import config_dict

  def fill(group, cls, base, path):
    # Every field given, so `build` gets the same values whatever base it starts from:
    # `base`'s (the group's default instance), else the dataclass's own defaults.
    defaults = _defaults(cls)
    for name, hint in _fields(cls).items():
      if name in _FILLED.get(path, {}):
        continue
      default = getattr(base, name) if base is not None else defaults[name]
      sub = _dataclass_of(hint)
      if sub is not None:
        if name not in group and dataclasses.is_dataclass(default):
          group[name] = config_dict.ConfigDict()
        if isinstance(group.get(name), config_dict.ConfigDict):
          nested = default if dataclasses.is_dataclass(default) else None
          fill(group[name], sub, nested, f"{path}.{name}")
      elif group.get(name, default) is None:  # a typed placeholder: None until set
        kinds = [t for t in typing.get_args(hint) if t is not type(None)]
        if kinds and kinds[0] in (int, float, str):
          group[name] = config_dict.placeholder(kinds[0])
      elif name not in group and not isinstance(default, Mapping | type(dataclasses.MISSING)):
        group[name] = default

  defaults = RunConfig()
  with config.unlocked():
    for f in dataclasses.fields(RunConfig):
      sub, base = _dataclass_of(_fields(RunConfig)[f.name]), getattr(defaults, f.name)
      if f.name not in config and base is not None:  # parse would take RunConfig's default
        config[f.name] = config_dict.ConfigDict() if sub is not None else base
      else:
        base = None  # `build` starts a group the config has from the dataclass's defaults
      if sub is not None and isinstance(config.get(f.name), config_dict.ConfigDict):
        fill(config[f.name], sub, base, f.name)


def parse(config: Mapping[str, Any]) -> RunConfig:
  """The `RunConfig` of an experiment ConfigDict (or plain dict). See module docstring."""
  try:
    plain = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  except OSError as e:  # ml_collections defers a config file's load error to first use
    raise ConfigError(f"--config: {' '.join(str(e).split())}") from None
  fields = _fields(RunConfig)
  kwargs = {}
  for key, value in plain.items():
    if key not in fields:
      raise ConfigError(f"config.{key}: unknown group; known: {sorted(fields)}")
    for name, source in _FILLED.get(key, {}).items():
      if isinstance(value, Mapping) and name in value:
        raise ConfigError(f"config.{key}.{name}: set by {source}, not here")
    sub = _dataclass_of(fields[key])
    if sub is None:
      _check_finite(value, f"config.{key}")
    kwargs[key] = build(sub, value, key) if sub is not None else value
  run = RunConfig(**kwargs)
  run.check()
  return run
