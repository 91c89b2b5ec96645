"""Rounds vs stream at the paper's scale: decode steps, tokens and signal per method.

A thin CLI over `ada_jax.rl.simulate_stream` (see its docstring for the model): B = 512
prompts per step, a 2,048-token budget, lognormal response lengths (median 512, ~3 % at the
budget), the Beta-mix pass rates of `ada_jax.rl.simulate`, and a pool of 1,024 decode slots.
Each method runs in the one controller (`ada_jax.rl.controller`) under the `rounds` schedule
(the released barrier at the end of each round) and the `stream` schedule (exits at
segment boundaries, retired prompts' rows cancelled). Counts only, no model.

  python experiments/simulate_stream.py --out_dir experiments/results

Also pos and balance with the exit-chance rule (`SeqConfig.min_exit_chance`, rows
`<method>_stop<threshold>`), each under pass rates that stay fixed or drift between epochs
(`--drifts walk_sd:drift ...`).

Writes simulate_stream.json (git commit, config, every row per drift setting, the goal
check and a sweep of the stream knobs for pos and balance), simulate_stream.md (the tables)
and simulate_stream.png (the first drift setting) to --out_dir, and prints the JSON.
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
from ada_jax.rl import rules
from ada_jax.rl import simulate_stream as ss

# Paper (arXiv 2510.04996, 1.5B model): wall time per step relative to GRPO.
PAPER_WALL_TIME_RATIO = {"pos": 2.2, "balance": 2.8}
# The goal of the exit-chance rule: decode steps per RL step ÷ GRPO n = 4's, at the signal
# fraction of the released `rounds` (within SIGNAL_TOLERANCE).
GOAL = {"ada_pos": 1.6, "ada_balance": 2.0}
SIGNAL_TOLERANCE = 0.01

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
  {"min_pool": 4},  # n: exit on the first n graded (the default is a round's worth, M)
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
    if method in PAPER_WALL_TIME_RATIO:
      ax.plot(i, PAPER_WALL_TIME_RATIO[method], "k*", ms=11)
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


class OracleSeq(rules.Seq):
  """A bound, not a method: the Seq rule that knows each prompt's future. Once a round's
  worth is graded it stops exactly the prompts whose whole R·M budget (their first R·M
  responses, as `rounds` draws them) would hold one class only: no rule that keeps the
  signal and explores a round first can draw less."""

  step_draws = None  # the step's `simulate_stream._Draws` (set by `oracle_draws`)
  uniform: dict[int, bool] = {}  # this step: prompt -> its first R·M responses are uniform

  def hopeless(self, ctl, p, graded):
    if p not in self.uniform:  # once per prompt and step, not at every boundary
      d, cap = self.step_draws, ctl.config.seq.budget
      future = _FRESH(d.rates, d.sim, d.step, d.mix)  # the same responses, drawn afresh
      self.uniform[p] = len(set(future.draw(np.full(cap, p))[0].tolist())) == 1
    return self.uniform[p]


_FRESH = ss._Draws  # a step's draws, built without registering them for the oracle


def oracle_draws() -> None:
  """Registers the oracle rules (`pos_oracle`, `balance_oracle`) and lets them see each
  step's draws."""

  class Recorded(_FRESH):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      OracleSeq.step_draws = self
      OracleSeq.uniform.clear()

  ss._Draws = Recorded
  for method in ("pos", "balance"):
    rules.RULES[f"{method}_oracle"] = OracleSeq(rules.RULES[method].exit_thresholds)


def goal_check(rows: Mapping[str, Mapping[str, ss.ScheduleResult]]) -> dict[str, dict]:
  """Per method (pos, balance) and schedule, each of its rows (the released one and its
  exit-chance variants `<method>_stop<t>`): decode steps ÷ GRPO n = 4 (rounds), the signal
  fraction minus the released `rounds` row's, and whether both meet `GOAL`."""
  ref = rows["grpo_n4"]["rounds"].decode_steps
  out = {}
  for method, goal in GOAL.items():
    base = rows[method]["rounds"].signal_fraction
    out[method] = {}
    for name in [
      n for n in rows if n == method or n.startswith((method + "_stop", method + "_oracle"))
    ]:
      for schedule, r in rows[name].items():
        ratio, diff = r.decode_steps / ref, r.signal_fraction - base
        out[method][f"{name}/{schedule}"] = {
          "decode_steps_vs_grpo_n4": ratio,
          "signal_diff": diff,
          "stopped_fraction": r.stopped_fraction,
          "stopped_would_exit": r.stopped_would_exit,
          "meets_goal": bool(ratio <= goal and abs(diff) <= SIGNAL_TOLERANCE),
        }
  return out


def _paper(name: str) -> str:
  method = name.removeprefix("ada_")
  return f"{PAPER_WALL_TIME_RATIO[method]}×" if method in PAPER_WALL_TIME_RATIO else ""


def markdown_table(
  rows: Mapping[str, Mapping[str, ss.ScheduleResult]], reference: str = "grpo_n4"
) -> list[str]:
  """Lines of a Markdown table, one line per (row, schedule): samples, tokens and
  cancelled tokens per prompt, decode steps per RL step and their ratio to `reference`'s
  (rounds), slot utilisation, signal fraction, prompts stopped by the exit-chance rule and
  the share of them that would have exited, and the paper's wall time ÷ GRPO."""
  ref = rows[reference]["rounds"].decode_steps
  lines = [
    "| method | schedule | samples/prompt | tokens/prompt | tokens cancelled/prompt "
    "| decode steps/step | decode steps ÷ GRPO n=4 | slot utilisation | signal fraction "
    "| stopped | stopped that would exit | paper: wall time ÷ GRPO |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for name, by_schedule in rows.items():
    for schedule, r in by_schedule.items():
      lines.append(
        f"| {name} | {schedule} | {r.samples_per_prompt:.2f} | {r.tokens_per_prompt:.0f} | "
        f"{r.tokens_cancelled_per_prompt:.0f} | {r.decode_steps:.0f} | "
        f"{r.decode_steps / ref:.2f}× | {r.slot_utilisation:.2f} | {r.signal_fraction:.3f} | "
        f"{r.stopped_fraction:.3f} | {r.stopped_would_exit:.3f} | {_paper(name)} |"
      )
  return lines


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
  parser.add_argument(
    "--min_exit_chance",
    type=float,
    nargs="*",
    default=[0.05, 0.2, 0.5],
    help="thresholds of the exit-chance rows (pos and balance)",
  )
  parser.add_argument(
    "--drifts",
    nargs="*",
    default=["0:0"],
    help="pass-rate drift settings walk_sd:drift (per epoch, logit units), one table each",
  )
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
  oracle_draws()
  for name in ("ada_pos", "ada_balance"):
    for t in args.min_exit_chance:
      seq = dataclasses.replace(configs[name].seq, min_exit_chance=t)
      configs[f"{name}_stop{t:g}"] = dataclasses.replace(configs[name], seq=seq)
    method = f"{name.removeprefix('ada_')}_oracle"  # the bound (min_exit_chance: on)
    seq = dataclasses.replace(configs[name].seq, min_exit_chance=0.5)
    configs[f"{name}_oracle"] = dataclasses.replace(configs[name], method=method, seq=seq)
  by_drift, checks, tables = {}, {}, {}
  for setting in args.drifts:
    walk_sd, drift = (float(x) for x in setting.split(":"))
    variant = dataclasses.replace(sim, walk_sd=walk_sd, drift=drift)
    results = {
      name: {schedule: ss.simulate_schedule(cfg, schedule, variant) for schedule in ss.SCHEDULES}
      for name, cfg in configs.items()
    }
    ref = results["grpo_n4"]["rounds"].decode_steps
    by_drift[setting] = {
      name: {
        schedule: {**r.as_dict(), "decode_steps_vs_grpo_n4": r.decode_steps / ref}
        for schedule, r in by_schedule.items()
      }
      for name, by_schedule in results.items()
    }
    checks[setting], tables[setting] = goal_check(results), markdown_table(results)
    if setting == args.drifts[0]:
      first = results
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
  result = {
    "git_commit": metrics.git_commit(),
    "command": "python experiments/simulate_stream.py " + " ".join(sys.argv[1:]),
    "config": dataclasses.asdict(sim),
    "length_sigma": ss.length_sigma(sim.median_length, sim.budget, sim.at_budget),
    "methods": {k: v.as_dict() for k, v in configs.items()},
    "paper_wall_time_vs_grpo": PAPER_WALL_TIME_RATIO,
    "goal": {"decode_steps_vs_grpo_n4": GOAL, "signal_tolerance": SIGNAL_TOLERANCE},
    "notes": {
      "decode_steps": "slot-pool decode steps per RL step: the sampling part of wall time; "
      "the paper's ratios are whole-step wall time at 1.5B (sampling + grading + training)",
      "scored": f"epochs {args.warmup_epochs + 1}..{args.epochs} of "
      f"{args.num_prompts // args.batch} steps each",
      "goal": "pos <= 1.6x and balance <= 2.0x GRPO n=4's decode steps per step, at the "
      "signal fraction of the released rounds (within 0.01)",
      "drifts": "walk_sd:drift of the pass rates per epoch (logit units)",
    },
    "rows": by_drift,
    "goal_check": checks,
    "sweep": sweep,
    "table_markdown": tables,
    "seconds": round(time.time() - t0, 1),
  }
  out = pathlib.Path(args.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / "simulate_stream.json").write_text(json.dumps(result, indent=2) + "\n")
  (out / "simulate_stream.md").write_text(markdown(result) + "\n")
  plot(first, out / "simulate_stream.png")
  print(json.dumps(result, indent=2))


def markdown(result: dict) -> str:
  lines = [
    f"Rounds vs stream, slot-pool simulator (git {result['git_commit']}, `{result['command']}`)"
  ]
  for setting, table in result["table_markdown"].items():
    lines += ["", f"Pass-rate drift {setting} (walk_sd:drift per epoch):", "", *table]
    lines += [
      "",
      "Goal (pos <= 1.6x, balance <= 2.0x GRPO n=4 decode steps; signal within 0.01 of rounds):",
      "",
      "| row | decode steps ÷ GRPO n=4 | signal − rounds | stopped | of them would exit | meets |",
      "|---|---|---|---|---|---|",
    ]
    for by_row in result["goal_check"][setting].values():
      for row, c in by_row.items():
        lines.append(
          f"| {row} | {c['decode_steps_vs_grpo_n4']:.2f}× | {c['signal_diff']:+.4f} | "
          f"{c['stopped_fraction']:.3f} | {c['stopped_would_exit']:.3f} | {c['meets_goal']} |"
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
