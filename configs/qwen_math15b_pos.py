"""Reinforce-Ada-pos on Qwen2.5-Math-1.5B (base model, paper hyper-parameters).

  python -m ada_jax.main --config=configs/qwen_math15b_pos.py --workdir=/gcs/BUCKET/runs/q15b_pos

Qwen2.5-Math has a 4096-token context: prompts <= 1024 and responses <= 2048 tokens fit.
"""

import ml_collections

from configs import llama3b_pos


def get_config() -> ml_collections.ConfigDict:
  c = llama3b_pos.get_config()
  c.model.hf_dir = "Qwen/Qwen2.5-Math-1.5B"  # local folder or Hub id
  c.tokenizer.eos_ids = (151643, 151645)  # <|endoftext|>, <|im_end|>
  return c
