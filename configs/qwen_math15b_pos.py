"""Reinforce-Ada-pos on Qwen2.5-Math-1.5B (base model, paper hyper-parameters).

  python -m ada_jax.main --config=configs/qwen_math15b_pos.py --workdir=/gcs/BUCKET/runs/q15b_pos

Budgets as the authors' training script sets them for every model: prompts take at most
1,024 tokens (the largest prompt bucket), training responses 2,048, evaluation responses
4,096 at temperature 1.0 (Avg@32). Qwen2.5-Math's config.json says 4,096 positions; the
released script overrides `max_position_embeddings` to 32,768 for training and evaluation,
and so does `model.overrides` here (RoPE without scaling: the override only lifts the
length check, positions past 4,096 are ones the checkpoint was not trained on).
"""

import ml_collections

from configs import common, llama3b_pos

# GPU hosts (`--config=configs/qwen_math15b_pos.py:h100x8`): rollout and evaluation slots
# sized to 8 GPUs' memory on the default mesh (fsdp 2 x tensor 4), from
# XLA:GPU's plan (experiments/results/memory_plan_<host>.json, docs/gpu.md).
HOSTS = {
  "h100x8": dict(chunk_rows=512, eval_chunk_rows=256),
  "h200x8": dict(chunk_rows=1024, eval_chunk_rows=512),
}


def get_config(host: str = "") -> ml_collections.ConfigDict:
  c = llama3b_pos.get_config()
  c.model.hf_dir = "Qwen/Qwen2.5-Math-1.5B"  # local folder or Hub id
  # The authors' released hard set (their easy set: RLHFlow/reinforce_ada_simple_prompt_1-5b).
  c.data.verl_set = "RLHFlow/reinforce_ada_hard_prompt_1-5b"
  c.tokenizer.eos_ids = ()  # the folder's stop ids (generation_config.json), as released
  # The released script's override (config.json: 4,096), so that 1,024 + 4,096 evaluates.
  c.model.overrides.max_position_embeddings = 32768
  # The Qwen configs' slices (v4-32 for the 7B) hold the train state beside the sampler.
  c.train.offload_state = False
  c.sampler.max_new_tokens = 2048  # training response budget (released script: 2,048)
  c.eval.sampler.max_new_tokens = 4096  # evaluation response budget (authors' evaluation: 4,096)
  c.eval.sampler.temperature = 1.0  # Avg@32 sampled at T = 1 (authors' evaluation)
  # Slots: the most that fit a v5e-8 beside the train state (XLA:TPU's plan,
  # `python -m ada_jax.plan --topology=v5e-8`; docs/tpu.md section 7).
  c.sampler.chunk_rows = 256
  c.eval.sampler.chunk_rows = 160
  return common.on_host(c, host, HOSTS)
