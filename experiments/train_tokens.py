"""Token positions, real tokens, FLOPs and peak memory of one RL step's train phase at the
paper's lengths, one sequence a row (padded) against packed rows (`rl.packing`), from the
target's own compiler ahead of time on this CPU (XLA:TPU via libtpu, XLA:GPU via the CUDA
plugin's compile-only devices).

  JAX_PLATFORMS=cpu python experiments/train_tokens.py \\
      --prompts=DATA/math_test_full.jsonl --tokenizer=TOKENIZERS/llama3

The RL batch: `rl.batch_prompts` prompts drawn from `--prompts` (a JSONL of maths problems,
`problem` fields), rendered in Llama 3's chat format with the config's system prompt and
tokenized with `--tokenizer` (a folder with tokenizer.json), those over the largest prompt
bucket dropped as `data.prompts.build_prompts` drops them; each prompt's rows (train rows
/ prompts) draw response lengths from the simulators' lognormal (`simulate_stream`: median
512, 3 % at the budget, cut at `sampler.max_new_tokens`). Each mini-batch is packed as
`update.minibatches` packs it; the train step is compiled at the mini-batch's own rows and
at the largest packed count, and its FLOPs are the matrix multiplications of the optimized
HLO (`plan.hlo_walk.matmul_flops`: loops counted by their trips; on TPU the splash
attention kernel's calls by the blocks each computes, `flash.KERNEL_FLOPS`), linear in
the rows between the two (each micro-batch the same program), summed over the step's
mini-batches.

The model's own FLOPs per real token: 6 · matmul params (8 with remat: the forward runs
twice) plus causal attention over each token's real context (4 · context · heads ·
head_dim a layer, times 3, or 4 with remat). Output: a table and JSON
(experiments/results/train_tokens.json) with the commit and every setting.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time

ARGS = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ARGS.add_argument("--configs", default="llama3b_pos:v5e-8,qwen_math15b_pos:h200x1")
ARGS.add_argument("--prompts", required=True, help="JSONL with a 'problem' field per line")
ARGS.add_argument("--tokenizer", required=True, help="folder with the Llama 3 tokenizer.json")
ARGS.add_argument("--seed", type=int, default=0)
ARGS.add_argument("--out", default="")
ARGS = ARGS.parse_args()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ada_jax import config as config_lib  # noqa: E402
from ada_jax import metrics  # noqa: E402
from ada_jax.data import prompts as prompts_lib  # noqa: E402
from ada_jax.models import decoder as model_lib  # noqa: E402
from ada_jax.models import sharding as sharding_lib  # noqa: E402
from ada_jax.models.tokenizer import Tokenizer  # noqa: E402
from ada_jax.plan import programs, targets  # noqa: E402
from ada_jax.rl import simulate_stream, update  # noqa: E402
from ada_jax.rl.train import TrainBatch  # noqa: E402

# Llama 3's chat format (the tokenizer folder has no template).
LLAMA3_CHAT = (
  "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
  "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
  "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def load_config(entry: str) -> tuple[config_lib.RunConfig, targets.Target, dict]:
  """`<config>:<target>` -> (the parsed config, the target, the settings changed for it): on
  a one-device target the mesh is that device (no tensor split)."""
  name, _, target_name = entry.partition(":")
  target = targets.target(target_name)
  c = importlib.import_module(f"configs.{name}").get_config()
  changed = {}
  if target.devices == 1:
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
    changed["mesh"] = "1 x 1 x 1 (one device)"
  return config_lib.parse(c), target, changed


def prompt_lengths(path: str, tokenizer_dir: str, longest: int) -> np.ndarray:
  """Token counts of every problem in `path` as the chat prompt a run builds, those over
  `longest` dropped."""
  tok = Tokenizer.from_dir(
    tokenizer_dir, chat_template=LLAMA3_CHAT, eos_ids=[128009, 128001], bos_id=128000
  )
  with open(path) as f:
    problems = [json.loads(line)["problem"] for line in f if line.strip()]
  examples = [{"prompt_id": str(i), "problem": p, "answer": ""} for i, p in enumerate(problems)]
  built = prompts_lib.build_prompts(examples, tok, style="chat", max_prompt_tokens=longest)
  return np.asarray([len(t) for t in built.tokens])


def rl_batch(cfg, lengths: np.ndarray, rng: np.random.Generator) -> TrainBatch:
  """One RL step's batch in `make_train_batch`'s layout with these prompt lengths drawn
  and the simulators' response lengths (token ids random: packing and FLOPs see none)."""
  prompts, rows = cfg.rl.batch_prompts, cfg.train_rows
  lp, lr = max(cfg.sampler.prompt_buckets), cfg.sampler.max_new_tokens
  stream = simulate_stream.StreamSimConfig()
  sigma = simulate_stream.length_sigma(stream.median_length, lr, stream.at_budget)
  p = np.repeat(rng.choice(lengths, prompts), rows // prompts)
  r = np.minimum(np.ceil(stream.median_length * rng.lognormal(0.0, sigma, rows)), lr).astype(int)
  cols = np.arange(lp + lr)[None]
  prompt = (cols >= lp - p[:, None]) & (cols < lp)
  response = (cols >= lp) & (cols < lp + r[:, None])
  real = prompt | response
  return TrainBatch(
    tokens=np.where(real, 1, 0).astype(np.int32),
    positions=np.asarray(model_lib.positions_from_mask(real), np.int32),
    segments=real.astype(np.int32),
    loss_mask=response,
    advantages=np.where(real, 1.0, 0.0).astype(np.float32),
    old_logprobs=np.zeros(real.shape, np.float32),
  )


def model_flops(model_cfg, batch: TrainBatch, remat: bool) -> float:
  """The model's own FLOPs over the batch's real tokens: (6 or 8) · matmul params per
  token plus causal attention over each token's real context."""
  shapes = model_lib.param_shapes(model_cfg)
  params = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  if not model_cfg.tie_embeddings:  # the input embedding is a lookup, not a matmul
    params -= model_cfg.vocab_size * model_cfg.embed_dim
  passes = 4 if remat else 3
  tokens = int((batch.segments > 0).sum())
  context = float((batch.positions[batch.segments > 0] + 1).sum())
  attention = 4 * context * model_cfg.num_heads * model_cfg.head_dim * model_cfg.num_layers
  return 2 * passes * params * tokens + passes * attention


def measure(entry: str, lengths: np.ndarray, rng) -> dict:
  cfg, target, changed = load_config(entry)
  model_cfg = programs.model_of(cfg)
  mesh = programs.mesh_for(cfg, targets.devices_for(target))
  batch = rl_batch(cfg, lengths, rng)
  k, b = cfg.train.num_minibatches, cfg.mini_batch_rows
  minis = update.minibatches(batch, cfg.train, mesh)
  width = batch.tokens.shape[1]
  packed_rows = [m.rows for m in minis]
  figures = {}
  for name, rows in (("padded", b), ("packed", max(packed_rows))):
    start = time.perf_counter()
    p = programs.train_program(cfg, model_cfg, mesh, rows=rows, keep_hlo=True)
    if p.matmul_flops is None:
      raise SystemExit(f"{entry} {name}: the train step's matmul FLOPs could not be counted")
    flops = p.matmul_flops * mesh.size
    figures[name] = {
      "rows": rows,
      "matmul_flops": flops,
      "peak_gib": round(targets.gib(p.program.peak), 2),
      "compile_s": round(time.perf_counter() - start, 1),
    }
    print(f"  {entry} {name}: {rows} rows, {flops:.4g} FLOPs, {figures[name]['peak_gib']} GiB")
  # FLOPs of a mini-batch of S rows: linear in S (S / micro-batch trips of one program).
  (s0, f0), (s1, f1) = ((figures[n]["rows"], figures[n]["matmul_flops"]) for n in figures)
  per_row = (f0 - f1) / (s0 - s1) if s0 != s1 else f0 / s0
  flops_of = lambda s: f1 + per_row * (s - s1)
  real = int((batch.segments > 0).sum())
  own = model_flops(model_cfg, batch, cfg.train.remat)
  step = {
    "padded": {"positions": batch.tokens.size, "flops": k * flops_of(b)},
    "packed": {"positions": sum(packed_rows) * width, "flops": sum(map(flops_of, packed_rows))},
  }
  for v in step.values():
    v["positions_per_real_token"] = round(v["positions"] / real, 3)
    v["flops_per_real_token"] = v["flops"] / real
    v["flops_vs_model"] = round(v["flops"] / own, 3)
  return {
    "entry": entry,
    "settings_changed": changed,
    "attention": sharding_lib.platform(mesh).self_attention or "XLA's blocked form",
    "mini_batches": k,
    "mini_batch_rows": b,
    "row_width": width,
    "packed_rows": packed_rows,
    "real_tokens": real,
    "response_tokens": int(batch.loss_mask.sum()),
    "model_flops": own,
    "model_flops_per_real_token": own / real,
    "compiled": figures,
    "step": step,
    "run_config": config_lib.as_dict(cfg),
  }


def main() -> None:
  rng = np.random.default_rng(ARGS.seed)
  commit, start, rows = metrics.git_commit(), time.perf_counter(), []
  lengths = None
  for entry in ARGS.configs.split(","):
    if lengths is None:
      cfg, _, _ = load_config(entry)
      lengths = prompt_lengths(ARGS.prompts, ARGS.tokenizer, max(cfg.sampler.prompt_buckets))
      print(f"{len(lengths)} prompts, median {np.median(lengths):.0f} tokens", flush=True)
    rows.append(measure(entry, lengths, rng))
    s = rows[-1]["step"]
    print(
      f"{entry}: positions / real token {s['padded']['positions_per_real_token']} -> "
      f"{s['packed']['positions_per_real_token']}; FLOPs / model's own "
      f"{s['padded']['flops_vs_model']} -> {s['packed']['flops_vs_model']}",
      flush=True,
    )
  out = ARGS.out or os.path.join(os.path.dirname(__file__), "results", "train_tokens.json")
  result = {
    "what": "one RL step's train phase at the paper's lengths: token positions computed, "
    "real tokens, matmul FLOPs of the compiled step (all devices) and peak bytes per device, "
    "padded rows against packed ones; compiled ahead of time, not run",
    "prompts": os.path.basename(ARGS.prompts),
    "prompt_lengths": {"count": len(lengths), "median": float(np.median(lengths))},
    "responses": {
      k: getattr(simulate_stream.StreamSimConfig(), k) for k in ("median_length", "at_budget")
    }
    | {"note": "lognormal with this median, at_budget of rows at max_new_tokens, cut there"},
    "seed": ARGS.seed,
    "git_commit": commit,
    "jax": jax.__version__,
    "wall_s": round(time.perf_counter() - start, 1),
    "rows": rows,
  }
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=1, default=str)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
