"""Reinforce-Ada-pos on the procedural arithmetic task, sized for a 2-core CPU (minutes).

  python -m ada_jax.main --config=configs/tiny_arith_pos.py --workdir=/tmp/ada_tiny

A 3-layer d=96 Llama-architecture model with the task's character tokenizer is
warm-started by a short supervised stage on 1-3 digit additions that stops once 2-digit
problems are solved 60% of the time (greedy), then RL-trained on 2-3 digit additions of the
training split. That leaves about half of the RL prompts at pass rates
strictly between 0 and 1 — where adaptive sampling matters (docs/design.md "Data";
experiments/calibrate_arith.py measured the mix). Held-out accuracy (Avg@4 on unseen
problems of the same distribution) is measured before and after RL: workdir/summary.json.
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
  c = common.get_config()
  c.model.preset = "tiny-llama"
  c.model.dtype = "float32"
  c.model.overrides = ml_collections.ConfigDict(
    dict(
      vocab_size=128,  # covers the 105-token arithmetic tokenizer
      embed_dim=96,
      mlp_dim=384,
      num_layers=3,
      num_heads=4,
      num_kv_heads=4,
      head_dim=24,
      tie_embeddings=False,
      rope_scaling=None,
      rope_theta=10_000.0,
      max_position_embeddings=64,
    )
  )

  c.data.source = "arith"
  c.data.arith = ml_collections.ConfigDict(dict(levels=(2, 3), level_weights=(), ops=("+",)))
  c.data.arith_prompts = 20_000  # training prompts per epoch
  c.data.max_prompt_tokens = 16

  c.sampler.max_new_tokens = 12  # '\boxed{' + up to 4 digits + '}' + EOS fits
  c.sampler.chunk_rows = 256
  c.sampler.prompt_buckets = (16,)

  c.ada.method = "pos"

  c.rl.steps = 100
  c.rl.batch_prompts = 64
  c.rl.verifier.judge = "exact"
  c.rl.verifier.num_workers = 1

  c.optim.learning_rate = 3e-4  # 1e-3 collapses within 10 steps (calibrate_arith.py)
  c.optim.warmup_steps = 0

  c.ckpt.every_steps = 20
  c.train.mini_batch_prompts = 0  # one update per RL step, every method (the calibrated setting)
  c.ckpt.export_hf = False

  c.warmstart = ml_collections.ConfigDict(
    dict(
      steps=1200,
      batch_size=64,
      learning_rate=3e-3,
      target_accuracy=0.6,
      target_level=2,
      task=ml_collections.ConfigDict(
        dict(levels=(1, 2, 3), level_weights=(1.0, 3.0, 2.0), ops=("+",))
      ),
    )
  )

  c.eval.benchmarks = ("arith",)
  c.eval.k = 4
  c.eval.sampler.max_new_tokens = 12
  c.eval.arith_problems = 256
  c.eval.arith_levels = (2, 3)
  c.eval.arith_ops = ("+",)
  c.eval.sampler.prompt_buckets = (16,)
  c.eval.sampler.chunk_rows = 256
  c.eval.max_prompt_tokens = 16
  c.eval.verifier = ml_collections.ConfigDict(dict(num_workers=1))
  return c
