"""The command lines as a user runs them (subprocesses): --help, a missing config file,
offline data, exit codes and messages of a finished, an interrupted and a resumed run,
TensorBoard events after a resume, and the evaluate CLI's output."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from test_loop import _metrics, _steps_saved, _tensorboard, _write_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  return env


def _run(args, cwd, timeout=600, **kw):
  return subprocess.run(
    [sys.executable, *args],
    cwd=cwd,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
    **kw,
  )


@pytest.mark.parametrize("module", ["ada_jax.main", "ada_jax.evaluate"])
def test_help_exits_0(module, tmp_path):
  proc = _run(["-m", module, "--help"], cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "--workdir" in proc.stdout + proc.stderr


@pytest.mark.parametrize("module", ["ada_jax.main", "ada_jax.evaluate"])
def test_missing_config_is_named_as_typed(module, tmp_path):
  proc = _run(
    ["-m", module, "--config=configs/no_such.py", f"--workdir={tmp_path / 'w'}", "--checkpoint=1"],
    cwd=tmp_path,
  )
  assert proc.returncode == 2
  assert (
    proc.stderr.strip()
    .splitlines()[-1]
    .startswith("ada_jax: --config=configs/no_such.py: no such file")
  )
  assert "Traceback" not in proc.stderr and "config_config" not in proc.stderr


# `python -m ada_jax.main` with the network probe answering "offline" (the tests never reach
# the network): TFDS's download would retry for minutes.
OFFLINE_MAIN = (
  "import runpy, sys; from ada_jax import data; "
  "data.reachable = lambda url, timeout_s=3.0: False; "
  "runpy.run_module('ada_jax.main', run_name='__main__', alter_sys=True)"
)


def test_gsm8k_config_offline_without_files_fails_in_seconds_with_one_line(tmp_path):
  workdir = tmp_path / "run"
  env_tfds = str(tmp_path / "tfds")
  start = time.perf_counter()
  proc = subprocess.run(
    [
      sys.executable,
      "-c",
      OFFLINE_MAIN,
      f"--config={ROOT / 'configs' / 'gsm8k_tiny_pos.py'}",
      f"--workdir={workdir}",
      "--config.data.manual_dir=",
      "--config.tokenizer.dir=",
      "--config.tokenizer.eos_ids=()",  # the built-in tokenizer takes no Llama 3 stop ids
    ],
    cwd=tmp_path,
    env={**_env(), "TFDS_DATA_DIR": env_tfds},
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  wall = time.perf_counter() - start
  assert proc.returncode == 2, proc.stderr[-3000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("ada_jax: config.data: gsm8k: gsm8k_train.jsonl, gsm8k_test.jsonl not in")
  assert "unreachable" in last and "set config.data.manual_dir" in last
  assert "Traceback" not in proc.stderr and "Downloading" not in proc.stdout + proc.stderr
  assert not workdir.exists()
  assert wall < 120, wall  # seconds (interpreter and TensorFlow start-up), not minutes


def _main(tmp_path, workdir, steps, *overrides, popen=False):
  args = [
    "-m",
    "ada_jax.main",
    f"--config={_write_config(tmp_path, steps)}",
    f"--workdir={workdir}",
    *overrides,
  ]
  if popen:
    return subprocess.Popen(
      [sys.executable, *args],
      cwd=ROOT,
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
  return _run(args, cwd=ROOT)


@pytest.mark.parametrize(
  "summary,code,text",
  [
    (
      {"steps_done": 3, "after_rl": {}},
      0,
      "done: 3 RL steps (no held-out benchmarks: config.eval.benchmarks is empty)\n",
    ),
    (
      {
        "steps_done": 3,
        "before_rl": {"eval/arith/avg@4": 0.28, "eval/arith/pass@4": 0.5},
        "after_rl": {"eval/arith/avg@4": 0.435, "eval/arith/pass@4": 0.75},
      },
      0,
      "done: 3 RL steps; held-out before -> after RL:\n  eval/arith/avg@4: 0.2800 -> 0.4350\n",
    ),
    (
      {"steps_done": 8, "stopped_by": "SIGINT"},
      75,
      "stopped by SIGINT after RL step 8 with a checkpoint; run the same command again",
    ),
  ],
)
def test_closing_lines_and_exit_codes(summary, code, text):
  from ada_jax import main

  got, exit_code = main.report(summary, "/runs/x")
  assert exit_code == code and got.startswith(text)
  assert "pass@4" not in got  # Avg@k only


@pytest.mark.slow
def test_ctrl_c_stops_with_checkpoint_exit_75_and_the_rerun_resumes(tmp_path):
  """SIGINT: the log names it, exit code 75 (resumable); the same command resumes ("resuming
  from step N"), evaluates with progress lines, and TensorBoard has every step once and the
  held-out scores before and after RL."""
  workdir = tmp_path / "run"
  proc = _main(tmp_path, workdir, 50, popen=True)
  deadline = time.time() + 600
  while not _metrics(workdir) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.2)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 75, err[-3000:]
  last = _metrics(workdir)[-1]["step"]
  assert _steps_saved(workdir)[-1] == last < 50
  assert f"SIGINT: saved checkpoint {last}, exiting" in err and "SIGTERM" not in err
  assert out.startswith(f"stopped by SIGINT after RL step {last} with a checkpoint")
  assert "held-out evaluation at RL step 0: arith (Avg@2)" in err
  assert "held-out at RL step 0: arith/avg@2 " in err

  resumed = _main(tmp_path, workdir, last + 1)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resuming from step {last} " in resumed.stderr
  assert f"held-out at RL step {last + 1}: arith/avg@2 " in resumed.stderr
  assert f"done: {last + 1} RL steps; held-out before -> after RL:\n  eval/arith/avg@2: " in (
    resumed.stdout
  )
  tb = _tensorboard(workdir)
  assert tb["loss"] == list(range(1, last + 2))
  assert tb["eval/arith/avg_at_2"] == [0, last + 1]


class _Reader:
  """Collects a pipe's text in a thread (tqdm bars end lines with \\r, not \\n)."""

  def __init__(self, pipe):
    import threading

    self.text = ""
    self._pipe = pipe
    self._thread = threading.Thread(target=self._read, daemon=True)
    self._thread.start()

  def _read(self):
    while chunk := self._pipe.read(1):
      self.text += chunk

  def wait_for(self, needle, timeout=300):
    deadline = time.monotonic() + timeout
    while needle not in self.text:
      assert time.monotonic() < deadline, self.text[-3000:]
      time.sleep(0.2)

  def join(self):
    self._thread.join(timeout=60)
    return self.text


def test_a_second_main_on_a_running_workdir_exits_2_naming_the_holder(tmp_path):
  """Two `main`s on one workdir: the second is refused in one line naming the first (its
  pid and host) and writes nothing; the first goes on and stops cleanly on SIGTERM."""
  workdir = tmp_path / "run"
  first = _main(tmp_path, workdir, 200, popen=True)
  err = _Reader(first.stderr)
  try:
    err.wait_for("RL steps")
    second = _main(tmp_path, workdir, 200)
    assert second.returncode == 2, second.stderr[-3000:]
    line = [x for x in second.stderr.splitlines() if x.startswith("ada_jax:")]
    assert len(line) == 1 and f"in use by pid {first.pid} on host" in line[0], second.stderr
    assert "Traceback" not in second.stderr
  finally:
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=300)
  assert first.returncode == 75, err.join()[-3000:]
  steps = [m["step"] for m in _metrics(workdir)]
  assert steps == sorted(set(steps))  # one writer: every step once, in order


def test_sigterm_during_the_warm_start_exits_75_without_a_trace(tmp_path):
  workdir = tmp_path / "run"
  proc = _main(tmp_path, workdir, 2, "--config.warmstart.steps=5000", popen=True)
  err = _Reader(proc.stderr)
  err.wait_for("warm start")
  time.sleep(1.0)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  text = err.join()
  assert proc.returncode == 75, text[-3000:]
  assert "stopped by SIGTERM during the warm start" in out
  assert "Traceback" not in text and "Fatal" not in text and "SIGTERM received" not in text


NAN_CONFIG = """
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from ada_jax.rl import update
from test_loop import tiny_config

_real = update.update_policy


def _nan_loss(*args, **kwargs):  # a policy update whose loss is NaN from step 2 on
  state, metrics = _real(*args, **kwargs)
  _nan_loss.calls = getattr(_nan_loss, "calls", 0) + 1
  return state, {{**metrics, "loss": float("nan")}} if _nan_loss.calls >= 2 else metrics


update.update_policy = _nan_loss


def get_config():
  c = tiny_config(4)
  c.ckpt.every_steps = 1
  c.ckpt.keep = 1
  c.eval.benchmarks = ()  # the stop is the RL loop's: no held-out evaluation to wait for
  return c
"""


def test_a_nan_loss_exits_3_in_one_line_keeping_the_last_finite_checkpoint(tmp_path):
  config = tmp_path / "nan.py"
  config.write_text(NAN_CONFIG.format(root=str(ROOT), tests=str(ROOT / "tests")))
  workdir = tmp_path / "run"
  proc = _run(["-m", "ada_jax.main", f"--config={config}", f"--workdir={workdir}"], cwd=ROOT)
  assert proc.returncode == 3, proc.stderr[-3000:]
  lines = [x for x in proc.stderr.splitlines() if x.startswith("ada_jax:")]
  assert len(lines) == 1 and "RL step 2: the loss is nan" in lines[0]
  assert "Traceback" not in proc.stderr and "done" not in proc.stdout
  assert _steps_saved(workdir) == [1]  # keep=1: the last finite one, never rotated away


def test_no_cuda_here_drops_only_the_plugins_missing_cuda_traceback():
  """The dev requirements' CUDA compile plugin on a machine with no CUDA: JAX's start-up
  traceback is dropped; the same plugin failing otherwise, or other errors, are kept."""
  import logging

  from ada_jax import cli

  def record(message, error):
    try:
      raise error
    except RuntimeError:
      return logging.LogRecord("jax", logging.ERROR, "", 0, message, (), sys.exc_info())

  plugin = "Jax plugin configuration error: Exception when calling %s.initialize()"
  no_cuda = RuntimeError("Unable to load CUDA. Is it installed?")
  keep = cli._NoCudaHere().filter
  assert not keep(record(plugin % "jax_plugins.xla_cuda12", no_cuda))
  assert keep(record(plugin % "jax_plugins.xla_cuda12", RuntimeError("cuDNN 9.1 < 9.8")))
  assert keep(record(plugin % "jax_plugins.xla_tpu", no_cuda))
  assert keep(logging.LogRecord("jax", logging.ERROR, "", 0, "another error", (), None))
