"""Command line of the held-out evaluation: `python -m ada_jax.evaluate --config=...
--workdir=DIR (--checkpoint=STEP | --hf_dir=PATH) [--benchmarks=...] [--k=K] [--json]`.

Thin on purpose: flags, then `policy.load_model` and `eval.evaluator.run`; the
report goes to `<workdir>/eval/` and its table (or JSON) to stdout.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
from absl import app, flags

from ada_jax import cli, runstate, saved_params
from ada_jax import config as config_lib
from ada_jax.eval import benchmarks as benchmarks_lib
from ada_jax.eval.benchmarks import EvalConfig
from ada_jax.eval.evaluator import report_text, run
from ada_jax.models import sharding
from ada_jax.policy import load_model


def define_flags(flag_values=None, sys_argv: list[str] | None = None) -> None:
  """Registers the CLI flags on `flag_values` (default: absl's global FLAGS)."""
  fv = flags.FLAGS if flag_values is None else flag_values
  help_ = "Experiment config file (as for training); its eval, model, tokenizer, mesh are read."
  cli.define_config_file("config", help_, fv, sys_argv=sys_argv)
  for define, name, help_ in (
    (flags.DEFINE_string, "workdir", "Run directory; reports go to <workdir>/eval."),
    (flags.DEFINE_integer, "checkpoint", "Orbax checkpoint step to evaluate."),
    (flags.DEFINE_string, "checkpoint_dir", "Orbax directory (default <workdir>/checkpoints)."),
    (flags.DEFINE_string, "hf_dir", "Hugging Face folder or Hub id to evaluate."),
    (flags.DEFINE_string, "tokenizer_dir", "Default: config.tokenizer.dir, else the model's."),
    (
      flags.DEFINE_list,
      "benchmarks",
      f"Comma-separated, from {sorted(benchmarks_lib.BENCHMARKS)}.",
    ),
    (flags.DEFINE_integer, "k", "Responses per problem (Avg@k)."),
    (flags.DEFINE_integer, "limit", "Only the first N problems of each benchmark."),
  ):
    define(name, None, help_, flag_values=fv)
  flags.DEFINE_bool(
    "json", False, "Print the report as JSON on stdout instead of the table.", flag_values=fv
  )


def main(argv: Sequence[str], flag_values=None) -> dict[str, Any]:
  """The CLI: loads the model named by --hf_dir or --checkpoint and calls `run`.

  The model is `load_model`'s: with --checkpoint the architecture is the config's `model`
  group, exactly as the run that wrote the checkpoint built it; with --hf_dir it is the
  folder's config.json (in the config's `model.dtype`). The tokenizer: --tokenizer_dir,
  else `tokenizer.dir`, else the model's folder, else the arithmetic task's.

  Raises:
    ValueError: neither or both of --hf_dir / --checkpoint, no --workdir, an unreadable model
      folder, a tokenizer larger than the model's vocabulary, or a bad config field (named).
  """
  del argv
  fv = flags.FLAGS if flag_values is None else flag_values
  config_lib.check_workdir(fv.workdir)
  if (fv.hf_dir is None) == (fv.checkpoint is None):
    raise config_lib.ConfigError("give exactly one of --hf_dir=PATH and --checkpoint=STEP")
  if fv.config is not None:
    cfg = config_lib.parse(fv.config)
  else:
    cfg = dataclasses.replace(config_lib.RunConfig(), eval=EvalConfig())
  flags_ = {
    k: v
    for k, v in {"benchmarks": fv.benchmarks, "k": fv.k, "limit": fv.limit}.items()
    if v is not None
  }
  try:
    config = dataclasses.replace(cfg.eval, **flags_)
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from None
  # A report made with other benchmarks / k / limit than the config's gets its own name, so
  # it never replaces the run's own eval/step_<n> report.
  suffix = "".join(
    "_" + ("+".join(v) if k == "benchmarks" else f"{k}{v}") for k, v in sorted(flags_.items())
  )
  if fv.hf_dir is not None:
    model = load_model(cfg, mesh, hf_dir=fv.hf_dir, tokenizer_dir=fv.tokenizer_dir)
    tag, name = model.tag, f"hf_{pathlib.Path(fv.hf_dir).absolute().name}"
  else:
    directory = pathlib.Path(fv.checkpoint_dir or pathlib.Path(fv.workdir) / "checkpoints")
    directory = directory.absolute()
    ckpt = directory / str(fv.checkpoint)
    try:
      saved_params.params_step_dir(ckpt)
    except FileNotFoundError as e:
      raise config_lib.ConfigError(f"--checkpoint={fv.checkpoint}: {e}") from None
    model = load_model(cfg, mesh, checkpoint_path=ckpt, tokenizer_dir=fv.tokenizer_dir)
    tag, name = model.tag, f"step_{fv.checkpoint}"
  return run(
    config,
    fv.workdir,
    params=model.params,
    model_config=model.model_config,
    tokenizer=model.tokenizer,
    model_tag=tag,
    name=name + suffix,
    mesh=mesh,
    # The run's own eval key (`runstate.RunKeys.eval` of the config's seed): a checkpoint of
    # the run gets the samples, and the cached results, of the run's own evaluation.
    rng=runstate.run_keys(jax.random.key(cfg.seed)).eval,
  )


if __name__ == "__main__":
  define_flags()
  cli.make_configs_importable()

  def _main(argv):
    cli.quiet_logs()
    with cli.exit_on_config_error():
      report = main(argv)
    print(report_text(report, flags.FLAGS.workdir, as_json=flags.FLAGS.json), flush=True)
    # Not returned: app.run would sys.exit() a returned report.

  app.run(_main, flags_parser=cli.parse_flags)
