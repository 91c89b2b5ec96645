"""Calibrates the CPU toy: how a warm-started tiny model's pass rates spread over levels.

  python experiments/calibrate_arith.py --candidates=recommended [--rl_check_steps 100]

For each candidate setting (model size; supervised warm-start steps, learning rate, batch,
level mix and operators, early-stop target), the script warm-starts a fresh model
(`ada_jax.rl.warmstart`), then per difficulty level samples k responses at temperature 1.0
for `--prompts` training-split prompts with `ada_jax.rollout.sampler.Sampler`, scores them with
the RL reward (last `\\boxed{}`, exact match after normalisation: `rewards.JUDGES['exact']`)
and records each prompt's pass rate. It also measures greedy accuracy on held-out
(test-split) problems of each level.

A candidate's RL prompt mixes are scored from the per-level measurements (a mix with level
weights w has bucket fraction Σ_L w_L · fraction_L), so one sampling pass rates every mix.
Buckets: pass rate 0, (0, 0.25], (0.25, 0.5), [0.5, 0.75), ≥ 0.75, and `mid`, the share
strictly inside (0, 0.5), where Reinforce-Ada differs from GRPO (docs/design.md "Data").

`--rl_check_steps N` then runs N steps of a deliberately plain RL proxy from the warm
start (on-policy REINFORCE, group-mean baseline, one Adam update per step, no clipping or
KL; not the project's RL loop) on the candidate's RL mix, to check that RL has room: it
records the training pass rate of the first and last 10 steps and held-out greedy
accuracy before and after.

Results merge into experiments/results/calibrate_arith.json (keyed by candidate name, so
candidates can be run one at a time on a busy machine); the PNG redraws from all stored
candidates. Wall times are those of this machine at the time (2 cores shared with other
jobs): compare them with care.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ada_jax.data import arith
from ada_jax.models import decoder as model_lib
from ada_jax.rewards import grader as rewards
from ada_jax.rl import warmstart
from ada_jax.rollout import sampler as sampler_lib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
BUCKETS = ("zero", "(0,0.25]", "(0.25,0.5)", "[0.5,0.75)", ">=0.75")
MIXES = (
  ("L1-3", (1, 2, 3), (1.0, 1.0, 1.0)),
  ("L2", (2,), (1.0,)),
  ("L2-3", (2, 3), (1.0, 1.0)),
  ("L2-3 (1:2)", (2, 3), (1.0, 2.0)),
  ("L3", (3,), (1.0,)),
  ("L2-4", (2, 3, 4), (1.0, 1.0, 1.0)),
)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One setting to calibrate (defaults: the recommended one).

  Attributes:
    embed_dim, num_layers, mlp_dim, num_heads: the llama-family model (head_dim =
      embed_dim / num_heads, no GQA, untied embeddings, RoPE θ = 10⁴).
    warm: the supervised warm start (its `task` says which levels and operators).
    eval_levels: levels whose pass rates are measured.
    rl_mix: levels and weights of the RL prompts for `--rl_check_steps`.
    init_seed: seed of the random initial parameters.
  """

  embed_dim: int = 96
  num_layers: int = 3
  mlp_dim: int = 384
  num_heads: int = 4
  warm: warmstart.WarmStartConfig = warmstart.RECOMMENDED
  eval_levels: tuple[int, ...] = (1, 2, 3, 4)
  rl_mix: tuple[tuple[int, ...], tuple[float, ...]] = (arith.TOY_RL_TASK.levels, (1.0, 1.0))
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


def _warm(steps=600, lr=3e-3, levels=(1, 2, 3), weights=(), ops=("+", "-"), **kw):
  task = arith.ArithConfig(levels=levels, level_weights=weights, ops=ops)
  return warmstart.WarmStartConfig(steps=steps, learning_rate=lr, task=task, **kw)


_D96 = dict(embed_dim=96, mlp_dim=384)
_ADD = dict(weights=(1.0, 3.0, 2.0), ops=("+",))


def _seeds(prefix, **warm_kw):
  return {
    f"{prefix}_seed{s}": Candidate(**_D96, init_seed=s, warm=_warm(**_ADD, seed=s, **warm_kw))
    for s in (0, 1, 2)
  }


# What was tried, in order. Names: d<width>L<layers>, s<steps>, lr, mix132 = level weights
# 1:3:2 for L1:L2:L3, add = addition only (else + and -), t/L2t/L3t = early-stop target on
# the whole mix / level 2 / level 3.
CANDIDATES: dict[str, Candidate] = {
  "d128L3_s600_lr3e-3": Candidate(embed_dim=128, mlp_dim=512, warm=_warm()),
  "d128L3_s600_lr1e-2": Candidate(embed_dim=128, mlp_dim=512, warm=_warm(lr=1e-2)),
  "d128L3_s600_mix132": Candidate(embed_dim=128, mlp_dim=512, warm=_warm(weights=(1.0, 3.0, 2.0))),
  "d128L2_s800": Candidate(embed_dim=128, mlp_dim=512, num_layers=2, warm=_warm(steps=800)),
  "d96L3_s900": Candidate(**_D96, warm=_warm(steps=900)),
  "d96L3_s900_lr1e-3": Candidate(**_D96, warm=_warm(steps=900, lr=1e-3)),
  "d96L3_s1500": Candidate(**_D96, warm=_warm(steps=1500)),
  "add_d96L3_s900_mix132": Candidate(**_D96, warm=_warm(steps=900, **_ADD)),
  "add_d96L3_s400_lr1e-3": Candidate(**_D96, warm=_warm(steps=400, lr=1e-3, **_ADD)),
  **_seeds("add_d96L3_s400", steps=400),
  **_seeds("add_d96L3_t0.7", steps=1200, target_accuracy=0.7),
  **_seeds("add_d96L3_L3t0.35", steps=1200, target_accuracy=0.35, target_level=3),
  **_seeds("add_d96L3_L2t0.6", steps=1200, target_accuracy=0.6, target_level=2),
}
RECOMMENDED = "add_d96L3_L2t0.6_seed0"
CANDIDATES["recommended"] = CANDIDATES[RECOMMENDED]
assert CANDIDATES[RECOMMENDED] == Candidate(), "Candidate() defaults must be the recommendation"


# --------------------------------------------------------------------------- measurement


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
  rows = zip(sampled["tokens"], sampled["lengths"], strict=True)
  texts = tok.decode_many([t[:n] for t, n in rows])
  judge = rewards.JUDGES["exact"]
  return np.asarray(
    [judge(t, a, None, rewards.MAX_ANSWER_CHARS)[0] for t, a in zip(texts, answers, strict=True)],
    np.float32,
  )


def greedy_accuracy(tok, greedy, params, examples) -> float:
  out, _ = greedy.generate(
    params,
    [arith.prompt_ids(tok, e["problem"]) for e in examples],
    np.arange(len(examples)),
    jax.random.key(0),
  )
  return float(score(tok, out, [e["answer"] for e in examples]).mean())


def measure_level(tok, sampler, greedy, params, level, cand, args, rng) -> dict:
  """Pass rates at temperature 1 (train split) and greedy accuracy (test split) of a level."""
  task = dataclasses.replace(cand.warm.task, levels=(level,), level_weights=())
  train = arith.examples(task, "train", args.prompts, seed=10_000 + level)
  prompts = [arith.prompt_ids(tok, e["problem"]) for e in train]
  rows = np.repeat(np.arange(len(prompts)), args.k)
  out, stats = sampler.generate(params, prompts, rows, jax.random.fold_in(rng, level))
  rates = score(tok, out, [train[i]["answer"] for i in rows]).reshape(len(prompts), args.k)
  rates = rates.mean(1)
  test = arith.examples(task, "test", args.heldout, seed=20_000 + level)
  return {
    "mean_pass_rate": round(float(rates.mean()), 4),
    "greedy_heldout_accuracy": round(greedy_accuracy(tok, greedy, params, test), 4),
    "buckets": bucket_fractions(rates),
    "pass_rates": rates.round(4).tolist(),
    "sample_wall_s": round(stats.wall_s, 2),
    "mean_response_tokens": round(float(out["lengths"].mean()), 2),
  }


def mix_summary(levels: dict, mix_levels, weights) -> dict:
  w = np.asarray(weights, np.float64) / np.sum(weights)
  fr = dict.fromkeys((*BUCKETS, "mid"), 0.0)
  mean = 0.0
  for level, wl in zip(mix_levels, w, strict=True):
    m = levels[str(level)]
    mean += wl * m["mean_pass_rate"]
    for b in fr:
      fr[b] += wl * m["buckets"][b]
  return {
    "levels": list(mix_levels),
    "weights": list(weights),
    "mean_pass_rate": round(mean, 4),
    "buckets": {b: round(v, 4) for b, v in fr.items()},
  }


# --------------------------------------------------------------------------- RL proxy


def reinforce_check(tok, config, params, cand, sampler, greedy, args) -> dict:
  """A plain RL proxy: does the training pass rate rise from this warm start?"""
  levels, weights = cand.rl_mix
  task = dataclasses.replace(cand.warm.task, levels=levels, level_weights=weights)
  b, n, steps = args.rl_prompts, args.rl_k, args.rl_check_steps
  train = arith.examples(task, "train", b * steps, seed=30_000)
  heldout = arith.examples(task, "test", args.heldout, seed=30_001)
  lp = max(len(arith.prompt_ids(tok, e["problem"])) for e in train)
  lr_ = sampler.max_new_tokens
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(args.rl_lr))

  def loss_fn(p, tokens, attention, response, advantage):
    positions = model_lib.positions_from_mask(attention)
    logp = jax.nn.log_softmax(model_lib.logits(config, p, tokens, positions, attention)[:, :-1])
    logp = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    mask = response[:, 1:].astype(jnp.float32)
    return -(logp * mask * advantage[:, None]).sum() / jnp.maximum(mask.sum(), 1.0)

  @jax.jit
  def update(p, s, *batch):
    updates, s = optimizer.update(jax.grad(loss_fn)(p, *batch), s, p)
    return optax.apply_updates(p, updates), s

  before = greedy_accuracy(tok, greedy, params, heldout)
  state, pass_rate, start = optimizer.init(params), [], time.perf_counter()
  for step in range(steps):
    chunk = train[step * b : (step + 1) * b]
    prompts = [arith.prompt_ids(tok, e["problem"]) for e in chunk]
    rows = np.repeat(np.arange(b), n)
    out, _ = sampler.generate(params, prompts, rows, jax.random.key(40_000 + step))
    r = score(tok, out, [chunk[i]["answer"] for i in rows]).reshape(b, n)
    advantage = (r - r.mean(1, keepdims=True)).reshape(-1)
    tokens = np.full((b * n, lp + lr_), tok.pad_id, np.int32)
    attention = np.zeros(tokens.shape, bool)
    response = np.zeros(tokens.shape, bool)
    for j, i in enumerate(rows):
      p, m = prompts[i], int(out["lengths"][j])
      tokens[j, lp - len(p) : lp], tokens[j, lp : lp + m] = p, out["tokens"][j, :m]
      attention[j, lp - len(p) : lp + m] = True
      response[j, lp : lp + m] = True
    params, state = update(params, state, tokens, attention, response, advantage)
    pass_rate.append(float(r.mean()))
  return {
    "method": "REINFORCE, group-mean baseline, token-mean, 1 Adam step per RL step",
    "rl_mix": {"levels": list(levels), "weights": list(weights)},
    "steps": steps,
    "prompts_per_step": b,
    "samples_per_prompt": n,
    "learning_rate": args.rl_lr,
    "pass_rate_first10": round(float(np.mean(pass_rate[:10])), 4),
    "pass_rate_last10": round(float(np.mean(pass_rate[-10:])), 4),
    "pass_rate_per_step": [round(x, 4) for x in pass_rate],
    "heldout_greedy_before": round(before, 4),
    "heldout_greedy_after": round(greedy_accuracy(tok, greedy, params, heldout), 4),
    "wall_s": round(time.perf_counter() - start, 1),
  }


# --------------------------------------------------------------------------- driver


def run_candidate(name: str, cand: Candidate, args) -> dict:
  tok = arith.load_tokenizer()
  config = cand.model_config(tok.vocab_size)
  params = model_lib.init_params(config, jax.random.key(cand.init_seed))
  params, metrics = warmstart.warm_start(config, params, tok, cand.warm, progress=True)
  print(
    f"[{name}] warm start {metrics['wall_s']:.1f} s, {metrics['steps_run']} steps, "
    f"final loss {metrics['loss'][-20:].mean():.3f}",
    flush=True,
  )
  max_level = max(cand.eval_levels)
  answer_digits = max(
    {"+": max_level + 1, "-": max_level, "*": 2 * max_level}[o] for o in cand.warm.task.ops
  )
  max_new = len(arith.response_ids(tok, "9" * answer_digits)) + 2  # room for wrong answers
  common = dict(
    max_new_tokens=max_new,
    stop_ids=tok.eos_ids,
    chunk_rows=256,
    prompt_buckets=(8, 16, 24),
    pad_id=tok.pad_id,
  )
  sampler = sampler_lib.Sampler(
    config,
    rule=sampler_lib.SamplingRule(temperature=1.0),
    prompts_per_chunk=max(256 // args.k, 1),
    **common,
  )
  greedy = sampler_lib.Sampler(
    config, rule=sampler_lib.SamplingRule(temperature=0.0), prompts_per_chunk=256, **common
  )
  start = time.perf_counter()
  rng = jax.random.key(1234)
  levels = {
    str(level): measure_level(tok, sampler, greedy, params, level, cand, args, rng)
    for level in cand.eval_levels
  }
  eval_s = time.perf_counter() - start
  mixes = {
    mix: mix_summary(levels, mix_levels, weights)
    for mix, mix_levels, weights in MIXES
    if set(mix_levels) <= set(cand.eval_levels)
  }
  for level, m in levels.items():
    print(
      f"[{name}] L{level}: pass {m['mean_pass_rate']:.3f} "
      f"greedy {m['greedy_heldout_accuracy']:.3f} {m['buckets']}"
    )
  for mix, m in mixes.items():
    print(f"[{name}] mix {mix}: mean {m['mean_pass_rate']:.3f} {m['buckets']}")
  result = {
    "candidate": dataclasses.asdict(cand),
    "params": int(sum(x.size for x in jax.tree.leaves(params))),
    "warm_start_wall_s": round(metrics["wall_s"], 1),
    "warm_start_steps_run": int(metrics["steps_run"]),
    "warm_start_reached_target": bool(metrics["reached_target"]),
    "warm_start_final_loss": round(float(metrics["loss"][-20:].mean()), 4),
    "warm_start_final_teacher_forced_seq_acc": round(
      float(metrics["sequence_accuracy"][-20:].mean()), 4
    ),
    "warm_start_level_accuracy": {
      str(k): [round(float(x), 3) for x in v] for k, v in metrics["level_accuracy"].items()
    },
    "eval_wall_s": round(eval_s, 1),
    "k": args.k,
    "prompts_per_level": args.prompts,
    "heldout_per_level": args.heldout,
    "levels": levels,
    "rl_mixes": mixes,
  }
  if args.rl_check_steps:
    rl_sampler = sampler_lib.Sampler(
      config,
      rule=sampler_lib.SamplingRule(temperature=1.0),
      prompts_per_chunk=max(256 // args.rl_k, 1),
      **common,
    )
    check = reinforce_check(tok, config, params, cand, rl_sampler, greedy, args)
    print(
      f"[{name}] RL proxy: pass {check['pass_rate_first10']:.3f} -> "
      f"{check['pass_rate_last10']:.3f}, held-out greedy {check['heldout_greedy_before']:.3f} "
      f"-> {check['heldout_greedy_after']:.3f} ({check['wall_s']:.0f} s)"
    )
    result["rl_check"] = check
  return result


def _level_cell(levels: dict, level: str) -> str:
  if level not in levels:
    return "-"
  m = levels[level]
  return f"{m['mean_pass_rate']:.2f} / {m['greedy_heldout_accuracy']:.2f}"


def summary_table(results: dict) -> list[str]:
  """Markdown rows: one per candidate, the RL mix L2-3 and the RL proxy where run."""
  lines = [
    "| candidate | params | SFT steps | SFT wall s | L2 pass / greedy | L3 pass / greedy "
    "| L2-3 mean | L2-3 zero | L2-3 mid (0,0.5) | RL proxy first10 -> last10 |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for name, r in results.items():
    lv, mix = r["levels"], r["rl_mixes"].get("L2-3", {})
    rl = r.get("rl_check")
    rl_cell = f"{rl['pass_rate_first10']:.2f} -> {rl['pass_rate_last10']:.2f}" if rl else "-"
    steps = r.get("warm_start_steps_run") or r["candidate"]["warm"]["steps"]
    lines.append(
      f"| {name} | {r['params'] / 1e3:.0f}k | {steps} | {r['warm_start_wall_s']:.0f} "
      f"| {_level_cell(lv, '2')} | {_level_cell(lv, '3')} | {mix['mean_pass_rate']:.2f} "
      f"| {mix['buckets']['zero']:.2f} | {mix['buckets']['mid']:.2f} | {rl_cell} |"
    )
  return lines


def plot(results: dict, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (top, bottom) = plt.subplots(
    2, 1, figsize=(8, 4 + 0.25 * len(results)), height_ratios=(1, 0.3 + 0.08 * len(results))
  )
  bins = np.arange(18) / 16 - 1 / 32  # one bin per pass rate j/16
  for name in sorted(n for n in results if n.startswith(RECOMMENDED.removesuffix("0"))):
    lv = results[name]["levels"]
    rates = lv["2"]["pass_rates"] + lv["3"]["pass_rates"]
    top.hist(rates, bins=bins, histtype="step", linewidth=1.5, label=name)
  top.set_xlabel("per-prompt pass rate at temperature 1.0, RL mix L2-3 (k=16)")
  top.set_ylabel("prompts")
  top.set_title("Recommended warm start, three seeds", fontsize=10)
  top.legend(fontsize=7)
  names = list(results)
  left = np.zeros(len(names))
  # The two buckets inside (0, 0.5) first, so the 0.4 line reads "40% of prompts there".
  order = ("(0,0.25]", "(0.25,0.5)", "zero", "[0.5,0.75)", ">=0.75")
  colors = ("#d62728", "#ff7f0e", "#444444", "#2ca02c", "#1f77b4")
  for bucket, color in zip(order, colors, strict=True):
    width = np.array([results[n]["rl_mixes"]["L2-3"]["buckets"][bucket] for n in names])
    bottom.barh(names, width, left=left, color=color, label=bucket)
    left += width
  bottom.axvline(0.4, color="k", linewidth=0.5)
  bottom.invert_yaxis()
  bottom.tick_params(axis="y", labelsize=7)
  bottom.set_xlabel("share of RL-mix (L2-3) prompts per pass-rate bucket; line: 40%")
  bottom.legend(fontsize=7, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--candidates",
    default="recommended",
    help=f"comma-separated names from {sorted(CANDIDATES)}; '' redraws the stored results",
  )
  parser.add_argument("--k", type=int, default=16, help="samples per prompt")
  parser.add_argument("--prompts", type=int, default=64, help="training-split prompts per level")
  parser.add_argument("--heldout", type=int, default=256, help="held-out problems per level")
  parser.add_argument("--rl_check_steps", type=int, default=0, help="RL proxy steps; 0 = none")
  parser.add_argument("--rl_prompts", type=int, default=64, help="RL proxy prompts per step")
  parser.add_argument("--rl_k", type=int, default=8, help="RL proxy samples per prompt")
  parser.add_argument("--rl_lr", type=float, default=3e-4, help="RL proxy Adam learning rate")
  parser.add_argument("--out", default=str(RESULTS / "calibrate_arith.json"))
  parser.add_argument("--fresh", action="store_true", help="drop stored candidates first")
  args = parser.parse_args()
  out = pathlib.Path(args.out)
  stored = {}
  if out.exists() and not args.fresh:
    stored = json.loads(out.read_text()).get("candidates", {})
  for name in filter(None, args.candidates.split(",")):  # '' only redraws
    if name not in CANDIDATES:
      raise SystemExit(f"--candidates: unknown {name!r}; known: {sorted(CANDIDATES)}")
    key = RECOMMENDED if name == "recommended" else name
    stored[key] = run_candidate(key, CANDIDATES[name], args)
  out.parent.mkdir(parents=True, exist_ok=True)
  doc = {
    "machine": f"{os.cpu_count()} CPU cores shared with other jobs; jax {jax.__version__}",
    "recommended": RECOMMENDED,
    "buckets": "per-prompt pass-rate buckets; mid = share strictly inside (0, 0.5)",
    "table_markdown": summary_table(stored),
    "candidates": stored,
  }
  out.write_text(json.dumps(doc, indent=1) + "\n")
  plot(stored, out.with_suffix(".png"))
  print("\n".join(doc["table_markdown"]))
  print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
  main()
