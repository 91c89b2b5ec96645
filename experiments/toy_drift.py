"""How often training turns a prompt that was all wrong right again an epoch later: on the
toy, and in the slot-pool simulator for a grid of pass-rate drifts.

The exit-chance rule (`SeqConfig.min_exit_chance`) judges a prompt by its earlier epochs,
so its value depends on how much pass rates move between epochs. This measures that on the
real toy run and finds the simulator drift that matches it:

* toy: `configs/tiny_arith_pos.py` (pos, rounds, its warm start), `--steps` RL steps on
  `--train_prompts` problems (B = 64: an epoch every train_prompts / 64 steps), in process,
  every step's pools captured (`controller.run_step`);
* simulator: `simulate_stream` at the paper's scale (pos, rounds), pass rates moving by a
  logit random walk of `--walk_sd` plus a drift per epoch, for each `--drifts` value;
* the figure: of the prompt visits whose whole pool was wrong, the fraction whose next
  visit (an epoch later) drew a correct response.

  python experiments/toy_drift.py --out experiments/results/toy_drift.json

Prints and writes the JSON (git commit, the commands' settings, both figures, the chosen
drift).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
import sys
import tempfile
import time
from collections.abc import Iterator

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ada_jax import loop  # noqa: E402
from ada_jax import metrics as metrics_lib  # noqa: E402
from ada_jax.rl import controller  # noqa: E402
from ada_jax.rl import simulate_stream as ss  # noqa: E402
from ada_jax.rl.rules import AdaConfig, SeqConfig  # noqa: E402
from configs import tiny_arith_pos  # noqa: E402


@contextlib.contextmanager
def captured_pools(visits: list[tuple[str, float]]) -> Iterator[None]:
  """Appends (prompt id, pool pass rate) of each of a step's B prompts for every
  `controller.run_step` call in the block."""
  run_step = controller.run_step

  def recorded(config, prompt_ids, *args, **kwargs):
    result, est = run_step(config, prompt_ids, *args, **kwargs)
    rates = result.stats.pool_pass_rate[: len(prompt_ids)]
    visits.extend(zip(map(str, prompt_ids), rates.tolist(), strict=True))
    return result, est

  controller.run_step = recorded
  try:
    yield
  finally:
    controller.run_step = run_step


def wrong_then_right(visits: list[tuple[str, float]]) -> dict[str, float]:
  """Of the visits with an all-wrong pool that have a next visit, the fraction whose next
  visit's pool holds a correct response (and how many visits that is)."""
  last: dict[str, float] = {}
  wrong = right = 0
  for pid, rate in visits:
    if pid in last and last[pid] == 0.0:
      wrong += 1
      right += rate > 0
    last[pid] = rate
  return {"all_wrong_then_right": right / max(wrong, 1), "all_wrong_visits": wrong}


def toy(steps: int, train_prompts: int, seed: int) -> dict[str, float]:
  c = tiny_arith_pos.get_config()
  c.rl.steps, c.data.arith_prompts, c.seed = steps, train_prompts, seed
  c.eval.benchmarks, c.ckpt.every_steps = (), 0
  visits: list[tuple[str, float]] = []
  with tempfile.TemporaryDirectory() as workdir, captured_pools(visits):
    loop.run(c, workdir)
  return wrong_then_right(visits)


def simulated(walk_sd: float, drift: float, sim: ss.StreamSimConfig) -> dict[str, float]:
  cfg = AdaConfig(method="pos", n=4, seq=SeqConfig(samples_per_round=8, max_rounds=4))
  visits: list[tuple[str, float]] = []
  with captured_pools(visits):
    ss.simulate_schedule(cfg, "rounds", dataclasses.replace(sim, walk_sd=walk_sd, drift=drift))
  return wrong_then_right(visits)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="experiments/results/toy_drift.json")
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--train_prompts", type=int, default=1280)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--walk_sd", type=float, default=0.5)
  parser.add_argument("--drifts", type=float, nargs="*", default=[0.0, 0.25, 0.5, 1.0, 2.0])
  parser.add_argument("--epochs", type=int, default=4)
  args = parser.parse_args()
  start = time.perf_counter()
  measured = toy(args.steps, args.train_prompts, args.seed)
  sim = ss.StreamSimConfig(epochs=args.epochs)
  grid = {f"{args.walk_sd:g}:{d:g}": simulated(args.walk_sd, d, sim) for d in args.drifts}
  grid["0:0"] = simulated(0.0, 0.0, sim)
  target = measured["all_wrong_then_right"]
  chosen = min(grid, key=lambda k: abs(grid[k]["all_wrong_then_right"] - target))
  result = {
    "git_commit": metrics_lib.git_commit(REPO),
    "command": "python experiments/toy_drift.py " + " ".join(sys.argv[1:]),
    "toy": {
      "config": "configs/tiny_arith_pos.py",
      "steps": args.steps,
      "train_prompts": args.train_prompts,
      "seed": args.seed,
      **measured,
    },  # fmt: skip
    "simulator": {"config": dataclasses.asdict(sim), "by_walk_sd_drift": grid},
    "chosen_walk_sd_drift": chosen,
    "seconds": round(time.perf_counter() - start, 1),
  }
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
