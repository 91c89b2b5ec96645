"""GRPO (n = 4) baseline of `qwen_math15b_pos.py`.

  python -m ada_jax.main --config=configs/qwen_math15b_grpo.py --workdir=/gcs/BUCKET/runs/q15b_grpo

As the authors ran it: `common.released_baseline` (std normalization, dual clip 3, weight
decay 0.01, no warm-up). `--config.ada.std_normalize=False` gives the Dr.GRPO-style variant.
"""

import ml_collections

from configs import common, qwen_math15b_pos


def get_config(host: str = "") -> ml_collections.ConfigDict:
  return common.released_baseline(qwen_math15b_pos.get_config(host))
