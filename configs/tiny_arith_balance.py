"""Reinforce-Ada-balance variant of `tiny_arith_pos.py` (same model, data, budget of steps).

python -m ada_jax.main --config=configs/tiny_arith_balance.py --workdir=/tmp/ada_tiny_balance
"""

import ml_collections

from configs import tiny_arith_pos


def get_config() -> ml_collections.ConfigDict:
  c = tiny_arith_pos.get_config()
  c.ada.method = "balance"
  return c
