"""Rounds vs stream at the paper's scale: decode steps, tokens and signal per method.

A thin CLI over `ada_jax.rl.simulate_stream` (see its docstring for the model): B = 512
prompts per step, a 2,048-token budget, lognormal response lengths (median 512, ~3 % at the
budget), the Beta-mix pass rates of `ada_jax.rl.simulate`, and a pool of 1,024 decode slots.
Each method runs in the one controller (`ada_jax.rl.controller`) under the `rounds` schedule
(the released barrier at the end of each round) and the `stream` schedule (exits at
segment boundaries, retired prompts' rows cancelled). Counts only, no model.

  python experiments/simulate_stream.py --out_dir experiments/results

Writes simulate_stream.json (git commit, config, every row, the issue's Done-when check and
a sweep of the stream knobs for pos and balance), simulate_stream.md (the tables) and
simulate_stream.png to --out_dir, and prints the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Mapping

import numpy as np

from ada_jax import metrics
from ada_jax.rl import simulate_stream as ss

# Stream knobs varied one at a time around the main configuration, for pos and balance.
SWEEP = (
  {"segment": 16},
  {"segment": 32},
  {"segment": 128},
  {"segment": 256},
  {"window": 4},
  {"window": 16},
  {"slots": 512},
  {"slots": 4096},
  {"min_pool": 8},
)


def plot_schedules(rows: Mapping[str, Mapping[str, ss.ScheduleResult]], axes=None):
  """Two panels: decode steps ÷ GRPO n = 4 per method and schedule (the paper's wall-time
  ratios marked), and signal fraction vs tokens per prompt (an arrow rounds -> stream).

  Args:
    rows: row name -> schedule -> `ss.ScheduleResult` (must hold grpo_n4 under rounds).
    axes: two matplotlib Axes; None: a new 12 x 4.5 in figure.

  Returns:
    The two Axes.
  """
  import matplotlib.pyplot as plt

  if axes is None:
    _, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  ax, ax2 = axes
  ref = rows["grpo_n4"]["rounds"].decode_steps
  names = list(rows)
  x = np.arange(len(names))
  for k, schedule in enumerate(ss.SCHEDULES):
    ratio = [rows[n][schedule].decode_steps / ref if schedule in rows[n] else 0 for n in names]
    ax.bar(x + (k - 0.5) * 0.38, ratio, 0.38, label=schedule)
  for i, name in enumerate(names):
    method = name.removeprefix("ada_")
    if method in ss.PAPER_WALL_TIME_RATIO:
      ax.plot(i, ss.PAPER_WALL_TIME_RATIO[method], "k*", ms=11)
  ax.plot([], [], "k*", ms=11, label="paper: wall time ÷ GRPO (1.5B)")
  ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
  ax.set_ylabel("decode steps per RL step ÷ GRPO n=4")
  ax.grid(axis="y", alpha=0.3)
  ax.legend(fontsize=8)
  for name in names:
    r, s = rows[name].get("rounds"), rows[name].get("stream")
    if r is None or s is None:
      continue
    ax2.annotate(
      "",
      (s.tokens_per_prompt, s.signal_fraction),
      (r.tokens_per_prompt, r.signal_fraction),
      arrowprops=dict(arrowstyle="->", lw=0.8),
    )
    ax2.plot(r.tokens_per_prompt, r.signal_fraction, "o", ms=6, label=name)
    ax2.annotate(
      name,
      (r.tokens_per_prompt, r.signal_fraction),
      fontsize=7,
      xytext=(4, 4),
      textcoords="offset points",
    )
  ax2.set_xlabel("tokens decoded per prompt (rounds: dot; arrow: to stream)")
  ax2.set_ylabel("signal fraction")
  ax2.grid(alpha=0.3)
  return ax, ax2


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out_dir", default="experiments/results")
  parser.add_argument("--num_prompts", type=int, default=4096)
  parser.add_argument("--sweep_num_prompts", type=int, default=2048)
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--warmup_epochs", type=int, default=1)
  parser.add_argument("--batch", type=int, default=512)
  parser.add_argument("--slots", type=int, default=1024)
  parser.add_argument("--budget", type=int, default=2048)
  parser.add_argument("--median_length", type=float, default=512.0)
  parser.add_argument("--at_budget", type=float, default=0.03)
  parser.add_argument("--segment", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--no_sweep", action="store_true")
  args = parser.parse_args()

  t0 = time.time()
  sim = ss.StreamSimConfig(
    batch=args.batch,
    slots=args.slots,
    budget=args.budget,
    median_length=args.median_length,
    at_budget=args.at_budget,
    segment=args.segment,
    num_prompts=args.num_prompts,
    epochs=args.epochs,
    warmup_epochs=args.warmup_epochs,
    seed=args.seed,
  )
  configs = ss.method_rows()
  results = {
    name: {schedule: ss.simulate_schedule(cfg, schedule, sim) for schedule in ss.SCHEDULES}
    for name, cfg in configs.items()
  }
  ref = results["grpo_n4"]["rounds"].decode_steps
  rows = {
    name: {
      schedule: {**r.as_dict(), "decode_steps_vs_grpo_n4": r.decode_steps / ref}
      for schedule, r in by_schedule.items()
    }
    for name, by_schedule in results.items()
  }
  check = ss.done_when(results)
  sweep = []
  if not args.no_sweep:
    base = dataclasses.replace(sim, num_prompts=args.sweep_num_prompts)
    for change in SWEEP:
      variant = dataclasses.replace(base, **change)
      for name in ("ada_pos", "ada_balance"):
        cfg = configs[name]
        r = ss.simulate_schedule(cfg, "rounds", variant)
        s = ss.simulate_schedule(cfg, "stream", variant)
        sweep.append(
          {
            "change": change,
            "method": name,
            "signal_diff": s.signal_fraction - r.signal_fraction,
            "tokens_ratio": s.tokens_per_prompt / r.tokens_per_prompt,
            "decode_steps_ratio": s.decode_steps / r.decode_steps,
            "stream_tokens_cancelled_per_prompt": s.tokens_cancelled_per_prompt,
            "capped_token_share": r.capped_token_share,
          }
        )
  table = ss.markdown_table(results)
  result = {
    "git_commit": metrics.git_commit(),
    "command": "python experiments/simulate_stream.py " + " ".join(sys.argv[1:]),
    "config": dataclasses.asdict(sim),
    "length_sigma": ss.length_sigma(sim.median_length, sim.budget, sim.at_budget),
    "methods": {k: dataclasses.asdict(v) for k, v in configs.items()},
    "paper_wall_time_vs_grpo": ss.PAPER_WALL_TIME_RATIO,
    "notes": {
      "decode_steps": "slot-pool decode steps per RL step: the sampling part of wall time; "
      "the paper's ratios are whole-step wall time at 1.5B (sampling + grading + training)",
      "scored": f"epochs {args.warmup_epochs + 1}..{args.epochs} of "
      f"{args.num_prompts // args.batch} steps each",
      "done_when": "stream within 0.01 signal fraction of rounds with <= 0.8x its tokens "
      "per prompt, for pos and balance",
    },
    "rows": rows,
    "done_when": check,
    "sweep": sweep,
    "table_markdown": table,
    "seconds": round(time.time() - t0, 1),
  }
  out = pathlib.Path(args.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / "simulate_stream.json").write_text(json.dumps(result, indent=2) + "\n")
  (out / "simulate_stream.md").write_text(markdown(result) + "\n")
  plot(results, out / "simulate_stream.png")
  print(json.dumps(result, indent=2))


def markdown(result: dict) -> str:
  lines = [
    f"Rounds vs stream, slot-pool simulator (git {result['git_commit']}, `{result['command']}`)",
    "",
    *result["table_markdown"],
    "",
    "Done when (stream within 0.01 signal fraction of rounds, <= 0.8x tokens per prompt):",
    "",
    "| method | signal stream − rounds | tokens stream ÷ rounds | decode steps stream ÷ rounds "
    "| holds |",
    "|---|---|---|---|---|",
  ]
  for name, c in result["done_when"].items():
    lines.append(
      f"| {name} | {c['signal_diff']:+.4f} | {c['tokens_ratio']:.3f} | "
      f"{c['decode_steps_ratio']:.3f} | {c['holds']} |"
    )
  if result["sweep"]:
    lines += [
      "",
      "Stream knobs, one at a time (smaller data set):",
      "",
      "| change | method | signal stream − rounds | tokens ÷ rounds | decode steps ÷ rounds "
      "| cancelled tokens/prompt | rounds: token share of prompts at R·M |",
      "|---|---|---|---|---|---|---|",
    ]
    for s in result["sweep"]:
      lines.append(
        f"| {s['change']} | {s['method']} | {s['signal_diff']:+.4f} | {s['tokens_ratio']:.3f} "
        f"| {s['decode_steps_ratio']:.3f} | {s['stream_tokens_cancelled_per_prompt']:.0f} | "
        f"{s['capped_token_share']:.3f} |"
      )
  return "\n".join(lines)


def plot(results, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  plot_schedules(results, axes)
  fig.suptitle("Rounds vs stream: B=512, 1,024 slots, budget 2,048, lognormal lengths", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  main()
