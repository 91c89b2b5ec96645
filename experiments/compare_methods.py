"""GRPO, DAPO, Reinforce-Ada (pos, balance) and Est on the tiny arithmetic task.

  python experiments/compare_methods.py            # 3 seeds x 100 RL steps
  python experiments/compare_methods.py --quick    # 1 seed x 40 RL steps

Methods, as the authors ran them: the baselines from `configs/tiny_arith_grpo.py`
(`configs.common.released_baseline`: std normalization, dual clip 3, weight decay 0.01,
no warm-up) — GRPO n = 4, GRPO n = 8 and DAPO n = 4 — plus GRPO n = 4 with the
Reinforce-Ada optimizer settings (dual clip, weight decay and warm-up of
`configs/tiny_arith_pos.py`), which separates those settings from the method;
Reinforce-Ada-pos and -balance from `configs/tiny_arith_pos.py`; Est as released at a
budget of K = 8 per prompt (the paper sets it against GRPO n = 8), and the same Est with
p̂ from the learned pass-rate head (`ada.est.estimator=head`) instead of the EMA.

One supervised warm start (`configs/tiny_arith_pos.py`'s, run once as its own workdir)
gives the shared initial policy; every (method, seed) run then starts from its step-0
checkpoint (`ckpt.init_from`) and trains the same number of RL steps with the same
prompts per step (B = 64) and seed-dependent prompt order and rollout keys. The training
set is cut to `--train_prompts` problems so that prompts come back every few steps; Est
needs that to estimate pass rates from earlier visits (the paper trains several epochs).
Sampler chunks are full for every method (`sampler.prompts_per_chunk` is derived from
`chunk_rows` and the rows each prompt gets), so the time per step compares fairly.

Each run is `python -m ada_jax.main` in its own process (`--jobs` at a time), in
`--workdir/<commit>_steps<S>_prompts<P>/<method>_seed<s>`; a finished run is not repeated,
an interrupted one resumes from its last checkpoint. Then the script reads every run's
metrics.jsonl and summary.json and writes, under `--out` (default
experiments/results/compare_methods or ..._quick):

  <out>.json   the git commit; per method: its config file, overrides and the full parsed
               config of each run; final training pass rate (mean and spread over seeds),
               held-out Avg@4 before/after RL, samples drawn, sampler rows computed,
               zero-signal fraction, seconds per step split into sample / grade-wait / train
               and the step cost relative to GRPO n = 4; per run: the curves
  <out>.png    training pass rate vs step and vs samples drawn, zero-signal fraction vs
               step, held-out Avg@4 after RL, time per step
  <out>.md     the summary table (pasted into experiments/README.md)

"Training pass rate" is the `first_round_pass_rate` metric: the fraction of correct
responses among each prompt's first-round samples (drawn before any exit decision),
averaged over the step's B prompts. It is an unbiased estimate of the policy's pass rate
on the step's prompts for every method. The `pass_rate` metric (every response drawn) is
not: pos and balance stop sampling a prompt after successes, so it reads high for them
(the Bernoulli simulator measures +0.009 for pos; experiments/simulate_sampling.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tqdm.auto import tqdm

from ada_jax import cli
from ada_jax import config as config_lib
from ada_jax import metrics as metrics_lib

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results"
ADA, BASELINE = "configs/tiny_arith_pos.py", "configs/tiny_arith_grpo.py"
WARM_START = ADA  # its supervised warm start is every run's initial policy
# The Reinforce-Ada script's optimizer settings where the released baselines differ.
ADA_OPTIM = ("loss.dual_clip", "optim.weight_decay", "optim.warmup_steps")
PASS_RATE = "first_round_pass_rate"  # unbiased for every method (module docstring)
REFERENCE = "GRPO n=4"  # step costs are reported relative to this row


def _config(path: str):
  """The ConfigDict of the experiment file `path` (relative to the repository)."""
  cli.make_configs_importable()
  return importlib.import_module(f"configs.{pathlib.Path(path).stem}").get_config()


def _ada_optim() -> dict[str, object]:
  ada = _config(ADA)
  return {key: getattr(getattr(ada, key.split(".")[0]), key.split(".")[1]) for key in ADA_OPTIM}


STREAM = {"ada.schedule": "stream", "sampler.segment_steps": 1}
STOP = 0.1
PARTS = ("sample", "grade_wait", "train")  # a step's wall time: `time_<part>_s` metrics
# label -> (config file, overrides); everything else is the file's.
METHODS: dict[str, tuple[str, dict[str, object]]] = {
  "GRPO n=4": (BASELINE, {}),
  "GRPO n=4, Ada optim": (BASELINE, _ada_optim()),
  "GRPO n=8": (BASELINE, {"ada.n": 8}),
  "DAPO n=4": (BASELINE, {"ada.method": "dapo"}),
  "Ada-pos": (ADA, {"ada.method": "pos"}),
  "Ada-balance": (ADA, {"ada.method": "balance"}),
  "Est K=8": (ADA, {"ada.method": "est", "ada.est.budget_per_prompt": 8.0}),
  "Est-head K=8": (
    ADA,
    {"ada.method": "est", "ada.est.budget_per_prompt": 8.0, "ada.est.estimator": "head"},
  ),
  # The streaming schedule (`controller.drive_stream`). Responses are ~6 tokens, so a segment
  # is 1 decode step (the decision lag costs a sixth of a response; at 2 steps the stream
  # ran 43 decode steps per pos step against 38, and 1.6-1.8 s sampling against 1.2-1.5).
  "GRPO n=4 stream": (BASELINE, STREAM),
  "Ada-pos stream": (ADA, {"ada.method": "pos", **STREAM}),
  "Ada-balance stream": (ADA, {"ada.method": "balance", **STREAM}),
  # Beyond the paper: the exit-chance rule (`ada.seq.min_exit_chance`), at the threshold that
  # keeps pos's signal within 0.01 in the simulator (experiments/README.md).
  "Ada-pos stop": (ADA, {"ada.method": "pos", "ada.seq.min_exit_chance": STOP}),
  "Ada-balance stop": (ADA, {"ada.method": "balance", "ada.seq.min_exit_chance": STOP}),
  "Ada-pos stop stream": (ADA, {"ada.method": "pos", "ada.seq.min_exit_chance": STOP, **STREAM}),
  "Ada-balance stop stream": (
    ADA,
    {"ada.method": "balance", "ada.seq.min_exit_chance": STOP, **STREAM},
  ),
}
# Each stream row and the rounds row it is measured against.
STREAM_OF = {label: label.removesuffix(" stream") for label in METHODS if "stream" in label}
LAST = 10  # steps averaged for the "final" training pass rate


def slug(label: str) -> str:
  return label.lower().replace(",", "").replace(" ", "_").replace("=", "").replace("-", "_")


def command(workdir: pathlib.Path, config: str, overrides: dict[str, object]) -> list[str]:
  args = [sys.executable, "-m", "ada_jax.main", f"--config={config}", f"--workdir={workdir}"]
  return args + [f"--config.{k}={v}" for k, v in overrides.items()]


def full_config(config: str, overrides: dict[str, object]) -> dict:
  """The parsed `RunConfig` of `config` with `overrides`, as a JSON-ready dict (checks the
  overrides before anything runs: a bad one raises `ConfigError` naming it)."""
  c = _config(config)
  c.update_from_flattened_dict(
    {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in overrides.items()}
  )
  parsed = config_lib.parse(c)
  out = json.loads(json.dumps(config_lib.as_dict(parsed), default=str))
  out["derived"] = {"train_rows": parsed.train_rows, "prompts_per_chunk": parsed.prompts_per_chunk}
  return out


def run(workdir: pathlib.Path, config: str, overrides: dict[str, object]) -> float:
  """Runs (or resumes) one training run unless its summary says it finished; returns the
  wall seconds spent now. Raises RuntimeError with the log's tail when it fails."""
  summary = workdir / "summary.json"
  if summary.exists() and "after_rl" in json.loads(summary.read_text()):
    return 0.0
  workdir.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  with open(workdir / "log.txt", "a") as log:
    proc = subprocess.run(
      command(workdir, config, overrides),
      cwd=REPO,
      stdout=log,
      stderr=subprocess.STDOUT,
      check=False,
    )
  if proc.returncode:
    tail = (workdir / "log.txt").read_text()[-2000:]
    raise RuntimeError(f"run {workdir} failed (exit {proc.returncode}):\n{tail}")
  return time.perf_counter() - start


def summarize(runs: dict[str, list[pathlib.Path]]) -> dict:
  """Per method: seed means and spreads of the final metrics; per run: the curves."""
  out = {}
  for label, dirs in runs.items():
    per_seed = []
    for d in dirs:
      lines = metrics_lib.read_jsonl(d / "metrics.jsonl")
      summary = json.loads((d / "summary.json").read_text())
      drawn = np.cumsum([m["samples_drawn"] for m in lines])
      steady = lines[1:] or lines  # step 1 compiles
      per_seed.append(
        {
          "run": d.name,
          "step": [m["step"] for m in lines],
          "pass_rate": [m[PASS_RATE] for m in lines],
          "pool_pass_rate": [m["pass_rate"] for m in lines],
          "zero_signal_frac": [m["zero_signal_frac"] for m in lines],
          "samples_drawn_total": drawn.tolist(),
          "final_pass_rate": float(np.mean([m[PASS_RATE] for m in lines[-LAST:]])),
          "first_pass_rate": float(np.mean([m[PASS_RATE] for m in lines[:LAST]])),
          "final_pool_pass_rate": float(np.mean([m["pass_rate"] for m in lines[-LAST:]])),
          "heldout_before": summary["before_rl"]["eval/arith/avg@4"],
          "heldout_after": summary["after_rl"]["eval/arith/avg@4"],
          "samples_per_step": float(np.mean([m["samples_drawn"] for m in lines])),
          "rows_computed_per_step": float(np.mean([m["rows_computed"] for m in lines])),
          "zero_signal": float(np.mean([m["zero_signal_frac"] for m in lines])),
          **{f"{k}_s": float(np.median([m[f"time_{k}_s"] for m in steady])) for k in PARTS},
          "step_s": float(np.median([sum(m[f"time_{k}_s"] for k in PARTS) for m in steady])),
          # The streaming figures (`rollout.engine.RolloutCounters`).
          "grade_wait_frac": float(
            np.median([m["time_grade_wait_s"] / max(m["time_sample_s"], 1e-9) for m in steady])
          ),
          "decode_steps_per_step": float(np.mean([m["decode_steps"] for m in lines])),
          "token_slot_utilization": float(np.mean([m["token_slot_utilization"] for m in lines])),
          "tokens_cancelled_per_step": float(np.mean([m["tokens_cancelled"] for m in lines])),
          "compiles_after_step1": int(sum(m["compiles"] for m in lines[1:])),
        }
      )

    def stat(key, per_seed=per_seed):
      values = np.array([s[key] for s in per_seed], float)
      return {
        "mean": float(values.mean()),
        "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
        "min": float(values.min()),
        "max": float(values.max()),
        "seeds": values.tolist(),
      }

    out[label] = {
      "final_pass_rate": stat("final_pass_rate"),
      "first_pass_rate": stat("first_pass_rate"),
      "final_pool_pass_rate": stat("final_pool_pass_rate"),
      "heldout_before": stat("heldout_before"),
      "heldout_after": stat("heldout_after"),
      "samples_per_step": stat("samples_per_step"),
      "rows_computed_per_step": stat("rows_computed_per_step"),
      "zero_signal": stat("zero_signal"),
      **{f"{k}_s": stat(f"{k}_s") for k in (*PARTS, "step")},
      **{
        k: stat(k)
        for k in (
          "grade_wait_frac",
          "decode_steps_per_step",
          "token_slot_utilization",
          "tokens_cancelled_per_step",
          "compiles_after_step1",
        )
        if all(k in s for s in per_seed)
      },
      "runs": per_seed,
    }
  if REFERENCE in out:
    ref = out[REFERENCE]["step_s"]["mean"]
    for r in out.values():
      r["step_cost_vs_grpo_n4"] = r["step_s"]["mean"] / ref
  return out


def table(results: dict, seeds: int, steps: int) -> str:
  """The Markdown summary table."""
  sd = lambda s, scale=1.0, fmt=".3f": f" ± {scale * s['std']:{fmt}}" if seeds > 1 else ""
  rows = [
    f"| method | train pass rate, first {LAST} steps | last {LAST} steps"
    f"{' (mean ± sd)' if seeds > 1 else ''} | held-out Avg@4 after RL | samples / step"
    " | sampler rows / step | zero-signal fraction | s / step (sample + grade-wait + train)"
    f" | step cost vs {REFERENCE} |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for label, r in results.items():
    f, h = r["final_pass_rate"], r["heldout_after"]
    secs = " + ".join(f"{r[f'{k}_s']['mean']:.2f}" for k in PARTS)
    ratio = r.get("step_cost_vs_grpo_n4")
    rows.append(
      f"| {label} | {r['first_pass_rate']['mean']:.3f} | **{f['mean']:.3f}**{sd(f)}"
      f" | {100 * h['mean']:.1f}%{sd(h, 100, '.1f')}"
      f" | {r['samples_per_step']['mean']:.0f}"
      f" | {r['rows_computed_per_step']['mean']:.0f}"
      f" | {r['zero_signal']['mean']:.3f} | {secs}"
      f" | {'' if ratio is None else f'{ratio:.2f}×'} |"
    )
  before = next(iter(results.values()))["heldout_before"]["mean"]
  pairs = [(s, r) for s, r in STREAM_OF.items() if s in results and r in results]
  if pairs:
    rows += [
      "\n| stream row vs rounds row | held-out Avg@4 stream − rounds (rounds sd) | within 1 sd"
      " | grade-wait ÷ sample, stream (rounds) | compiles after step 1 | decode steps / step"
      " | token-slot utilisation | tokens cancelled / step | samples / step |",
      "|---|---|---|---|---|---|---|---|---|",
    ]
    for s, r in pairs:
      a, b = results[s], results[r]
      diff = a["heldout_after"]["mean"] - b["heldout_after"]["mean"]
      sd_r = b["heldout_after"]["std"]
      pair = lambda k, fmt, a=a, b=b: f"{a[k]['mean']:{fmt}} ({b[k]['mean']:{fmt}})"
      rows.append(
        f"| {s} | {100 * diff:+.1f} pts ({100 * sd_r:.1f}) | {abs(diff) <= sd_r}"
        f" | {pair('grade_wait_frac', '.3f')} | {a['compiles_after_step1']['max']:.0f}"
        f" | {pair('decode_steps_per_step', '.0f')} | {pair('token_slot_utilization', '.2f')}"
        f" | {pair('tokens_cancelled_per_step', '.0f')} | {pair('samples_per_step', '.0f')} |"
      )
  rows.append(
    f"\nHeld-out Avg@4 of the shared warm start before RL: {100 * before:.1f}%. "
    f"{seeds} seed(s), {steps} RL steps, B = 64 prompts per step. Train pass rate: "
    f"`{PASS_RATE}` (unbiased for every method)."
  )
  return "\n".join(rows)


def plot(results: dict, path: pathlib.Path, steps: int) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
  colors = dict(zip(results, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
  smooth = max(1, min(5, steps // 10))

  def band(ax, label, x_key, y_key):
    runs = results[label]["runs"]
    n = min(len(r[y_key]) for r in runs)
    ys = np.array([np.convolve(r[y_key][:n], np.ones(smooth) / smooth, "valid") for r in runs])
    xs = np.mean([r[x_key][smooth - 1 : n] for r in runs], axis=0)
    ax.plot(xs, ys.mean(0), color=colors[label], label=label)
    if len(runs) > 1:
      ax.fill_between(xs, ys.min(0), ys.max(0), color=colors[label], alpha=0.15)

  panels = [
    (axes[0, 0], "step", "pass_rate", "RL step", "training pass rate (first round)"),
    (
      axes[0, 1],
      "samples_drawn_total",
      "pass_rate",
      "responses sampled (cumulative)",
      "training pass rate (first round)",
    ),
    (axes[0, 2], "step", "zero_signal_frac", "RL step", "fraction of prompts with zero advantage"),
  ]
  for ax, x_key, y_key, xlabel, ylabel in panels:
    for label in results:
      band(ax, label, x_key, y_key)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  axes[0, 1].set_xscale("log")
  seeds = len(next(iter(results.values()))["runs"])
  shade = f"; shade: min–max over {seeds} seeds" if seeds > 1 else ""
  axes[0, 0].set_title(f"mean over seeds, {smooth}-step moving average{shade}", fontsize=9)

  labels = list(results)
  x = np.arange(len(labels))
  ax = axes[1, 0]
  for i, label in enumerate(labels):
    h = results[label]["heldout_after"]
    ax.bar(i, 100 * h["mean"], color=colors[label])
    ax.scatter([i] * len(h["seeds"]), 100 * np.array(h["seeds"]), color="k", s=12, zorder=3)
  before = 100 * results[labels[0]]["heldout_before"]["mean"]
  ax.axhline(before, color="gray", ls="--", label=f"before RL ({before:.1f}%)")
  ax.set_xticks(x, labels, rotation=20, fontsize=8)
  ax.set_ylabel("held-out Avg@4 after RL (%)")
  ax.set_title("bars: mean over seeds; dots: seeds", fontsize=9)
  ax.legend(fontsize=8)

  ax = axes[1, 1]
  bottom = np.zeros(len(labels))
  for part in PARTS:
    vals = np.array([results[label][f"{part}_s"]["mean"] for label in labels])
    ax.bar(x, vals, bottom=bottom, label=part)
    bottom += vals
  ax.set_xticks(x, labels, rotation=20, fontsize=8)
  ax.set_ylabel("wall time per RL step (s, median over steps)")
  ax.legend(fontsize=8)

  ax = axes[1, 2]
  for i, label in enumerate(labels):
    f = results[label]["final_pass_rate"]
    ax.bar(i, f["mean"], color=colors[label])
    ax.scatter([i] * len(f["seeds"]), f["seeds"], color="k", s=12, zorder=3)
  ax.set_xticks(x, labels, rotation=20, fontsize=8)
  ax.set_ylabel(f"training pass rate, last {LAST} steps")
  ax.set_ylim(bottom=0)
  fig.suptitle("Tiny arithmetic task: same warm start, same RL steps and prompts per step")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="1 seed, 40 steps (≤ 10 min)")
  parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2")
  parser.add_argument("--steps", type=int, default=None, help="RL steps (default 100)")
  parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  parser.add_argument(
    "--train_prompts",
    type=int,
    default=1280,
    help="training problems (B=64 → a new epoch every 20 steps)",
  )
  parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
  parser.add_argument("--workdir", default="/tmp/ada_compare_methods")
  parser.add_argument("--out", default=None, help="output path without extension")
  parser.add_argument(
    "--readme",
    action="store_true",
    help="also replace the table between this output's markers in experiments/README.md",
  )
  parser.add_argument(
    "--add_to",
    default=None,
    help="merge the --methods run now into this results JSON (its other rows kept as they "
    "are) and rewrite its .md/.png; the added rows' commit and command are recorded",
  )
  parser.add_argument(
    "--from_json",
    default=None,
    help="run nothing: rewrite the .md/.png (and --readme) from this JSON",
  )
  args = parser.parse_args()
  if args.from_json:
    path = pathlib.Path(args.from_json)
    write_outputs(json.loads(path.read_text()), path.with_suffix(""), args.readme)
    return
  seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
  steps = args.steps or (40 if args.quick else 100)
  out = pathlib.Path(args.out or RESULTS / ("compare_methods" + "_quick" * args.quick))
  commit = metrics_lib.git_commit(REPO)
  # Runs of other code never mix in: each commit gets its own folder of runs.
  root = pathlib.Path(args.workdir) / f"{commit[:12]}_steps{steps}_prompts{args.train_prompts}"
  common = {
    "rl.steps": steps,
    "data.arith_prompts": args.train_prompts,
    "ckpt.every_steps": 10,
    "eval.every_steps": 0,
    "eval.arith_problems": 512,
  }
  warm = root / "warm_start"
  specs = {
    (label, s): (
      METHODS[label][0],
      {**common, **METHODS[label][1], "seed": s, "ckpt.init_from": warm / "checkpoints" / "0"},
    )
    for label in args.methods
    for s in seeds
  }
  configs = {key: full_config(*spec) for key, spec in specs.items()}  # fail before running

  start = time.perf_counter()
  # The warm start, once: every run below takes its params from this run's step 0.
  print("warm start ...", flush=True)
  run(warm, WARM_START, {**common, "rl.steps": 1})
  # Seed-major: runs of neighbouring rows (a method's two schedules) share the machine at
  # the same time, so their step times see the same load.
  order = sorted(specs, key=lambda key: (key[1], args.methods.index(key[0])))
  jobs = {key: root / f"{slug(key[0])}_seed{key[1]}" for key in order}
  with ThreadPoolExecutor(args.jobs) as pool:
    futures = [pool.submit(run, d, *specs[key]) for key, d in jobs.items()]
    for future in tqdm(futures, desc="runs", unit="run"):
      future.result()
  wall = time.perf_counter() - start

  results = summarize({label: [jobs[label, s] for s in seeds] for label in args.methods})
  for label, r in results.items():
    r["config_file"], r["overrides"] = (
      METHODS[label][0],
      {k: str(v) for k, v in METHODS[label][1].items()},
    )
    for seed_run, s in zip(r["runs"], seeds, strict=True):
      seed_run["config"] = configs[label, s]
      seed_run["command"] = " ".join(command(jobs[label, s], *specs[label, s])[1:])
  cmd = shlex.join(["python", "experiments/compare_methods.py", *sys.argv[1:]])
  report = {
    "command": cmd,
    "git_commit": commit,
    "seeds": seeds,
    "steps": steps,
    "train_prompts": args.train_prompts,
    "jobs": args.jobs,
    "cpus": os.cpu_count(),
    "wall_s": round(wall, 1),
    "pass_rate_metric": PASS_RATE,
    "methods": results,
  }
  if args.add_to:
    out = pathlib.Path(args.add_to).with_suffix("")
    report = add_rows(json.loads(out.with_suffix(".json").read_text()), report)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
  write_outputs(report, out, args.readme)
  print(
    json.dumps(
      {
        "wall_s": round(wall, 1),
        "json": str(out.with_suffix(".json")),
        "png": str(out.with_suffix(".png")),
      }
    )
  )


def add_rows(base: dict, new: dict) -> dict:
  """`base` (a results JSON) with `new`'s methods added; each added row's commit, command
  and wall time go to `base['added_rows']`. The step-cost ratio uses `base`'s GRPO n=4."""
  if new["seeds"] != base["seeds"] or new["steps"] != base["steps"]:
    raise SystemExit(
      f"--add_to: seeds/steps {new['seeds']}/{new['steps']} differ from the JSON's "
      f"{base['seeds']}/{base['steps']}"
    )
  ref = base["methods"].get(REFERENCE, {}).get("step_s", {}).get("mean")
  for label, row in new["methods"].items():
    if ref:
      row["step_cost_vs_grpo_n4"] = row["step_s"]["mean"] / ref
    base["methods"][label] = row
    base.setdefault("added_rows", {})[label] = {
      k: new[k] for k in ("command", "git_commit", "wall_s", "cpus")
    }
  return base


def write_outputs(report: dict, out: pathlib.Path, readme: bool) -> None:
  """Writes <out>.md and <out>.png from a results JSON; with `readme`, also the table
  between the `<!-- <out name>:begin -->` / `:end -->` markers of experiments/README.md."""
  md = table(report["methods"], len(report["seeds"]), report["steps"])
  text = (
    f"`{report['command']}` ({report['wall_s'] / 60:.1f} min on {report['cpus']} cores,"
    f" commit {report['git_commit']})\n\n{md}\n"
  )
  for label, added in report.get("added_rows", {}).items():
    text += (
      f"\nRow {label} added later: `{added['command']}` ({added['wall_s'] / 60:.1f} min,"
      f" commit {added['git_commit']}; seeds and steps as above).\n"
    )
  out.with_suffix(".md").write_text(text)
  plot(report["methods"], out.with_suffix(".png"), report["steps"])
  print(md)
  if readme:
    path = REPO / "experiments" / "README.md"
    begin, end = f"<!-- {out.name}:begin -->\n", f"<!-- {out.name}:end -->"
    doc = path.read_text()
    if begin not in doc or end not in doc:
      raise SystemExit(f"--readme: {path} lacks the markers {begin.strip()} ... {end}")
    head, rest = doc.split(begin, 1)
    image = f"\n![{out.name}]({os.path.relpath(out.with_suffix('.png').absolute(), path.parent)})\n"
    path.write_text(head + begin + text + image + rest[rest.index(end) :])


if __name__ == "__main__":
  main()
