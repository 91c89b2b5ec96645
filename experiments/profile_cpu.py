"""Where one RL step's time goes on XLA:CPU (issue 55): a `jax.profiler` trace of one RL
step and of one held-out evaluation of a real run (`loop.run`), both after their programs
have compiled, summed per compiled program.

  python experiments/profile_cpu.py [--config=configs/tiny_arith_pos.py] [--model=DIR]
      [--out=experiments/results/profile_cpu_<config>.json]
  python experiments/profile_cpu.py --vs=COMMIT [--alternations=3] [--config=...]
      [--out=experiments/results/profile_cpu_<config>_vs_<COMMIT>.json]

The run is the config's own with 3 RL steps and an evaluation every 2 (DIR: a Hugging Face
folder for a config that loads one, e.g. SmolLM2's). RL step 3 and the evaluation at step 2
are traced; the run stops after RL step 3. For each, per program (`hlo_module`): the
seconds XLA:CPU's threads spent in its operations (the time inside each leaf thunk, summed
over threads), thunks run, and of those the copies and transposes (a thunk whose name says
copy or transpose: XLA:CPU's relayouts), the dots (library matmul calls) and the op kinds
that took the most time (an op's name without its number: `ynn_fusion` the library's
dots, `gather_bitcast_fusion` a gather, `copy_bitcast_fusion` a relayout); beside them
the window's wall seconds and the part of it in which no XLA thread ran an operation (the
host: Python, the driver, grading, transfers). The step's own timers (`time_*_s`) come
from its metrics row. Prints one JSON object (git commit, config, arguments) and writes it
to `--out`.

`--vs=COMMIT`: the same two windows timed without the profiler (`--no_trace`), this tree
against COMMIT's (its code from git, this script beside it), each run its own process,
alternating (`--alternations` pairs, the order flipped every pair): wall seconds per arm,
medians, and the median of the per-pair ratios COMMIT / this (a speed-up above 1).
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib.util
import json
import os
import pathlib
import sys
import tempfile
import time

ARGS = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ARGS.add_argument("--config", default="configs/tiny_arith_pos.py")
ARGS.add_argument("--model", default="", help="Hugging Face folder, for configs that load one")
ARGS.add_argument("--out", default="")
ARGS.add_argument("--vs", default="", metavar="COMMIT", help="time against COMMIT's tree")
ARGS.add_argument("--alternations", type=int, default=3)
ARGS.add_argument("--no_trace", action="store_true", help="time the windows, no profiler")
ARGS = ARGS.parse_args(None if __name__ == "__main__" else [])  # imported: the defaults
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
from jax.profiler import ProfileData  # noqa: E402

from ada_jax import loop, metrics  # noqa: E402

RELAYOUT = ("copy", "transpose")


class _Traced(Exception):
  """Both windows traced: the run stops here."""


# Ops that run other ops: their time is their ops' (counted there), not their own.
CONTAINERS = ("while", "cond", "conditional", "call")


def _leaf_times(plane_lines) -> list[tuple[str, str, int, int]]:
  """(module, op, start ns, ns) of every operation but `CONTAINERS`, on whichever thread ran
  it (XLA's pool, or the client's own for a small program)."""
  out = []
  for line in plane_lines:
    for e in line.events:
      stats = dict(e.stats)
      if "hlo_module" not in stats or e.name.startswith("end:"):
        continue
      if stats["hlo_op"].split(".")[0] not in CONTAINERS:
        out.append((stats["hlo_module"], stats["hlo_op"], e.start_ns, e.duration_ns))
  return out


def summarize(trace_dir: str, wall_s: float) -> dict:
  """Per program: op seconds, thunks, relayout thunks, dot thunks; and the host's share."""
  path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
  lines = [line for plane in ProfileData.from_file(path).planes for line in plane.lines]
  ops = _leaf_times(lines)
  per = collections.defaultdict(lambda: collections.Counter())
  kinds = collections.defaultdict(lambda: collections.Counter())
  intervals = []
  for module, op, start, dur in ops:
    c = per[module]
    c["thunks"] += 1
    c["op_ns"] += dur
    kinds[module][op.split(".")[0]] += dur
    c["relayouts"] += any(op.startswith(r) or f"_{r}" in op for r in RELAYOUT)
    c["dots"] += op.startswith(("ynn_fusion", "dot", "custom-call"))
    intervals.append((start, start + dur))
  intervals.sort()
  busy, end = 0, -1
  for a, b in intervals:  # the union of the XLA threads' busy time
    if b > end:
      busy += b - max(a, end)
      end = b
  programs = {
    m.removeprefix("jit_"): {
      "op_s": round(c["op_ns"] / 1e9, 3),
      "thunks": c["thunks"],
      "relayout_thunks": c["relayouts"],
      "dot_thunks": c["dots"],
      "top_op_kinds_s": {k: round(ns / 1e9, 3) for k, ns in kinds[m].most_common(6) if ns > 1e6},
    }
    for m, c in sorted(per.items(), key=lambda kv: -kv[1]["op_ns"])
    if c["op_ns"] > 1e6
  }
  return {
    "wall_s": round(wall_s, 3),
    "host_only_s": round(wall_s - busy / 1e9, 3),
    "programs": programs,
  }


def traced(fn, name: str, results: dict):
  """`fn` that traces its call into `results[name]`."""

  def call(*args, **kwargs):
    with tempfile.TemporaryDirectory(prefix=f"profile_{name}_") as directory:
      if not ARGS.no_trace:
        jax.profiler.start_trace(directory)
      start = time.perf_counter()
      out = fn(*args, **kwargs)
      jax.block_until_ready(out)
      wall = time.perf_counter() - start
      if ARGS.no_trace:
        results[name] = {"wall_s": round(wall, 3)}
      else:  # summed here, then the trace (hundreds of MB for SmolLM2) is removed
        jax.profiler.stop_trace()
        results[name] = summarize(directory, wall)
    return out

  return call


def versus() -> dict:
  """`--vs`: this tree against COMMIT's, one process per run, alternating."""
  import shutil
  import statistics
  import subprocess

  base = pathlib.Path(tempfile.mkdtemp(prefix="profile_vs_"))
  archive = subprocess.run(
    ["git", "-C", str(ROOT), "archive", ARGS.vs, "ada_jax", "configs"],
    check=True,
    capture_output=True,
  ).stdout
  subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
  (base / "experiments").mkdir(exist_ok=True)
  shutil.copy(__file__, base / "experiments")
  trees = {"baseline": base, "this": ROOT}
  runs = {name: [] for name in trees}
  for k in range(ARGS.alternations):
    for name in trees if k % 2 == 0 else reversed(list(trees)):
      out = base / f"{name}_{k}.json"
      flags = [f"--config={ARGS.config}", f"--model={ARGS.model}", f"--out={out}", "--no_trace"]
      script = trees[name] / "experiments" / pathlib.Path(__file__).name
      subprocess.run(
        [sys.executable, str(script), *flags], cwd=trees[name], check=True, capture_output=True
      )
      runs[name].append(json.loads(out.read_text()))
      print(name, {w: runs[name][-1][w]["wall_s"] for w in ("rl_step", "evaluation")}, flush=True)
  result = {"git_commit": metrics.git_commit(), "baseline_commit": ARGS.vs, "args": vars(ARGS)}
  for window in ("rl_step", "evaluation"):
    wall = {n: [r[window]["wall_s"] for r in runs[n]] for n in trees}
    ratios = [a / b for a, b in zip(wall["baseline"], wall["this"], strict=True)]
    result[window] = {
      "wall_s": wall,
      "wall_s_median": {n: statistics.median(w) for n, w in wall.items()},
      "speedup_median": round(statistics.median(ratios), 3),
    }
  result["step_timers"] = {n: [r["rl_step"]["step_timers"] for r in runs[n]] for n in trees}
  shutil.rmtree(base, ignore_errors=True)
  return result


def main() -> None:
  if ARGS.vs:
    result = versus()
    text = json.dumps(result, indent=1)
    print(text)
    name = f"{pathlib.Path(ARGS.config).stem}_vs_{ARGS.vs}"
    out = ARGS.out or ROOT / f"experiments/results/profile_cpu_{name}.json"
    pathlib.Path(out).write_text(text + "\n")
    return
  commit = metrics.git_commit()
  spec = importlib.util.spec_from_file_location("config", ROOT / ARGS.config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  if ARGS.model:
    c.model.hf_dir = ARGS.model
  c.rl.steps, c.eval.every_steps = 3, 2
  results: dict = {}
  rl_step, heldout = loop.rl_step, loop._heldout_eval

  def step(ctx, n, *args):
    out = (traced(rl_step, "rl_step", results) if n == 3 else rl_step)(ctx, n, *args)
    if n == 3:
      results["rl_step"]["step_timers"] = {
        k: round(v, 3) for k, v in out[2].as_dict().items() if k.startswith("time_")
      }
      raise _Traced  # the evaluation after RL would only cost time
    return out

  def evaluate(evaluator, workdir, params, n, rng):
    fn = traced(heldout, "evaluation", results) if n == 2 else heldout
    return fn(evaluator, workdir, params, n, rng)

  loop.rl_step, loop._heldout_eval = step, evaluate
  with tempfile.TemporaryDirectory() as workdir:
    try:
      loop.run(c, workdir)
    except _Traced:
      pass
  name = pathlib.Path(ARGS.config).stem
  result = {"git_commit": commit, "config": ARGS.config, "args": vars(ARGS), **results}
  result["config_full"] = json.loads(c.to_json_best_effort())
  text = json.dumps(result, indent=1)
  print(text)
  out = ARGS.out or ROOT / f"experiments/results/profile_cpu_{name}.json"
  pathlib.Path(out).write_text(text + "\n")


if __name__ == "__main__":
  main()
