"""GRPO n = 4 that differs from `smollm2_arith_pos.py` only in the sampling rule
("GRPO-matched" of experiments/smollm2_learning.py): one pass of n = 4 responses per prompt,
with exactly Ada's optimizer, warm-up, clipping and advantage settings (global baseline,
no std normalization), so that a comparison of the two measures adaptive sampling alone.
The authors' GRPO baseline, with its own optimizer settings, is `smollm2_arith_grpo.py`.

  python -m ada_jax.main --config=configs/smollm2_arith_grpo_matched.py --workdir=/tmp/grpo_m

Set-up (the converted model folder): as `smollm2_arith_pos.py`.
"""

import ml_collections

from configs import smollm2_arith_pos


def get_config() -> ml_collections.ConfigDict:
  c = smollm2_arith_pos.get_config()
  c.ada.method = "grpo"
  return c
