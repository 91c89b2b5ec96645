"""Hugging Face checkpoint folders <-> (ModelConfig, params).

`load_hf` streams a folder (config.json plus one or several `*.safetensors`, with
`model.safetensors.index.json` when sharded) tensor by tensor: each tensor is read,
re-laid out, cast and placed on its target sharding before the next is read, so the host
never holds more than one tensor of the model. `save_hf` writes the inverse, a folder that
`transformers.AutoModelForCausalLM.from_pretrained` loads. Every name, shape and config
field is checked; nothing loads partially.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from ada_jax.models import decoder as model_lib
from ada_jax.models.architecture import FAMILIES
from ada_jax.models.decoder import PRESETS, ModelConfig, Params, RopeScaling
from ada_jax.models.folder import CheckpointError, model_folder, resolve, write_safetensors

# Buffers some exporters write that are derived, not learned.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Which model a run uses (the run config's `model` group). Exactly one of `preset` /
  `hf_dir` names the architecture.

  Attributes:
    preset: a `decoder.PRESETS` name; weights are random unless `hf_dir` or a checkpoint
      provides them.
    hf_dir: a Hugging Face folder (or Hub id): architecture from its config.json, weights
      loaded at start (docs/design.md "One RL step", set-up).
    dtype: compute dtype of activations, matmuls, the KV cache and the sampler's rollout
      copy of the weights ('float32' or 'bfloat16').
    param_dtype: storage dtype of the parameters, hence of the train state (AdamW moments
      are kept in it too) and of checkpoints ('float32' or 'bfloat16'). float32 as verl
      (FSDP MixedPrecision), MaxText and tunix keep their masters: at lr 1e-6 a bfloat16
      master is below half an ulp for |w| > ~5e-4 and does not move (docs/design.md
      "Precision").
    overrides: `ModelConfig` fields replacing the preset's (e.g. tiny CPU shapes).

  Raises:
    ValueError: both or neither of `preset` / `hf_dir`, an unknown preset, or an override
      that is no `ModelConfig` field (each named).
  """

  preset: str = ""
  hf_dir: str = ""
  dtype: str = "float32"
  param_dtype: str = "float32"
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if bool(self.preset) == bool(self.hf_dir):
      raise ValueError("set exactly one of model.preset and model.hf_dir")
    if self.preset and self.preset not in PRESETS:
      raise ValueError(f"model.preset {self.preset!r} unknown; choose one of {sorted(PRESETS)}")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    for key in self.overrides:
      if key not in known or key in ("dtype", "param_dtype"):
        raise ValueError(
          f"model.overrides.{key}: not a ModelConfig field an override may set"
          + (f" (set model.{key})" if key in ("dtype", "param_dtype") else "")
        )
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16"):
        raise ValueError(
          f"model.{name} must be 'float32' or 'bfloat16', got {getattr(self, name)!r}"
        )

  def model_config(self, hf_config: Mapping[str, Any] | None = None) -> ModelConfig:
    """The architecture: the preset with `overrides`, or `hf_config` (the `hf_dir`'s
    config.json as a dict), computing in `dtype` with parameters stored in `param_dtype`.

    Raises:
      CheckpointError: `hf_config` is not a supported architecture.
      ValueError: an override or dtype `ModelConfig` rejects.
    """
    if self.preset:
      base = PRESETS[self.preset]
    else:
      base = config_from_hf(dict(hf_config or {}), source=f"{self.hf_dir}/config.json")
    return dataclasses.replace(
      base, dtype=self.dtype, param_dtype=self.param_dtype, **dict(self.overrides)
    )


def config_from_hf(
  hf: dict[str, Any], *, source: str = "config.json", dtype: str = "float32"
) -> ModelConfig:
  """Reads a transformers `config.json` dict (v4 `rope_scaling` or v5 `rope_parameters`).

  Args:
    hf: the parsed config.json.
    source: the file name to quote in errors.
    dtype: parameter and compute dtype of the returned config.

  Raises:
    CheckpointError: unsupported `model_type`, a missing field, or an unsupported rope type.
  """

  def field(name, default=...):
    if name in hf and hf[name] is not None:
      return hf[name]
    if default is ...:
      raise CheckpointError(f"{source}: required field {name!r} is missing")
    return default

  family = field("model_type")
  if family not in FAMILIES:
    raise CheckpointError(
      f"{source}: model_type {family!r} is not supported (supported: {sorted(FAMILIES)})"
    )
  traits = FAMILIES[family]
  rope = dict(hf.get("rope_parameters") or {})
  if hf.get("rope_scaling"):
    rope.update(hf["rope_scaling"])
  rope_theta = float(rope.get("rope_theta", field("rope_theta", 10_000.0)))
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type == "llama3":
    try:
      scaling = RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
      )
    except KeyError as e:
      raise CheckpointError(f"{source}: llama3 rope scaling lacks field {e.args[0]!r}") from None
  elif rope_type == "default":
    scaling = None
  else:
    raise CheckpointError(
      f"{source}: rope_type {rope_type!r} is not supported (supported: default, llama3)"
    )
  heads = int(field("num_attention_heads"))
  hidden = int(field("hidden_size"))
  for flag in ("attention_bias", "mlp_bias"):
    if hf.get(flag) and not (flag == "attention_bias" and traits.qkv_bias):
      raise CheckpointError(f"{source}: {flag}=true is not supported for {family}")
  try:
    return ModelConfig(
      family=family,
      vocab_size=int(field("vocab_size")),
      embed_dim=hidden,
      mlp_dim=int(field("intermediate_size")),
      num_layers=int(field("num_hidden_layers")),
      num_heads=heads,
      num_kv_heads=int(field("num_key_value_heads", heads)),
      head_dim=int(field("head_dim", hidden // heads)),
      rope_theta=rope_theta,
      rope_scaling=scaling,
      rms_norm_eps=float(field("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(field("tie_word_embeddings", False)),
      qkv_bias=traits.qkv_bias,
      qk_norm=traits.qk_norm,
      max_position_embeddings=int(field("max_position_embeddings", 131_072)),
      dtype=dtype,
      param_dtype=dtype,
    )
  except ValueError as e:
    raise CheckpointError(f"{source}: {e}") from None


def config_to_hf(config: ModelConfig, dtype: str | None = None) -> dict[str, Any]:
  """The transformers `config.json` dict for `config` (v5 `rope_parameters` layout), its
  weights stored in `dtype` (default `config.param_dtype`), written as both `dtype` (v5)
  and `torch_dtype` (v4 and inference servers)."""
  dtype = dtype or config.param_dtype
  rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
  if config.rope_scaling is not None:
    s = config.rope_scaling
    rope.update(
      rope_type="llama3",
      factor=s.factor,
      low_freq_factor=s.low_freq_factor,
      high_freq_factor=s.high_freq_factor,
      original_max_position_embeddings=s.original_max_position_embeddings,
    )
  return {
    "architectures": [FAMILIES[config.family].hf_architecture],
    "model_type": config.family,
    "vocab_size": config.vocab_size,
    "hidden_size": config.embed_dim,
    "intermediate_size": config.mlp_dim,
    "num_hidden_layers": config.num_layers,
    "num_attention_heads": config.num_heads,
    "num_key_value_heads": config.num_kv_heads,
    "head_dim": config.head_dim,
    "rms_norm_eps": config.rms_norm_eps,
    "rope_theta": config.rope_theta,
    "rope_parameters": rope,
    "rope_scaling": rope if config.rope_scaling is not None else None,
    "tie_word_embeddings": config.tie_embeddings,
    "max_position_embeddings": config.max_position_embeddings,
    # A family whose projections always have a bias (Qwen2) writes no flag for it.
    "attention_bias": config.qkv_bias and not FAMILIES[config.family].qkv_bias,
    "hidden_act": "silu",
    "dtype": dtype,
    "torch_dtype": dtype,
  }


# ----------------------------------------------------------------------------- name table


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every tensor a Hugging Face folder of `config` holds, by name, with its shape."""
  return {name: shape for name, (_, shape, _, _) in _tensor_table(config).items()}


def _tensor_table(
  config: ModelConfig,
) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], Callable, Callable]]:
  """HF tensor name -> (our param path, HF shape, hf_to_ours, ours_to_hf)."""
  c = config
  d, f, n, k, h, v = (c.embed_dim, c.mlp_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size)
  same = lambda x: x
  t = lambda x: x.T

  def proj_in(heads):  # [heads*H, D] <-> [D, heads, H]
    return (lambda x: x.T.reshape(d, heads, h), lambda x: x.reshape(d, heads * h).T)

  def bias(heads):
    return (lambda x: x.reshape(heads, h), lambda x: x.reshape(heads * h))

  table = {
    "model.embed_tokens.weight": (("embed",), (v, d), same, same),
    "model.norm.weight": (("final_norm", "scale"), (d,), same, same),
  }
  if not c.tie_embeddings:
    table["lm_head.weight"] = (("lm_head",), (v, d), same, same)
  for i in range(c.num_layers):
    hf, ours = f"model.layers.{i}.", f"layer_{i}"
    table.update(
      {
        hf + "input_layernorm.weight": ((ours, "attn_norm", "scale"), (d,), same, same),
        hf + "post_attention_layernorm.weight": ((ours, "mlp_norm", "scale"), (d,), same, same),
        hf + "self_attn.q_proj.weight": ((ours, "attn", "q"), (n * h, d), *proj_in(n)),
        hf + "self_attn.k_proj.weight": ((ours, "attn", "k"), (k * h, d), *proj_in(k)),
        hf + "self_attn.v_proj.weight": ((ours, "attn", "v"), (k * h, d), *proj_in(k)),
        hf + "self_attn.o_proj.weight": (
          (ours, "attn", "o"),
          (d, n * h),
          lambda x: x.T.reshape(n, h, d),
          lambda x: x.reshape(n * h, d).T,
        ),
        hf + "mlp.gate_proj.weight": ((ours, "mlp", "gate"), (f, d), t, t),
        hf + "mlp.up_proj.weight": ((ours, "mlp", "up"), (f, d), t, t),
        hf + "mlp.down_proj.weight": ((ours, "mlp", "down"), (d, f), t, t),
      }
    )
    if c.qkv_bias:
      for name, heads in (("q", n), ("k", k), ("v", k)):
        table[hf + f"self_attn.{name}_proj.bias"] = (
          (ours, "attn", f"{name}_bias"),
          (heads * h,),
          *bias(heads),
        )
    if c.qk_norm:
      for name in ("q", "k"):
        table[hf + f"self_attn.{name}_norm.weight"] = (
          (ours, "attn", f"{name}_norm", "scale"),
          (h,),
          same,
          same,
        )
  return table


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


# ----------------------------------------------------------------------------- load / save


def _open_safetensors(file: pathlib.Path):
  """`safe_open` of one weights file; a truncated or empty one is named (safetensors' own
  error names no file)."""
  try:
    return safe_open(str(file), framework="numpy")
  except (SafetensorError, OSError) as e:
    raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def _safetensors_files(folder: pathlib.Path) -> list[pathlib.Path]:
  index = folder / "model.safetensors.index.json"
  if index.exists():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise CheckpointError(f"{index}: malformed index ({e})") from None
    files = [folder / name for name in sorted(set(weight_map.values()))]
  else:
    files = sorted(folder.glob("*.safetensors"))
  if not files:
    raise CheckpointError(f"{folder}: no *.safetensors weights found")
  for file in files:
    if not file.exists():
      raise CheckpointError(f"{file}: listed in the index but missing")
  return files


def load_hf(
  path: str | os.PathLike, *, dtype=jnp.float32, shardings: Params | None = None
) -> tuple[ModelConfig, Params]:
  """Loads a Hugging Face Llama/Qwen2/Qwen3 checkpoint, one tensor at a time.

  Args:
    path: a folder with config.json and safetensors weights, or a Hub repo id such as
      `meta-llama/Llama-3.2-3B-Instruct` (downloaded into the HF cache when online).
    dtype: parameter dtype (`jnp.float32` or `jnp.bfloat16`); also the compute dtype of the
      returned config.
    shardings: optional tree (same structure as the params) of `jax.sharding.Sharding`;
      each tensor is placed directly onto its sharding.

  Returns:
    (config, params) where params is the tree of `model.init_params`.

  Raises:
    CheckpointError: missing folder/file/field, an unexpected or missing tensor, or a
      tensor whose shape does not match config.json (the message names it).
  """
  folder = resolve(path)
  config_file = folder / "config.json"
  if not config_file.exists():
    raise CheckpointError(f"{config_file}: missing")
  try:
    hf_config = json.loads(config_file.read_text())
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{config_file}: invalid JSON ({e})") from None
  config = config_from_hf(hf_config, source=str(config_file), dtype=jnp.dtype(dtype).name)
  table = _tensor_table(config)
  params: Params = {}
  for file, names in check_hf(folder, config).items():
    with _open_safetensors(file) as f:
      for name in names:
        our_path, _, to_ours, _ = table[name]
        value = np.asarray(to_ours(f.get_tensor(name))).astype(dtype)
        target = _get(shardings, our_path) if shardings is not None else None
        _set(params, our_path, jax.device_put(value, target))
        del value
  return config, params


def check_hf(folder: pathlib.Path, config: ModelConfig) -> dict[pathlib.Path, list[str]]:
  """Checks a folder's weights against `config` from the files' headers alone (no tensor
  read): every tensor there, none unexpected, each of its shape; so that a run refuses a
  bad folder before it writes anything.

  Returns:
    Each weights file with the tensors to load from it.

  Raises:
    CheckpointError: an unreadable file, an unexpected, missing or mis-shaped tensor (named).
  """
  table = _tensor_table(config)
  out: dict[pathlib.Path, list[str]] = {}
  for file in _safetensors_files(folder):
    with _open_safetensors(file) as f:
      for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
        if _IGNORED.match(name) or (name == "lm_head.weight" and config.tie_embeddings):
          continue
        if name not in table:
          raise CheckpointError(
            f"{file.name}: unexpected tensor {name!r} for a "
            f"{config.family} model with {config.num_layers} layers"
          )
        shape = tuple(f.get_slice(name).get_shape())
        if shape != table[name][1]:
          raise CheckpointError(
            f"{file.name}: tensor {name!r} has shape {shape}, config.json implies {table[name][1]}"
          )
        out.setdefault(file, []).append(name)
  missing = sorted(set(table) - {n for names in out.values() for n in names})
  if missing:
    raise CheckpointError(f"{folder}: {len(missing)} tensor(s) missing, e.g. {missing[:5]}")
  return out


def save_hf(
  config: ModelConfig,
  params: Params,
  path: str | os.PathLike,
  *,
  dtype: str | None = None,
  max_shard_bytes: int = 4 << 30,
  tokenizer=None,
) -> None:
  """Writes `params` as a Hugging Face folder (config.json + safetensors [+ index]), and the
  tokenizer's files when one is given (`Tokenizer.save`), whole or not at all
  (`model_folder`: the folder's old model files go, its other files stay).

  Tensors are gathered to the host one at a time and stored in `dtype` ('float32' or
  'bfloat16'; default `config.param_dtype`), which config.json names. Shards hold at most
  `max_shard_bytes` (bytes) each; more than one shard adds `model.safetensors.index.json`.

  Raises:
    CheckpointError: `params` does not match `config` (a missing or mis-shaped tensor).
    CheckpointError: also `folder.model_folder`'s refusals (nothing written).
  """
  with model_folder(path) as folder:
    _write_hf(config, params, folder, dtype or config.param_dtype, max_shard_bytes)
    if tokenizer is not None:
      tokenizer.save(folder)


def _write_hf(
  config: ModelConfig, params: Params, folder: pathlib.Path, dtype: str, max_shard_bytes: int
) -> None:
  table = _tensor_table(config)
  expected = jax.tree.map(lambda s: s.shape, model_lib.param_shapes(config))
  shards: list[dict[str, np.ndarray]] = [{}]
  sizes = [0]
  for name, (our_path, hf_shape, _, to_hf) in table.items():
    try:
      value = _get(params, our_path)
    except (KeyError, TypeError):
      raise CheckpointError(f"params lack {'/'.join(our_path)} (for {name})") from None
    if tuple(value.shape) != _get(expected, our_path):
      raise CheckpointError(
        f"params {'/'.join(our_path)} has shape {tuple(value.shape)}, "
        f"expected {_get(expected, our_path)}"
      )
    array = np.ascontiguousarray(to_hf(np.asarray(jax.device_get(value)).astype(jnp.dtype(dtype))))
    assert array.shape == hf_shape, (name, array.shape, hf_shape)
    if sizes[-1] and sizes[-1] + array.nbytes > max_shard_bytes:
      shards.append({})
      sizes.append(0)
    shards[-1][name] = array
    sizes[-1] += array.nbytes
  names = (
    ["model.safetensors"]
    if len(shards) == 1
    else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  )
  weight_map = {}
  for name, shard in zip(names, shards, strict=True):
    write_safetensors(shard, folder / name)
    weight_map.update(dict.fromkeys(shard, name))
  if len(shards) > 1:
    (folder / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, indent=2)
    )
  (folder / "config.json").write_text(json.dumps(config_to_hf(config, dtype), indent=2))
