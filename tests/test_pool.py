"""The slot pool: refills, the budget, long queues, cancellation, mixed prompt lengths, and
tokens that do not depend on the schedule (pool size, refill, queue length)."""

import collections
import dataclasses
import pathlib

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from ada_jax import platforms, testing
from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding
from ada_jax.rollout import attention as attention_lib
from ada_jax.rollout import sampler as sampler_lib
from ada_jax.rollout import slots as slots_lib

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [13], [20, 21, 22, 23, 24, 25, 26]]
GREEDY = sampler_lib.SamplingRule(temperature=0.0)
STOPS = tuple(range(3, 512, 16))  # ~6% of the vocabulary: lengths vary row to row


@pytest.fixture(scope="module")
def tiny():
  config = model_lib.preset("tiny-llama")
  return config, model_lib.init_params(config, jax.random.key(0))


def _assert_same_draw(got, want, *, atol, err_msg=""):
  """Two `Sampler.generate` outputs drew the same rows: equal tokens and lengths, log-probs
  within `atol`."""
  np.testing.assert_array_equal(got["tokens"], want["tokens"], err_msg=err_msg)
  np.testing.assert_array_equal(got["lengths"], want["lengths"], err_msg=err_msg)
  np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=atol, err_msg=err_msg)


def _reference(config, params, prompts, length, steps):
  tokens = np.zeros((len(prompts), length), np.int32)
  mask = np.zeros((len(prompts), length), bool)
  for i, p in enumerate(prompts):
    tokens[i, length - len(p) :], mask[i, length - len(p) :] = p, True
  return testing.greedy_reference(config, params, tokens, mask, steps)


def test_rollout_modules_stay_small():
  for path in (pathlib.Path(__file__).parents[1] / "ada_jax" / "rollout").glob("*.py"):
    assert len(path.read_text().splitlines()) <= 500, path.name


def test_row_finishing_at_step_0_frees_its_slot_at_once(tiny):
  config, params = tiny
  ref = _reference(config, params, PROMPTS[:2], 8, 10)
  stop = int(ref[0, 0])  # prompt 0's first token ends it; prompt 1 never draws it
  assert stop not in ref[1]
  smp = sampler_lib.Sampler(
    config, rule=GREEDY, max_new_tokens=10, stop_ids=[stop], chunk_rows=1, prompts_per_chunk=1,
    prompt_buckets=(8,),
  )  # fmt: skip
  out, stats = smp.generate(params, PROMPTS, [0, 1, 0], jax.random.key(0))
  np.testing.assert_array_equal(out["lengths"], [1, 10, 1])
  assert (out["tokens"][[0, 2], 0] == stop).all() and not out["mask"][[0, 2], 1:].any()
  np.testing.assert_array_equal(out["tokens"][1], ref[1])
  # One slot: 1 + 10 + 1 decode steps, no step idle between the rows.
  assert stats.slot_steps == 12 and stats.token_slot_utilization == 1.0


def test_every_row_at_the_budget(tiny):
  config, params = tiny
  smp = sampler_lib.Sampler(
    config, max_new_tokens=5, stop_ids=[-1], chunk_rows=4, prompts_per_chunk=4,
    prompt_buckets=(8,), queue_rows=4,
  )  # fmt: skip
  rows = [0, 1, 2, 3] * 3
  out, stats = smp.generate(params, PROMPTS, rows, jax.random.key(1))
  assert (out["lengths"] == 5).all() and out["mask"].all() and (out["logprobs"] < 0).all()
  assert stats.slot_steps == 3 * 4 * 5 and stats.token_slot_utilization == 1.0
  assert 0 < stats.kv_useful <= stats.kv_read


@pytest.fixture(scope="module")
def pools(tiny):
  """Samplers that differ only in schedule: slots and queue length."""
  config, _ = tiny
  kw = dict(max_new_tokens=12, stop_ids=STOPS, prompt_buckets=(8,), prompts_per_chunk=2)
  return {
    "S=64": sampler_lib.Sampler(config, chunk_rows=64, **kw),
    "S=256": sampler_lib.Sampler(config, chunk_rows=256, **kw),
    "S=2, Q=2": sampler_lib.Sampler(config, chunk_rows=2, queue_rows=2, segment_steps=5, **kw),
  }


def test_tokens_do_not_depend_on_the_schedule(tiny, pools):
  """600 rows: many refills of a 64-slot pool, one 256-slot pool."""
  _, params = tiny
  rows = np.random.default_rng(0).integers(0, 4, 600)
  outs = {k: pools[k].generate(params, PROMPTS, rows, jax.random.key(3)) for k in list(pools)[:2]}
  base, base_stats = outs["S=64"]
  assert len(set(base["lengths"].tolist())) > 5  # varied lengths: refills really happen
  for name, (out, _) in outs.items():
    _assert_same_draw(out, base, atol=1e-5, err_msg=name)
  # Refill keeps the slots busy: fewer slot-steps than static chunks of 64 rows in the same
  # order, each decoding for its longest row (a row of length L takes L steps).
  lengths = base["lengths"]
  static = sum(64 * int(lengths[i : i + 64].max()) for i in range(0, len(lengths), 64))
  assert base_stats.slot_steps < static


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
def test_running_idle_decode_steps_draws_the_same_tokens(tiny, monkeypatch, mesh_shape):
  """XLA:GPU's schedule (`slots.in_place_under_cond` False: the decode step runs even when no
  slot goes on, the refill's cache copy runs outside its conditional) draws what the TPU's
  draws: 2 slots, 3-step segments, many refills and steps where every live row ends at
  once; on a 2 x 2 x 2 mesh as well."""
  config, params = tiny
  mesh = sharding.make_mesh(*mesh_shape) if mesh_shape else None
  rows = np.random.default_rng(1).integers(0, 4, 24)
  rule = sampler_lib.SamplingRule(temperature=1.0)
  kw = dict(max_new_tokens=6, stop_ids=STOPS, prompt_buckets=(8,), segment_steps=3)
  kw |= dict(chunk_rows=4 if mesh else 2, prompts_per_chunk=2, queue_rows=4, rule=rule)
  draw = lambda: sampler_lib.Sampler(config, mesh=mesh, **kw).generate(
    params, PROMPTS, rows, jax.random.key(4)
  )
  skipped, stats = draw()
  monkeypatch.setattr(slots_lib, "in_place_under_cond", lambda mesh: False)
  always, always_stats = draw()
  assert len(set(skipped["lengths"].tolist())) > 2  # rows end at different steps
  _assert_same_draw(always, skipped, atol=1e-6)
  assert (always_stats.kv_read, always_stats.kv_useful) == (stats.kv_read, stats.kv_useful)


def test_rows_decode_in_their_prompts_row_shard(tiny, monkeypatch):
  """Where decode attention is a kernel on each device's shard (the TPU one, interpreted),
  on a 2 x 2 x 2 mesh the slots and the prompt-cache entries are both split over the 4
  row shards (data x fsdp): every live row sits in a slot of its entry's shard, at every
  segment, and draws what it draws on one device (entries spread over the shards)."""
  config, params = tiny
  monkeypatch.setattr(attention_lib, "uses_kernel", lambda mesh: "tpu" if mesh else "")
  mesh = sharding.make_mesh(2, 2, 2)
  rows = np.random.default_rng(3).integers(0, 4, 40)
  kw = dict(max_new_tokens=6, stop_ids=STOPS, prompt_buckets=(8,), segment_steps=2)
  kw |= dict(chunk_rows=8, prompts_per_chunk=4, queue_rows=8, entry_rows=4)
  kw |= dict(rule=sampler_lib.SamplingRule(temperature=1.0))
  one, _ = sampler_lib.Sampler(config, **kw).generate(params, PROMPTS, rows, jax.random.key(5))
  smp = sampler_lib.Sampler(config, mesh=mesh, **kw)
  assert smp.programs(8).row_shards == 4
  driver = smp.pool(params, jax.random.key(5), 8)
  pending, entry_of, finished, shards_used = collections.deque(range(len(rows))), {}, [], set()
  while pending or driver.busy:
    finished += driver.advance(PROMPTS, rows, pending, entry_of)
    live, entry = np.asarray(driver.state.live), np.asarray(driver.state.entry)
    slot_shard = np.arange(8) // 2
    np.testing.assert_array_equal((entry // (smp.prompt_entries // 4))[live], slot_shard[live])
    shards_used |= set(slot_shard[live].tolist())
  assert shards_used == {0, 1, 2, 3}
  got = sampler_lib.response_arrays(finished, len(rows), 6)
  _assert_same_draw(got, one, atol=1e-5)


@pytest.mark.timeout(300, method="thread")  # a livelock fails instead of hanging
def test_a_first_row_blocked_by_entries_kept_behind_it_still_starts(tiny):
  """A livelock found by the cache-layout test: with the queue empty, the first pending
  row's prompt had no prompt-cache entry and every entry was kept for rows further back,
  so no row was queued and every segment returned at once (`SlotDriver.admit` now frees
  those entries). Here: 2 entries, 4 prompts, 16 rows; every row ends."""
  config, params = tiny
  smp = sampler_lib.Sampler(
    config, max_new_tokens=12, stop_ids=STOPS, prompt_buckets=(8,), segment_steps=5,
    chunk_rows=4, prompts_per_chunk=2, queue_rows=4, attention_block=4,
    rule=sampler_lib.SamplingRule(temperature=1.0),
  )  # fmt: skip
  rows = np.random.default_rng(2).integers(0, 4, 16)
  out, _ = smp.generate(params, PROMPTS, rows, jax.random.key(5))
  assert (out["lengths"] >= 1).all() and (out["lengths"] <= 12).all()
  ended = out["lengths"] < 12
  last = out["tokens"][ended, out["lengths"][ended] - 1]
  assert np.isin(last, STOPS).all()  # a row shorter than the budget ended on a stop id


def test_kv_shardings_fit_a_real_cache(tiny):
  """Slots over ('data', 'fsdp'), kv heads over 'tensor', columns and head dim whole; rows
  that do not divide over the data axes are replicated rather than refused."""
  from jax.sharding import PartitionSpec as P

  config, _ = tiny
  mesh = sharding.make_mesh(2, 2, 2)
  kv, mask = slots_lib.kv_shardings(config, mesh, 8, 16)
  assert kv.spec == P(("data", "fsdp"), "tensor", None, None)
  assert mask.spec == P(("data", "fsdp"), None)
  cache = slots_lib.init_slot_cache(config, 8, 4, mesh)
  assert {s.data.shape for s in cache.v[1].addressable_shards} == {(2, 1, 4, 16)}
  assert slots_lib.cache_axes(mesh) == ("bkhs", "bksh")  # XLA:CPU's keys: head dim first
  assert {s.data.shape for s in cache.k[1].addressable_shards} == {(2, 1, 16, 4)}
  assert slots_lib.kv_shardings(config, mesh, 6, 16)[0].spec[0] is None


@pytest.mark.parametrize(
  "mesh_shape, order, key_order", [(None, "sbhk", ""), ((2, 2, 2), "khbs", "shkb")]
)
def test_another_cache_layout_draws_the_same_tokens(
  tiny, monkeypatch, mesh_shape, order, key_order
):
  """The caches' axis orders are `slots.KV_AXES` and the platform's `key_axes` alone: set
  to others (keys in `KV_AXES` order where the platform has none, or in their own), every
  cache array is laid out in them (sharded by them on a mesh, the prompt cache's rows too)
  and the pool draws the same tokens as in XLA:CPU's own orders, with the same log-probs,
  through refills, ring wrap-around and windowed reads; on the mesh also through the
  Pallas kernel (interpreted off TPU), which reads its own order."""
  config, params = tiny
  mesh = sharding.make_mesh(*mesh_shape) if mesh_shape else None
  rows = np.random.default_rng(2).integers(0, 4, 16)
  kw = dict(max_new_tokens=12, stop_ids=STOPS, prompt_buckets=(8,), segment_steps=5)
  kw |= dict(chunk_rows=4, prompts_per_chunk=4 if mesh else 2, queue_rows=4, attention_block=4)
  kw |= dict(rule=sampler_lib.SamplingRule(temperature=1.0))
  draw = lambda: sampler_lib.Sampler(config, mesh=mesh, **kw).generate(
    params, PROMPTS, rows, jax.random.key(5)
  )
  want, want_stats = draw()
  monkeypatch.setattr(slots_lib, "KV_AXES", order)
  cpu = dataclasses.replace(platforms.PLATFORMS["cpu"], key_axes=key_order)
  monkeypatch.setitem(platforms.PLATFORMS, "cpu", cpu)
  sizes = dict(b=4, k=config.num_kv_heads, s=12, h=config.head_dim)
  cache = slots_lib.init_slot_cache(config, 4, 12)
  assert cache.v[0].shape == tuple(sizes[a] for a in order)
  assert cache.k[0].shape == tuple(sizes[a] for a in key_order or order)
  if mesh is not None:  # 4 prompt entries over data x fsdp: the entries' axis is sharded
    assert slots_lib.kv_shardings(config, mesh, 4, 8)[0].spec[order.index("b")] is not None
  got, stats = draw()
  assert len(set(want["lengths"].tolist())) > 2  # rows end at different steps
  _assert_same_draw(got, want, atol=1e-5)
  assert (stats.kv_read, stats.kv_useful) == (want_stats.kv_read, want_stats.kv_useful)
  if mesh is not None:
    monkeypatch.setattr(attention_lib, "uses_kernel", lambda mesh: "tpu")
    kernel, _ = draw()
    _assert_same_draw(kernel, want, atol=1e-4)


@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(rows=st.lists(st.integers(0, 3), min_size=1, max_size=40), seed=st.integers(0, 9))
def test_queue_longer_than_many_refills(tiny, pools, rows, seed):
  """A 2-slot pool fed 2 rows per device call and 5 steps per segment (many segments and
  refills) draws exactly what a 64-slot pool draws for the same rows."""
  _, params = tiny
  small, stats = pools["S=2, Q=2"].generate(params, PROMPTS, rows, jax.random.key(seed))
  big, _ = pools["S=64"].generate(params, PROMPTS, rows, jax.random.key(seed))
  np.testing.assert_array_equal(small["tokens"], big["tokens"])
  np.testing.assert_array_equal(small["lengths"], big["lengths"])
  assert stats.tokens == big["lengths"].sum()
  assert stats.chunks >= len(rows) / 2  # at least one device call per 2 queued rows


def test_rows_past_an_entrys_bound_are_refused(tiny):
  """An entry's live and queued rows are at most R (`entry_rows`): decode attention groups
  no more, so `add_rows` refuses what would pass it, naming the bound."""
  config, params = tiny
  smp = sampler_lib.Sampler(
    config, max_new_tokens=4, stop_ids=[-1], chunk_rows=2, prompts_per_chunk=1,
    prompt_buckets=(8,), entry_rows=2,
  )  # fmt: skip
  pool = smp.pool(params, jax.random.key(0), 8)
  (a,), _ = pool.prefill([PROMPTS[0]])
  pool.add_rows(a, [0])
  with pytest.raises(ValueError, match=r"entry_rows"):
    pool.add_rows(a, [1, 2])
  pool.add_rows(a, [1])


def test_cancelled_prompt_frees_its_slots_at_once(tiny, no_implicit_transfers):
  config, params = tiny
  smp = sampler_lib.Sampler(
    config, max_new_tokens=12, stop_ids=[-1], chunk_rows=2, prompts_per_chunk=2,
    prompt_buckets=(8,), segment_steps=3, entry_rows=2,
  )  # fmt: skip
  key = jax.random.key(5)
  with no_implicit_transfers():
    pool = smp.pool(params, key, 8)
    (a, b, c), hidden = pool.prefill([PROMPTS[0], PROMPTS[1], PROMPTS[2]])
    assert hidden.shape == (3, config.embed_dim) and hidden.dtype == np.float32
    pool.add_rows(a, [0, 1])
    pool.add_rows(c, [2])
    pool.add_rows(b, [3, 4])
    pool.run()  # 3 steps: rows 0 and 1 hold both slots, mid-decode
    assert pool.collect() == [] and len(pool.started) == 2
    assert pool.cancel_rows([0, 1, 2]) == 6  # row 2 leaves the queue; 0 and 1 drew 3 each
    pool.run()  # the cancelled rows' slots go to rows 3 and 4 at the first step
    assert sorted(r.row_id for r in pool.started.values()) == [3, 4]
    assert int(np.asarray(pool.state.length).min()) == 3  # both started at this call's step 0
    while pool.busy:
      pool.run()
  done = {row: (tokens, n) for row, tokens, _, n in pool.collect()}
  assert sorted(done) == [3, 4] and all(n == 12 for _, n in done.values())
  # The same rows in a fresh pool without the cancelled prompt: the same tokens.
  alone = smp.pool(params, key, 8)
  (e,), _ = alone.prefill([PROMPTS[1]])
  alone.add_rows(e, [3, 4])
  while alone.busy:
    alone.run()
  for row, tokens, _, _ in alone.collect():
    np.testing.assert_array_equal(tokens, done[row][0])


def test_prompts_of_different_lengths_in_one_pool(tiny):
  config, params = tiny
  prompts = PROMPTS + [list(range(30, 42))]  # 12 tokens: the pool uses the 16 bucket
  rows = [4, 2, 0, 4, 3, 1]
  ref = _reference(config, params, [prompts[r] for r in rows], 16, 8)
  smp = sampler_lib.Sampler(
    config, rule=GREEDY, max_new_tokens=8, stop_ids=[-1], chunk_rows=2, prompts_per_chunk=1,
    prompt_buckets=(8, 16), attention_block=8,
  )  # fmt: skip
  out, _ = smp.generate(params, prompts, rows, jax.random.key(0))
  np.testing.assert_array_equal(out["tokens"], ref)
  short, _ = smp.generate(params, prompts, [2, 0], jax.random.key(0))  # the 8 bucket
  np.testing.assert_array_equal(short["tokens"], ref[[1, 2]])


def test_slot_cache_draws_the_tokens_of_the_engine_before_it():
  """The ring slot cache changes where keys sit, not what attention computes: in float32
  the pool draws exactly the tokens the per-row-scatter cache of commit 67c6509 drew
  (recorded there with this call), at two pool sizes and attention blocks."""
  golden = np.load(pathlib.Path(__file__).parent / "data" / "pool_tokens_67c6509.npz")
  prompts = [[5, 6, 7, 8, 9], [11, 12], [13], [20, 21, 22, 23, 24, 25, 26], list(range(30, 50))]
  config = model_lib.preset("tiny-llama", dtype="float32")
  params = model_lib.init_params(config, jax.random.key(1))
  for slots, block in ((4, 0), (8, 8)):
    smp = sampler_lib.Sampler(
      config, max_new_tokens=40, stop_ids=tuple(range(3, 512, 37)), chunk_rows=slots,
      prompts_per_chunk=2, prompt_buckets=(8, 32), attention_block=block,
    )  # fmt: skip
    out, _ = smp.generate(params, prompts, np.repeat(np.arange(5), 6), jax.random.key(7))
    np.testing.assert_array_equal(out["tokens"], golden[f"float32_{slots}_tokens"])
    np.testing.assert_array_equal(out["lengths"], golden[f"float32_{slots}_lengths"])
    np.testing.assert_allclose(out["logprobs"], golden[f"float32_{slots}_logprobs"], atol=1e-5)


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
def test_prefill_in_steps_and_query_blocks_fills_the_cache_of_one_forward(
  tiny, monkeypatch, mesh_shape
):
  """`pool.prefill_prompts` (on a mesh one prompt per data-parallel device per step,
  causal attention 3 queries at a time here) stores the keys, values and last hidden
  state one whole forward over the prompts gives, at every real token; padded entries
  (`>= P`) are dropped."""
  from ada_jax.models import layers
  from ada_jax.rollout import pool as pool_lib

  config, params = tiny
  mesh = sharding.make_mesh(*mesh_shape) if mesh_shape else None
  monkeypatch.setattr(pool_lib, "PREFILL_QUERY_BLOCK", 3)
  tokens, mask = testing.left_padded_batch([8, 1, 5, 3, 7, 2, 6, 4], 8, config.vocab_size)
  entries = jnp.array([5, 0, 7, 2, 9, 3, 1, 6])  # 9 >= P: dropped
  cache = slots_lib.empty_prompt_cache(config, 8, 8, mesh)
  filled, hidden = jax.jit(
    lambda c, t, m, e: pool_lib.prefill_prompts(config, params, c, t, m, e, mesh)
  )(cache, tokens, mask, entries)
  positions = model_lib.positions_from_mask(jnp.asarray(mask))

  def causal(*projections):
    q, k, v = layers.split_heads(*projections)
    return layers.causal_attend(q, k, v, jnp.asarray(mask), 8), (k, v)

  whole = lambda layer: causal
  want_hidden, kvs = model_lib.forward(
    config, params, tokens, positions, whole, last_only=True, head=False
  )
  np.testing.assert_allclose(hidden, want_hidden[:, 0], atol=1e-5)
  real = np.asarray(mask)
  as_model = lambda keys: jnp.einsum(f"{slots_lib.cache_axes(mesh)[0]}->bksh", keys)
  for row, entry in enumerate(np.asarray(entries)):
    if entry >= 8:
      continue
    cols = real[row]
    np.testing.assert_array_equal(np.asarray(filled.mask[entry]), cols)
    for layer, (k, v) in enumerate(kvs):
      keys = as_model(filled.k[layer])[entry]
      np.testing.assert_allclose(keys[:, cols], k[row][:, cols], atol=1e-5)
      np.testing.assert_allclose(filled.v[layer][entry][:, cols], v[row][:, cols], atol=1e-5)
  assert not np.asarray(filled.mask[4]).any()  # entry 4 was given no prompt
