"""GRPO (n = 4, one pass) baseline of `smollm2_arith_pos.py`, as the authors ran it
(`common.released_baseline`: std normalization, dual clip 3, weight decay 0.01, no warm-up).

  python -m ada_jax.main --config=configs/smollm2_arith_grpo.py --workdir=/tmp/smollm2_grpo

Set-up (the converted model folder): as `smollm2_arith_pos.py`.
"""

import ml_collections

from configs import common, smollm2_arith_pos


def get_config() -> ml_collections.ConfigDict:
  return common.released_baseline(smollm2_arith_pos.get_config())
