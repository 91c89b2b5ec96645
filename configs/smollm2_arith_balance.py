"""Reinforce-Ada-balance variant of `smollm2_arith_pos.py` (same model, task and sizes).

  python -m ada_jax.main --config=configs/smollm2_arith_balance.py --workdir=/tmp/smollm2_balance

Set-up (the converted model folder): as `smollm2_arith_pos.py`.
"""

import ml_collections

from configs import smollm2_arith_pos


def get_config() -> ml_collections.ConfigDict:
  c = smollm2_arith_pos.get_config()
  c.ada.method = "balance"  # exit on n/2 positives and n/2 negatives
  return c
