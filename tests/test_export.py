"""The exported Hugging Face folder is usable as is: transformers loads the tokenizer (chat
template, special tokens) and the model, greedy generation stops at the run's stop id, and
the logits are ours."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ada_jax import saved_params, testing
from ada_jax.data import arith
from ada_jax.models import decoder as model_lib
from ada_jax.models.tokenizer import Tokenizer
from ada_jax.rollout import sampler as sampler_lib

torch = pytest.importorskip("torch", reason="torch is the transformers backend")
transformers = pytest.importorskip("transformers", reason="transformers is the oracle")

MESSAGES = [{"role": "user", "content": "What is 12+34?"}]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """A tiny arithmetic model exported with a run tokenizer whose stop id is the token our
  greedy decoder emits third (so that a stop is reached after a few tokens)."""
  config, params = testing.tiny_arith_model(seed=0)
  base = arith.load_tokenizer()
  prompt = base.encode(base.apply_chat_template(MESSAGES))
  smp = sampler_lib.Sampler(
    config,
    rule=sampler_lib.SamplingRule(temperature=0.0),
    max_new_tokens=8,
    stop_ids=[-1],
    chunk_rows=1,
    prompts_per_chunk=1,
    prompt_buckets=(64,),
  )
  free = smp.generate(params, [prompt], [0], jax.random.key(0))[0]["tokens"][0]
  j = int(np.argmax(free == free[2]))  # first occurrence of the third token
  stop = int(free[j])
  tokenizer = Tokenizer.from_dir(arith.TOKENIZER_DIR, eos_ids=[stop])  # as config.tokenizer
  folder = tmp_path_factory.mktemp("hf_final")
  saved_params.export_hf(config, params, folder, tokenizer=tokenizer)
  return folder, config, params, tokenizer, prompt, free[: j + 1]


def test_export_holds_tokenizer_template_and_stop_ids(exported):
  folder, _, _, tokenizer, _, _ = exported
  for name in (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
  ):
    assert (folder / name).is_file(), name
  gen = json.loads((folder / "generation_config.json").read_text())
  assert gen["eos_token_id"] == list(tokenizer.eos_ids)
  # Our own loader reads it back: the run's stop ids (after the template's eos_token, which
  # is kept so that the template renders as in the run), pad id and template.
  again = Tokenizer.from_dir(folder)
  assert set(tokenizer.eos_ids) <= set(again.eos_ids) and again.pad_id == tokenizer.pad_id
  assert again.chat_template == tokenizer.chat_template
  assert again.special_tokens == tokenizer.special_tokens


def test_transformers_tokenizer_matches_ours(exported):
  folder, _, _, tokenizer, prompt, _ = exported
  hf = transformers.AutoTokenizer.from_pretrained(folder)
  text = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
  assert text == tokenizer.apply_chat_template(MESSAGES)
  assert hf(text, add_special_tokens=False)["input_ids"] == prompt
  assert (hf.bos_token, hf.eos_token, hf.pad_token) == ("<bos>", "<eos>", "<pad>")
  assert hf.decode(prompt, skip_special_tokens=True) == tokenizer.decode(prompt)


def test_transformers_model_generates_and_stops_like_ours(exported):
  folder, config, params, _, prompt, expected = exported
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  ids = torch.tensor([prompt], dtype=torch.long)
  with torch.no_grad():
    theirs = model(ids).logits.numpy()[0]
    out = model.generate(
      ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
    )
  tokens = jnp.asarray([prompt], jnp.int32)
  ours = np.asarray(
    model_lib.logits(config, params, tokens, model_lib.positions_from_mask(jnp.ones_like(tokens)))
  )[0]
  np.testing.assert_allclose(theirs, ours, atol=1e-4)
  # Stops right after the run's stop id, where our sampler would have stopped.
  np.testing.assert_array_equal(out[0, len(prompt) :].numpy(), expected)
  assert len(expected) < 8


def test_export_writes_the_compute_dtype(tmp_path):
  """float32 masters of a bf16-compute run export as bfloat16 tensors (as released
  checkpoints are), named in config.json as `dtype` and `torch_dtype`; transformers loads
  the folder in that dtype."""
  from safetensors import safe_open

  config, params = testing.tiny_arith_model(seed=1)
  config = config.replace(dtype="bfloat16", param_dtype="float32")
  saved_params.export_hf(config, params, tmp_path)
  hf_config = json.loads((tmp_path / "config.json").read_text())
  assert hf_config["dtype"] == hf_config["torch_dtype"] == "bfloat16"
  with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
    assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"bfloat16"}  # noqa: SIM118
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
  assert model.dtype == torch.bfloat16
