"""Will this config fit that TPU slice or GPU host? `python -m ada_jax.plan
--config=configs/<experiment>.py --topology=v5e-8|h100x8|... [--config.group.field=value ...]
[--json=PATH] [--mem_fraction=0.75] [--nosize_slots]`, on a laptop, before renting the
machines.

Compiles every program the run holds in device memory with the target's own compiler
(libtpu for TPU slices, the CUDA plugin for GPUs; ahead of time, no accelerator needed)
on the config's mesh over the target's devices (`verdict.plan`). Prints per phase the
bytes per device against the memory a program may use (a TPU's HBM; a GPU's memory times
JAX's allocator fraction, `--mem_fraction`), the largest temporary buffers, the largest
slot counts that fit, and a compiler-derived decode roofline (not a measurement; on GPU
with the decode step's kernel launches).
Exit codes: 0 every phase fits, 1 one does not (named, with its buffers, or XLA's
refusal), 2 a bad flag, config field or target name (one line, nothing compiled).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

from absl import app, flags

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_USAGE = 0, 1, 2


def _check_writable(path: str) -> None:
  """Refuses a `--json` path that cannot be written (checked, nothing created).

  Raises:
    ConfigError: naming the flag and why.
  """
  from ada_jax.config import ConfigError

  target = pathlib.Path(path).absolute()
  if not path or target.is_dir():
    raise ConfigError(f"--json={path}: not a file name")
  folder = target.parent
  if not folder.is_dir():
    raise ConfigError(f"--json={path}: no folder {folder}")
  if not os.access(target if target.exists() else folder, os.W_OK):
    raise ConfigError(f"--json={path}: not writable")


def define_flags() -> None:
  """The command's flags, on absl's global FLAGS (only when run as the command: importing
  this module defines none, so it sits beside other entry points in one process)."""
  from ada_jax import cli
  from ada_jax.plan import targets

  cli.define_config_file("config", "Experiment config file.")
  flags.DEFINE_string("topology", None, f"TPU slice or GPU host(s): {', '.join(targets.TARGETS)}.")
  flags.DEFINE_float(
    "mem_fraction",
    targets.DEFAULT_MEM_FRACTION,
    "GPU targets: the fraction of each card's memory JAX's allocator takes "
    "(XLA_PYTHON_CLIENT_MEM_FRACTION).",
  )
  flags.DEFINE_string("json", None, "Also write the whole plan as JSON here.")
  flags.DEFINE_bool(
    "size_slots",
    True,
    "Also find the largest rollout and evaluation slot counts that fit (more compiles).",
  )


def main(argv) -> int:
  del argv
  topology, json_path = flags.FLAGS.topology, flags.FLAGS.json
  mem_fraction = flags.FLAGS.mem_fraction
  from ada_jax import cli, metrics
  from ada_jax import config as config_lib
  from ada_jax.plan import programs, targets, verdict

  with cli.exit_on_config_error():
    if topology not in targets.TARGETS:
      raise config_lib.ConfigError(
        f"--topology={topology}: unknown TPU slice or GPU host; known: {', '.join(targets.TARGETS)}"
      )
    if not 0 < mem_fraction <= 1:
      raise config_lib.ConfigError(f"--mem_fraction={mem_fraction}: must be in (0, 1]")
    cfg = config_lib.parse(flags.FLAGS.config)
    try:
      programs.model_of(cfg)
    except ValueError as e:
      raise config_lib.ConfigError(str(e)) from None
    if json_path is not None:  # before minutes of compiling, not after them
      _check_writable(json_path)
    try:
      devices = targets.devices_for(targets.TARGETS[topology])
    except RuntimeError as e:
      raise config_lib.ConfigError(f"--topology={topology}: {e}") from None
    try:
      programs.mesh_for(cfg, devices)
    except ValueError as e:
      raise config_lib.ConfigError(f"config.mesh on {topology}: {e}") from None
  compiler = targets.TARGETS[topology].compiler
  print(f"compiling for {topology} with {compiler} (minutes on a laptop)", flush=True)
  try:
    result = verdict.plan(
      cfg,
      topology,
      devices=devices,
      progress=lambda line: print(line, flush=True),
      mem_fraction=mem_fraction,
      size_slots=flags.FLAGS.size_slots,
    )
  except ValueError as e:  # a batch or chunk that does not divide over this mesh
    print(f"ada_jax: {e}", file=sys.stderr)
    return EXIT_USAGE
  print(verdict.report(result), flush=True)
  if json_path:
    record = result.as_json()
    record |= {"git_commit": metrics.git_commit(), "config": config_lib.as_dict(cfg)}
    try:
      with open(json_path, "w") as f:
        json.dump(record, f, indent=1, default=str)
    except OSError as e:  # the file's folder went away while compiling
      print(f"ada_jax: --json={json_path}: {e.strerror}", file=sys.stderr, flush=True)
      return EXIT_USAGE
  return EXIT_FITS if result.fits else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the target; run nothing
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from ada_jax import cli

  cli.make_configs_importable()
  define_flags()
  flags.mark_flags_as_required(["config", "topology"])
  app.run(main, flags_parser=cli.parse_flags)
