"""Supervised warm start: teacher-forced training on arithmetic before RL (docs/design.md "Data").

RL from a random tiny model learns nothing (every group is all-wrong, so every advantage is
zero). A short supervised phase on `ada_jax.data.arith` problems, in exactly the format the RL
prompts and rewards use (prompt `<bos>12+345=`, response `\\boxed{357}<eos>`), gives a
policy whose pass rates sit between 0 and 1 on the RL prompts. How far to train, and on
which levels, is what `experiments/calibrate_arith.py` measures; `RECOMMENDED` is its
recommendation (`WarmStartConfig`'s own defaults are plain: a fixed step count, no target).

Layout of a batch (the RL batch's layout, so positions match what RL will see): the prompt
is left-padded to Lp, the response right-padded to Lr, T = Lp + Lr. The loss is the
token-mean cross-entropy of the response tokens (including EOS) given everything before
them; prompt tokens are inputs only, never targets.

`sft_loss` and `sft_step` are pure; `warm_start` jits the step and runs it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from ada_jax import bounds
from ada_jax.data import arith
from ada_jax.models import decoder as model_lib
from ada_jax.models.decoder import ModelConfig, Params
from ada_jax.models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
  """The supervised warm start. `RECOMMENDED` is the calibrated setting for the CPU toy.

  Attributes:
    steps: optimizer updates (the most, when `target_accuracy` stops the run earlier).
    batch_size: examples per update.
    learning_rate: peak Adam learning rate.
    warmup_steps: linear warm-up from 0 to the peak; afterwards cosine decay to
      `final_lr_fraction` of the peak at the last step.
    final_lr_fraction: learning rate at the last step, as a fraction of the peak.
    weight_decay: decoupled weight decay (AdamW); 0 is plain Adam.
    grad_clip: max global gradient norm; 0 disables clipping.
    seed: seed of the training problems' draw.
    target_accuracy: stop once the teacher-forced exact-match accuracy of the training
      batches' problems of `target_level`, over the last `check_every` steps, reaches this
      value; 0 = never.
      Every batch is fresh problems and "argmax right at every answer token given the
      right prefix" is exactly "greedy decoding writes the answer", so this is an online
      estimate of greedy accuracy on the task mix. Arithmetic is learnt in sudden
      transitions whose step varies with the seed (calibrate_arith.py measured ±150 steps
      of 64 problems), so a target accuracy, unlike a step count, leaves every seed at the
      same skill.
    target_level: the level `target_accuracy` is measured on; 0 = the whole task mix.
      Seeds also differ in which level they learn first, so a target on the hardest level
      pins down the state that matters for RL better than one on the mix.
    check_every: steps between two checks of `target_accuracy` (one host sync each).
    task: the problems trained on (levels, level mix, operators); the held-out split is
      never trained on.
  """

  steps: int = bounds.within("[1, STEPS]", 600)
  batch_size: int = bounds.within("[1, ROWS]", 64)
  learning_rate: float = bounds.within("(0, 100]", 3e-3)
  warmup_steps: int = bounds.within("[0, STEPS]", 50)
  final_lr_fraction: float = bounds.within("[0, 1]", 0.1)
  weight_decay: float = bounds.within("[0, 100]", 0.0)
  grad_clip: float = bounds.within("[0, 1e12]", 1.0)
  seed: int = bounds.within("[0, 2**63)", 0)
  target_accuracy: float = bounds.within("[0, 1]", 0.0)
  target_level: int = bounds.within("[0, 9]", 0)
  check_every: int = bounds.within("[1, STEPS]", 25)
  task: arith.ArithConfig = arith.ArithConfig(levels=(1, 2, 3), ops=("+", "-"))

  def __post_init__(self):
    for name in ("steps", "batch_size", "check_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"WarmStartConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.learning_rate <= 0:
      raise ValueError(f"WarmStartConfig.learning_rate must be > 0, got {self.learning_rate}")
    if self.warmup_steps < 0:
      raise ValueError(f"WarmStartConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
    if not 0.0 <= self.final_lr_fraction <= 1.0:
      raise ValueError(
        f"WarmStartConfig.final_lr_fraction must be in [0, 1], got {self.final_lr_fraction}"
      )
    if not 0.0 <= self.target_accuracy <= 1.0:
      raise ValueError(
        f"WarmStartConfig.target_accuracy must be in [0, 1], got {self.target_accuracy}"
      )
    if self.target_level and self.target_level not in self.task.levels:
      raise ValueError(
        f"WarmStartConfig.target_level={self.target_level} is not one of task.levels="
        f"{self.task.levels}"
      )
    if self.weight_decay < 0 or self.grad_clip < 0:
      raise ValueError(
        f"WarmStartConfig.weight_decay ({self.weight_decay}) and grad_clip "
        f"({self.grad_clip}) must be >= 0"
      )


# What experiments/calibrate_arith.py recommends for the CPU toy (its JSON has the figures):
# a 3-layer d=96 model trained on 1-3-digit additions (level weights 1:3:2) stops when
# greedy accuracy on 2-digit problems reaches 0.6 (400-500 steps, 1-1.5 min on 2 busy
# cores), which leaves most RL prompts of `arith.TOY_RL_TASK` at pass rates inside (0, 1).
# Addition only: with '-' as well, learning is 2-3x slower (2-digit sampled pass rate
# 5-26% after 600-900 steps), too slow for the toy's budget.
RECOMMENDED = WarmStartConfig(
  steps=1200,
  batch_size=64,
  learning_rate=3e-3,
  target_accuracy=0.6,
  target_level=2,
  task=arith.ArithConfig(levels=(1, 2, 3), level_weights=(1.0, 3.0, 2.0), ops=("+",)),
)


# --------------------------------------------------------------------------- batches


# --------------------------------------------------------------------------- loss and step


def masked_cross_entropy(
  logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Token-mean next-token cross-entropy over the positions marked in `loss_mask`.

  The logits at position t predict token t + 1; target t + 1 counts iff `loss_mask[:, t+1]`.

  Args:
    logits: `float32[B, T, V]`.
    tokens: `int32[B, T]`.
    loss_mask: `bool[B, T]`, True at the tokens to predict (never the first position).

  Returns:
    (loss `float32[]` in nats per target token, metrics: `token_accuracy` (argmax equals
    target, over targets), `sequence_accuracy` (every target of a row right, over rows with
    a target), `targets` (count), `row_correct bool[B]` (the row has targets and all are
    right: what greedy decoding would get right)). An all-False mask gives loss 0.
  """
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  targets = tokens[:, 1:]
  weights = loss_mask[:, 1:].astype(jnp.float32)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  count = weights.sum()
  denom = jnp.maximum(count, 1.0)
  right = (jnp.argmax(logp, -1) == targets).astype(jnp.float32)
  has_target = weights.sum(-1) > 0
  row_right = jnp.all((right > 0) | (weights == 0), axis=-1) & has_target
  metrics = {
    "token_accuracy": (right * weights).sum() / denom,
    "sequence_accuracy": row_right.sum() / jnp.maximum(has_target.sum(), 1),
    "targets": count,
    "row_correct": row_right,
  }
  return (nll * weights).sum() / denom, metrics


def sft_loss(
  config: ModelConfig, params: Params, batch: Mapping[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Teacher-forced loss of one batch from `arith.encode_examples` (see `masked_cross_entropy`)."""
  positions = model_lib.positions_from_mask(batch["attention_mask"])
  logits = model_lib.logits(config, params, batch["tokens"], positions, batch["attention_mask"])
  return masked_cross_entropy(logits, batch["tokens"], batch["loss_mask"])


def make_optimizer(config: WarmStartConfig) -> optax.GradientTransformation:
  """Global-norm clipping then AdamW with linear warm-up and cosine decay."""
  warmup = min(config.warmup_steps, config.steps)
  schedule = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=config.learning_rate,
    warmup_steps=warmup,
    decay_steps=max(config.steps, warmup + 1),
    end_value=config.learning_rate * config.final_lr_fraction,
  )
  adam = optax.adamw(schedule, weight_decay=config.weight_decay)
  if config.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adam)
  return adam


def sft_step(
  config: ModelConfig,
  optimizer: optax.GradientTransformation,
  params: Params,
  opt_state: optax.OptState,
  batch: Mapping[str, jax.Array],
) -> tuple[Params, optax.OptState, dict[str, jax.Array]]:
  """One supervised update (pure; jit with `config` and `optimizer` closed over).

  Returns:
    (new params, new optimizer state, metrics: `loss`, `grad_norm` (before clipping) and
    those of `masked_cross_entropy`).
  """
  (loss, metrics), grads = jax.value_and_grad(lambda p: sft_loss(config, p, batch), has_aux=True)(
    params
  )
  updates, opt_state = optimizer.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  return params, opt_state, {"loss": loss, "grad_norm": optax.global_norm(grads), **metrics}


# --------------------------------------------------------------------------- driver


def _step_setting(config: WarmStartConfig) -> WarmStartConfig:
  # Fields that only choose the data or steer the host loop do not change the function.
  return dataclasses.replace(config, seed=0, target_accuracy=0.0, target_level=0, check_every=1)


@dataclasses.dataclass(frozen=True)
class SftStep:
  """The jitted `sft_step` of one (model, optimizer setting): build it once (`make`) and
  pass it to every `warm_start` of that setting, so that repeated warm starts (other
  seeds, targets) compile once.

  Attributes:
    model_config: the architecture it was traced for.
    setting: the `WarmStartConfig` it was built from, with the fields that do not change
      the function (seed, target_accuracy, target_level, check_every) reset.
    optimizer: `make_optimizer(setting)`.
    step: jitted (params, opt_state, batch) -> (params, opt_state, metrics), params and
      optimizer state donated.
  """

  model_config: ModelConfig
  setting: WarmStartConfig
  optimizer: optax.GradientTransformation
  step: Callable

  @classmethod
  def make(cls, model_config: ModelConfig, config: WarmStartConfig) -> SftStep:
    setting = _step_setting(config)
    optimizer = make_optimizer(setting)
    step = jax.jit(
      lambda p, s, b: sft_step(model_config, optimizer, p, s, b), donate_argnums=(0, 1)
    )
    return cls(model_config, setting, optimizer, step)


def describe(metrics: dict[str, Any], config: WarmStartConfig) -> str:
  """One line on how a warm start ended: at `target_accuracy` (stopped early) or after all
  `config.steps`, with the last accuracy and loss (`metrics` as `warm_start` returns it)."""
  acc, target = metrics["accuracy"], config.target_accuracy
  on = f" on level {config.target_level}" if config.target_level else ""
  loss = float(metrics["loss"][-1]) if len(metrics["loss"]) else float("nan")
  head = f"warm start: {metrics['steps_run']} of {config.steps} steps, {metrics['wall_s']:.0f} s"
  if metrics["reached_target"]:
    return f"{head}: stopped early, accuracy{on} {acc:.2f} >= target {target} (loss {loss:.3f})"
  shown = "n/a" if acc is None else f"{acc:.2f}"
  goal = f", target {target} not reached" if target > 0 else ""
  return f"{head}: accuracy{on} {shown}{goal} (loss {loss:.3f})"


def summary(metrics: dict[str, Any]) -> dict[str, Any]:
  """A warm start's JSON-able record (`metrics` as `warm_start` returns it): `wall_s`,
  `final_loss` (the mean of the last 20 steps' losses), `steps_run`, `reached_target`."""
  return {
    "wall_s": float(metrics["wall_s"]),
    "final_loss": float(np.mean(metrics["loss"][-20:])),
    "steps_run": int(metrics["steps_run"]),
    "reached_target": bool(metrics["reached_target"]),
  }


def warm_start(
  model_config: ModelConfig,
  params: Params,
  tokenizer: Tokenizer,
  config: WarmStartConfig,
  *,
  progress: bool = True,
  step: SftStep | None = None,
) -> tuple[Params, dict[str, Any]]:
  """Trains `params` on `config.steps × config.batch_size` fresh training-split problems of
  `config.task`.

  Deterministic for (inputs, config.seed): problems come from `arith.examples(config.task,
  'train', steps * batch_size, seed=config.seed)` in order, and the update is a pure jitted
  function (XLA CPU is deterministic run to run).

  Args:
    model_config: the architecture (its vocab must cover the tokenizer's).
    params: initial parameters (e.g. `model.init_params`); not modified.
    tokenizer: the arithmetic tokenizer.
    config: the settings (problems to train on, steps, optimizer, early stop).
    progress: show a tqdm bar with the running loss.
    step: `SftStep.make(model_config, config)` when warm starts repeat (it compiles once);
      None = built for this call.

  Returns:
    (trained params, metrics): numpy `loss float32[S]`, `token_accuracy float32[S]`,
    `sequence_accuracy float32[S]` (teacher-forced, per step), `grad_norm float32[S]`
    (S = steps run), `level_accuracy` (level -> `float32[S // check_every]`, teacher-forced
    exact match of that level's problems per window of `check_every` steps), `steps_run`,
    `reached_target` (stopped by `target_accuracy`), `accuracy` (the last window's exact
    match on `target_level`, the figure compared with `target_accuracy`; None before the
    first check), `wall_s` (seconds, compile included), `examples` (count).

  Raises:
    ValueError: bad settings (named as `WarmStartConfig` fields), a tokenizer larger
      than the model's vocabulary, or a `step` built for another model or setting.
  """
  c = config
  task_config, steps, batch_size, seed = c.task, c.steps, c.batch_size, c.seed
  target_accuracy, target_level, check_every = c.target_accuracy, c.target_level, c.check_every
  start = time.perf_counter()
  lp, lr = arith.length_bounds(task_config, tokenizer)
  examples = arith.examples(task_config, "train", steps * batch_size, seed=seed)
  data = arith.encode_examples(tokenizer, examples, prompt_len=lp, response_len=lr)
  model_lib.check_vocab(model_config, tokenizer.vocab_size)  # before the model is traced
  levels = np.asarray([int(e["source"].removeprefix("arith/L")) for e in examples])
  levels = levels.reshape(steps, batch_size)
  if step is None:
    step = SftStep.make(model_config, config)
  elif (step.model_config, step.setting) != (model_config, _step_setting(config)):
    raise ValueError("warm_start: `step` was made for another model or WarmStartConfig")
  optimizer, step_fn = step.optimizer, step.step
  # Copy so that donation never invalidates the caller's arrays.
  params = jax.tree.map(jnp.array, params)
  opt_state = optimizer.init(params)
  history, reached, accuracy = [], False, None
  bar = tqdm.trange(steps, desc="warm start", disable=not progress, leave=False)
  for i in bar:
    rows = slice(i * batch_size, (i + 1) * batch_size)
    params, opt_state, metrics = step_fn(params, opt_state, {k: v[rows] for k, v in data.items()})
    history.append(metrics)
    # Syncing once per check, not per step, keeps the host dispatching ahead of XLA.
    if (i + 1) % check_every == 0:
      recent = np.stack(jax.device_get([h["row_correct"] for h in history[-check_every:]]))
      window = levels[i + 1 - check_every : i + 1]
      chosen = window == target_level if target_level else np.ones_like(window, bool)
      accuracy = float(recent[chosen].mean()) if chosen.any() else 0.0
      bar.set_postfix(loss=f"{float(metrics['loss']):.3f}", acc=f"{accuracy:.2f}")
      if target_accuracy > 0 and accuracy >= target_accuracy:
        reached = True
        break
  bar.close()
  history = jax.device_get(history)
  out = {
    key: np.asarray([h[key] for h in history], np.float32)
    for key in ("loss", "token_accuracy", "sequence_accuracy", "grad_norm")
  }
  correct = np.stack([h["row_correct"] for h in history])
  windows = len(history) // check_every
  out["level_accuracy"] = {}
  for level in task_config.levels:
    acc = []
    for w in range(windows):
      rows = slice(w * check_every, (w + 1) * check_every)
      chosen = levels[rows] == level
      acc.append(correct[rows][chosen].mean() if chosen.any() else np.nan)
    out["level_accuracy"][int(level)] = np.asarray(acc, np.float32)
  out["steps_run"] = len(history)
  out["reached_target"] = reached
  out["accuracy"] = accuracy
  out["wall_s"] = time.perf_counter() - start
  out["examples"] = len(history) * batch_size
  return params, out
