"""Shared-prompt decode attention in XLA's form (`rollout.shared_prompt`): grouping the live
slots by prompt-cache entry, and the attention, read once per entry, equal to one softmax
over each row's own copy of its prompt and its response columns (issue 52)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ada_jax.models import decoder as model_lib
from ada_jax.models import layers, sharding
from ada_jax.rollout import sampler as sampler_lib
from ada_jax.rollout import shared_prompt
from ada_jax.rollout import slots as slots_lib


@st.composite
def pools(draw):
  s, p, r = draw(st.integers(1, 12)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
  live = draw(st.lists(st.booleans(), min_size=s, max_size=s))
  entry = draw(st.lists(st.integers(0, p - 1), min_size=s, max_size=s))
  # The pool's admission keeps at most R live rows per entry: drop the rest.
  seen = {}
  for i in range(s):
    if live[i]:
      seen[entry[i]] = seen.get(entry[i], 0) + 1
      live[i] = seen[entry[i]] <= r
  return s, p, r, np.array(entry, np.int32), np.array(live), draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pools())
def test_grouping_lists_each_entrys_live_slots_in_order(case):
  s, p, r, entry, live, _ = case
  members, rank = map(
    np.asarray, shared_prompt.group_by_entry(jnp.asarray(entry), jnp.asarray(live), p, r)
  )
  for e in range(p):
    want = [i for i in range(s) if live[i] and entry[i] == e]
    assert members[e].tolist() == want + [s] * (r - len(want))
  for i in range(s):
    if live[i]:
      assert members[entry[i], rank[i]] == i


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pools())
def test_attention_read_once_per_entry_equals_each_rows_own_copy(case):
  s, p, r, entry, live, seed = case
  kh, g, h, lp, lr = 2, 3, 16, 6, 5
  ks = jax.random.split(jax.random.key(seed), 8)
  normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32)
  q = normal(ks[0], (s, 1, kh * g, h))
  pk, pv = normal(ks[1], (p, kh, lp, h)), normal(ks[2], (p, kh, lp, h))
  pm = (jax.random.uniform(ks[3], (p, lp)) < 0.7).at[:, 0].set(jnp.arange(p) != 0)  # entry 0: none
  rk, rv = normal(ks[4], (s, kh, lr, h)), normal(ks[5], (s, kh, lr, h))
  rm = jax.random.uniform(ks[6], (s, 1, lr)) < 0.6
  members, rank = shared_prompt.group_by_entry(jnp.asarray(entry), jnp.asarray(live), p, r)
  own = layers.attend_partial(q, [(rk, rv, rm)])
  out = shared_prompt.attend(q, (pk, pv, pm), jnp.asarray(entry), rank, members, own)
  copies = (pk[entry], pv[entry], pm[entry][:, None])
  ref = layers.attend(q, [copies, (rk, rv, rm)])
  np.testing.assert_allclose(np.asarray(out)[live], np.asarray(ref)[live], atol=2e-5, rtol=2e-5)
  assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
def test_pool_draws_the_same_tokens_grouped_and_from_slot_copies(monkeypatch, mesh_shape):
  """XLA's two forms of the shared prompt read (`platforms.Platform.shared_prompt`): each
  entry once for its rows as the query axis (GPU's, where no kernel applies) or each slot
  over its own copy, made when its row starts (CPU's): the same tokens through the pool,
  with refills; on a 2 x 2 x 2 mesh too."""
  config = model_lib.preset("tiny-llama")
  params = model_lib.init_params(config, jax.random.key(0))
  mesh = sharding.make_mesh(*mesh_shape) if mesh_shape else None
  rows = np.random.default_rng(4).integers(0, 4, 24)
  prompts = [[5, 6, 7, 8, 9], [11, 12], [13], [20, 21, 22, 23, 24, 25, 26]]
  kw = dict(max_new_tokens=10, stop_ids=tuple(range(3, 512, 16)), prompt_buckets=(8,))
  kw |= dict(chunk_rows=8, prompts_per_chunk=4, segment_steps=4, entry_rows=3)
  kw |= dict(rule=sampler_lib.SamplingRule(temperature=1.0))
  cpu = sharding.platform(mesh)
  forms, copies = {}, {}
  for form in ("slot copy", "grouped"):
    traits = dataclasses.replace(cpu, shared_prompt=form)
    monkeypatch.setattr(sharding, "platform", lambda mesh, traits=traits: traits)
    smp = sampler_lib.Sampler(config, mesh=mesh, **kw)
    forms[form] = smp.generate(params, prompts, rows, jax.random.key(6))[0]
    copies[form] = smp.programs(8).init().cache.prompt_mask is not None
  assert copies == {"slot copy": True, "grouped": False}
  assert len(set(forms["grouped"]["lengths"].tolist())) > 2
  np.testing.assert_array_equal(forms["grouped"]["tokens"], forms["slot copy"]["tokens"])
  np.testing.assert_array_equal(forms["grouped"]["lengths"], forms["slot copy"]["lengths"])
  np.testing.assert_allclose(
    forms["grouped"]["logprobs"], forms["slot copy"]["logprobs"], atol=1e-5
  )


@settings(max_examples=8, deadline=None)
@given(
  take=st.lists(st.booleans(), min_size=6, max_size=6),
  entry=st.lists(st.integers(0, 3), min_size=6, max_size=6),
)
def test_admit_copies_the_starting_slots_prompts_only(take, entry):
  """`slots.admit` on XLA:CPU: each starting slot's copy is its entry's keys, values and
  mask (in the platform's key order); every other slot's copy and every ring are as
  they were; the starting slots' rings are masked."""
  config = model_lib.preset("tiny-llama")
  cache = slots_lib.init_slot_cache(config, 6, 5, prompt_len=4)
  assert cache.prompt_mask is not None  # XLA:CPU keeps copies
  fill = lambda x, seed: jax.random.normal(jax.random.key(seed), x.shape, x.dtype)
  cache = cache.replace(
    prompt_k=tuple(fill(x, i) for i, x in enumerate(cache.prompt_k)),
    prompt_v=tuple(fill(x, 50 + i) for i, x in enumerate(cache.prompt_v)),
    prompt_mask=jnp.ones_like(cache.prompt_mask),
    mask=jnp.ones_like(cache.mask),
  )
  prompts = slots_lib.empty_prompt_cache(config, 4, 4)
  prompts = prompts.replace(
    k=tuple(fill(x, 100 + i) for i, x in enumerate(prompts.k)),
    v=tuple(fill(x, 150 + i) for i, x in enumerate(prompts.v)),
    mask=jax.random.uniform(jax.random.key(7), prompts.mask.shape) < 0.5,
  )
  take, entry = np.asarray(take), np.asarray(entry, np.int32)
  out = jax.jit(slots_lib.admit)(cache, jnp.asarray(take), prompts, jnp.asarray(entry))
  key_axes, value_axes = slots_lib.cache_axes(None)
  checks = [(out.prompt_mask, cache.prompt_mask, prompts.mask, "bs")]
  for layer in range(config.num_layers):
    checks.append((out.prompt_k[layer], cache.prompt_k[layer], prompts.k[layer], key_axes))
    checks.append((out.prompt_v[layer], cache.prompt_v[layer], prompts.v[layer], value_axes))
  for new, old, src, axes in checks:
    b = axes.index("b")
    new, old, src = (np.moveaxis(np.asarray(x), b, 0) for x in (new, old, src))
    np.testing.assert_array_equal(new[take], src[entry[take]])
    np.testing.assert_array_equal(new[~take], old[~take])
  np.testing.assert_array_equal(np.asarray(out.mask), np.broadcast_to(~take[:, None], (6, 5)))
  np.testing.assert_array_equal(np.asarray(out.k[0]), np.asarray(cache.k[0]))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  kv_heads=st.integers(1, 3),
  groups=st.integers(1, 3),
  widths=st.lists(st.integers(1, 6), min_size=1, max_size=3),
  key_axes=st.permutations("bksh").map("".join),
  value_axes=st.permutations("bksh").map("".join),
  seed=st.integers(0, 2**16),
)
def test_one_query_a_row_attends_as_among_others(
  kv_heads, groups, widths, key_axes, value_axes, seed
):
  """A decode step's one query a row (`layers._scores` without the T axis, XLA:CPU's form)
  gets what the same query gets among others (prefill's form), keys and values in any two
  orders, in `attend` and in `attend_partial`'s open parts."""
  b, h = 3, 8
  ks = iter(jax.random.split(jax.random.key(seed), 16))
  normal = lambda shape: jax.random.normal(next(ks), shape, jnp.float32)
  order = lambda x, axes: jnp.einsum(f"bksh->{axes}", x)
  q = normal((b, 2, kv_heads * groups, h))
  pieces = []
  for w in widths:
    k, v = normal((b, kv_heads, w, h)), normal((b, kv_heads, w, h))
    mask = (jax.random.uniform(next(ks), (b, 2, w)) < 0.7).at[:, :, 0].set(True)
    pieces.append((order(k, key_axes), order(v, value_axes), mask))
  axes = (key_axes, value_axes)
  first = [(k, v, m[:, :1]) for k, v, m in pieces]
  np.testing.assert_allclose(
    layers.attend(q[:, :1], first, axes), layers.attend(q, pieces, axes)[:, :1], atol=1e-5
  )
  for one, both in zip(
    layers.attend_partial(q[:, :1], first, axes),
    layers.attend_partial(q, pieces, axes),
    strict=True,
  ):
    np.testing.assert_allclose(one, both[:, :1], atol=1e-5, rtol=1e-5)
