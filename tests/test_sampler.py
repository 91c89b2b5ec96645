"""The chunk sampler against the full (no-cache) forward, sampling-rule statistics, the row
mask, prompt sharing, compile counts and the mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ada_jax import testing
from ada_jax.models import decoder as model_lib
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


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [2]])  # batch of mixed lengths, and B = 1
def test_greedy_equals_full_forward_argmax(tiny, rows):
  config, params = tiny
  ref = testing.greedy_reference(config, params, *_padded([PROMPTS[r] for r in rows], 8), 16)
  smp = _greedy(config, max_new_tokens=16, stop_ids=[-1])
  out, stats = smp.generate(params, PROMPTS, rows, jax.random.key(0))
  np.testing.assert_array_equal(out["tokens"], ref)
  assert out["mask"].all() and (out["lengths"] == 16).all()
  assert stats.rows_useful == len(rows) and stats.rows_computed == 4


def test_generation_stops_at_eos_per_row(tiny):
  config, params = tiny
  ref = testing.greedy_reference(config, params, *_padded(PROMPTS, 8), 16)
  # A stop token that each row reaches at a different step (or never).
  stop = int(ref[0, 3])
  first = [int(np.argmax(r == stop)) if (r == stop).any() else None for r in ref]
  assert len({f for f in first}) > 1, first
  out, stats = _greedy(config, max_new_tokens=16, stop_ids=[stop, -7]).generate(
    params, PROMPTS, [0, 1, 2, 3], jax.random.key(0)
  )
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
    chunk_rows=8,
    prompts_per_chunk=4,
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


def _frequencies(rule, logits, draws=200_000, seed=0):
  logits = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (draws, len(logits)))
  tokens, _ = jax.jit(rule.sample)(jax.random.key(seed), logits)
  return np.bincount(np.asarray(tokens), minlength=logits.shape[1]) / draws


def _chi2(freq, probs, draws=200_000):
  keep = probs > 0
  assert (freq[~keep] == 0).all()
  return float((((freq - probs) ** 2)[keep] / probs[keep]).sum() * draws)


BASE = np.log(np.array([0.30, 0.25, 0.15, 0.12, 0.08, 0.06, 0.04]))
CHI2_CRIT = 22.5  # chi-square 99.9% quantile at 6 degrees of freedom (the widest case)


def _expected(temperature, top_k, top_p):
  p = np.exp(BASE / temperature)
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


@pytest.mark.parametrize(
  "temperature,top_k,top_p",
  [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.6), (2.0, 4, 0.8)],
)
def test_sampling_frequencies_match_truncated_distribution(temperature, top_k, top_p):
  rule = sampler_lib.SamplingRule(temperature=temperature, top_k=top_k, top_p=top_p)
  freq = _frequencies(rule, BASE)
  right = _expected(temperature, top_k, top_p)
  assert _chi2(freq, right) < CHI2_CRIT
  # The test has teeth: the untruncated or untempered distribution is rejected.
  wrong = (
    _expected(1.0 if temperature != 1.0 else 2.0, top_k, top_p)
    if (top_k == 0 and top_p == 1.0)
    else _expected(temperature, 0, 1.0)
  )
  assert _chi2(np.where(wrong > 0, freq, 0) + 1e-12 * (wrong > 0), wrong) > 10 * CHI2_CRIT


# (rows requested, chunks the packing rule needs with C = 4 rows and P = 2 prompts a chunk):
# a chunk closes when it holds C rows or a row brings a (P+1)-th distinct prompt.
PACKINGS = [
  ([0, 0, 0, 0, 1], 2),  # 4 rows fill the first chunk
  ([3], 1),
  ([1, 2, 1, 2], 1),  # 2 prompts, 4 rows: one chunk
  ([0, 0, 3, 3, 1, 1, 2], 2),
  ([0, 1, 2, 3], 2),  # 4 rows but 4 prompts: the prompt limit splits them
  ([0, 1, 0, 1, 0, 1, 0, 1], 2),
]


def test_row_mask_and_rng_do_not_recompile(tiny):
  config, params = tiny
  smp = sampler_lib.Sampler(
    config, max_new_tokens=6, stop_ids=[-1], chunk_rows=4, prompts_per_chunk=2, prompt_buckets=(8,)
  )
  for i, (rows, chunks) in enumerate(PACKINGS):
    out, stats = smp.generate(params, PROMPTS, rows, jax.random.key(i))
    assert stats.chunks == chunks, rows  # neither fewer (rows lost) nor more (wasted)
    assert stats.rows_computed == 4 * chunks and stats.rows_useful == len(rows)
    assert out["tokens"].shape == (len(rows), 6)
  assert smp.compiles == 1


def test_chunk_packing_respects_prompt_limit_and_skips_empty_chunks(tiny):
  config, params = tiny
  smp = _greedy(config, max_new_tokens=4, stop_ids=[-1], chunk_rows=4, prompts_per_chunk=2)
  rows = [0, 0, 1, 1, 2, 3]  # 4 distinct prompts, P = 2 -> chunks {0,1} and {2,3}
  out, stats = smp.generate(params, PROMPTS, rows, jax.random.key(0))
  assert stats.chunks == 2 and stats.rows_computed == 8
  np.testing.assert_array_equal(out["tokens"][0], out["tokens"][1])  # shared prefill, greedy
  _, stats = smp.generate(params, PROMPTS, [], jax.random.key(0))
  assert stats.chunks == 0 and stats.rows_computed == 0


def test_masked_rows_are_zero_and_do_not_hold_the_loop(tiny, monkeypatch):
  """Live rows stop at their first token; the decode loop must then end, whatever the
  masked rows would do (they never stop on their own: their token is never a stop id)."""
  config, params = tiny
  tokens, mask = _padded(PROMPTS[:2], 8)
  row_prompt = jnp.array([0, 1, 0, 1])
  greedy = sampler_lib.SamplingRule(temperature=0.0)
  first = testing.greedy_reference(config, params, tokens, mask, 1)[:, 0]
  assert 0 not in first  # a masked row emits 0: it must not count as a stop
  steps = []  # one entry per decode step the loop runs (counted at run time)
  real_decode = model_lib.decode

  def counting_decode(*args, **kwargs):
    jax.debug.callback(lambda: steps.append(1))
    return real_decode(*args, **kwargs)

  monkeypatch.setattr(model_lib, "decode", counting_decode)
  fn = jax.jit(
    lambda rm: sampler_lib.generate(
      config,
      params,
      tokens,
      mask,
      row_prompt,
      rm,
      jax.random.key(0),
      rule=greedy,
      max_new_tokens=5,
      stop_ids=tuple(int(t) for t in first),
    )
  )
  out = fn(jnp.array([True, False, True, False]))
  jax.effects_barrier()
  assert not np.asarray(out.mask[1::2]).any() and (np.asarray(out.tokens[1::2]) == 0).all()
  assert (np.asarray(out.lengths) == [1, 0, 1, 0]).all()
  assert len(steps) == 1  # the live rows' one step; masked rows added none
  steps.clear()
  none = fn(jnp.zeros(4, bool))  # every row masked: the loop must not run at all
  jax.effects_barrier()
  assert int(none.lengths.sum()) == 0 and steps == []


def test_sharded_sampler_matches_single_device(tiny):
  config, params = tiny
  mesh = jax.make_mesh(
    (2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3
  )
  rows = [0, 1, 2, 3, 0, 1, 2, 3]
  single, _ = _greedy(config, max_new_tokens=8, stop_ids=[-1], chunk_rows=8).generate(
    params, PROMPTS, rows, jax.random.key(0)
  )
  smp = _greedy(config, max_new_tokens=8, stop_ids=[-1], chunk_rows=8, mesh=mesh)
  sharded, _ = smp.generate(params, PROMPTS, rows, jax.random.key(0))
  np.testing.assert_array_equal(single["tokens"], sharded["tokens"])
  np.testing.assert_allclose(single["logprobs"], sharded["logprobs"], atol=1e-5)


def test_bad_input_is_reported():
  config = model_lib.preset("tiny-llama")
  with pytest.raises(ValueError, match="top_p"):
    sampler_lib.SamplingRule(top_p=0.0)
  with pytest.raises(ValueError, match="prompts_per_chunk"):
    sampler_lib.Sampler(config, max_new_tokens=4, stop_ids=[1], chunk_rows=2, prompts_per_chunk=3)
  smp = sampler_lib.Sampler(
    config, max_new_tokens=4, stop_ids=[1], chunk_rows=2, prompts_per_chunk=2, prompt_buckets=(4,)
  )
  params = model_lib.init_params(config, jax.random.key(0))
  with pytest.raises(ValueError, match="largest prompt bucket"):
    smp.generate(params, [[1, 2, 3, 4, 5]], [0], jax.random.key(0))
  with pytest.raises(ValueError, match="outside"):
    smp.generate(params, [[1, 2]], [1], jax.random.key(0))
