"""The model an evaluation or a prompt selection measures: weights, architecture and
tokenizer, placed on a mesh.

`load_model` reads a Hugging Face folder (or Hub id), an orbax checkpoint of a run, or the
config's `model.hf_dir`. With `init_dir` it measures the policy a fresh training run of the
config would start from (`start.initial_params`: `ckpt.init_from`, else `model.hf_dir`,
else random init with the run's init key followed by the config's warm start, saved under
`init_dir` so that a rerun reads it back and training can start from it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib

import jax
from absl import logging

from ada_jax import config as config_lib
from ada_jax import inputs, runstate, saved_params, start
from ada_jax.eval.evaluator import weights_tag
from ada_jax.models import sharding, weights
from ada_jax.models.decoder import ModelConfig, Params
from ada_jax.models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  """A model loaded by `load_model`.

  Attributes:
    params: the weights, placed on the mesh; None when nothing names weights and no
      `init_dir` was given (the caller initialises them).
    model_config: the architecture.
    tokenizer: `inputs.load_model_files`', checked against `model_config.vocab_size`.
    tag: identity of the weights in results caches (`eval.evaluator.weights_tag`: their
      values' digest, wherever they came from), or '' when params is None.
    init_from: a checkpoint folder that `ckpt.init_from` accepts for training from these
      params, or '' (a Hugging Face model: use `model.hf_dir`; or no params).
  """

  params: Params | None
  model_config: ModelConfig
  tokenizer: Tokenizer
  tag: str
  init_from: str = ""


def load_model(
  cfg: config_lib.RunConfig,
  mesh: jax.sharding.Mesh,
  *,
  hf_dir: str | None = None,
  checkpoint_path: str | os.PathLike | None = None,
  tokenizer_dir: str | None = None,
  init_dir: str | os.PathLike | None = None,
  progress: bool = True,
) -> LoadedModel:
  """The model named by `hf_dir`, `checkpoint_path` or the config, placed on `mesh`.

  Weights: `hf_dir`'s safetensors; else the orbax checkpoint at `checkpoint_path`; else
  `cfg.model.hf_dir`'s safetensors; else none (params None). With `init_dir` (and neither
  `hf_dir` nor `checkpoint_path`) the model is the one a fresh training run of `cfg` starts
  from: `ckpt.init_from`, else `model.hf_dir`, else random init + warm start (see module
  docstring). Architecture:
  `hf_dir`'s config.json (in `cfg.model.dtype` and `param_dtype`); else `cfg.model` (with
  `cfg.model.hf_dir`'s config.json if set), exactly as the run that wrote a checkpoint
  built it. Tokenizer: `tokenizer_dir`, else `cfg.tokenizer.dir`, else the model's folder,
  else the arithmetic task's. The tokenizer is checked before any weights are read.

  Args:
    cfg: the experiment (`model`, `tokenizer`; `seed` and `warmstart` for `init_dir`).
    mesh: parameter placement (`sharding.param_shardings`).
    hf_dir: a Hugging Face folder or Hub id.
    checkpoint_path: an orbax checkpoint: a run's checkpoint folder (its latest step) or
      one step's folder.
    tokenizer_dir: overrides `cfg.tokenizer.dir`.
    init_dir: where a policy built here (init + warm start) is saved, and found again on a
      rerun, as `base_params_<tag>/params`; None = build none.
    progress: warm-start progress bar.

  Raises:
    ValueError: both hf_dir and checkpoint_path; a `config.ConfigError` for an unreadable
      model folder (named as '--hf_dir' or 'config.model.hf_dir') or a tokenizer larger
      than the model's vocabulary.
    FileNotFoundError: a checkpoint path without a checkpoint.
    config.ConfigError: a checkpoint of another model, or weights that do not load
      (`weights.CheckpointError`, the file named).
  """
  if hf_dir is not None and checkpoint_path is not None:
    raise ValueError("give at most one of --hf_dir and --checkpoint")
  model, field = cfg.model, "config.model.hf_dir"
  if hf_dir is not None:
    spec = weights.ModelSpec(
      hf_dir=hf_dir, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype
    )
    model, field = spec, "--hf_dir"
  tokenizer = cfg.tokenizer
  if tokenizer_dir:
    tokenizer = dataclasses.replace(tokenizer, dir=tokenizer_dir)
  model_dir, model_config, tok = inputs.load_model_files(model, tokenizer, hf_field=field)
  target = sharding.abstract_params(model_config, mesh)
  if init_dir is not None and hf_dir is None and checkpoint_path is None:
    recipe = [dataclasses.asdict(cfg.model), cfg.warmstart and dataclasses.asdict(cfg.warmstart)]
    digest = hashlib.sha256(json.dumps([*recipe, cfg.seed], default=str).encode()).hexdigest()
    folder = pathlib.Path(init_dir).absolute() / f"base_params_{digest[:12]}"
    if not (cfg.ckpt.init_from or model_dir or cfg.warmstart):
      logging.warning("no checkpoint, hf_dir or warm start: measuring a RANDOM model")
    params, _, _ = start.initial_params(
      cfg,
      model_config,
      tok,
      target,
      model_dir=model_dir,
      init_key=runstate.run_keys(jax.random.key(cfg.seed)).init,
      progress=progress,
      scratch_cache=folder,
    )
    # What `ckpt.init_from` takes to train from these params ('' for a Hugging Face model).
    init_from = str(folder)
    if cfg.ckpt.init_from:
      init_from = str(pathlib.Path(cfg.ckpt.init_from).absolute())
    elif model_dir:
      init_from = ""
    return LoadedModel(params, model_config, tok, weights_tag(params, model_config), init_from)
  if checkpoint_path is not None:
    path = pathlib.Path(checkpoint_path).absolute()
    try:
      params = saved_params.restore_params(path, target)
    except weights.CheckpointError as e:  # another model's params
      raise config_lib.ConfigError(
        f"{e}; load it with the config of the run that wrote it"
      ) from None
    return LoadedModel(params, model_config, tok, weights_tag(params, model_config), str(path))
  if model_dir is not None:
    shardings = sharding.param_shardings(model_config, mesh)
    try:
      _, params = weights.load_hf(model_dir, dtype=model_config.param_dtype, shardings=shardings)
    except weights.CheckpointError as e:
      raise config_lib.ConfigError(f"{field}: {e}") from None
    return LoadedModel(params, model_config, tok, weights_tag(params, model_config))
  return LoadedModel(None, model_config, tok, "")
