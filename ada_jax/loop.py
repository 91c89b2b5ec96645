"""The run: set-up, the loop over RL steps, evaluations, checkpoints.

Per RL step `step.rl_step` runs prompts -> the one controller's rollouts -> training batch
-> policy update (docs/design.md, "One RL step"); here the step's metrics go to
JSONL/TensorBoard/console and the whole run state is checkpointed every
`ckpt.every_steps` steps, at the end, and on SIGTERM or Ctrl-C (the summary then names
the signal, `stopped_by`, and has no `after_rl`). Outside the RL loop (set-up, warm start,
held-out evaluations) SIGTERM and Ctrl-C stop at once (`runstate.Stopped`); a non-finite
step stops the run before it is saved (`runstate.check_step`); the workdir is held by one
run (`runstate.hold_workdir`).

Determinism: the rollout key of step s is `fold_in(rollout_key, s)`; the root key it comes
from, the host Generator, the prompt position and the Est statistics are checkpointed and
read back, so a run restarted from its last checkpoint repeats exactly the steps an
uninterrupted run would take.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from typing import Any

import jax
import numpy as np
from absl import logging

from ada_jax import checkpoint, distributed, inputs, runstate
from ada_jax import config as config_lib
from ada_jax import metrics as metrics_lib
from ada_jax.config import ConfigError
from ada_jax.data import prompts
from ada_jax.eval import benchmarks
from ada_jax.eval import evaluation as evaluate
from ada_jax.eval import sampling as eval_sampling
from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding as sharding_lib
from ada_jax.rewards.verifier import RewardPool, VerifierConfig
from ada_jax.rl import train, update
from ada_jax.rl import warmstart as warmstart_lib
from ada_jax.rollout import sampler
from ada_jax.step import StepContext, rl_step

# Controller outputs that must be identical on every process (`distributed.assert_same`).
_AGREED = (
  "reward_mean",
  "pass_rate",
  "first_round_pass_rate",
  "samples_drawn",
  "active_prompts_per_round",
  "zero_signal_frac",
  "response_len_mean",
  "rows_computed",
  "decode_steps",
  "tokens_cancelled",
)


def _heldout_eval(cfg, workdir, tokenizer, params, model_cfg, step, samplers) -> dict[str, float]:
  """`cfg.eval` benchmarks of the current policy (report in workdir/eval/step_<step>.*),
  with a progress bar and a closing line on the console; `samplers` are the run's
  `eval.sampling.EvalSamplers`, built once so that only the first evaluation compiles."""
  if not cfg.eval.benchmarks:
    return {}
  primary = jax.process_index() == 0
  metrics_lib.console(
    f"held-out evaluation at RL step {step}: {', '.join(cfg.eval.benchmarks)} (Avg@{cfg.eval.k})"
  )
  results = evaluate.run(
    cfg.eval,
    workdir,
    params=params,
    model_config=model_cfg,
    tokenizer=tokenizer,
    samplers=samplers,
    model_tag=evaluate.weights_tag(params, model_cfg),
    name=f"step_{step}",
    progress=primary,
  )["results"]
  flat = benchmarks.flat_metrics(results)
  metrics_lib.console(
    f"held-out at RL step {step}: "
    + ", ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in flat.items() if "avg@" in k)
  )
  return flat


def run(config, workdir: str) -> dict[str, Any]:
  """Runs (or resumes) the experiment `config` (ConfigDict) in `workdir`.

  Returns:
    The run summary (also written to `workdir/summary.json`).

  Raises:
    ConfigError: a bad config (named field), before any compile or any file is written.
  """
  cfg = config_lib.parse(config)
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
  workdir = str(pathlib.Path(workdir).absolute())
  with runstate.stop_signals("the set-up") as stop, contextlib.ExitStack() as stack:
    return _train(cfg, workdir, stop, stack)


def _train(cfg, workdir: str, stop: runstate.StopRequest, stack: contextlib.ExitStack):
  for warning in cfg.warnings():
    logging.warning("%s", warning)
  model_dir, model_cfg, tokenizer = inputs.load_model_files(cfg.model, cfg.tokenizer)
  cfg.check_model(model_cfg)
  try:
    mesh = sharding_lib.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  except ValueError as e:
    raise ConfigError(f"config.mesh: {e}") from None
  train_cfg = cfg.train
  try:
    train.check_batch_layout(cfg.train_rows, train_cfg, mesh)
  except ValueError as e:
    raise ConfigError(
      f"config.rl.batch_prompts ({cfg.rl.batch_prompts}) with config.train and config.mesh: {e}"
    ) from None
  ps = inputs.load_prompts(cfg, tokenizer)
  inputs.check_eval_data(cfg)
  eval_samplers = None
  if cfg.eval.benchmarks:  # built once: periodic evaluations reuse their compiles
    try:  # on the run's mesh: replicated, its KV cache would not fit beside the train state
      eval_samplers = eval_sampling.EvalSamplers.make(model_cfg, tokenizer, cfg.eval, mesh)
    except ValueError as e:
      raise ConfigError(f"config.eval: {e}") from None
  ppc = cfg.prompts_per_chunk
  if not cfg.sampler.prompts_per_chunk:  # derived: round up to the rows' mesh axes
    ppc = sampler.fit_prompts_per_chunk(ppc, cfg.sampler.chunk_rows, mesh)
  try:
    smp = sampler.Sampler.from_spec(
      model_cfg,
      cfg.sampler,
      stop_ids=tokenizer.eos_ids,
      prompts_per_chunk=ppc,
      pad_id=tokenizer.pad_id,
      mesh=mesh,
    )
  except ValueError as e:
    raise ConfigError(f"config.sampler: {e}") from None
  if cfg.ckpt.init_from:
    try:
      checkpoint.params_step_dir(cfg.ckpt.init_from)
    except FileNotFoundError as e:
      raise ConfigError(f"config.ckpt.init_from: {e}") from None
  stack.enter_context(runstate.hold_workdir(workdir))  # one run per workdir
  with_ref = cfg.loss.kl_coeff > 0
  target = train.abstract_state(model_cfg, train_cfg, mesh, with_ref=with_ref)
  root = jax.random.key(cfg.seed)
  init_key = jax.random.split(root, 3)[0]  # [1]: rollouts, from the run state's root
  iterator = prompts.PromptIterator(len(ps), cfg.rl.batch_prompts, seed=cfg.seed)
  record = runstate.config_record(cfg, model_cfg)

  def start(params):
    host: dict[str, Any] = {}
    if params is None:
      params = model_lib.init_params(model_cfg, init_key)
      if cfg.warmstart is not None:
        stop.enter("the warm start")
        params, ws = warmstart_lib.warm_start(
          model_cfg, params, tokenizer, cfg.warmstart, progress=jax.process_index() == 0
        )
        stop.enter("the set-up")
        metrics_lib.console(warmstart_lib.describe(ws, cfg.warmstart))
        host["warmstart"] = {
          "wall_s": float(ws["wall_s"]),
          "final_loss": float(np.mean(ws["loss"][-20:])),
          "steps_run": int(ws["steps_run"]),
          "reached_target": bool(ws["reached_target"]),
        }
    state = train.init_train_state(
      model_cfg, train_cfg, params, mesh, ref_params=params if with_ref else None
    )
    host.update(
      step=0,
      iterator=_jsonable(iterator.state()),
      np_rng=runstate.generator_state(np.random.default_rng(cfg.seed)),
    )
    return checkpoint.RunState(train=state, rng=root, est=None, host=host)

  # Resume order (`checkpoint.resume`): 1. the latest checkpoint in this workdir that
  # restores (the whole run state: params, optimizer, root key, Est statistics, prompt
  # position, host Generator), if it was made with a compatible config
  # (`runstate.check_resume`); 2. `ckpt.init_from` (another run's params, fresh
  # optimizer); 3. the pretrained weights of `model.hf_dir`; 4. `start(None)`: random
  # init, then the warm start. 2-4 go through `start`.
  manager = checkpoint.make_manager(pathlib.Path(workdir) / "checkpoints", cfg.ckpt)
  stack.callback(_close, manager)
  run_state, source = checkpoint.resume(
    manager,
    target,
    start=start,
    init_from=cfg.ckpt.init_from or None,
    pretrained=str(model_dir) if model_dir else None,
    check_host=lambda host, step: runstate.check_resume(host.get("config"), record, step),
  )
  logging.info("run state from %s", source)
  host = run_state.host
  host["config"] = record  # with any change a resume may make
  stop.enter(None)  # signals are polled from here: a save is never cut
  if source.startswith("checkpoint"):
    resumed = int(host["step"])
    metrics_lib.console(
      f"resuming from step {resumed} (checkpoint {workdir}/checkpoints/{resumed})"
    )
  else:
    # Step 0 (the warm-started policy) is saved at once, so a restart never repeats the
    # warm start and other runs can `init_from` this folder's step 0.
    checkpoint.save(manager, 0, run_state)
  state, est = run_state.train, run_state.est
  first = int(host["step"])
  writer = metrics_lib.MetricsWriter(
    workdir, total_steps=cfg.rl.steps, start_step=first, primary=jax.process_index() == 0
  )
  stack.callback(writer.close)
  if first == 0 and "before_rl" not in host:  # also after a stop during it: cached batches
    stop.enter("the held-out evaluation before RL")
    host["before_rl"] = _heldout_eval(
      cfg, workdir, tokenizer, state.params, model_cfg, 0, eval_samplers
    )
    stop.enter(None)
  if first == 0:
    writer.add_scalars(0, host["before_rl"])
  # The checkpoint's root key, not the config's seed: a resumed run draws the keys the saved
  # run would have drawn (tests/test_guards.py).
  root = run_state.rng
  rollout_key = jax.random.split(root, 3)[1]
  iterator.restore(host["iterator"])
  np_rng = runstate.generator_from_state(host["np_rng"])
  step_fn = train.make_train_step(model_cfg, train_cfg, mesh, with_ref=with_ref)
  logprob_fn = None
  if train_cfg.old_logprobs == "recompute":  # released: the trainer's old log-probs
    logprob_fn = update.make_logprob_step(model_cfg, train_cfg, mesh)
  # The stop ids end responses in training and evaluation; the folder's are the default.
  writer.log_text(f"stop ids {list(tokenizer.eos_ids)} (training and evaluation samplers)")
  verifier_cfg = VerifierConfig(
    judge=cfg.rl.judge, num_workers=cfg.rl.verifier_workers, timeout_s=cfg.rl.verifier_timeout_s
  )
  step = first
  agreed = stopped_by = None
  with RewardPool(verifier_cfg) as pool:
    grader = distributed.SharedGrader(pool)  # identical rewards on every process
    ctx = StepContext(cfg, ps, iterator, smp, step_fn, grader, tokenizer, mesh, np_rng, logprob_fn)
    for step in range(first + 1, cfg.rl.steps + 1):
      state, est, m = rl_step(ctx, step, state, est, jax.random.fold_in(rollout_key, step))
      runstate.check_step(step, m, state.params)  # before anything of it is saved
      if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < cfg.rl.steps:
        m.update(
          _heldout_eval(cfg, workdir, tokenizer, state.params, model_cfg, step, eval_samplers)
        )
      writer.write(step, m)
      host.update(
        step=step, iterator=_jsonable(iterator.state()), np_rng=runstate.generator_state(np_rng)
      )
      agreed = distributed.assert_same(
        f"controller state after RL step {step}",
        [host["iterator"], host["np_rng"], est, [m.get(k) for k in _AGREED]],
      )
      stopping = runstate.stop_requested(stop)
      if (
        stopping
        or step == cfg.rl.steps
        or (cfg.ckpt.every_steps and step % cfg.ckpt.every_steps == 0)
      ):
        checkpoint.save(
          manager, step, checkpoint.RunState(train=state, rng=root, est=est, host=host)
        )
      if stopping:
        # Another process's signal stops this one too (`stop_requested` combines them).
        stopped_by = stop.signal_name or "a signal to another process"
        writer.log_text(f"{stopped_by}: saved checkpoint {step}, exiting")
        break
  checkpoint.close(manager)
  summary = {
    "steps_done": step,
    "source": source,
    "warmstart": host.get("warmstart"),
    "before_rl": host.get("before_rl", {}),
    "stop_ids": list(tokenizer.eos_ids),
  }
  if stopped_by is not None:
    summary["stopped_by"] = stopped_by
  if jax.process_count() > 1:  # equal on every process (tests/test_distributed.py)
    summary["fingerprints"] = {
      "controller": agreed,
      "params": distributed.local_fingerprint(state.params),
    }
  if step == cfg.rl.steps and stopped_by is None:  # stopped: the rerun evaluates
    stop.enter("the held-out evaluation after RL")
    summary["after_rl"] = _heldout_eval(
      cfg, workdir, tokenizer, state.params, model_cfg, step, eval_samplers
    )
    writer.add_scalars(step, summary["after_rl"])
    if cfg.ckpt.export_hf:
      params = sharding_lib.host_copy(state.params)  # collective: every process takes part
      if jax.process_index() == 0:
        checkpoint.export_hf(
          model_cfg, params, pathlib.Path(workdir) / "hf_final", tokenizer=tokenizer
        )
    stop.enter(None)
  if jax.process_index() == 0:
    (pathlib.Path(workdir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary


def _close(manager) -> None:
  """The manager's last wait and close, on every way out (a stop, an error): a save in
  flight completes. Once closed, closing again is a no-op."""
  try:
    checkpoint.close(manager)
  except Exception as e:  # noqa: BLE001 - an error on the way out must not hide the first
    logging.warning("closing the checkpoint manager: %s", e)


def _jsonable(state: dict) -> dict:
  return {k: np.asarray(v).tolist() for k, v in state.items()}
