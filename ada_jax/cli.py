"""Command-line plumbing shared by the entry points (`main`, `evaluate`, `select_prompts`,
`plan`): flag parsing with one-line errors, quiet logs, usage-error exits, and configs
importable from any working directory. Nothing in the library imports it.
"""

from __future__ import annotations

import contextlib
import logging as std_logging
import pathlib
import sys
import typing
from collections.abc import Iterator

from absl import app, flags, logging
from ml_collections import config_dict, config_flags
from ml_collections.config_flags.config_flags import ConfigFileFlagParser

from ada_jax.config import RENAMED, ConfigError, complete


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


class _GetConfigFailed(Exception):
  """A `--config` file's `get_config(arg)` raised (not a ValueError, which absl would wrap)."""


class _CompletingParser(ConfigFileFlagParser):
  """Loads a `--config` file as ml_collections does, then adds the fields it leaves out
  (`config.complete`) before the `--config.x.y` overrides are matched against it."""

  def __init__(self, name: str):
    super().__init__(name, lock_config=False)

  def parse(self, path):
    try:
      config = super().parse(path)
    except (TypeError, ValueError) as e:
      # ml_collections re-raises get_config's error with its traceback as the message;
      # the original (e.g. an unknown `:host` argument) is the one line a user needs.
      original = e.__context__ if isinstance(e.__context__, (TypeError, ValueError)) else e
      file, _, host = str(path).partition(":")
      if host and isinstance(original, TypeError) and "positional argument" in str(original):
        raise _GetConfigFailed(
          f"--config={path}: {file} has no host settings (its get_config() takes no "
          f"argument): drop ':{host}', or use a config whose get_config(host) takes one"
        ) from None
      raise _GetConfigFailed(f"--config={path}: {original}") from None
    if isinstance(config, config_dict.ConfigDict):  # else a deferred load error
      complete(config)
      config.lock()
    return config


def define_config_file(name: str, help_string: str, flag_values=None, sys_argv=None):
  """`config_flags.DEFINE_config_file` (locked) whose config has every field of the run's
  config groups, so every field can be overridden from the command line."""
  fv = flags.FLAGS if flag_values is None else flag_values
  holder = config_flags.DEFINE_config_file(
    name, None, help_string, fv, lock_config=True, sys_argv=sys_argv
  )
  fv[name].parser = _CompletingParser(name)
  return holder


def parse_flags(argv: list[str]) -> list[str]:
  """absl `flags_parser` for command lines with a `--config` file: a config file that does
  not load, or an override of a field the config does not have (`--config.rl.batchsize=3`),
  ends the process with one line and exit code 2, like a `ConfigError`, instead of
  ml_collections' traceback; a `--config` file that does not exist is named as typed.
  `--help` exits with code 0, and any other flag error with 2 (absl's own exit with 1)."""
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
  except _GetConfigFailed as e:
    _usage_exit(str(e))
  except (AttributeError, KeyError) as e:
    inner = e
    while inner.args and isinstance(inner.args[0], BaseException):  # ml_collections nests
      inner = inner.args[0]
    text = str(inner.args[0] if inner.args else inner)
    if "get_config" in text:  # the file loaded but is not an experiment config
      _usage_exit(f"--config: {text}")
    overrides = [a.split("=")[0].removeprefix("--") for a in argv[1:] if a.startswith("--config.")]
    moved = [
      f"{o} moved to config.{RENAMED[key]}"
      for o in overrides
      if (key := o.removeprefix("config.")) in RENAMED
    ]
    if moved:
      _usage_exit("; ".join(moved))
    which = ", ".join(overrides) if len(overrides) == 1 else f"one of {', '.join(overrides)}"
    _usage_exit(f"the config has no field named by {which} ({text})")


def quiet_logs() -> None:
  """For command-line entry points, before JAX picks its backend: log at WARNING unless
  `--verbosity` was given (orbax, TFDS, JAX's platform probe and the multi-process set-up
  log every file and probe at INFO; progress bars and status lines say what matters).
  Either way, the CUDA plugin's start-up traceback on a machine with no CUDA at all is
  dropped (`_NoCudaHere`)."""
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  std_logging.getLogger("jax._src.xla_bridge").addFilter(_NoCudaHere())


class _NoCudaHere(std_logging.Filter):
  """Drops JAX's "Jax plugin configuration error" traceback when the CUDA plugin finds no
  CUDA libraries: the dev requirements install the plugin to compile GPU plans on CPU
  machines (docs/gpu.md), where JAX then runs on the CPU as it would without it. Any other
  CUDA failure (a GPU machine with mismatched libraries) is still logged."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not (
      "xla_cuda12" in record.getMessage()
      and error is not None
      and "Unable to load CUDA. Is it installed?" in str(error)
    )


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
