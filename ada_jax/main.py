"""Entry point: `python -m ada_jax.main --config=configs/<experiment>.py --workdir=DIR`.

Thin on purpose (docs/design.md "Architecture"): parse flags, join the multi-process run if there
is one
(`ada_jax.distributed`, configured by environment variables), log the process/device
facts, hand over to `ada_jax.loop.run`.

Exit codes, for scripts and job schedulers (README.md's table):
  0  (`EXIT_FINISHED`) all RL steps and the held-out evaluation after RL are done (by this
     process, or already: a rerun of a finished run writes nothing).
  75 (`EXIT_STOPPED`, EX_TEMPFAIL) stopped by SIGTERM or a first Ctrl-C: after an RL step
     with a checkpoint of it, or at once outside the RL loop (set-up, warm start, held-out
     evaluation; nothing there is lost but the unfinished part): run the same command
     again to resume.
  2  (`EXIT_USAGE`) a bad flag or config field, an empty `--workdir` or a file, a resume
     with a changed config or an `rl.steps` below its latest checkpoint, a workdir held by
     another run, or a model folder or checkpoint that does not load as the configured
     model (one line naming it); nothing was run.
  3  (`EXIT_NONFINITE`) a NaN or infinite loss, gradient norm or update: stopped before
     saving it (one line naming the step and the quantity); the checkpoints are finite.
  1  a failure: one line for a checkpoint that no longer restores or a full disk, else a
     traceback (with several processes, one line per process); the run resumes from its
     last good checkpoint when started again.
A second Ctrl-C interrupts at once without a new checkpoint (Python's KeyboardInterrupt,
exit status 130 in a shell).
"""

import os
import sys

from absl import app, flags, logging

from ada_jax import cli

EXIT_FINISHED = 0
EXIT_STOPPED = 75
EXIT_USAGE = 2
EXIT_NONFINITE = 3
EXIT_FAILED = 1

_CONFIG = cli.define_config_file("config", "Experiment config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")


def main(argv):
  del argv
  from ada_jax import distributed

  cli.quiet_logs()  # before JAX probes its platforms
  distributed.initialize(distributed.DistributedConfig.from_env())  # before any JAX use
  import jax

  logging.warning(
    "process %d/%d, %d local / %d global devices (%s)",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
    jax.devices()[0].platform,
  )
  from ada_jax import checkpoint, loop, runstate
  from ada_jax.models import folder

  with distributed.exit_on_failure(), cli.exit_on_config_error():
    try:
      summary = loop.run(_CONFIG.value, _WORKDIR.value)
    except runstate.Stopped as e:
      summary = {"stopped_by": e.signal_name, "phase": e.phase}
    except (
      checkpoint.NonFiniteError,
      checkpoint.UnreadableCheckpoint,
      checkpoint.DiskFullError,
      folder.CheckpointError,  # the final export: a full disk (summary.json already written)
    ) as e:
      print(f"ada_jax: {e}", file=sys.stderr, flush=True)
      return EXIT_NONFINITE if isinstance(e, checkpoint.NonFiniteError) else EXIT_FAILED
  text, code = report(summary, _WORKDIR.value)
  if jax.process_index() == 0:
    print(text, flush=True)
  if "phase" in summary:
    # Stopped outside the RL loop, possibly between a jitted call and its result: the
    # interpreter's teardown of JAX's runtime threads then crashed (SIGSEGV) after this
    # clean stop. Nothing is left to write (no checkpoint is open in these phases).
    sys.stderr.flush()
    os._exit(code)
  return code


def report(summary: dict, workdir: str) -> tuple[str, int]:
  """The closing lines on stdout and the exit code of a run with `loop.run`'s `summary`
  (or, for a stop outside the RL loop, `{'stopped_by': signal, 'phase': what ran}`)."""
  if "phase" in summary:
    return (
      f"stopped by {summary['stopped_by']} during {summary['phase']}; run the same command "
      f"again to resume from the latest checkpoint, if any (exit code {EXIT_STOPPED}). "
      f"Files: {workdir}"
    ), EXIT_STOPPED
  if "stopped_by" in summary:  # stopped early: say so, not "done"
    return (
      f"stopped by {summary.get('stopped_by', 'a signal')} after RL step "
      f"{summary['steps_done']} with a checkpoint; run the same command again to "
      f"resume (exit code {EXIT_STOPPED}). Files: {workdir}"
    ), EXIT_STOPPED
  before, after = summary.get("before_rl", {}), summary.get("after_rl", {})
  if summary.get("before_rl_comparable", True):
    scores = "".join(
      f"\n  {k}: {before.get(k, float('nan')):.4f} -> {v:.4f}"
      for k, v in after.items()
      if "avg@" in k
    )
    heading = "held-out before -> after RL"
  else:  # the eval group changed on a resume: two numbers of different measurements
    scores = "".join(f"\n  {k}: {v:.4f}" for k, v in after.items() if "avg@" in k)
    changes = "; ".join(summary.get("before_rl_eval_changes", []))
    heading = (
      "held-out after RL (not comparable with before RL, measured with other eval "
      f"settings: {changes})"
    )
  held_out = (
    f"; {heading}:{scores}"
    if scores
    else " (no held-out benchmarks: config.eval.benchmarks is empty)"
  )
  return (
    f"done: {summary['steps_done']} RL steps{held_out}\n"
    f"  details: {workdir}/summary.json, metrics.jsonl, eval/, tensorboard/"
  ), EXIT_FINISHED


if __name__ == "__main__":
  cli.make_configs_importable()
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main, flags_parser=cli.parse_flags)  # exits with main's return value
