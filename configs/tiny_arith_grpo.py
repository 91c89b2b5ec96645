"""GRPO (n = 4, one pass, local group statistics) baseline of `tiny_arith_pos.py`.

  python -m ada_jax.main --config=configs/tiny_arith_grpo.py --workdir=/tmp/ada_tiny_grpo

As the authors ran it: `common.released_baseline` (std normalization, dual clip 3, weight
decay 0.01, no warm-up). `--config.ada.std_normalize=False` gives the Dr.GRPO-style variant.
"""

import ml_collections

from configs import common, tiny_arith_pos


def get_config() -> ml_collections.ConfigDict:
  return common.released_baseline(tiny_arith_pos.get_config())
