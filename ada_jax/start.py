"""A fresh run's start: where its state comes from when the run's own directory holds no
checkpoint (which would hold the whole run state: `loop` resumes from it with
`checkpoint.restore_latest`; docs/design.md "Run state"). In this order (`initial_state`):
1. `ckpt.init_from`: another run's params, a fresh optimizer, step 0; 2. the pretrained
weights of `model.hf_dir`; 3. random init (the init key), then the config's warm start.

An evaluation or a prompt selection of "the policy a fresh run would train"
(`policy.load_model` with `init_dir`) takes its params from `initial_params`.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax

from ada_jax import checkpoint, runstate, saved_params
from ada_jax import metrics as metrics_lib
from ada_jax.config import ConfigError
from ada_jax.models import decoder as model_lib
from ada_jax.models import weights
from ada_jax.models.decoder import ModelConfig, Params
from ada_jax.models.tokenizer import Tokenizer
from ada_jax.rl import train
from ada_jax.rl import warmstart as warmstart_lib


def load_pretrained(path: str | os.PathLike, target: Params) -> Params:
  """A Hugging Face folder's weights (`weights.load_hf`) on `target`'s dtype and shardings.

  Raises:
    weights.CheckpointError: the folder is missing, or its architecture or parameter
      shapes differ from `target`'s.
  """
  dtype = jax.tree.leaves(target)[0].dtype
  shardings = jax.tree.map(lambda s: s.sharding, target)
  try:
    _, params = weights.load_hf(path, dtype=dtype, shardings=shardings)
  except (KeyError, TypeError) as e:
    raise weights.CheckpointError(
      f"{path}: its architecture does not match the configured model ({e!r})"
    ) from None
  if jax.tree.map(lambda x: x.shape, params) != jax.tree.map(lambda s: s.shape, target):
    raise weights.CheckpointError(f"{path}: parameter shapes differ from the configured model's")
  return params


def initial_params(
  cfg,
  model_config: ModelConfig,
  tokenizer: Tokenizer,
  target: Params,
  *,
  model_dir: str | os.PathLike | None,
  init_key: jax.Array,
  phase: Callable[[str], None] | None = None,
  progress: bool = True,
  scratch_cache: pathlib.Path | None = None,
) -> tuple[Params, str, dict[str, Any] | None]:
  """The params a fresh run of `cfg` starts from, by the module docstring's order.

  Args:
    cfg: the run config (`ckpt.init_from`, `warmstart`).
    model_config: the architecture.
    tokenizer: the warm start's.
    target: abstract params (shapes, dtypes and shardings) of steps 1 and 2.
    model_dir: the pretrained folder of step 2 (`inputs.load_model_files`), or None.
    init_key: step 3's key (`runstate.RunKeys.init`).
    phase: called with 'the warm start' before it and 'the set-up' after it (the run's
      signal handling, `runstate.StopRequest.enter`).
    progress: the warm start's progress bar.
    scratch_cache: step 3 reads its params back from this folder when a run saved them
      there, else saves them there (evaluations of the initial policy); None: neither.

  Returns:
    (params, source, warm-start summary or None) with source 'init_from:<path>',
    'pretrained:<path>' or 'scratch'.

  Raises:
    FileNotFoundError: `ckpt.init_from` holds no checkpoint (named).
    ConfigError: `ckpt.init_from` holds another model's params, or `model_dir` does not
      load (`load_pretrained`'s error, the file named).
  """
  # 1. Another run's params (a fresh optimizer and step 0 are the caller's).
  if cfg.ckpt.init_from:
    try:
      params = saved_params.restore_params(cfg.ckpt.init_from, target)
    except FileNotFoundError as e:
      raise FileNotFoundError(f"config.ckpt.init_from: {e}") from None
    except weights.CheckpointError as e:  # another model's params
      raise ConfigError(f"config.ckpt.init_from={cfg.ckpt.init_from}: {e}") from None
    return params, f"init_from:{cfg.ckpt.init_from}", None
  # 2. Pretrained weights.
  if model_dir:
    try:
      return load_pretrained(model_dir, target), f"pretrained:{model_dir}", None
    except weights.CheckpointError as e:  # the file named: a bad input, not a failure
      raise ConfigError(f"config.model.hf_dir: {e}") from None
  # 3. Random init, then the warm start.
  if scratch_cache is not None and (scratch_cache / "params").is_dir():
    return saved_params.restore_params(scratch_cache, target), "scratch", None
  params, summary = model_lib.init_params(model_config, init_key), None
  if cfg.warmstart is not None:
    if phase:
      phase("the warm start")
    params, ws = warmstart_lib.warm_start(
      model_config, params, tokenizer, cfg.warmstart, progress=progress
    )
    if phase:
      phase("the set-up")
    line, summary = warmstart_lib.describe(ws, cfg.warmstart), warmstart_lib.summary(ws)
    metrics_lib.console(line)
  if scratch_cache is not None:
    params = jax.device_put(params, jax.tree.map(lambda s: s.sharding, target))
    saved_params.save_params(scratch_cache, params)
  return params, "scratch", summary


def initial_state(
  cfg,
  target: train.TrainState,
  model_config: ModelConfig,
  tokenizer: Tokenizer,
  mesh: jax.sharding.Mesh,
  *,
  model_dir: str | os.PathLike | None,
  host: dict[str, Any],
  phase: Callable[[str], None] | None = None,
  progress: bool = True,
) -> tuple[checkpoint.RunState, str]:
  """A fresh run's state: the params of the first of the module docstring's sources that
  exists (`initial_params`), a fresh optimizer, step 0, the config's root key.

  Args:
    cfg: the run config.
    target: `train.abstract_state(...)` of the run (its `ref_params` set iff the run has a
      KL reference).
    model_config, tokenizer, mesh: the run's.
    model_dir: the pretrained folder of step 2, or None.
    host: the host state of a fresh run (step, iterator position, Generator state).
    phase, progress: `initial_params`'.

  Returns:
    (run state, `initial_params`' source).

  Raises:
    FileNotFoundError, ConfigError: as `initial_params`.
  """
  root = jax.random.key(cfg.seed)
  params, source, warm = initial_params(
    cfg,
    model_config,
    tokenizer,
    target.params,
    model_dir=model_dir,
    init_key=runstate.run_keys(root).init,
    phase=phase,
    progress=progress,
  )
  with_ref = target.ref_params is not None
  state = train.init_train_state(
    model_config, cfg.train, params, mesh, ref_params=params if with_ref else None
  )
  host = {**host, **({"warmstart": warm} if warm else {})}
  return checkpoint.RunState(train=state, rng=root, host=host), source
