"""Reinforce-Ada-pos on Qwen2.5-Math-1.5B (base model, paper hyper-parameters).

  python -m ada_jax.main --config=configs/qwen_math15b_pos.py --workdir=/gcs/BUCKET/runs/q15b_pos

Qwen2.5-Math has 4,096 positions: prompts take at most 1,024 tokens (the largest prompt
bucket), responses 3,072, in training and evaluation alike (the authors' setting for
Qwen2.5-Math; the shared 4,096-token evaluation budget would not fit).
"""

import ml_collections

from configs import llama3b_pos


def get_config() -> ml_collections.ConfigDict:
  c = llama3b_pos.get_config()
  c.model.hf_dir = "Qwen/Qwen2.5-Math-1.5B"  # local folder or Hub id
  c.tokenizer.eos_ids = (151643, 151645)  # <|endoftext|>, <|im_end|>
  c.sampler.max_new_tokens = 3072  # 1024-token prompt bucket + 3072 = the 4096 positions
  c.eval.max_new_tokens = 3072
  return c
