"""Reinforce-Ada-balance variant of `qwen_math15b_pos.py`.

  python -m ada_jax.main --config=configs/qwen_math15b_balance.py \
      --workdir=/gcs/BUCKET/runs/q15b_balance
"""

import ml_collections

from configs import qwen_math15b_pos


def get_config(host: str = "") -> ml_collections.ConfigDict:
  c = qwen_math15b_pos.get_config(host)
  c.ada.method = "balance"
  return c
