"""The main job end to end on a tiny arithmetic config: metrics, checkpoints, compiles,
resume after kill -9, SIGTERM, bad configs."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from ada_jax import checkpoint as checkpoint_lib
from ada_jax import config as config_lib
from ada_jax import loop, saved_params
from ada_jax import metrics as metrics_lib
from ada_jax.eval import evaluator as evaluate
from configs import tiny_arith_pos

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiny_config(steps: int = 4, schedule: str = "rounds") -> ml_collections.ConfigDict:
  """tiny_arith_pos shrunk to seconds: 2-layer d=32 model, 8 prompts, short warm start."""
  c = tiny_arith_pos.get_config()
  c.ada.schedule = schedule
  c.sampler.segment_steps = 2 if schedule == "stream" else 0
  if schedule == "stream":
    # The tiny policy solves nothing: with every response counted positive, each prompt
    # exits once n of its rows are graded, and its rows still decoding are cancelled.
    c.ada.positive_threshold = -1.0
  c.model.overrides.update(
    embed_dim=32, mlp_dim=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16
  )
  c.rl.steps = steps
  c.rl.batch_prompts = 8
  c.data.arith_prompts = 256
  c.sampler.chunk_rows = 64
  c.sampler.prompts_per_chunk = 0  # derived: full chunks for every method
  c.ada.seq.max_rounds = 2
  c.ckpt.every_steps = 2
  c.warmstart.steps = 20
  c.warmstart.batch_size = 16
  c.eval.arith_problems = 16
  c.eval.k = 2
  c.eval.sampler.chunk_rows = 32
  return c


CONFIG_FILE = """
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from test_loop import est_head_no_eval, no_eval, tiny_config

def get_config():
  return {variant}(tiny_config({steps}, {schedule!r}))
"""


def est_head_no_eval(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Est with its learned pass-rate head (state beyond the train state: head params, Adam
  moments, statistics), no held-out evaluation."""
  c.ada.method, c.ada.est.estimator = "est", "head"
  c.eval.benchmarks = ()
  return c


def no_eval(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  c.eval.benchmarks = ()
  return c


def _write_config(tmp_path, steps, schedule="rounds", variant=None):
  """A config file of `tiny_config(steps, schedule)`, passed through `variant` (a function
  of this module, by name) when given."""
  name = variant.__name__ if variant else ""
  path = tmp_path / f"cfg_{steps}_{schedule}{'_' + name if name else ''}.py"
  text = CONFIG_FILE.format(
    root=str(ROOT), tests=str(ROOT / "tests"), steps=steps, schedule=schedule, variant=name
  )
  path.write_text(textwrap.dedent(text))
  return path


def _launch(tmp_path, workdir, steps, schedule="rounds", variant=None):
  env = dict(os.environ)
  return subprocess.Popen(
    [
      sys.executable,
      "-m",
      "ada_jax.main",
      f"--config={_write_config(tmp_path, steps, schedule, variant)}",
      f"--workdir={workdir}",
    ],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _metrics(workdir):
  path = pathlib.Path(workdir) / "metrics.jsonl"
  return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _steps_saved(workdir):
  ckpt = pathlib.Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []


DETERMINISTIC = (
  "loss",
  "pass_rate",
  "reward_mean",
  "samples_drawn",
  "zero_signal_frac",
  "response_len_mean",
  "grad_norm",
  "decode_steps",
  "tokens_cancelled",
)


def _guarded_run(config, workdir, guard):
  """`loop.run` with every RL step (rollouts, grading, batch, update) under `guard()`."""
  real = loop.rl_step

  def rl_step(*args):
    with guard():
      return real(*args)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(loop, "rl_step", rl_step)
    return loop.run(config, workdir)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, no_implicit_transfers):
  workdir = tmp_path_factory.mktemp("reference")
  summary = _guarded_run(tiny_config(steps=4), str(workdir), no_implicit_transfers)
  return workdir, summary


def test_run_writes_metrics_checkpoints_summary(reference_run):
  workdir, summary = reference_run
  lines = _metrics(workdir)
  assert [m["step"] for m in lines] == [1, 2, 3, 4]
  for key in (
    "reward_mean",
    "pass_rate",
    "samples_drawn",
    "active_prompts_per_round",
    "zero_signal_frac",
    "response_len_mean",
    "loss",
    "entropy",
    "clip_frac",
    "grad_norm",
    "tokens_per_s",
    "time_sample_s",
    "time_grade_wait_s",
    "time_train_s",
    "rows_computed",
    "decode_steps",
    "token_slot_utilization",
    "tokens_cancelled",
    "tokens_decoded",
  ):
    assert key in lines[-1], key
  # pos: M = 8 per active prompt and round, at most 2 rounds.
  assert all(8 * 8 <= m["samples_drawn"] <= 2 * 8 * 8 for m in lines)
  assert _steps_saved(workdir) == [0, 2, 4]  # keep = 3
  assert summary["steps_done"] == 4
  assert "eval/arith/avg@2" in summary["before_rl"] and "eval/arith/avg@2" in summary["after_rl"]
  assert "stopped_by" not in summary
  # One name per figure: the controller's statistics the loop logs are not repeated.
  assert not {
    "ada/reward_mean",
    "ada/zero_signal_fraction",
    "ada/rows_requested",
    "ada/active_r1",
  } & set(lines[0])
  assert "reward_mean" in lines[0] and "zero_signal_frac" in lines[0]
  assert lines[0]["ada/rows_selected"] == 8 * 4  # B prompts × n kept
  assert json.loads((workdir / "summary.json").read_text())["steps_done"] == 4
  assert list((workdir / "tensorboard").iterdir())


@pytest.fixture(scope="module")
def stream_run(tmp_path_factory, no_implicit_transfers):
  workdir = tmp_path_factory.mktemp("stream")
  config = tiny_config(steps=4, schedule="stream")
  summary = _guarded_run(config, str(workdir), no_implicit_transfers)
  return workdir, summary


def _new_row_counts(lines) -> list[int]:
  """1 for a step whose packed mini-batch took a row count (its `positions`: one update a
  step) that no earlier step took, else 0: the one compile a later step may make
  (`packing.row_counts`)."""
  seen, new = set(), []
  for m in lines:
    new.append(int(m["positions"] not in seen))
    seen.add(m["positions"])
  return new


def test_steady_state_compiles_only_new_packed_row_counts(reference_run):
  workdir, _ = reference_run
  lines = _metrics(workdir)
  assert [m["compiles"] for m in lines][2:] == _new_row_counts(lines)[2:]


def test_stream_schedule_runs_and_logs_its_figures(stream_run):
  workdir, summary = stream_run
  lines = _metrics(workdir)
  assert [m["step"] for m in lines] == [1, 2, 3, 4] and summary["steps_done"] == 4
  assert [m["compiles"] for m in lines][1:] == _new_row_counts(lines)[1:]
  for m in lines:
    # pos, n = 4, M = 8, R = 2, every response positive: each prompt exits once n of its
    # rows are graded (49-69 graded a step), before the R·M = 16 a prompt draws when none
    # exits; its rows still decoding are cancelled (98-188 tokens a step).
    assert 8 * 4 <= m["samples_drawn"] < 8 * 2 * 8
    assert m["decode_steps"] > 0 and 0 < m["token_slot_utilization"] <= 1
    assert m["tokens_cancelled"] > 0 and m["time_grade_wait_s"] > 0
    assert m["ada/rows_selected"] == 8 * 4
  assert "eval/arith/avg@2" in summary["after_rl"]


def _tensorboard(workdir):
  """tag -> the steps TensorBoard holds for it, in order."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  acc = EventAccumulator(str(pathlib.Path(workdir) / "tensorboard"), size_guidance={"scalars": 0})
  acc.Reload()
  return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _est_state(workdir, step):
  """The Est statistics (with the pass-rate head's params and moments) of checkpoint `step`
  of a run of `est_head_no_eval(tiny_config(4))`."""
  from ada_jax.models import sharding
  from ada_jax.rl import train

  cfg = config_lib.parse(est_head_no_eval(tiny_config(4)))
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  target = train.abstract_state(cfg.model.model_config(), cfg.train, mesh)
  manager = checkpoint_lib.make_manager(pathlib.Path(workdir) / "checkpoints")
  try:
    return checkpoint_lib.restore(manager, target, step).method_state
  finally:
    manager.close()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["rounds", "stream"])
def test_resume_after_kill9_repeats_the_uninterrupted_run(schedule, request, tmp_path):
  """kill -9 after step 3, which no checkpoint holds (every 2 steps), then the same command:
  the run resumes from checkpoint 2 and steps 3 and 4 repeat the uninterrupted run's;
  TensorBoard holds each step once. `stream` runs pos against the shared stream run;
  `rounds` runs Est with its learned head, whose state beyond the train state (statistics,
  head params and Adam moments) comes back exactly, with no held-out benchmarks (the closing
  line says so) and main's log level (no INFO lines)."""
  if schedule == "rounds":
    variant, ref_dir = est_head_no_eval, tmp_path / "ref"
    loop.run(est_head_no_eval(tiny_config(4)), str(ref_dir))
  else:
    variant, ref_dir = None, request.getfixturevalue("stream_run")[0]
  ref = {m["step"]: m for m in _metrics(ref_dir)}
  workdir = tmp_path / "run"
  proc = _launch(tmp_path, workdir, steps=4, schedule=schedule, variant=variant)
  deadline = time.time() + 600
  while len(_metrics(workdir)) < 3 and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  killed, _ = proc.communicate()
  assert max(_steps_saved(workdir)) == 2, "killed too late: step 4 was saved"
  assert len(_metrics(workdir)) >= 3 and re.search(r"warm start: \d+ of 20 steps", killed)
  proc = _launch(tmp_path, workdir, steps=4, schedule=schedule, variant=variant)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  assert "resuming from step 2 " in out
  lines = {m["step"]: m for m in _metrics(workdir)}
  assert sorted(lines) == [1, 2, 3, 4]
  assert _tensorboard(workdir)["loss"] == [1, 2, 3, 4]
  for step in (3, 4):
    for key in DETERMINISTIC:
      np.testing.assert_allclose(lines[step][key], ref[step][key], rtol=1e-6, err_msg=key)
  if schedule == "rounds":
    assert "done: 4 RL steps (no held-out benchmarks" in out
    assert "held-out before -> after RL" not in out
    assert not [line for line in out.splitlines() if line.startswith("I1")]
    want, got = _est_state(ref_dir, 4), _est_state(workdir, 4)
    assert any(k.startswith("head_") for k in want) and sorted(want) == sorted(got)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.slow
def test_sigterm_saves_and_exits_75(tmp_path):
  """A preemption notice: checkpoint after the current step, the log names SIGTERM, and the
  exit code says "stopped, resumable" (75), not "finished" (0)."""
  workdir = tmp_path / "run"
  proc = _launch(tmp_path, workdir, steps=50, variant=no_eval)
  deadline = time.time() + 600
  while not _metrics(workdir) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 75, out[-3000:]
  last = _metrics(workdir)[-1]["step"]
  assert last < 50 and _steps_saved(workdir)[-1] == last
  assert f"SIGTERM: saved checkpoint {last}, exiting" in out
  assert json.loads((workdir / "summary.json").read_text())["stopped_by"] == "SIGTERM"


@pytest.mark.parametrize(
  "edit,match",
  [
    (lambda c: c.rl.__setitem__("batchsize", 3), "config.rl.batchsize"),
    (lambda c: c.rl.__setitem__("batch_prompts", 3), "data×fsdp|data-parallel|divisible"),
    (lambda c: c.model.overrides.__setitem__("vocab_size", 64), "vocab_size"),
    (
      lambda c: (
        c.model.__setitem__("preset", ""),
        c.model.__setitem__("hf_dir", "/nonexistent/model"),
      ),
      "hf_dir",
    ),
    (lambda c: (c.ada.__setitem__("method", "balance"), c.ada.__setitem__("n", 3)), "n"),
    (lambda c: c.ada.__setitem__("method", "reinforce"), "method"),
    (lambda c: c.ada.__setitem__("schedule", "streaming"), "config.ada.*schedule"),
    (lambda c: c.rl.verifier.__setitem__("judge", "foo"), r"config\.rl\.verifier: judge='foo'"),
    (lambda c: c.rl.verifier.__setitem__("timeout_s", 0.0), r"timeout_s=0"),
    (lambda c: c.sampler.__setitem__("prompt_buckets", ()), r"config\.sampler\.prompt_buckets"),
    (lambda c: c.sampler.__setitem__("prompt_buckets", (8,)), r"data\.max_prompt_tokens \(16\)"),
    (lambda c: c.__setitem__("seed", -1), r"config\.seed"),
    (lambda c: c.sampler.__setitem__("temperature", 0.0), r"config\.sampler\.temperature=0"),
    (lambda c: c.optim.__setitem__("learning_rate", float("nan")), r"learning_rate=nan"),
    (
      lambda c: c.rl.__setitem__("batch_prompts", 512),
      r"config\.rl\.batch_prompts \(512\) exceeds the 256 usable training prompts",
    ),
  ],
)
def test_bad_config_fails_before_any_compile(tmp_path, edit, match):
  c = tiny_config()
  c.unlock() if hasattr(c, "unlock") else None
  edit(c)
  with metrics_lib.CompileCounter() as compiles:
    with pytest.raises(config_lib.ConfigError, match=match):
      loop.run(c, str(tmp_path / "run"))
  assert compiles.count == 0
  assert not (tmp_path / "run").exists()  # nothing written for a config that cannot run


def test_evaluate_cli_reuses_the_runs_results(reference_run, tmp_path):
  """`python -m ada_jax.evaluate --checkpoint=STEP` on a run's own checkpoint: the results the
  run's held-out evaluation after RL cached for that step are reused (nothing sampled, the
  cache does not grow), the run's report stays the only one for it, and `--json` prints
  the report on stdout; logs at WARNING, as main's."""
  workdir = reference_run[0]
  eval_dir = workdir / "eval"
  cache = (eval_dir / "cache.jsonl").read_text()
  own = json.loads((eval_dir / "step_4.json").read_text())
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "ada_jax.evaluate",
      f"--config={_write_config(tmp_path, 4)}",
      f"--workdir={workdir}",
      "--checkpoint=4",
      "--json",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout)
  assert report["results"] == own["results"] and report["model"] == own["model"]
  assert report["name"] == "step_4"
  assert (eval_dir / "cache.jsonl").read_text() == cache  # every result from the cache
  assert sorted(p.name for p in eval_dir.iterdir()) == [
    "cache.jsonl",
    "step_0.json",
    "step_0.md",
    "step_4.json",
    "step_4.md",
  ]
  assert not [line for line in proc.stderr.splitlines() if line.startswith("I1")]
  text = evaluate.report_text(report, workdir)
  assert "| arith | 16 |" in text and text.endswith(f"{eval_dir}/step_4.{{json,md}}")


def test_offline_benchmarks_fail_before_any_compile_naming_eval_manual_dir(tmp_path, monkeypatch):
  from ada_jax.data import sets as data

  monkeypatch.setattr(data, "reachable", lambda url, timeout_s=3.0: False)
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
  c = tiny_config()
  c.eval.benchmarks = ("arith", "aime24")
  c.eval.manual_dir = ""
  with metrics_lib.CompileCounter() as compiles:
    with pytest.raises(
      config_lib.ConfigError,
      match=r"config\.eval\.benchmarks \(aime24\): aime24: aime24_test\.jsonl not in"
      r".*unreachable.*set config\.eval\.manual_dir",
    ):
      loop.run(c, str(tmp_path / "run"))
  assert compiles.count == 0 and not (tmp_path / "run").exists()


def test_evaluation_samplers_are_on_the_run_mesh(tmp_path, monkeypatch):
  """The held-out evaluation's samplers shard their slot cache over the run's mesh (rows
  over data × fsdp) instead of holding a replicated copy on every device."""
  from ada_jax.eval import sampling as eval_sampling

  made, real = [], eval_sampling.EvalSamplers.make

  def spy(*args, **kwargs):
    made.append(real(*args, **kwargs))
    return made[-1]

  monkeypatch.setattr(eval_sampling.EvalSamplers, "make", spy)
  c = tiny_config(steps=1)
  c.warmstart.steps = 2
  loop.run(c, str(tmp_path / "run"))
  (samplers,) = made
  for smp in (samplers.sampled, samplers.greedy):
    if smp is None:
      continue
    assert smp.mesh is not None and smp.mesh.devices.size == 8
    cache = smp.programs(max(smp.prompt_buckets)).init().cache
    for leaf in (cache.k[0], cache.v[-1], cache.mask):
      assert len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
      shard = leaf.sharding.shard_shape(leaf.shape)
      assert shard[0] == leaf.shape[0] // 8  # slots split over the 8 data-parallel devices


def test_rollouts_decode_from_one_compute_dtype_copy_per_step(tmp_path, no_implicit_transfers):
  """docs/design.md "Precision": float32 masters, bf16 compute. Every array the pool reads
  is the fused bfloat16 copy on the rollout layout (never a master), made once per RL
  step (the sampler's counter), and the train state stays float32; with
  `train.offload_state` it waits in host memory while each step samples."""
  from ada_jax.models import sharding as sharding_lib
  from ada_jax.rollout import queue, sampler

  c = tiny_config(steps=2)
  c.model.dtype, c.model.param_dtype = "bfloat16", "float32"
  c.train.offload_state = True
  c.eval.benchmarks = ()
  c.ckpt.every_steps = 0
  seen, copies, moves = [], [], []
  real_pool, real_copy = queue.SlotDriver.__init__, sampler.Sampler.rollout_params
  real_move = sharding_lib.to_memory

  def to_memory(state, kind):
    moves.append(kind)
    out = real_move(state, kind)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(out)} == {kind}
    return out

  def pool_init(self, programs, params, key):
    seen.append([(x.dtype, x.sharding, x.ndim) for x in jax.tree.leaves(params)])
    assert moves[-1:] == ["pinned_host"]  # the state is away while the pool exists
    real_pool(self, programs, params, key)

  def rollout_params(self, params):
    before = self.copies
    out = real_copy(self, params)
    copies.append(self.copies - before)
    return out

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(queue.SlotDriver, "__init__", pool_init)
    patch.setattr(sampler.Sampler, "rollout_params", rollout_params)
    patch.setattr(sharding_lib, "to_memory", to_memory)
    summary = _guarded_run(c, str(tmp_path), no_implicit_transfers)
  cfg = config_lib.parse(c)
  model_cfg = cfg.model.model_config()
  mesh = sharding_lib.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  want = sharding_lib.rollout_param_shardings(model_cfg, mesh)
  assert len(seen) == sum(copies) == 2  # one pool, one copy per RL step
  assert moves == ["pinned_host", "device"] * 2 and summary["steps_done"] == 2
  assert all(np.isfinite(m["loss"]) for m in _metrics(tmp_path))
  for params in seen:
    for (dtype, got, ndim), sh in zip(params, jax.tree.leaves(want), strict=True):
      assert dtype == jnp.bfloat16 and got.is_equivalent_to(sh, ndim)
  saved = saved_params.restore_params(
    tmp_path / "checkpoints", sharding_lib.abstract_params(model_cfg, mesh)
  )
  assert {x.dtype for x in jax.tree.leaves(saved)} == {jnp.dtype(jnp.float32)}


# ----------------------------------------------------------------------------- reruns


def _copy_run(reference_run, tmp_path):
  """A copy of the finished reference run (its lock files left out) to rerun in."""
  import shutil

  workdir = tmp_path / "run"
  shutil.copytree(reference_run[0], workdir, ignore=shutil.ignore_patterns(".lock.*"))
  return workdir


def _files(workdir):
  """Every file of the run but the lock, with its bytes."""
  return {
    str(p.relative_to(workdir)): p.read_bytes()
    for p in sorted(pathlib.Path(workdir).rglob("*"))
    if p.is_file() and not p.name.startswith(".lock")
  }


@pytest.mark.parametrize("steps", [2, 3])
def test_rerun_below_the_latest_checkpoint_is_refused_and_keeps_the_results(
  reference_run, tmp_path, steps
):
  """A finished 4-step run rerun with rl.steps=2 (the example) or 3 (a neighbour): one line
  naming the fields, exit 2, and summary.json keeps its `after_rl` (it was rewritten without
  it, and the run exited 75 forever)."""
  workdir = _copy_run(reference_run, tmp_path)
  before = _files(workdir)
  with pytest.raises(config_lib.ConfigError) as e:
    loop.run(tiny_config(steps=steps), str(workdir))
  text = str(e.value)
  assert f"config.rl.steps={steps} is below the workdir's latest checkpoint (RL step 4)" in text
  assert "\n" not in text
  assert _files(workdir) == before
  assert "after_rl" in json.loads((workdir / "summary.json").read_text())


def test_rerun_of_a_finished_run_writes_nothing(reference_run, tmp_path, capsys):
  """The same command again: "already finished", the saved summary (exit 0), and no file
  changes (the evaluation after RL went to TensorBoard a second time, summary.json was
  rewritten); a moved data folder (`data.manual_dir`, resolved at parse) is no change."""
  from ada_jax import main

  workdir = _copy_run(reference_run, tmp_path)
  before = _files(workdir)
  for edit in (lambda c: None, lambda c: setattr(c.data, "manual_dir", str(tmp_path))):
    config = tiny_config(steps=4)
    edit(config)
    summary = loop.run(config, str(workdir))
    assert summary == json.loads((workdir / "summary.json").read_text())
    assert _files(workdir) == before
    text, code = main.report(summary, str(workdir))
    assert code == 0 and text.startswith("done: 4 RL steps; held-out before -> after RL:")
  assert "already finished: RL step 4" in capsys.readouterr().err


def test_export_asked_of_a_finished_run_is_done(reference_run, tmp_path, capsys, monkeypatch):
  """ckpt.export_hf on a finished run (a change a resume may make): the final policy is
  exported, not "already finished" with nothing written; asked again, nothing more."""
  import errno

  from ada_jax.models import folder, weights

  workdir = _copy_run(reference_run, tmp_path)
  summary = json.loads((workdir / "summary.json").read_text())
  config = tiny_config(steps=4)
  config.ckpt.export_hf = True
  before = _files(workdir)

  def disk_full(tensors, path):
    raise OSError(errno.ENOSPC, "No space left on device")

  with monkeypatch.context() as m:  # a full disk: one error, nothing written, no partial folder
    m.setattr(folder, "write_safetensors", disk_full)
    m.setattr(weights, "write_safetensors", disk_full)
    with pytest.raises(folder.CheckpointError, match="no space left"):
      loop.run(config, str(workdir))
  assert _files(workdir) == before and not list(workdir.glob(".hf_final*"))
  assert loop.run(config, str(workdir)) == summary
  assert "exported the final policy to" in capsys.readouterr().err
  weights.load_hf(workdir / "hf_final")
  before = _files(workdir)
  loop.run(config, str(workdir))
  assert _files(workdir) == before and "already finished: RL step 4" in capsys.readouterr().err


def test_a_real_change_is_still_refused_on_resume(reference_run, tmp_path):
  workdir = _copy_run(reference_run, tmp_path)
  config = tiny_config(steps=4)
  config.data.arith_prompts = 128
  with pytest.raises(config_lib.ConfigError, match=r"config\.data\.arith_prompts: 256 -> 128"):
    loop.run(config, str(workdir))


def test_a_changed_evaluation_is_not_compared_with_the_one_before_rl(reference_run, tmp_path):
  """A resume that changes the eval group (allowed): the evaluation after RL is redone with
  the new settings, and the summary and closing lines say that the one before RL was made
  with other settings instead of printing them as a before -> after pair."""
  from ada_jax import main

  workdir = _copy_run(reference_run, tmp_path)
  config = tiny_config(steps=4)
  config.eval.k = 1
  summary = loop.run(config, str(workdir))
  assert summary["before_rl_comparable"] is False
  assert summary["before_rl_eval_changes"] == ["eval.k: 2 -> 1"]
  assert "eval/arith/avg@1" in summary["after_rl"]
  assert json.loads((workdir / "summary.json").read_text()) == summary
  text, code = main.report(summary, str(workdir))
  assert code == 0
  assert "not comparable with before RL, measured with other eval settings: eval.k: 2 -> 1" in text
  assert "->" not in text.split("eval.k: 2 -> 1")[1]  # no before -> after pair of scores


@pytest.mark.parametrize("damage", ["truncate", "drop_tensor"])
def test_a_bad_model_folder_is_refused_before_anything_is_written(tmp_path, damage):
  """A fresh run from a folder whose weights do not load (a truncated file; a tensor
  missing) was refused after it had made checkpoints/ and its lock: now before, from the
  files' headers, and the workdir stays empty."""
  from safetensors.numpy import load_file, save_file

  from ada_jax import testing

  model_config, params = testing.tiny_arith_model(seed=0)
  folder = tmp_path / "hf"
  testing.save_arith_model(model_config, params, folder, tmp_path / "unused_ckpt")
  weights_file = folder / "model.safetensors"
  if damage == "truncate":
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
  else:
    tensors = load_file(str(weights_file))
    tensors.pop("model.norm.weight")
    save_file(tensors, str(weights_file))
  config = tiny_config(steps=1)
  config.model.hf_dir = str(folder)
  config.model.preset = ""
  config.model.overrides = {}
  config.warmstart = None  # a pretrained start
  workdir = tmp_path / "run"
  words = "not a readable safetensors file" if damage == "truncate" else "tensor(s) missing"
  with pytest.raises(config_lib.ConfigError, match=rf"config\.model\.hf_dir: .*{re.escape(words)}"):
    loop.run(config, str(workdir))
  assert not workdir.exists() or not any(workdir.iterdir())
