"""Reinforce-Ada-pos on Qwen2.5-Math-7B (base model, paper hyper-parameters).

  python -m ada_jax.main --config=configs/qwen_math7b_pos.py --workdir=/gcs/BUCKET/runs/q7b_pos

The 1.5B config (`configs/qwen_math15b_pos.py`: the released budgets and position
override, stop ids from the model folder) with the 7B weights, the authors' 7B prompt set
and micro-batches sized for a v4-32.
"""

import ml_collections

from configs import common, qwen_math15b_pos

# GPU hosts (`--config=configs/qwen_math7b_pos.py:h100x8`): rollout and evaluation slots
# sized to 8 GPUs' memory on the default mesh (fsdp 2 x tensor 4), from
# XLA:GPU's plan (experiments/results/memory_plan_<host>.json, docs/gpu.md).
HOSTS = {
  "h100x8": dict(chunk_rows=768, eval_chunk_rows=512),
  "h200x8": dict(chunk_rows=1536, eval_chunk_rows=1024),
}


def get_config(host: str = "") -> ml_collections.ConfigDict:
  c = qwen_math15b_pos.get_config()
  c.model.hf_dir = "Qwen/Qwen2.5-Math-7B"  # local folder or Hub id
  # The authors' released hard set (their easy set: RLHFlow/reinforce_ada_easy_prompt).
  c.data.verl_set = "RLHFlow/reinforce_ada_hard_prompt"
  # Sized for a v4-32 (16 devices: tensor 4 × fsdp 4): one row per data-parallel group.
  c.train.micro_batch_size = 4
  # Rollout and evaluation slots: the most that fit a v4-32 with 0.5 GiB spare in every
  # phase (XLA:TPU's plan, `python -m ada_jax.plan --topology=v4-32`; docs/tpu.md).
  c.sampler.chunk_rows = 1856
  c.eval.sampler.chunk_rows = 1152
  return common.on_host(c, host, HOSTS)
