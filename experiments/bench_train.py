"""The real-model CPU run's train phase, one sequence a row (padded) against packed rows
(`rl.packing`), interleaved in one process: SmolLM2-135M-Instruct at a config's shapes
(default configs/smollm2_arith_pos.py: 16 rows, prompt bucket 128, 96 new tokens, float32).

  python experiments/bench_train.py --model=DIR [--config=smollm2_arith_pos] [--pairs=8]

DIR: the model's Hugging Face folder (`python -m ada_jax.models.from_gguf` writes one from
the GGUF). The batch is real: the config's prompts (its data pipeline and seed), the
first `rl.batch_prompts` of them, `train rows / prompts` responses each sampled by the
model with the config's sampler (real lengths), laid out by `update.make_train_batch`
with standard-normal advantages. Arm 'padded' passes each mini-batch's padded rows to
the train step (the update as it was before packing: the same step function, segments 0
and 1); arm 'packed' is `update.update_policy`, which packs each mini-batch first. Both
compile first (not timed); then `--pairs` pairs, the arms' order alternating, each the
wall time of one RL step's update to its metrics on the host. Output: medians, the
median of per-pair ratios (padded / packed) and JSON
(experiments/results/bench_train.json) with the commit and the config.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
import types

ARGS = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ARGS.add_argument("--model", required=True, help="the model's Hugging Face folder")
ARGS.add_argument("--config", default="smollm2_arith_pos")
ARGS.add_argument("--pairs", type=int, default=8)
ARGS.add_argument("--out", default="")
ARGS = ARGS.parse_args()
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CPU path, whatever plugins are installed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ada_jax import config as config_lib  # noqa: E402
from ada_jax import inputs, metrics  # noqa: E402
from ada_jax.models import sharding  # noqa: E402
from ada_jax.models import weights as weights_lib  # noqa: E402
from ada_jax.rl import train, update  # noqa: E402
from ada_jax.rollout import sampler as sampler_lib  # noqa: E402


def real_batch(cfg, model_cfg, tok, params, mesh) -> train.TrainBatch:
  """The config's first prompts, each with its rows' responses sampled by the model."""
  prompt_set = inputs.load_prompts(cfg.data, tok, seed=cfg.seed)
  prompts = [list(t) for t in prompt_set.tokens[: cfg.rl.batch_prompts]]
  per_prompt = cfg.train_rows // len(prompts)
  row_prompt = np.repeat(np.arange(len(prompts)), per_prompt)
  smp = sampler_lib.Sampler.from_spec(
    model_cfg,
    cfg.sampler,
    stop_ids=tok.eos_ids,
    rows_per_prompt=cfg.min_rows_per_prompt,
    max_rows_per_prompt=cfg.max_rows_per_prompt,
    pad_id=tok.pad_id,
    mesh=mesh,
  )
  out, _ = smp.generate(params, prompts, row_prompt, jax.random.key(cfg.seed))
  result = types.SimpleNamespace(
    handles=np.arange(len(row_prompt)),
    prompt_index=row_prompt,
    advantages=np.random.default_rng(cfg.seed).standard_normal(len(row_prompt)),
  )
  return update.make_train_batch(
    result,
    out,
    [np.asarray(p) for p in prompts],
    rows=cfg.train_rows,
    buckets=cfg.sampler.prompt_buckets,
    pad_id=tok.pad_id,
  )


def main() -> None:
  commit = metrics.git_commit()  # the code that runs, whatever is edited meanwhile
  c = importlib.import_module(f"configs.{ARGS.config}").get_config()
  c.model.hf_dir = ARGS.model
  cfg = config_lib.parse(c)
  _, model_cfg, tok = inputs.load_model_files(cfg.model, cfg.tokenizer)
  _, params = weights_lib.load_hf(ARGS.model, dtype=model_cfg.weight_dtype)
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  batch = real_batch(cfg, model_cfg, tok, params, mesh)
  tcfg = cfg.train
  k = tcfg.num_minibatches
  size = batch.rows // k
  step_fn = train.make_train_step(model_cfg, tcfg, mesh)
  logprob_fn = update.make_logprob_step(model_cfg, tcfg, mesh)
  state = train.init_train_state(model_cfg, tcfg, params, mesh)

  def padded(state):
    minis = [
      sharding.place_batch(jax.tree.map(lambda x, i=i: x[i * size : (i + 1) * size], batch), mesh)
      for i in range(k)
    ]
    if tcfg.old_logprobs == "recompute":
      minis = [m.replace(old_logprobs=logprob_fn(state.params, m)) for m in minis]
    for mini in minis:
      state, m = step_fn(state, mini)
    return state, jax.device_get(m)

  def packed(state):
    return update.update_policy(
      step_fn, state, batch, config=tcfg, mesh=mesh, logprob_fn=logprob_fn
    )

  arms = {"padded": padded, "packed": packed}
  for arm in arms.values():  # compile
    state, _ = arm(state)
  times = {name: [] for name in arms}
  for pair in range(ARGS.pairs):
    order = list(arms) if pair % 2 == 0 else list(arms)[::-1]
    for name in order:
      start = time.perf_counter()
      state, _ = arms[name](state)
      times[name].append(time.perf_counter() - start)
    print(f"pair {pair}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in arms), flush=True)
  ratios = [a / b for a, b in zip(times["padded"], times["packed"], strict=True)]
  minis = update.minibatches(batch, tcfg, mesh)
  result = {
    "what": "one RL step's update (k mini-batch train steps, metrics on the host) on a "
    "real SmolLM2 batch: padded rows vs packed rows, interleaved in one process, seconds",
    "model": os.path.basename(os.path.normpath(ARGS.model)),
    "config": ARGS.config,
    "pairs": ARGS.pairs,
    "rows": batch.rows,
    "row_width": batch.tokens.shape[1],
    "real_tokens": int((batch.segments > 0).sum()),
    "response_tokens": int(batch.loss_mask.sum()),
    "positions": {"padded": int(batch.tokens.size), "packed": sum(m.tokens.size for m in minis)},
    "seconds": times,
    "median_s": {n: round(statistics.median(t), 3) for n, t in times.items()},
    "median_ratio_padded_over_packed": round(statistics.median(ratios), 3),
    "ratios": [round(r, 3) for r in ratios],
    "git_commit": commit,
    "jax": jax.__version__,
    "cpu_count": os.cpu_count(),
    "run_config": config_lib.as_dict(cfg),
  }
  print(
    json.dumps({k: result[k] for k in ("positions", "median_s", "median_ratio_padded_over_packed")})
  )
  out = ARGS.out or os.path.join(os.path.dirname(__file__), "results", "bench_train.json")
  with open(out, "w") as f:
    json.dump(result, f, indent=1, default=str)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
