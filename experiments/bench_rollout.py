"""Slot pool vs the static chunk engine on response lengths that follow a set schedule.

  python experiments/bench_rollout.py [--prompts 256 --rows 8 --budget 128 --slots 128]
      [--out experiments/results/bench_rollout.json]

The model is a counter: a tiny decoder (random weights, real shapes and compute) whose
blocks add nothing to the residual stream and whose output head maps token t to t + 1
with near certainty, except after the prompt's last token, where the next-token logits are
the log-probabilities of a length schedule. So each row's first sampled token fixes its
length (the stop token is reached after exactly that many steps), lengths are i.i.d.
across rows and drawn by the engines' own sampling, and the decode work is that of any
model of these shapes. Schedules:

* `lognormal`: median a quarter of the budget, ~3% of rows at the budget;
* `at_budget`: no row stops before the budget.

For each schedule, both engines run on the same rows: "today" is the static chunk
sampler as of `--baseline` (loaded from git history), "pool" the slot pool of this tree.
Reported: `token_slot_utilization` (useful tokens ÷ rows × decode steps) and
`kv_read_useful_fraction` (cache columns read holding a live row's real tokens ÷ columns
read), both from counts; the wall times of both engines interleaved (`--alternations`,
medians) and their ratio; compiles during the timed runs. Prints one JSON object (with
the git commit and the arguments) and writes it to `--out`.
"""

import argparse
import importlib.util
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from ada_jax import metrics
from ada_jax.models import decoder as model_lib
from ada_jax.rollout import sampler as sampler_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASELINE = "4bd179b"  # the last commit of the static chunk engine
START = 1  # the prompt's last token; the counter runs over tokens START + 1 ... V - 1


def load_baseline(commit: str):
  """The `ada_jax.rollout.sampler` module as of `commit`, imported from git history."""
  source = subprocess.run(
    ["git", "-C", str(ROOT), "show", f"{commit}:ada_jax/rollout/sampler.py"],
    check=True,
    capture_output=True,
    text=True,
  ).stdout
  path = pathlib.Path(tempfile.mkdtemp()) / "chunk_sampler.py"
  path.write_text(source)
  spec = importlib.util.spec_from_file_location("chunk_sampler", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def length_pmf(schedule: str, budget: int) -> np.ndarray:
  """`float64[budget]`: P(length = L + 1) for L = 0..budget-1; the last entry holds every
  length >= budget (those rows end at the budget)."""
  if schedule == "at_budget":
    pmf = np.zeros(budget)
    pmf[-1] = 1.0
    return pmf
  median = budget / 4
  sigma = math.log(4) / 1.8808  # 1.8808: the standard normal's 97% quantile
  normal_cdf = np.vectorize(lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2))))
  cdf = normal_cdf(np.log((np.arange(1, budget + 1) + 0.5) / median) / sigma)
  pmf = np.diff(np.concatenate([[0.0], cdf]))
  pmf[-1] += 1 - cdf[-1]
  return pmf


def counter_model(schedule: str, budget: int, dim: int, layers: int):
  """(config, params, stop token): see the module docstring."""
  vocab = budget + 8
  config = model_lib.ModelConfig(
    family="llama",
    vocab_size=vocab,
    embed_dim=dim,
    mlp_dim=3 * dim,
    num_layers=layers,
    num_heads=dim // 32,
    num_kv_heads=max(1, dim // 64),
    head_dim=32,
    rope_theta=500_000.0,
    tie_embeddings=False,
    max_position_embeddings=4 * budget + 1024,
  )
  params = model_lib.init_params(config, jax.random.key(0))
  for i in range(layers):  # blocks compute but add nothing: the residual is the embedding
    params[f"layer_{i}"]["attn"]["o"] = jnp.zeros_like(params[f"layer_{i}"]["attn"]["o"])
    params[f"layer_{i}"]["mlp"]["down"] = jnp.zeros_like(params[f"layer_{i}"]["mlp"]["down"])
  rng = np.random.default_rng(0)
  embed = rng.standard_normal((vocab, dim))
  embed[:, 0] = 0.0  # dimension 0 is the prompt token's alone
  embed[START] = 0.0
  embed[START, 0] = np.sqrt(dim)  # unit RMS, like the others
  stop = vocab - 1
  head = np.zeros((vocab, dim))
  head[START + 2 :, 1:] = 50.0 / dim * embed[START + 1 : -1, 1:]  # t -> t + 1
  pmf = length_pmf(schedule, budget)
  # A row that starts at token s reaches `stop` after stop - s + 1 tokens.
  first = stop - np.arange(budget)
  logp = np.full(vocab, -1e4)
  logp[first] = np.log(np.maximum(pmf, 1e-30))
  head[:, 0] = logp / np.sqrt(dim)
  params["embed"] = jnp.asarray(embed, params["embed"].dtype)
  params["lm_head"] = jnp.asarray(head, params["lm_head"].dtype)
  return config, params, stop


def chunk_counts(packing, lengths, chunk_rows, cache_len, prompt_len):
  """Counts for the static chunk engine from its packing and the rows' lengths."""
  steps = sum(int(lengths[rows].max()) for rows, _ in packing)
  useful = float(sum(prompt_len * (n - 1) + n * (n - 1) / 2 for n in lengths))
  return {
    "slot_steps": chunk_rows * steps,
    "kv_read": float(chunk_rows * steps * cache_len),
    "kv_useful": useful,
  }


def _setup(args):
  """(prompts, row -> prompt, the engines' shared `Sampler` arguments) of `args`."""
  rng = np.random.default_rng(0)
  prompts = rng.integers(START + 1, 8, (args.prompts, args.prompt_len)).tolist()
  for p in prompts:
    p[-1] = START
  rows = np.repeat(np.arange(args.prompts), args.rows)
  common = dict(
    max_new_tokens=args.budget,
    chunk_rows=args.slots,
    prompts_per_chunk=max(1, args.slots // args.rows),
    prompt_buckets=(args.prompt_len,),
  )
  return prompts, rows, common


def pool_only(args) -> None:
  """One process's pool: a warm-up, then one timed `generate` per schedule (JSON line)."""
  prompts, rows, common = _setup(args)
  out = {}
  for schedule in args.schedules.split(","):
    config, params, stop = counter_model(schedule, args.budget, args.dim, args.layers)
    pool = sampler_lib.Sampler(
      config, rule=sampler_lib.SamplingRule(temperature=1.0), stop_ids=[stop], **common
    )
    pool.generate(params, prompts, rows, jax.random.key(0))
    start = time.perf_counter()
    res, _ = pool.generate(params, prompts, rows, jax.random.key(1))
    out[schedule] = {"wall_s": time.perf_counter() - start, "tokens": int(res["lengths"].sum())}
  print(json.dumps(out))


def pool_vs(args) -> None:
  """This tree's pool (B) against COMMIT's (A): each run a fresh process (compiles outside
  the timed call), A B A B ..., medians and the per-pair ratio B / A."""
  import shutil

  base = pathlib.Path(tempfile.mkdtemp(prefix="pool_vs_"))
  archive = subprocess.run(
    ["git", "-C", str(ROOT), "archive", args.pool_vs, "ada_jax"], check=True, capture_output=True
  ).stdout
  subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
  trees = {"baseline": str(base), "this": str(ROOT)}
  keep = ["--prompts", "--rows", "--budget", "--prompt_len", "--slots", "--dim", "--layers"]
  flags = [f"{k}={getattr(args, k[2:])}" for k in keep] + [f"--schedules={args.schedules}"]
  runs = {name: [] for name in trees}
  for k in range(args.alternations):
    for name in trees if k % 2 == 0 else reversed(list(trees)):
      env = dict(os.environ, PYTHONPATH=trees[name])
      child = subprocess.run(
        [sys.executable, __file__, "--pool_only", *flags], env=env, capture_output=True, text=True,
        check=True, cwd=trees[name],
      )  # fmt: skip
      runs[name].append(json.loads(child.stdout.strip().splitlines()[-1]))
      print(f"{name}: {runs[name][-1]}", file=sys.stderr, flush=True)
  shutil.rmtree(base, ignore_errors=True)
  result = {"git_commit": metrics.git_commit(), "baseline_commit": args.pool_vs, "args": vars(args)}
  for schedule in args.schedules.split(","):
    wall = {n: [r[schedule]["wall_s"] for r in runs[n]] for n in trees}
    result[schedule] = {
      "wall_s": {n: [round(t, 3) for t in w] for n, w in wall.items()},
      "wall_s_median": {n: round(statistics.median(w), 3) for n, w in wall.items()},
      "ratio_this_over_baseline_median": round(
        statistics.median(b / a for a, b in zip(wall["baseline"], wall["this"], strict=True)), 3
      ),
      "tokens": {n: runs[n][0][schedule]["tokens"] for n in trees},
    }
  text = json.dumps(result, indent=1)
  print(text)
  pathlib.Path(args.out).write_text(text + "\n")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--prompts", type=int, default=256)
  parser.add_argument("--rows", type=int, default=8, help="rows (responses) per prompt")
  parser.add_argument("--budget", type=int, default=128, help="max_new_tokens")
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--slots", type=int, default=128, help="pool slots = chunk rows")
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--alternations", type=int, default=3)
  parser.add_argument("--schedules", default="lognormal,at_budget")
  parser.add_argument("--baseline", default=BASELINE)
  parser.add_argument("--out", default=str(ROOT / "experiments/results/bench_rollout.json"))
  parser.add_argument(
    "--pool_vs",
    default="",
    metavar="COMMIT",
    help="instead: this tree's pool against the pool of COMMIT, each in its own process, "
    "interleaved --alternations times; writes --out",
  )
  parser.add_argument("--pool_only", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.pool_vs:
    return pool_vs(args)
  if args.pool_only:
    return pool_only(args)

  chunked_lib = load_baseline(args.baseline)
  prompts, rows, common = _setup(args)
  result = {
    "git_commit": metrics.git_commit(),
    "baseline_commit": args.baseline,
    "args": vars(args),
    "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
    "schedules": {},
  }
  for schedule in args.schedules.split(","):
    config, params, stop = counter_model(schedule, args.budget, args.dim, args.layers)
    rule = sampler_lib.SamplingRule(temperature=1.0)
    today = chunked_lib.Sampler(config, rule=chunked_lib.SamplingRule(), stop_ids=[stop], **common)
    pool = sampler_lib.Sampler(config, rule=rule, stop_ids=[stop], **common)
    engines = {"today": today, "pool": pool}
    runs = {name: [] for name in engines}
    outs = {}
    for name, engine in engines.items():  # warm-up: compiles
      start = time.perf_counter()
      outs[name], stats = engine.generate(params, prompts, rows, jax.random.key(0))
      print(f"{schedule} {name} warm-up: {time.perf_counter() - start:.2f} s", file=sys.stderr)
      if name == "pool":
        outs["pool_stats"] = stats
    with metrics.CompileCounter() as compiles:
      for k in range(args.alternations):
        for name, engine in engines.items() if k % 2 == 0 else reversed(engines.items()):
          start = time.perf_counter()
          engine.generate(params, prompts, rows, jax.random.key(1 + k))
          runs[name].append(time.perf_counter() - start)
          print(f"{schedule} {name}: {runs[name][-1]:.2f} s", file=sys.stderr, flush=True)
    lengths = {n: outs[n]["lengths"] for n in engines}
    cache_len = args.prompt_len + args.budget
    counts = {
      "today": chunk_counts(
        today._pack(rows), lengths["today"], args.slots, cache_len, args.prompt_len
      ),
      "pool": {
        "slot_steps": outs["pool_stats"].slot_steps,
        "kv_read": outs["pool_stats"].kv_read,
        "kv_useful": outs["pool_stats"].kv_useful,
      },
    }
    entry = {}
    for name in engines:
      c, n = counts[name], lengths[name]
      entry[name] = {
        "tokens": int(n.sum()),
        "median_length": float(np.median(n)),
        "at_budget_fraction": float(np.mean(n == args.budget)),
        "token_slot_utilization": round(n.sum() / c["slot_steps"], 4),
        "kv_read_useful_fraction": round(c["kv_useful"] / c["kv_read"], 4),
        "wall_s": [round(t, 3) for t in runs[name]],
        "wall_s_median": round(statistics.median(runs[name]), 3),
      }
    entry["pool_over_today_wall"] = round(
      entry["pool"]["wall_s_median"] / entry["today"]["wall_s_median"], 3
    )
    entry["compiles_after_warm_up"] = compiles.count
    result["schedules"][schedule] = entry
    print(json.dumps({schedule: entry}), file=sys.stderr, flush=True)
  text = json.dumps(result, indent=1)
  print(text)
  pathlib.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
  main()
