"""Reinforce-Ada-pos on Llama-3.2-3B-Instruct with the paper's hyper-parameters (TPU VM).

  python -m ada_jax.main --config=configs/llama3b_pos.py --workdir=gs://BUCKET/runs/l3b_pos

Weights and tokenizer come from `model.hf_dir` (a local Hugging Face folder, or the Hub id,
downloaded when online). Training prompts: the MATH problems outside MATH500 through the
TFDS builder (offline: `--config.data.manual_dir=DIR` with the JSONL files). Mesh: FSDP over
all chips of the host/slice; micro-batching and remat keep the 3B step within a v4-8's HBM.
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
  c = common.get_config()
  c.model.hf_dir = "meta-llama/Llama-3.2-3B-Instruct"  # local folder or Hub id
  c.model.dtype = "bfloat16"
  c.tokenizer.eos_ids = (128001, 128009)  # <|end_of_text|>, <|eot_id|>

  c.data.source = "math_train"
  c.data.prompt_style = "chat"

  c.ada.method = "pos"

  c.rl.steps = 400
  c.rl.batch_prompts = 512

  c.sampler.chunk_rows = 256
  c.sampler.prompts_per_chunk = 32

  c.train.micro_batch_size = 32
  c.train.remat = True

  c.eval.benchmarks = ("math500", "minerva_math", "olympiadbench", "aime24", "amc23")
  c.eval.k = 32

  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1
  return c
