"""The decoder's architecture: `ModelConfig` (Llama 3.x, Qwen2/2.5, Qwen3 in one set of
fields), its `llama3` RoPE scaling, and the one table of model families: `FAMILIES` (each
family's Hugging Face class and fixed attention traits; its tiny preset `tiny-<family>`,
from which the tests' random checkpoints are made), `PRESETS` (the named architectures)
and `HUB_PRESETS` (the Hub ids the presets describe). Field names follow the Hugging
Face config.json keys they are read from (`weights.config_from_hf`).

`decoder` re-exports `ModelConfig`, `PRESETS` and `preset`, so callers that only build a
model need one import.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family as Hugging Face names it (config.json's `model_type`).

  Attributes:
    hf_architecture: its transformers class (config.json's `architectures`).
    qkv_bias: its q/k/v projections always have a bias (Qwen2/2.5); in another family a
      bias is config.json's `attention_bias`.
    qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
  """

  hf_architecture: str
  qkv_bias: bool = False
  qk_norm: bool = False


# Adding a family: an entry here, its tiny preset `tiny-<family>` in `PRESETS`, and the
# decoder's code for whatever its traits do not cover.
FAMILIES = {
  "llama": Family("LlamaForCausalLM"),
  "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True),
  "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """`llama3` RoPE frequency scaling (Llama 3.1/3.2 `rope_scaling` in config.json)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


# The largest architecture sizes accepted: well beyond every released model (405B: 126
# layers, width 16,384, MLP 53,248, 128 heads; vocabularies up to 262,144), far below what
# would make set-up loop for hours or allocate without bound on a corrupt config.json or GGUF.
MAX_SIZES = {
  "vocab_size": 1 << 21,
  "embed_dim": 1 << 16,
  "mlp_dim": 1 << 18,
  "num_layers": 1024,
  "num_heads": 1024,
  "num_kv_heads": 1024,
  "head_dim": 1024,
  "max_position_embeddings": 1 << 24,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of one decoder (hashable: it is a static argument under jit).

  Attributes:
    family: a key of `FAMILIES` (the Hugging Face `model_type`).
    vocab_size: V.
    embed_dim: D, the residual width (`hidden_size`).
    mlp_dim: F, the SwiGLU hidden width (`intermediate_size`).
    num_layers: L.
    num_heads: N query heads.
    num_kv_heads: K key/value heads; N must be a multiple of K (grouped-query attention).
    head_dim: H.
    rope_theta: RoPE base frequency.
    rope_scaling: `llama3` scaling, or None for plain RoPE.
    rms_norm_eps: epsilon inside every RMSNorm.
    tie_embeddings: output projection is the transposed input embedding.
    qkv_bias: q/k/v projections have a bias (Qwen2/2.5).
    qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
    max_position_embeddings: longest position the checkpoint was trained for.
    dtype: compute dtype of activations and the KV cache ('float32' or 'bfloat16').
    param_dtype: storage dtype of the parameters.
  """

  family: str
  vocab_size: int
  embed_dim: int
  mlp_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 500_000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-5
  tie_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  max_position_embeddings: int = 131_072
  dtype: str = "float32"
  param_dtype: str = "float32"

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"ModelConfig.family: {self.family!r} is not one of {', '.join(FAMILIES)}")
    for name, most in MAX_SIZES.items():
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
      if value > most:
        raise ValueError(
          f"ModelConfig.{name}={value} is beyond any real model's (at most {most}): a "
          "corrupt or hostile config"
        )
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
        f"num_kv_heads ({self.num_kv_heads})"
      )
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16"):
        raise ValueError(
          f"ModelConfig.{name} must be 'float32' or 'bfloat16', got {getattr(self, name)!r}"
        )

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)


_LLAMA32_ROPE = RopeScaling(
  factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA31_ROPE = RopeScaling(
  factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

# Published architectures (config.json of each Hugging Face checkpoint).
PRESETS: dict[str, ModelConfig] = {
  "llama-3.2-3b": ModelConfig(
    family="llama",
    vocab_size=128_256,
    embed_dim=3072,
    mlp_dim=8192,
    num_layers=28,
    num_heads=24,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500_000.0,
    rope_scaling=_LLAMA32_ROPE,
    rms_norm_eps=1e-5,
    tie_embeddings=True,
  ),
  "llama-3.1-8b": ModelConfig(
    family="llama",
    vocab_size=128_256,
    embed_dim=4096,
    mlp_dim=14_336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500_000.0,
    rope_scaling=_LLAMA31_ROPE,
    rms_norm_eps=1e-5,
    tie_embeddings=False,
  ),
  "qwen2.5-math-1.5b": ModelConfig(
    family="qwen2",
    vocab_size=151_936,
    embed_dim=1536,
    mlp_dim=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    tie_embeddings=True,
    qkv_bias=True,
    max_position_embeddings=4096,
  ),
  "qwen2.5-math-7b": ModelConfig(
    family="qwen2",
    vocab_size=152_064,
    embed_dim=3584,
    mlp_dim=18_944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    tie_embeddings=False,
    qkv_bias=True,
    max_position_embeddings=4096,
  ),
  "qwen3-4b": ModelConfig(
    family="qwen3",
    vocab_size=151_936,
    embed_dim=2560,
    mlp_dim=9728,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_embeddings=True,
    qk_norm=True,
    max_position_embeddings=40_960,
  ),
  # SmolLM2-135M-Instruct (configs/smollm2_arith_*.py, from its GGUF: models/from_gguf.py).
  "smollm2-135m": ModelConfig(
    family="llama",
    vocab_size=49_152,
    embed_dim=576,
    mlp_dim=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100_000.0,
    rms_norm_eps=1e-5,
    tie_embeddings=True,
    max_position_embeddings=8192,
  ),
  # Tiny shapes for tests and CPU runs; one per family so each code path is exercised.
  "tiny-llama": ModelConfig(
    family="llama",
    vocab_size=512,
    embed_dim=64,
    mlp_dim=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=500_000.0,
    rope_scaling=RopeScaling(factor=32.0, original_max_position_embeddings=64),
    tie_embeddings=True,
  ),
  "tiny-qwen2": ModelConfig(
    family="qwen2",
    vocab_size=512,
    embed_dim=64,
    mlp_dim=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    qkv_bias=True,
  ),
  "tiny-qwen3": ModelConfig(
    family="qwen3",
    vocab_size=512,
    embed_dim=64,
    mlp_dim=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_embeddings=True,
    qk_norm=True,
  ),
}
PRESETS["llama-3.2-3b-instruct"] = PRESETS["llama-3.2-3b"]
# Hub ids of the published checkpoints -> their presets: a plan names the architecture of
# an experiment config's `model.hf_dir` without reading its config.json.
HUB_PRESETS = {
  "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b",
  "meta-llama/Llama-3.2-3B": "llama-3.2-3b",
  "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
  "Qwen/Qwen2.5-Math-1.5B": "qwen2.5-math-1.5b",
  "Qwen/Qwen2.5-Math-7B": "qwen2.5-math-7b",
  "Qwen/Qwen3-4B": "qwen3-4b",
}


def preset(name: str, **overrides) -> ModelConfig:
  """Returns the named preset with optional field overrides (e.g. `dtype='bfloat16'`).

  Raises:
    ValueError: unknown preset name.
  """
  if name not in PRESETS:
    raise ValueError(f"model preset {name!r} unknown; choose one of {sorted(PRESETS)}")
  return dataclasses.replace(PRESETS[name], **overrides)
