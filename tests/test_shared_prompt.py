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
  piece = shared_prompt.per_row_piece((pk, pv, pm), jnp.asarray(entry))
  per_row = layers.attend(q, [piece, (rk, rv, rm)])
  np.testing.assert_allclose(np.asarray(per_row)[live], np.asarray(ref)[live], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
def test_pool_draws_the_same_tokens_grouped_and_per_row(monkeypatch, mesh_shape):
  """XLA's two forms of the shared prompt read (`platforms.Platform.shared_prompt`): each
  entry once for its rows as the query axis (GPU's, where no kernel applies) or each row
  over a gathered copy (CPU's): the same tokens through the pool, with refills; on a
  2 x 2 x 2 mesh too."""
  config = model_lib.preset("tiny-llama")
  params = model_lib.init_params(config, jax.random.key(0))
  mesh = sharding.make_mesh(*mesh_shape) if mesh_shape else None
  rows = np.random.default_rng(4).integers(0, 4, 24)
  prompts = [[5, 6, 7, 8, 9], [11, 12], [13], [20, 21, 22, 23, 24, 25, 26]]
  kw = dict(max_new_tokens=10, stop_ids=tuple(range(3, 512, 16)), prompt_buckets=(8,))
  kw |= dict(chunk_rows=8, prompts_per_chunk=4, segment_steps=4, entry_rows=3)
  kw |= dict(rule=sampler_lib.SamplingRule(temperature=1.0))
  draw = lambda: sampler_lib.Sampler(config, mesh=mesh, **kw).generate(
    params, prompts, rows, jax.random.key(6)
  )[0]
  cpu = sharding.platform(mesh)
  forms = {}
  for form in ("per row", "grouped"):
    traits = dataclasses.replace(cpu, shared_prompt=form)
    monkeypatch.setattr(sharding, "platform", lambda mesh, traits=traits: traits)
    forms[form] = draw()
  assert len(set(forms["grouped"]["lengths"].tolist())) > 2
  np.testing.assert_array_equal(forms["grouped"]["tokens"], forms["per row"]["tokens"])
  np.testing.assert_array_equal(forms["grouped"]["lengths"], forms["per row"]["lengths"])
  np.testing.assert_allclose(forms["grouped"]["logprobs"], forms["per row"]["logprobs"], atol=1e-5)


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
