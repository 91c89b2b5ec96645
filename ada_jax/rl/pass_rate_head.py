"""The learned pass-rate estimator of Reinforce-Ada-Est: a small head on the policy's hidden
state at a prompt's last token.

The paper's Est takes p̂_x "from an estimator: a small value network, or Ada-EMA"
(arXiv 2510.04996, §3.3). The EMA (`estimate.est_pass_rates`) knows nothing about a prompt
until it has been sampled; this head reads the policy's own representation of the prompt,
so a prompt seen for the first time gets an estimate of its own.

* Input: float32[P, d_model], the final-normed hidden state at each prompt's last token,
  from the rollout pool's own prefill (`rollout.queue.SlotDriver.prefill_all`): no
  second forward pass. Gradients never flow into the policy: the head trains on host
  copies of those features (stop-gradient by construction).
* Head: one hidden layer of `WIDTH` GELU units, then a logit; p = sigmoid(logit). The
  output weights start at zero and the output bias at logit(a/(a + b)), so an untrained
  head predicts the Est prior's mean for every prompt.
* Loss: binary cross-entropy per response, L = −Σ_x [n_pos log p_x + (n_tot − n_pos)
  log(1 − p_x)] / Σ_x n_tot, on the rewards the step observed; `train_head` takes
  `est.head_steps` Adam steps (optax) on it each RL step.
* State: parameters and Adam moments live in the Est state dict as `head_*` numpy
  entries (float32, replicated on every process: the head is tiny), so they are
  checkpointed and restored exactly with the rest of the run state.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

WIDTH = 64  # hidden units; the head is a probe, not a second model
STATE_PREFIX = "head_"
_PARAM_NAMES = ("w1", "b1", "w2", "b2")

Params = dict[str, np.ndarray]


def init_params(d_model: int, prior_p: float, seed: int = 0) -> Params:
  """Fresh head parameters (float32): w1 [d, WIDTH] ~ N(0, 1/d), b1 [WIDTH] = 0,
  w2 [WIDTH] = 0, b2 [1] = logit(prior_p), so every prediction starts at `prior_p`."""
  rng = np.random.default_rng(seed)
  return {
    "w1": (rng.standard_normal((d_model, WIDTH)) / np.sqrt(d_model)).astype(np.float32),
    "b1": np.zeros(WIDTH, np.float32),
    "w2": np.zeros(WIDTH, np.float32),
    "b2": np.full(1, np.log(prior_p / (1 - prior_p)), np.float32),
  }


def logits(params: Mapping[str, jax.Array], features: jax.Array) -> jax.Array:
  """float32[P] logits of the pass rate for features float32[P, d]."""
  hidden = jax.nn.gelu(features @ params["w1"] + params["b1"])
  return hidden @ params["w2"] + params["b2"][0]


def bce_loss(
  params: Mapping[str, jax.Array], features: jax.Array, n_pos: jax.Array, n_tot: jax.Array
) -> jax.Array:
  """Per-response binary cross-entropy (nats) of the head on one step's outcomes.

  Args:
    params: head parameters.
    features: float32[P, d] prompt hidden states.
    n_pos: float[P] correct responses per prompt.
    n_tot: float[P] responses per prompt (a prompt with 0 adds nothing).

  Returns:
    float32 scalar: −Σ [n_pos log p + (n_tot − n_pos) log(1 − p)] / Σ n_tot.
  """
  z = logits(params, features)
  nll = -(n_pos * jax.nn.log_sigmoid(z) + (n_tot - n_pos) * jax.nn.log_sigmoid(-z))
  return nll.sum() / jnp.maximum(n_tot.sum(), 1.0)


def predict(params: Mapping[str, np.ndarray], features: np.ndarray) -> np.ndarray:
  """float64[P] predicted pass rates in (0, 1) for features float32[P, d]."""
  z = _logits_jit(params, jnp.asarray(features, jnp.float32))
  return np.asarray(jax.nn.sigmoid(z), np.float64)


_logits_jit = jax.jit(logits)


@functools.lru_cache(maxsize=8)
def _optimizer(lr: float) -> optax.GradientTransformation:
  return optax.adam(lr)


@functools.lru_cache(maxsize=8)
def _train_fn(lr: float, steps: int):
  opt = _optimizer(lr)

  def run(params, opt_state, features, n_pos, n_tot):
    def one(carry, _):
      params, opt_state = carry
      loss, grads = jax.value_and_grad(bce_loss)(params, features, n_pos, n_tot)
      updates, opt_state = opt.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    (params, opt_state), losses = jax.lax.scan(one, (params, opt_state), None, length=steps)
    return params, opt_state, losses

  return jax.jit(run)


@functools.lru_cache(maxsize=8)
def _adam_template(d_model: int, lr: float) -> tuple[list[np.ndarray], jax.tree_util.PyTreeDef]:
  """Adam's fresh state for a head on d_model features: its leaves and structure."""
  leaves, treedef = jax.tree.flatten(_optimizer(lr).init(init_params(d_model, 0.5)))
  return [np.asarray(x) for x in leaves], treedef


def head_state(state: Mapping[str, np.ndarray], d_model: int, config) -> dict[str, np.ndarray]:
  """The `head_*` entries of an Est state, or fresh ones (parameters from `init_params`,
  Adam moments at zero) when the state has none yet.

  Raises:
    ValueError: the stored head was built for another d_model.
  """
  if STATE_PREFIX + "w1" in state:
    if np.shape(state[STATE_PREFIX + "w1"])[0] != d_model:
      raise ValueError(
        f"the Est state's pass-rate head reads d_model={np.shape(state['head_w1'])[0]} "
        f"features, got {d_model}"
      )
    return {k: v for k, v in state.items() if k.startswith(STATE_PREFIX)}
  params = init_params(d_model, config.est.alpha / (config.est.alpha + config.est.beta))
  return _pack(params, _adam_template(d_model, float(config.est.head_lr))[0])


def params_from_state(state: Mapping[str, np.ndarray], d_model: int, config) -> Params:
  """The head parameters held by (or, before the first step, to be added to) `state`."""
  flat = head_state(state, d_model, config)
  return {k: flat[STATE_PREFIX + k] for k in _PARAM_NAMES}


def _pack(params: Mapping[str, np.ndarray], opt_leaves: Sequence) -> dict[str, np.ndarray]:
  # Scalars (Adam's step count) become [1]: a checkpoint stores every entry as an array.
  out = {STATE_PREFIX + k: np.asarray(params[k], np.float32) for k in _PARAM_NAMES}
  for i, leaf in enumerate(opt_leaves):
    out[f"{STATE_PREFIX}adam{i}"] = np.atleast_1d(np.asarray(leaf))
  return out


def train_head(
  flat: Mapping[str, np.ndarray],
  features: np.ndarray,
  n_pos: np.ndarray,
  n_tot: np.ndarray,
  *,
  lr: float,
  steps: int,
) -> tuple[dict[str, np.ndarray], float]:
  """`steps` Adam steps (learning rate `lr`) of `bce_loss` on one step's outcomes.

  Args:
    flat: the `head_*` entries (`head_state`).
    features: float32[P, d]; n_pos, n_tot: float[P] (see `bce_loss`).

  Returns:
    (the new `head_*` entries, the loss before the first step).
  """
  d_model = np.shape(features)[1]
  params = {k: jnp.asarray(flat[STATE_PREFIX + k]) for k in _PARAM_NAMES}
  template, treedef = _adam_template(d_model, float(lr))
  leaves = [
    jnp.asarray(np.reshape(flat[f"{STATE_PREFIX}adam{i}"], t.shape), t.dtype)
    for i, t in enumerate(template)
  ]
  opt_state = jax.tree.unflatten(treedef, leaves)
  args = [jnp.asarray(x, jnp.float32) for x in (features, n_pos, n_tot)]
  if steps == 0:
    return dict(flat), float(bce_loss(params, *args))
  params, opt_state, losses = _train_fn(float(lr), int(steps))(params, opt_state, *args)
  host = lambda t: jax.tree.map(np.asarray, t)
  return _pack(host(params), jax.tree.leaves(host(opt_state))), float(losses[0])


def calibration(
  p_pred: np.ndarray, n_pos: np.ndarray, n_tot: np.ndarray, bins: int = 10
) -> dict[str, float]:
  """Calibration of predicted pass rates against observed responses.

  Args:
    p_pred: float[P] predictions, made before the outcomes were seen.
    n_pos: float[P] correct responses per prompt; n_tot: float[P] responses per prompt.
    bins: equal-width probability bins of the expected calibration error.

  Returns:
    {'brier': mean over responses of (p − y)², 'ece': Σ_bins (responses in bin /
    responses) · |correct fraction − mean p| over the bin's responses}.
  """
  p = np.asarray(p_pred, np.float64)
  pos, tot = np.asarray(n_pos, np.float64), np.asarray(n_tot, np.float64)
  total = max(tot.sum(), 1e-12)
  brier = float(((1 - p) ** 2 * pos + p**2 * (tot - pos)).sum() / total)
  which = np.minimum((p * bins).astype(int), bins - 1)
  ece = 0.0
  for b in range(bins):
    m = which == b
    if tot[m].sum() > 0:
      ece += abs(pos[m].sum() - (p[m] * tot[m]).sum()) / total
  return {"brier": brier, "ece": float(ece)}
