"""The decoder's building blocks in Flax NNX: RoPE (with the `llama3` frequency scaling),
RMSNorm, grouped-query attention over an optional KV-cache slice, the SwiGLU MLP and the
pre-norm block. `decoder` assembles them into the `Transformer` and its pure API.

Shape letters as in `decoder`: B rows, T query length, S key length (cache slots), D model
width, N query heads, K kv heads, G = N // K, H head dim, F MLP width. Numerics follow the
Hugging Face reference implementations: RMSNorm in fp32 then cast back, rotate-half RoPE,
softmax in fp32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ada_jax.models.architecture import ModelConfig

# A large finite negative instead of -inf: a fully masked query row (a left-padding
# position) then gets a uniform softmax instead of NaNs that would poison gradients.
_MASK_VALUE = -1e30


# ----------------------------------------------------------------------------- RoPE


def rope_frequencies(config: ModelConfig) -> jax.Array:
  """Inverse frequencies `float32[H // 2]`, with `llama3` scaling when configured.

  Source: Llama 3.1's rope scaling as implemented by transformers'
  `_compute_llama3_parameters`: wavelengths longer than original_len / low_freq_factor are
  divided by `factor`, shorter than original_len / high_freq_factor kept, and the band in
  between interpolated smoothly.
  """
  h = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  s = config.rope_scaling
  if s is None:
    return inv_freq
  old_len = s.original_max_position_embeddings
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > old_len / s.low_freq_factor, inv_freq / s.factor, inv_freq)
  smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= old_len / s.high_freq_factor) & (wavelen <= old_len / s.low_freq_factor)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotate-half RoPE. x: `[B, T, heads, H]`; positions: `int32[B, T]`."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
  cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, :, None, :]
  sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, :, None, :]
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  # HF computes cos/sin in fp32 then casts them to the activation dtype before mixing.
  return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


# ----------------------------------------------------------------------------- modules


def make_param(rngs: nnx.Rngs, shape, axes, dtype, scale: float | None = None) -> nnx.Param:
  """A parameter with logical axis names in its `axes` metadata (see `logical_axes`)."""
  if scale is None:
    value = jnp.zeros(shape, dtype)
  else:
    value = (scale * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, axes=axes)


class RMSNorm(nnx.Module):
  """y = scale * x / rms(x), the statistic in fp32 (HF `LlamaRMSNorm`)."""

  def __init__(self, dim: int, eps: float, axis_name: str, dtype):
    self.scale = nnx.Param(jnp.ones((dim,), dtype), axes=(axis_name,))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale.value * y.astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with optional q/k/v bias and per-head q/k RMSNorm."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    c = config
    d, n, k, h, pd = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.weight_dtype
    std = 1.0 / math.sqrt(d)
    self.q = make_param(rngs, (d, n, h), ("embed", "heads", "head_dim"), pd, std)
    self.k = make_param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pd, std)
    self.v = make_param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pd, std)
    self.o = make_param(rngs, (n, h, d), ("heads", "head_dim", "embed"), pd, 1.0 / math.sqrt(n * h))
    if c.qkv_bias:
      self.q_bias = make_param(rngs, (n, h), ("heads", "head_dim"), pd)
      self.k_bias = make_param(rngs, (k, h), ("kv_heads", "head_dim"), pd)
      self.v_bias = make_param(rngs, (k, h), ("kv_heads", "head_dim"), pd)
    if c.qk_norm:
      self.q_norm = RMSNorm(h, c.rms_norm_eps, "head_dim", pd)
      self.k_norm = RMSNorm(h, c.rms_norm_eps, "head_dim", pd)
    self.config = config

  def __call__(self, x, positions, inv_freq, kv_valid, layer_cache):
    """x: `[B, T, D]`. Returns (out `[B, T, D]`, (keys `[B, K, H, S]`, values
    `[B, K, S, H]`) attended).

    Without a cache, S = T and `kv_valid` is `bool[B, T]`; with a cache `(k, v, mask,
    index)`, the new keys are written at slot `index` and S is the cache length.
    """
    c = self.config
    dt = c.compute_dtype
    # One matmul for q, k and v (fewer, larger ops: faster at decode sizes on CPU). Query
    # heads are grouped under their kv head and stacked with k and v on a new axis, so the
    # kv-head axis keeps its tensor-parallel shards aligned.
    b, t, _ = x.shape
    nk, g, h = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
    qkv = jnp.concatenate(
      [self.q.value.reshape(-1, nk, g, h), self.k.value[:, :, None], self.v.value[:, :, None]],
      axis=2,
    ).astype(dt)
    qkv = jnp.einsum("btd,dkgh->btkgh", x, qkv)
    q = qkv[:, :, :, :g].reshape(b, t, nk * g, h)
    k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]
    if c.qkv_bias:
      q = q + self.q_bias.value.astype(dt)
      k = k + self.k_bias.value.astype(dt)
      v = v + self.v_bias.value.astype(dt)
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq).transpose(0, 2, 3, 1)  # [B, K, H, T]
    v = v.transpose(0, 2, 1, 3)  # [B, K, T, H]
    if layer_cache is None:
      key_slot_ok = kv_valid[:, None, :]  # [B, 1, S=T]
      start, bound = 0, None
    else:
      ck, cv, cmask, start, bound = layer_cache
      if jnp.ndim(start):  # per-row write slots (T = 1): one scatter per row
        rows = jnp.arange(b)
        k = ck.at[rows, :, :, start].set(k[..., 0].astype(ck.dtype))
        v = cv.at[rows, :, start, :].set(v[:, :, 0].astype(cv.dtype))
      else:
        k = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, 0, 0, start))
        v = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, 0, start, 0))
      key_slot_ok = cmask[:, None, :]
    s = k.shape[3]
    # Slots are written in order, so slot order is position order within a row.
    first = jnp.reshape(start, (-1, 1, 1))  # [1 or B, 1, 1]
    causal = jnp.arange(s) <= first + jnp.arange(t)[:, None]  # [1 or B, T, S]
    if bound is not None:
      out = _attend_bounded(q, k, v, key_slot_ok & causal, *bound)
    else:
      out = _attend(q, k, v, key_slot_ok & causal)
    y = jnp.einsum("btnh,nhd->btd", out, self.o.value.astype(dt))
    return y, (k, v)


def _attend(q, k, v, mask):
  """q `[B, T, N, H]`, k `[B, K, H, S]`, v `[B, K, S, H]`, mask `bool[B, T, S]` ->
  `[B, T, N, H]`."""
  b, t, n, h = q.shape
  kh = k.shape[1]
  if t == 1:
    # Decode is bound by reading the cache. A multiply-reduce over H reads it once as a
    # fused loop; on XLA CPU the equivalent dot re-laid k out every step (2x slower).
    q = q.reshape(b, kh, n // kh, h, 1).astype(jnp.float32)
    scores = jnp.sum(q * k[:, :, None].astype(jnp.float32), axis=-2)
    scores = jnp.where(mask[:, None], scores / math.sqrt(h), _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgs,bksh->bkgh", probs, v).reshape(b, 1, n, h)
  q = q.reshape(b, t, kh, n // kh, h)
  # The dot takes [B, K, S, H] keys: XLA CPU has no bf16 x bf16 -> f32 kernel for the
  # [B, K, H, S] form, and the transposes fold away.
  k = jnp.swapaxes(k, 2, 3)
  scores = jnp.einsum("btkgh,bksh->bkgts", q, k, preferred_element_type=jnp.float32)
  scores = jnp.where(mask[:, None, None], scores / math.sqrt(h), _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bksh->btkgh", probs, v)
  return out.reshape(b, t, n, h)


def _attend_bounded(q, k, v, mask, used, block):
  """`_attend` reading only the first `ceil(used / block)` blocks of `block` slots.

  Decode is bound by reading the cache; slots past every live row's last token only add
  masked scores, so they are skipped. `lax.switch` over the static prefix lengths keeps
  every shape static (one compile) while the bytes read follow the longest live row.

  Args:
    q, k, v, mask: as `_attend` (S slots).
    used: `int32[]`, slots that any query may attend to (the rest are masked for all).
    block: static block size (slots).
  """
  s = k.shape[3]
  lengths = sorted({min(s, block * i) for i in range(1, -(-s // block) + 1)})

  def prefix(n):
    return lambda: _attend(q, k[..., :n], v[:, :, :n], mask[..., :n])

  index = jnp.searchsorted(jnp.asarray(lengths), jnp.clip(used, 1, s))
  return jax.lax.switch(index, [prefix(n) for n in lengths])


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    d, f, pd = config.embed_dim, config.mlp_dim, config.weight_dtype
    self.gate = make_param(rngs, (d, f), ("embed", "mlp"), pd, 1.0 / math.sqrt(d))
    self.up = make_param(rngs, (d, f), ("embed", "mlp"), pd, 1.0 / math.sqrt(d))
    self.down = make_param(rngs, (f, d), ("mlp", "embed"), pd, 1.0 / math.sqrt(f))
    self.dtype = config.compute_dtype

  def __call__(self, x):
    dt = self.dtype
    # One [D, 2, F] matmul instead of two [D, F]: measured ~25% faster on CPU at decode
    # sizes; inside the decode loop the stack is loop-invariant and hoisted by XLA. Stacking
    # on a new axis (not concatenating along F) keeps F's tensor-parallel shards aligned.
    gate_up = jnp.stack([self.gate.value, self.up.value], axis=1).astype(dt)
    gate_up = jnp.einsum("btd,dgf->btgf", x, gate_up)
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, self.down.value.astype(dt))


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(config.embed_dim, config.rms_norm_eps, "embed", config.weight_dtype)
    self.attn = Attention(config, rngs)
    self.mlp_norm = RMSNorm(config.embed_dim, config.rms_norm_eps, "embed", config.weight_dtype)
    self.mlp = MLP(config, rngs)

  def __call__(self, x, positions, inv_freq, kv_valid, layer_cache):
    y, kv = self.attn(self.attn_norm(x), positions, inv_freq, kv_valid, layer_cache)
    x = x + y
    return x + self.mlp(self.mlp_norm(x)), kv
