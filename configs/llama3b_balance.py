"""Reinforce-Ada-balance variant of `llama3b_pos.py` (Llama-3.2-3B-Instruct, paper settings).

python -m ada_jax.main --config=configs/llama3b_balance.py --workdir=/gcs/BUCKET/runs/l3b_balance
"""

import ml_collections

from configs import llama3b_pos


def get_config(host: str = "") -> ml_collections.ConfigDict:
  c = llama3b_pos.get_config(host)
  c.ada.method = "balance"
  return c
