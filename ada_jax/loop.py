"""The one stateful loop: prompts -> adaptive rollouts -> policy update -> log -> checkpoint.

Per RL step (DESIGN.md §1): the prompt iterator yields B prompts; `adaptive.run_step` asks
for responses round by round through `draw`, which lays the requested rows out for the
chunked sampler and scores them with the verifier pool; the selected responses and their
advantages become a fixed-shape training batch (`make_train_batch`); `train.update_policy`
runs k mini-batch updates; metrics go to JSONL/TensorBoard/console; the whole run state is
checkpointed every `ckpt.every_steps` steps, at the end, and on SIGTERM or Ctrl-C (the
summary then names the signal, `stopped_by`, and has no `after_rl`).

Determinism: the rollout key of step s is `fold_in(rollout_key, s)`; the root key it comes
from, the host Generator, the prompt position and the Est statistics are checkpointed and
read back, so a run restarted from its last checkpoint repeats exactly the steps an
uninterrupted run would take.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from ada_jax import (
  adaptive,
  arith,
  benchmarks,
  checkpoint,
  data,
  distributed,
  evaluate,
  prompts,
  sampler,
  train,
  weights,
)
from ada_jax import config as config_lib
from ada_jax import metrics as metrics_lib
from ada_jax import model as model_lib
from ada_jax import sharding as sharding_lib
from ada_jax import warmstart as warmstart_lib
from ada_jax.config import ConfigError
from ada_jax.tokenizer import Tokenizer
from ada_jax.verifier import RewardPool, VerifierConfig

_COMPILES = [0]
# Controller outputs that must be identical on every process (`distributed.assert_same`).
_AGREED = ("reward_mean", "pass_rate", "first_round_pass_rate", "samples_drawn",
           "active_prompts_per_round", "zero_signal_frac", "response_len_mean", "rows_computed")


def _count_compiles(event: str, duration: float, **kwargs) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def load_tokenizer(spec: config_lib.TokenizerSpec, model_dir: pathlib.Path | None
                   ) -> Tokenizer:
  """The run's tokenizer: `tokenizer.dir`, else the model's folder, else the arithmetic
  task's built-in one."""
  folder = spec.dir or model_dir
  if not folder:
    return arith.load_tokenizer()
  try:
    return Tokenizer.from_dir(folder, eos_ids=spec.eos_ids or None)
  except (OSError, ValueError) as e:
    field = "config.tokenizer.dir" if spec.dir else "config.model.hf_dir (its tokenizer)"
    raise ConfigError(f"{field}: {e}") from None


def load_prompts(cfg: config_lib.RunConfig, tokenizer: Tokenizer) -> prompts.PromptSet:
  """The training prompts of `cfg.data`, tokenized (too-long ones dropped and counted)."""
  d = cfg.data
  if d.source == "arith":
    examples = arith.examples(d.arith, "train", d.arith_prompts, seed=cfg.seed)
    style = "raw"
  else:
    if d.source == "jsonl":
      try:
        spec = data.user_jsonl_spec("user", d.jsonl_paths, problem_field=d.problem_field,
                                    answer_field=d.answer_field,
                                    answer_format=d.answer_format,
                                    exclude_math500=d.exclude_math500)
      except (OSError, ValueError) as e:
        raise ConfigError(f"config.data: {e}") from None
    elif d.source in data.SETS:
      spec = d.source
    else:
      raise ConfigError(f"config.data.source {d.source!r}: use 'arith', 'jsonl' or one of "
                       f"{sorted(data.SETS)}")
    data_dir = d.data_dir or os.environ.get("TFDS_DATA_DIR") or str(
        pathlib.Path.home() / "tensorflow_datasets")
    try:
      examples = data.load_examples(spec, d.split, data_dir=data_dir,
                                    manual_dir=d.manual_dir or None)
    except (OSError, ValueError) as e:  # a bad file (named, with its line) or no network
      raise ConfigError(f"config.data: {' '.join(str(e).split())}"
                        f"{_offline_hint(e, 'config.data.manual_dir')}") from None
    style = d.prompt_style
  ps = prompts.build_prompts(examples, tokenizer, style=style,
                             max_prompt_tokens=d.max_prompt_tokens)
  if ps.num_dropped:
    logging.warning("%d training prompts over %d tokens dropped", ps.num_dropped,
                    d.max_prompt_tokens)
  if len(ps) < cfg.rl.batch_prompts:
    raise ConfigError(f"config.rl.batch_prompts ({cfg.rl.batch_prompts}) exceeds the "
                     f"{len(ps)} usable training prompts")
  return ps


def _offline_hint(error: Exception, field: str) -> str:
  if not isinstance(error, ConnectionError):
    return ""
  return (f"; set {field} to a folder with these JSONL files (a folder shared/data beside "
          "the checkout is the configs' default when present)")


def check_eval_data(cfg: config_lib.RunConfig) -> None:
  """Fails before any compile when a maths benchmark of `cfg.eval` can neither be read
  from `eval.manual_dir` nor downloaded (`data.check_available`).

  Raises:
    ConfigError: naming `config.eval.manual_dir` (offline) or `config.eval.benchmarks`.
  """
  e = cfg.eval
  data_dir = e.data_dir or os.environ.get("TFDS_DATA_DIR") or str(
      pathlib.Path.home() / "tensorflow_datasets")
  for name in e.benchmarks:
    if name not in data.SETS:
      continue  # 'arith' is generated, unknown names fail in `benchmarks.load_examples`
    try:
      data.check_available(name, data_dir=data_dir, manual_dir=e.manual_dir or None)
    except OSError as err:
      raise ConfigError(f"config.eval.benchmarks ({name}): {err}"
                        f"{_offline_hint(err, 'config.eval.manual_dir')}") from None


def make_train_batch(result: adaptive.StepResult, responses: dict[str, np.ndarray],
                     prompt_tokens: Sequence[np.ndarray], *, rows: int,
                     buckets: Sequence[int]) -> train.TrainBatch:
  """Lays the selected responses out as a fixed-shape training batch.

  Row i: its prompt left-padded to the bucket Lp, then its response (Lr tokens, mask after
  the stop token); rows beyond the selection are padding with an empty loss mask (they add
  nothing to a token mean). Old log-probs sit at the response tokens' columns, as
  `losses.token_logprobs` aligns them.

  Args:
    result: the adaptive step's selection (handles index `responses`).
    responses: `tokens int32[N, Lr]`, `logprobs float32[N, Lr]`, `mask bool[N, Lr]` of all
      responses drawn this step.
    prompt_tokens: token ids of the step's prompts (indexed by `result.prompt_index`).
    rows: the batch's fixed row count (>= number selected).
    buckets: allowed prompt lengths.

  Returns:
    A `train.TrainBatch` of numpy arrays, `[rows, Lp + Lr]`.
  """
  sel = np.asarray(result.handles, np.int64)
  if len(sel) > rows:
    raise ValueError(f"{len(sel)} responses selected for a {rows}-row batch")
  lr = responses["tokens"].shape[1]
  # No selection (dapo without a mixed group) gives an all-padding batch.
  longest = max((len(prompt_tokens[p]) for p in result.prompt_index), default=1)
  lp = sampler.bucket_length(longest, buckets)
  total = lp + lr
  tokens = np.zeros((rows, total), np.int32)
  attention = np.zeros((rows, total), bool)
  loss_mask = np.zeros((rows, total), bool)
  old = np.zeros((rows, total), np.float32)
  adv = np.zeros((rows,), np.float32)
  for i, (h, p) in enumerate(zip(sel, result.prompt_index, strict=True)):
    ids = prompt_tokens[p]
    tokens[i, lp - len(ids):lp] = ids
    attention[i, lp - len(ids):lp] = True
    tokens[i, lp:] = responses["tokens"][h]
    attention[i, lp:] = loss_mask[i, lp:] = responses["mask"][h]
    old[i, lp:] = responses["logprobs"][h]
    adv[i] = result.advantages[i]
  positions = np.maximum(np.cumsum(attention, axis=1) - 1, 0).astype(np.int32)
  return train.TrainBatch(tokens=tokens, positions=positions, attention_mask=attention,
                          loss_mask=loss_mask, advantages=adv, old_logprobs=old)


@dataclasses.dataclass
class _Rollouts:
  """The step's `draw` callable: sampler + verifier, keeping every response it drew."""

  sampler: sampler.Sampler
  params: Any
  tokenizer: Tokenizer
  score: Any
  prompt_tokens: list
  answers: list
  key: jax.Array
  calls: int = 0
  parts: list = dataclasses.field(default_factory=list)
  time_sample_s: float = 0.0
  time_verify_s: float = 0.0
  rows_computed: int = 0
  rows_useful: int = 0
  tokens: int = 0

  def __call__(self, rows: np.ndarray):
    out, stats = self.sampler.generate(self.params, self.prompt_tokens, rows,
                                       jax.random.fold_in(self.key, self.calls))
    self.calls += 1
    start = time.perf_counter()
    texts = self.tokenizer.decode_many([t[:n] for t, n in zip(out["tokens"], out["lengths"],
                                                               strict=True)])
    rewards = self.score(texts, [self.answers[r] for r in rows])
    self.time_verify_s += time.perf_counter() - start
    self.time_sample_s += stats.wall_s
    self.rows_computed += stats.rows_computed
    self.rows_useful += stats.rows_useful
    self.tokens += stats.tokens
    first = sum(len(p["tokens"]) for p in self.parts)
    self.parts.append(out)
    return np.asarray(rewards, np.float32), list(range(first, first + len(rows)))

  def responses(self) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in self.parts]) for k in ("tokens", "logprobs",
                                                                    "mask", "lengths")}


def _heldout_eval(cfg, workdir, tokenizer, params, model_cfg, step) -> dict[str, float]:
  """`cfg.eval` benchmarks of the current policy (report in workdir/eval/step_<step>.*),
  with a progress bar and a closing line on the console."""
  if not cfg.eval.benchmarks:
    return {}
  primary = jax.process_index() == 0
  metrics_lib.console(f"held-out evaluation at RL step {step}: "
                      f"{', '.join(cfg.eval.benchmarks)} (Avg@{cfg.eval.k})")
  results = evaluate.run(cfg.eval, workdir, params=params, model_config=model_cfg,
                         tokenizer=tokenizer, model_tag=evaluate.run_model_tag(workdir, step),
                         name=f"step_{step}", progress=primary)["results"]
  flat = benchmarks.flat_metrics(results)
  metrics_lib.console(f"held-out at RL step {step}: " + ", ".join(
      f"{k.removeprefix('eval/')} {v:.4f}" for k, v in flat.items() if "avg@" in k))
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
  """`run` on a parsed config."""
  workdir = str(pathlib.Path(workdir).absolute())
  model_dir = hf_config = None
  if cfg.model.hf_dir:
    try:  # a Hub id is downloaded here, once, when online
      model_dir = weights.resolve(cfg.model.hf_dir)
      hf_config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
      raise ConfigError(f"config.model.hf_dir: {e}") from None
  tokenizer = load_tokenizer(cfg.tokenizer, model_dir)
  model_cfg = config_lib.model_config(cfg.model, hf_config)
  if model_cfg.vocab_size < tokenizer.vocab_size:
    raise ConfigError(f"config.model: vocab_size {model_cfg.vocab_size} is smaller than the "
                     f"tokenizer's {tokenizer.vocab_size}")
  cfg.check_model(model_cfg)
  try:
    mesh = sharding_lib.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  except ValueError as e:
    raise ConfigError(f"config.mesh: {e}") from None
  train_cfg = cfg.train_config
  try:
    train.check_batch_layout(cfg.train_rows, train_cfg, mesh)
  except ValueError as e:
    raise ConfigError(f"config.rl.batch_prompts ({cfg.rl.batch_prompts}) with config.train "
                      f"and config.mesh: {e}") from None
  ps = load_prompts(cfg, tokenizer)
  check_eval_data(cfg)
  ppc = cfg.prompts_per_chunk
  if not cfg.sampler.prompts_per_chunk:  # derived: round up to the rows' mesh axes
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    ppc = min(-(-ppc // dp) * dp, cfg.sampler.chunk_rows)
  try:
    smp = sampler.Sampler(
        model_cfg, rule=cfg.sampler.rule,
        max_new_tokens=cfg.sampler.max_new_tokens, stop_ids=tokenizer.eos_ids,
        chunk_rows=cfg.sampler.chunk_rows, prompts_per_chunk=ppc,
        prompt_buckets=cfg.sampler.prompt_buckets, pad_id=tokenizer.pad_id, mesh=mesh)
  except ValueError as e:
    raise ConfigError(f"config.sampler: {e}") from None
  if cfg.ckpt.init_from:
    try:
      checkpoint.params_step_dir(cfg.ckpt.init_from)
    except FileNotFoundError as e:
      raise ConfigError(f"config.ckpt.init_from: {e}") from None
  pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
  with_ref = cfg.loss.kl_coeff > 0
  target = train.abstract_state(model_cfg, train_cfg, mesh, with_ref=with_ref)
  root = jax.random.key(cfg.seed)
  init_key = jax.random.split(root, 3)[0]  # [1]: rollouts, from the run state's root
  iterator = prompts.PromptIterator(len(ps), cfg.rl.batch_prompts, seed=cfg.seed)

  def start(params):
    host: dict[str, Any] = {}
    if params is None:
      params = model_lib.init_params(model_cfg, init_key)
      if cfg.warmstart is not None:
        params, ws = warmstart_lib.warm_start(model_cfg, params, tokenizer, cfg.warmstart,
                                              progress=jax.process_index() == 0)
        metrics_lib.console(warmstart_lib.describe(ws, cfg.warmstart))
        host["warmstart"] = {"wall_s": float(ws["wall_s"]),
                             "final_loss": float(np.mean(ws["loss"][-20:])),
                             "steps_run": int(ws["steps_run"]),
                             "reached_target": bool(ws["reached_target"])}
    host["before_rl"] = _heldout_eval(cfg, workdir, tokenizer, params, model_cfg, 0)
    state = train.init_train_state(model_cfg, train_cfg, params, mesh,
                                   ref_params=params if with_ref else None)
    host.update(step=0, iterator=_jsonable(iterator.state()),
                np_rng=checkpoint.generator_state(np.random.default_rng(cfg.seed)))
    return checkpoint.RunState(train=state, rng=root, est=None, host=host)

  manager = checkpoint.make_manager(pathlib.Path(workdir) / "checkpoints", cfg.ckpt.manager)
  run_state, source = checkpoint.resume(manager, target, start=start,
                                        init_from=cfg.ckpt.init_from or None,
                                        pretrained=str(model_dir) if model_dir else None)
  logging.info("run state from %s", source)
  if source.startswith("checkpoint"):
    resumed = int(run_state.host["step"])
    metrics_lib.console(f"resuming from step {resumed} (checkpoint {workdir}/checkpoints/"
                        f"{resumed})")
  else:
    # Step 0 (the warm-started policy, its held-out score) is saved at once, so a restart
    # never repeats the warm start and other runs can `init_from` this folder's step 0.
    checkpoint.save(manager, 0, run_state)
  host = run_state.host
  state, est = run_state.train, run_state.est
  # The checkpoint's root key, not the config's seed: a resumed run draws the keys the saved
  # run would have drawn (tests/test_guards.py).
  root = run_state.rng
  rollout_key = jax.random.split(root, 3)[1]
  iterator.restore(host["iterator"])
  np_rng = checkpoint.generator_from_state(host["np_rng"])
  first = int(host["step"])
  step_fn = train.make_train_step(model_cfg, train_cfg, mesh, with_ref=with_ref)
  writer = metrics_lib.MetricsWriter(workdir, total_steps=cfg.rl.steps, start_step=first,
                                     primary=jax.process_index() == 0)
  if first == 0:
    writer.add_scalars(0, host.get("before_rl", {}))
  verifier_cfg = VerifierConfig(judge=cfg.rl.judge, num_workers=cfg.rl.verifier_workers,
                                timeout_s=cfg.rl.verifier_timeout_s)
  step = first
  agreed = stopped_by = None
  with checkpoint.stop_signals() as stop, RewardPool(verifier_cfg) as pool:
    score = distributed.shared_scorer(pool.score)  # identical rewards on every process
    for step in range(first + 1, cfg.rl.steps + 1):
      state, est, m = rl_step(cfg, step, state, est, iterator, np_rng, ps, smp, step_fn,
                              score, tokenizer, mesh, jax.random.fold_in(rollout_key, step))
      if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < cfg.rl.steps:
        m.update(_heldout_eval(
            cfg, workdir, tokenizer, state.params, model_cfg, step))
      writer.write(step, m)
      host.update(step=step, iterator=_jsonable(iterator.state()),
                  np_rng=checkpoint.generator_state(np_rng))
      agreed = distributed.assert_same(f"controller state after RL step {step}", [
          host["iterator"], host["np_rng"], est, [m.get(k) for k in _AGREED]])
      stopping = checkpoint.stop_requested(stop)
      if stopping or step == cfg.rl.steps or (cfg.ckpt.every_steps and
                                              step % cfg.ckpt.every_steps == 0):
        checkpoint.save(manager, step, checkpoint.RunState(train=state, rng=root, est=est,
                                                           host=host))
      if stopping:
        # Another process's signal stops this one too (`stop_requested` combines them).
        stopped_by = stop.signal_name or "a signal to another process"
        writer.log_text(f"{stopped_by}: saved checkpoint {step}, exiting")
        break
  checkpoint.close(manager)
  summary = {"steps_done": step, "source": source, "warmstart": host.get("warmstart"),
             "before_rl": host.get("before_rl", {})}
  if stopped_by is not None:
    summary["stopped_by"] = stopped_by
  if jax.process_count() > 1:  # equal on every process (tests/test_distributed.py)
    summary["fingerprints"] = {"controller": agreed,
                               "params": distributed.local_fingerprint(state.params)}
  if step == cfg.rl.steps and stopped_by is None:  # stopped: the rerun evaluates
    summary["after_rl"] = _heldout_eval(cfg, workdir, tokenizer, state.params, model_cfg, step)
    writer.add_scalars(step, summary["after_rl"])
    if cfg.ckpt.export_hf:
      params = distributed.host_copy(state.params)  # collective: every process takes part
      if jax.process_index() == 0:
        checkpoint.export_hf(model_cfg, params, pathlib.Path(workdir) / "hf_final",
                             tokenizer=tokenizer)
  writer.close()
  if jax.process_index() == 0:
    (pathlib.Path(workdir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary


def rl_step(cfg, step, state, est, iterator, np_rng, ps, smp, step_fn, score, tokenizer,
            mesh, key):
  """One RL step (see module docstring). Returns (state, est, metrics)."""
  compiles = _COMPILES[0]
  idx = [int(i) for i in next(iterator)]
  extra: list[int] = []

  def more_prompts(k):
    for _ in range(-(-k // cfg.rl.batch_prompts)):
      extra.extend(int(i) for i in next(iterator))
    got, extra[:] = extra[:k], extra[k:]
    step_prompts.extend(got)
    rollouts.prompt_tokens.extend(ps.tokens[i] for i in got)
    rollouts.answers.extend(ps.answers[i] for i in got)
    return [ps.prompt_ids[i] for i in got]

  step_prompts = list(idx)
  rollouts = _Rollouts(smp, state.params, tokenizer, score,
                       [ps.tokens[i] for i in idx], [ps.answers[i] for i in idx], key)
  result, est = adaptive.run_step(cfg.ada, [ps.prompt_ids[i] for i in idx], rollouts, np_rng,
                                  est, more_prompts if cfg.ada.method == "dapo" else None)
  responses = rollouts.responses()
  start = time.perf_counter()
  skipped = len(result.handles) == 0
  if skipped:
    # dapo when no group is mixed even after its extra passes: there is nothing to train on,
    # and an update on an empty batch would still move the params (Adam's momentum).
    logging.warning("RL step %d: no response selected for training (%s found no group with "
                    "mixed rewards); the policy update is skipped", step, cfg.ada.method)
    tm = {}
  else:
    batch = make_train_batch(result, responses, rollouts.prompt_tokens, rows=cfg.train_rows,
                             buckets=cfg.sampler.prompt_buckets)
    batch = distributed.local_rows(batch, mesh, cfg.train.num_minibatches)  # this host's rows
    state, tm = train.update_policy(step_fn, state, batch, config=cfg.train_config, mesh=mesh)
  time_train = time.perf_counter() - start
  s = result.stats
  m = {
      "reward_mean": s.reward_mean,
      # Over every response drawn: biased upward for pos/balance, which stop after
      # successes. The first-round rate is the unbiased one, whichever the method.
      "pass_rate": float(np.mean(s.pool_pass_rate[:len(idx)])),
      "first_round_pass_rate": s.first_round_pass_rate,
      "samples_drawn": s.rows_requested,
      "active_prompts_per_round": list(s.active_per_round),
      "zero_signal_frac": s.zero_signal_fraction,
      "response_len_mean": float(np.mean(responses["lengths"])),
      "tokens_per_s": rollouts.tokens / max(rollouts.time_sample_s, 1e-9),
      "time_sample_s": rollouts.time_sample_s,
      "time_verify_s": rollouts.time_verify_s,
      "time_train_s": time_train,
      "rows_computed": rollouts.rows_computed,
      "rows_useful": rollouts.rows_useful,
      "compiles": _COMPILES[0] - compiles,  # XLA compilations during the step
      "update_skipped": float(skipped),  # 1: no response to train on, params unchanged
  }
  m.update(s.as_metrics())
  m.update({k: tm[k] for k in ("loss", "entropy", "clip_frac", "grad_norm", "approx_kl",
                               "learning_rate") if k in tm})
  return state, est, m


def _jsonable(state: dict) -> dict:
  return {k: np.asarray(v).tolist() for k, v in state.items()}
