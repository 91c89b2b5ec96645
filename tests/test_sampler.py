"""The rollout engine against the full (no-cache) forward, sampling-rule statistics (on the
rule and through the pool), prompt sharing, compile counts, the mesh and bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ada_jax import testing
from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding
from ada_jax.rollout import sampler as sampler_lib

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [13], [20, 21, 22, 23, 24, 25, 26]]


@pytest.fixture(scope="module")
def tiny():
  config = model_lib.preset("tiny-llama")
  return config, model_lib.init_params(config, jax.random.key(0))


def _padded(prompts, length):
  tokens = np.zeros((len(prompts), length), np.int32)
  mask = np.zeros((len(prompts), length), bool)
  for i, p in enumerate(prompts):
    tokens[i, length - len(p) :] = p
    mask[i, length - len(p) :] = True
  return tokens, mask


def _greedy(config, **kw):
  kw.setdefault("chunk_rows", 4)
  kw.setdefault("prompts_per_chunk", 4)
  kw.setdefault("prompt_buckets", (8, 16))
  return sampler_lib.Sampler(config, rule=sampler_lib.SamplingRule(temperature=0.0), **kw)


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [2], [3, 0, 3, 1, 2, 2, 0]])  # B=1; B > S
def test_greedy_equals_full_forward_argmax(tiny, rows):
  config, params = tiny
  ref = testing.greedy_reference(config, params, *_padded([PROMPTS[r] for r in rows], 8), 16)
  smp = _greedy(config, max_new_tokens=16, stop_ids=[-1], attention_block=4)
  out, stats = smp.generate(params, PROMPTS, rows, jax.random.key(0))
  np.testing.assert_array_equal(out["tokens"], ref)
  assert out["mask"].all() and (out["lengths"] == 16).all()
  assert stats.rows_useful == len(rows) and stats.tokens == 16 * len(rows)


def test_generation_stops_at_eos_per_row(tiny):
  config, params = tiny
  ref = testing.greedy_reference(config, params, *_padded(PROMPTS, 8), 16)
  # A stop token that each row reaches at a different step (or never).
  stop = int(ref[0, 3])
  first = [int(np.argmax(r == stop)) if (r == stop).any() else None for r in ref]
  assert len({f for f in first}) > 1, first
  out, stats = _greedy(
    config, max_new_tokens=16, stop_ids=[stop, -7], chunk_rows=2, prompts_per_chunk=2
  ).generate(params, PROMPTS, [0, 1, 2, 3], jax.random.key(0))
  for row, f in enumerate(first):
    n = 16 if f is None else f + 1
    assert out["lengths"][row] == n
    np.testing.assert_array_equal(out["tokens"][row, :n], ref[row, :n])
    assert not out["mask"][row, n:].any() and (out["tokens"][row, n:] == 0).all()
    assert (out["logprobs"][row, n:] == 0).all()
  assert stats.tokens == out["lengths"].sum()


def test_logprobs_are_those_of_the_full_forward(tiny):
  config, params = tiny
  temperature = 0.7
  smp = sampler_lib.Sampler(
    config,
    rule=sampler_lib.SamplingRule(temperature=temperature),
    max_new_tokens=10,
    stop_ids=[-1],
    chunk_rows=4,
    prompts_per_chunk=2,
    prompt_buckets=(8,),
  )
  rows = [0, 0, 1, 2, 3, 3]
  out, _ = smp.generate(params, PROMPTS, rows, jax.random.key(3))
  tokens, mask = _padded([PROMPTS[r] for r in rows], 8)
  full_tokens = np.concatenate([tokens, out["tokens"]], 1)
  full_mask = np.concatenate([mask, out["mask"]], 1)
  logits = model_lib.logits(
    config, params, full_tokens, model_lib.positions_from_mask(jnp.asarray(full_mask)), full_mask
  )
  logp = jax.nn.log_softmax(logits[:, 7:-1] / temperature, -1)
  expected = np.take_along_axis(np.asarray(logp), out["tokens"][..., None], -1)[..., 0]
  np.testing.assert_allclose(out["logprobs"], expected, atol=1e-4)
  assert len({tuple(t) for t in out["tokens"][:2]}) == 2  # same prompt, different samples


def _chi2_crit(df: int) -> float:
  """99.9% quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty)."""
  z = 3.090
  return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def _chi2(counts, probs):
  """Pearson's statistic and its degrees of freedom; bins expected below 5 are pooled."""
  n = counts.sum()
  keep = probs > 0
  assert (counts[~keep] == 0).all(), "a token outside the kept set was drawn"
  expected = probs * n
  big = keep & (expected >= 5)
  obs = np.append(counts[big], counts[keep & ~big].sum())
  exp = np.append(expected[big], expected[keep & ~big].sum())
  obs, exp = obs[exp > 0], exp[exp > 0]
  return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def _frequencies(rule, logits, draws=200_000, seed=0):
  logits = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (draws, len(logits)))
  tokens, _ = jax.jit(rule.sample)(jax.random.key(seed), logits)
  return np.bincount(np.asarray(tokens), minlength=logits.shape[1])


BASE = np.log(np.array([0.30, 0.25, 0.15, 0.12, 0.08, 0.06, 0.04]))
RULES = [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6), (2.0, 4, 0.8)]


def _expected(logits, temperature, top_k, top_p):
  p = np.exp((logits - logits.max()) / temperature)
  p /= p.sum()
  order = np.argsort(-p)
  keep = np.zeros_like(p, bool)
  if top_k:
    keep[order[:top_k]] = True
  else:
    keep[:] = True
  p = np.where(keep, p, 0) / p[keep].sum()  # top-p acts on the top-k renormalised mass
  mass_before = np.cumsum(p[order]) - p[order]
  keep[order[mass_before >= top_p]] = False
  q = np.where(keep, p, 0)
  return q / q.sum()


def _wrong(logits, temperature, top_k, top_p):
  """A nearby wrong distribution: untempered, or untruncated."""
  if top_k == 0 and top_p == 1.0:
    return _expected(logits, 1.0 if temperature != 1.0 else 2.0, 0, 1.0)
  return _expected(logits, temperature, 0, 1.0)


def _rejects(counts, wrong):
  stat, df = _chi2(np.where(wrong > 0, counts, 0), wrong)
  return stat > 10 * _chi2_crit(df)


@pytest.mark.parametrize("temperature,top_k,top_p", RULES)
def test_sampling_frequencies_match_truncated_distribution(temperature, top_k, top_p):
  rule = sampler_lib.SamplingRule(temperature=temperature, top_k=top_k, top_p=top_p)
  counts = _frequencies(rule, BASE)
  stat, df = _chi2(counts, _expected(BASE, temperature, top_k, top_p))
  assert stat < _chi2_crit(df)
  assert _rejects(counts, _wrong(BASE, temperature, top_k, top_p))  # the test has teeth


@pytest.fixture(scope="module")
def sharp(tiny):
  """The tiny model with a 3x embedding scale: first-token distributions far from uniform."""
  config, params = tiny
  return config, {**params, "embed": params["embed"] * 3.0}


@pytest.mark.parametrize("temperature,top_k,top_p", RULES)
def test_pool_first_tokens_follow_the_rule(sharp, temperature, top_k, top_p):
  """The same chi-square through the engine: many one-token rows of one prompt, drawn by
  the pool's per-row keys, against the rule applied to the no-cache forward's logits."""
  config, params = sharp
  rule = sampler_lib.SamplingRule(temperature=temperature, top_k=top_k, top_p=top_p)
  smp = sampler_lib.Sampler(
    config, rule=rule, max_new_tokens=1, stop_ids=[-1], chunk_rows=512, prompts_per_chunk=1,
    prompt_buckets=(8,),
  )  # fmt: skip
  out, _ = smp.generate(params, PROMPTS, np.zeros(16_384, int), jax.random.key(7))
  tokens, mask = _padded(PROMPTS[:1], 8)
  logits = model_lib.logits(config, params, tokens, model_lib.positions_from_mask(mask), mask)
  logits = np.asarray(logits[0, -1], np.float64)
  counts = np.bincount(out["tokens"][:, 0], minlength=config.vocab_size)
  stat, df = _chi2(counts, _expected(logits, temperature, top_k, top_p))
  assert stat < _chi2_crit(df), (stat, df)
  assert _rejects(counts, _wrong(logits, temperature, top_k, top_p))


def test_no_recompile_after_warm_up(tiny, no_implicit_transfers):
  """Row counts, prompt sets, keys and queue fill change; shapes (and compiles) do not,
  and no call moves data to the device implicitly."""
  config, params = tiny
  smp = sampler_lib.Sampler(
    config, max_new_tokens=6, stop_ids=[9], chunk_rows=4, prompts_per_chunk=2, prompt_buckets=(8,)
  )
  smp.generate(params, PROMPTS, [0, 1], jax.random.key(0))
  warm = smp.compiles
  calls = [[0, 0, 0, 0, 1], [3], [1, 2, 1, 2] * 5, list(range(4)) * 9, []]
  keys = [jax.random.key(i) for i in range(len(calls))]
  for key, rows in zip(keys, calls, strict=True):
    with no_implicit_transfers():
      out, stats = smp.generate(params, PROMPTS, rows, key)
    assert out["tokens"].shape == (len(rows), 6) and stats.rows_useful == len(rows)
  assert smp.compiles == warm


def test_rows_of_one_prompt_share_a_prefill(tiny):
  config, params = tiny
  smp = _greedy(config, max_new_tokens=4, stop_ids=[-1], chunk_rows=4, prompts_per_chunk=1)
  prefills = []
  programs = smp.programs(8)  # PROMPTS' bucket: the engine the pool is handed
  counted = lambda *a: prefills.append(1) or programs.prefill(*a)
  smp._fns[8] = dataclasses.replace(programs, prefill=counted)
  out, _ = smp.generate(params, PROMPTS, [0, 0, 1, 1, 2, 3], jax.random.key(0))
  np.testing.assert_array_equal(out["tokens"][0], out["tokens"][1])  # greedy, one prompt
  assert len(prefills) == 4  # one per prompt (one prompt a launch), never one per row
  _, stats = smp.generate(params, PROMPTS, [], jax.random.key(0))
  assert stats.chunks == 0 and stats.tokens == 0


def test_sharded_sampler_matches_single_device(tiny, no_implicit_transfers):
  config, params = tiny
  mesh = sharding.make_mesh(2, 2, 2)
  rows = [0, 1, 2, 3, 0, 1, 2, 3, 1, 1, 3]
  kw = dict(max_new_tokens=8, stop_ids=[9], chunk_rows=4, prompts_per_chunk=2, prompt_buckets=(8,))
  rule = sampler_lib.SamplingRule(temperature=1.0)
  single, _ = sampler_lib.Sampler(config, rule=rule, **kw).generate(
    params, PROMPTS, rows, jax.random.key(0)
  )
  kw["chunk_rows"] = 8  # a multiple of data x fsdp
  smp = sampler_lib.Sampler(config, rule=rule, mesh=mesh, **kw)
  key = jax.random.key(0)
  placed = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  with no_implicit_transfers():
    sharded, _ = smp.generate(placed, PROMPTS, rows, key)
  np.testing.assert_array_equal(single["tokens"], sharded["tokens"])
  np.testing.assert_array_equal(single["lengths"], sharded["lengths"])
  np.testing.assert_allclose(single["logprobs"], sharded["logprobs"], atol=1e-5)
  # The prompt cache is sharded like the slot cache (entries over data x fsdp), before and
  # after a prefill: replicated, a 3B model's would take ~20 GiB on every device.
  pool = smp.pool(params, jax.random.key(0), 8)
  for _ in range(2):
    for leaf in (pool.prompts.k[0], pool.prompts.v[0], pool.prompts.mask):
      assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // 4, leaf.sharding
    pool.prefill([PROMPTS[0], PROMPTS[1]])


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_vocab_sharded_draw_equals_the_whole_vocabulary_draw(temperature):
  """`SamplingRule.draw` on logits split 4 ways along the vocabulary (rows 2 ways) draws the
  tokens and log-probs the whole-vocabulary rule draws from the same uniforms: peaked and
  flat rows, -inf logits, a row with mass in one slice only, u at 0 and just below 1."""
  mesh = sharding.make_mesh(2, 1, 4)
  rule = sampler_lib.SamplingRule(temperature=temperature)
  rng = np.random.default_rng(0)
  rows, vocab = 64, 96
  logits = rng.normal(size=(rows, vocab)) * rng.choice([0.1, 1.0, 8.0], size=(rows, 1))
  logits[3, :] = -np.inf
  logits[3, 70] = 2.0  # all mass in the last-but-one slice
  logits[5, ::3] = -np.inf
  u = rng.uniform(size=rows)
  u[:4], u[4:8] = 0.0, np.nextafter(np.float32(1), np.float32(0))
  logits, u = jnp.asarray(logits, jnp.float32), jnp.asarray(u, jnp.float32)
  assert rule.vocab_shards(mesh, logits.shape) == 4
  assert sampler_lib.SamplingRule(top_k=5).vocab_shards(mesh, logits.shape) == 1
  whole = jax.jit(rule.draw)(logits, u)
  split = jax.jit(lambda z, u: rule.draw(z, u, mesh))(logits, u)
  np.testing.assert_array_equal(np.asarray(split[0]), np.asarray(whole[0]))
  np.testing.assert_allclose(np.asarray(split[1]), np.asarray(whole[1]), rtol=1e-5, atol=1e-5)
  assert np.asarray(split[0])[3] == 70 and len(set(np.asarray(split[0]).tolist())) > 10


@pytest.mark.parametrize("vocab", [8192, 8704])
def test_two_level_cumulative_sum_draws_the_flat_rule(vocab):
  """Vocabularies summed in blocks (`rule.cdf_block`: 1,024 tokens for 8,192 and its
  2,048-token slices; 512 and 128 for 8,704 and its slices) draw the flat inverse-CDF rule's
  token (a float64 reference) for every u not within float rounding of a boundary, whole
  and split 4 ways: mass in one block only, -inf runs, u at 0 and just below 1."""
  from ada_jax.rollout import rule as rule_lib

  assert rule_lib.cdf_block(vocab) and rule_lib.cdf_block(vocab // 4)
  mesh = sharding.make_mesh(2, 1, 4)
  rng = np.random.default_rng(1)
  rows = 64
  logits = rng.normal(size=(rows, vocab)) * rng.choice([0.1, 1.0, 8.0], size=(rows, 1))
  logits[3, :] = -np.inf
  logits[3, vocab - 70] = 2.0  # all mass in one block of the last slice
  logits[5, : vocab // 2] = -np.inf
  u = rng.uniform(size=rows)
  u[:4], u[4:8] = 0.0, np.nextafter(np.float32(1), np.float32(0))
  p = np.exp(logits - logits.max(-1, keepdims=True))
  cdf = np.cumsum(p / p.sum(-1, keepdims=True), -1)
  want = np.argmax((cdf >= u[:, None]) & (p > 0), -1)
  clear = np.abs(cdf - u[:, None]).min(-1) > 1e-5  # u away from every boundary
  rule = sampler_lib.SamplingRule()
  z, uu = jnp.asarray(logits, jnp.float32), jnp.asarray(u, jnp.float32)
  for got in (jax.jit(rule.draw)(z, uu), jax.jit(lambda z, u: rule.draw(z, u, mesh))(z, uu)):
    tokens = np.asarray(got[0])
    np.testing.assert_array_equal(tokens[clear], want[clear])
    assert (
      tokens[3] == vocab - 70 and (tokens[5] >= vocab // 2) and (p[range(rows), tokens] > 0).all()
    )
    logp = (
      logits[range(rows), tokens]
      - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
      - logits.max(-1)
    )
    np.testing.assert_allclose(np.asarray(got[1]), logp, rtol=1e-4, atol=1e-4)
  assert clear.sum() > 40  # most rows: the assertion above is not vacuous


def test_bad_input_is_reported():
  config = model_lib.preset("tiny-llama")
  with pytest.raises(ValueError, match="top_p"):
    sampler_lib.SamplingRule(top_p=0.0)
  with pytest.raises(ValueError, match="prompts_per_chunk"):
    sampler_lib.Sampler(config, max_new_tokens=4, stop_ids=[1], chunk_rows=2, prompts_per_chunk=3)
  with pytest.raises(ValueError, match="segment_steps"):
    sampler_lib.Sampler(
      config, max_new_tokens=4, stop_ids=[1], chunk_rows=2, prompts_per_chunk=1, segment_steps=-1
    )
  smp = sampler_lib.Sampler(
    config, max_new_tokens=4, stop_ids=[1], chunk_rows=2, prompts_per_chunk=2, prompt_buckets=(4,)
  )
  params = model_lib.init_params(config, jax.random.key(0))
  with pytest.raises(ValueError, match="largest prompt bucket"):
    smp.generate(params, [[1, 2, 3, 4, 5]], [0], jax.random.key(0))
  with pytest.raises(ValueError, match="outside"):
    smp.generate(params, [[1, 2]], [1], jax.random.key(0))
  with pytest.raises(ValueError, match="prompt 0 is empty"):
    smp.generate(params, [[]], [0], jax.random.key(0))
