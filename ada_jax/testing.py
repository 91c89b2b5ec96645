"""Tiny fixtures shared by the tests: random Hugging Face checkpoints and reference decoders.

Importing this module needs only JAX; `save_tiny_hf` needs torch and transformers (dev
requirements), which are test oracles only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ada_jax import checkpoint
from ada_jax.data import arith
from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding, weights
from ada_jax.rl import controller, losses, train

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"


def load_experiment(name: str, module_name: str = ""):
  """The script `experiments/<name>.py` of this checkout, imported as module `module_name`
  (default `name`) and registered in `sys.modules` (dataclasses look their module up
  there). Raises FileNotFoundError when the checkout has no such script."""
  spec = importlib.util.spec_from_file_location(module_name or name, EXPERIMENTS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def tiny_hf_config(family: str) -> dict:
  """The transformers config.json of one tiny checkpoint of `family`
  (`architecture.FAMILIES`): its tiny preset `tiny-<family>` with a 256-token vocabulary
  and positions; the Llama one keeps the preset's llama3 rope scaling (factor 32, as
  Llama-3.2-3B) from 16 original positions, so that short prompts reach the scaled band."""
  config = model_lib.PRESETS[f"tiny-{family}"]
  sizes = dict(vocab_size=256, max_position_embeddings=256)
  if config.rope_scaling is not None:
    sizes["rope_scaling"] = dataclasses.replace(
      config.rope_scaling, original_max_position_embeddings=16
    )
  return weights.config_to_hf(dataclasses.replace(config, **sizes))


def save_tiny_hf(family: str, folder: str | pathlib.Path, seed: int = 0, init_std: float = 0.2):
  """Saves a random tiny `*ForCausalLM` of `family` with transformers; returns the model.

  `init_std` is larger than transformers' 0.02 so that logits are peaked enough for greedy
  decoding to have clear winners (no near-ties that fp32 rounding could flip).
  """
  import torch
  import transformers

  kwargs = tiny_hf_config(family)
  config = transformers.AutoConfig.for_model(
    kwargs.pop("model_type"), **kwargs, initializer_range=init_std
  )
  torch.manual_seed(seed)
  hf_model = transformers.AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():  # RMSNorm scales start at 1; perturb them so they are tested too.
    for name, p in hf_model.named_parameters():
      if "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  hf_model.save_pretrained(folder)
  return hf_model


def left_padded_batch(lengths, total: int, vocab: int, seed: int = 0):
  """Random left-padded prompts: (tokens int32[B, total], mask bool[B, total])."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, vocab, size=(len(lengths), total)).astype(np.int32)
  mask = np.arange(total)[None, :] >= total - np.asarray(lengths)[:, None]
  return np.where(mask, tokens, 0).astype(np.int32), mask


def greedy_reference(config, params, tokens, mask, steps: int) -> np.ndarray:
  """Greedy continuation by re-running the full (no-cache) forward each step.

  Slow on purpose: it shares no code path with the KV cache, so it is the oracle for the
  cached decoders. Tokens are appended into a fixed buffer so that one compile serves all
  steps (causal attention never reads the empty slots to the right). Returns
  `int32[B, steps]`.
  """
  b, t = tokens.shape
  buf = jnp.concatenate([jnp.asarray(tokens), jnp.zeros((b, steps), jnp.int32)], 1)
  mask = jnp.concatenate([jnp.asarray(mask), jnp.ones((b, steps), bool)], 1)
  pos = model_lib.positions_from_mask(mask)

  @jax.jit
  def step(buf, i):
    out = model_lib.logits(config, params, buf, pos, mask)
    nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(out, t - 1 + i, 1, keepdims=False), -1)
    return jax.lax.dynamic_update_index_in_dim(buf, nxt.astype(jnp.int32), t + i, 1)

  for i in range(steps):
    buf = step(buf, i)
  return np.asarray(buf[:, t:])


def rl_batch(
  config,
  params,
  prompt_lengths,
  response_lengths,
  *,
  prompt_len: int,
  response_len: int,
  noise: float = 0.3,
  seed: int = 0,
):
  """A random RL training batch (`train.TrainBatch` of numpy arrays) for loss/train tests.

  Row i is a left-padded prompt of `prompt_lengths[i]` tokens in a `prompt_len` window,
  then a response of `response_lengths[i]` tokens right-padded to `response_len`. Old
  log-probs are the model's own (under `params`) plus Gaussian `noise`, so ratios sit near
  1 and both clipped and unclipped tokens occur; advantages are standard normal.
  """
  rng = np.random.default_rng(seed)
  rows, total = len(prompt_lengths), prompt_len + response_len
  cols = np.arange(total)[None, :]
  p = np.asarray(prompt_lengths)[:, None]
  r = np.asarray(response_lengths)[:, None]
  prompt = (cols >= prompt_len - p) & (cols < prompt_len)
  response = (cols >= prompt_len) & (cols < prompt_len + r)
  attention = prompt | response
  tokens = np.where(attention, rng.integers(1, config.vocab_size, (rows, total)), 0)
  tokens = tokens.astype(np.int32)
  positions = np.asarray(model_lib.positions_from_mask(jnp.asarray(attention)))
  logprobs, _ = jax.jit(lambda t, q, m: losses.token_logprobs(config, params, t, q, m))(
    tokens, positions, attention
  )
  old = np.asarray(logprobs) + noise * rng.standard_normal((rows, total))
  return train.TrainBatch(
    tokens=tokens,
    positions=positions.astype(np.int32),
    segments=attention.astype(np.int32),
    loss_mask=response,
    advantages=np.where(attention, rng.standard_normal(rows)[:, None], 0.0).astype(np.float32),
    old_logprobs=np.where(response, old, 0.0).astype(np.float32),
  )


def tiny_arith_model(seed: int = 0, **overrides):
  """A 1-layer d=32 Llama for the arithmetic tokenizer: (ModelConfig, random params)."""
  config = model_lib.ModelConfig(
    **{
      **dict(
        family="llama",
        vocab_size=arith.load_tokenizer().vocab_size,
        embed_dim=32,
        mlp_dim=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
      ),
      **overrides,
    }
  )
  return config, model_lib.init_params(config, jax.random.key(seed))


def save_arith_model(
  config, params, folder: pathlib.Path, checkpoint_dir: pathlib.Path, step: int = 3
) -> dict:
  """Writes one model both ways a user points the tools at it: a Hugging Face folder with
  the arithmetic tokenizer files, and an orbax run checkpoint `step` in `checkpoint_dir`.

  Returns:
    The `ModelConfig` fields as `model.overrides` of a 'tiny-llama' preset config group.
  """
  weights.save_hf(config, params, folder)
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    (pathlib.Path(folder) / name).write_text((arith.TOKENIZER_DIR / name).read_text())
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  state = train.init_train_state(config, train.TrainConfig(), params, mesh)
  manager = checkpoint.make_manager(checkpoint_dir)
  checkpoint.save(manager, step, checkpoint.RunState(train=state, rng=jax.random.key(0)))
  checkpoint.close(manager)
  return {
    f.name: getattr(config, f.name)
    for f in dataclasses.fields(config)
    if f.name not in ("dtype", "param_dtype")
  }


def rounds_step(config, prompt_ids, draw, rng, **kwargs):
  """`controller.run_step` under `rounds` on a scripted `draw(prompts) -> (rewards,
  handles)` (`controller.DrawEngine`), the result's handles (row ids, which under `rounds`
  number the rows in draw order) mapped to `draw`'s own. Keyword arguments go to
  `run_step`."""
  served = []

  def rewards_only(prompts):
    rewards, handles = draw(prompts)
    served.extend(handles)
    return rewards

  engine = controller.DrawEngine(rewards_only)
  result, est = controller.run_step(config, prompt_ids, engine, rng, schedule="rounds", **kwargs)
  return dataclasses.replace(result, handles=[served[h] for h in result.handles]), est
