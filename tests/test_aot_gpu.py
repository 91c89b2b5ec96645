"""The GPU compiler in the loop: a run's programs compiled by XLA:GPU (the CUDA plugin,
ahead of time, compile-only devices, no GPU) for H100 and H200 hosts, and the plan
command's verdicts on them.

CI has no GPU; jax-cuda12-plugin with ptxas (requirements-dev.txt) is the compiler. Every
figure asserted here is XLA:GPU's, never XLA:CPU's.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from ada_jax import config as config_lib
from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding as sharding_lib
from ada_jax.plan import compiler, programs, targets
from ada_jax.rollout import sampler as sampler_lib

pytest.importorskip("jax_plugins.xla_cuda12", reason="jax-cuda12-plugin (requirements-dev.txt)")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_aot import _kv_model, _tiny_arith  # noqa: E402  (the TPU tests' config and model)


@pytest.mark.parametrize(
  "name, devices, hosts, kind, gib",
  [
    ("h200x1", 1, 1, "NVIDIA H200 141GB HBM3e", 141.0),
    ("h100x8", 8, 1, "NVIDIA H100 80GB HBM3", 79.11),
    ("h100x16", 16, 2, "NVIDIA H100 80GB HBM3", 79.11),
  ],
)
def test_gpu_targets_give_the_compilers_devices(name, devices, hosts, kind, gib):
  t = targets.target(name)
  got = targets.devices_for(t)
  assert len(got) == devices and {d.device_kind for d in got} == {kind}
  assert {d.platform for d in got} == {"gpu"} and t.platform == "gpu"
  assert len({d.process_index for d in got}) == hosts  # one process per host
  assert t.hbm_gib == gib and t.usable_gib(0.75) == pytest.approx(0.75 * gib)
  assert targets.target("v5e-8").usable_gib(0.75) == targets.target("v5e-8").hbm_gib  # TPU: whole


def _keep_texts(monkeypatch) -> list[str]:
  """The HLO text of every program `plan.compiler` compiles from here on, in order."""
  texts = []
  compile_ = compiler._compile

  def keep_text(fn, *args, **kw):
    compiled = compile_(fn, *args, **kw)
    texts.append(compiled.as_text())
    return compiled

  monkeypatch.setattr(compiler, "_compile", keep_text)
  return texts


def test_eight_gpu_train_step_all_reduces_the_gradients(monkeypatch):
  """Data parallel over 8 GPUs: each device's gradients are summed across the 8 (an
  all-reduce in XLA:GPU's program), so every replica applies the same update."""
  texts = _keep_texts(monkeypatch)
  cfg = config_lib.parse(_tiny_arith())
  mesh = programs.mesh_for(cfg, targets.devices_for(targets.target("h100x8")))
  assert mesh.shape["data"] == 8
  program = programs.train_program(cfg, programs.model_of(cfg), mesh).program
  (text,) = texts
  # XLA:GPU's async all-reduce over all 8 devices (its replica groups printed as a mesh).
  assert "all-reduce-start(" in text and "replica_groups=mesh['axis_0'=8" in text
  assert program.peak > 0 and 'custom_call_target="__cublas' in text  # XLA:GPU's gemms


@pytest.mark.slow
def test_pool_cache_stays_in_place_under_xla_gpu(monkeypatch):
  """The slot cache is updated in place by XLA:GPU too: before the pool ran its idle decode
  steps outside a `lax.cond` (`slots.in_place_under_cond`) and copied one prompt-cache entry
  per refill out of the sharded prompt cache, the segment's temporaries were 1.05x the
  cache (the slots now hold only their rings). Under
  FSDP the decode loop moves no weight between GPUs: the rollout copy is whole along 'fsdp'
  (`sharding.rollout_param_shardings`; from the masters' layout XLA:GPU all-gathered the
  output table inside the loop), and no `[rows, V]` logits (drawn per vocabulary slice)."""
  config = _kv_model()
  mesh = sharding_lib.make_mesh(2, 2, 2, devices=targets.devices_for(targets.target("h100x8")))
  smp = sampler_lib.Sampler(
    config, max_new_tokens=2048, stop_ids=(1,), chunk_rows=64, prompts_per_chunk=8,
    prompt_buckets=(128,), mesh=mesh,
  )  # fmt: skip
  texts = _keep_texts(monkeypatch)
  out = programs.pool_programs(smp, programs.rollout_params(config, mesh), what="pool")
  kv, segment = out.slot_cache, out.segment
  assert kv == 2 * 4 * (64 // 4) * (8 // 2) * 2048 * 128 * 2  # bf16 K, V rings per device
  assert segment.temp <= 0.25 * kv, segment.largest
  assert segment.alias >= kv  # the donated cache is the output's
  (run,) = [t for t in texts if "jit(run_segment)" in t]
  gathered = set()
  for m in re.finditer(r"= (.*?) all-gather-done\(", run):
    gathered |= set(re.findall(r"\w+\[[\d,]+\]", m.group(1)))
  weights = {
    f"bf16[{','.join(map(str, x.shape))}]" for x in jax.tree.leaves(model_lib.param_shapes(config))
  }
  assert gathered, "expected the pool's row and prompt-cache gathers in the program"
  assert not gathered & weights, sorted(gathered & weights)
  # Tokens are drawn from the vocab-sharded logits (`SamplingRule.draw` with the mesh).
  assert not [g for g in gathered if g.endswith(f",{config.vocab_size}]")], sorted(gathered)


def _plan_cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, "-m", "ada_jax.plan", "--config=configs/tiny_arith_pos.py", *args],
    cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
  )  # fmt: skip


@pytest.mark.slow
def test_plan_command_on_eight_h100s(tmp_path):
  """The tiny run compiles for an 8-GPU host and fits; the JSON names target and commit.
  (The slot-count search is the TPU test's, tests/test_aot.py: the same code.)"""
  ok = _plan_cli("--topology=h100x8", f"--json={tmp_path}/p.json", "--nosize_slots")
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert "with XLA:GPU" in ok.stdout and "FITS" in ok.stdout
  result = json.loads((tmp_path / "p.json").read_text())
  assert result["device_kind"] == "NVIDIA H100 80GB HBM3" and result["mesh"]["data"] == 8
  assert result["git_commit"] and result["config"]["model"]["preset"]
  assert set(result["phases"]) == {"train", "sample", "prefill", "eval"}
  assert result["fits"] and all(p["fits"] and p["gib"] > 0 for p in result["phases"].values())
  target = result["target"]
  assert target["name"] == "h100x8" and target["usable_gib"] == pytest.approx(0.75 * 79.11)
  # The verdict is the plan's (XLA:GPU never refuses): spare = usable - the phase.
  for p in result["phases"].values():
    assert p["spare_gib"] == pytest.approx(target["usable_gib"] - p["gib"], abs=1e-3)
  assert "never refuses" in " ".join(result["notes"])
  # No cost analysis on GPU: the decode step's optimized HLO, walked (`plan.hlo_walk`).
  roofline = result["roofline"]
  assert "optimized HLO" in roofline["what"] and "flops" not in str(roofline)
  assert roofline["kernels_per_step"] > 0 and roofline["decode_bytes_ratio"] > 1
