"""Run-state checkpoints: exact round trip, keep-last-k, resume order, SIGTERM / Ctrl-C,
kill -9."""

import dataclasses
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time
import types

import flax
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from ada_jax import checkpoint, checksums, runstate, saved_params, start
from ada_jax.config import ConfigError
from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding
from ada_jax.rl import train

CONFIG = model_lib.preset("tiny-llama")
TRAIN = train.TrainConfig()
REPO = pathlib.Path(__file__).resolve().parents[1]


def _state(mesh, shift=0.0, ref=False):
  """A train state whose every leaf differs from a fresh one (moments, counts, params)."""
  params = model_lib.init_params(CONFIG, jax.random.key(0))
  state = train.init_train_state(CONFIG, TRAIN, params, mesh, ref_params=params if ref else None)
  bump = lambda x: x + (shift + 0.25) if jnp.issubdtype(x.dtype, jnp.floating) else x + 3
  return jax.tree.map(bump, state)


def _est(size, seed=0):
  rng = np.random.default_rng(seed)
  return {
    "keys": np.sort(rng.integers(-(2**62), 2**62, size)).astype(np.int64),
    "pos": rng.random(size) * 5,
    "tot": rng.random(size) * 9 + 1 / 3,
  }


def _assert_tree_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_is_exact_and_keeps_last_k(tmp_path, async_save):
  mesh = sharding.make_mesh(2, 2, 2)
  manager = checkpoint.make_manager(
    tmp_path / "ckpt", checkpoint.CheckpointConfig(keep=2, async_save=async_save)
  )
  gen = np.random.default_rng(7)
  gen.random(5)
  saved = {}
  for step, size in [(1, 0), (2, 3), (3, 5)]:  # Est state grows between saves, from empty
    run = checkpoint.RunState(
      train=_state(mesh, shift=step),
      rng=jax.random.split(jax.random.key(step))[1],
      method_state=_est(size, step),
      host={"rl_step": step, "data_pos": 10 * step, "gen": runstate.generator_state(gen)},
    )
    assert checkpoint.save(manager, step, run)
    saved[step] = run
    if step == 1:  # the empty Est state round-trips too (before keep=2 deletes step 1)
      manager.wait_until_finished()
      back = checkpoint.restore(manager, train.abstract_state(CONFIG, TRAIN, mesh), 1)
      keys = back.method_state["keys"]
      assert keys.shape == (0,) and keys.dtype == np.int64
  assert not checkpoint.save(manager, 3, saved[3])  # already there: no second write
  checkpoint.close(manager)

  manager = checkpoint.make_manager(tmp_path / "ckpt")
  assert manager.all_steps() == [2, 3] and manager.latest_step() == 3
  target = train.abstract_state(CONFIG, TRAIN, mesh)
  for step in (2, 3):
    back = checkpoint.restore(manager, target, step)
    want = saved[step]
    _assert_tree_equal(back.train, want.train)
    shard = lambda t: jax.tree.map(lambda x: x.sharding, t)
    assert shard(back.train) == shard(target)
    assert back.rng.dtype == want.rng.dtype  # a typed key with its impl
    np.testing.assert_array_equal(jax.random.key_data(back.rng), jax.random.key_data(want.rng))
    assert back.method_state.keys() == want.method_state.keys()
    for name in want.method_state:
      assert back.method_state[name].dtype == want.method_state[name].dtype
      np.testing.assert_array_equal(back.method_state[name], want.method_state[name])
    assert back.host["rl_step"] == step and back.host["data_pos"] == 10 * step
  restored_gen = runstate.generator_from_state(back.host["gen"])
  np.testing.assert_array_equal(restored_gen.random(4), gen.random(4))
  assert checkpoint.restore(manager, target).host["rl_step"] == 3  # default: latest
  with pytest.raises(FileNotFoundError, match="no checkpoint 1"):
    checkpoint.restore(manager, target, 1)
  with pytest.raises(ValueError, match="reference params"):
    checkpoint.restore(manager, train.abstract_state(CONFIG, TRAIN, mesh, with_ref=True))
  manager.close()


def test_reference_params_and_no_est(tmp_path):
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  run = checkpoint.RunState(train=_state(mesh, ref=True), rng=jnp.asarray([1, 2], jnp.uint32))
  manager = checkpoint.make_manager(tmp_path)
  checkpoint.save(manager, 4, run)
  back = checkpoint.restore(manager, train.abstract_state(CONFIG, TRAIN, mesh, with_ref=True))
  _assert_tree_equal(back.train, run.train)
  assert back.method_state is None and back.host == {}
  np.testing.assert_array_equal(back.rng, [1, 2])  # a raw uint32 key stays raw
  manager.close()


@flax.struct.dataclass
class _Books:
  gave_up: np.ndarray
  per_prompt: dict
  seen: int


def test_a_rules_typed_state_round_trips_and_an_old_est_item_restores(tmp_path):
  """A rule's state of any pytree type comes back as its state dict (`Rule.restore_state`
  rebuilds the type); a checkpoint written when Est's statistics were item `est` restores
  them as the same dict."""
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  books = _Books(
    gave_up=np.asarray(3), per_prompt={"keys": np.zeros(0, np.int64), "w": np.ones((2, 3))}, seen=7
  )
  run = checkpoint.RunState(
    train=_state(mesh), rng=jnp.asarray([1, 2], jnp.uint32), method_state=books
  )
  manager = checkpoint.make_manager(tmp_path / "new")
  checkpoint.save(manager, 1, run)
  back = checkpoint.restore(manager, train.abstract_state(CONFIG, TRAIN, mesh))
  again = flax.serialization.from_state_dict(books, back.method_state)
  _assert_tree_equal(again, books)
  assert again.per_prompt["keys"].dtype == np.int64 and again.per_prompt["w"].shape == (2, 3)
  manager.close()

  est = _est(4, 1)
  old = checkpoint.make_manager(tmp_path / "old")
  state = run.train
  old.save(1, args=ocp.args.Composite(
    params=ocp.args.StandardSave(state.params),
    opt=ocp.args.StandardSave({"step": state.step, "opt_state": state.opt_state}),
    rng=ocp.args.StandardSave({"key": np.asarray([1, 2], np.uint32)}),
    host=ocp.args.JsonSave({"user": {}, "rng_impl": None, "est_size": 4, "has_ref": False}),
    est=ocp.args.StandardSave({k: np.append(v, v.dtype.type(0)) for k, v in est.items()}),
  ))  # fmt: skip
  old.wait_until_finished()
  back = checkpoint.restore(old, train.abstract_state(CONFIG, TRAIN, mesh))
  assert back.method_state.keys() == est.keys()
  for name, want in est.items():
    assert back.method_state[name].dtype == want.dtype
    np.testing.assert_array_equal(back.method_state[name], want)
  old.close()


def test_fresh_start_order(tmp_path):
  """A fresh run's start (`start.initial_state`, when its own directory holds no checkpoint
  for `loop` to resume from): 1. `init_from`; 2. pretrained weights; 3. random init (the
  run's init key)."""
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  target = train.abstract_state(CONFIG, TRAIN, mesh)
  root = jax.random.key(0)
  fresh_params = model_lib.init_params(CONFIG, runstate.run_keys(root).init)
  other = checkpoint.make_manager(tmp_path / "other")
  other_run = checkpoint.RunState(
    train=_state(mesh, shift=1.0), rng=jax.random.key(5), host={"rl_step": 9}
  )
  checkpoint.save(other, 9, other_run)
  other.close()
  hf = tmp_path / "hf"
  saved_params.export_hf(CONFIG, jax.tree.map(lambda x: x * 2, fresh_params), hf)

  def initial(init_from="", pretrained=None):
    cfg = types.SimpleNamespace(
      seed=0, ckpt=types.SimpleNamespace(init_from=init_from), warmstart=None, train=TRAIN
    )
    return start.initial_state(
      cfg, target, CONFIG, None, mesh, model_dir=pretrained, host={"rl_step": 0}
    )

  # 1. init_from (over pretrained weights): another run's params, fresh optimizer and step.
  run, source = initial(init_from=str(tmp_path / "other"), pretrained=str(hf))
  assert source.startswith("init_from:") and int(run.train.step) == 0
  assert run.host == {"rl_step": 0}
  _assert_tree_equal(run.train.params, other_run.train.params)
  # A step that was never saved: the error names the field and lists the saved steps.
  with pytest.raises(FileNotFoundError, match=r"config\.ckpt\.init_from: .*holds steps \[9\]"):
    initial(init_from=str(tmp_path / "other" / "5"))
  # 2. pretrained Hugging Face weights (the exported folder), on the target shardings.
  run, source = initial(pretrained=str(hf))
  assert source == f"pretrained:{hf}"
  _assert_tree_equal(run.train.params, jax.tree.map(lambda x: x * 2, fresh_params))
  # 3. from scratch: the init key of the config's seed.
  run, source = initial()
  assert source == "scratch"
  _assert_tree_equal(run.train.params, fresh_params)
  np.testing.assert_array_equal(jax.random.key_data(run.rng), jax.random.key_data(root))
  with pytest.raises(
    ConfigError, match=r"config\.model\.hf_dir: .*no_such_weights: no such folder"
  ):
    initial(pretrained=str(tmp_path / "no_such_weights"))
  with pytest.raises(FileNotFoundError, match="init_from"):
    initial(init_from=str(tmp_path / "no_checkpoints"))


def test_init_from_bf16_params_restores_them_upcast_with_one_warning(tmp_path, caplog):
  """A checkpoint of bfloat16 params (a run from before `model.param_dtype`) restores onto a
  float32 target exactly upcast, with one warning line naming the folder and the dtypes."""
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  params = model_lib.init_params(CONFIG, jax.random.key(3))
  old = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  saved_params.save_params(tmp_path, old)
  target = sharding.abstract_params(CONFIG, mesh)
  with caplog.at_level(logging.WARNING):
    got = saved_params.restore_params(tmp_path, target)
  _assert_tree_equal(got, jax.tree.map(lambda x: x.astype(jnp.float32), old))
  lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(lines) == 1 and "stored in bfloat16, restored cast to float32" in lines[0]
  assert "\n" not in lines[0]
  caplog.clear()
  saved_params.restore_params(
    tmp_path, jax.tree.map(lambda t: t.update(dtype=jnp.bfloat16), target)
  )
  assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_run_keys_are_one_split_of_the_root():
  root = jax.random.key(3)
  keys = runstate.run_keys(root)
  split = jax.random.split(root, 3)
  for i, k in enumerate((keys.init, keys.rollout, keys.eval)):
    np.testing.assert_array_equal(jax.random.key_data(k), jax.random.key_data(split[i]))
  assert len({tuple(np.asarray(jax.random.key_data(k)).tolist()) for k in split}) == 3


def test_bad_config_names_the_field():
  with pytest.raises(ValueError, match="CheckpointConfig.keep"):
    checkpoint.CheckpointConfig(keep=0)
  with pytest.raises(ValueError, match="unknown bit_generator"):
    runstate.generator_from_state({"bit_generator": "NoSuchGen"})


# A worker process: saves steps in a tight loop (params = base + step); SIGTERM makes it
# save the current step and stop at the next step boundary.
_WORKER = textwrap.dedent("""
  import sys, time
  import jax
  from ada_jax import checkpoint, runstate
  from ada_jax.models import decoder as model
  from ada_jax.models import sharding
  from ada_jax.rl import train
  config = model.preset("tiny-llama")
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  base = model.init_params(config, jax.random.key(0))
  manager = checkpoint.make_manager(sys.argv[1])
  every = int(sys.argv[2])
  state = train.init_train_state(config, train.TrainConfig(), base, mesh)
  step = 0
  with runstate.stop_signals() as stop:
    print("ready", flush=True)
    while True:
      step += 1
      time.sleep(0.01)  # the "training" of one step
      run = checkpoint.RunState(
        train=state.replace(params=jax.tree.map(lambda x: x + step, base)),
        rng=jax.random.key(step), host={"rl_step": step})
      if runstate.stop_requested(stop):
        checkpoint.save(manager, step, run)
        checkpoint.close(manager)
        print("preempted", step, flush=True)
        break
      if step % every == 0:
        checkpoint.save(manager, step, run)
        print("saved", step, flush=True)
""")


def _start_worker(tmp_path, every):
  script = tmp_path / "worker.py"
  script.write_text(_WORKER)
  env = dict(os.environ, PYTHONPATH=str(REPO))
  log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 (the process owns it)
  return subprocess.Popen(
    [sys.executable, str(script), str(tmp_path / "ckpt"), str(every)],
    stdout=subprocess.PIPE,
    stderr=log,
    text=True,
    env=env,
  )


def _restored_step(tmp_path):
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  manager = checkpoint.make_manager(tmp_path / "ckpt")
  run = checkpoint.restore(manager, train.abstract_state(CONFIG, TRAIN, mesh))
  manager.close()
  step = run.host["rl_step"]
  base = model_lib.init_params(CONFIG, jax.random.key(0))
  _assert_tree_equal(run.train.params, jax.tree.map(lambda x: x + step, base))
  np.testing.assert_array_equal(
    jax.random.key_data(run.rng), jax.random.key_data(jax.random.key(step))
  )
  return step


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_stop_signal_saves_and_exits_zero(tmp_path, sig):
  proc = _start_worker(tmp_path, every=10_000)  # no periodic save: only the stop one
  assert proc.stdout.readline().strip() == "ready"
  time.sleep(0.5)
  proc.send_signal(sig)
  out, _ = proc.communicate(timeout=120)
  log = (tmp_path / "worker.log").read_text()[-3000:]
  assert proc.returncode == 0, log
  assert out.strip().startswith("preempted"), (out, log)
  step = int(out.split()[-1])
  assert _restored_step(tmp_path) == step


def test_stop_signals_restores_the_previous_handlers():
  """After the block a Ctrl-C interrupts again (e.g. a notebook kernel's interrupt)."""
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  with runstate.stop_signals() as stop:
    assert signal.getsignal(signal.SIGINT) is not before[0]
    signal.raise_signal(signal.SIGINT)  # the first one only asks to stop
    assert stop.is_set() and stop.signal_name == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
      signal.raise_signal(signal.SIGINT)  # the second one interrupts
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_stop_request_names_the_first_signal():
  with runstate.stop_signals() as stop:
    assert stop.signal_name is None
    signal.raise_signal(signal.SIGTERM)
    signal.raise_signal(signal.SIGTERM)
    assert stop.is_set() and stop.signal_name == "SIGTERM"


def test_kill_9_mid_save_leaves_the_last_complete_checkpoint(tmp_path):
  proc = _start_worker(tmp_path, every=1)  # saving nearly all the time
  assert proc.stdout.readline().strip() == "ready"
  saved = []
  while len(saved) < 4:
    saved.append(int(proc.stdout.readline().split()[1]))
  time.sleep(0.03)
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  step = _restored_step(tmp_path)  # a complete checkpoint, never a torn one
  assert step >= saved[-1]
  manager = checkpoint.make_manager(tmp_path / "ckpt")  # and the run can go on saving
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  checkpoint.save(manager, step + 1, checkpoint.RunState(train=_state(mesh), rng=jax.random.key(0)))
  assert manager.latest_step() == step + 1
  manager.close()


# ----------------------------------------------------------------------------- bad files


def _largest_file(folder):
  return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _truncate(step_dir):
  f = _largest_file(step_dir / "params")
  f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  return "params", "OUT_OF_RANGE|not valid"


def _garbage(step_dir, seed=0):
  """Random bytes over the middle of the largest params file. Depending on where they
  land (which moves with the file's layout), the read fails with a decode error or decodes
  to values with NaN or infinity among them; either way the checkpoint is skipped."""
  f = _largest_file(step_dir / "params")
  data = bytearray(f.read_bytes())
  lo, hi = len(data) // 4, len(data) // 2
  data[lo:hi] = np.random.default_rng(seed).bytes(hi - lo)
  f.write_bytes(bytes(data))
  return "params", "Error|error|NaN or infinity in"


def _garbage_1(step_dir):
  return _garbage(step_dir, seed=1)


def _no_params(step_dir):
  import shutil

  shutil.rmtree(step_dir / "params")
  return "params", "missing"


def _no_rng(step_dir):
  import shutil

  shutil.rmtree(step_dir / "rng")
  return "rng", "missing"


def _bad_host(step_dir):
  (step_dir / "host" / "metadata").write_bytes(b"\x00garbage{")
  return "host", "JSONDecodeError"


def _nan_params(step_dir):
  """Values that decode but are NaN (what garbage in an uncompressed chunk reads as)."""
  import shutil

  import orbax.checkpoint as ocp

  with ocp.StandardCheckpointer() as c:
    params = c.restore(step_dir / "params")
    shutil.rmtree(step_dir / "params")
    c.save(step_dir / "params", jax.tree.map(lambda x: np.asarray(x) * np.nan, params))
  return "params", "NaN or infinity in"


def _rewrite(step_dir, item, change):
  import shutil

  import orbax.checkpoint as ocp

  with ocp.StandardCheckpointer() as c:
    tree = c.restore(step_dir / item)
    shutil.rmtree(step_dir / item)
    c.save(step_dir / item, change(tree))


def _finite_params(step_dir):
  """Garbage that decodes to finite values: one element of one param moved by 1e-3."""

  def change(params):
    leaves, treedef = jax.tree.flatten(params)
    first = np.array(leaves[0])
    first.flat[0] += 1e-3
    return jax.tree.unflatten(treedef, [first, *leaves[1:]])

  _rewrite(step_dir, "params", change)
  return "params", r"checksum mismatch in \[.*\]: the bytes changed"


def _finite_opt(step_dir):
  """The same in an Adam moment: finite, plausible, not what was saved."""
  _rewrite(step_dir, "opt", lambda opt: jax.tree.map(lambda x: np.asarray(x) * 0.5, opt))
  return "opt", "checksum mismatch in"


CORRUPTIONS = [_truncate, _garbage, _garbage_1, _no_params, _no_rng, _bad_host, _nan_params]
CORRUPTIONS += [_finite_params, _finite_opt]


def _saved_run(tmp_path, steps=(1, 2, 3)):
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  manager = checkpoint.make_manager(tmp_path / "ckpt", checkpoint.CheckpointConfig(keep=5))
  for step in steps:
    run = checkpoint.RunState(train=_state(mesh, shift=step), rng=jax.random.key(step))
    checkpoint.save(manager, step, dataclasses.replace(run, host={"step": step}))
  checkpoint.close(manager)
  return mesh, train.abstract_state(CONFIG, TRAIN, mesh)


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_resume_skips_an_unreadable_checkpoint_naming_it(tmp_path, corrupt, caplog):
  """The latest checkpoint that restores is used; the skipped one is named with its file
  and why, set aside as `<step>.unreadable` (nothing deleted), and the run saves that step
  again."""
  mesh, target = _saved_run(tmp_path)
  item, why = corrupt(tmp_path / "ckpt" / "3")
  manager = checkpoint.make_manager(tmp_path / "ckpt")
  with caplog.at_level("WARNING"):
    run, step = checkpoint.restore_latest(manager, target)
  assert step == 2 and run.host == {"step": 2}
  warning = " ".join(r.getMessage() for r in caplog.records)
  assert f"checkpoint 3 does not restore: {tmp_path / 'ckpt' / '3' / item}" in warning
  assert re.search(why, warning) and "3.unreadable" in warning
  assert (tmp_path / "ckpt" / "3.unreadable").is_dir() and manager.all_steps() == [1, 2]
  state = checkpoint.RunState(train=_state(mesh), rng=jax.random.key(0), host={"step": 3})
  assert checkpoint.save(manager, 3, state)
  checkpoint.close(manager)


def test_no_readable_checkpoint_is_one_line_naming_step_and_file(tmp_path):
  _, target = _saved_run(tmp_path, steps=(4,))
  _no_params(tmp_path / "ckpt" / "4")
  manager = checkpoint.make_manager(tmp_path / "ckpt")
  with pytest.raises(checkpoint.UnreadableCheckpoint) as e:
    checkpoint.restore_latest(manager, target)
  assert (
    str(e.value) == f"checkpoint 4 does not restore: {tmp_path / 'ckpt' / '4' / 'params'}: missing"
  )
  assert (tmp_path / "ckpt" / "4").is_dir()  # nothing set aside when nothing is left


def test_a_full_disk_is_one_line_and_leaves_no_temporary_folder(tmp_path, monkeypatch):
  import errno

  from orbax.checkpoint._src.handlers import json_checkpoint_handler

  async def no_space(self, x, directory):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))

  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  manager = checkpoint.make_manager(tmp_path / "ckpt")
  run = checkpoint.RunState(train=_state(mesh), rng=jax.random.key(0), host={"step": 1})
  checkpoint.save(manager, 1, run)
  monkeypatch.setattr(json_checkpoint_handler.JsonCheckpointHandler, "_save_fn", no_space)
  with pytest.raises(checkpoint.DiskFullError) as e:
    checkpoint.save(manager, 2, run)
  text = str(e.value)
  assert f"no space left on device for a checkpoint in {tmp_path / 'ckpt'}" in text
  assert re.search(r"needs about [\d.]+ MiB \(\d+ bytes\)", text) and "\n" not in text
  assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1"]
  monkeypatch.undo()
  manager.close()


def test_checksums_cover_every_kind_of_leaf_and_see_one_bit():
  """bool (optax's apply_if_finite), a typed PRNG key, bf16, int and empty leaves all sum;
  one flipped bit of any leaf changes its pair."""
  tree = {
    "b": jnp.array([True, False, True]),
    "k": jax.random.key(3),
    "h": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3),
    "i": jnp.arange(4, dtype=jnp.int32),
    "e": jnp.zeros((0, 2)),
  }
  sums = checksums.of(tree)
  assert set(sums) == {"['b']", "['k']", "['h']", "['i']", "['e']"}
  flipped = dict(tree, i=tree["i"].at[2].set(tree["i"][2] ^ 1), b=tree["b"].at[1].set(True))
  again = checksums.of(flipped)
  assert again["['i']"] != sums["['i']"] and again["['b']"] != sums["['b']"]
  assert again["['h']"] == sums["['h']"]
  # Swapping two elements keeps the plain sum but not the position-weighted one.
  swapped = checksums.of(dict(tree, i=tree["i"][::-1]))["['i']"]
  assert swapped[0] == sums["['i']"][0] and swapped[1] != sums["['i']"][1]
