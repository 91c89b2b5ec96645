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
import pathlib
import sys
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from ada_jax.checkpoint import CheckpointConfig
from ada_jax.data import arith
from ada_jax.eval.benchmarks import EvalConfig
from ada_jax.models import weights
from ada_jax.models.decoder import PRESETS, ModelConfig
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
class ModelSpec:
  """Which model. Exactly one of `preset` / `hf_dir` names the architecture.

  Attributes:
    preset: a `model.PRESETS` name; weights are random unless `hf_dir` or a checkpoint
      provides them.
    hf_dir: a Hugging Face folder (or Hub id): architecture from its config.json, weights
      loaded at start (docs/design.md "Run state" resume order, step 3).
    dtype: parameter and compute dtype ('float32' or 'bfloat16').
    overrides: `ModelConfig` fields replacing the preset's (e.g. tiny CPU shapes).
  """

  preset: str = ""
  hf_dir: str = ""
  dtype: str = "float32"
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if bool(self.preset) == bool(self.hf_dir):
      raise ConfigError("set exactly one of model.preset and model.hf_dir")
    if self.preset and self.preset not in PRESETS:
      raise ConfigError(f"model.preset {self.preset!r} unknown; choose one of {sorted(PRESETS)}")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    for key in self.overrides:
      if key not in known:
        raise ConfigError(f"model.overrides.{key}: not a ModelConfig field")


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
  """Attributes:
  dir: folder with tokenizer.json (+ tokenizer_config.json / generation_config.json);
    '' = the arithmetic task's built-in tokenizer.
  eos_ids: stop token ids overriding the folder's; () = the folder's.
  """

  dir: str = ""
  eos_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """Training prompts.

  Attributes:
    source: 'arith' (procedural task), a `data.SETS` name (e.g. 'gsm8k', 'math_train'), or
      'jsonl' (the user's files in `jsonl_paths`).
    split: split of a `data.SETS` source.
    manual_dir: folder with the maths JSONL files (offline TFDS preparation).
    data_dir: TFDS data directory; '' = TFDS's default.
    jsonl_paths: the user's JSONL files (source 'jsonl').
    problem_field, answer_field: field names in those files.
    answer_format: 'plain', 'boxed' or 'gsm8k' (how the answer field holds the answer).
    exclude_math500: drop MATH500 problems from the user's files (needs
      math500_test.jsonl in `manual_dir`, or network).
    prompt_style: `prompts` style ('chat', 'chat_no_system', 'plain', 'raw').
    max_prompt_tokens: longer prompts are dropped and counted.
    arith: the arithmetic task's problem distribution (source 'arith').
    arith_prompts: number of arithmetic training prompts drawn (an epoch).
  """

  source: str = "arith"
  split: str = "train"
  manual_dir: str = ""
  data_dir: str = ""
  jsonl_paths: tuple[str, ...] = ()
  problem_field: str = "problem"
  answer_field: str = "answer"
  answer_format: str = "plain"
  exclude_math500: bool = True
  prompt_style: str = "chat"
  max_prompt_tokens: int = 1024
  arith: arith.ArithConfig = arith.ArithConfig()
  arith_prompts: int = 20_000


@dataclasses.dataclass(frozen=True)
class RLSpec:
  """Attributes:
  steps: RL steps to run.
  batch_prompts: B, prompts per RL step.
  judge: reward function (`rewards.JUDGES`: 'math' or 'exact').
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


@dataclasses.dataclass(frozen=True)
class CkptSpec:
  """Attributes: every_steps, keep, async_save (see `checkpoint.CheckpointConfig`);
  init_from (another run's checkpoint folder to take params from); export_hf (write the
  final policy as a Hugging Face folder `workdir/hf_final`)."""

  every_steps: int = 10
  keep: int = 3
  async_save: bool = False
  init_from: str = ""
  export_hf: bool = False

  @property
  def manager(self) -> CheckpointConfig:
    return CheckpointConfig(
      every_steps=self.every_steps, keep=self.keep, async_save=self.async_save
    )


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """Mesh axis sizes ('data', 'fsdp', 'tensor'); one may be -1 (all remaining devices)."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1


@dataclasses.dataclass(frozen=True)
class TrainSpec:
  """Attributes: num_minibatches (k updates per RL step), micro_batch_size (rows per
  gradient-accumulation step, 0 = whole mini-batch), remat (per-block rematerialisation)."""

  num_minibatches: int = 4
  micro_batch_size: int = 0
  remat: bool = False


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A whole experiment, checked. Groups mirror the config file's."""

  seed: int = 0
  model: ModelSpec = ModelSpec(preset="tiny-llama")
  tokenizer: TokenizerSpec = TokenizerSpec()
  data: DataSpec = DataSpec()
  sampler: SamplerSpec = SamplerSpec()
  ada: AdaConfig = AdaConfig()
  rl: RLSpec = RLSpec()
  loss: LossConfig = LossConfig()
  optim: OptimConfig = OptimConfig()
  train: TrainSpec = TrainSpec()
  ckpt: CkptSpec = CkptSpec()
  warmstart: WarmStartConfig | None = None
  eval: EvalConfig = EvalConfig(benchmarks=(), k=4)
  mesh: MeshSpec = MeshSpec()

  @property
  def train_config(self) -> TrainConfig:
    # The sampler's temperature is the one source of the trainer's (PPO ratio consistency).
    return TrainConfig(
      loss=self.loss,
      optim=self.optim,
      temperature=self.sampler.rule.logprob_temperature,
      **dataclasses.asdict(self.train),
    )

  @property
  def train_rows(self) -> int:
    """Rows of the RL training batch: B·n, or K·B for est (`AdaConfig.train_rows`)."""
    return self.ada.train_rows(self.rl.batch_prompts)

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
    if self.rl.steps < 1:
      raise ConfigError(f"config.rl.steps must be >= 1, got {self.rl.steps}")
    if self.rl.batch_prompts < 1:
      raise ConfigError(f"config.rl.batch_prompts must be >= 1, got {self.rl.batch_prompts}")
    if self.train_rows % self.train.num_minibatches:
      raise ConfigError(
        f"config.train.num_minibatches ({self.train.num_minibatches}) must divide the "
        f"training batch ({self.train_rows} rows = rl.batch_prompts × responses per prompt)"
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
    kwargs[key] = value
  try:
    return cls(**kwargs)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.{path}: {e}") from None


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
    sub = _dataclass_of(fields[key])
    kwargs[key] = build(sub, value, key) if sub is not None else value
  run = RunConfig(**kwargs)
  run.check()
  return run


def model_config(spec: ModelSpec, hf_config: Mapping[str, Any] | None = None) -> ModelConfig:
  """The architecture: a preset with overrides, or a Hugging Face config.json dict."""
  if spec.preset:
    base = PRESETS[spec.preset]
  else:
    base = weights.config_from_hf(dict(hf_config or {}), source=f"{spec.hf_dir}/config.json")
  try:
    return dataclasses.replace(
      base, dtype=spec.dtype, param_dtype=spec.dtype, **dict(spec.overrides)
    )
  except ValueError as e:
    raise ConfigError(f"config.model: {e}") from None
