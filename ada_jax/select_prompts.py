"""Command line of training-prompt selection: `python -m ada_jax.select_prompts
--config=configs/<experiment>.py --workdir=DIR [--hf_dir=PATH | --checkpoint=STEP] [--k=16]
[--rules=hard:0.125:1,easy:0.3125:1] [--limit=N]`.

Thin on purpose: flags, then `selection` (what the outputs in `<workdir>/select/`
are is described there).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

from absl import app, flags, logging

from ada_jax import cli, saved_params
from ada_jax import config as config_lib
from ada_jax.models import sharding
from ada_jax.policy import load_model
from ada_jax.selection import SelectConfig, parse_rules, run, training_prompts


def define_flags(flag_values=None, sys_argv: list[str] | None = None) -> None:
  """Registers the CLI flags on `flag_values` (default: absl's global FLAGS)."""
  fv = flags.FLAGS if flag_values is None else flag_values
  help_ = "Experiment config: its data (prompts), model, tokenizer, sampler, rl, mesh groups."
  cli.define_config_file("config", help_, fv, sys_argv=sys_argv)
  for define, name, default, help_ in (
    (flags.DEFINE_string, "workdir", None, "Outputs go to <workdir>/select."),
    (flags.DEFINE_string, "hf_dir", None, "Hugging Face folder or Hub id of the model."),
    (flags.DEFINE_integer, "checkpoint", None, "Orbax checkpoint step of the model."),
    (flags.DEFINE_string, "checkpoint_dir", None, "Default: <workdir>/checkpoints."),
    (flags.DEFINE_string, "tokenizer_dir", None, "Default: config.tokenizer.dir, else model's."),
    (flags.DEFINE_integer, "k", 16, "Samples per prompt (K)."),
    (flags.DEFINE_float, "temperature", 1.0, "Sampling temperature."),
    (flags.DEFINE_integer, "max_new_tokens", None, "Default: config.sampler.max_new_tokens."),
    (flags.DEFINE_integer, "problems_per_batch", 64, "Prompts per sampler call / cache unit."),
    (flags.DEFINE_integer, "seed", None, "Sampling seed; default: config.seed."),
    (flags.DEFINE_integer, "limit", 0, "Only the first N prompts (0 = all)."),
    (flags.DEFINE_string, "rules", "hard:0.125:1,easy:0.3125:1", "name:max_rate[:min_correct],..."),
  ):
    define(name, default, help_, flag_values=fv)


def main(argv: Sequence[str], flag_values=None) -> dict[str, Any]:
  """The CLI: loads prompts and model from the config and flags, then calls `run`.

  Raises:
    config.ConfigError: no --config, an empty --workdir or one that is a file, both
      --hf_dir and --checkpoint, a checkpoint that is not there or of another model, a
      bad flag, rule or config field (named).
  """
  del argv
  fv = flags.FLAGS if flag_values is None else flag_values
  if flag_values is None and not fv["verbosity"].present:
    # orbax and TFDS log every file they touch at INFO; the progress bar says what matters.
    logging.set_verbosity(logging.WARNING)
  if fv.config is None:
    raise config_lib.ConfigError("--config is required")
  out = config_lib.check_workdir(fv.workdir) / "select"
  if fv.hf_dir and fv.checkpoint is not None:
    raise config_lib.ConfigError("give at most one of --hf_dir and --checkpoint")
  if fv.limit < 0:
    raise config_lib.ConfigError(f"--limit={fv.limit}: must be >= 0 (0 = all)")
  cfg = config_lib.parse(fv.config)
  sampler = {n: getattr(fv, n) for n in ("temperature", "max_new_tokens")}
  try:
    config = SelectConfig.from_run_config(
      cfg,
      rules=parse_rules(fv.rules),
      sampler={k: v for k, v in sampler.items() if v is not None},
      **{n: getattr(fv, n) for n in ("k", "problems_per_batch", "seed")},
    )
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  except (TypeError, ValueError) as e:  # a flag SelectConfig or the mesh refuses
    raise config_lib.ConfigError(f"a bad flag: {' '.join(str(e).split())}") from None
  ckpt = None
  if fv.checkpoint is not None:
    ckpt = pathlib.Path(fv.checkpoint_dir or pathlib.Path(fv.workdir) / "checkpoints")
    ckpt = ckpt.absolute() / str(fv.checkpoint)
    try:
      saved_params.params_step_dir(ckpt)
    except FileNotFoundError as e:  # as evaluate: a usage error, named
      raise config_lib.ConfigError(f"--checkpoint={fv.checkpoint}: {e}") from None
  base = load_model(
    cfg,
    mesh,
    hf_dir=fv.hf_dir or None,
    checkpoint_path=ckpt,
    tokenizer_dir=fv.tokenizer_dir,
    init_dir=out,
  )
  ps = training_prompts(cfg, base.tokenizer, fv.limit)
  info = {"init_from": base.init_from, "prompts_dropped_over_max_tokens": ps.num_dropped}
  kw = dict(params=base.params, model_config=base.model_config, tokenizer=base.tokenizer)
  return run(config, out, prompt_set=ps, model_tag=base.tag, mesh=mesh, info=info, **kw)


if __name__ == "__main__":
  define_flags()
  cli.make_configs_importable()

  def _main(argv):
    with cli.exit_on_config_error():
      summary = main(argv)
    if summary.get("files"):
      print(pathlib.Path(summary["files"]["pass_rates.md"]).read_text())

  # _main returns None: app.run would sys.exit() a returned summary.
  app.run(_main, flags_parser=cli.parse_flags)
