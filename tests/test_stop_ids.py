"""Stop ids come from the model folder's generation_config.json: Llama 3.2 Instruct's three
([128001, 128008, 128009]) each end a response in the training and evaluation samplers,
and the ids a run used are in its log, its summary and its export."""

import json
import shutil

import jax
import numpy as np
import pytest
import tokenizers
from tokenizers import AddedToken, models, pre_tokenizers

from ada_jax import inputs, loop
from ada_jax.data import arith
from ada_jax.eval import sampling as eval_sampling
from ada_jax.eval.benchmarks import EvalConfig
from ada_jax.models import decoder as model_lib
from ada_jax.models import weights
from ada_jax.models.tokenizer import Tokenizer, TokenizerConfig
from ada_jax.rollout import sampler as sampler_lib
from ada_jax.rollout.spec import SamplerSpec

LLAMA32_STOPS = [128001, 128008, 128009]  # Llama-3.2-3B-Instruct's generation_config.json
BUDGET = 6


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
  """A folder laid out as Llama 3.2 Instruct's: 128,000 plain words, then its special
  tokens at their ids, `eos_token` <|eot_id|> and generation_config's three stop ids."""
  specials = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128008: "<|eom_id|>"}
  specials[128009] = "<|eot_id|>"
  vocab = {f"w{i}": i for i in range(128000)}
  vocab.update({specials.get(i, f"<|reserved_{i}|>"): i for i in range(128000, 128256)})
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w0"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens([AddedToken(t, special=True) for t in specials.values()])
  folder = tmp_path_factory.mktemp("llama32")
  tok.save(str(folder / "tokenizer.json"))
  config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  generation = {"bos_token_id": 128000, "eos_token_id": LLAMA32_STOPS}
  (folder / "generation_config.json").write_text(json.dumps(generation))
  return folder


def _always(config, params, token):
  """Params under which every next token is `token`: blocks add nothing, every embedding is
  the same vector, and only `token`'s output row is non-zero (logit gap 16 per unit)."""
  params = jax.tree.map(np.asarray, params)
  for name, layer in params.items():
    if name.startswith("layer_"):
      layer["attn"]["o"] = np.zeros_like(layer["attn"]["o"])
      layer["mlp"]["down"] = np.zeros_like(layer["mlp"]["down"])
  params["embed"] = np.ones_like(params["embed"])
  params["final_norm"]["scale"] = np.ones_like(params["final_norm"]["scale"])
  head = np.zeros_like(params["lm_head"])
  head[token] = 4.0
  params["lm_head"] = head
  return params


@pytest.fixture(scope="module")
def model():
  config = model_lib.preset(
    "tiny-llama", vocab_size=128256, embed_dim=16, mlp_dim=32, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=8, tie_embeddings=False,
  )  # fmt: skip
  return config, model_lib.init_params(config, jax.random.key(0))


def test_the_folders_three_stop_ids_are_the_runs(llama_folder):
  spec = weights.ModelSpec(preset="llama-3.2-3b-instruct")
  _, _, tok = inputs.load_model_files(spec, TokenizerConfig(dir=str(llama_folder)))
  assert sorted(tok.eos_ids) == LLAMA32_STOPS
  assert Tokenizer.from_dir(llama_folder).eos_ids == tok.eos_ids


def _lengths(smp, params):
  out, _ = smp.generate(params, [[5, 6, 7]], [0, 0], jax.random.key(1))
  return out["tokens"][:, 0].tolist(), out["lengths"].tolist()


def test_each_stop_id_ends_a_response_in_training_and_evaluation(llama_folder, model):
  config, params = model
  tok = Tokenizer.from_dir(llama_folder)
  spec = SamplerSpec(max_new_tokens=BUDGET, chunk_rows=8, prompt_buckets=(8,))
  training = sampler_lib.Sampler.from_spec(
    config, spec, stop_ids=tok.eos_ids, rows_per_prompt=8, pad_id=tok.pad_id
  )
  evaluation = eval_sampling.make_sampler(
    config, tok, EvalConfig(benchmarks=(), k=2, sampler=spec, max_prompt_tokens=8)
  )
  for smp in (training, evaluation):
    for stop in LLAMA32_STOPS:
      assert _lengths(smp, _always(config, params, stop)) == ([stop, stop], [1, 1])
    # Any other token runs to the budget: the three ids are what stops it.
    assert _lengths(smp, _always(config, params, 128010)) == ([128010] * 2, [BUDGET] * 2)


@pytest.mark.slow
def test_a_runs_stop_ids_are_in_its_log_summary_and_export(tmp_path, capsys):
  from test_loop import tiny_config

  folder = tmp_path / "tok"
  shutil.copytree(arith.TOKENIZER_DIR, folder)
  stops = [2, 7, 6]  # <eos>, <|end|>, <|assistant|>
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
  c = tiny_config(1)
  c.warmstart = None
  c.tokenizer.dir = str(folder)
  c.eval.benchmarks = ()
  c.ckpt.export_hf = True
  summary = loop.run(c, str(tmp_path / "run"))
  assert summary["stop_ids"] == stops
  assert json.loads((tmp_path / "run" / "summary.json").read_text())["stop_ids"] == stops
  assert f"stop ids {stops}" in capsys.readouterr().err  # the console log
  gen = json.loads((tmp_path / "run" / "hf_final" / "generation_config.json").read_text())
  assert gen["eos_token_id"] == stops


@pytest.mark.parametrize("stops", [(2, 5), (7,)])
def test_the_builtin_tokenizer_takes_the_configs_stop_ids(stops):
  """`tokenizer.eos_ids` with no folder (the arithmetic task's own tokenizer) was recorded
  and ignored; it is what the run stops on, like a folder's override."""
  from ada_jax.config import ConfigError

  spec = weights.ModelSpec(preset="tiny-llama")
  _, _, tok = inputs.load_model_files(spec, TokenizerConfig(eos_ids=stops))
  assert tok.eos_ids == stops
  _, _, default = inputs.load_model_files(spec, TokenizerConfig())
  assert default.eos_ids == (2,)
  with pytest.raises(ConfigError, match=r"config\.tokenizer\.eos_ids \(the built-in tokenizer\)"):
    inputs.load_model_files(spec, TokenizerConfig(eos_ids=(10**6,)))
