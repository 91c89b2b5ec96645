"""GRPO (n = 4, one pass, local group mean) baseline of `tiny_arith_pos.py` (same budget).

  python -m ada_jax.main --config=configs/tiny_arith_grpo.py --workdir=/tmp/ada_tiny_grpo
"""

import ml_collections

from configs import tiny_arith_pos


def get_config() -> ml_collections.ConfigDict:
  c = tiny_arith_pos.get_config()
  c.ada.method = "grpo"
  return c
