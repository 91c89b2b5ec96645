"""Sampler throughput vs Hugging Face `generate` on the same tiny Llama, same settings.

  python experiments/bench_sampler.py [--batch 64 --prompt_len 32 --new_tokens 96]

One run measures, on this machine: our rollout engine, the slot pool (tokens/s, compile
excluded and reported separately), transformers' `generate` (torch CPU, fp32) on the same weights, a
plain fp32 matmul's FLOP/s as the machine's practical peak, the sampler's achieved model
FLOP/s as a fraction of it, and the time of the model's matmuls alone at these shapes
(`matmul_floor_s`; `ratio_vs_hf_bound` is the ratio a sampler with no other cost would
reach). Prints one JSON object.
"""

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from ada_jax import metrics
from ada_jax.models import decoder as model_lib
from ada_jax.models import weights
from ada_jax.rollout import sampler as sampler_lib


def _best_of(fn, repeats):
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def matmul_flops_per_s(n: int = 1024, repeats: int = 5) -> float:
  a = jax.random.normal(jax.random.key(0), (n, n))
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  return 2 * n**3 / _best_of(lambda: f(a).block_until_ready(), repeats)


def matmul_floor_s(config, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> float:
  """Seconds for only the model's matmuls, with our fused shapes (q/k/v, o, gate/up, down
  per layer, the LM head) on `batch` rows: the prefill's once on batch × prompt_len rows,
  then one decode step's per token in a jitted loop. No attention, norms, RoPE, cache or
  sampling: a bound no sampler built from XLA:CPU matmuls can beat on this machine."""
  c = config
  keys = iter(jax.random.split(jax.random.key(1), 5 * c.num_layers + 1))
  normal = lambda *shape: jax.random.normal(next(keys), shape) * 0.05
  qkv_dim = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
  layers = [
    (
      normal(c.embed_dim, qkv_dim),
      normal(c.num_heads * c.head_dim, c.embed_dim),
      normal(c.embed_dim, 2 * c.mlp_dim),
      normal(c.mlp_dim, c.embed_dim),
    )
    for _ in range(c.num_layers)
  ]
  head = normal(c.embed_dim, c.vocab_size)

  def forward(x):
    for qkv, o, gate_up, down in layers:
      x = x + (x @ qkv)[:, : o.shape[0]] @ o
      gu = x @ gate_up
      x = x + (jax.nn.silu(gu[:, : c.mlp_dim]) * gu[:, c.mlp_dim :]) @ down
    return x, x @ head

  def run(prompt_x, x):
    prompt_x, _ = forward(prompt_x)
    step = lambda i, x: x + 1e-3 * forward(x)[1][:, : c.embed_dim]
    return prompt_x, jax.lax.fori_loop(0, new_tokens, step, x)

  f = jax.jit(run)
  args = (jnp.ones((batch * prompt_len, c.embed_dim)), jnp.ones((batch, c.embed_dim)))
  jax.block_until_ready(f(*args))
  return _best_of(lambda: jax.block_until_ready(f(*args)), repeats)


def model_flops_per_token(config, context: float) -> float:
  """Forward FLOPs for one token: 2 × matmul params + attention over `context` slots."""
  c = config
  per_layer = 2 * c.embed_dim * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim
  per_layer += 2 * 3 * c.embed_dim * c.mlp_dim
  per_layer += 2 * 2 * c.num_heads * c.head_dim * context
  return c.num_layers * per_layer + 2 * c.embed_dim * c.vocab_size


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--new_tokens", type=int, default=96)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()

  config = model_lib.ModelConfig(
    family="llama",
    vocab_size=512,
    embed_dim=256,
    mlp_dim=768,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    rope_theta=500_000.0,
    tie_embeddings=False,
  )
  params = model_lib.init_params(config, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, config.vocab_size, (args.batch, args.prompt_len)).tolist()
  stop = -1  # no stop token: every row generates exactly new_tokens (same work for both)

  sampler = sampler_lib.Sampler(
    config,
    rule=sampler_lib.SamplingRule(temperature=1.0),
    max_new_tokens=args.new_tokens,
    stop_ids=[stop],
    chunk_rows=args.batch,
    prompts_per_chunk=args.batch,
    prompt_buckets=(args.prompt_len,),
  )
  rows = np.arange(args.batch)
  start = time.perf_counter()
  sampler.generate(params, prompts, rows, jax.random.key(0))
  compile_s = time.perf_counter() - start
  keys = iter(range(1, 1000))
  ours_s = _best_of(
    lambda: sampler.generate(params, prompts, rows, jax.random.key(next(keys))), args.repeats
  )
  tokens = args.batch * args.new_tokens

  import torch
  import transformers

  torch.set_num_threads(os.cpu_count())
  with tempfile.TemporaryDirectory() as folder:
    weights.save_hf(config, params, folder)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
  inputs = torch.tensor(prompts, dtype=torch.long)

  def hf_generate():
    with torch.no_grad():
      hf_model.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        eos_token_id=None,
        pad_token_id=0,
      )

  hf_generate()  # warm-up
  hf_s = _best_of(hf_generate, args.repeats)

  peak = matmul_flops_per_s()
  floor_s = matmul_floor_s(config, args.batch, args.prompt_len, args.new_tokens, args.repeats)
  flops = args.batch * (
    args.prompt_len * model_flops_per_token(config, args.prompt_len / 2)
    + args.new_tokens * model_flops_per_token(config, args.prompt_len + args.new_tokens / 2)
  )
  result = {
    "git_commit": metrics.git_commit(),
    "args": vars(args),
    "batch": args.batch,
    "prompt_len": args.prompt_len,
    "new_tokens": args.new_tokens,
    "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
    "cpus": os.cpu_count(),
    "ours_s": round(ours_s, 4),
    "hf_s": round(hf_s, 4),
    "ours_tokens_per_s": round(tokens / ours_s, 1),
    "hf_tokens_per_s": round(tokens / hf_s, 1),
    "ratio_vs_hf": round(hf_s / ours_s, 2),
    "matmul_peak_gflops": round(peak / 1e9, 2),
    "ours_gflops": round(flops / ours_s / 1e9, 2),
    "fraction_of_matmul_peak": round(flops / ours_s / peak, 4),
    "matmul_floor_s": round(floor_s, 4),
    "ours_over_matmul_floor": round(ours_s / floor_s, 2),  # 1 = nothing but the matmuls
    "ratio_vs_hf_bound": round(hf_s / floor_s, 2),  # what matmuls alone would reach
    "compile_s": round(compile_s, 2),
    "compiles": sampler.compiles,
  }
  print(json.dumps(result))


if __name__ == "__main__":
  main()
