"""The decoder's own invariants: KV-cache decode == full forward, shapes, dtypes, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from hypothesis import given, settings
from hypothesis import strategies as st

from ada_jax import testing
from ada_jax.models import decoder as model_lib
from ada_jax.models import layers
from ada_jax.models.layers import attend, causal_attend, split_heads

TINY = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]


@struct.dataclass
class _Cache:
  """A plain cache, per layer keys and values `[B, K, S, H]` written at column `index`."""

  k: tuple
  v: tuple
  mask: jax.Array
  index: jax.Array

  @property
  def length(self) -> int:
    return self.mask.shape[1]


def _prefill(config, params, tokens, positions, mask, cache_len):
  """(`float32[B, V]` logits at the last prompt position, a `cache_len`-column `_Cache`
  holding the prompts at columns `[0, T)`): one forward with causal attention."""
  t = tokens.shape[1]

  def causal(*projections):
    q, k, v = split_heads(*projections)
    return causal_attend(q, k, v, jnp.asarray(mask), t), (k, v)

  out, kvs = model_lib.forward(
    config, params, tokens, positions, lambda layer: causal, last_only=True
  )
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, cache_len - t), (0, 0)))
  cache = _Cache(
    k=tuple(pad(k) for k, _ in kvs),
    v=tuple(pad(v) for _, v in kvs),
    mask=jnp.pad(jnp.asarray(mask), ((0, 0), (0, cache_len - t))),
    index=jnp.asarray(t, jnp.int32),
  )
  return out[:, 0], cache


def _decode(config, params, tokens, positions, cache, attention_mask=None):
  """The plain cache's incremental forward, the reference the slot pool's ring is held to:
  writes `tokens` (`int32[B, T]`) at columns `[index, index + T)` of `cache` (a `_prefill`
  result) and attends over it, causally within the new tokens; `attention_mask` False marks
  tokens never attended to. Returns (`float32[B, T, V]` logits, the updated cache)."""
  if attention_mask is None:
    attention_mask = jnp.ones(tokens.shape, bool)
  t = tokens.shape[1]
  mask = jax.lax.dynamic_update_slice(cache.mask, attention_mask, (0, cache.index))
  causal = jnp.arange(cache.length) <= cache.index + jnp.arange(t)[:, None]  # [T, S]

  def attention(layer):
    def write_and_read(*projections):
      q, k, v = split_heads(*projections)
      put = lambda old, new: jax.lax.dynamic_update_slice(
        old, new.astype(old.dtype), (0, 0, cache.index, 0)
      )
      k, v = put(cache.k[layer], k), put(cache.v[layer], v)
      return attend(q, [(k, v, mask[:, None, :] & causal)]), (k, v)

    return write_and_read

  out, kvs = model_lib.forward(config, params, tokens, positions, attention)
  k, v = tuple(k for k, _ in kvs), tuple(v for _, v in kvs)
  return out, _Cache(k=k, v=v, mask=mask, index=cache.index + t)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_decode_matches_full_forward(name, chunk):
  config = model_lib.preset(name)
  params = model_lib.init_params(config, jax.random.key(0))
  # Row 3's prompt is only padding inside the prefill window: its first real token
  # arrives through the cache path.
  tokens, mask = testing.left_padded_batch([10, 7, 4, 2, 1], 10, config.vocab_size)
  mask = jnp.asarray(mask)
  pos = model_lib.positions_from_mask(mask)
  full = model_lib.logits(config, params, tokens, pos, mask)
  prefix = 4
  out, cache = _prefill(
    config, params, tokens[:, :prefix], pos[:, :prefix], mask[:, :prefix], cache_len=12
  )
  real = np.asarray(mask[:, prefix - 1])  # rows whose prefill ends on a real token
  np.testing.assert_allclose(
    np.asarray(out)[real],
    np.asarray(full[:, prefix - 1])[real],
    atol=1e-4 * max(1.0, float(jnp.abs(full).max())),
  )
  outs = [full[:, :prefix]]
  decode = jax.jit(lambda *a: _decode(config, params, *a))
  for t in range(prefix, 10, chunk):
    sl = slice(t, min(t + chunk, 10))
    out, cache = decode(tokens[:, sl], pos[:, sl], cache, mask[:, sl])
    outs.append(out)
  inc = jnp.concatenate(outs, 1)
  assert int(cache.index) == 10
  np.testing.assert_array_equal(np.asarray(cache.mask[:, :10]), np.asarray(mask))
  diff = np.abs(np.asarray(inc - full))[np.asarray(mask)]
  assert diff.max() <= 1e-4 * max(1.0, float(jnp.abs(full).max()))


def test_cache_rows_can_be_shared():
  config = model_lib.preset("tiny-llama")
  params = model_lib.init_params(config, jax.random.key(1))
  tokens, mask = testing.left_padded_batch([6, 3], 6, config.vocab_size)
  pos = model_lib.positions_from_mask(jnp.asarray(mask))
  _, cache = _prefill(config, params, tokens, pos, mask, cache_len=8)
  rows = jnp.array([1, 0, 1])
  shared = jax.tree.map(lambda x: x if x.ndim == 0 else jnp.take(x, rows, axis=0), cache)
  nxt = jnp.array([[5], [6], [7]], jnp.int32)
  out, _ = _decode(config, params, nxt, pos[rows, -1:] + 1, shared)
  full_tokens = jnp.concatenate([jnp.asarray(tokens)[rows], nxt], 1)
  full_mask = jnp.concatenate([jnp.asarray(mask)[rows], jnp.ones((3, 1), bool)], 1)
  ref = model_lib.logits(
    config, params, full_tokens, model_lib.positions_from_mask(full_mask), full_mask
  )[:, -1:]
  np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-5)


def test_llama3_rope_scaling_changes_low_frequencies_only():
  scaled = model_lib.preset("llama-3.2-3b")
  plain = scaled.replace(rope_scaling=None)
  a, b = model_lib.rope_frequencies(scaled), model_lib.rope_frequencies(plain)
  assert a.shape == (64,)
  np.testing.assert_allclose(a[:8], b[:8])  # short wavelengths untouched
  np.testing.assert_allclose(a[-4:], b[-4:] / 32.0, rtol=1e-6)  # longest divided by factor


def test_logical_axes_cover_every_param():
  for name in TINY:
    config = model_lib.preset(name)
    shapes = model_lib.param_shapes(config)
    axes = model_lib.logical_axes(config)
    ok = jax.tree.map(
      lambda s, a: len(a) == len(s.shape), shapes, axes, is_leaf=lambda x: isinstance(x, tuple)
    )
    assert all(jax.tree.leaves(ok))


def test_presets_have_published_sizes():
  counts = {
    name: sum(
      int(np.prod(s.shape)) for s in jax.tree.leaves(model_lib.param_shapes(model_lib.preset(name)))
    )
    for name in ["llama-3.2-3b", "qwen2.5-math-1.5b", "qwen3-4b"]
  }
  assert 3.1e9 < counts["llama-3.2-3b"] < 3.3e9
  assert 1.5e9 < counts["qwen2.5-math-1.5b"] < 1.6e9
  assert 3.9e9 < counts["qwen3-4b"] < 4.1e9


def test_bfloat16_compute_keeps_fp32_logits():
  config = model_lib.preset("tiny-qwen3", dtype="bfloat16", param_dtype="bfloat16")
  params = model_lib.init_params(config, jax.random.key(0))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  tokens, mask = testing.left_padded_batch([4, 2], 4, config.vocab_size)
  pos = model_lib.positions_from_mask(jnp.asarray(mask))
  out = model_lib.logits(config, params, tokens, pos, mask)
  ref = model_lib.logits(
    config.replace(dtype="float32", param_dtype="float32"),
    jax.tree.map(lambda x: x.astype(jnp.float32), params),
    tokens,
    pos,
    mask,
  )
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out[mask], ref[mask], atol=0.1 * float(jnp.abs(ref).max()))


def test_remat_gives_the_same_gradients():
  config = model_lib.preset("tiny-llama")
  params = model_lib.init_params(config, jax.random.key(0))
  tokens, mask = testing.left_padded_batch([4, 3], 4, config.vocab_size)
  pos = model_lib.positions_from_mask(jnp.asarray(mask))
  loss = lambda p, remat: jnp.mean(
    jax.nn.log_softmax(model_lib.logits(config, p, tokens, pos, mask, remat=remat))[..., 0]
  )
  g1, g2 = jax.grad(loss)(params, False), jax.grad(loss)(params, True)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("num_kv_heads", 3, "multiple of num_kv_heads"),
    ("family", "gpt2", "family"),
    ("head_dim", 0, "head_dim"),
    ("dtype", "float16", "dtype"),
  ],
)
def test_bad_config_is_named(field, value, match):
  with pytest.raises(ValueError, match=match):
    model_lib.preset("tiny-llama", **{field: value})


def test_unknown_preset():
  with pytest.raises(ValueError, match="unknown"):
    model_lib.preset("gpt-5")


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_float32_masters_compute_exactly_as_their_compute_dtype_copy(preset):
  """docs/design.md "Precision": every weight is cast to the compute dtype where it is used,
  so the trainer's forward on float32 masters (with and without the remat scan) equals the
  sampler's on the bf16 rollout copy bit for bit, and activations stay bf16."""
  masters_cfg = model_lib.preset(preset).replace(dtype="bfloat16", param_dtype="float32")
  copy_cfg = masters_cfg.replace(param_dtype="bfloat16")
  params = model_lib.init_params(masters_cfg, jax.random.key(2))
  copy = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  tokens = jax.random.randint(jax.random.key(3), (2, 9), 1, masters_cfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
  for remat in (False, True):  # XLA fuses the two paths differently: each against its own
    want = model_lib.logits(copy_cfg, copy, tokens, positions, remat=remat)
    got = model_lib.logits(masters_cfg, params, tokens, positions, remat=remat)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  hidden, _ = model_lib.hidden_states(masters_cfg, params, tokens, positions)
  assert hidden.dtype == jnp.bfloat16


LAYOUTS = ["gdf", "dgf", "dgf-dkgh", "gdf-dkgh"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", TINY)
def test_fused_tree_computes_what_the_separate_weights_compute(preset, layout):
  """`decoder.fuse` (the rollout copy's q, k, v and gate, up each one array, in each
  platform's layout) holds the same weights: the same logits from either tree, every leaf
  accounted for, and its logical axes and shapes describe it (what
  `sharding.rollout_param_shardings` reads); a tree fused in one layout is not silently
  taken for another."""
  config = model_lib.preset(preset)
  params = model_lib.init_params(config, jax.random.key(4))
  fused = model_lib.fuse(params, layout)
  assert model_lib.fused_layout(fused) == layout and model_lib.fused_layout(params) == ""
  assert model_lib.fuse(fused, layout) is fused
  for other in set(LAYOUTS) - {layout}:
    with pytest.raises(ValueError, match=f"fused in layout '{layout}', asked for '{other}'"):
      model_lib.fuse(fused, other)
  d, f = config.embed_dim, config.mlp_dim
  gate_up_order, qkv_order = layers.split_layout(layout)
  gate_up = fused["layer_0"]["mlp"]["gate_up"]
  assert gate_up.shape == {"gdf": (2, d, f), "dgf": (d, 2, f)}[gate_up_order]
  np.testing.assert_array_equal(
    np.take(np.asarray(gate_up), 1, axis=gate_up_order.index("g")), params["layer_0"]["mlp"]["up"]
  )
  k, g, h = config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim
  qkv = np.asarray(fused["layer_0"]["attn"]["qkv"])
  assert qkv.shape == {"kghd": (k, g + 2, h, d), "dkgh": (d, k, g + 2, h)}[qkv_order]
  values = np.moveaxis(qkv, [qkv_order.index(a) for a in "dkgh"], range(4))[:, :, g + 1]
  np.testing.assert_array_equal(values, params["layer_0"]["attn"]["v"])
  o = np.asarray(fused["layer_0"]["attn"]["o"])
  np.testing.assert_array_equal(
    o.transpose(1, 0, 2) if qkv_order == "dkgh" else o, params["layer_0"]["attn"]["o"]
  )
  n = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
  assert n(fused) == n(params)
  shapes = jax.tree.map(lambda x: x.shape, model_lib.param_shapes(config, fused=layout))
  assert shapes == jax.tree.map(lambda x: x.shape, fused)
  axes = model_lib.logical_axes(config, fused=layout)
  assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == jax.tree.structure(
    fused
  )
  assert (
    axes["layer_0"]["mlp"]["gate_up"]
    == {
      "gdf": (None, "embed", "mlp"),
      "dgf": ("embed", None, "mlp"),
    }[gate_up_order]
  )
  assert (
    axes["layer_0"]["attn"]["qkv"]
    == {
      "kghd": ("kv_heads", None, "head_dim", "embed"),
      "dkgh": ("embed", "kv_heads", None, "head_dim"),
    }[qkv_order]
  )
  tokens = jax.random.randint(jax.random.key(5), (2, 7), 1, config.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
  np.testing.assert_allclose(
    model_lib.logits(config, fused, tokens, positions),
    model_lib.logits(config, params, tokens, positions),
    atol=1e-5,
  )


def test_an_unknown_fused_layout_is_refused():
  params = model_lib.init_params(model_lib.preset(TINY[0]), jax.random.key(4))
  with pytest.raises(ValueError, match="gate_up layout 'fdg' is not one of"):
    model_lib.fuse(params, "fdg")
  with pytest.raises(ValueError, match="qkv layout 'hgkd' is not one of"):
    model_lib.fuse(params, "dgf-hgkd")


@pytest.mark.parametrize("block", [1, 3, 4])
def test_blocked_causal_attention_equals_the_whole(block):
  """`layers.causal_attend` `block` queries at a time equals all queries at once at every
  real token (left-padded rows, one all padding but its last token; a padding query sees
  no key, and its output, masked everywhere downstream, is a mean over other keys)."""
  from ada_jax.models.layers import causal_attend

  ks = jax.random.split(jax.random.key(6), 3)
  q = jax.random.normal(ks[0], (3, 9, 4, 8))
  k, v = (jax.random.normal(x, (3, 2, 9, 8)) for x in ks[1:])
  valid = jnp.arange(9)[None] >= jnp.array([[0], [4], [8]])
  got, want = causal_attend(q, k, v, valid, block), causal_attend(q, k, v, valid, 9)
  np.testing.assert_allclose(got[valid], want[valid], atol=1e-6)


@pytest.mark.parametrize("block", [1, 4, 12])
def test_packed_sequences_attend_as_each_alone(block):
  """Sequences packed one after another in a row (segment ids 1, 2, ..., 0 at padding)
  get, at every real token, the attention each gets alone in a row of its own, whatever
  the query block."""
  from ada_jax.models.layers import causal_attend

  ks = jax.random.split(jax.random.key(7), 3)
  lengths = [5, 3, 2]  # then 2 positions of padding
  t = sum(lengths) + 2
  q = jax.random.normal(ks[0], (1, t, 4, 8))
  k, v = (jax.random.normal(x, (1, 2, t, 8)) for x in ks[1:])
  segments = jnp.asarray([np.repeat([1, 2, 3, 0], lengths + [2])])
  got = causal_attend(q, k, v, segments, block)
  start = 0
  for n in lengths:
    cut = slice(start, start + n)
    alone = causal_attend(q[:, cut], k[:, :, cut], v[:, :, cut], jnp.ones((1, n), bool), n)
    np.testing.assert_allclose(got[:, cut], alone, atol=1e-6)
    start += n


def test_a_width_of_two_is_fused_gdf_whatever_the_layout_asked():
  """With D = 2, `[D, 2, F]` has `[2, D, F]`'s shape, so a tree's layout could not be read
  back: 'dgf' is made 'gdf' (`layers.made_layout`), and the fused tree is taken as it is
  when fused again in either layout (a GPU sampler does not copy it again)."""
  import dataclasses

  config = dataclasses.replace(model_lib.preset(TINY[0]), embed_dim=2)
  fused = model_lib.fuse(model_lib.init_params(config, jax.random.key(1)), "dgf")
  assert model_lib.fused_layout(fused) == "gdf"
  assert model_lib.fuse(fused, "dgf") is fused and model_lib.fuse(fused, "gdf") is fused
  shapes = jax.tree.map(lambda x: x.shape, model_lib.param_shapes(config, fused="dgf"))
  assert shapes == jax.tree.map(lambda x: x.shape, fused)


@settings(max_examples=25, deadline=None)
@given(
  embed_dim=st.sampled_from([2, 3, 4, 8]),
  kv_heads=st.integers(1, 4),
  groups=st.integers(1, 3),
  head_dim=st.sampled_from([2, 4, 8]),
  layout=st.sampled_from(LAYOUTS),
)
def test_a_fused_layout_reads_back_from_its_shapes(embed_dim, kv_heads, groups, head_dim, layout):
  """Whatever the widths, the layout a tree is fused in (`layers.made_layout`: a part whose
  shape the other order shares is made in its first order) is the one
  `decoder.fused_layout` reads back from its shapes."""
  import dataclasses

  config = dataclasses.replace(
    model_lib.preset("tiny-llama", vocab_size=16, num_layers=1),
    embed_dim=embed_dim,
    num_kv_heads=kv_heads,
    num_heads=kv_heads * groups,
    head_dim=head_dim,
  )
  made = layers.made_layout(layout, embed_dim, head_dim)
  assert made.split("-")[0] == ("gdf" if embed_dim == 2 else layout.split("-")[0])
  assert model_lib.fused_layout(model_lib.param_shapes(config, layout)) == made


def test_param_shapes_traced_once_per_architecture_and_handed_out_fresh():
  """The samplers ask for the rollout copy's shapes and axes at every RL step: traced once
  per (architecture, layout), each caller gets its own tree (editing it changes no other)."""
  config = model_lib.preset("tiny-llama", vocab_size=64, embed_dim=32, num_layers=1)
  model_lib._abstract.cache_clear()
  shapes = model_lib.param_shapes(config, "dgf")
  shapes["layer_0"]["mlp"]["gate_up"] = None
  again = model_lib.param_shapes(config, "dgf")
  axes = model_lib.logical_axes(config, "dgf")
  assert model_lib._abstract.cache_info().misses == 1
  assert again["layer_0"]["mlp"]["gate_up"].shape == (32, 2, config.mlp_dim)
  assert axes["layer_0"]["mlp"]["gate_up"] == ("embed", None, "mlp")
  assert model_lib.param_shapes(config)["layer_0"]["mlp"]["gate"].shape == (32, config.mlp_dim)
