"""GRPO (n = 4) baseline of `llama3b_pos.py` (Llama-3.2-3B-Instruct, paper settings).

  python -m ada_jax.main --config=configs/llama3b_grpo.py --workdir=/gcs/BUCKET/runs/l3b_grpo

As the authors ran it: `common.released_baseline` (std normalization, dual clip 3, weight
decay 0.01, no warm-up). `--config.ada.std_normalize=False` gives the Dr.GRPO-style variant.
"""

import ml_collections

from configs import common, llama3b_pos


def get_config(host: str = "") -> ml_collections.ConfigDict:
  return common.released_baseline(llama3b_pos.get_config(host))
