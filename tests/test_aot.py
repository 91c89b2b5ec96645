"""The TPU compiler in the loop: a run's programs compiled by XLA:TPU (libtpu, ahead of
time, no TPU) for a v5e-8, the slot cache kept in place, and the plan command's verdicts.

CI has no TPU; libtpu (requirements-dev.txt) is the compiler. Every figure asserted here
is XLA:TPU's, never XLA:CPU's.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding as sharding_lib
from ada_jax.plan import compiler, programs, targets
from ada_jax.rollout import sampler as sampler_lib

pytest.importorskip("libtpu", reason="libtpu (requirements-dev.txt) is the TPU compiler")
ROOT = pathlib.Path(__file__).resolve().parents[1]
V5E = targets.target("v5e-8")


def _tiny_arith():
  sys.path.insert(0, str(ROOT))
  from configs import tiny_arith_pos

  return tiny_arith_pos.get_config()


@pytest.fixture(scope="module")
def v5e_devices():
  return targets.devices_for(V5E)


def test_targets_name_the_compilers_devices_and_hbm(v5e_devices):
  assert len(v5e_devices) == 8 and v5e_devices[0].device_kind == "TPU v5 lite"
  # The usable HBM in TARGETS is the figure XLA:TPU's own refusal states.
  mesh = jax.sharding.Mesh(np.array(v5e_devices), ("x",))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  too_big = jax.ShapeDtypeStruct((8 * 2**33,), jnp.float32, sharding=sh)  # 32 GiB/device
  with pytest.raises(compiler.OutOfMemory, match=re.escape(f"({V5E.hbm_gib}G)")):
    compiler.compile_program(jax.jit(lambda x: x * 2 + 1), too_big, what="probe")


def _kv_model(**overrides):
  """A small bf16 model whose KV cache, not its weights or logits, is the pool's bulk."""
  fields = dict(
    num_layers=4, embed_dim=256, num_heads=8, num_kv_heads=8, head_dim=128, mlp_dim=512,
    vocab_size=1024, dtype="bfloat16",
  )  # fmt: skip
  return model_lib.preset("tiny-llama", **(fields | overrides))


@pytest.mark.slow
def test_pool_cache_stays_in_place_under_xla_tpu(v5e_devices):
  config = _kv_model()
  mesh = sharding_lib.make_mesh(8, 1, 1, devices=v5e_devices)
  smp = sampler_lib.Sampler(
    config, max_new_tokens=1024, stop_ids=(1,), chunk_rows=64, prompts_per_chunk=8,
    prompt_buckets=(128,), mesh=mesh,
  )  # fmt: skip
  params = programs.abstract_params(config, mesh)
  out = programs.pool_programs(smp, params, what="pool")
  kv = out.slot_cache
  assert kv == 2 * 4 * (64 // 8) * 8 * 1024 * 128 * 2  # bf16 ring K and V per device
  segment = out.segment
  # No second copy of the cache (a scatter's or a transposed layout's): temporaries are a
  # small fraction of it, and the donated cache aliases its output.
  assert segment.temp <= 0.25 * kv, segment.largest
  assert segment.alias >= kv
  assert not any(b["bytes"] >= kv // 8 and "f32" in b["shape"] for b in segment.largest)


@pytest.mark.slow
def test_decode_loop_moves_no_cache_sized_operand_between_devices(v5e_devices):
  """From the TPU HLO text: no all-gather or all-to-all of a KV-cache-sized operand."""
  config = _kv_model(num_kv_heads=4, num_heads=8)
  mesh = sharding_lib.make_mesh(4, 1, 2, devices=v5e_devices)
  smp = sampler_lib.Sampler(
    config, max_new_tokens=512, stop_ids=(1,), chunk_rows=32, prompts_per_chunk=4,
    prompt_buckets=(64,), mesh=mesh,
  )  # fmt: skip
  fns, args = programs.segment_args(smp, programs.abstract_params(config, mesh))
  text = fns.run.lower(*args).compile().as_text()
  layer_shard = (32 // 4) * (4 // 2) * 512 * 128 * 2  # one layer's ring K per device
  dtype_bytes = {"bf16": 2, "f32": 4, "s32": 4, "pred": 1, "u32": 4}
  moved = []
  for m in re.finditer(r"= (\w+)\[([\d,]*)\][^=]*? (all-gather|all-to-all)\(", text):
    dims = [int(d) for d in m.group(2).split(",") if d]
    moved.append(dtype_bytes.get(m.group(1), 4) * int(np.prod(dims)))
  assert all(b < layer_shard for b in moved), sorted(moved)[-3:]


def _plan_cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  return subprocess.run(
    [sys.executable, "-m", "ada_jax.plan", *args], cwd=ROOT, env=env, capture_output=True,
    text=True, timeout=600,
  )  # fmt: skip


def test_plan_command_names_a_mesh_the_slice_cannot_hold_with_exit_2():
  """Found once libtpu made the slice's devices (the other bad flags, before it:
  tests/test_cli_errors.py)."""
  proc = _plan_cli(
    "--config=configs/tiny_arith_pos.py", "--topology=v5e-8", "--config.mesh.tensor=3"
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "config.mesh" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_plan_command_exit_codes(tmp_path):
  """The tiny run on a v5e-8: every program compiles with XLA:TPU and fits (exit 0, the
  JSON's figures); with a 16.9 GiB KV cache per device the sample phase does not (exit 1).
  Bad flags exit 2 before compiling (tests/test_cli_errors.py)."""
  ok = _plan_cli(
    "--config=configs/tiny_arith_pos.py", "--topology=v5e-8", f"--json={tmp_path}/p.json",
    "--nosize_slots",
  )  # fmt: skip
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert "FITS" in ok.stdout
  result = json.loads((tmp_path / "p.json").read_text())
  assert result["device_kind"] == "TPU v5 lite"
  assert set(result["phases"]) == {"train", "sample", "prefill", "eval"}
  assert result["fits"] and all(p["fits"] and p["gib"] > 0 for p in result["phases"].values())
  for name in ("train", "pool_segment", "prefill", "eval_segment"):
    assert result["programs"][name]["peak_gib"] > 0, name
  step = result["programs"]["decode_step"]
  assert step["one_step"]["peak_gib"] > 0 and step["two_steps"]["peak_gib"] > 0
  assert step["bytes_accessed"] > 0
  r = result["roofline"]
  assert r["decode_bytes_ratio"] >= 1.0 and r["slots"] == 256
  assert step["memory_spaces"].keys() <= {"default", "color_6"}
  big = _plan_cli(
    "--config=configs/tiny_arith_pos.py", "--topology=v5e-8",
    f"--config.sampler.chunk_rows={2**21}", f"--json={tmp_path}/big.json", "--nosize_slots",
    "--config.eval.benchmarks=()",
  )  # fmt: skip
  assert big.returncode == 1, big.stderr[-2000:]
  assert "DOES NOT FIT" in big.stdout
  refused = json.loads((tmp_path / "big.json").read_text())
  assert not refused["fits"] and not refused["phases"]["sample"]["fits"]


@pytest.mark.slow
def test_plan_finds_the_largest_slot_count_that_fits(v5e_devices):
  """A bf16 model whose slot cache is the pool's bulk, on a v5e-8 with data 4 x tensor 2:
  the plan's largest rollout slot count fits every phase with the spare, and one
  granule more (compiled here) does not; the roofline at that count says its tokens/s."""
  from ada_jax import config as config_lib
  from ada_jax.plan import verdict
  from ada_jax.rollout import decode_kernel

  c = _tiny_arith()
  c.model.preset, c.model.dtype = "tiny-llama", "bfloat16"
  c.model.overrides = dict(
    num_layers=4, embed_dim=256, num_heads=8, num_kv_heads=8, head_dim=128, mlp_dim=512
  )
  c.tokenizer.dir = ""
  c.sampler.max_new_tokens, c.sampler.prompt_buckets = 8192, (128,)
  c.sampler.chunk_rows, c.eval.benchmarks = 64, ()
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 4, 1, 2
  cfg = config_lib.parse(c)
  result = verdict.plan(cfg, "v5e-8", devices=v5e_devices, progress=lambda line: None)
  sized = result.slots["rollout"]
  granule = 4 * decode_kernel.SLOT_BLOCK
  assert sized.largest > 64 and sized.largest % granule == 0
  assert sized.bytes / targets.GIB + verdict.SPARE_GIB <= V5E.hbm_gib
  assert sized.roofline.slots == sized.largest
  assert sized.roofline.decode_tokens_per_s_per_chip > 0
  mesh = programs.mesh_for(cfg, v5e_devices)
  smp = programs.rollout_sampler(cfg, programs.model_of(cfg), mesh, sized.largest + granule)
  try:
    pool = programs.pool_programs(
      smp, programs.rollout_params(programs.model_of(cfg), mesh), what="pool"
    )
    over = max(pool.segment.peak, pool.prefill.peak + pool.pool_state)
    assert over / targets.GIB + verdict.SPARE_GIB > V5E.hbm_gib
  except compiler.OutOfMemory:
    pass


@pytest.mark.slow
def test_decode_loop_runs_the_kernel_and_gathers_no_weight_under_fsdp(v5e_devices):
  """The TPU segment of a pool on data 2 x fsdp 2 x tensor 2: decode attention is the
  Pallas kernel (a Mosaic custom call in the program), and with the rollout copy whole
  along 'fsdp' no weight-sized operand is all-gathered in the loop."""
  config = _kv_model(num_kv_heads=4, num_heads=8, embed_dim=1024, mlp_dim=2048)
  mesh = sharding_lib.make_mesh(2, 2, 2, devices=v5e_devices)
  smp = sampler_lib.Sampler(
    config, max_new_tokens=512, stop_ids=(1,), chunk_rows=32, prompts_per_chunk=4,
    prompt_buckets=(128,), mesh=mesh,
  )  # fmt: skip
  fns, args = programs.segment_args(smp, programs.rollout_params(config, mesh))
  text = fns.run.lower(*args).compile().as_text()
  assert 'custom_call_target="tpu_custom_call"' in text
  weight = 1024 * 2048 * 2 // 2  # one MLP weight's bytes per device (bf16, split over tensor)
  dtype_bytes = {"bf16": 2, "f32": 4, "s32": 4, "pred": 1, "u32": 4}
  gathered = []
  for m in re.finditer(r"= (\w+)\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", text):
    dims = [int(d) for d in m.group(2).split(",") if d]
    gathered.append(dtype_bytes.get(m.group(1), 4) * int(np.prod(dims)))
  assert all(b < weight // 4 for b in gathered), sorted(gathered)[-3:]
