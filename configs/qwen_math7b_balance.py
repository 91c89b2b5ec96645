"""Reinforce-Ada-balance variant of `qwen_math7b_pos.py`.

  python -m ada_jax.main --config=configs/qwen_math7b_balance.py \
      --workdir=/gcs/BUCKET/runs/q7b_balance
"""

import ml_collections

from configs import qwen_math7b_pos


def get_config(host: str = "") -> ml_collections.ConfigDict:
  c = qwen_math7b_pos.get_config(host)
  c.ada.method = "balance"
  return c
