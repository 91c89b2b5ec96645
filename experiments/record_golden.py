"""Golden outputs of one RL step's sampling, for every method under both schedules.

Records what the step decides, so that a restructure of the controller (one controller for
`rounds` and `stream`) can be checked to move no number (tests/test_golden_step.py):

* Bernoulli simulator (`ada_jax.rl.simulate_stream`, with response lengths and a slot
  pool, both schedules; `ada_jax.rl.simulate`, `rounds`): every row of
  `simulate_stream.method_rows` (GRPO n = 4 and 8, DAPO, pos, balance, released Est,
  the paper's Est), 3 seeds, a few steps each. Per step: the prompts, the selected
  responses by row id, their prompt index, rewards and advantages, the `StepStats` and the
  simulator's cost figures; per run the totals (`ScheduleResult`, `SimResult`).
* The tiny model (`loop.run` on `tests/test_loop.tiny_config`, 2 RL steps, random init,
  no warm start or evaluation) for each method, and Est with its learned head, under
  both schedules (seed 0; DAPO, pos and balance also seed 1): per step the same
  selection record, a hash of each selected response's tokens, the training batch's
  advantages, and `metrics.jsonl` without its timing figures. Rewards there come from
  `text_reward`, a deterministic rule on the response text and the reference answer, in
  place of the verifier pool: a random tiny model never writes a correct sum, and the
  rule gives prompts pass rates of 0, 1/4, 1/2 and 3/4, so groups are mixed, uniform,
  exit early or never (the verifier has its own tests).

Row ids are the controller's (`controller.Controller`), in queue order: under `rounds`
round after round, each round's rows prompt-major. The capture wraps the step's entry
points (`controller.run_step`, `update.make_train_batch`, `loop.Verifier`); code that moves
them re-points the capture, not the data.

  python experiments/record_golden.py            # rewrites tests/data/golden_step.json

Re-record only for an intended behaviour change, and say so in the commit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "golden_step.json"

SEEDS = (0, 1, 2)
SCHEDULES = ("rounds", "stream")
# The tiny model's methods per seed (the simulator runs every `simulate_stream.method_rows`
# row): every method once, and again those whose rows depend on earlier grades (DAPO's
# extra prompts, the Seq methods' later rounds / top-ups).
TINY_METHODS = ("grpo", "dapo", "pos", "balance", "est")
# Variants run like methods: Est with its learned head, whose features are the prompts'
# hidden states (the model's, unlike the simulator's toy features).
TINY_VARIANTS = {"est_head": ("est", {"est": {"estimator": "head"}})}
TINY_SEEDS = {0: (*TINY_METHODS, *TINY_VARIANTS), 1: ("dapo", "pos", "balance")}
TINY_STEPS = 2
# metrics.jsonl figures that depend on the clock or on what this process compiled before.
TIMING_METRICS = ("tokens_per_s", "time_sample_s", "time_grade_wait_s", "time_train_s", "compiles")


def sim_config(seed: int):
  """The simulator's scale: 4 steps of B = 6 prompts (1 warm-up epoch, Est's statistics)."""
  from ada_jax.rl.simulate_stream import StreamSimConfig

  return StreamSimConfig(
    batch=6,
    slots=12,
    budget=64,
    median_length=16.0,
    at_budget=0.05,
    segment=8,
    num_prompts=12,
    epochs=2,
    warmup_epochs=1,
    seed=seed,
  )


@contextlib.contextmanager
def patched(obj: Any, name: str, new: Any) -> Iterator[None]:
  """Sets `obj.name = new` for the block."""
  old = getattr(obj, name)
  setattr(obj, name, new)
  try:
    yield
  finally:
    setattr(obj, name, old)


def _jsonable(x: Any) -> Any:
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, (np.integer, np.floating, np.bool_)):
    return x.item()
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  return x


def selection_record(result) -> dict[str, Any]:
  """What a `StepResult` pins: prompts, selected row ids, rewards, advantages, stats."""
  return {
    "prompt_ids": [str(p) for p in result.prompt_ids],
    "rows": [int(h) for h in result.handles],
    "prompt_index": result.prompt_index.tolist(),
    "rewards": result.rewards.tolist(),
    "advantages": result.advantages.tolist(),
    "stats": _jsonable(
      {**dataclasses.asdict(result.stats), "pool_pass_rate": result.stats.pool_pass_rate}
    ),
  }


@contextlib.contextmanager
def capture_steps(records: list[dict[str, Any]]) -> Iterator[None]:
  """Records the `StepResult` of every `controller.run_step` call in the block."""
  from ada_jax.rl import controller

  run_step = controller.run_step

  def recorded(*args, **kwargs):
    result, est = run_step(*args, **kwargs)
    records.append(selection_record(result))
    return result, est

  with patched(controller, "run_step", recorded):
    yield


@contextlib.contextmanager
def compile_cache(path: str | pathlib.Path) -> Iterator[None]:
  """JAX's persistent compilation cache in `path` for the block, every program cached: the
  tiny runs' programs repeat from method to method (same shapes), and a cached program is
  the same executable, so no figure depends on whether the cache was used."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  new = {
    "jax_compilation_cache_dir": str(path),
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
  }
  old = {k: getattr(jax.config, k) for k in new}
  for k, v in new.items():
    jax.config.update(k, v)
  compilation_cache.reset_cache()  # JAX reads the cache settings once, at first use
  try:
    yield
  finally:
    for k, v in old.items():
      jax.config.update(k, v)
    compilation_cache.reset_cache()


# ------------------------------------------------------------------ the simulators


def record_bernoulli(seeds=SEEDS) -> dict[str, Any]:
  """Per method row, schedule and seed: the steps of `simulate_stream.simulate_schedule`
  (with its per-step cost figures), and of `simulate.simulate` (rounds), with totals."""
  from ada_jax.rl import simulate, simulate_stream

  out: dict[str, Any] = {}
  for name, cfg in simulate_stream.method_rows().items():
    for seed in seeds:
      sim = sim_config(seed)
      for schedule in SCHEDULES:
        steps: list[dict[str, Any]] = []
        costs: list[dict[str, Any]] = []
        step_fn = simulate_stream._step

        def costed(*args, step_fn=step_fn, costs=costs):
          res, est_state, stats = step_fn(*args)
          costs.append(_jsonable(stats))
          return res, est_state, stats

        with capture_steps(steps), patched(simulate_stream, "_step", costed):
          total = simulate_stream.simulate_schedule(cfg, schedule, sim)
        for s, c in zip(steps, costs, strict=True):
          s["sim"] = c
        out[f"stream_sim/{name}/{schedule}/seed{seed}"] = {
          "steps": steps,
          "total": _jsonable(total.as_dict()),
        }
      steps = []
      rates = simulate.sample_pass_rates(np.random.default_rng([seed, 7]), 12)
      with capture_steps(steps):
        total = simulate.simulate(cfg, rates, batch=6, epochs=2, warmup_epochs=1, seed=seed)
      out[f"bernoulli/{name}/rounds/seed{seed}"] = {
        "steps": steps,
        "total": _jsonable(total.as_dict()),
      }
  return out


# ------------------------------------------------------------------ the tiny model


def text_reward(text: str, answer: str) -> float:
  """1.0 when the response's character sum mod 4 is below the answer's last digit mod 4:
  pass rate 0, 1/4, 1/2 or 3/4 per prompt for a random policy. Deterministic."""
  digits = [c for c in answer if c.isdigit()]
  level = int(digits[-1]) % 4 if digits else 0
  return float(sum(map(ord, text)) % 4 < level)


class TextVerifier:
  """`verifier.Verifier`'s interface (submit / collect, a context manager), in process,
  grading with `text_reward`."""

  def __init__(self, config=None):
    self.config = config
    self._done: dict[int, list[float]] = {}

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False

  def submit(self, responses, references) -> int:
    ticket = len(self._done)
    self._done[ticket] = [text_reward(t, a) for t, a in zip(responses, references, strict=True)]
    return ticket

  def collect(self, ticket) -> list[float]:
    return self._done.pop(ticket)

  def score(self, responses, references) -> list[float]:
    return self.collect(self.submit(responses, references))


def tiny_run_config(method: str, schedule: str, seed: int):
  """`tests/test_loop.tiny_config` for `TINY_STEPS` RL steps: random init (no warm start),
  no evaluation, `method` (or a `TINY_VARIANTS` name) under `schedule`."""
  if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))
  from test_loop import tiny_config

  from configs import tiny_arith_pos

  c = tiny_config(steps=TINY_STEPS, schedule=schedule)
  # Pinned here, not by test_loop: its stream runs count every response positive.
  if "positive_threshold" not in tiny_arith_pos.get_config().ada:
    if "positive_threshold" in c.ada:
      del c.ada["positive_threshold"]
  c.seed = seed
  method, overrides = TINY_VARIANTS.get(method, (method, {}))
  c.ada.method = method
  c.ada.update(overrides)
  c.warmstart = None
  c.eval.benchmarks = ()
  return c


def _row_advantages(batch) -> np.ndarray:
  """Each row's advantage (0 for a row of padding): the value at its first real token."""
  real = np.asarray(batch.segments) > 0
  first = real.argmax(1)
  adv = np.asarray(batch.advantages)[np.arange(len(first)), first]
  return np.where(real.any(1), adv, 0.0)


def _row_hash(tokens: np.ndarray, length: int) -> str:
  return hashlib.sha1(np.asarray(tokens[:length], np.int32).tobytes()).hexdigest()[:16]


def record_tiny(seeds: dict[int, tuple[str, ...]] = TINY_SEEDS, schedules=SCHEDULES) -> dict:
  """Per seed, method (`seeds`: seed -> methods) and schedule: `TINY_STEPS` steps of
  `loop.run`; per step the selection, the selected responses' token hashes, the batch's
  advantages and the non-timing metrics."""
  from ada_jax import loop
  from ada_jax.metrics import read_jsonl
  from ada_jax.rl import update

  out: dict[str, Any] = {}
  for seed, method in [(seed, m) for seed, methods in seeds.items() for m in methods]:
    for schedule in schedules:
      steps: list[dict[str, Any]] = []
      batches: list[dict[str, Any]] = []
      make_batch = update.make_train_batch

      def recording_batch(result, responses, *args, batches=batches, make_batch=make_batch, **kw):
        batch = make_batch(result, responses, *args, **kw)
        h = np.asarray(result.handles, np.int64)
        batches.append(
          {
            "response_hashes": [
              _row_hash(responses["tokens"][i], int(responses["lengths"][i])) for i in h
            ],
            "response_lengths": responses["lengths"][h].tolist(),
            "batch_advantages": _row_advantages(batch).tolist(),
            "batch_loss_tokens": int(np.asarray(batch.loss_mask).sum()),
          }
        )
        return batch

      with tempfile.TemporaryDirectory() as workdir, contextlib.ExitStack() as stack:
        stack.enter_context(capture_steps(steps))
        stack.enter_context(patched(update, "make_train_batch", recording_batch))
        stack.enter_context(patched(loop, "Verifier", TextVerifier))
        loop.run(tiny_run_config(method, schedule, seed), workdir)
        metrics = read_jsonl(pathlib.Path(workdir) / "metrics.jsonl")
      metrics = [m for m in metrics if "ada/rows_selected" in m]  # the RL steps' lines
      if not len(steps) == len(metrics) == TINY_STEPS:
        raise RuntimeError(f"{method}/{schedule}: {len(steps)} steps, {len(metrics)} metrics")
      if len(batches) != TINY_STEPS:  # dapo skips the update when no group is mixed
        raise RuntimeError(f"{method}/{schedule}: a step built no training batch")
      for s, b, m in zip(steps, batches, metrics, strict=True):
        s.update(b)
        s["metrics"] = {k: v for k, v in m.items() if k not in TIMING_METRICS}
      out[f"tiny/{method}/{schedule}/seed{seed}"] = {"steps": steps}
  return out


def record() -> dict[str, Any]:
  """The whole golden set (without its header)."""
  return {**record_bernoulli(), **record_tiny()}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=str(GOLDEN), help="the JSON file written")
  args = parser.parse_args(argv)
  # The test suite's devices (tests/conftest.py), set before JAX starts: the mesh, and so
  # the sharded reductions of the tiny model's update, are those the test sees.
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, str(ROOT))
  from ada_jax import metrics

  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as cache, compile_cache(cache):
    runs = record()
  doc = {
    "git_commit": metrics.git_commit(ROOT),
    "command": "python experiments/record_golden.py",
    "runs": runs,
  }
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(doc, separators=(",", ":"), sort_keys=True) + "\n")
  print(f"{len(runs)} runs, {path.stat().st_size / 1e3:.0f} kB -> {path} "
        f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
  return 0


if __name__ == "__main__":
  sys.exit(main())
