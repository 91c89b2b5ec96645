"""Reinforce-Ada-pos on the procedural arithmetic task, sized for a 2-core CPU (minutes).

  python -m ada_jax.main --config=configs/tiny_arith_pos.py --workdir=/tmp/ada_tiny

A 3-layer Llama-architecture model with the task's character tokenizer is warm-started by
a short supervised stage, then RL-trained; held-out accuracy (Avg@4) is measured before
and after RL (workdir/summary.json).
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
  c = common.get_config()
  c.model.preset = "tiny-llama"
  c.model.dtype = "float32"
  c.model.overrides = ml_collections.ConfigDict(dict(
      vocab_size=128,  # covers the 105-token arithmetic tokenizer
      embed_dim=128, mlp_dim=384, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
      tie_embeddings=False, rope_scaling=None, rope_theta=10_000.0))

  c.data.source = "arith"
  c.data.arith = ml_collections.ConfigDict(dict(
      levels=(1, 2, 3, 4), level_weights=(), ops=("+", "-"), heldout_fraction=0.1))
  c.data.arith_prompts = 20_000  # training prompts per epoch
  c.data.max_prompt_tokens = 16

  c.sampler.max_new_tokens = 16  # '\boxed{' + up to 9 digits + '}' + EOS fits
  c.sampler.chunk_rows = 256
  c.sampler.prompts_per_chunk = 32
  c.sampler.prompt_buckets = (16,)

  c.ada.method = "pos"

  c.rl.steps = 60
  c.rl.batch_prompts = 32
  c.rl.judge = "exact"
  c.rl.verifier_workers = 1

  c.optim.learning_rate = 2e-4
  c.optim.warmup_steps = 0

  c.ckpt.every_steps = 10
  c.ckpt.export_hf = False

  c.warmstart = ml_collections.ConfigDict(dict(
      steps=600, batch_size=64, learning_rate=3e-3,
      task=ml_collections.ConfigDict(dict(levels=(1, 2, 3), ops=("+", "-")))))

  c.eval.benchmarks = ("arith",)
  c.eval.k = 4
  c.eval.max_new_tokens = 16
  c.eval.arith_problems = 256
  c.eval.arith_levels = (1, 2, 3, 4)
  c.eval.prompt_buckets = (16,)
  c.eval.chunk_rows = 256
  c.eval.max_prompt_tokens = 16
  c.eval.verifier_workers = 1
  return c
