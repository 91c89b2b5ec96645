"""Calibrates the CPU toy: how a warm-started tiny model's pass rates spread over levels.

  python experiments/calibrate_arith.py --candidates=recommended [--k 16 --prompts 64]

For each candidate setting (model size, supervised warm-start steps / learning rate /
batch, levels trained), the script warm-starts a fresh model (`ada_jax.warmstart`), then
per difficulty level samples k responses at temperature 1.0 for `--prompts` training-split
prompts with `ada_jax.sampler.Sampler`, scores them with the RL reward (last `\\boxed{}`,
exact match after normalisation: `rewards.JUDGES['exact']`) and records each prompt's pass
rate. It also measures greedy accuracy on held-out (test-split) problems of each level.

A candidate's RL prompt mixes are scored from the per-level measurements (a mix with level
weights w has bucket fraction Σ_L w_L · fraction_L), so one sampling pass rates every mix.
Buckets: pass rate 0, (0, 0.25], (0.25, 0.5), [0.5, 0.75), ≥ 0.75, and the share strictly
inside (0, 0.5), where Reinforce-Ada differs from GRPO (DESIGN.md §6).

Results merge into experiments/results/calibrate_arith.json (keyed by candidate name, so
candidates can be run one at a time on a busy machine) and the PNG redraws from all stored
candidates. Wall times are those of this machine at the time (2 shared cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

import jax
import numpy as np

from ada_jax import arith, rewards, warmstart
from ada_jax import model as model_lib
from ada_jax import sampler as sampler_lib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
BUCKETS = ("zero", "(0,0.25]", "(0.25,0.5)", "[0.5,0.75)", ">=0.75")


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One setting to calibrate.

  Attributes:
    embed_dim, num_layers, mlp_dim, num_heads: the llama-family model (head_dim =
      embed_dim / num_heads, no GQA, untied embeddings).
    warm: the supervised warm start (its `task` says which levels are trained).
    eval_levels: levels whose pass rates are measured.
    rl_mixes: name -> (levels, weights) of candidate RL prompt mixes, scored from the
      per-level measurements.
    init_seed: seed of the random initial parameters.
  """

  embed_dim: int = 128
  num_layers: int = 3
  mlp_dim: int = 512
  num_heads: int = 4
  warm: warmstart.WarmStartConfig = warmstart.WarmStartConfig()
  eval_levels: tuple[int, ...] = (1, 2, 3, 4)
  rl_mixes: tuple[tuple[str, tuple[int, ...], tuple[float, ...]], ...] = (
    ("L1-3", (1, 2, 3), (1.0, 1.0, 1.0)),
    ("L2-3", (2, 3), (1.0, 1.0)),
    ("L2-3 (1:2)", (2, 3), (1.0, 2.0)),
    ("L3", (3,), (1.0,)),
    ("L2-4", (2, 3, 4), (1.0, 1.0, 1.0)),
  )
  init_seed: int = 0

  def model_config(self, vocab_size: int) -> model_lib.ModelConfig:
    return model_lib.ModelConfig(
      family="llama",
      vocab_size=vocab_size,
      embed_dim=self.embed_dim,
      mlp_dim=self.mlp_dim,
      num_layers=self.num_layers,
      num_heads=self.num_heads,
      num_kv_heads=self.num_heads,
      head_dim=self.embed_dim // self.num_heads,
      rope_theta=10_000.0,
      max_position_embeddings=64,
    )


_ADD_SUB = ("+", "-")


def _warm(steps=600, lr=3e-3, batch=64, levels=(1, 2, 3), weights=(), ops=_ADD_SUB):
  task = arith.ArithConfig(levels=levels, level_weights=weights, ops=ops)
  return warmstart.WarmStartConfig(steps=steps, learning_rate=lr, batch_size=batch, task=task)


CANDIDATES: dict[str, Candidate] = {
  "recommended": Candidate(),
  "d128L3_s600_lr3e-3": Candidate(warm=_warm()),
  "d128L3_s600_lr1e-2": Candidate(warm=_warm(lr=1e-2)),
  "d128L3_s600_mix132": Candidate(warm=_warm(weights=(1.0, 3.0, 2.0))),
  "d96L3_s900": Candidate(embed_dim=96, mlp_dim=384, warm=_warm(steps=900)),
  "d128L2_s800": Candidate(num_layers=2, warm=_warm(steps=800)),
  "add_d96L3_s900_mix132": Candidate(
    embed_dim=96, mlp_dim=384, warm=_warm(steps=900, weights=(1.0, 3.0, 2.0), ops=("+",))
  ),
  "add_d96L3_s400_lr1e-3": Candidate(
    embed_dim=96, mlp_dim=384, warm=_warm(steps=400, lr=1e-3, weights=(1.0, 3.0, 2.0), ops=("+",))
  ),
  "add_d96L3_s400": Candidate(
    embed_dim=96, mlp_dim=384, warm=_warm(steps=400, weights=(1.0, 3.0, 2.0), ops=("+",))
  ),
  "add_d96L3_s400_seed1": Candidate(
    embed_dim=96, mlp_dim=384, init_seed=1,
    warm=dataclasses.replace(_warm(steps=400, weights=(1.0, 3.0, 2.0), ops=("+",)), seed=1),
  ),
  "add_d96L3_s400_seed2": Candidate(
    embed_dim=96, mlp_dim=384, init_seed=2,
    warm=dataclasses.replace(_warm(steps=400, weights=(1.0, 3.0, 2.0), ops=("+",)), seed=2),
  ),
  **{
    f"add_d96L3_t{t}_seed{seed}": Candidate(
      embed_dim=96, mlp_dim=384, init_seed=seed,
      warm=dataclasses.replace(
        _warm(steps=1200, weights=(1.0, 3.0, 2.0), ops=("+",)), seed=seed, target_accuracy=t
      ),
    )
    for t in (0.6, 0.7)
    for seed in (0, 1, 2)
  },
  **{
    f"add_d96L3_L3t{t}_seed{seed}": Candidate(
      embed_dim=96, mlp_dim=384, init_seed=seed,
      warm=dataclasses.replace(
        _warm(steps=1200, weights=(1.0, 3.0, 2.0), ops=("+",)), seed=seed,
        target_accuracy=t, target_level=3,
      ),
    )
    for t in (0.25, 0.35)
    for seed in (0, 1, 2)
  },
  **{
    f"add_d96L3_L2t{t}_seed{seed}": Candidate(
      embed_dim=96, mlp_dim=384, init_seed=seed,
      warm=dataclasses.replace(
        _warm(steps=1200, weights=(1.0, 3.0, 2.0), ops=("+",)), seed=seed,
        target_accuracy=t, target_level=2,
      ),
    )
    for t in (0.6, 0.7)
    for seed in (0, 1, 2)
  },
  "d96L3_s1500": Candidate(embed_dim=96, mlp_dim=384, warm=_warm(steps=1500)),
  "d96L3_s900_lr1e-3": Candidate(embed_dim=96, mlp_dim=384, warm=_warm(steps=900, lr=1e-3)),
}


def bucket_fractions(pass_rates: np.ndarray) -> dict[str, float]:
  """Share of prompts per pass-rate bucket, plus `mid` = share strictly inside (0, 0.5)."""
  p = np.asarray(pass_rates, np.float64)
  out = {
    "zero": np.mean(p == 0),
    "(0,0.25]": np.mean((p > 0) & (p <= 0.25)),
    "(0.25,0.5)": np.mean((p > 0.25) & (p < 0.5)),
    "[0.5,0.75)": np.mean((p >= 0.5) & (p < 0.75)),
    ">=0.75": np.mean(p >= 0.75),
    "mid": np.mean((p > 0) & (p < 0.5)),
  }
  return {k: round(float(v), 4) for k, v in out.items()}


def score(tok, sampled: dict[str, np.ndarray], answers: list[str]) -> np.ndarray:
  """0/1 reward of each sampled row against its reference (the RL `exact` judge)."""
  texts = tok.decode_many([t[:n] for t, n in zip(sampled["tokens"], sampled["lengths"])])
  judge = rewards.JUDGES["exact"]
  return np.asarray(
    [judge(t, a, None, rewards.MAX_ANSWER_CHARS)[0] for t, a in zip(texts, answers)], np.float32
  )


def measure_level(tok, sampler, greedy, params, level, cand, args, rng):
  """Pass rates at temperature 1 (train split) and greedy accuracy (test split) of a level."""
  task = dataclasses.replace(cand.warm.task, levels=(level,), level_weights=())
  train = arith.examples(task, "train", args.prompts, seed=10_000 + level)
  prompts = [arith.prompt_ids(tok, e["problem"]) for e in train]
  rows = np.repeat(np.arange(len(prompts)), args.k)
  out, stats = sampler.generate(params, prompts, rows, jax.random.fold_in(rng, level))
  r = score(tok, out, [train[i]["answer"] for i in rows]).reshape(len(prompts), args.k)
  rates = r.mean(1)
  test = arith.examples(task, "test", args.heldout, seed=20_000 + level)
  g, _ = greedy.generate(
    params, [arith.prompt_ids(tok, e["problem"]) for e in test], np.arange(len(test)), rng
  )
  greedy_acc = float(score(tok, g, [e["answer"] for e in test]).mean())
  return {
    "mean_pass_rate": round(float(rates.mean()), 4),
    "greedy_heldout_accuracy": round(greedy_acc, 4),
    "buckets": bucket_fractions(rates),
    "pass_rates": rates.round(4).tolist(),
    "sample_wall_s": round(stats.wall_s, 2),
    "mean_response_tokens": round(float(out["lengths"].mean()), 2),
  }


def run_candidate(name: str, cand: Candidate, args) -> dict:
  tok = arith.load_tokenizer()
  config = cand.model_config(tok.vocab_size)
  params = model_lib.init_params(config, jax.random.key(cand.init_seed))
  params, metrics = warmstart.warm_start(config, params, tok, cand.warm, progress=True)
  print(
    f"[{name}] warm start {metrics['wall_s']:.1f} s, {metrics['steps_run']} steps, "
    f"final loss {metrics['loss'][-20:].mean():.3f}"
  )
  if args.save_params:
    flat = {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}
    pathlib.Path(args.save_params).mkdir(parents=True, exist_ok=True)
    np.savez(pathlib.Path(args.save_params) / f"{name}.npz", **flat)
  max_level = max(cand.eval_levels)
  answer_digits = max({"+": max_level + 1, "-": max_level, "*": 2 * max_level}[o]
                      for o in cand.warm.task.ops)
  max_new = len(arith.response_ids(tok, "9" * answer_digits)) + 2  # slack: wrong, long answers
  common = dict(max_new_tokens=max_new, stop_ids=tok.eos_ids, chunk_rows=256,
                prompt_buckets=(8, 16, 24), pad_id=tok.pad_id)
  sampler = sampler_lib.Sampler(config, rule=sampler_lib.SamplingRule(temperature=1.0),
                                prompts_per_chunk=max(256 // args.k, 1), **common)
  greedy = sampler_lib.Sampler(config, rule=sampler_lib.SamplingRule(temperature=0.0),
                               prompts_per_chunk=256, **common)
  start = time.perf_counter()
  rng = jax.random.key(1234)
  levels = {
    str(level): measure_level(tok, sampler, greedy, params, level, cand, args, rng)
    for level in cand.eval_levels
  }
  eval_s = time.perf_counter() - start
  mixes = {}
  for mix_name, mix_levels, weights in cand.rl_mixes:
    w = np.asarray(weights, np.float64) / np.sum(weights)
    fr = {b: 0.0 for b in (*BUCKETS, "mid")}
    mean = 0.0
    for level, wl in zip(mix_levels, w):
      m = levels[str(level)]
      mean += wl * m["mean_pass_rate"]
      for b in fr:
        fr[b] += wl * m["buckets"][b]
    mixes[mix_name] = {"levels": list(mix_levels), "weights": list(weights),
                       "mean_pass_rate": round(mean, 4),
                       "buckets": {b: round(v, 4) for b, v in fr.items()}}
  for level, m in levels.items():
    print(f"[{name}] L{level}: pass {m['mean_pass_rate']:.3f} greedy {m['greedy_heldout_accuracy']:.3f} "
          f"{m['buckets']}")
  for mix_name, m in mixes.items():
    print(f"[{name}] mix {mix_name}: mean {m['mean_pass_rate']:.3f} {m['buckets']}")
  cfg = dataclasses.asdict(cand)
  return {
    "candidate": cfg,
    "warm_start_steps_run": int(metrics["steps_run"]),
    "warm_start_reached_target": bool(metrics["reached_target"]),
    "params": int(sum(x.size for x in jax.tree.leaves(params))),
    "warm_start_wall_s": round(metrics["wall_s"], 1),
    "warm_start_final_loss": round(float(metrics["loss"][-20:].mean()), 4),
    "warm_start_final_teacher_forced_seq_acc": round(
      float(metrics["sequence_accuracy"][-20:].mean()), 4),
    "eval_wall_s": round(eval_s, 1),
    "k": args.k,
    "prompts_per_level": args.prompts,
    "heldout_per_level": args.heldout,
    "levels": levels,
    "rl_mixes": mixes,
  }


def plot(results: dict, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(results)
  fig, axes = plt.subplots(len(names), 1, figsize=(7, 2.4 * len(names)), squeeze=False)
  bins = np.linspace(0, 1, 17 + 1) - 0.5 / 16
  for ax, name in zip(axes[:, 0], names):
    res = results[name]
    for level, m in res["levels"].items():
      ax.hist(m["pass_rates"], bins=bins, histtype="step", linewidth=1.5,
              label=f"L{level} (mean {m['mean_pass_rate']:.2f})")
    ax.set_title(f"{name}: warm start {res['warm_start_wall_s']:.0f} s, "
                 f"{res['params'] / 1e3:.0f}k params", fontsize=9)
    ax.set_ylabel("prompts")
    ax.legend(fontsize=7)
  axes[-1, 0].set_xlabel(f"pass rate at temperature 1.0 (k={results[names[-1]]['k']})")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--candidates", default="recommended",
                      help=f"comma-separated names from {sorted(CANDIDATES)}")
  parser.add_argument("--k", type=int, default=16, help="samples per prompt")
  parser.add_argument("--prompts", type=int, default=64, help="training-split prompts per level")
  parser.add_argument("--heldout", type=int, default=256, help="held-out problems per level")
  parser.add_argument("--out", default=str(RESULTS / "calibrate_arith.json"))
  parser.add_argument("--save_params", default="",
                      help="folder to write each candidate's warm params to (<name>.npz)")
  parser.add_argument("--fresh", action="store_true", help="drop stored candidates first")
  args = parser.parse_args()
  out = pathlib.Path(args.out)
  stored = {}
  if out.exists() and not args.fresh:
    stored = json.loads(out.read_text()).get("candidates", {})
  for name in args.candidates.split(","):
    if name not in CANDIDATES:
      raise SystemExit(f"--candidates: unknown {name!r}; known: {sorted(CANDIDATES)}")
    stored[name] = run_candidate(name, CANDIDATES[name], args)
  out.parent.mkdir(parents=True, exist_ok=True)
  doc = {
    "machine": f"{os.cpu_count()} CPU cores, shared with other jobs; jax {jax.__version__}",
    "buckets": "pass-rate buckets; mid = share strictly inside (0, 0.5)",
    "candidates": stored,
  }
  out.write_text(json.dumps(doc, indent=1) + "\n")
  plot(stored, out.with_suffix(".png"))
  print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
  main()
