"""Throughput of the reward pool on realistic responses: responses/s for 1 worker and all cores.

Builds N responses as an RL step would produce them (N/8 MATH500 prompts x 8 responses each),
each the problem's reference solution with its final box rewritten in one of several surface
forms (verbatim, `\\dfrac`, tight spacing, `\\left(`/`\\right)` dropped, as a decimal, another
problem's answer, cut off before the box), scores them with `Verifier.score` and prints
one JSON object.

  .venv/bin/python experiments/bench_rewards.py                  # 4096 responses, 1 and all
  .venv/bin/python experiments/bench_rewards.py --workers 1,2,4 --num 1024
"""

import argparse
import dataclasses
import json
import os
import pathlib
import re
import time

import numpy as np

from ada_jax import metrics
from ada_jax.rewards import verifier
from ada_jax.rewards.references import reference_answer

GROUP = 8  # Responses per prompt, as in a Reinforce-Ada round.
_FRAC = re.compile(r"^\\frac\{(\d+)\}\{(\d+)\}$")
_SPACED_OP = re.compile(r"\s*([=+,-])\s*")


def _forms(answer: str, other: str) -> dict[str, str]:
  """Surface forms of a final answer (most equivalent, `other` and `cut` wrong)."""
  decimal = answer
  if m := _FRAC.match(answer):
    decimal = f"{int(m.group(1)) / int(m.group(2)):.6f}"
  return {
    "verbatim": answer,
    "dfrac": answer.replace("\\frac", "\\dfrac"),
    "tight_spacing": _SPACED_OP.sub(r"\1", answer),
    "no_left_right": answer.replace("\\left", "").replace("\\right", ""),
    "decimal": decimal,
    "other": other,
  }


def build_responses(rows: list[dict], num: int, seed: int) -> tuple[list[str], list[str], list]:
  """N responses grouped by prompt, their references and the form of each."""
  rng = np.random.default_rng(seed)
  refs = [reference_answer("math500", r) for r in rows]
  responses, references, kinds = [], [], []
  for p in range(num // GROUP + 1):
    i = int(rng.integers(len(rows)))
    solution, answer = rows[i]["solution"], refs[i]
    cut = solution.rfind("\\boxed")
    reasoning = solution[:cut] if cut >= 0 else solution + "\nSo the answer is $"
    other = next(
      refs[j % len(refs)]
      for j in range(i + 1 + p, i + p + len(refs))
      if refs[j % len(refs)] != answer
    )
    forms = _forms(answer, other)
    for _ in range(GROUP):
      kind = str(rng.choice([*forms, "cut"]))
      if kind == "cut":  # Ran out of tokens before the final answer.
        responses.append(reasoning[: len(reasoning) // 2])
      else:
        responses.append(f"{reasoning}\\boxed{{{forms[kind]}}}$.")
      references.append(answer)
      kinds.append(kind)
  return responses[:num], references[:num], kinds[:num]


def bench(responses, references, kinds, workers: int, timeout_s: float) -> dict:
  t0 = time.perf_counter()
  with verifier.Verifier(verifier.VerifierConfig(num_workers=workers, timeout_s=timeout_s)) as pool:
    startup = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = pool.score(responses, references)
    seconds = time.perf_counter() - t0
    stats = dataclasses.asdict(pool.last_stats)
  kinds = np.asarray(kinds)
  by_kind = {k: float(out[kinds == k].mean()) for k in np.unique(kinds)}
  return {
    "workers": workers,
    "responses_per_s": round(len(responses) / seconds, 1),
    "seconds": round(seconds, 3),
    "startup_s": round(startup, 3),
    "reward_mean_by_form": dict(sorted(by_kind.items())),
    "stats": stats,
  }


def main():
  repo = pathlib.Path(__file__).resolve().parents[1]
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data_dir", default=str(repo.parent / "shared" / "data"))
  parser.add_argument("--num", type=int, default=4096, help="responses to score")
  parser.add_argument("--workers", default="1,all", help="comma list; 'all' = every core")
  parser.add_argument("--timeout_s", type=float, default=5.0, help="hard per-item timeout")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  path = pathlib.Path(args.data_dir) / "math500_test.jsonl"
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  responses, references, kinds = build_responses(rows, args.num, args.seed)
  cores = len(os.sched_getaffinity(0))
  counts = [cores if w == "all" else int(w) for w in args.workers.split(",")]
  result = {
    "git_commit": metrics.git_commit(),
    "args": vars(args),
    "num_responses": len(responses),
    "mean_response_chars": round(float(np.mean([len(r) for r in responses])), 1),
    "cores": cores,
    "timeout_s": args.timeout_s,
    "runs": [bench(responses, references, kinds, w, args.timeout_s) for w in counts],
  }
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
