"""The sampler's recorded log-probs are the trainer's: temperature, top-k / top-p, and draws
that never leave the kept set (whatever the uniform number)."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding
from ada_jax.rl import losses, train
from ada_jax.rollout import sampler as sampler_lib

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [13], [20, 21, 22, 23, 24, 25, 26]]
U_EDGES = (0.0, float(np.nextafter(np.float32(1), np.float32(0))))  # u = 0 and largest < 1


@pytest.fixture(scope="module")
def tiny():
  config = model_lib.preset("tiny-llama")  # float32
  return config, model_lib.init_params(config, jax.random.key(0))


def _rollout_batch(config, params, rule, *, rows=(0, 0, 1, 2, 3, 3, 1, 2), new_tokens=12, seed=3):
  """Samples with `rule`, then lays prompt + response out as a `train.TrainBatch`."""
  smp = sampler_lib.Sampler(
    config,
    rule=rule,
    max_new_tokens=new_tokens,
    stop_ids=[-1],
    chunk_rows=8,
    prompts_per_chunk=4,
    prompt_buckets=(8,),
  )
  out, _ = smp.generate(params, PROMPTS, list(rows), jax.random.key(seed))
  lp = 8
  tokens = np.zeros((len(rows), lp), np.int32)
  mask = np.zeros((len(rows), lp), bool)
  for i, r in enumerate(rows):
    tokens[i, lp - len(PROMPTS[r]) :] = PROMPTS[r]
    mask[i, lp - len(PROMPTS[r]) :] = True
  attention = np.concatenate([mask, out["mask"]], 1)
  response = np.concatenate([np.zeros_like(mask), out["mask"]], 1)
  return train.TrainBatch(
    tokens=np.concatenate([tokens, out["tokens"]], 1),
    positions=np.maximum(np.cumsum(attention, 1) - 1, 0).astype(np.int32),
    segments=attention.astype(np.int32),
    loss_mask=response,
    advantages=np.repeat(np.linspace(-1, 1, len(rows))[:, None], attention.shape[1], 1).astype(
      np.float32
    ),
    old_logprobs=np.concatenate([np.zeros(mask.shape, np.float32), out["logprobs"]], 1),
  )


def _first_update_metrics(config, params, batch, temperature):
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  cfg = train.TrainConfig(num_minibatches=1, temperature=temperature)
  state = train.init_train_state(config, cfg, params, mesh)
  _, metrics = train.make_train_step(config, cfg, mesh)(state, batch)
  return jax.device_get(metrics)


def test_trainer_recomputes_the_sampler_logprobs_at_temperature(tiny):
  """T = 0.5: gap <= 1e-5, no clipped token on the first update."""
  config, params = tiny
  rule = sampler_lib.SamplingRule(temperature=0.5)
  batch = _rollout_batch(config, params, rule)
  lp, ent = losses.token_logprobs(
    config,
    params,
    batch.tokens,
    batch.positions,
    batch.segments,
    temperature=rule.logprob_temperature,
  )
  m = batch.loss_mask
  gap = np.abs(np.asarray(lp) - batch.old_logprobs)[m]
  assert m.sum() > 50 and gap.max() <= 1e-5, gap.max()
  assert float(_first_update_metrics(config, params, batch, 0.5)["clip_frac"]) == 0.0
  # The test has teeth: recomputing at T = 1 (the old behaviour) clips many tokens.
  at_one, _ = losses.token_logprobs(config, params, batch.tokens, batch.positions, batch.segments)
  _, clipped, _ = losses.per_token_pg_loss(
    at_one, batch.old_logprobs, batch.advantages, losses.LossConfig()
  )
  assert np.asarray(clipped)[m].mean() > 0.2

  # The entropy is that of softmax(z / T) (float64 reference).
  z = (
    np.asarray(
      model_lib.logits(config, params, batch.tokens, batch.positions, batch.segments),
      np.float64,
    )[:, :-1]
    / 0.5
  )
  logp = z - z.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  want = -(np.exp(logp) * logp).sum(-1)
  np.testing.assert_allclose(np.asarray(ent)[:, 1:][m[:, 1:]], want[m[:, 1:]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 20, 0.8)])
def test_recorded_logprob_is_the_tempered_full_distribution(tiny, temperature, top_k, top_p):
  """Under top-k / top-p the ratio's log-prob is the untruncated tempered one, on both
  paths (greedy: T = 1)."""
  config, params = tiny
  rule = sampler_lib.SamplingRule(temperature, top_k, top_p)
  batch = _rollout_batch(config, params, rule, rows=(0, 1, 2, 3), new_tokens=6, seed=1)
  lp, _ = losses.token_logprobs(
    config,
    params,
    batch.tokens,
    batch.positions,
    batch.segments,
    temperature=rule.logprob_temperature,
  )
  m = batch.loss_mask
  assert np.abs(np.asarray(lp) - batch.old_logprobs)[m].max() <= 1e-5


def _np_log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


@settings(max_examples=40, deadline=None)
@given(
  temperature=st.floats(0.05, 3.0),
  top_k=st.integers(0, 12),
  top_p=st.floats(0.05, 1.0, exclude_min=True),
  u=st.one_of(st.sampled_from(U_EDGES), st.floats(0.0, 1.0, exclude_max=True, width=32)),
  seed=st.integers(0, 2**16),
)
def test_draw_stays_in_kept_set_and_records_full_tempered_logprob(
  temperature, top_k, top_p, u, seed
):
  rng = np.random.default_rng(seed)
  logits = (3 * rng.standard_normal((4, 12))).astype(np.float32)
  logits[1, :5] = -np.inf  # -inf logits are never drawn either
  rule = sampler_lib.SamplingRule(temperature, top_k, top_p)
  tokens, logprobs = rule.draw(jnp.asarray(logits), jnp.full((4,), u, jnp.float32))
  tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
  kept = np.isfinite(np.asarray(rule.truncated(jnp.asarray(logits))))
  assert kept[np.arange(4), tokens].all()
  want = _np_log_softmax(logits.astype(np.float64) / temperature)[np.arange(4), tokens]
  np.testing.assert_allclose(logprobs, want, rtol=1e-5, atol=1e-5)
  assert np.isfinite(logprobs).all()


@pytest.mark.parametrize("u", U_EDGES)
@pytest.mark.parametrize(
  "rule,logits,allowed",
  [
    (sampler_lib.SamplingRule(top_k=1), [0.0, 1.0, 2.0, 5.0], {3}),
    (sampler_lib.SamplingRule(top_k=2), [9.0, 1.0, 2.0, 5.0], {0, 3}),
    (sampler_lib.SamplingRule(top_p=0.5), [0.0, 1.0, 2.0, 5.0], {3}),
    (sampler_lib.SamplingRule(), [-np.inf, 1.0, 2.0, -np.inf], {1, 2}),
    (sampler_lib.SamplingRule(temperature=0.3), [-np.inf, -np.inf, 0.0, -np.inf], {2}),
  ],
)
def test_a_token_outside_the_kept_set_is_never_drawn(rule, logits, allowed, u):
  """A token the rule masks out (top_k, top_p, -inf logits) is never drawn, also at the
  edges of the uniform u (u exactly 0: top_k=1 on [0, 1, 2, 5] draws token 3, not 0)."""
  logits = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (3, len(logits)))
  tokens, logprobs = jax.jit(rule.draw)(logits, jnp.full((3,), u, jnp.float32))
  assert set(np.asarray(tokens).tolist()) <= allowed
  assert np.isfinite(np.asarray(logprobs)).all()


def test_many_draws_never_leave_top_k():
  rule = sampler_lib.SamplingRule(top_k=1)
  logits = jnp.broadcast_to(jnp.asarray([0.0, 1.0, 2.0, 5.0]), (65_536, 4))
  tokens, _ = jax.jit(rule.sample)(jax.random.key(0), logits)
  assert (np.asarray(tokens) == 3).all()


def test_top_k_larger_than_the_vocabulary_is_rejected_at_construction(tiny):
  config, _ = tiny
  with pytest.raises(ValueError, match="top_k"):
    sampler_lib.Sampler(
      config,
      rule=sampler_lib.SamplingRule(top_k=config.vocab_size + 1),
      max_new_tokens=4,
      stop_ids=[1],
    )
  sampler_lib.Sampler(
    config, rule=sampler_lib.SamplingRule(top_k=config.vocab_size), max_new_tokens=4, stop_ids=[1]
  )  # the whole vocabulary is fine


# ----------------------------------------------------------------- KV cache on the mesh


def _mesh_vs_unsharded(kv_heads, tensors):
  """(kv heads, tensor) -> (tokens equal, max log-prob gap) of the sharded sampler against
  the unsharded one, on a 1-layer Qwen2-shaped model with 8 query heads."""
  config = model_lib.ModelConfig(
    family="qwen2",
    vocab_size=64,
    embed_dim=32,
    mlp_dim=64,
    num_layers=1,
    num_heads=8,
    num_kv_heads=kv_heads,
    head_dim=8,
    qkv_bias=True,
  )
  params = model_lib.init_params(config, jax.random.key(kv_heads))
  rows = [0, 1, 2, 3, 0, 1, 2, 3]
  kw = dict(
    rule=sampler_lib.SamplingRule(temperature=1.0),
    max_new_tokens=3,
    stop_ids=[-1],
    chunk_rows=8,
    prompts_per_chunk=8,
    prompt_buckets=(8,),
  )
  ref, _ = sampler_lib.Sampler(config, **kw).generate(params, PROMPTS, rows, jax.random.key(1))
  out = {}
  for tensor in tensors:
    mesh = sharding.make_mesh(data=-1, fsdp=1, tensor=tensor)
    placed = sharding.place_params(params, sharding.param_shardings(config, mesh))
    got, _ = sampler_lib.Sampler(config, mesh=mesh, **kw).generate(
      placed, PROMPTS, rows, jax.random.key(1)
    )
    out[kv_heads, tensor] = (
      bool((got["tokens"] == ref["tokens"]).all()),
      float(np.abs(got["logprobs"] - ref["logprobs"]).max()),
    )
  return out


def _check_mesh_runs(cases, capfd):
  # XLA prints "Involuntary full rematerialization" from C++ straight to file descriptor 2,
  # which only capfd (not capsys) sees; the models here are unique, so each case compiles.
  capfd.readouterr()
  results = {}
  for kv_heads, tensors in cases.items():
    results.update(_mesh_vs_unsharded(kv_heads, tensors))
  err = capfd.readouterr().err
  assert "rematerialization" not in err, err[-3000:]
  for case, (equal, gap) in results.items():
    assert equal and gap <= 1e-5, (case, equal, gap)


def test_fewer_kv_heads_than_tensor_shards_without_rematerialization(capfd):
  """2 kv heads on tensor = 4 (Qwen2.5-Math-1.5B with its configs' mesh): no
  rematerialization warning."""
  _check_mesh_runs({2: (4,)}, capfd)


@pytest.mark.slow
def test_sharded_sampler_matches_unsharded_over_kv_heads_and_tensor(capfd):
  """kv heads {1, 2, 8} x tensor {1, 2, 4} on the 8-device mesh."""
  _check_mesh_runs({kv: (1, 2, 4) for kv in (1, 2, 8)}, capfd)


def _flat_specs(config, mesh):
  leaves = jax.tree_util.tree_flatten_with_path(
    sharding.param_specs(config, mesh), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
  )[0]
  return {"/".join(str(getattr(k, "key", k)) for k in path): spec for path, spec in leaves}


def test_query_heads_follow_their_kv_heads_in_the_rule_table():
  config = model_lib.preset("qwen2.5-math-1.5b")  # 12 query heads, 2 kv heads
  uneven = _flat_specs(config, sharding.make_mesh(data=2, fsdp=1, tensor=4))
  assert not any("tensor" in str(v) for k, v in uneven.items() if "/attn/" in k), uneven
  assert "tensor" in str(uneven["layer_0/mlp/up"])
  even = _flat_specs(config, sharding.make_mesh(data=4, fsdp=1, tensor=2))
  for name in ("q", "k", "v", "o"):
    assert "tensor" in str(even[f"layer_0/attn/{name}"]), (name, even)
