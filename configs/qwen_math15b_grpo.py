"""GRPO (n = 4) baseline of `qwen_math15b_pos.py`.

  python -m ada_jax.main --config=configs/qwen_math15b_grpo.py --workdir=/gcs/BUCKET/runs/q15b_grpo
"""

import ml_collections

from configs import qwen_math15b_pos


def get_config() -> ml_collections.ConfigDict:
  c = qwen_math15b_pos.get_config()
  c.ada.method = "grpo"
  return c
