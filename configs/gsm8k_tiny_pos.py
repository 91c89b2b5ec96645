"""The real pipeline at real sequence lengths on a CPU: GSM8K prompts, the Llama 3
tokenizer, a tiny random Llama-architecture model, math-verify rewards, Reinforce-Ada-pos.

  python -m ada_jax.main --config=configs/gsm8k_tiny_pos.py --workdir=/tmp/ada_gsm8k

It needs the Llama 3 `tokenizer.json` in `shared/tokenizers/llama3/` beside the checkout
(or `--config.tokenizer.dir=DIR`). The GSM8K files come from `shared/data/` beside the
checkout when present (`common.shared_path`), else from `--config.data.manual_dir=DIR`,
else they are downloaded from GitHub (openai/grade-school-math) on first use.

The model is random (rewards are ~0: this checks plumbing, shapes and speed, not
learning). Point `--config.model.hf_dir=DIR --config.model.preset=''` at a Hugging Face
folder to load weights instead.
"""

import ml_collections

from configs import common


def get_config() -> ml_collections.ConfigDict:
  c = common.get_config()
  c.model.preset = "tiny-llama"
  c.model.dtype = "float32"
  c.model.overrides = ml_collections.ConfigDict(dict(vocab_size=128_256))
  # tokenizer.json only (no chat template); a path that is absent is named by the error.
  c.tokenizer.dir = str(common.SHARED / "tokenizers" / "llama3")
  c.tokenizer.eos_ids = (128001, 128009)

  c.data.source = "gsm8k"
  c.data.split = "train"
  c.data.prompt_style = "plain"
  c.data.max_prompt_tokens = 512

  c.sampler.max_new_tokens = 256
  c.sampler.chunk_rows = 64
  c.sampler.prompt_buckets = (128, 256, 512)

  c.ada.method = "pos"
  c.ada.seq.max_rounds = 2

  c.rl.steps = 3
  c.rl.batch_prompts = 8
  c.train.mini_batch_prompts = 2  # 4 updates per step, as the paper's 512 / 128
  c.rl.verifier.num_workers = 2

  c.optim.learning_rate = 1e-5
  c.ckpt.every_steps = 1
  c.ckpt.export_hf = False
  c.eval.benchmarks = ()
  return c
