"""Run-state guards (ada_jax.runstate): the workdir lock (kill -9, multi-host), the resume
compatibility rule, the non-finite step check, and stops by signal in every phase."""

import math
import os
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ada_jax import checkpoint, inputs, runstate
from ada_jax import config as config_lib
from ada_jax.models import decoder as model_lib

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


def test_resume_refuses_a_changed_seed_and_architecture():
  with pytest.raises(config_lib.ConfigError, match=r"config\.seed: 0 -> 7"):
    runstate.check_resume(_record(), {**_record(), "seed": 7}, 2)
  arch = _record(model={"overrides": {"num_layers": 2}})
  other = _record(model={"overrides": {"num_layers": 3}})
  with pytest.raises(config_lib.ConfigError, match=r"architecture num_layers: 2 -> 3"):
    runstate.check_resume(arch, other, 2)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  steps=st.integers(1, 10_000),
  every=st.integers(0, 50),
  keep=st.integers(1, 20),
  k=st.integers(1, 64),
  eval_every=st.integers(0, 50),
  log_samples=st.integers(0, 8),
)
def test_resume_allows_the_documented_changes(steps, every, keep, k, eval_every, log_samples):
  """rl.steps (to extend), logging and checkpoint cadence, ckpt.keep and the evaluation's
  settings may change on resume (docs/design.md "Run state")."""
  now = _record(
    rl={"steps": steps, "log_samples": log_samples},
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
  from ada_jax.models import sharding
  from ada_jax.rl import train

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
