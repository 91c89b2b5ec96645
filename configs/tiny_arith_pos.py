"""Reinforce-Ada-pos on the procedural arithmetic task, sized for a 2-core CPU.

  python -m ada_jax.main --config=configs/tiny_arith_pos.py --workdir=/tmp/ada_tiny

The full field set arrives with the training loop (main-job issue); until then this file
only names the experiment so that the entry point can report what is missing.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0  # root PRNG seed
  config.ada = ml_collections.ConfigDict()
  config.ada.method = "pos"  # grpo | dapo | pos | balance | est
  return config
