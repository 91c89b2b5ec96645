"""HBM bytes of one decode step under the choices issue 39 weighed, from XLA:TPU (libtpu,
ahead of time on this CPU): the rollout copy's layout (the parameters' own, split over
'fsdp' and 'tensor'; or whole along 'fsdp', split over 'tensor' only, what runs ship) and
decode attention (XLA's pieces, or the Pallas kernel, what TPU runs use), for the paper
configs on their slices, at their slot counts.

  python experiments/decode_roofline.py                      # both configs, about 25 min
  python experiments/decode_roofline.py --configs=llama3b_pos --slots=192,384

Each figure is `plan.programs.decode_step_program`'s: the pool's decode loop compiled with one and
two steps per trip (every slot live, reading its whole cache), VMEM/CMEM prefetching off so
that XLA's cost analysis counts HBM bytes; the ratio holds them against the copy's weights
on a device (an untied input embedding not counted) plus the slot cache. Compiler-derived,
not measured; ICI time (the activations the 'params' layout moves between fsdp devices at
every layer) is in no figure here. Output: a table and JSON
(experiments/results/decode_roofline.json) with the commit and every setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

ARGS = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ARGS.add_argument("--configs", default="llama3b_pos:v5e-8,qwen_math7b_pos:v4-32")
ARGS.add_argument("--slots", default="", help="slot counts (default: each config's own)")
ARGS.add_argument("--out", default="")
ARGS = ARGS.parse_args()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import importlib  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ada_jax import config as config_lib  # noqa: E402
from ada_jax import metrics  # noqa: E402
from ada_jax.models import sharding as sharding_lib  # noqa: E402
from ada_jax.plan import compiler, programs, roofline, targets  # noqa: E402
from ada_jax.rollout import attention as attention_lib  # noqa: E402

SHIPPED_LAYOUT = sharding_lib.rollout_param_shardings
SHIPPED_KERNEL = attention_lib.uses_kernel


def params_layout(config, mesh):
  """The rollout copy on the parameters' own specs (split over 'fsdp' too)."""
  specs = sharding_lib.param_specs(config, mesh, fused=sharding_lib.platform(mesh).fused_layout)
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def measure(cfg, target, devices, slots, layout, kernel):
  sharding_lib.rollout_param_shardings = SHIPPED_LAYOUT if layout == "decode" else params_layout
  attention_lib.uses_kernel = SHIPPED_KERNEL if kernel else (lambda mesh: "")
  model_cfg = programs.model_of(cfg)
  mesh = programs.mesh_for(cfg, devices)
  smp = programs.rollout_sampler(cfg, model_cfg, mesh, slots)
  params = programs.rollout_params(model_cfg, mesh)
  _, (_, state, prompts, *_) = programs.segment_args(smp, params)
  step = programs.decode_step_program(smp, params, state)
  per_device = compiler.per_device_bytes
  kv = programs.live_kv(smp, per_device((state.cache.k, state.cache.v)), per_device(prompts))
  figures = roofline.decode_roofline(model_cfg, target, mesh, smp.slots, kv, step)
  return dataclasses.asdict(figures)


def main():
  start, rows = time.perf_counter(), []
  for item in ARGS.configs.split(","):
    name, _, slice_name = item.partition(":")
    cfg = config_lib.parse(importlib.import_module(f"configs.{name}").get_config())
    target = targets.target(slice_name)
    devices = targets.devices_for(target)
    for slots in [int(s) for s in ARGS.slots.split(",") if s] or [cfg.sampler.chunk_rows]:
      for layout in ("params", "decode"):
        for kernel in (False, True):
          r = measure(cfg, target, devices, slots, layout, kernel)
          r |= {"config": name, "target": slice_name, "layout": layout, "kernel": kernel}
          rows.append(r)
          gb, ratio = r["decode_bytes_per_device"] / 1e9, r["decode_bytes_ratio"]
          print(
            f"[{time.perf_counter() - start:5.0f} s] {name} {slice_name} S={slots} "
            f"layout={layout:<6} kernel={kernel!s:<5} bytes/step {gb:6.2f} GB ratio "
            f"{ratio:.3f} {r['decode_tokens_per_s_per_chip']:7.0f} tokens/s/chip",
            flush=True,
          )
  out = ARGS.out or os.path.join(os.path.dirname(__file__), "results", "decode_roofline.json")
  with open(out, "w") as f:
    json.dump(
      {
        "what": __doc__.split("\n\n")[0],
        "compiler": "XLA:TPU (libtpu " + importlib.metadata.version("libtpu") + ")",
        "git_commit": metrics.git_commit(),
        "jax": jax.__version__,
        "args": vars(ARGS),
        "wall_s": round(time.perf_counter() - start, 1),
        "rows": rows,
      },
      f,
      indent=1,
    )
    f.write("\n")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
