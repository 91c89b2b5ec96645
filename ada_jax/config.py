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
import typing
from collections.abc import Mapping
from typing import Any

from ada_jax.checkpoint import CheckpointConfig
from ada_jax.data.prompts import DataConfig
from ada_jax.eval.benchmarks import EvalConfig
from ada_jax.models.sharding import MeshConfig
from ada_jax.models.tokenizer import TokenizerConfig
from ada_jax.models.weights import ModelSpec
from ada_jax.rewards.verifier import VerifierConfig
from ada_jax.rl.adaptive import AdaConfig
from ada_jax.rl.losses import LossConfig
from ada_jax.rl.train import OptimConfig, TrainConfig
from ada_jax.rl.warmstart import WarmStartConfig
from ada_jax.rollout.sampler import prompts_per_chunk
from ada_jax.rollout.spec import SamplerSpec


class ConfigError(ValueError):
  """A bad experiment config or command-line flag; the message names it
  (`config.group.field`, `--flag`)."""


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

  steps: int = 100
  batch_prompts: int = 512
  verifier: VerifierConfig = VerifierConfig()

  def __post_init__(self):
    if not self.verifier.judge:
      raise ValueError("RLConfig.verifier.judge is empty: training needs a judge")


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

  seed: int = 0
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
  def train_rows(self) -> int:
    """Rows of the RL training batch: B·n, or K·B for est (`AdaConfig.train_rows`)."""
    return self.ada.train_rows(self.rl.batch_prompts)

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
    return prompts_per_chunk(self.sampler, self.ada.min_rows_per_prompt)

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
    if self.rl.steps < 1:
      raise ConfigError(f"config.rl.steps must be >= 1, got {self.rl.steps}")
    if self.rl.batch_prompts < 1:
      raise ConfigError(f"config.rl.batch_prompts must be >= 1, got {self.rl.batch_prompts}")
    if self.train_rows % self.mini_batch_rows:
      raise ConfigError(
        f"config.train.mini_batch_prompts ({self.train.mini_batch_prompts}) × ada.n "
        f"({self.ada.n}) = {self.mini_batch_rows} rows must divide the training batch "
        f"({self.train_rows} rows: rl.batch_prompts × ada.n, or est's K·B); 0 = one update"
      )
    rows = self.ada.min_rows_per_prompt
    if self.prompts_per_chunk * rows < self.sampler.chunk_rows:
      raise ConfigError(
        f"config.sampler.prompts_per_chunk ({self.sampler.prompts_per_chunk}) × "
        f"{rows} rows per prompt (ada.method {self.ada.method!r}) leaves sampler chunks of "
        f"config.sampler.chunk_rows ({self.sampler.chunk_rows}) part empty: use at least "
        f"{-(-self.sampler.chunk_rows // rows)}, or 0 to derive it"
      )
    if self.warmstart is not None and (self.tokenizer.dir or self.model.hf_dir):
      raise ConfigError(
        "config.warmstart (the arithmetic warm start) needs the arithmetic "
        "tokenizer: leave tokenizer.dir and model.hf_dir empty"
      )

  def warnings(self) -> list[str]:
    """Settings that run but are likely mistakes (the loop logs them before compiling)."""
    out = []
    m, n = self.ada.samples_per_round, self.ada.n
    if self.ada.is_seq and m > 16 * n:
      out.append(
        f"config.ada.samples_per_round={m} draws {m} responses per active prompt per round "
        f"to keep n={n} ({m // n}x GRPO's rows per round; the paper: M=8, n=4): "
        "each step costs that much more decoding"
      )
    return out


def _fields(cls) -> dict[str, Any]:
  hints = typing.get_type_hints(cls)
  return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


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
  defaults = {f.name: f.default for f in dataclasses.fields(cls)}
  kwargs = {}
  for key, value in dict(group).items():
    if key not in fields:
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
    return cls(**kwargs) if base is None else dataclasses.replace(base, **kwargs)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.{path}: {e}") from None


def _check_finite(value: Any, name: str) -> None:
  """NaN and infinities pass every `x <= 0` check (NaN compares false), so they are refused
  here, for every float field alike."""
  items = value if isinstance(value, tuple) else (value,)
  for x in items:
    if isinstance(x, float) and not math.isfinite(x):
      raise ConfigError(f"{name}={value!r}: must be a finite number")


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
