"""Est's learned pass-rate head on prompts it has never seen (tiny arithmetic task).

  python experiments/est_head_arith.py                   # 3 seeds x 50 RL steps
  python experiments/est_head_arith.py --init_from=DIR   # reuse a warm start's step 0

Each seed trains Reinforce-Ada-Est with the learned estimator (`ada.est.estimator=head`,
K = 8, `configs/tiny_arith_pos.py` otherwise, the training set cut to --train_prompts
problems as in experiments/compare_methods.py) for --steps RL steps from the shared
supervised warm start. Then, with the run's final policy and head, on --heldout problems of
the arithmetic task's held-out split (never trained on, never sampled by the run; same
digit counts as training):

* the head predicts each prompt's pass rate p̂ from the policy's hidden state at the
  prompt's last token (the sampler's prefill, `SlotDriver.prefill_all`);
* the policy draws --k responses per prompt at the training temperature; the label of a
  prompt is "at least one of k correct", the outcome of a response is its reward.

Reported per seed, for three estimators of p: the head, the EMA estimator (which can only
give an unseen prompt its prior mean a/(a + b) = 1/17: AUC 0.5), and a per-digit-count
oracle (the mean reward of the held-out responses at the prompt's digit count, fitted on
those very responses: a ceiling for any estimator that knows only the digit count):

  auc     ROC AUC of p̂ for the "at least one of k correct" label (ties count one half)
  brier   mean over responses of (p̂ − reward)²

Writes <out>.json (git commit, command, full parsed config of each run, per-seed figures,
mean and spread) and <out>.md, and prints the JSON. Runs live in
--workdir/<commit>_steps<S>_prompts<P>/est_head_seed<s> (a finished run is not repeated).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import compare_methods as cm  # noqa: E402  (the shared run helpers)

from ada_jax import config as config_lib  # noqa: E402
from ada_jax import metrics as metrics_lib  # noqa: E402

OVERRIDES = {
  "ada.method": "est",
  "ada.est.budget_per_prompt": 8.0,
  "ada.est.estimator": "head",
}


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """ROC AUC: P(score of a positive > score of a negative), ties counted as one half."""
  pos, neg = scores[labels], scores[~labels]
  if pos.size == 0 or neg.size == 0:
    return float("nan")
  diff = pos[:, None] - neg[None, :]
  return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


def brier(p: np.ndarray, rewards: np.ndarray) -> float:
  """Mean over responses of (p − reward)²; p float[N], rewards float[N, k]."""
  return float(np.mean((p[:, None] - rewards) ** 2))


def evaluate_run(workdir: pathlib.Path, config: str, overrides: dict, args) -> dict:
  """Head, EMA-prior and digit-count-oracle figures of one finished run (module docstring)."""
  import jax

  from ada_jax import checkpoint, inputs
  from ada_jax.data import arith
  from ada_jax.models import sharding
  from ada_jax.rewards import grader
  from ada_jax.rl import estimate, pass_rate_head, train
  from ada_jax.rollout import sampler

  c = cm._config(config)
  c.update_from_flattened_dict(
    {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in overrides.items()}
  )
  cfg = config_lib.parse(c)
  model_cfg = cfg.model.model_config()
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  manager = checkpoint.make_manager(workdir / "checkpoints", cfg.ckpt)
  run = checkpoint.restore(manager, train.abstract_state(model_cfg, cfg.train, mesh))
  manager.close()
  params = run.train.params
  _, _, tok = inputs.load_model_files(cfg.model, cfg.tokenizer)
  problems = arith.examples(cfg.data.arith, "test", args.heldout, seed=args.heldout_seed)
  prompts = [np.asarray(arith.prompt_ids(tok, p["problem"]), np.int32) for p in problems]
  smp = sampler.Sampler.from_spec(
    model_cfg,
    cfg.sampler,
    stop_ids=tok.eos_ids,
    rows_per_prompt=args.k,
    pad_id=tok.pad_id,
    mesh=mesh,
  )
  lp = sampler.bucket_length(max(len(p) for p in prompts), smp.prompt_buckets)
  features = smp.pool(params, jax.random.key(0), lp).prefill_all(prompts, {})
  p_head = pass_rate_head.predict(
    pass_rate_head.params_from_state(run.est, features.shape[1], cfg.ada), features
  )
  rows = np.repeat(np.arange(len(prompts)), args.k)
  out, _ = smp.generate(params, prompts, rows, jax.random.key(args.heldout_seed))
  texts = tok.decode_many([t[:n] for t, n in zip(out["tokens"], out["lengths"], strict=True)])
  answers = [problems[i]["answer"] for i in rows]
  rewards = np.asarray(
    [float(grader.last_boxed(t) == a) for t, a in zip(texts, answers, strict=True)]
  ).reshape(len(prompts), args.k)
  labels = rewards.max(1) > 0
  level = np.asarray([p["source"] for p in problems])
  oracle = np.zeros(len(prompts))
  for name in np.unique(level):
    oracle[level == name] = rewards[level == name].mean()
  prior = np.full(len(prompts), cfg.ada.est.alpha / (cfg.ada.est.alpha + cfg.ada.est.beta))
  est_unseen = estimate.est_pass_rates(
    estimate.init_est_state(),
    estimate.prompt_keys([p["prompt_id"] for p in problems]),
    cfg.ada.est.alpha,
    cfg.ada.est.beta,
  )
  assert np.allclose(est_unseen, prior)  # the EMA's answer for a prompt it never sampled
  return {
    "run": workdir.name,
    "heldout_prompts": len(prompts),
    "pass_rate": float(rewards.mean()),
    "at_least_one_of_k": float(labels.mean()),
    "pass_rate_by_level": {n: float(rewards[level == n].mean()) for n in np.unique(level)},
    "head": {"auc": auc(p_head, labels), "brier": brier(p_head, rewards)},
    "ema_prior": {"auc": auc(prior, labels), "brier": brier(prior, rewards)},
    "digit_oracle": {"auc": auc(oracle, labels), "brier": brier(oracle, rewards)},
    "head_mean_prediction": float(p_head.mean()),
  }


def table(report: dict) -> str:
  rows = [
    f"| estimator | AUC (≥1 of {report['k']} correct) | Brier score |",
    "|---|---|---|",
  ]
  s = report["summary"]
  names = {
    "head": "learned head",
    "ema_prior": "EMA (prior 1/17)",
    "digit_oracle": "digit-count oracle",
  }
  for key, label in names.items():
    a, b = s[key]["auc"], s[key]["brier"]
    rows.append(
      f"| {label} | {a['mean']:.3f} ± {a['std']:.3f} | {b['mean']:.4f} ± {b['std']:.4f} |"
    )
  rows.append(
    f"\n{len(report['seeds'])} seeds (mean ± sd), {report['steps']} RL steps of Est K=8 with"
    f" the head, {report['heldout']} held-out problems, {report['k']} responses each; held-out"
    f" pass rate {s['pass_rate']['mean']:.3f}."
  )
  return "\n".join(rows)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--train_prompts", type=int, default=1280)
  parser.add_argument("--heldout", type=int, default=512, help="held-out problems scored")
  parser.add_argument("--heldout_seed", type=int, default=1234)
  parser.add_argument("--k", type=int, default=4, help="responses per held-out problem")
  parser.add_argument("--workdir", default="/tmp/ada_est_head")
  parser.add_argument(
    "--init_from",
    default=None,
    help="a warm start's checkpoint step folder; default: run the warm start here",
  )
  parser.add_argument("--out", default=str(cm.RESULTS / "est_head_arith"))
  args = parser.parse_args()
  commit = metrics_lib.git_commit(cm.REPO)
  root = pathlib.Path(args.workdir) / f"{commit[:12]}_steps{args.steps}_prompts{args.train_prompts}"
  common = {
    "rl.steps": args.steps,
    "data.arith_prompts": args.train_prompts,
    "ckpt.every_steps": 10,
    "eval.every_steps": 0,
    "eval.arith_problems": 64,
  }
  start = time.perf_counter()
  warm = (
    pathlib.Path(args.init_from) if args.init_from else root / "warm_start" / "checkpoints" / "0"
  )
  if not args.init_from:
    print("warm start ...", flush=True)
    cm.run(root / "warm_start", cm.WARM_START, {**common, "rl.steps": 1})
  per_seed, configs = [], {}
  for s in args.seeds:
    overrides = {**common, **OVERRIDES, "seed": s, "ckpt.init_from": warm}
    configs[s] = cm.full_config(cm.ADA, overrides)
    workdir = root / f"est_head_seed{s}"
    print(f"seed {s}: training ({workdir}) ...", flush=True)
    cm.run(workdir, cm.ADA, overrides)
    lines = metrics_lib.read_jsonl(workdir / "metrics.jsonl")
    result = evaluate_run(workdir, cm.ADA, overrides, args)
    result["train_head_brier_last10"] = float(np.mean([m["est/head_brier"] for m in lines[-10:]]))
    result["train_head_ece_last10"] = float(np.mean([m["est/head_ece"] for m in lines[-10:]]))
    result["command"] = " ".join(cm.command(workdir, cm.ADA, overrides)[1:])
    result["config"] = configs[s]
    per_seed.append(result)
    print(json.dumps({k: result[k] for k in ("run", "head", "ema_prior", "digit_oracle")}))

  def stat(path):
    values = np.array([eval_path(r, path) for r in per_seed], float)
    return {
      "mean": float(values.mean()),
      "std": float(values.std(ddof=1)) if values.size > 1 else 0.0,
      "seeds": values.tolist(),
    }

  summary = {
    key: {m: stat((key, m)) for m in ("auc", "brier")}
    for key in ("head", "ema_prior", "digit_oracle")
  }
  summary["pass_rate"] = stat(("pass_rate",))
  report = {
    "command": " ".join(["python experiments/est_head_arith.py", *sys.argv[1:]]),
    "git_commit": commit,
    "config_file": cm.ADA,
    "overrides": {k: str(v) for k, v in OVERRIDES.items()},
    "init_from": str(warm),
    "seeds": args.seeds,
    "steps": args.steps,
    "train_prompts": args.train_prompts,
    "heldout": args.heldout,
    "heldout_seed": args.heldout_seed,
    "k": args.k,
    "cpus": os.cpu_count(),
    "wall_s": round(time.perf_counter() - start, 1),
    "summary": summary,
    "runs": per_seed,
  }
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
  md = table(report)
  out.with_suffix(".md").write_text(
    f"`{report['command']}` (commit {commit}, {report['wall_s'] / 60:.1f} min)\n\n{md}\n"
  )
  print(md)
  print(json.dumps({"summary": summary, "git_commit": commit}))


def eval_path(record: dict, path: tuple[str, ...]) -> float:
  for key in path:
    record = record[key]
  return record


if __name__ == "__main__":
  main()
