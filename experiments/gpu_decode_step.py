"""One decode step of the slot pool as XLA:GPU compiles it (the CUDA plugin, ahead of time,
compile-only devices, no GPU): HBM bytes and kernel launches per step, read from the
optimized HLO (`ada_jax/plan/hlo_walk.py`), at the accelerator check's decode shape
(Qwen2.5-Math-1.5B in bf16, one prompt bucket of 512 tokens, 256 new, every slot live and
reading its whole cache) on one H200, at 64 / 256 / 1,024 slots: issue 51's figures.
Two programs per slot count: the plan's decode step (`programs.decode_step_program`: one
`draw_and_decode` per loop trip, the roofline's) and the pool's segment as it runs (one
trip of its loop: a decode step with the pool's bookkeeping, its refill and its attention
window under conditionals, each counted at its largest branch: an upper bound).

  python experiments/gpu_decode_step.py                 # about 1 min (wall_s 51.7 at 64b3d19)
  python experiments/gpu_decode_step.py --slots=64 --target=h100x1

Compiler-derived, not measured: every byte counted is counted as an HBM byte (no L2), and
the live KV is the whole slot cache. `experiments/accelerator_check.py` measures the same
shape on a lent card. Output: a table and JSON (`results/gpu_decode_step_<target>.json`)
with the commit, the versions, the shapes and per slot count the walk (bytes, the ratio to
weights + KV, kernels by kind, conditionals, the largest byte movers).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import pathlib
import sys
import time

ARGS = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ARGS.add_argument("--target", default="h200x1", help="a one-GPU host: h200x1 or h100x1")
ARGS.add_argument("--slots", default="64,256,1024")
ARGS.add_argument("--out", default="")
ARGS = ARGS.parse_args()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import jax  # noqa: E402
from accelerator_check import FULL  # noqa: E402  (the check's decode shape)

from ada_jax import metrics  # noqa: E402
from ada_jax.models import sharding as sharding_lib  # noqa: E402
from ada_jax.models import weights  # noqa: E402
from ada_jax.plan import compiler, hlo_walk, programs, roofline, targets  # noqa: E402
from ada_jax.rollout import sampler as sampler_lib  # noqa: E402


def main():
  target = targets.target(ARGS.target)
  if target.devices != 1 or target.traits.decode_traffic != "optimized HLO":
    raise SystemExit(f"--target={ARGS.target}: expected a one-GPU host (h200x1, h100x1)")
  mesh = sharding_lib.make_mesh(1, 1, 1, devices=targets.devices_for(target))
  cfg = weights.ModelSpec(preset=FULL.model, dtype="bfloat16").model_config()
  params = programs.rollout_params(cfg, mesh)
  start, rows = time.perf_counter(), []
  for slots in [int(s) for s in ARGS.slots.split(",") if s]:
    spec = dataclasses.replace(FULL.sampler_spec(slots), prompts_per_chunk=FULL.prompts_for(slots))
    smp = sampler_lib.Sampler.from_spec(
      cfg, spec, stop_ids=(cfg.vocab_size,), rows_per_prompt=FULL.rows_per_prompt, mesh=mesh
    )
    fns, args = programs.segment_args(smp, params)
    state = args[1]
    step = programs.decode_step_program(smp, params, state)
    segment = compiler.compile_program(fns.run, *args, what="segment", keep_hlo=True)
    seg = hlo_walk.walk_loop(segment.hlo)
    cache = state.cache
    per_device = compiler.per_device_bytes
    kv = programs.live_kv(smp, per_device((cache.k, cache.v)), per_device(args[2]))
    figures = roofline.decode_roofline(cfg, target, mesh, slots, kv, step)
    rows.append({**figures.as_json(), "walk": step.walk.as_json(), "segment_walk": seg.as_json()})
    print(
      f"[{time.perf_counter() - start:4.0f} s] {ARGS.target} S={slots:<5} "
      f"bytes/step {figures.decode_bytes_per_device / 1e9:6.2f} GB "
      f"(weights {figures.decode_weight_bytes / 1e9:.2f} + unique KV {kv[0] / 1e9:.2f}; "
      f"per row {kv[1] / 1e9:.2f}) ratio {figures.decode_bytes_ratio:.3f} "
      f"(per row {figures.decode_bytes_ratio_per_row:.3f}), {step.walk.kernels} kernels "
      f"{step.walk.kinds}; segment trip {seg.bytes / 1e9:.2f} GB, {seg.kernels} kernels, "
      f"{seg.conditionals} conditionals",
      flush=True,
    )
  out = ARGS.out or HERE / "results" / f"gpu_decode_step_{ARGS.target}.json"
  record = {
    "what": __doc__.split("\n\n")[0],
    "compiler": "XLA:GPU (jax-cuda12-plugin "
    + importlib.metadata.version("jax-cuda12-plugin")
    + ", compile-only devices)",
    "git_commit": metrics.git_commit(),
    "jax": jax.__version__,
    "args": vars(ARGS),
    "model": dataclasses.asdict(cfg),
    "shape": {
      "prompt_tokens": FULL.prompt_len,
      "new_tokens": FULL.new_tokens,
      "segment_steps": FULL.segment_steps,
    },
    "wall_s": round(time.perf_counter() - start, 1),
    "rows": rows,
  }
  pathlib.Path(out).write_text(json.dumps(record, indent=1) + "\n")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
