"""Packed training rows (`rl.packing`): the layout keeps every sequence whole and apart,
and the update it computes is the padded batch's (loss, gradients, params after a step,
token mean, micro-batches, 8 fake devices, every loss aggregation)."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ada_jax import testing
from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding
from ada_jax.rl import losses, packing, train, update

CONFIG = model_lib.preset("tiny-llama")
PARAMS = model_lib.init_params(CONFIG, jax.random.key(0))


def _batch(prompt_lengths, response_lengths, seed=0, prompt_len=6, response_len=10):
  return testing.rl_batch(
    CONFIG,
    PARAMS,
    prompt_lengths,
    response_lengths,
    prompt_len=prompt_len,
    response_len=response_len,
    seed=seed,
  )


def _layout_batch(prompt_lengths, response_lengths, width_prompt, width_response, seed=0):
  """A `TrainBatch` in make_train_batch's layout with distinct values everywhere (no model:
  the layout tests need only where each value goes)."""
  rows = len(prompt_lengths)
  width = width_prompt + width_response
  cols = np.arange(width)[None]
  p, r = np.asarray(prompt_lengths)[:, None], np.asarray(response_lengths)[:, None]
  real = ((cols >= width_prompt - p) & (cols < width_prompt)) | (
    (cols >= width_prompt) & (cols < width_prompt + r)
  )
  response = real & (cols >= width_prompt)
  ids = np.arange(rows * width).reshape(rows, width)
  rng = np.random.default_rng(seed)
  adv = rng.standard_normal((rows, 1))
  return train.TrainBatch(
    tokens=np.where(real, ids + 1, 0).astype(np.int32),
    positions=np.asarray(model_lib.positions_from_mask(real)).astype(np.int32),
    segments=real.astype(np.int32),
    loss_mask=response,
    advantages=np.where(real, adv, 0.0).astype(np.float32),
    old_logprobs=np.where(response, -ids / 7.0, 0.0).astype(np.float32),
    ref_logprobs=np.where(response, ids / 5.0, 0.0).astype(np.float32),
  )


@given(
  rows_in_units=st.integers(1, 70),
  unit=st.sampled_from([1, 2, 4, 8]),
)
def test_row_counts_are_a_bounded_ladder_of_unit_multiples(rows_in_units, unit):
  rows = rows_in_units * unit
  counts = packing.row_counts(rows, unit)
  assert counts[-1] == rows and counts == sorted(set(counts))
  assert all(c % unit == 0 and c > 0 for c in counts)
  # Every count up to 16 units, then at most 1/8 of a count is rounding.
  first = min(16, rows_in_units)
  assert counts[:first] == [unit * m for m in range(1, first + 1)]
  assert all(b - a <= max(unit, a // 8) for a, b in zip(counts, counts[1:], strict=False))
  assert len(counts) <= 16 + 8 * max(0, int(np.ceil(np.log2(rows_in_units / 16))))


def test_row_counts_refuse_a_mini_batch_that_is_not_a_multiple():
  with pytest.raises(ValueError, match="12 rows is not a positive multiple of 8"):
    packing.row_counts(12, 8)


@settings(deadline=None, max_examples=60)
@given(
  data=st.data(),
  unit=st.sampled_from([1, 2, 4]),
  width_prompt=st.integers(1, 8),
  width_response=st.integers(1, 12),
)
def test_pack_moves_every_sequence_whole_into_its_own_segment(
  data, unit, width_prompt, width_response
):
  rows = unit * data.draw(st.integers(1, 6))
  prompts = data.draw(st.lists(st.integers(0, width_prompt), min_size=rows, max_size=rows))
  responses = data.draw(st.lists(st.integers(0, width_response), min_size=rows, max_size=rows))
  # A row with a response has a prompt (a sequence starts with its prompt).
  prompts = [max(p, 1) if r else p for p, r in zip(prompts, responses, strict=True)]
  batch = _layout_batch(prompts, responses, width_prompt, width_response)
  packed = packing.pack(batch, unit)
  width = width_prompt + width_response
  assert packed.tokens.shape[1] == width
  assert packed.rows in packing.row_counts(rows, unit)
  lengths = np.asarray(prompts) + np.asarray(responses)
  needed = -(-lengths.sum() // width)  # fewer rows cannot hold the tokens
  assert packed.rows >= max(needed, unit)
  # Each sequence appears once, whole, in one segment, with its values.
  by_token = {}
  for row in range(packed.rows):
    for col in np.flatnonzero(packed.segments[row]):
      by_token[int(packed.tokens[row, col])] = (row, col, int(packed.segments[row, col]))
  assert len(by_token) == int(lengths.sum())
  for i in range(rows):
    cols = np.flatnonzero(batch.segments[i])
    if not cols.size:
      continue
    spots = [by_token[int(t)] for t in batch.tokens[i, cols]]
    (row,), (_,) = {s[0] for s in spots}, {s[2] for s in spots}
    got = np.asarray([s[1] for s in spots])
    np.testing.assert_array_equal(got, got[0] + np.arange(len(cols)))  # contiguous, in order
    for field in ("positions", "loss_mask", "advantages", "old_logprobs", "ref_logprobs"):
      np.testing.assert_array_equal(
        getattr(packed, field)[row, got], getattr(batch, field)[i, cols], err_msg=field
      )
  # Segments are numbered 1, 2, ... in column order; padding is 0 everywhere.
  for row in range(packed.rows):
    seg = packed.segments[row]
    starts = seg[np.flatnonzero(np.diff(np.concatenate([[0], seg])))]
    assert starts[starts > 0].tolist() == list(range(1, len(starts[starts > 0]) + 1))
    pad = seg == 0
    assert not packed.loss_mask[row, pad].any() and not packed.tokens[row, pad].any()


def test_pack_refuses_a_row_it_cannot_pack():
  batch = _layout_batch([2, 3], [4, 1], 4, 4)
  holey = batch.replace(segments=batch.segments.copy())
  holey.segments[1, 2] = 0  # a hole inside the prompt
  with pytest.raises(ValueError, match="row 1's real tokens are not one contiguous run"):
    packing.pack(holey, 1)
  with pytest.raises(ValueError, match="this batch is packed"):
    packing.pack(batch.replace(segments=batch.segments * 2), 1)
  on_padding = batch.replace(loss_mask=batch.loss_mask.copy())
  on_padding.loss_mask[1, 6] = True  # row 1 holds columns 1-4: column 6 is padding
  with pytest.raises(ValueError, match="row 1 has loss tokens on padding"):
    packing.pack(on_padding, 1)
  first = batch.replace(loss_mask=batch.loss_mask.copy())
  first.loss_mask[0, 2] = True  # row 0's first token (columns 2-7), a prompt token
  with pytest.raises(ValueError, match="row 0's first token carries the loss"):
    packing.pack(first, 1)
  with pytest.raises(ValueError, match=r"advantages has shape \(2,\): pack takes one per token"):
    packing.pack(batch.replace(advantages=np.ones(2, np.float32)), 1)


def test_packed_log_probs_equal_the_padded_ones_at_every_real_token():
  batch = _batch([6, 1, 3, 5, 2, 6, 4, 1], [10, 1, 4, 7, 0, 10, 2, 3], seed=2)
  packed = packing.pack(batch, 1)
  assert packed.rows < batch.rows
  fn = jax.jit(lambda b: losses.token_logprobs(CONFIG, PARAMS, b.tokens, b.positions, b.segments))
  (want, want_ent), (got, got_ent) = fn(batch), fn(packed)
  # The old log-probs (the model's plus noise) tell the response tokens apart.
  order = lambda b, x: np.asarray(x)[b.loss_mask][np.argsort(b.old_logprobs[b.loss_mask])]
  assert len(set(batch.old_logprobs[batch.loss_mask])) == batch.loss_mask.sum()
  np.testing.assert_allclose(order(packed, got), order(batch, want), atol=1e-6)
  np.testing.assert_allclose(order(packed, got_ent), order(batch, want_ent), atol=1e-6)


def _mesh(data, fsdp, tensor):
  return sharding.make_mesh(data, fsdp, tensor, devices=jax.devices()[: data * fsdp * tensor])


# seq-mean-token-sum is token-mean's total over seq-mean-token-mean's count: both pieces
# are covered by the other two.
@pytest.mark.parametrize(
  "aggregation,query_block",
  [("token-mean", None), ("seq-mean-token-mean", None), ("token-mean", 4)],
)
def test_a_packed_step_is_the_padded_step(aggregation, query_block, monkeypatch):
  """The same update on 8 fake devices in micro-batches: loss, metrics, gradient norm and
  params after the step within float32 round-off; the token count exactly. With queries
  in blocks of 4 (`layers.QUERY_BLOCK`: no block above the diagonal computed) too."""
  from ada_jax.models import layers

  batch = _batch([6, 1, 3, 5, 2, 6, 4, 1] * 2, [10, 1, 4, 7, 0, 10, 2, 3] * 2, seed=4)
  config = train.TrainConfig(
    loss=losses.LossConfig(aggregation=aggregation, entropy_coeff=0.01),
    # Adam's eps well above round-off: an update then moves with its gradient, not with
    # the sign of a gradient that is 0 up to round-off (the first step's lr · g / |g|).
    optim=train.OptimConfig(learning_rate=1e-3, warmup_steps=0, eps=1e-3),
    num_minibatches=1,
    micro_batch_size=4,
  )
  mesh = _mesh(2, 2, 2)
  packed = packing.pack(batch, 4)
  assert packed.rows == 12  # 130 tokens need 9 rows of 16 positions: 12, in units of 4
  out = {}
  for name, b in (("padded", batch), ("packed", packed)):
    if name == "packed" and query_block:
      monkeypatch.setattr(layers, "QUERY_BLOCK", query_block)
    state = train.init_train_state(CONFIG, config, PARAMS, mesh)
    grads = jax.jit(
      lambda p, b: train.loss_and_grads(p, b, model_config=CONFIG, config=config, mesh=mesh)[1]
    )(state.params, sharding.place_batch(b, mesh))
    state, metrics = train.make_train_step(CONFIG, config, mesh)(
      state, sharding.place_batch(b, mesh)
    )
    out[name] = jax.device_get((metrics, state.params, grads))
  (m_pad, p_pad, g_pad), (m_pack, p_pack, g_pack) = out["padded"], out["packed"]
  largest = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(g_pad))
  for a, b in zip(jax.tree.leaves(g_pad), jax.tree.leaves(g_pack), strict=True):
    assert float(np.max(np.abs(a - b))) <= 1e-5 * largest
  assert m_pack["tokens"] == m_pad["tokens"] == batch.loss_mask.sum()
  for key in ("loss", "grad_norm", "entropy", "clip_frac", "approx_kl", "pg_loss_token_mean"):
    assert m_pack[key] == pytest.approx(m_pad[key], rel=1e-5, abs=1e-6), key
  diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), p_pad, p_pack)
  assert max(jax.tree.leaves(diffs)) <= 1e-6
  moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), p_pad, PARAMS)
  assert max(jax.tree.leaves(moved)) > 1e-4  # the step did move the params


def test_update_policy_packs_each_mini_batch_and_reports_positions():
  """Two mini-batches, each packed on its own (a mini-batch's sequences stay together):
  the update equals the padded mini-batches' updates one after another."""
  batch = _batch([6, 1, 3, 5, 2, 6, 4, 1] * 2, [10, 1, 4, 7, 0, 10, 2, 3] * 2, seed=5)
  config = train.TrainConfig(
    # eps well above round-off, as in the step test above: an update follows its gradient,
    # not the sign of a coordinate that is 0 up to round-off (1.2e-6 apart on an AMD EPYC).
    optim=train.OptimConfig(learning_rate=1e-3, warmup_steps=0, eps=1e-3),
    num_minibatches=2,
    micro_batch_size=2,
  )
  mesh = _mesh(2, 1, 2)
  minis = update.minibatches(batch, config, mesh)
  for j, mini in enumerate(minis):
    assert mini.loss_mask.sum() == batch.loss_mask[8 * j : 8 * j + 8].sum()
    assert mini.rows in packing.row_counts(8, 2) and mini.rows < 8
  step = train.make_train_step(CONFIG, config, mesh)
  state = train.init_train_state(CONFIG, config, PARAMS, mesh)
  state, metrics = update.update_policy(step, state, batch, config=config, mesh=mesh)
  assert metrics["positions"] == sum(m.tokens.size for m in minis) < batch.tokens.size
  assert metrics["tokens"] == batch.loss_mask.sum()
  ref = train.init_train_state(CONFIG, config, PARAMS, mesh)
  for j in range(2):
    mini = jax.tree.map(lambda x, j=j: x[8 * j : 8 * j + 8], batch)
    ref, _ = step(ref, sharding.place_batch(mini, mesh))
  diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), *jax.device_get((state, ref)))
  assert max(jax.tree.leaves(diffs.params)) <= 1e-6


@pytest.mark.parametrize("micro", [0, 16])
def test_a_mini_batch_of_one_micro_batch_packs_in_units_of_the_devices(micro):
  """A mini-batch of one micro-batch (`micro_batch_size` 0, or all its 16 rows): the
  packed row count is a multiple of data × fsdp, not of the mini-batch, so its sequences
  do take fewer rows, and the step takes them as one micro-batch."""
  batch = _batch([6, 1, 3, 5, 2, 6, 4, 1] * 2, [10, 1, 4, 7, 0, 10, 2, 3] * 2, seed=6)
  mesh = _mesh(2, 1, 2)
  config = train.TrainConfig(num_minibatches=1, micro_batch_size=micro)
  (mini,) = update.minibatches(batch, config, mesh)
  assert mini.rows == 10  # 130 tokens in rows of 16: 9 rows, in units of 2
  step = train.make_train_step(CONFIG, config, mesh)
  state = train.init_train_state(CONFIG, config, PARAMS, mesh)
  _, metrics = update.update_policy(step, state, batch, config=config, mesh=mesh)
  assert metrics["positions"] == 10 * 16 and metrics["tokens"] == batch.loss_mask.sum()
