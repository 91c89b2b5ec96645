"""Decoder-only transformer covering Llama 3.x, Qwen2/2.5 and Qwen3, in Flax NNX.

The modules are NNX, but every public entry point is a pure function of
`(config, params, ...)`, where `params` is a plain nested dict of arrays (the NNX state
as a pure dict). That one pytree is what optax updates, orbax saves, `sharding.py`
places and `weights.py` converts; the module graph is rebuilt from the frozen config at
trace time. A KV cache is never module state: the rollout pool's (`rollout.slots`) writes
and reads through `forward`'s `attention` argument.

Shape letters (used in einsum strings, docstrings and logical axis names):
  B batch (rows)        T query length       S key length (cache slots)
  D model width         N query heads        K kv heads
  G query heads per kv head (N // K)         H head dim
  F MLP width           V vocabulary         L layers

Numerics follow the Hugging Face reference implementations (`LlamaForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`): RMSNorm in fp32 then cast back, rotate-half
RoPE (with the `llama3` frequency scaling), softmax in fp32, logits in fp32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ada_jax.models import layers as layers_lib
from ada_jax.models.architecture import PRESETS as PRESETS
from ada_jax.models.architecture import ModelConfig
from ada_jax.models.architecture import RopeScaling as RopeScaling
from ada_jax.models.architecture import preset as preset
from ada_jax.models.layers import Block, RMSNorm, make_param, rope_frequencies

Params = dict[str, Any]


class Transformer(nnx.Module):
  """The decoder. Layers are attributes `layer_0 ... layer_{L-1}` so that parameter paths
  are plain strings (orbax and safetensors keys stay stable). `fused`: each layer's
  projections in the layout their matmuls read (`fuse`), the samplers' rollout copy, in
  that fused layout as made for the config's widths (`layers.made_layout`, here once for
  every layer); '' for separate ones."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, fused: str = ""):
    pd = config.weight_dtype
    if fused:
      fused = layers_lib.made_layout(fused, config.embed_dim, config.head_dim)
    self.embed = make_param(
      rngs,
      (config.vocab_size, config.embed_dim),
      ("vocab", "embed"),
      pd,
      1.0 / math.sqrt(config.embed_dim),
    )
    for i in range(config.num_layers):
      setattr(self, f"layer_{i}", Block(config, rngs, fused))
    self.final_norm = RMSNorm(config.embed_dim, config.rms_norm_eps, "embed", pd)
    if not config.tie_embeddings:
      self.lm_head = make_param(
        rngs,
        (config.vocab_size, config.embed_dim),
        ("vocab", "embed"),
        pd,
        1.0 / math.sqrt(config.embed_dim),
      )
    self.config = config

  def __call__(
    self,
    tokens,
    positions,
    segments=None,
    *,
    remat: bool = False,
    last_only: bool = False,
    head: bool = True,
    attention: Callable[[int], Callable] | None = None,
    self_attend: Callable | None = None,
  ):
    """Returns (logits `float32[B, T, V]` (`[B, 1, V]` if last_only), per layer the (k, v)
    `layers.Attention` returned). With `head=False` the first output is the final-normed
    hidden state `[B, T, D]` (compute dtype) instead of the logits. `attention(layer)` gives that
    layer's cache write and read (`layers.Attention`); None attends causally over the T
    tokens within their `segments` (`layers.causal_attend`, or `self_attend(q, k, v,
    segments)` where given: `flash.self_attend`)."""
    c = self.config
    x = jnp.take(self.embed.value, tokens, axis=0).astype(c.compute_dtype)
    inv_freq = rope_frequencies(c)
    kvs = []
    if remat and attention is None:
      x = self._scan_blocks(x, positions, inv_freq, segments, self_attend)
    else:
      for i in range(c.num_layers):
        layer_attention = None if attention is None else attention(i)
        layer = getattr(self, f"layer_{i}")
        x, kv = layer(x, positions, inv_freq, segments, layer_attention, self_attend)
        kvs.append(kv)
    if last_only:  # prefill for sampling: skip the [B, T, V] logits of the prompt
      x = x[:, -1:]
    x = self.final_norm(x)
    if not head:
      return x, kvs
    return unembed(c, self.output_embedding(), x), kvs

  def _scan_blocks(self, x, positions, inv_freq, segments, self_attend):
    """The blocks as one `lax.scan` over their stacked parameters, each rematerialised.

    Why a scan: with the blocks unrolled, XLA is free to schedule every block's recomputed
    forward before the first block's backward, and XLA:CPU does (measured on the 3B
    training step: the attention scores of all 28 layers live at once, ~9 GiB per device).
    A scan's backward is a loop, so one block's activations exist at a time. The stacked
    copy of the block parameters costs one extra copy of them; the layer_i parameter names
    (checkpoints, safetensors) stay as they are. Keys and values are not returned.
    """
    graphdef, _ = nnx.split(self.layer_0)
    layers = [nnx.state(getattr(self, f"layer_{i}")) for i in range(self.config.num_layers)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)

    @jax.checkpoint
    def body(x, layer_state):
      y, _ = nnx.merge(graphdef, layer_state)(x, positions, inv_freq, segments, None, self_attend)
      return y, None

    return jax.lax.scan(body, x, stacked)[0]

  def output_embedding(self) -> jax.Array:
    """The `[V, D]` output projection (the input embedding when tied)."""
    return self.embed.value if self.config.tie_embeddings else self.lm_head.value


def unembed(config: ModelConfig, table: jax.Array, x: jax.Array) -> jax.Array:
  """Logits `float32[..., V]` of hidden states `x` `[..., D]` under the output projection
  `table` `[V, D]` (matmul in the compute dtype, accumulated in float32)."""
  return jnp.einsum(
    "...d,vd->...v", x, table.astype(config.compute_dtype), preferred_element_type=jnp.float32
  )


# ----------------------------------------------------------------------------- pure API


@functools.lru_cache(maxsize=32)
def _graphdef(config: ModelConfig, fused: str = ""):
  abstract = nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0), fused))
  return nnx.split(abstract)[0]


def fused_layout(params: Params) -> str:
  """The layout of a fused tree (`fuse`: the layers' q, k, v as one `qkv`, gate and up as
  one `gate_up`), read from its shapes: `gate_up` 'dgf' where it is `[D, 2, F]` with D !=
  2, else 'gdf'; `qkv` 'dkgh' where it is `[D, K, G + 2, H]` with H != D, else 'kghd'
  (`layers.made_layout` makes the cases it cannot tell apart the first); '' for a tree of
  separate projections."""
  layer = params.get("layer_0", {})
  if "qkv" not in layer.get("attn", {}):
    return ""
  shape = layer["mlp"]["gate_up"].shape
  gate_up = "dgf" if shape[1] == 2 and shape[0] != 2 else "gdf"
  width, qkv = shape[gate_up.index("d")], layer["attn"]["qkv"].shape
  return f"{gate_up}-dkgh" if qkv[-1] != width else gate_up


def _module(config: ModelConfig, params: Params) -> Transformer:
  return nnx.merge(_graphdef(config, fused_layout(params)), params)


def init_params(config: ModelConfig, rng: jax.Array) -> Params:
  """Random parameters (normal, fan-in scaled; norms at 1), a nested dict of arrays.

  Args:
    config: the architecture.
    rng: a PRNG key.

  Returns:
    Nested dict, e.g. `params['layer_0']['attn']['q']` is `param_dtype[D, N, H]`.
  """
  model = Transformer(config, nnx.Rngs(params=rng))
  return nnx.to_pure_dict(nnx.state(model))


_BIASES = ("q_bias", "k_bias", "v_bias")


def fuse(params: Params, layout: str = "gdf") -> Params:
  """The same weights with each layer's projections in the layout their matmuls read
  (`layers.made_layout` of `layout`, a fused layout name): `attn.qkv` (`layers.fuse_qkv`:
  'kghd' `[K, G + 2, H, D]`, 'dkgh' `[D, K, G + 2, H]` and o `[H, N, D]`) for q, k, v
  (their biases, if any, `attn.qkv_bias` `[K, G + 2, H]`, `layers.fuse_qkv_bias`) and
  `mlp.gate_up` (`layers.fuse_gate_up`: 'gdf' `[2, D, F]`, 'dgf' `[D, 2, F]`) for gate,
  up; every other leaf as it is. Every function here takes either tree. The samplers'
  rollout copy is fused once per RL step (`Sampler.rollout_params`, in its platform's
  `fused_layout`): from separate weights a decode loop stacks them itself, and XLA hoists
  that stack out of the loop as a copy of them all. A tree fused in `layout` is returned
  as it is.

  Raises:
    ValueError: an unknown layout, or a tree already fused in another one.
  """
  _, d = params["embed"].shape
  have = fused_layout(params)
  if have:
    qkv = params["layer_0"]["attn"]["qkv"].shape  # [K, G + 2, H, D] or [D, K, G + 2, H]
    h = qkv[3] if have.endswith("-dkgh") else qkv[2]
    if have != layers_lib.made_layout(layout, d, h):
      raise ValueError(f"params are fused in layout {have!r}, asked for {layout!r}")
    return params
  made = layers_lib.made_layout(layout, d, params["layer_0"]["attn"]["k"].shape[2])
  gate_up, qkv_order = layers_lib.split_layout(made)

  def layer(p):
    attn = {k: v for k, v in p["attn"].items() if k not in ("q", "k", "v") + _BIASES}
    mlp = {k: v for k, v in p["mlp"].items() if k not in ("gate", "up")}
    attn["qkv"] = layers_lib.fuse_qkv(p["attn"]["q"], p["attn"]["k"], p["attn"]["v"], qkv_order)
    if qkv_order == "dkgh":
      attn["o"] = p["attn"]["o"].transpose(1, 0, 2)  # [H, N, D], `layers.Attention`
    if "q_bias" in p["attn"]:
      attn["qkv_bias"] = layers_lib.fuse_qkv_bias(*(p["attn"][b] for b in _BIASES))
    mlp["gate_up"] = layers_lib.fuse_gate_up(p["mlp"]["gate"], p["mlp"]["up"], gate_up)
    return {**p, "attn": attn, "mlp": mlp}

  return {k: layer(v) if k.startswith("layer_") else v for k, v in params.items()}


@functools.lru_cache(maxsize=16)
def _abstract(config: ModelConfig, fused: str) -> tuple[Params, Params]:
  """(`param_shapes`, `logical_axes`) of `config`, traced once per architecture and layout:
  each trace builds the whole model abstractly (0.1-1 s on a CPU host), and the samplers
  ask for the rollout copy's shardings at every RL step and evaluation."""
  shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  if fused:
    shapes = jax.eval_shape(lambda p: fuse(p, fused), shapes)
  abstract = nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0), fused))
  axes = nnx.to_pure_dict(nnx.state(abstract), lambda v: tuple(v.get_metadata()["axes"]))
  return shapes, axes


def _copy(tree: Params) -> Params:
  """A new nested dict of the same leaves (a cached tree is never handed out to be edited)."""
  return {k: _copy(v) if isinstance(v, dict) else v for k, v in tree.items()}


def param_shapes(config: ModelConfig, fused: str = "") -> Params:
  """`jax.ShapeDtypeStruct` of every parameter (of the tree `fuse`d in layout `fused`, if
  one is named), with no allocation."""
  return _copy(_abstract(config, fused)[0])


def logical_axes(config: ModelConfig, fused: str = "") -> Params:
  """Logical axis names of every parameter (same tree as the params, or the tree `fuse`d
  in layout `fused`; tuples of str or None).

  Names: 'vocab', 'embed', 'heads', 'kv_heads', 'head_dim', 'mlp'. `sharding.py` maps them
  to mesh axes with one rule table.
  """
  return _copy(_abstract(config, fused)[1])


def check_vocab(config: ModelConfig, tokenizer_vocab_size: int) -> None:
  """Raises ValueError naming `ModelConfig.vocab_size` when the tokenizer has ids the
  embedding table has no row for (a smaller tokenizer is fine: padded vocabularies)."""
  if tokenizer_vocab_size > config.vocab_size:
    raise ValueError(
      f"ModelConfig.vocab_size ({config.vocab_size}) is smaller than the tokenizer's "
      f"({tokenizer_vocab_size})"
    )


def positions_from_mask(attention_mask: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
  """Per-row positions `int32[B, T]` of a left-padded batch: 0 at each row's first real
  token, counting up; padding positions are 0 (they are masked anyway). A numpy mask gives
  a numpy result (host-side batches: nothing is compiled)."""
  xp = np if isinstance(attention_mask, np.ndarray) else jnp
  return xp.maximum(xp.cumsum(attention_mask.astype(xp.int32), axis=-1) - 1, 0)


def logits(
  config: ModelConfig,
  params: Params,
  tokens: jax.Array,
  positions: jax.Array,
  attention_mask: jax.Array | None = None,
  *,
  remat: bool = False,
) -> jax.Array:
  """Full causal forward without a cache.

  Args:
    config: the architecture (static under jit).
    params: the parameter tree of `init_params` / `weights.load_hf`.
    tokens: `int32[B, T]`, left-padded.
    positions: `int32[B, T]` RoPE positions (see `positions_from_mask`).
    attention_mask: `bool[B, T]`, True at real tokens; None means all real.
    remat: rematerialise each block in the backward pass (saves activation memory).

  Returns:
    `float32[B, T, V]` next-token logits at every position (garbage at padding positions).
  """
  if attention_mask is None:
    attention_mask = jnp.ones(tokens.shape, bool)
  out, _ = _module(config, params)(tokens, positions, attention_mask, remat=remat)
  return out


def hidden_states(
  config: ModelConfig,
  params: Params,
  tokens: jax.Array,
  positions: jax.Array,
  segments: jax.Array | None = None,
  *,
  remat: bool = False,
  self_attend: Callable | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Full causal forward without a cache, stopping before the output projection.

  `logits(...)` equals `unembed(config, table, hidden)`; callers that need only some
  positions' logits, or the logits block by block (`losses.token_logprobs`), start here so
  that the `[B, T, V]` array never exists whole.

  Args:
    as `logits`; `segments` as its `attention_mask`, or `int32[B, T]` ids of sequences
    packed in a row (0 at padding; `layers.causal_attend`), positions counting from 0 in
    each; `self_attend` as `Transformer`'s.

  Returns:
    (final-normed hidden states `[B, T, D]` in the compute dtype, the output projection
    `[V, D]`, i.e. the input embedding when tied).
  """
  if segments is None:
    segments = jnp.ones(tokens.shape, bool)
  module = _module(config, params)
  hidden, _ = module(tokens, positions, segments, remat=remat, head=False, self_attend=self_attend)
  return hidden, module.output_embedding()


def forward(
  config: ModelConfig,
  params: Params,
  tokens: jax.Array,
  positions: jax.Array,
  attention: Callable[[int], Callable],
  *,
  last_only: bool = False,
  head: bool = True,
) -> tuple[jax.Array, list]:
  """A forward pass whose attention is a cache's own (`Transformer(attention=...)`): the
  rollout pool's caches write and read through it.

  Args:
    tokens, positions: `int32[B, T]`.
    attention: `attention(layer)(qkv, positions, inv_freq) -> (out, (keys, values))`, as
      `layers.Attention` calls it.
    last_only: only the last position's output (a prefill's).
    head: False returns the final-normed hidden states (compute dtype) instead of logits.

  Returns:
    (`float32[B, T, V]` logits (`[B, 1, V]` if last_only; `[B, T or 1, D]` hidden states
    if not head), per layer the (keys, values) the attention returned).
  """
  return _module(config, params)(
    tokens, positions, None, attention=attention, last_only=last_only, head=head
  )
