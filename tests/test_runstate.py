"""Run-state guards (ada_jax.runstate): the workdir lock (kill -9, multi-host), the resume
compatibility rule, the non-finite step check, and stops by signal in every phase."""

import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loop import _metrics, _steps_saved, tiny_config

from ada_jax import checkpoint, inputs, loop, main, runstate
from ada_jax import config as config_lib
from ada_jax import metrics as metrics_lib
from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding
from ada_jax.rl import train, update
from ada_jax.rl import warmstart as warmstart_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------- the lock


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
  with runstate.hold_workdir(tmp_path, process_index=0) as lock:
    assert f"pid {os.getpid()}" in lock.read_text()
    with pytest.raises(config_lib.ConfigError, match=rf"in use by pid {os.getpid()} on host"):
      with runstate.hold_workdir(tmp_path, process_index=0):
        pass
    # Another process index of a multi-host run holds its own file.
    with runstate.hold_workdir(tmp_path, process_index=1):
      pass
  with runstate.hold_workdir(tmp_path, process_index=0):  # released on exit
    pass


_HOLDER = textwrap.dedent("""
  import sys, time
  from ada_jax import runstate
  with runstate.hold_workdir(sys.argv[1], process_index=int(sys.argv[2])):
    print("held", flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("index", [0, 3])
def test_a_lock_dies_with_its_process_even_by_kill_9(tmp_path, index):
  """Another process's lock refuses this one (every host of a second multi-host job is
  refused by its own index's file); once the holder is killed -9 the workdir is free at
  once, with no stale lock to remove."""
  script = tmp_path / "holder.py"
  script.write_text(_HOLDER)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(
    [sys.executable, str(script), str(tmp_path / "run"), str(index)],
    stdout=subprocess.PIPE,
    env=env,
    text=True,
  )
  try:
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(config_lib.ConfigError, match=rf"pid {proc.pid} on host"):
      with runstate.hold_workdir(tmp_path / "run", process_index=index):
        pass
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
  with runstate.hold_workdir(tmp_path / "run", process_index=index):
    pass


# ----------------------------------------------------------------------------- resume rule


def _record(**groups):
  groups = {g: dict(v) for g, v in groups.items()}
  groups["model"] = {"preset": "tiny-llama", **groups.get("model", {})}
  cfg = config_lib.parse(groups)
  _, architecture, _ = inputs.load_model_files(cfg.model, cfg.tokenizer)
  return runstate.config_record(cfg, architecture)


def test_resume_refuses_a_change_of_what_the_run_is_naming_old_and_new():
  saved = _record(rl={"batch_prompts": 8}, optim={"learning_rate": 1e-6})
  now = _record(rl={"batch_prompts": 16}, optim={"learning_rate": 2e-6})
  with pytest.raises(config_lib.ConfigError) as e:
    runstate.check_resume(saved, now, 6)
  text = str(e.value)
  assert "checkpoint 6" in text and "\n" not in text
  assert "config.rl.batch_prompts: 8 -> 16" in text
  assert "config.optim.learning_rate: 1e-06 -> 2e-06" in text


@pytest.mark.parametrize(
  "group,field,old,new",
  [
    ("ada", "method", "pos", "balance"),
    ("model", "dtype", "float32", "bfloat16"),
    ("rl", "judge", "math", "exact"),
    ("sampler", "max_new_tokens", 12, 16),
    ("loss", "kl_coeff", 0.0, 0.1),
  ],
)
def test_resume_refuses_each_kind_of_recipe_change(group, field, old, new):
  with pytest.raises(config_lib.ConfigError, match=rf"config\.{group}\.{field}: "):
    runstate.check_resume(_record(**{group: {field: old}}), _record(**{group: {field: new}}), 1)


def test_resume_refuses_a_checkpoint_of_bf16_masters_naming_the_field():
  """A run saved before `model.param_dtype` existed stored its params and AdamW moments in
  its compute dtype: its record has no `model.param_dtype` and a bfloat16 architecture;
  resuming it under float32 masters is refused naming the field (ckpt.init_from of its
  weights restores them upcast instead: tests/test_checkpoint.py)."""
  old = _record(model={"dtype": "bfloat16", "param_dtype": "bfloat16"})
  del old["model.param_dtype"]
  with pytest.raises(
    config_lib.ConfigError, match=r"architecture param_dtype: 'bfloat16' -> 'float32'"
  ):
    runstate.check_resume(old, _record(model={"dtype": "bfloat16"}), 3)
  with pytest.raises(config_lib.ConfigError, match=r"config\.model\.param_dtype: "):
    runstate.check_resume(_record(model={"param_dtype": "bfloat16"}), _record(), 3)


def test_a_checkpoint_of_the_flat_names_resumes_or_is_refused_by_new_name():
  """Records saved before Est's, DAPO's and Seq's settings became groups spell them flat
  (`ada.est_decay`, `ada.max_rounds`): the same values resume, a changed one is refused
  under its name now."""
  now = _record(
    ada={
      "method": "est",
      "est": {"decay": 0.5},
      "dapo": {"max_extra_passes": 2},
      "seq": {"max_rounds": 3},
    }
  )
  old = {}
  for key, value in now.items():
    for group in ("est", "dapo"):
      key = key.replace(f"ada.{group}.", f"ada.{group}_")
    old[key.replace("ada.seq.", "ada.")] = value
  assert {"ada.est_decay", "ada.dapo_max_extra_passes", "ada.max_rounds"} <= set(old)
  assert set(runstate.RENAMED.values()) <= set(now)
  runstate.check_resume(old, now, 4)
  for key, before, name in [
    ("ada.est_decay", 0.9, r"ada\.est\.decay: 0\.9 -> 0\.5"),
    ("ada.dapo_max_extra_passes", 4, r"ada\.dapo\.max_extra_passes: 4 -> 2"),
    ("ada.max_rounds", 4, r"ada\.seq\.max_rounds: 4 -> 3"),
    ("ada.min_exit_chance", 0.1, r"ada\.seq\.min_exit_chance: 0\.1 -> 0\.0"),
  ]:
    with pytest.raises(config_lib.ConfigError, match=rf"config\.{name}"):
      runstate.check_resume({**old, key: before}, now, 4)


def test_resume_refuses_a_changed_seed_and_architecture():
  with pytest.raises(config_lib.ConfigError, match=r"config\.seed: 0 -> 7"):
    runstate.check_resume(_record(), {**_record(), "seed": 7}, 2)
  arch = _record(model={"overrides": {"num_layers": 2}})
  other = _record(model={"overrides": {"num_layers": 3}})
  with pytest.raises(config_lib.ConfigError, match=r"architecture num_layers: 2 -> 3"):
    runstate.check_resume(arch, other, 2)


@pytest.mark.parametrize(
  ("field", "old", "new"), [("eos_ids", (2,), (2, 5)), ("eos_ids", (2,), (3,)), ("pad_id", 0, 4)]
)
def test_resume_refuses_a_model_folder_whose_stop_or_pad_ids_changed(field, old, new):
  """The ids come from the folder's files, not the config: a folder edited in place between
  two sessions would make the resumed run sample other responses under the same record."""
  from ada_jax.data import arith

  tok = arith.load_tokenizer()
  before = {**_record(), **runstate.tokenizer_record(tok)}
  setattr(tok, field, new)
  after = {**_record(), **runstate.tokenizer_record(tok)}
  what = {"eos_ids": "stop_ids", "pad_id": "pad_id"}[field]
  with pytest.raises(config_lib.ConfigError, match=rf"the model folder's tokenizer {what}: "):
    runstate.check_resume(before, after, 4)
  runstate.check_resume(_record(), after, 4)  # a checkpoint saved before the record had them


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  steps=st.integers(1, 10_000),
  every=st.integers(0, 50),
  keep=st.integers(1, 20),
  k=st.integers(1, 64),
  eval_every=st.integers(0, 50),
  workers=st.integers(0, 8),
)
def test_resume_allows_the_documented_changes(steps, every, keep, k, eval_every, workers):
  """rl.steps (to extend), logging and checkpoint cadence, ckpt.keep and the evaluation's
  settings may change on resume (docs/design.md "Run state")."""
  now = _record(
    rl={"steps": steps, "verifier": {"num_workers": workers}},
    ckpt={"every_steps": every, "keep": keep},
    eval={"k": k, "every_steps": eval_every},
  )
  runstate.check_resume(_record(), now, 3)
  runstate.check_resume(None, now, 3)  # a checkpoint without a record: not compared


# ----------------------------------------------------------------------------- numbers

_BAD = st.sampled_from([math.nan, math.inf, -math.inf])


@settings(max_examples=30, deadline=None)
@given(quantity=st.sampled_from(["loss", "grad_norm"]), bad=_BAD, step=st.integers(1, 10**6))
def test_a_non_finite_loss_or_grad_norm_stops_naming_step_and_quantity(quantity, bad, step):
  params = {"w": np.ones(3, np.float32)}
  metrics = {"loss": 0.5, "grad_norm": 1.0, quantity: bad}
  with pytest.raises(checkpoint.NonFiniteError, match=rf"RL step {step}: the {quantity} is"):
    runstate.check_step(step, metrics, params)
  runstate.check_step(step, {"loss": 0.5}, params)  # finite: passes
  runstate.check_step(step, {}, params)  # a skipped update has no loss


@settings(max_examples=30, deadline=None)
@given(leaf=st.integers(0, 2), index=st.integers(0, 5), bad=_BAD)
def test_a_non_finite_update_stops_naming_the_param(leaf, index, bad):
  params = {f"p{i}": np.zeros(6, np.float32) for i in range(3)}
  params[f"p{leaf}"][index] = bad
  with pytest.raises(checkpoint.NonFiniteError, match=rf"non-finite params \(\['p{leaf}'\]\)"):
    runstate.check_step(4, {"loss": 0.1, "grad_norm": 0.2}, params)


# ----------------------------------------------------------------------------- signals


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_in_a_phase_stops_at_once_and_in_the_loop_is_polled(sig):
  with runstate.stop_signals("the warm start") as stop:
    with pytest.raises(runstate.Stopped) as e:
      signal.raise_signal(sig)
    assert e.value.signal_name == signal.Signals(sig).name
    assert e.value.phase == "the warm start"
  with runstate.stop_signals() as stop:
    stop.enter(None)
    signal.raise_signal(sig)  # polled: no exception here
    assert runstate.stop_requested(stop) and stop.signal_name == signal.Signals(sig).name


def test_a_swallowed_stop_still_stops_at_the_next_phase_boundary():
  """An exception raised inside e.g. a garbage-collection callback is printed and dropped
  by Python; the event stays set, and the next phase change stops the run."""
  with runstate.stop_signals("the held-out evaluation before RL") as stop:
    try:
      signal.raise_signal(signal.SIGINT)
    except runstate.Stopped:
      pass  # swallowed
    with pytest.raises(runstate.Stopped, match="SIGINT during the held-out evaluation"):
      stop.enter(None)


def test_stop_signals_restores_the_previous_handlers():
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  with runstate.stop_signals("the set-up"):
    assert signal.getsignal(signal.SIGINT) is not before[0]
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_second_ctrl_c_interrupts_at_once():
  with runstate.stop_signals() as stop:
    stop.enter(None)
    signal.raise_signal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
      signal.raise_signal(signal.SIGINT)


def test_checkpoint_refuses_to_save_non_finite_state(tmp_path):
  cfg = model_lib.preset("tiny-llama")
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  params = model_lib.init_params(cfg, jax.random.key(0))
  params = jax.tree.map(lambda x: x * np.nan, params)
  state = train.init_train_state(cfg, train.TrainConfig(), params, mesh)
  manager = checkpoint.make_manager(tmp_path / "ckpt")
  with pytest.raises(checkpoint.NonFiniteError, match="checkpoint 5 not saved"):
    checkpoint.save(manager, 5, checkpoint.RunState(train=state, rng=jax.random.key(0)))
  assert manager.all_steps() == []
  manager.close()


# ----------------------------------------------------------------------------- on the loop
# A finished 2-step tiny run (checkpoints 0 and 2, held-out evaluations at 0 and 2) that
# each test copies and reuses: resumed, extended, corrupted, signalled.


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("base")
  summary = loop.run(tiny_config(steps=2), str(workdir))
  return workdir, summary


def _copy(base_run, tmp_path):
  workdir = tmp_path / "run"
  shutil.copytree(base_run[0], workdir)
  return workdir


def _cache_lines(workdir):
  return (workdir / "eval" / "cache.jsonl").read_text().count("\n")


def test_a_reused_workdir_samples_again_for_other_weights(base_run, tmp_path):
  """The workdir reused for another run (its checkpoints, metrics and summary deleted):
  the evaluations at steps 0 and 2 are of other weights and are sampled, not read from
  the earlier run's cache."""
  workdir = _copy(base_run, tmp_path)
  for name in ("checkpoints", "metrics.jsonl", "summary.json"):
    path = workdir / name
    shutil.rmtree(path) if path.is_dir() else path.unlink()
  before = _cache_lines(workdir)
  c = tiny_config(steps=2)
  c.seed = 1
  summary = loop.run(c, str(workdir))
  assert _cache_lines(workdir) == 2 * before  # both evaluations sampled again
  reports = {p.name for p in (workdir / "eval").glob("*.json")}
  assert {"step_0.2.json", "step_2.2.json"} <= reports  # the earlier reports kept
  assert summary["source"] == "scratch"


def _poison(monkeypatch, quantity):
  """The first policy update of the run returns a NaN `quantity` ('update': params)."""
  real = update.update_policy

  def poisoned(*args, **kwargs):
    state, tm = real(*args, **kwargs)
    if quantity == "update":
      state = state.replace(params=jax.tree.map(lambda x: x * np.nan, state.params))
    else:
      tm = {**tm, quantity: float("nan")}
    return state, tm

  monkeypatch.setattr(update, "update_policy", poisoned)


@pytest.mark.parametrize("quantity", ["loss", "grad_norm", "update"])
def test_a_non_finite_step_stops_before_its_checkpoint(base_run, tmp_path, monkeypatch, quantity):
  """Extended (rl.steps 2 -> 4, keep 3 -> 1: changes a resume may make) and poisoned at
  step 3: the run stops naming the step and the quantity; checkpoint 2, the last finite
  one, is not rotated away, nothing non-finite is on disk, and no metrics line of step 3
  is written."""
  workdir = _copy(base_run, tmp_path)
  c = tiny_config(steps=4)
  c.ckpt.keep = 1
  c.ckpt.every_steps = 1
  _poison(monkeypatch, quantity)
  name = "the update left non-finite params" if quantity == "update" else f"the {quantity} is nan"
  with pytest.raises(checkpoint.NonFiniteError, match=rf"RL step 3: {name}"):
    loop.run(c, str(workdir))
  assert _steps_saved(workdir) == [0, 2]
  assert [m["step"] for m in _metrics(workdir)] == [1, 2]
  manager = checkpoint.make_manager(workdir / "checkpoints")
  assert checkpoint.restore(manager, _target(c)).host["step"] == 2  # restores: finite
  manager.close()


def _target(c):
  cfg = config_lib.parse(c)
  _, model_cfg, _ = inputs.load_model_files(cfg.model, cfg.tokenizer)
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  return train.abstract_state(model_cfg, cfg.train, mesh)


@pytest.mark.parametrize(
  "edit,match",
  [
    (lambda c: setattr(c.optim, "learning_rate", 1e-3), r"config\.optim\.learning_rate: 0\.0003"),
    (lambda c: setattr(c.rl, "batch_prompts", 16), r"config\.rl\.batch_prompts: 8 -> 16"),
    (lambda c: setattr(c.ada, "method", "balance"), r"config\.ada\.method: 'pos' -> 'balance'"),
    (lambda c: setattr(c.model, "dtype", "bfloat16"), r"config\.model\.dtype: 'float32'"),
    (lambda c: setattr(c, "seed", 5), r"config\.seed: 0 -> 5"),
    (lambda c: c.model.overrides.update(num_layers=3), r"architecture num_layers: 2 -> 3"),
  ],
)
def test_a_resume_with_another_config_is_refused_before_any_compile(
  base_run, tmp_path, edit, match
):
  workdir = _copy(base_run, tmp_path)
  c = tiny_config(steps=2)
  edit(c)
  with metrics_lib.CompileCounter() as compiles:
    with pytest.raises(config_lib.ConfigError, match=match):
      loop.run(c, str(workdir))
  assert compiles.count == 0 and _steps_saved(workdir) == [0, 2]


def test_a_held_workdir_is_refused_naming_the_holder(base_run, tmp_path):
  workdir = _copy(base_run, tmp_path)
  with runstate.hold_workdir(workdir):
    with pytest.raises(config_lib.ConfigError, match=rf"in use by pid {os.getpid()} on host"):
      loop.run(tiny_config(steps=2), str(workdir))
  assert _metrics(workdir) == _metrics(base_run[0])


def test_a_torn_checkpoint_and_metrics_line_fall_back_and_resume(base_run, tmp_path, caplog):
  """Checkpoint 2 truncated and a torn last metrics line (a kill mid-write): the run
  resumes from checkpoint 0, naming the skipped file, and redoes steps 1-2."""
  workdir = _copy(base_run, tmp_path)
  params = workdir / "checkpoints" / "2" / "params"
  big = max((p for p in params.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  big.write_bytes(big.read_bytes()[:100])
  with open(workdir / "metrics.jsonl", "a") as f:
    f.write('{"step": 3, "loss": 0.')
  with caplog.at_level("WARNING"):
    summary = loop.run(tiny_config(steps=2), str(workdir))
  assert summary["source"] == "checkpoint:0" and summary["steps_done"] == 2
  assert f"checkpoint 2 does not restore: {params}" in caplog.text
  assert [m["step"] for m in _metrics(workdir)] == [1, 2]
  assert _steps_saved(workdir) == [0, 2] and (workdir / "checkpoints" / "2.unreadable").is_dir()


# ----------------------------------------------------------------------------- signals


def _signal_in(monkeypatch, module, name, sig, swallow=False, when=lambda *a: True):
  real = getattr(module, name)

  def patched(*args, **kwargs):
    if when(*args):
      try:
        signal.raise_signal(sig)
      except BaseException:  # what a garbage-collection callback does with an exception
        if not swallow:
          raise
    return real(*args, **kwargs)

  monkeypatch.setattr(module, name, patched)


def test_sigterm_during_the_warm_start_stops_cleanly(tmp_path, monkeypatch):
  _signal_in(monkeypatch, warmstart_lib, "warm_start", signal.SIGTERM)
  with pytest.raises(runstate.Stopped) as e:
    loop.run(tiny_config(steps=2), str(tmp_path / "run"))
  assert (e.value.signal_name, e.value.phase) == ("SIGTERM", "the warm start")
  assert main.report({"stopped_by": "SIGTERM", "phase": e.value.phase}, "w")[1] == 75
  assert _steps_saved(tmp_path / "run") == []


def test_a_swallowed_ctrl_c_in_the_step_0_evaluation_still_stops_and_resumes(tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  _signal_in(
    monkeypatch, loop, "_heldout_eval", signal.SIGINT, swallow=True, when=lambda *a: a[3] == 0
  )
  with pytest.raises(runstate.Stopped, match="SIGINT during the held-out evaluation before RL"):
    loop.run(tiny_config(steps=2), str(workdir))
  assert _steps_saved(workdir) == [0] and _metrics(workdir) == []
  monkeypatch.undo()
  summary = loop.run(tiny_config(steps=2), str(workdir))  # resumes: no second warm start
  assert summary["source"] == "checkpoint:0" and summary["before_rl"] and summary["after_rl"]
  assert summary["warmstart"] is not None


def test_sigterm_during_the_final_evaluation_stops_and_the_rerun_finishes(
  base_run, tmp_path, monkeypatch
):
  workdir = _copy(base_run, tmp_path)
  (workdir / "summary.json").unlink()
  _signal_in(monkeypatch, loop, "_heldout_eval", signal.SIGTERM)
  with pytest.raises(runstate.Stopped, match="SIGTERM during the held-out evaluation after RL"):
    loop.run(tiny_config(steps=2), str(workdir))
  monkeypatch.undo()
  lines = _cache_lines(workdir)
  summary = loop.run(tiny_config(steps=2), str(workdir))
  assert summary["after_rl"] == base_run[1]["after_rl"] and _cache_lines(workdir) == lines
  assert [m["step"] for m in _metrics(workdir)] == [1, 2]


@pytest.mark.parametrize(
  "field,old,new",
  [
    # The example: a `../shared` folder appeared (the configs' default resolves it at parse).
    ("data.manual_dir", "", "/work/shared/data"),
    # Neighbours: the checkout moved; the tokenizer's and the benchmarks' folders alike.
    ("data.manual_dir", "/old/checkout/../shared/data", "/new/shared/data"),
    ("tokenizer.dir", "/old/shared/tokenizers/llama3", "/new/shared/tokenizers/llama3"),
    ("data.data_dir", "", "/tfds"),
    ("eval.manual_dir", "/a", "/b"),
  ],
)
def test_resume_compares_the_prompts_not_the_folders_they_were_read_from(field, old, new):
  base, sha = _record(), {"data.prompts_sha256": "ab12"}
  runstate.check_resume({**base, field: old, **sha}, {**base, field: new, **sha}, 4)
  # What the run depends on did change: the same folder, other prompts, is refused.
  with pytest.raises(config_lib.ConfigError, match=r"config\.data\.prompts_sha256: 'ab12' -> "):
    runstate.check_resume(
      {**base, field: old, **sha}, {**base, field: new, "data.prompts_sha256": "cd"}, 4
    )


def test_prompts_record_changes_with_the_prompts_only():
  from ada_jax.data.prompts import PromptSet

  def prompt_set(tokens, answers):
    n = len(tokens)
    return PromptSet(
      ("p",) * n, ("q",) * n, answers, ("s",) * n, tuple(np.asarray(t) for t in tokens), 0
    )

  a = runstate.prompts_record(prompt_set([[1, 2], [3]], ("4", "5")))
  assert a == runstate.prompts_record(prompt_set([[1, 2], [3]], ("4", "5")))
  assert a != runstate.prompts_record(prompt_set([[1], [2, 3]], ("4", "5")))  # other tokens
  assert a != runstate.prompts_record(prompt_set([[1, 2], [3]], ("4", "6")))  # other answer
