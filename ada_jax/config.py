"""The boundary between experiment configs (ml_collections) and the library (dataclasses).

An experiment file's `get_config()` returns a ConfigDict with nested groups; `parse`
turns it, once, into a `RunConfig` of small frozen dataclasses (docs/design.md "Architecture").
Every key
must be a field of its group's dataclass, every value passes that dataclass's own checks,
and the cross-group rules (`RunConfig.check`) hold, all before anything is compiled; an
error names the offending `config.group.field`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import sys
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from ada_jax.checkpoint import CheckpointConfig
from ada_jax.data.prompts import DataConfig
from ada_jax.eval.benchmarks import EvalConfig
from ada_jax.models.decoder import ModelConfig
from ada_jax.models.sharding import MeshConfig
from ada_jax.models.tokenizer import TokenizerConfig
from ada_jax.models.weights import ModelSpec
from ada_jax.rewards.judges import JUDGES
from ada_jax.rl.adaptive import AdaConfig
from ada_jax.rl.losses import LossConfig
from ada_jax.rl.train import OptimConfig, TrainConfig
from ada_jax.rl.warmstart import WarmStartConfig
from ada_jax.rollout.sampler import check_context_length
from ada_jax.rollout.spec import SamplerSpec


class ConfigError(ValueError):
  """A bad experiment config or command-line flag; the message names it
  (`config.group.field`, `--flag`)."""


def _usage_exit(message: str) -> typing.NoReturn:
  print(f"ada_jax: {' '.join(message.split())}", file=sys.stderr, flush=True)
  raise SystemExit(2)


@contextlib.contextmanager
def exit_on_config_error() -> Iterator[None]:
  """For command-line entry points: a `ConfigError` ends the process with its one-line
  message on stderr and exit code 2 (a usage error), without a traceback."""
  try:
    yield
  except ConfigError as e:
    _usage_exit(str(e))


def parse_flags(argv: list[str]) -> list[str]:
  """absl `flags_parser` for command lines with a `--config` file: a config file that does
  not load, or an override of a field the config does not have (`--config.rl.batchsize=3`),
  ends the process with one line and exit code 2, like a `ConfigError`, instead of
  ml_collections' traceback; a `--config` file that does not exist is named as typed.
  `--help` exits with code 0, and any other flag error with 2 (absl's own exit with 1)."""
  from absl import app

  path = _config_path(argv)
  if path is not None and not pathlib.Path(path).is_file():
    _usage_exit(f"--config={path}: no such file (from {pathlib.Path.cwd()})")
  try:
    return app.parse_flags_with_usage(argv)
  except SystemExit as e:
    # absl ends `--help` and a flag error (an unknown or missing flag, after its one-line
    # message) with exit code 1: asking for help is no failure, a bad flag is a usage error.
    if e.code == 1:
      raise SystemExit(0 if any(a.split("=")[0] in _HELP_FLAGS for a in argv[1:]) else 2) from None
    raise
  except OSError as e:  # the config file itself did not load
    _usage_exit(f"--config: {e}")
  except (AttributeError, KeyError) as e:
    inner = e
    while inner.args and isinstance(inner.args[0], BaseException):  # ml_collections nests
      inner = inner.args[0]
    text = str(inner.args[0] if inner.args else inner)
    if "get_config" in text:  # the file loaded but is not an experiment config
      _usage_exit(f"--config: {text}")
    overrides = [a.split("=")[0].removeprefix("--") for a in argv[1:] if a.startswith("--config.")]
    which = ", ".join(overrides) if len(overrides) == 1 else f"one of {', '.join(overrides)}"
    _usage_exit(f"the config has no field named by {which} ({text})")


def quiet_logs() -> None:
  """For command-line entry points, before JAX picks its backend: log at WARNING unless
  `--verbosity` was given (orbax, TFDS, JAX's platform probe and the multi-process set-up
  log every file and probe at INFO; progress bars and status lines say what matters)."""
  from absl import flags, logging

  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)


_HELP_FLAGS = ("-h", "--help", "-?", "--helpshort", "--helpfull", "--helpxml")


def _config_path(argv: list[str]) -> str | None:
  """The file named by `--config=PATH` / `--config PATH` (its `:arg` suffix removed)."""
  for i, arg in enumerate(argv[1:], start=1):
    if arg.startswith("--config="):
      value = arg.removeprefix("--config=")
    elif arg == "--config" and i + 1 < len(argv):
      value = argv[i + 1]
    else:
      continue
    return value.split(":", 1)[0] if value else None
  return None


def make_configs_importable() -> None:
  """Lets a command line load `--config=<checkout>/configs/x.py` from any working directory:
  experiment files import `configs.common`, so the checkout holding this package and its
  `configs/` folder goes on `sys.path` (nothing happens for an installed package)."""
  repo = pathlib.Path(__file__).resolve().parent.parent
  if (repo / "configs" / "common.py").is_file() and str(repo) not in sys.path:
    sys.path.append(str(repo))


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """The run's own group (`rl`).

  Attributes:
    steps: RL steps to run.
    batch_prompts: B, prompts per RL step.
    judge: reward function (`rewards.judges.JUDGES`): 'math' (ours), 'exact', or
      'released' (the authors' training reward: last `\\boxed{`, stock math-verify).
    verifier_workers: reward worker processes (0 = all cores); 'exact' runs in-process.
    verifier_timeout_s: hard per-response timeout (seconds).
    log_samples: print this many decoded responses every `eval.every_steps` steps.
  """

  steps: int = 100
  batch_prompts: int = 512
  judge: str = "math"
  verifier_workers: int = 0
  verifier_timeout_s: float = 5.0
  log_samples: int = 0

  def __post_init__(self):
    if self.judge not in JUDGES:
      raise ValueError(f"RLConfig.judge={self.judge!r}: not a judge; known: {sorted(JUDGES)}")
    if not self.verifier_timeout_s > 0:
      raise ValueError(f"RLConfig.verifier_timeout_s={self.verifier_timeout_s}: must be > 0")
    for name in ("verifier_workers", "log_samples"):
      if getattr(self, name) < 0:
        raise ValueError(f"RLConfig.{name}={getattr(self, name)}: must be >= 0")


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
    """P, distinct prompts per sampler launch: `sampler.prompts_per_chunk`, or when that
    is 0, C // (the fewest rows a draw asks for one prompt), so that a chunk always fills
    its C rows before it runs out of prompt slots (GRPO n = 4 with C = 256: 64)."""
    if self.sampler.prompts_per_chunk:
      return self.sampler.prompts_per_chunk
    return max(1, self.sampler.chunk_rows // self.ada.min_rows_per_prompt)

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

  def check_model(self, model: ModelConfig) -> None:
    """Rules that need the architecture: the rollout (and, when benchmarks are set, the
    evaluation) prompt bucket plus response budget fit the model's positions. Call it
    before anything compiles. Raises ConfigError naming the fields."""
    context_fits(model, self.sampler.prompt_buckets, self.sampler.max_new_tokens, "config.sampler")
    if self.eval.benchmarks:
      context_fits(model, self.eval.prompt_buckets, self.eval.max_new_tokens, "config.eval")


def context_fits(model: ModelConfig, prompt_buckets, max_new_tokens: int, group: str) -> None:
  """`sampler.check_context_length` as a ConfigError naming `<group>.prompt_buckets` and
  `<group>.max_new_tokens` (for training, evaluation and prompt selection alike)."""
  try:
    check_context_length(model, prompt_buckets, max_new_tokens, prefix=f"{group}.")
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _fields(cls) -> dict[str, Any]:
  hints = typing.get_type_hints(cls)
  return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _dataclass_of(annotation) -> type | None:
  for candidate in (annotation, *typing.get_args(annotation)):
    if dataclasses.is_dataclass(candidate):
      return candidate
  return None


def build(cls, group: Mapping[str, Any] | None, path: str):
  """Builds dataclass `cls` from a config group; nested groups become nested dataclasses.

  Raises:
    ConfigError: `config.<path>.<key>` is not a field of `cls`, or `cls` rejects a value.
  """
  if group is None:
    return None
  fields = _fields(cls)
  kwargs = {}
  for key, value in dict(group).items():
    if key not in fields:
      raise ConfigError(f"config.{path}.{key}: unknown field; {cls.__name__} has {sorted(fields)}")
    sub = _dataclass_of(fields[key])
    if sub is not None and isinstance(value, Mapping):
      value = build(sub, value, f"{path}.{key}")
    elif isinstance(value, list):
      value = tuple(value)
    elif isinstance(value, Mapping):
      value = dict(value)
    _check_finite(value, f"config.{path}.{key}")
    kwargs[key] = value
  try:
    return cls(**kwargs)
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
