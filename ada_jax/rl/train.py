"""Policy update: train state, AdamW, and the sharded policy-gradient step (docs/design.md
"Algorithm", "Distribution").

`train_step` is a pure function doing ONE optimizer update on one mini-batch: the
mini-batch is cut into micro-batches whose gradients are accumulated by `lax.scan` inside
the jit, every micro-batch dividing its loss by the same whole-mini-batch normaliser (so
`token-mean` is over all valid tokens of the global mini-batch, whatever the micro-batch
size or device count). `make_train_step` jits it once over a mesh with explicit in/out
shardings and a donated state; `rl.update.update_policy` drives it for one RL step.

Batch layout on the mesh: rows over ('data', 'fsdp'). Micro-batch j of a mini-batch of b
rows is rows {j, j+m, j+2m, ...} (m micro-batches): reshaping [b] to [b/m, m] keeps each
device's contiguous block of rows local, so every micro-batch is spread evenly over all
devices and the scan moves no data between them. This needs b/m divisible by data × fsdp;
`check_batch_layout` says so before anything compiles.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ada_jax import bounds
from ada_jax.models import flash
from ada_jax.models import sharding as sharding_lib
from ada_jax.models.decoder import ModelConfig, Params
from ada_jax.rl import losses
from ada_jax.rl.losses import LossConfig


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with linear warm-up then a constant rate, after global-norm clipping.

  Defaults: docs/design.md "Algorithm" (the released code's verl settings).

  Attributes:
    learning_rate: peak learning rate.
    warmup_steps: RL steps of linear warm-up: during RL step s < warmup_steps every update
      uses learning_rate · (s + 1) / warmup_steps; 0 = no warm-up.
    b1, b2, eps: Adam moments' decay rates and denominator epsilon.
    weight_decay: decoupled weight decay (AdamW).
    grad_clip: max global gradient norm; 0 disables clipping.
  """

  learning_rate: float = bounds.within("(0, 100]", 1e-6)
  warmup_steps: int = bounds.within("[0, STEPS]", 10)
  b1: float = bounds.within("[0, 1)", 0.9)
  b2: float = bounds.within("[0, 1)", 0.999)
  eps: float = bounds.within("(0, 1]", 1e-8)
  weight_decay: float = bounds.within("[0, 100]", 0.0)
  grad_clip: float = bounds.within("[0, 1e12]", 1.0)

  def __post_init__(self):
    if self.learning_rate <= 0:
      raise ValueError(f"OptimConfig.learning_rate must be > 0, got {self.learning_rate}")
    if self.warmup_steps < 0:
      raise ValueError(f"OptimConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
    if self.grad_clip < 0:
      raise ValueError(f"OptimConfig.grad_clip must be >= 0, got {self.grad_clip}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """How one RL step's batch becomes optimizer updates.

  Attributes:
    loss: the policy loss.
    optim: the optimizer.
    num_minibatches: k, optimizer updates per RL step (the batch is cut into k
      mini-batches of consecutive rows; 1 epoch). In a run it is derived from
      `mini_batch_prompts` (`config.RunConfig`), as verl derives it.
    mini_batch_prompts: a mini-batch in prompts, verl's `ppo_mini_batch_size` (released
      script: 128): it holds `mini_batch_prompts × ada.n` rows (verl: × rollout.n), so
      k = training rows / that, and Est's K·B rows give more updates than B·n (paper
      batch: Est 8, GRPO n = 8 4, Seq 4); 0 = the whole batch, one update. Read by
      `config.RunConfig` only.
    micro_batch_size: rows per micro-batch (gradient accumulation inside the jit);
      0 = the whole mini-batch at once.
    remat: rematerialise each transformer block in the backward pass.
    old_logprobs: the PPO old log-probs: 'sampler' (the rollout's, recorded while sampling:
      same params, the sampler's numerics) or 'recompute' (released: verl recomputes them
      with the trainer before the update, `update.make_logprob_step`).
    temperature: T at which log-probs and entropy are recomputed, softmax(logits / T); it
      must be the sampler's (`sampler.SamplingRule.logprob_temperature`, which
      `config.RunConfig` fills in), else the PPO ratio is off from the start.
    offload_state: while a step samples, the train state (master params, AdamW moments)
      waits in the host's pinned memory (`sharding.to_memory`), leaving the accelerator's to the
      rollout copy and the caches; it comes back before the update. Worth it where
      `python -m ada_jax.plan` says a sampling phase does not fit beside the state (the 3B
      on a v5e-8); costs two host transfers of the state per step.
  """

  loss: LossConfig = LossConfig()
  optim: OptimConfig = OptimConfig()
  num_minibatches: int = 4
  mini_batch_prompts: int = bounds.within("[0, ROWS]", 0)
  micro_batch_size: int = bounds.within("[0, 16 * ROWS]", 0)
  remat: bool = False
  old_logprobs: str = "sampler"
  temperature: float = 1.0
  offload_state: bool = False

  def __post_init__(self):
    if self.num_minibatches < 1:
      raise ValueError(f"TrainConfig.num_minibatches must be >= 1, got {self.num_minibatches}")
    if self.mini_batch_prompts < 0:
      raise ValueError(
        f"TrainConfig.mini_batch_prompts must be >= 0, got {self.mini_batch_prompts}"
      )
    if self.micro_batch_size < 0:
      raise ValueError(f"TrainConfig.micro_batch_size must be >= 0, got {self.micro_batch_size}")
    if self.old_logprobs not in ("sampler", "recompute"):
      raise ValueError(
        f"TrainConfig.old_logprobs={self.old_logprobs!r}: expected 'sampler' or 'recompute'"
      )
    if not self.temperature > 0:
      raise ValueError(f"TrainConfig.temperature must be > 0, got {self.temperature}")


@struct.dataclass
class TrainState:
  """Everything the policy update carries from step to step.

  Attributes:
    step: `int32[]`, optimizer updates done so far.
    params: the policy parameters (tree of `model.init_params`, e.g.
      `params['embed']` is `param_dtype[V, D]`).
    opt_state: optax state of `make_optimizer` (Adam moments shaped like params, counts).
    ref_params: frozen reference parameters for the KL term, or None.
  """

  step: jax.Array
  params: Params
  opt_state: optax.OptState
  ref_params: Params | None = None


@struct.dataclass
class TrainBatch:
  """One (mini-)batch of sequences (prompt then response), one or several packed in a row.

  `update.make_train_batch` lays one sequence in a row (its prompt left-padded to the
  bucket, its response right-padded); `packing.pack` packs a mini-batch's sequences
  one after another into as few rows as hold them, which computes the same update
  (`layers.causal_attend` keeps each sequence to its own keys; the loss aggregates per
  sequence id).

  Attributes:
    tokens: `int32[B, L]`, each sequence's prompt then response, padding elsewhere.
    positions: `int32[B, L]` RoPE positions, from 0 at each sequence's first token.
    segments: `int32[B, L]` sequence ids: 1, 2, ... for the row's sequences in order, 0
      at padding.
    loss_mask: `bool[B, L]`, True at response tokens that carry the loss.
    advantages: `float32[B, L]`, each token's sequence's advantage (0 at padding).
    old_logprobs: `float32[B, L]`, log-prob of `tokens[:, t]` under the sampling policy
      (0 outside the response), aligned as `losses.token_logprobs`.
    ref_logprobs: `float32[B, L]` under the reference policy, or None (then the KL term,
      when enabled, is computed from `TrainState.ref_params`).
  """

  tokens: jax.Array
  positions: jax.Array
  segments: jax.Array
  loss_mask: jax.Array
  advantages: jax.Array
  old_logprobs: jax.Array
  ref_logprobs: jax.Array | None = None

  @property
  def rows(self) -> int:
    return self.tokens.shape[0]


# ----------------------------------------------------------------------------- optimizer


def learning_rate_schedule(config: OptimConfig, updates_per_step: int = 1) -> optax.Schedule:
  """Learning rate as a function of the optimizer update count.

  Warm-up is counted in RL steps of `updates_per_step` updates each, so the k updates of
  one RL step share one rate, and the first update already moves (rate lr / warmup_steps).
  """
  lr, warmup = config.learning_rate, config.warmup_steps
  if warmup == 0:
    return optax.constant_schedule(lr)

  def schedule(count):
    rl_step = count // updates_per_step
    return lr * jnp.minimum(1.0, (rl_step + 1).astype(jnp.float32) / warmup)

  return schedule


def make_optimizer(config: OptimConfig, updates_per_step: int = 1) -> optax.GradientTransformation:
  """Global-norm clip (if `grad_clip` > 0) then AdamW on `learning_rate_schedule`."""
  adamw = optax.adamw(
    learning_rate_schedule(config, updates_per_step),
    b1=config.b1,
    b2=config.b2,
    eps=config.eps,
    weight_decay=config.weight_decay,
  )
  if config.grad_clip:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)
  return adamw


def _optimizer(config: TrainConfig) -> optax.GradientTransformation:
  return make_optimizer(config.optim, config.num_minibatches)


# ----------------------------------------------------------------------------- state


def abstract_state(
  model_config: ModelConfig, config: TrainConfig, mesh: Mesh, *, with_ref: bool = False
) -> TrainState:
  """`TrainState` of `jax.ShapeDtypeStruct`s carrying their shardings (a restore target):
  Adam moments on their params' shardings, the rest replicated."""
  optimizer = _optimizer(config)
  params = sharding_lib.abstract_params(model_config, mesh)
  rep = sharding_lib.replicated(mesh)
  on = lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
  opt = optax.tree_map_params(
    optimizer,
    lambda s, p: on(s, p.sharding),
    jax.eval_shape(optimizer.init, params),
    params,
    transform_non_params=lambda s: on(s, rep),
  )
  step = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
  return TrainState(
    step=step, params=params, opt_state=opt, ref_params=params if with_ref else None
  )


def state_shardings(
  model_config: ModelConfig, config: TrainConfig, mesh: Mesh, *, with_ref: bool = False
) -> TrainState:
  """`NamedSharding` of every `TrainState` leaf (`abstract_state`'s)."""
  state = abstract_state(model_config, config, mesh, with_ref=with_ref)
  return jax.tree.map(lambda s: s.sharding, state)


def _placed_copy(tree, shardings):
  """The tree on `shardings` in buffers of its own. The jitted step donates the state,
  which must not delete the caller's arrays (nor hold one buffer twice when ref_params is
  params); `device_put(may_alias=False)` alone still hands back the caller's buffer for a
  replicated leaf on some meshes (JAX 0.10.2: a 2 x 1 x 2 mesh over a single-device
  array), so a leaf that shares one is copied."""

  def own(src, dst):
    if not isinstance(src, jax.Array):
      return dst
    held = {s.data.unsafe_buffer_pointer() for s in src.addressable_shards}
    if any(s.data.unsafe_buffer_pointer() in held for s in dst.addressable_shards):
      return jnp.copy(dst)
    return dst

  return jax.tree.map(own, tree, jax.device_put(tree, shardings, may_alias=False))


def init_train_state(
  model_config: ModelConfig,
  config: TrainConfig,
  params: Params,
  mesh: Mesh,
  *,
  ref_params: Params | None = None,
) -> TrainState:
  """A fresh state (step 0, zero Adam moments) with every leaf on its sharding.

  Args:
    model_config: the architecture.
    config: training configuration (its optimizer).
    params: initial policy params (host or device arrays, any placement; copied).
    mesh: the mesh.
    ref_params: frozen reference params for the KL term, or None.
  """
  shardings = state_shardings(model_config, config, mesh, with_ref=ref_params is not None)
  params = _placed_copy(params, shardings.params)
  if ref_params is not None:
    ref_params = _placed_copy(ref_params, shardings.ref_params)
  opt_state = jax.jit(_optimizer(config).init, out_shardings=shardings.opt_state)(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
  return TrainState(step=step, params=params, opt_state=opt_state, ref_params=ref_params)


# ----------------------------------------------------------------------------- the step


def check_batch_layout(rows: int, config: TrainConfig, mesh: Mesh) -> tuple[int, int]:
  """Checks that an RL batch of `rows` splits into mini- and micro-batches over the mesh.

  Call it on the host before the first step: a bad layout then fails with a message naming
  the field instead of inside a compile.

  Returns:
    (mini-batch rows, micro-batches per mini-batch).

  Raises:
    ValueError: rows not divisible by `num_minibatches`, a mini-batch not divisible by
      `micro_batch_size`, or a micro-batch not divisible by data × fsdp.
  """
  k = config.num_minibatches
  if rows % k:
    raise ValueError(
      f"the RL batch ({rows} rows) is not divisible by TrainConfig.num_minibatches ({k})"
    )
  mini = rows // k
  micro = config.micro_batch_size or mini
  if mini % micro:
    raise ValueError(
      f"a mini-batch ({mini} rows = {rows} / num_minibatches {k}) is not "
      f"divisible by TrainConfig.micro_batch_size ({micro})"
    )
  sharding_lib.check_rows(
    micro, mesh, "a micro-batch (TrainConfig.micro_batch_size, or the mini-batch when it is 0)"
  )
  return mini, mini // micro


def _micro_batches(x: jax.Array, num: int, mesh: Mesh | None) -> jax.Array:
  """[b, ...] -> [num, b / num, ...], micro-batch j = rows j, j + num, ... (see module doc)."""
  y = x.reshape(x.shape[0] // num, num, *x.shape[1:]).swapaxes(0, 1)
  if mesh is None:
    return y
  spec = P(None, sharding_lib.batch_sharding(mesh).spec[0])
  return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec))


def logprobs_fn(model_config: ModelConfig, config: TrainConfig, mesh: Mesh | None, length: int):
  """`losses.token_logprobs` as the trainer takes it on rows of `length` tokens (the train
  step and `update.logprob_step` alike): its temperature, the platform's attention."""
  return functools.partial(
    losses.token_logprobs,
    model_config,
    temperature=config.temperature,
    self_attend=flash.self_attend(model_config, mesh, length),
  )


def loss_and_grads(
  params: Params,
  batch: TrainBatch,
  *,
  model_config: ModelConfig,
  config: TrainConfig,
  mesh: Mesh | None = None,
  ref_params: Params | None = None,
) -> tuple[jax.Array, Params, dict[str, jax.Array]]:
  """The mini-batch loss and its gradient, accumulated over micro-batches by `lax.scan`.

  Args:
    params: the policy parameters.
    batch: the mini-batch, `[b, L]` rows (b / micro-batches divisible by data × fsdp).
    model_config: the architecture (static).
    config: loss, micro-batch size, remat (static).
    mesh: when given, micro-batches are constrained to stay spread over the data axes.
    ref_params: reference params for the KL term when the batch has no `ref_logprobs`.

  Returns:
    (loss `f32[]`, grads (float32, the params tree), metric sums of `losses.policy_loss`
    over the whole mini-batch).

  Raises:
    ValueError: rows not divisible by the micro-batch size, or the KL term is enabled but
      neither reference log-probs nor params are given.
  """
  loss_cfg = config.loss
  rows = batch.tokens.shape[0]
  # A packed mini-batch can hold fewer rows than a micro-batch: it is then one.
  micro = min(config.micro_batch_size or rows, rows)
  if rows % micro:  # shapes are static: this fires while tracing, before any compile
    raise ValueError(
      f"a mini-batch of {rows} rows is not divisible by TrainConfig.micro_batch_size ({micro})"
    )
  num_micro = rows // micro
  # Computed over the whole mini-batch, so that micro-batches and devices share it.
  normalizer = losses.loss_normalizer(batch.loss_mask, loss_cfg.aggregation, batch.segments)
  need_ref = loss_cfg.kl_coeff > 0 and batch.ref_logprobs is None
  if need_ref and ref_params is None:
    raise ValueError(
      "LossConfig.kl_coeff > 0 needs TrainBatch.ref_logprobs or TrainState.ref_params"
    )

  logprobs_of = logprobs_fn(model_config, config, mesh, batch.tokens.shape[1])

  def micro_loss(params, mb: TrainBatch):
    if mesh is not None:
      params = sharding_lib.gather_embedding(params, mesh)
    rows = (mb.tokens, mb.positions, mb.segments)
    logprobs, entropy = logprobs_of(params, *rows, remat=config.remat)
    ref = mb.ref_logprobs
    if need_ref:
      ref_p = ref_params if mesh is None else sharding_lib.gather_embedding(ref_params, mesh)
      ref, _ = logprobs_of(ref_p, *rows)
      ref = jax.lax.stop_gradient(ref)
    return losses.policy_loss(
      logprobs,
      mb.old_logprobs,
      mb.advantages,
      mb.loss_mask,
      config=loss_cfg,
      normalizer=normalizer,
      segments=mb.segments,
      entropy=entropy,
      ref_logprobs=ref,
    )

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
  stacked = jax.tree.map(lambda x: _micro_batches(x, num_micro, mesh), batch)
  first = jax.tree.map(lambda x: x[0], stacked)
  sums_shape = jax.eval_shape(lambda: grad_fn(params, first)[0][1])

  def accumulate(carry, mb):
    grads, loss, sums = carry
    (mb_loss, mb_sums), mb_grads = grad_fn(params, mb)
    grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads, mb_grads)
    return (grads, loss + mb_loss, jax.tree.map(jnp.add, sums, mb_sums)), None

  init = (
    jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
    jnp.zeros((), jnp.float32),
    jax.tree.map(jnp.zeros_like, sums_shape),
  )
  (grads, loss, sums), _ = jax.lax.scan(accumulate, init, stacked)
  return loss, grads, sums


def train_step(
  state: TrainState,
  batch: TrainBatch,
  *,
  model_config: ModelConfig,
  config: TrainConfig,
  mesh: Mesh | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update on one mini-batch (pure; jit it with `make_train_step`).

  Args:
    state: the current state.
    batch: the mini-batch, `[b, L]` rows (b / micro-batches divisible by data × fsdp).
    model_config: the architecture (static).
    config: loss, optimizer, micro-batch size, remat (static).
    mesh: when given, micro-batches are constrained to stay spread over the data axes.

  Returns:
    (new state, metrics) where metrics are `f32[]` scalars: 'loss' (the mini-batch loss,
    all terms), 'grad_norm' (global, before clipping), 'learning_rate', 'clip_frac',
    'dual_clip_frac', 'approx_kl', 'entropy', 'pg_loss_token_mean', 'kl' (when enabled)
    — token means over the global mini-batch — and 'tokens' (its valid response tokens).
  """
  loss, grads, sums = loss_and_grads(
    state.params,
    batch,
    model_config=model_config,
    config=config,
    mesh=mesh,
    ref_params=state.ref_params,
  )
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
  updates, opt_state = _optimizer(config).update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  schedule = learning_rate_schedule(config.optim, config.num_minibatches)
  metrics = losses.finalize_sums(sums)
  metrics.update(
    loss=loss,
    grad_norm=optax.global_norm(grads),
    learning_rate=jnp.asarray(schedule(state.step), jnp.float32),
  )
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def make_train_step(
  model_config: ModelConfig, config: TrainConfig, mesh: Mesh, *, with_ref: bool = False
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, dict]]:
  """`train_step` jitted once over `mesh`: state in/out on `state_shardings` (donated),
  batch rows over ('data', 'fsdp'), metrics replicated.

  The returned function compiles once per mini-batch shape; call `check_batch_layout`
  first. After it, the old state's buffers are donated: use only the returned state.
  """
  shardings = state_shardings(model_config, config, mesh, with_ref=with_ref)
  step = functools.partial(train_step, model_config=model_config, config=config, mesh=mesh)
  return jax.jit(
    step,
    in_shardings=(shardings, sharding_lib.batch_sharding(mesh)),
    out_shardings=(shardings, sharding_lib.replicated(mesh)),
    donate_argnums=0,
  )
