"""One RL step's policy update: the selected responses laid out as a fixed-shape batch
(`make_train_batch`), the RL batch cut into k mini-batches, each packed into as few rows
as hold its sequences (`packing.pack`), and k optimizer updates of the jitted train step
(`train.make_train_step`), metrics fetched to the host once.

k is `TrainConfig.num_minibatches`, which a run derives as verl does from the mini-batch
size in prompts (`train.mini_batch_prompts` × n rows; released: 128 × 4 of 2,048 rows, 4
updates; Est's 4,096 rows, 8); mini-batches are consecutive rows, which keeps each
prompt's group together, like verl's `data.split`; 1 epoch. Every process holds the
whole RL batch (the rollouts are identical everywhere) and passes the mesh only the rows
its devices hold: this module is the one place that knows both the cut and those rows
(`minibatches`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding as sharding_lib
from ada_jax.models.decoder import ModelConfig, Params
from ada_jax.models.tokenizer import pad_left
from ada_jax.rl import packing
from ada_jax.rl import train as train_lib
from ada_jax.rl.pools import StepResult
from ada_jax.rl.train import TrainBatch, TrainConfig, TrainState, check_batch_layout


def minibatches(batch: TrainBatch, config: TrainConfig, mesh: Mesh) -> list[TrainBatch]:
  """This process's rows of each of the k = `config.num_minibatches` consecutive
  mini-batches of a batch that every process holds whole, each packed (`packing.pack`):
  mini-batch j is the sequences of rows [j·b, (j+1)·b) (b = rows / k), packed into S_j
  rows, a multiple of a micro-batch (`config.micro_batch_size`, or data × fsdp when the
  mini-batch is one micro-batch: size 0 or all its rows), of which this process keeps the
  ones its devices hold under `sharding.batch_sharding` (`sharding.local_rows`), as
  `sharding.place_batch` expects. With one process each mini-batch is whole.

  Args:
    batch: the RL batch, one sequence a row (`make_train_batch`), host arrays.
    config: the training configuration (k and the micro-batch).
    mesh: the training mesh.

  Returns:
    k `TrainBatch`es of `S_j / process_count` rows per leaf.

  Raises:
    ValueError: R is not divisible by k, or a mini-batch by the micro-batch.
  """
  num = config.num_minibatches
  rows = batch.rows
  if rows % num:
    raise ValueError(f"{rows} rows are not divisible into {num} mini-batches")
  size = rows // num
  micro = config.micro_batch_size
  # A mini-batch of one micro-batch (micro_batch_size 0, or all of its rows) packs in
  # units of the devices: it stays one micro-batch, of fewer rows.
  unit = micro if 0 < micro < size else sharding_lib.data_parallel_size(mesh)
  out = []
  for i in range(num):
    mini = packing.pack(
      jax.tree.map(lambda x, i=i: np.asarray(x)[i * size : (i + 1) * size], batch), unit
    )
    if jax.process_count() > 1:
      own = sharding_lib.local_rows(mini.rows, mesh)
      mini = jax.tree.map(lambda x, own=own: x[own], mini)
    out.append(mini)
  return out


def logprob_step(
  params: Params, batch: TrainBatch, *, model_config: ModelConfig, config: TrainConfig, mesh: Mesh
) -> jax.Array:
  """The trainer's log-probs of a placed mini-batch: float32[b, L], zero outside the loss
  mask (as the sampler's), rows over ('data', 'fsdp') as the batch's, in micro-batches of
  `config.micro_batch_size` rows (`make_logprob_step` jits it)."""
  rows = batch.tokens.shape[0]
  num = rows // min(config.micro_batch_size or rows, rows)
  stacked = [
    train_lib._micro_batches(x, num, mesh) for x in (batch.tokens, batch.positions, batch.segments)
  ]
  params = sharding_lib.gather_embedding(params, mesh)
  logprobs_of = train_lib.logprobs_fn(model_config, config, mesh, batch.tokens.shape[1])

  def one(mb):
    return logprobs_of(params, *mb)[0]

  out = jax.lax.map(one, stacked)  # [num, b / num, L]: micro-batch j = rows j, j + num, ...
  out = out.swapaxes(0, 1).reshape(rows, -1)
  out = jnp.where(batch.loss_mask, out, 0.0)
  return jax.lax.with_sharding_constraint(out, sharding_lib.batch_sharding(mesh))


def make_logprob_step(
  model_config: ModelConfig, config: TrainConfig, mesh: Mesh
) -> Callable[[Params, TrainBatch], jax.Array]:
  """`logprob_step` jitted over `mesh`: `(params, batch) -> float32[b, L]`.
  `train.old_logprobs='recompute'` puts them in place of the sampler's, as verl recomputes
  old log-probs with the actor before its update (released; `compute_log_prob`)."""
  return jax.jit(
    functools.partial(logprob_step, model_config=model_config, config=config, mesh=mesh)
  )


def update_policy(
  step_fn: Callable,
  state: TrainState,
  batch: TrainBatch,
  *,
  config: TrainConfig,
  mesh: Mesh,
  logprob_fn: Callable[[Params, TrainBatch], jax.Array] | None = None,
) -> tuple[TrainState, dict[str, float]]:
  """One RL step's policy update: k = `num_minibatches` optimizer updates, 1 epoch.

  Args:
    step_fn: from `train.make_train_step`.
    state: the current state (donated: use the returned one).
    batch: the whole RL batch, as host (numpy) arrays, identical on every process.
    config: the training configuration.
    mesh: the mesh.
    logprob_fn: from `make_logprob_step`; needed by `config.old_logprobs='recompute'`,
      which replaces every mini-batch's old log-probs by it before the first update.

  Returns:
    (new state, metrics averaged over the k updates, 'tokens' summed, 'positions' (the
    token positions the packed mini-batches computed, padding included), and
    'old_logprob_gap': mean |log π_trainer − log π_old| over the first mini-batch's
    response tokens before any update, i.e. the sampler–trainer mismatch; 0 up to
    rounding under 'recompute'), fetched to the host once.

  Raises:
    ValueError: the batch does not split into mini- and micro-batches over the mesh, or
      'recompute' without `logprob_fn`.
  """
  check_batch_layout(batch.rows, config, mesh)
  minis = minibatches(batch, config, mesh)
  positions = sum(m.tokens.size for m in minis) * jax.process_count()
  minis = [sharding_lib.place_batch(mini, mesh, "mini-batch") for mini in minis]
  if config.old_logprobs == "recompute":
    if logprob_fn is None:
      raise ValueError("TrainConfig.old_logprobs='recompute' needs update_policy's logprob_fn")
    # All of them under the step's params, before the first update moves (and donates) them.
    minis = [m.replace(old_logprobs=logprob_fn(state.params, m)) for m in minis]
  history = []
  for mini in minis:
    state, metrics = step_fn(state, mini)
    history.append(metrics)
  history = jax.device_get(history)
  out = {name: float(np.mean([m[name] for m in history])) for name in history[0]}
  out["tokens"] = float(np.sum([m["tokens"] for m in history]))
  out["positions"] = float(positions)
  out["old_logprob_gap"] = float(history[0]["abs_log_ratio"])
  return state, out


def make_train_batch(
  result: StepResult,
  responses: dict[str, np.ndarray],
  prompt_tokens: Sequence[np.ndarray],
  *,
  rows: int,
  buckets: Sequence[int],
  pad_id: int = 0,
) -> TrainBatch:
  """Lays the selected responses out as a fixed-shape training batch.

  Row i: its prompt left-padded to the bucket Lp (`tokenizer.pad_left`), then its response
  (Lr tokens, mask after the stop token); rows beyond the selection are padding with an
  empty loss mask (they add nothing to a token mean). Old log-probs sit at the response
  tokens' columns, as `losses.token_logprobs` aligns them. `update_policy` packs each
  mini-batch of these rows (`packing.pack`) before it trains on it.

  Args:
    result: the controller's selection (handles: row ids, indexing `responses`).
    responses: the step's response store by row id (`SlotEngine.responses`):
      `tokens int32[N, Lr]`, `logprobs float32[N, Lr]`, `mask bool[N, Lr]`.
    prompt_tokens: token ids of the step's prompts (indexed by `result.prompt_index`).
    rows: the batch's fixed row count (>= number selected).
    buckets: allowed prompt lengths.
    pad_id: id written into padding (masked out).

  Returns:
    A `TrainBatch` of numpy arrays, `[rows, Lp + Lr]`.

  Raises:
    ValueError: more responses selected than `rows`, or a prompt longer than every bucket.
  """
  sel = np.asarray(result.handles, np.int64)
  if len(sel) > rows:
    raise ValueError(f"{len(sel)} responses selected for a {rows}-row batch")
  lr = responses["tokens"].shape[1]
  selected = [prompt_tokens[p] for p in result.prompt_index]
  # No selection (dapo without a mixed group) gives an all-padding batch of the smallest
  # bucket, padded to `rows` below like any short selection.
  prompt_ids, prompt_mask = pad_left(selected or [[pad_id]], pad_id, buckets=buckets)
  lp = prompt_ids.shape[1]
  tokens = np.full((rows, lp + lr), pad_id, np.int32)
  attention = np.zeros((rows, lp + lr), bool)
  loss_mask = np.zeros((rows, lp + lr), bool)
  old = np.zeros((rows, lp + lr), np.float32)
  adv = np.zeros((rows, lp + lr), np.float32)
  n = len(sel)
  if n:
    tokens[:n, :lp], attention[:n, :lp] = prompt_ids, prompt_mask
    tokens[:n, lp:] = responses["tokens"][sel]
    attention[:n, lp:] = loss_mask[:n, lp:] = responses["mask"][sel]
    old[:n, lp:] = responses["logprobs"][sel]
    adv[:n] = np.where(attention[:n], np.asarray(result.advantages, np.float32)[:, None], 0.0)
  positions = model_lib.positions_from_mask(attention)
  return TrainBatch(
    tokens=tokens,
    positions=positions,
    segments=attention.astype(np.int32),
    loss_mask=loss_mask,
    advantages=adv,
    old_logprobs=old,
  )
