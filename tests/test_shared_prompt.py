"""Shared-prompt decode attention in XLA's form (`rollout.shared_prompt`): grouping the live
slots by prompt-cache entry, and the attention, read once per entry, equal to one softmax
over each row's own copy of its prompt and its response columns (issue 52)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ada_jax.models import layers
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
