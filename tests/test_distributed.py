"""Multi-process runs: 2 local processes on loopback (gloo CPU collectives), 4 fake CPU
devices each, one 8-device mesh over both. Checks that both processes end with identical
params and controller state, and that killing one makes the other fail fast; plus the
host-side helpers of `ada_jax.distributed` in one process."""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from ada_jax import distributed
from ada_jax.models import sharding

ROOT = pathlib.Path(__file__).resolve().parents[1]

# tiny_arith_pos shrunk to seconds: a 2-layer d=32 model warm-started on 1-digit sums until
# about half its answers are right, so rewards and the controller's choices are not trivial.
# Eval off (the in-loop eval sampler is single-host).
CONFIG = """
import ml_collections
from configs import tiny_arith_pos


def get_config():
  c = tiny_arith_pos.get_config()
  # Everything the test relies on is set here, not inherited from the calibrated config.
  c.model.overrides.update(embed_dim=32, mlp_dim=64, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=16)
  c.data.arith = ml_collections.ConfigDict(dict(levels=(1,), ops=("+",)))
  c.data.arith_prompts = 256
  c.sampler.max_new_tokens = 12
  c.sampler.chunk_rows = 64
  c.sampler.prompts_per_chunk = 8
  c.ada.method = {method!r}
  c.ada.seq.max_rounds = 2
  c.ada.schedule = {schedule!r}
  c.ada.seq.min_exit_chance = {chance!r}
  c.ada.est.beta = 0.1 if {chance!r} else 16.0  # an optimistic prior: easy prompts stop
  c.sampler.segment_steps = 2
  c.rl.steps = {steps}
  c.rl.batch_prompts = 8
  c.ckpt.every_steps = 2
  c.warmstart = ml_collections.ConfigDict(dict(
      steps=200, batch_size=32, learning_rate=3e-3,
      task=ml_collections.ConfigDict(dict(levels=(1,), ops=("+",)))))
  c.eval.benchmarks = ()
  return c
"""

# Like `python -m ada_jax.main`, but keeps each process's summary (fingerprints) in a file.
WORKER = """
import json, sys
sys.path.insert(0, {root!r})
import importlib.util
from absl import logging
from ada_jax import distributed


def main():
  distributed.initialize(distributed.DistributedConfig.from_env())
  logging.set_verbosity(logging.WARNING)
  spec = importlib.util.spec_from_file_location("cfg", {config!r})
  cfg = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cfg)
  import jax
  from ada_jax import loop
  with distributed.exit_on_failure():
    summary = loop.run(cfg.get_config(), {workdir!r})
  with open({out!r}.format(jax_process=jax.process_index()), "w") as f:
    json.dump(summary, f)


if __name__ == "__main__":  # worker processes (verifier pool) re-import this file
  main()
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(port: int, process: int) -> dict[str, str]:
  env = dict(os.environ)
  env.update(
    XLA_FLAGS="--xla_force_host_platform_device_count=4",
    JAX_PLATFORMS="cpu",
    JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
    JAX_NUM_PROCESSES="2",
    JAX_PROCESS_ID=str(process),
    ADA_JAX_HEARTBEAT_TIMEOUT_S="10",
    ADA_JAX_SHUTDOWN_TIMEOUT_S="10",
    ADA_JAX_INIT_TIMEOUT_S="120",
    PYTHONUNBUFFERED="1",
  )
  return env


def _launch(cmd: list[str], tmp_path: pathlib.Path) -> list[subprocess.Popen]:
  port = _free_port()
  procs = []
  for p in range(2):
    log = open(tmp_path / f"process{p}.log", "w")  # noqa: SIM115 - closed with the process
    # A session of its own per process: cleanup kills the whole group, children included.
    procs.append(
      subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env(port, p),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
      )
    )
  return procs


def _cleanup(procs: list[subprocess.Popen]) -> None:
  for proc in procs:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    try:  # anything still alive in that group (e.g. a verifier worker) goes too
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def _group_gone(pgid: int, timeout_s: float = 20.0) -> bool:
  """Whether every process of group `pgid` has exited (children may take a moment)."""
  deadline = time.time() + timeout_s
  while time.time() < deadline:
    try:
      os.killpg(pgid, 0)
    except ProcessLookupError:
      return True
    time.sleep(0.2)
  return False


def _write_config(
  tmp_path: pathlib.Path,
  steps: int,
  schedule: str = "rounds",
  chance: float = 0.0,
  method: str = "pos",
) -> pathlib.Path:
  path = tmp_path / f"cfg_{steps}.py"
  text = CONFIG.format(steps=steps, schedule=schedule, chance=chance, method=method)
  path.write_text(textwrap.dedent(text))
  return path


def _log(tmp_path, p):
  return (tmp_path / f"process{p}.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
  "schedule,chance,method",
  [("rounds", 0.0, "pos"), ("stream", 0.5, "balance")],
)
def test_two_processes_end_identical(tmp_path, schedule, chance, method):
  # Under `stream` the processes also grade their halves of each segment's rows
  # asynchronously and all-gather them at the next boundary (`SharedGrader`); with the
  # exit-chance rule (chance > 0) they also stop the same prompts and fold the same
  # statistics (the controller's fingerprint covers the Est state). One stream case
  # covers both: the rule only adds decisions to the same boundaries.
  workdir = tmp_path / "run"
  out = str(tmp_path / "summary_{jax_process}.json")
  script = tmp_path / "worker.py"
  config = _write_config(tmp_path, 2, schedule, chance, method)
  script.write_text(
    WORKER.format(root=str(ROOT), config=str(config), workdir=str(workdir), out=out)
  )
  procs = _launch([sys.executable, str(script)], tmp_path)
  try:
    for proc in procs:
      proc.wait(timeout=420)
    gone = [_group_gone(proc.pid) for proc in procs]  # before cleanup kills stragglers
  finally:
    _cleanup(procs)
  for p, proc in enumerate(procs):
    assert proc.returncode == 0, f"process {p}:\n{_log(tmp_path, p)[-4000:]}"
  assert gone == [True, True], "a process left children behind"
  s0, s1 = (json.loads((tmp_path / f"summary_{p}.json").read_text()) for p in range(2))
  assert s0["steps_done"] == s1["steps_done"] == 2
  # Params are replicated over both processes (mesh data=8): equal digests = equal bits.
  assert s0["fingerprints"]["params"] == s1["fingerprints"]["params"]
  assert s0["fingerprints"]["controller"] == s1["fingerprints"]["controller"]
  # A digest of the last step's controller state (16 bytes), not of the params.
  assert re.fullmatch("[0-9a-f]{32}", s0["fingerprints"]["controller"])
  assert s0["fingerprints"]["controller"] != s0["fingerprints"]["params"]
  # One metrics file and one checkpoint set, written by process 0 / collectively.
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in lines] == [1, 2]
  assert any(0 < m["reward_mean"] < 1 for m in lines), "rewards carry no signal"
  assert any(m.get("ada/stopped_fraction", 0) > 0 for m in lines) == (chance > 0)
  assert (workdir / "checkpoints" / "2").is_dir()


@pytest.mark.slow
def test_killed_peer_makes_the_survivor_exit_fast(tmp_path):
  workdir = tmp_path / "run"
  cmd = [
    sys.executable,
    "-m",
    "ada_jax.main",
    f"--config={_write_config(tmp_path, 100)}",
    f"--workdir={workdir}",
  ]
  procs = _launch(cmd, tmp_path)
  try:
    deadline = time.time() + 420
    metrics = workdir / "metrics.jsonl"
    while (not metrics.exists() or not metrics.read_text().strip()) and time.time() < deadline:
      assert procs[0].poll() is None and procs[1].poll() is None, _log(tmp_path, 0)[-3000:]
      time.sleep(0.2)
    assert metrics.exists(), "no RL step finished in time"
    os.kill(procs[1].pid, signal.SIGKILL)  # mid-step: step 2 is running
    killed = time.time()
    procs[0].wait(timeout=120)  # heartbeat timeout is 10 s: well within the bound
    elapsed = time.time() - killed
  finally:
    _cleanup(procs)
  log = _log(tmp_path, 0)
  print(f"survivor exited with {procs[0].returncode} {elapsed:.1f} s after the kill")
  assert procs[0].returncode != 0, log[-3000:]
  assert elapsed < 60, f"survivor took {elapsed:.0f} s to exit"
  # Our message (a failed collective) or JAX's (heartbeat lost), never a silent hang.
  assert "process 0 of 2 stops" in log or "another task died" in log, log[-3000:]
  assert len([json.loads(x) for x in metrics.read_text().splitlines()]) < 100
  assert all(_group_gone(proc.pid) for proc in procs)


# ----------------------------------------------------------------------------- one process


def test_config_from_env():
  c = distributed.DistributedConfig.from_env(
    {
      "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
      "JAX_NUM_PROCESSES": "4",
      "JAX_PROCESS_ID": "3",
      "JAX_LOCAL_DEVICE_IDS": "0,1",
      "ADA_JAX_HEARTBEAT_TIMEOUT_S": "20",
    }
  )
  assert (c.coordinator_address, c.num_processes, c.process_id) == ("10.0.0.1:1234", 4, 3)
  assert c.local_device_ids == (0, 1) and c.heartbeat_timeout_s == 20 and c.mode == "auto"
  assert distributed.DistributedConfig.from_env({}) == distributed.DistributedConfig()
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
    distributed.DistributedConfig.from_env({"JAX_NUM_PROCESSES": "two"})
  with pytest.raises(ValueError, match="process_id"):
    distributed.DistributedConfig.from_env({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"})
  with pytest.raises(ValueError, match="mode"):
    distributed.DistributedConfig(mode="maybe")


def test_initialize_single_process_is_a_no_op():
  # The backend is already up in this test process: 'off' and 'auto' without a cluster
  # must return without touching jax.distributed.
  assert distributed.initialize(distributed.DistributedConfig(mode="off")) is False
  assert jax.process_count() == 1


def test_block_of_covers_every_item_once():
  for n in (0, 1, 5, 8, 9):
    for count in (1, 2, 3):
      covered = np.concatenate(
        [np.arange(n)[distributed.block_of(n, p, count)] for p in range(count)]
      )
      np.testing.assert_array_equal(covered, np.arange(n))


class _ExactPool:
  """A stand-in `Verifier`: reward 1 when the response equals the reference."""

  def __init__(self):
    self.items, self.seen, self.next = {}, [], 0

  def submit(self, responses, references):
    self.seen.append(list(responses))
    first, self.next = self.next, self.next + len(responses)
    for i, (x, y) in enumerate(zip(responses, references, strict=True)):
      self.items[first + i] = float(x == y)
    return np.arange(first, first + len(responses))

  def collect(self, ids):
    return [self.items.pop(int(i)) for i in ids]


def test_shared_grader_and_local_rows_single_process():
  grader = distributed.SharedGrader(_ExactPool())
  np.testing.assert_array_equal(grader.score(["1", "2"], ["1", "3"]), np.array([1, 0], np.float32))
  # Two batches in flight at once come back separately, in submission order or not.
  a, b = grader.submit(["1", "2", "3"], ["1", "2", "0"]), grader.submit(["4"], ["5"])
  np.testing.assert_array_equal(grader.collect(b), [0.0])
  np.testing.assert_array_equal(grader.collect(a), [1.0, 1.0, 0.0])
  assert grader.collect(grader.submit([], [])).shape == (0,)
  with pytest.raises(ValueError, match="2 responses but 1 references"):
    grader.submit(["1", "2"], ["1"])
  mesh = sharding.make_mesh(-1, 1, 1)
  # Every row of an 8-way split is held by this (only) process.
  np.testing.assert_array_equal(sharding.local_rows(16, mesh), np.arange(16))


def test_shared_grader_splits_work_and_reassembles_in_order(monkeypatch):
  # Three simulated processes: each grades only its block; the gathered vector is the full
  # one, in order, whatever the padding of the last block.
  responses = [str(i) for i in range(7)]
  references = [str(i if i % 3 else -1) for i in range(7)]
  expected = np.array([float(a == b) for a, b in zip(responses, references, strict=True)])
  pools, blocks = {}, {}
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 3)
  for p in range(3):
    monkeypatch.setattr(distributed.jax, "process_index", lambda p=p: p)
    monkeypatch.setattr(distributed, "allgather", lambda x, p=p: blocks.setdefault(p, x)[None])
    pools[p] = _ExactPool()
    distributed.SharedGrader(pools[p]).score(responses, references)
  assert [pools[p].seen for p in range(3)] == [[["0", "1", "2"]], [["3", "4", "5"]], [["6"]]]
  gathered = np.stack([blocks[p] for p in range(3)])
  monkeypatch.setattr(distributed, "allgather", lambda x: gathered)
  got = distributed.SharedGrader(_ExactPool()).score(responses, references)
  np.testing.assert_array_equal(got, expected)


def test_fingerprint_and_assert_same():
  a = {"b": np.arange(3, dtype=np.int64), "a": [1.5, None, "x"]}
  b = {"a": [1.5, None, "x"], "b": np.arange(3, dtype=np.int64)}
  assert distributed.fingerprint(a) == distributed.fingerprint(b)
  assert distributed.fingerprint(a) != distributed.fingerprint(
    {"a": [1.5, None, "x"], "b": np.arange(3, dtype=np.int32)}
  )
  assert distributed.fingerprint([0.1 + 0.2]) != distributed.fingerprint([0.3])
  assert distributed.assert_same("x", a) == distributed.fingerprint(a)
  mesh = sharding.make_mesh(-1, 1, 1)
  x = jax.device_put(np.arange(16.0), sharding.batch_sharding(mesh))
  assert distributed.local_fingerprint({"w": x}) == distributed.local_fingerprint(
    {"w": jax.device_put(np.arange(16.0), sharding.batch_sharding(mesh))}
  )
  assert distributed.local_fingerprint({"w": x}) != distributed.local_fingerprint({"w": x + 1})


def test_exit_on_failure_reraises_with_one_process():
  with pytest.raises(KeyError), distributed.exit_on_failure():
    raise KeyError("boom")
