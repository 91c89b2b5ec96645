"""Entry point: `python -m ada_jax.main --config=configs/<experiment>.py --workdir=DIR`.

Thin on purpose (STYLE.md §1): parse flags, join the multi-process run if there is one
(`ada_jax.distributed`, configured by environment variables), log the process/device
facts, hand over to `ada_jax.loop.run`.
"""

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")


def main(argv):
  del argv
  from ada_jax import distributed

  distributed.initialize(distributed.DistributedConfig.from_env())  # before any JAX use
  import jax

  if not flags.FLAGS["verbosity"].present:
    # orbax and TFDS log every file they touch at INFO; the progress bar says what matters.
    logging.set_verbosity(logging.WARNING)
  logging.warning("process %d/%d, %d local / %d global devices (%s)", jax.process_index(),
                  jax.process_count(), jax.local_device_count(), jax.device_count(),
                  jax.devices()[0].platform)
  from ada_jax import config, loop

  with distributed.exit_on_failure(), config.exit_on_config_error():
    summary = loop.run(_CONFIG.value, _WORKDIR.value)
  if "after_rl" not in summary:  # stopped early (SIGTERM): say so, not "done"
    print(f"stopped after RL step {summary['steps_done']} with a checkpoint; run the same "
          f"command again to resume. Files: {_WORKDIR.value}")
    return
  before, after = summary.get("before_rl", {}), summary.get("after_rl", {})
  scores = "".join(f"\n  {k}: {before.get(k, float('nan')):.4f} -> {v:.4f}"
                   for k, v in after.items() if "avg@" in k)
  print(f"done: {summary['steps_done']} RL steps; held-out before -> after RL:{scores}\n"
        f"  details: {_WORKDIR.value}/summary.json, metrics.jsonl, eval/, tensorboard/")


if __name__ == "__main__":
  from ada_jax import config

  config.make_configs_importable()
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main, flags_parser=config.parse_flags)
