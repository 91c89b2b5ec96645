"""Calibrates the real-model comparison's task: where does GRPO n = 4 lose signal on failures?

  python experiments/calibrate_smollm2.py                 # every candidate, 100 problems x 8
  python experiments/calibrate_smollm2.py --candidates L2+ L2+-
  python experiments/calibrate_smollm2.py --report        # run nothing: rewrite the JSON

The base model (SmolLM2-135M-Instruct converted from its GGUF, `configs/smollm2_arith_pos.py`'s
frame, sampler and 96-token budget) answers `--problems` distinct held-out problems of each
candidate task mix `--k` times (`python -m ada_jax.evaluate`, one process and one workdir per
candidate under `--root`, resumable through the evaluation's results cache). From each
problem's correct count c of k it estimates, without bias (a hypergeometric draw of 4 of the
k samples), the chance that a GRPO group of n = 4 is all wrong, C(k - c, 4) / C(k, 4), and
all right; their sum is the chance that the group has no signal.

A candidate suits the comparison (issue 50) when its mean pass rate is in [0.10, 0.25], at
least 40 % of its prompts' groups of 4 are all wrong, and the pass rates spread (some
prompts solved often): `pick` takes the suitable candidate whose all-wrong share is largest.
Level-1 facts are not candidates (about 16 held-out problems, memorised).

Writes experiments/results/calibrate_smollm2.json: per candidate the commit and command it was
measured with, its task, settings, per-problem correct counts, the summary figures and
whether it suits (recomputed from the counts on every write, `--report` included).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results"
sys.path.insert(0, str(REPO / "experiments"))
import smollm2_learning as learning  # noqa: E402

CONFIG = "configs/smollm2_arith_pos.py"
# The configs' worked example, and a second one (mixed digit counts, so never a drawn problem).
ONE_EXAMPLE = ("What is 7 + 35?", "7 + 35 = 42. The answer is \\boxed{42}.")
TWO_EXAMPLES = (*ONE_EXAMPLE, "What is 6 + 158?", "6 + 158 = 164. The answer is \\boxed{164}.")
# name -> (levels, ops, worked examples): two- and three-digit sums, differences, products.
CANDIDATES = {
  "L2+": ((2,), ("+",), ONE_EXAMPLE),
  "L2+ 2ex": ((2,), ("+",), TWO_EXAMPLES),
  "L2+- 2ex": ((2,), ("+", "-"), TWO_EXAMPLES),
  "L2-": ((2,), ("-",), ONE_EXAMPLE),
  "L3+": ((3,), ("+",), ONE_EXAMPLE),
  "L2*": ((2,), ("*",), ONE_EXAMPLE),
}
PASS_RANGE = (0.10, 0.25)
MIN_ALL_WRONG = 0.40
GROUP = 4  # GRPO's n in the comparison


def group_chances(correct: np.ndarray, k: int, n: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
  """Per problem, the unbiased chance that n of its k samples, drawn without replacement,
  are all wrong and all right: C(k - c, n) / C(k, n) and C(c, n) / C(k, n).

  Raises:
    ValueError: n > k.
  """
  if n > k:
    raise ValueError(f"a group of {n} cannot be drawn from {k} samples")
  total = math.comb(k, n)
  wrong = np.array([math.comb(k - int(c), n) / total for c in correct])
  right = np.array([math.comb(int(c), n) / total for c in correct])
  return wrong, right


def summarise(correct: list[int], k: int) -> dict:
  """A candidate's figures from its per-problem correct counts of k."""
  c = np.asarray(correct)
  rate = c / k
  wrong, right = group_chances(c, k)
  out = {
    "problems": len(c),
    "pass_rate_mean": round(float(rate.mean()), 4),
    "pass_rate_quartiles": [round(float(q), 4) for q in np.quantile(rate, [0.25, 0.5, 0.75])],
    "share_never_solved": round(float(np.mean(c == 0)), 4),
    "share_solved_half_or_more": round(float(np.mean(rate >= 0.5)), 4),
    "grpo4_all_wrong": round(float(wrong.mean()), 4),
    "grpo4_all_right": round(float(right.mean()), 4),
    "grpo4_zero_signal": round(float((wrong + right).mean()), 4),
  }
  out["suits"] = bool(
    PASS_RANGE[0] <= out["pass_rate_mean"] <= PASS_RANGE[1]
    and out["grpo4_all_wrong"] >= MIN_ALL_WRONG
    and out["share_solved_half_or_more"] > 0
  )
  return out


def pick(candidates: dict[str, dict]) -> str | None:
  """The suitable candidate with the largest all-wrong share, or None."""
  ok = [
    (c["summary"]["grpo4_all_wrong"], name)
    for name, c in candidates.items()
    if c["summary"]["suits"]
  ]
  return max(ok)[1] if ok else None


def evaluate(name: str, root: pathlib.Path, args) -> dict:
  """Runs (or reads back) one candidate's evaluation; its report."""
  levels, ops, examples = CANDIDATES[name]
  workdir = root / learning.slug(name.replace("+", "add").replace("-", "sub").replace("*", "mul"))
  overrides = {
    "eval.arith_levels": tuple(levels),
    "eval.arith_ops": tuple(ops),
    "eval.frame.examples": tuple(examples),
    "eval.arith_problems": args.problems,
    "eval.k": args.k,
  }
  cmd = [
    sys.executable,
    "-m",
    "ada_jax.evaluate",
    f"--config={CONFIG}",
    f"--workdir={workdir}",
    f"--hf_dir={args.model_dir}",
    "--json",
    *[f"--config.{k}={v}" for k, v in overrides.items()],
  ]
  start = time.perf_counter()
  print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"candidate {name} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
  report = json.loads(proc.stdout[proc.stdout.index("{") :])
  problems = report["problems"]["arith_text"]
  correct = [p["correct"] for p in problems]
  return {
    "commit": learning.metrics_lib.git_commit(REPO),
    "command": " ".join(["python", *sys.argv]),
    "k": args.k,
    "levels": list(levels),
    "ops": list(ops),
    "examples": list(examples),
    "overrides": overrides,
    "wall_s": round(time.perf_counter() - start, 1),
    "correct": correct,
    "boxed": [p["boxed"] for p in problems],
    "summary": summarise(correct, args.k),
  }


def main(argv=None) -> None:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
  p.add_argument("--problems", type=int, default=100)
  p.add_argument("--k", type=int, default=8)
  p.add_argument(
    "--root", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()) / "ada_calibrate"
  )
  p.add_argument("--model_dir", type=pathlib.Path, default=None)
  p.add_argument("--out", type=pathlib.Path, default=RESULTS / "calibrate_smollm2.json")
  p.add_argument("--report", action="store_true", help="run nothing: re-pick from the JSON")
  args = p.parse_args(argv)
  out = json.loads(args.out.read_text()) if args.out.exists() else {"candidates": {}}
  if not args.report:
    args.model_dir = learning.ensure_model(
      args.model_dir or learning.default_model_dir(), str(learning.SHARED_GGUF)
    )
    for name in args.candidates:
      out["candidates"][name] = evaluate(name, args.root, args)
      print(f"[{name}] {json.dumps(out['candidates'][name]['summary'])}", flush=True)
  # Each candidate keeps the commit, command and k it was measured with; its summary is
  # recomputed from its counts, so the criteria below are the ones its verdict used.
  for c in out["candidates"].values():
    c["summary"] = summarise(c["correct"], c.get("k", args.k))
  for stale in ("commit", "command", "k"):  # once the last run's, now per candidate
    out.pop(stale, None)
  out.update(
    config=CONFIG,
    criteria={"pass_rate_mean": PASS_RANGE, "grpo4_all_wrong_min": MIN_ALL_WRONG},
    picked=pick(out["candidates"]),
  )
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(out, indent=1) + "\n")
  print(f"picked: {out['picked']}; wrote {args.out}")


if __name__ == "__main__":
  main()
