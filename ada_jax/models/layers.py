"""The decoder's building blocks in Flax NNX: RoPE (with the `llama3` frequency scaling),
RMSNorm, grouped-query attention (a KV cache plugs in its own write and read), the SwiGLU
MLP and the pre-norm block. `decoder` assembles them into the `Transformer` and its pure API.

Shape letters as in `decoder`: B rows, T query length, S key length (cache slots), D model
width, N query heads, K kv heads, G = N // K, H head dim, F MLP width. Numerics follow the
Hugging Face reference implementations: RMSNorm in fp32 then cast back, rotate-half RoPE,
softmax in fp32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from ada_jax.models.architecture import ModelConfig

# A large finite negative instead of -inf: a fully masked query row (a left-padding
# position) then gets a uniform softmax instead of NaNs that would poison gradients. The
# decode-attention kernels mask with it too, so that they equal `attend` on such rows.
MASK_VALUE = -1e30
# Queries per block of attention without a cache (training, log-probs): a block attends
# only to the keys up to its last position, so the blocks above the diagonal are not
# computed (at the paper's 3,072 positions, 21 of 36 blocks of the square).
QUERY_BLOCK = 512


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
  """y = scale * x / rms(x), the statistic in fp32 (HF `LlamaRMSNorm`), the output in x's
  dtype: a float32 master scale is cast to the compute dtype as every other weight is, so
  the trainer's forward on the masters and the sampler's on its rollout copy agree."""

  def __init__(self, dim: int, eps: float, axis_name: str, dtype):
    self.scale = nnx.Param(jnp.ones((dim,), dtype), axes=(axis_name,))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale.value.astype(x.dtype) * y.astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with optional q/k/v bias and per-head q/k RMSNorm.

  `fused` (a fused layout name as `made_layout` makes it; '' for none): the q, k and v projections
  held as one `qkv` in the layout's `QKV_LAYOUTS` order, `[K, G + 2, H, D]` or `[D, K, G +
  2, H]` (each kv head's G query heads, then its key and value: `fuse_qkv`; with the
  second, o `[H, N, D]` instead of `[N, H, D]`), and their
  biases as one `qkv_bias` `[K, G + 2, H]` (`fuse_qkv_bias`: stacked inside a decode loop,
  XLA:GPU re-stacked and broadcast them every layer of every step)."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, fused: str = ""):
    c = config
    d, n, k, h, pd = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.weight_dtype
    std = 1.0 / math.sqrt(d)
    qkv_order = split_layout(fused)[1] if fused else ""
    if qkv_order:
      sizes = {"k": k, "g": n // k + 2, "h": h, "d": d}
      names = {"k": "kv_heads", "g": None, "h": "head_dim", "d": "embed"}
      shape, axes = (tuple(m[a] for a in qkv_order) for m in (sizes, names))
      self.qkv = make_param(rngs, shape, axes, pd, std)
    else:
      self.q = make_param(rngs, (d, n, h), ("embed", "heads", "head_dim"), pd, std)
      self.k = make_param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pd, std)
      self.v = make_param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pd, std)
    # `fuse_qkv`'s 'dkgh' takes o as `[H, N, D]`: the order XLA:CPU's dot reads it in.
    self.o_order = "hnd" if qkv_order == "dkgh" else "nhd"
    sizes, names = {"n": n, "h": h, "d": d}, {"n": "heads", "h": "head_dim", "d": "embed"}
    shape, axes = (tuple(m[a] for a in self.o_order) for m in (sizes, names))
    self.o = make_param(rngs, shape, axes, pd, 1.0 / math.sqrt(n * h))
    if c.qkv_bias and qkv_order:
      self.qkv_bias = make_param(rngs, (k, n // k + 2, h), ("kv_heads", None, "head_dim"), pd)
    elif c.qkv_bias:
      self.q_bias = make_param(rngs, (n, h), ("heads", "head_dim"), pd)
      self.k_bias = make_param(rngs, (k, h), ("kv_heads", "head_dim"), pd)
      self.v_bias = make_param(rngs, (k, h), ("kv_heads", "head_dim"), pd)
    if c.qk_norm:
      self.q_norm = RMSNorm(h, c.rms_norm_eps, "head_dim", pd)
      self.k_norm = RMSNorm(h, c.rms_norm_eps, "head_dim", pd)
    self.config, self.fused = config, qkv_order

  def __call__(self, x, positions, inv_freq, segments, attention=None, self_attend=None):
    """x: `[B, T, D]`. Returns (out `[B, T, D]`, (keys, values)): the T tokens' own
    `[B, K, T, H]` without `attention`, else what `attention` returned (the cache's arrays,
    in its own order).

    Without `attention`, the T tokens attend causally to each other within their
    `segments` (`causal_attend`: a padding mask or packed sequences' ids), or as
    `self_attend(q, k, v, segments)` where given (a kernel's form, `flash.self_attend`).
    `attention(qkv, positions, inv_freq) -> (out, (keys, values))` replaces that with a
    KV cache's own write and read: qkv `[B, T, K, G + 2, H]` the projections before RoPE
    (`split_heads` gives the rotated q, k and v; a decode kernel may rotate them itself,
    reading the one buffer), out `[B, T, N, H]`; the cache owns its layout.
    """
    c = self.config
    dt = c.compute_dtype
    # One matmul for q, k and v (fewer, larger ops: faster at decode sizes on CPU).
    b, t, _ = x.shape
    g = c.num_heads // c.num_kv_heads
    if self.fused:
      weights, order = self.qkv.value, self.fused
    else:
      weights, order = fuse_qkv(self.q.value, self.k.value, self.v.value), "kghd"
    qkv = jnp.einsum(f"btd,{order}->btkgh", x, weights.astype(dt))
    if c.qkv_bias:
      bias = (
        self.qkv_bias.value
        if self.fused
        else fuse_qkv_bias(self.q_bias.value, self.k_bias.value, self.v_bias.value)
      )
      flat = lambda x: x.reshape(b, t, -1)
      qkv = (flat(qkv) + bias.reshape(-1).astype(dt)).reshape(qkv.shape)
    if c.qk_norm:
      q, k = self.q_norm(qkv[:, :, :, :g]), self.k_norm(qkv[:, :, :, g : g + 1])
      qkv = jnp.concatenate([q, k, qkv[:, :, :, g + 1 :]], axis=3)
    if attention is None:
      q, k, v = split_heads(qkv, positions, inv_freq)
      attend = self_attend or functools.partial(causal_attend, block=min(t, QUERY_BLOCK))
      out, kv = attend(q, k, v, segments), (k, v)
    else:
      out, kv = attention(qkv, positions, inv_freq)
    y = jnp.einsum(f"btnh,{self.o_order}->btd", out, self.o.value.astype(dt))
    return y, kv


def split_heads(qkv: jax.Array, positions: jax.Array, inv_freq: jax.Array):
  """The queries, keys and values of `Attention`'s projections, q and k rotated (RoPE).

  Args:
    qkv: `[B, T, K, G + 2, H]`, each kv head's G query heads, then its key and value.
    positions: `int32[B, T]`.
    inv_freq: `float32[H // 2]` (`rope_frequencies`).

  Returns:
    (q `[B, T, N, H]`, k `[B, K, T, H]`, v `[B, K, T, H]`) in qkv's dtype.
  """
  b, t, nk, g2, h = qkv.shape
  q = apply_rope(qkv[:, :, :, : g2 - 2].reshape(b, t, nk * (g2 - 2), h), positions, inv_freq)
  k = apply_rope(qkv[:, :, :, g2 - 2], positions, inv_freq).transpose(0, 2, 1, 3)
  return q, k, qkv[:, :, :, g2 - 1].transpose(0, 2, 1, 3)


GATE_UP_LAYOUTS = ("gdf", "dgf")
QKV_LAYOUTS = ("kghd", "dkgh")


def fuse_qkv(q: jax.Array, k: jax.Array, v: jax.Array, order: str = "kghd") -> jax.Array:
  """Each kv head's G query heads (of q `[D, N, H]`), then its key and value (k, v `[D, K,
  H]`), stacked on a new axis so that the kv-head axis keeps its tensor-parallel shards
  aligned, in `order` (`QKV_LAYOUTS`): 'kghd' `[K, G + 2, H, D]`, H and D minor, D last:
  the tiles XLA:TPU's matmuls read in the prefill and the decode loop alike (laid out `[D,
  K, G + 2, H]` the copy was re-laid out for both, `[K, G + 2, D, H]` for the prefill:
  every layer's copy, hoisted out of the loop as temporaries of the weights' size); 'dkgh'
  `[D, K, G + 2, H]`, the operand XLA:CPU's dot reads as it lies (from 'kghd' it re-laid
  every layer's weights out at every decode step: 2.2 MB a layer at SmolLM2's size), the
  layout's o then `[H, N, D]` (`decoder.fuse`), which that dot reads as it lies too (from
  `[N, H, D]`: 1.3 MB a layer a step)."""
  d, nk, h = k.shape
  qkv = jnp.concatenate([q.reshape(d, nk, -1, h), k[:, :, None], v[:, :, None]], axis=2)
  return jnp.einsum(f"dkgh->{order}", qkv)


def fuse_qkv_bias(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """`[K, G + 2, H]`: the q (`[N, H]`), k and v (`[K, H]`) biases stacked as `fuse_qkv`
  stacks the projections."""
  nk, h = k.shape
  return jnp.concatenate([q.reshape(nk, -1, h), k[:, None], v[:, None]], axis=1)


def split_layout(layout: str) -> tuple[str, str]:
  """(gate_up's einsum letters, qkv's) of a fused layout name: a `GATE_UP_LAYOUTS` name
  alone (qkv 'kghd'), or it and a `QKV_LAYOUTS` name joined by '-' ('dgf-dkgh').

  Raises:
    ValueError: a part not in its list.
  """
  gate_up, _, qkv = layout.partition("-")
  qkv = qkv or "kghd"
  if gate_up not in GATE_UP_LAYOUTS:
    raise ValueError(f"gate_up layout {gate_up!r} is not one of {GATE_UP_LAYOUTS}")
  if qkv not in QKV_LAYOUTS:
    raise ValueError(f"qkv layout {qkv!r} is not one of {QKV_LAYOUTS}")
  return gate_up, qkv


def made_layout(layout: str, embed_dim: int, head_dim: int) -> str:
  """The fused layout a model of width D = `embed_dim` is made in: `layout`, but each part
  in its first order where the other could be read for it, since a tree's layout is read
  from its shapes (`decoder.fused_layout`): gate_up 'gdf' where D = 2, qkv 'kghd' where
  D is the head dim H (both orders then end in D).

  Raises:
    ValueError: an unknown layout (`split_layout`).
  """
  gate_up, qkv = split_layout(layout)
  gate_up = "gdf" if embed_dim == 2 else gate_up
  qkv = "kghd" if embed_dim == head_dim else qkv
  return gate_up if qkv == "kghd" else f"{gate_up}-{qkv}"


def fuse_gate_up(gate: jax.Array, up: jax.Array, layout: str = "gdf") -> jax.Array:
  """The MLP's gate and up projections (`[D, F]` each) stacked on a new axis, in `layout`,
  the einsum letters of the stack (g: gate or up, d: embed, f: mlp): 'gdf' `[2, D, F]`,
  leading so that XLA:TPU's matmul reads D and F as the tiled dims; 'dgf' `[D, 2, F]`,
  the operand a cuBLAS gemm reads as it is (from `[2, D, F]` XLA:GPU re-lays the weights
  out inside the decode loop, every layer and step). Stacked, not concatenated along F,
  which keeps F's tensor-parallel shards aligned. The platform chooses
  (`platforms.Platform.fused_layout`); D = 2 is always 'gdf' (`made_layout`).

  Raises:
    ValueError: an unknown layout.
  """
  layout = split_layout(made_layout(layout, gate.shape[0], 0))[0]
  return jnp.stack([gate, up], axis=layout.index("g"))


def kv_orders(kv_axes) -> tuple[str, str]:
  """(keys' axis order, values') from `attend`'s `kv_axes`: one order for both, or a pair."""
  return (kv_axes, kv_axes) if isinstance(kv_axes, str) else tuple(kv_axes)


def _scores(q: jax.Array, pieces, kv_axes) -> jax.Array:
  """`float32[B, K, G, T, sum S_i]`: each piece's scaled scores in the piece's own dtype
  with float32 accumulation, `MASK_VALUE` where its mask is False, concatenated.

  One query a row (a decode step) contracts without the T axis, here and in
  `_weighted_values`: with it, XLA:CPU lays every key and value out transposed for the
  dot, a copy of the whole cache per decode step (experiments/README.md, "Where the CPU's
  time goes"). More queries (prefill, training) keep the form XLA:TPU's and XLA:GPU's plans
  were measured with."""
  b, t, _, h = q.shape
  key_axes = kv_orders(kv_axes)[0]
  q = q.reshape(b, t, pieces[0][0].shape[key_axes.index("k")], -1, h)
  scores = []
  for k, _, mask in pieces:
    kw = dict(preferred_element_type=jnp.float32)
    if t == 1:
      s = jnp.einsum(f"bkgh,{key_axes}->bkgs", q[:, 0].astype(k.dtype), k, **kw)[..., None, :]
    else:
      s = jnp.einsum(f"btkgh,{key_axes}->bkgts", q.astype(k.dtype), k, **kw)
    scores.append(jnp.where(mask[:, None, None], s / math.sqrt(h), MASK_VALUE))
  return jnp.concatenate(scores, -1)


def _weighted_values(weights: jax.Array, v: jax.Array, kv_axes, **kwargs) -> jax.Array:
  """`[B, K, G, T, S]` weights times values (`kv_axes`' order): `[B, T, K, G, H]` (one query
  a row without the T axis, as `_scores`)."""
  value_axes = kv_orders(kv_axes)[1]
  if weights.shape[3] == 1:
    return jnp.einsum(f"bkgs,{value_axes}->bkgh", weights[:, :, :, 0], v, **kwargs)[:, None]
  return jnp.einsum(f"bkgts,{value_axes}->btkgh", weights, v, **kwargs)


def attend(q: jax.Array, pieces, kv_axes: str | tuple[str, str] = "bksh") -> jax.Array:
  """Attention of queries over keys held in several pieces, with one softmax over all.

  A cache can keep its keys in parts (a row's prompt and its response ring, or a window of
  the ring that wraps around its end); scores of each part are computed in the
  part's own dtype with float32 accumulation (no float32 copy of any key or value), then
  normalised together, so the result equals attention over the concatenated keys.

  Args:
    q: `[B, T, N, H]` queries (after RoPE).
    pieces: sequence of (k, v, mask `bool[B, T, S_i]`), keys and values laid out as
      `kv_axes` says, True where query t may attend to key s.
    kv_axes: the keys' and values' axis order in the letters b (row), k (kv head), s
      (column), h (head dim), or a pair (keys' order, values'): the order of the cache
      that holds them (`rollout.slots.cache_axes`), `[B, K, S_i, H]` by default
      (`Attention`'s own).

  Returns:
    `[B, T, N, H]` in v's dtype.
  """
  b, t, n, h = q.shape
  columns = kv_orders(kv_axes)[0].index("s")
  probs = jax.nn.softmax(_scores(q, pieces, kv_axes), axis=-1)
  outs, start = [], 0
  for k, v, _ in pieces:
    # In v's dtype (XLA:CPU has no bf16 x bf16 -> f32 kernel for this dot); the pieces'
    # partial sums are added in float32.
    p = probs[..., start : start + k.shape[columns]].astype(v.dtype)
    outs.append(_weighted_values(p, v, kv_axes))
    start += k.shape[columns]
  out = outs[0] if len(outs) == 1 else sum(o.astype(jnp.float32) for o in outs)
  return out.astype(pieces[0][1].dtype).reshape(b, t, n, h)


def attend_partial(q: jax.Array, pieces, kv_axes: str | tuple[str, str] = "bksh"):
  """`attend`'s softmax over some of a query's keys, kept open for `merge_partials`.

  Shared-prompt decode attends to a prompt's columns once for all the rows that share it
  (the rows as the query axis) and to each row's own response columns apart: two parts
  of one softmax, merged exactly from each part's max and sum (the online softmax's
  combination), which equals one softmax over all the columns.

  Args:
    q, pieces, kv_axes: as `attend`.

  Returns:
    (the value sum weighted by exp(score - max) `float32[B, T, N, H]`, the max score
    `float32[B, T, N]`, the sum of exp(score - max) `float32[B, T, N]`), masked columns
    scoring `MASK_VALUE` as in `attend`.
  """
  b, t, n, h = q.shape
  columns = kv_orders(kv_axes)[0].index("s")
  scores = _scores(q, pieces, kv_axes)
  top = scores.max(-1, keepdims=True)
  weights = jnp.exp(scores - top)
  acc, start = 0.0, 0
  for k, v, _ in pieces:
    w = weights[..., start : start + k.shape[columns]]
    acc = acc + _weighted_values(w, v, kv_axes, preferred_element_type=jnp.float32)
    start += k.shape[columns]
  heads = lambda x: jnp.moveaxis(x[..., 0], 3, 1).reshape(b, t, n)  # [B, K, G, T] -> [B, T, N]
  return acc.reshape(b, t, n, h), heads(top), heads(weights.sum(-1, keepdims=True))


def merge_partials(parts, dtype) -> jax.Array:
  """One softmax's output from `attend_partial`'s parts over disjoint columns of the
  same queries: each part's sum rescaled to the common max, `[B, T, N, H]` in `dtype`."""
  top = parts[0][1]
  for _, m, _ in parts[1:]:
    top = jnp.maximum(top, m)
  acc = sum(a * jnp.exp(m - top)[..., None] for a, m, _ in parts)
  total = sum(mass * jnp.exp(m - top) for _, m, mass in parts)
  return (acc / total[..., None]).astype(dtype)


def causal_attend(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, block: int):
  """Causal self-attention of T tokens within their segments, `block` queries at a time.

  A row holds one sequence (`segments` a padding mask: True at real tokens) or several
  packed one after another (`segments` their ids 1, 2, ..., 0 at padding, as the train
  step's packed batch holds them, `rl.packing`): a query attends to the keys at or before
  it in its own segment, so a packed row computes each sequence's attention exactly as
  that sequence alone. A padding query sees no key (its output, masked everywhere
  downstream, is a mean over other keys).

  Each block of queries attends to the keys up to its last position (`attend`, one
  softmax per query over exactly the keys it may see), so the float32 scores that exist
  are one block's, `[B, K, G, block, <= T]`, never the `[B, N, T, T]` of all queries: a
  prefill of 1,024-token prompts holds a quarter of them at `block` 256. With T <= block
  it is the whole computation at once.

  Args:
    q: `[B, T, N, H]` queries (after RoPE).
    k, v: `[B, K, T, H]` keys (after RoPE) and values.
    segments: `bool[B, T]` (True at real tokens) or `int32[B, T]` segment ids (0 at
      padding).
    block: queries per block.

  Returns:
    `[B, T, N, H]` in v's dtype.
  """
  t = q.shape[1]
  segments = segments.astype(jnp.int32)
  causal = jnp.arange(t) <= jnp.arange(t)[:, None]  # [T, S=T]
  outs = []
  for start in range(0, t, block):
    end = min(start + block, t)
    keys = segments[:, None, :end]
    mask = (segments[:, start:end, None] == keys) & (keys > 0) & causal[start:end, :end]
    outs.append(attend(q[:, start:end], [(k[:, :, :end], v[:, :, :end], mask)]))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)). `fused` (a fused layout name as `made_layout`
  makes it; '' for none): gate and up held as one `gate_up` in its `GATE_UP_LAYOUTS` part
  (`fuse_gate_up`)."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, fused: str = ""):
    d, f, pd = config.embed_dim, config.mlp_dim, config.weight_dtype
    fused = split_layout(fused)[0] if fused else ""
    if fused:
      shape = {"g": 2, "d": d, "f": f}
      axes = {"g": None, "d": "embed", "f": "mlp"}
      self.gate_up = make_param(
        rngs, tuple(shape[a] for a in fused), tuple(axes[a] for a in fused), pd, 1.0 / math.sqrt(d)
      )
    else:
      self.gate = make_param(rngs, (d, f), ("embed", "mlp"), pd, 1.0 / math.sqrt(d))
      self.up = make_param(rngs, (d, f), ("embed", "mlp"), pd, 1.0 / math.sqrt(d))
    self.down = make_param(rngs, (f, d), ("mlp", "embed"), pd, 1.0 / math.sqrt(f))
    self.dtype, self.fused = config.compute_dtype, fused

  def __call__(self, x):
    dt = self.dtype
    # One matmul for gate and up instead of two: measured ~25% faster on CPU at decode
    # sizes. A fused copy holds it made (`decoder.fuse`); from the separate weights the
    # stack is made here, which XLA hoists out of a loop as a copy of all of them.
    if self.fused:
      weights, layout = self.gate_up.value, self.fused
    else:
      weights, layout = fuse_gate_up(self.gate.value, self.up.value), "gdf"
    gate_up = jnp.einsum(f"btd,{layout}->btgf", x, weights.astype(dt))
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, self.down.value.astype(dt))


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). `fused`: the
  projections fused in that layout, as `made_layout` makes it (`Attention`, `MLP`)."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, fused: str = ""):
    self.attn_norm = RMSNorm(config.embed_dim, config.rms_norm_eps, "embed", config.weight_dtype)
    self.attn = Attention(config, rngs, fused)
    self.mlp_norm = RMSNorm(config.embed_dim, config.rms_norm_eps, "embed", config.weight_dtype)
    self.mlp = MLP(config, rngs, fused)

  def __call__(self, x, positions, inv_freq, segments, attention=None, self_attend=None):
    y, kv = self.attn(self.attn_norm(x), positions, inv_freq, segments, attention, self_attend)
    x = x + y
    return x + self.mlp(self.mlp_norm(x)), kv
