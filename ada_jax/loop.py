"""The run: resumed from its latest checkpoint or started fresh (`start.initial_state`),
the loop over RL steps, evaluations, checkpoints.

Per RL step `step.rl_step` runs prompts -> the one controller's rollouts -> training batch
-> policy update (docs/design.md, "One RL step"); here the step's metrics go to
JSONL/TensorBoard/console and the whole run state is checkpointed every
`ckpt.every_steps` steps, at the end, and on SIGTERM or Ctrl-C (the summary then names
the signal, `stopped_by`, and has no `after_rl`). Outside the RL loop (set-up, warm start,
held-out evaluations) SIGTERM and Ctrl-C stop at once (`runstate.Stopped`); a non-finite
step stops the run before it is saved (`runstate.check_step`); the workdir is held by one
run (`runstate.hold_workdir`).

Determinism: the rollout key of step s is `fold_in(keys.rollout, s)` (`runstate.RunKeys`);
the root key it comes from, the host Generator, the prompt position and the Est statistics
are checkpointed and read back, so a run restarted from its last checkpoint repeats
exactly the steps an uninterrupted run would take.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import serialization

from ada_jax import checkpoint, distributed, inputs, runstate, saved_params, start
from ada_jax import config as config_lib
from ada_jax import metrics as metrics_lib
from ada_jax.config import ConfigError
from ada_jax.data import prompts as prompts_lib
from ada_jax.eval import benchmarks
from ada_jax.eval.evaluator import Evaluator
from ada_jax.models import sharding as sharding_lib
from ada_jax.models import weights
from ada_jax.models.decoder import ModelConfig
from ada_jax.models.tokenizer import Tokenizer
from ada_jax.rewards.verifier import Verifier
from ada_jax.rl import train, update
from ada_jax.rollout import sampler as sampler_lib
from ada_jax.step import StepContext, rl_step


def _heldout_eval(evaluator, workdir, params, step, rng):
  """The held-out benchmarks of the current policy (`evaluator`, the run's
  `eval.evaluator.Evaluator`, or None: none set), report in workdir/eval/step_<step>.*,
  with a progress bar and a closing line on the console; `rng` the run's eval key
  (`runstate.RunKeys.eval`: every evaluation of the run samples with it, so two
  evaluations differ only by the policy). Returns the flat metrics."""
  if evaluator is None:
    return {}
  config = evaluator.config
  metrics_lib.console(
    f"held-out evaluation at RL step {step}: {', '.join(config.benchmarks)} (Avg@{config.k})"
  )
  report = evaluator.run(
    workdir, params, name=f"step_{step}", rng=rng, progress=jax.process_index() == 0
  )
  flat = benchmarks.flat_metrics(report["results"])
  metrics_lib.console(
    f"held-out at RL step {step}: "
    + ", ".join(
      f"{k.removeprefix('eval/')} {v:.4f}"
      for k, v in flat.items()
      if "avg@" in k or k.endswith("/boxed_rate")
    )
  )
  return flat


def run(config, workdir: str) -> dict[str, Any]:
  """Runs (or resumes) the experiment `config` (ConfigDict) in `workdir`, first logging the
  settings that run but are likely mistakes (`RunConfig.warnings`).

  Returns:
    The run summary (also written to `workdir/summary.json`).

  Raises:
    ConfigError: a bad config (named field), before any compile or any file is written.
  """
  cfg = config_lib.parse(config)
  for warning in cfg.warnings():
    logging.warning("%s", warning)
  return train_run(cfg, workdir)


def train_run(cfg: config_lib.RunConfig, workdir: str) -> dict[str, Any]:
  """`run` on a parsed config.

  Raises:
    runstate.Stopped: SIGTERM or Ctrl-C outside the RL loop (the same command resumes).
    checkpoint.NonFiniteError: a non-finite loss, gradient norm or update (nothing of it
      saved).
    checkpoint.UnreadableCheckpoint: the workdir has checkpoints but none restores.
    checkpoint.DiskFullError: a checkpoint did not fit on the disk.
  """
  workdir = str(config_lib.check_workdir(workdir))
  with runstate.stop_signals("the set-up") as stop, contextlib.ExitStack() as stack:
    return _train(cfg, workdir, stop, stack)


def _train(cfg, workdir: str, stop: runstate.StopRequest, stack: contextlib.ExitStack):
  """The run's phases in order: set-up (nothing written), start (the workdir held, the
  state restored or made), the evaluation before RL, the RL loop, the close-out."""
  setup = _set_up(cfg, workdir)
  if setup.evaluator is not None:  # its verifier pools serve every held-out evaluation
    stack.callback(setup.evaluator.close)
  started = _start(setup, stop, stack)
  if isinstance(started, dict):  # already finished with these settings
    return started
  writer = metrics_lib.MetricsWriter(
    workdir,
    total_steps=cfg.rl.steps,
    start_step=started.progress.step,
    primary=jax.process_index() == 0,
  )
  stack.callback(writer.close)
  _evaluate_before_rl(setup, started, writer, stop)
  end = _rl_loop(setup, started, writer, stop)
  return _close_out(setup, started, end, writer, stop)


@dataclasses.dataclass(frozen=True)
class _SetUp:
  """What the run reads and builds before it writes anything (`_set_up`)."""

  cfg: config_lib.RunConfig
  workdir: str
  model_dir: str | None
  model_cfg: ModelConfig
  tokenizer: Tokenizer
  mesh: jax.sharding.Mesh
  prompts: prompts_lib.PromptSet
  evaluator: Evaluator | None
  sampler: sampler_lib.Sampler
  # What the run depends on, the prompts' fingerprint standing for where they were read.
  record: dict[str, Any]


@dataclasses.dataclass
class _Started:
  """The run's state after `_start`: restored from its latest checkpoint or made anew."""

  manager: Any
  source: str  # 'checkpoint:<step>' or `start.initial_params`' source
  state: train.TrainState
  method_state: Any  # the sampling rule's (`Rule.init_state`), None until its first step
  root: jax.Array  # the checkpoint's root key, not the config's seed (tests/test_guards.py)
  keys: runstate.RunKeys  # the keys derived from `root`, once
  progress: runstate.Progress
  iterator: prompts_lib.PromptIterator
  np_rng: np.random.Generator


@dataclasses.dataclass(frozen=True)
class _End:
  """How the RL loop ended (`_rl_loop`)."""

  step: int
  state: train.TrainState
  stopped_by: str | None  # the signal that stopped it, or None: ran to `rl.steps`
  agreed: str | None  # the processes' common controller fingerprint


def _set_up(cfg: config_lib.RunConfig, workdir: str) -> _SetUp:
  """Model files, mesh, prompts, evaluator and sampler, each bad setting refused with the
  field named (`ConfigError`) before anything is written or compiled."""
  model_dir, model_cfg, tokenizer = inputs.load_model_files(cfg.model, cfg.tokenizer)
  saved = pathlib.Path(workdir) / "checkpoints"
  if model_dir and not cfg.ckpt.init_from and not (saved.is_dir() and any(saved.iterdir())):
    try:  # a fresh start reads these weights: a bad file is refused before the workdir is held
      weights.check_hf(model_dir, model_cfg)
    except weights.CheckpointError as e:
      raise ConfigError(f"config.model.hf_dir: {e}") from None
  try:
    mesh = sharding_lib.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  except ValueError as e:
    raise ConfigError(f"config.mesh: {e}") from None
  try:
    train.check_batch_layout(cfg.train_rows, cfg.train, mesh)
  except ValueError as e:
    raise ConfigError(
      f"config.rl.batch_prompts ({cfg.rl.batch_prompts}) with config.train and config.mesh: {e}"
    ) from None
  ps = inputs.load_prompts(cfg.data, tokenizer, seed=cfg.seed)
  if len(ps) < cfg.rl.batch_prompts:
    raise ConfigError(
      f"config.rl.batch_prompts ({cfg.rl.batch_prompts}) exceeds the "
      f"{len(ps)} usable training prompts"
    )
  evaluator = None
  if cfg.eval.benchmarks:  # set up once: every held-out evaluation reuses its data, compiles
    evaluator = Evaluator.make(cfg.eval, model_cfg, tokenizer, mesh)
  try:
    smp = sampler_lib.Sampler.from_spec(
      model_cfg,
      cfg.sampler,
      stop_ids=tokenizer.eos_ids,
      rows_per_prompt=cfg.min_rows_per_prompt,
      max_rows_per_prompt=cfg.max_rows_per_prompt,
      pad_id=tokenizer.pad_id,
      mesh=mesh,
    )
  except ValueError as e:
    raise ConfigError(f"config.sampler: {e}") from None
  if cfg.ckpt.init_from:
    try:
      saved_params.params_step_dir(cfg.ckpt.init_from)
    except FileNotFoundError as e:
      raise ConfigError(f"config.ckpt.init_from: {e}") from None
  record = {
    **runstate.config_record(cfg, model_cfg),
    **runstate.prompts_record(ps),
    **runstate.tokenizer_record(tokenizer),
  }
  return _SetUp(cfg, workdir, model_dir, model_cfg, tokenizer, mesh, ps, evaluator, smp, record)


def _start(
  setup: _SetUp, stop: runstate.StopRequest, stack: contextlib.ExitStack
) -> _Started | dict[str, Any]:
  """Holds the workdir and starts the run: from its latest checkpoint that restores (the
  whole run state; one made with an incompatible config is refused), else fresh
  (`start.initial_state`: `ckpt.init_from`, pretrained, init + warm start). A fresh run's
  step 0 is saved at once, so a restart never repeats the warm start and other runs can
  `init_from` it. Returns the summary instead when the run had already finished with these
  settings (nothing written).

  Raises:
    checkpoint.UnreadableCheckpoint: checkpoints exist but none restores.
  """
  cfg, workdir, record = setup.cfg, setup.workdir, setup.record
  with_ref = cfg.loss.kl_coeff > 0
  target = train.abstract_state(setup.model_cfg, cfg.train, setup.mesh, with_ref=with_ref)
  iterator = prompts_lib.PromptIterator(len(setup.prompts), cfg.rl.batch_prompts, seed=cfg.seed)
  fresh = runstate.Progress(
    iterator=_jsonable(iterator.state()),
    np_rng=runstate.generator_state(np.random.default_rng(cfg.seed)),
  )
  stack.enter_context(runstate.hold_workdir(workdir))  # one run per workdir
  manager = checkpoint.make_manager(pathlib.Path(workdir) / "checkpoints", cfg.ckpt)
  stack.callback(_close, manager)
  check = lambda host, step: runstate.check_resume(host.get("config"), record, step)
  latest = checkpoint.restore_latest(manager, target, check_host=check)
  if latest is not None:
    run_state, source = latest[0], f"checkpoint:{latest[1]}"
  else:
    run_state, source = start.initial_state(
      cfg,
      target,
      setup.model_cfg,
      setup.tokenizer,
      setup.mesh,
      model_dir=setup.model_dir,
      host=fresh.to_host(),
      phase=stop.enter,
      progress=jax.process_index() == 0,
    )
  logging.info("run state from %s", source)
  progress = runstate.Progress.from_host(run_state.host)
  iterator.restore(progress.iterator)
  stop.enter(None)  # signals are polled from here: a save is never cut
  if latest is not None:
    resumed = progress.step
    if resumed > cfg.rl.steps:  # nothing is run or written: the run's results stay
      raise ConfigError(
        f"config.rl.steps={cfg.rl.steps} is below the workdir's latest checkpoint (RL step "
        f"{resumed}): a run does not go back; rerun with config.rl.steps={resumed} for its "
        f"results or more to go on, or start a new run in another --workdir "
        f"(ckpt.init_from={workdir}/checkpoints/<step> starts it from these weights)"
      )
    finished = _finished_summary(workdir, resumed, record)
    if resumed == cfg.rl.steps and finished is not None:
      if cfg.ckpt.export_hf and not (_hf_final(workdir) / "config.json").is_file():
        # A resume may turn the export on (README): the final policy is this checkpoint.
        _export_final(setup, run_state.train.params)
        metrics_lib.console(f"already finished: exported the final policy to {_hf_final(workdir)}")
        return finished
      metrics_lib.console(
        f"already finished: RL step {resumed} and its evaluation after RL are done; nothing "
        f"to do ({workdir}/summary.json unchanged)"
      )
      return finished
    metrics_lib.console(
      f"resuming from step {resumed} (checkpoint {workdir}/checkpoints/{resumed})"
    )
    _say_if_not_comparable(progress, record)
  progress.config = record  # with any change a resume may make
  started = _Started(
    manager,
    source,
    run_state.train,
    cfg.rule.restore_state(cfg.ada, run_state.method_state),
    run_state.rng,
    runstate.run_keys(run_state.rng),
    progress,
    iterator,
    runstate.generator_from_state(progress.np_rng),
  )
  if latest is None:
    host = progress.to_host()
    checkpoint.save(manager, 0, dataclasses.replace(run_state, host=host))
  return started


def _evaluate_before_rl(setup, started, writer, stop) -> None:
  """The held-out evaluation of the starting policy (once: also after a stop during it,
  whose finished batches are cached), logged at step 0."""
  progress = started.progress
  if progress.step != 0:
    return
  if progress.before_rl is None:
    stop.enter("the held-out evaluation before RL")
    progress.before_rl_eval = _eval_settings(setup.record)  # what the scores below measure
    progress.before_rl = _heldout_eval(
      setup.evaluator, setup.workdir, started.state.params, 0, started.keys.eval
    )
    stop.enter(None)
  writer.add_scalars(0, progress.before_rl)


def _rl_loop(setup, started, writer, stop) -> _End:
  """RL steps from the one after the start to `rl.steps`: each step's metrics written, the
  processes' controller state compared, a checkpoint every `ckpt.every_steps`, at the end
  and when a signal asks the run to stop (after the current step)."""
  cfg, progress = setup.cfg, started.progress
  keys = started.keys
  logprob_fn = None
  if cfg.train.old_logprobs == "recompute":  # released: the trainer's old log-probs
    logprob_fn = update.make_logprob_step(setup.model_cfg, cfg.train, setup.mesh)
  with_ref = cfg.loss.kl_coeff > 0
  step_fn = train.make_train_step(setup.model_cfg, cfg.train, setup.mesh, with_ref=with_ref)
  # The stop ids end responses in training and evaluation; the folder's are the default.
  writer.log_text(f"stop ids {list(setup.tokenizer.eos_ids)} (training and evaluation samplers)")
  state, method_state, step = started.state, started.method_state, progress.step
  agreed = stopped_by = None
  with Verifier(cfg.rl.verifier) as pool:
    grader = distributed.SharedGrader(pool)  # identical rewards on every process
    ctx = StepContext(
      cfg, setup.prompts, started.iterator, setup.sampler, step_fn, grader, setup.tokenizer,
      setup.mesh, started.np_rng, logprob_fn,
    )  # fmt: skip
    for step in range(progress.step + 1, cfg.rl.steps + 1):
      state, method_state, m = rl_step(
        ctx, step, state, method_state, jax.random.fold_in(keys.rollout, step)
      )
      runstate.check_step(step, m.train, state.params)  # before anything of it is saved
      row = m.as_dict()
      if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < cfg.rl.steps:
        row |= _heldout_eval(setup.evaluator, setup.workdir, state.params, step, keys.eval)
      writer.write(step, row)
      progress.step = step
      progress.iterator = _jsonable(started.iterator.state())
      progress.np_rng = runstate.generator_state(started.np_rng)
      agreed = distributed.assert_same(
        f"controller state after RL step {step}",
        [progress.iterator, progress.np_rng, serialization.to_state_dict(method_state), m.agreed()],
      )
      stopping = runstate.stop_requested(stop)
      every = cfg.ckpt.every_steps
      if stopping or step == cfg.rl.steps or (every and step % every == 0):
        run_state = checkpoint.RunState(
          train=state, rng=started.root, method_state=method_state, host=progress.to_host()
        )
        checkpoint.save(started.manager, step, run_state)
      if stopping:
        # Another process's signal stops this one too (`stop_requested` combines them).
        stopped_by = stop.signal_name or "a signal to another process"
        writer.log_text(f"{stopped_by}: saved checkpoint {step}, exiting")
        break
  return _End(step, state, stopped_by, agreed)


def _close_out(setup, started, end: _End, writer, stop) -> dict[str, Any]:
  """The summary (workdir/summary.json): steps done, the scores before RL and, when the
  run reached `rl.steps`, the held-out evaluation after RL (and the Hugging Face export)."""
  cfg, progress = setup.cfg, started.progress
  checkpoint.close(started.manager)
  summary = {
    "steps_done": end.step,
    "source": started.source,
    "warmstart": progress.warmstart,
    "before_rl": progress.before_rl or {},
    "stop_ids": list(setup.tokenizer.eos_ids),
    "eval_settings": _eval_settings(setup.record),
  }
  changed = _eval_changes(progress, setup.record)
  if changed:
    summary["before_rl_comparable"] = False
    summary["before_rl_eval_changes"] = changed
  if end.stopped_by is not None:
    summary["stopped_by"] = end.stopped_by
  if jax.process_count() > 1:  # equal on every process (tests/test_distributed.py)
    summary["fingerprints"] = {
      "controller": end.agreed,
      "params": distributed.local_fingerprint(end.state.params),
    }
  if end.step == cfg.rl.steps and end.stopped_by is None:  # stopped: the rerun evaluates
    stop.enter("the held-out evaluation after RL")
    eval_key = started.keys.eval
    summary["after_rl"] = _heldout_eval(
      setup.evaluator, setup.workdir, end.state.params, end.step, eval_key
    )
    writer.add_scalars(end.step, summary["after_rl"])
    stop.enter(None)
  if jax.process_index() == 0:
    (pathlib.Path(setup.workdir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  # After the summary: an export that fails (a full disk) loses no result, and the same
  # command exports again ("already finished" with ckpt.export_hf and no hf_final).
  if "after_rl" in summary and cfg.ckpt.export_hf:
    stop.enter("the export of the final policy")
    _export_final(setup, end.state.params)
    stop.enter(None)
  return summary


def _hf_final(workdir: str) -> pathlib.Path:
  return pathlib.Path(workdir) / "hf_final"


def _export_final(setup: _SetUp, params) -> None:
  """The final policy, as a Hugging Face folder with the run's tokenizer (`ckpt.export_hf`)."""
  saved_params.export_hf(
    setup.model_cfg, params, _hf_final(setup.workdir), tokenizer=setup.tokenizer
  )


def _eval_settings(record: dict[str, Any]) -> dict[str, Any]:
  """The settings of a held-out evaluation in the run's config record: the `eval` group but
  for how often it runs and where its files are (neither changes what it measures)."""
  ignored = ("eval.every_steps", *runstate.LOCATIONS)
  return {k: v for k, v in record.items() if k.startswith("eval.") and k not in ignored}


def _eval_changes(progress: runstate.Progress, record: dict[str, Any]) -> list[str]:
  """'eval.k: 4 -> 2', ... for each setting of the evaluation before RL (saved in
  `progress`; a checkpoint of an older version has none: nothing to compare) that differs
  now."""
  before, now = progress.before_rl_eval, _eval_settings(record)
  if not before:
    return []
  keys = sorted(set(before) | set(now))
  return [f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in keys if before.get(k) != now.get(k)]


def _say_if_not_comparable(progress: runstate.Progress, record: dict[str, Any]) -> None:
  changed = _eval_changes(progress, record)
  if changed:
    metrics_lib.console(
      f"the eval group changed since the evaluation before RL ({'; '.join(changed)}): the "
      "scores after RL are not comparable with those before (summary.json says "
      "before_rl_comparable: false); a new run measures both with these settings"
    )


def _finished_summary(workdir: str, step: int, record: dict[str, Any]) -> dict[str, Any] | None:
  """The summary of a run that finished at RL step `step` with the current evaluation
  settings (its `after_rl` in workdir/summary.json), else None (never finished, stopped
  during the evaluation after RL, or evaluated with other settings: evaluate again)."""
  try:
    summary = json.loads((pathlib.Path(workdir) / "summary.json").read_text())
  except (OSError, ValueError):
    return None
  same = summary.get("eval_settings") == _eval_settings(record)
  if summary.get("steps_done") == step and "after_rl" in summary and same:
    return summary
  return None


def _close(manager) -> None:
  """The manager's last wait and close, on every way out (a stop, an error): a save in
  flight completes. Once closed, closing again is a no-op."""
  try:
    checkpoint.close(manager)
  except Exception as e:  # noqa: BLE001 - an error on the way out must not hide the first
    logging.warning("closing the checkpoint manager: %s", e)


def _jsonable(state: dict) -> dict:
  return {k: np.asarray(v).tolist() for k, v in state.items()}
