"""Per-device memory of the shipped configs on TPU slices and GPU hosts, from XLA:TPU
(libtpu) or XLA:GPU (the CUDA plugin's compile-only devices), ahead of time.

  python experiments/memory_plan.py --target=v5e-8 --configs=llama3b_pos
  python experiments/memory_plan.py --target=v4-32 --configs=qwen_math7b_pos
  python experiments/memory_plan.py --target=v4-8 --configs=llama3b_pos --set=sampler.chunk_rows=256
  python experiments/memory_plan.py --target=h100x8 --configs=qwen_math7b_pos:h100x8

For each config, `ada_jax.plan.verdict.plan` compiles with the target's compiler, on this CPU with
no accelerator and no weight allocated, every program the run holds in device memory (the
train step, the rollout pool's segment and prefill, the held-out evaluation's pool on the
run's mesh) and, on TPU, one decode step for the roofline, and says per phase whether it
fits with 0.5 GiB to spare (on a GPU, of the card's memory times JAX's allocator fraction,
0.75). `python -m ada_jax.plan` is the same plan for one config as a user command.

Where the compiler is absent (`pip install -r requirements-dev.txt` installs both), the
same programs compile with XLA:CPU on as many fake CPU devices: labelled `XLA:CPU
fallback`, an upper bound for nothing in particular (XLA:CPU computes bf16 in f32 and lays
out and copies buffers differently); every figure the docs quote comes from XLA:TPU or
XLA:GPU.

Output: a table on stdout and JSON (default experiments/results/memory_plan_<target>.json)
naming the git commit, the compiler and each row's full run config.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys


def _parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", default="v5e-8", help="TPU slice or GPU host (targets.TARGETS)")
  parser.add_argument("--configs", default="llama3b_pos", help="config modules under configs/")
  parser.add_argument(
    "--out", default="", help="JSON path (default: results/memory_plan_<target>.json)"
  )
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="GROUP.FIELD=VALUE",
    help="override a config value, e.g. sampler.chunk_rows=256 (repeatable)",
  )
  parser.add_argument(
    "--no_size_slots", action="store_true", help="skip the search for the largest slot counts"
  )
  return parser.parse_args(argv)


ARGS = _parse_args(sys.argv[1:])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64"
  ).strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import importlib  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from ada_jax import config as config_lib  # noqa: E402
from ada_jax import metrics  # noqa: E402
from ada_jax.plan import targets, verdict  # noqa: E402


def load_config(name: str, overrides: list[str]) -> config_lib.RunConfig:
  """configs/<name>.py's `get_config()` (`<name>:<host>`: `get_config(host)`, a GPU host's
  settings) with `--set` overrides, parsed and checked."""
  module, _, host = name.partition(":")
  c = importlib.import_module(f"configs.{module}").get_config(*([host] if host else []))
  for item in overrides:
    key, _, raw = item.partition("=")
    group, _, field = key.partition(".")
    try:
      value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      value = raw
    c[group][field] = value
  return config_lib.parse(c)


def compiler(target: targets.Target) -> tuple[str, list | None]:
  """('XLA:TPU (libtpu <version>)' or 'XLA:GPU (jax-cuda12-plugin <version>)', None), or
  the XLA:CPU fallback's name and its devices."""
  package = target.traits.packages[0]  # the compiler's own: libtpu, jax-cuda12-plugin
  try:
    targets.devices_for(target)
    return f"{target.compiler} ({package} {importlib.metadata.version(package)})", None
  except RuntimeError as e:
    print(f"{package} absent ({e}): XLA:CPU fallback on fake CPU devices", flush=True)
    return "XLA:CPU fallback (not a TPU figure)", jax.devices("cpu")[: target.devices]


def main() -> None:
  t = targets.target(ARGS.target)
  commit = metrics.git_commit()  # the code compiled, whatever is committed meanwhile
  name_of_compiler, devices = compiler(t)
  rows, start = [], time.perf_counter()
  for name in ARGS.configs.split(","):
    cfg = load_config(name, ARGS.set)
    print(f"[{time.perf_counter() - start:6.0f} s] {name} on {t.name}", flush=True)
    result = verdict.plan(
      cfg, t.name, devices=devices, progress=lambda line: print(line, flush=True),
      size_slots=not ARGS.no_size_slots,
    )  # fmt: skip
    print(verdict.report(result), flush=True)
    rows.append({"config": name, "run_config": config_lib.as_dict(cfg)} | result.as_json())
  out = ARGS.out or os.path.join(os.path.dirname(__file__), "results", f"memory_plan_{t.name}.json")
  result = {
    "what": "per-device bytes of every program a run holds in device memory, compiled ahead "
    "of time "
    "on abstract (unallocated) inputs; GiB = 2**30 bytes",
    "compiler": name_of_compiler,
    "target": t.name,
    "overrides": ARGS.set,
    "git_commit": commit,
    "jax": jax.__version__,
    "wall_s": round(time.perf_counter() - start, 1),
    "rows": rows,
  }
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=1, default=str)
    f.write("\n")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
