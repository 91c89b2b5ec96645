"""The model an evaluation or a prompt selection measures: weights, architecture and
tokenizer, placed on a mesh.

`load_model` reads a Hugging Face folder (or Hub id), an orbax checkpoint of a run, or the
config's `model.hf_dir`. With `init_dir` it also builds the policy a fresh training run of
the config would start from when nothing names weights: random init (the loop's init key)
followed by the config's warm start, saved under `init_dir` so that a rerun reads it back
and training can start from it (`ckpt.init_from`). This is the resume order of
`checkpoint.resume` (docs/design.md "One RL step", set-up): another run's params, then
pretrained weights, then init + warm start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib

import jax
from absl import logging

from ada_jax import checkpoint as checkpoint_lib
from ada_jax import config as config_lib
from ada_jax import inputs
from ada_jax.eval.evaluation import weights_tag
from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding, weights
from ada_jax.models.decoder import ModelConfig, Params
from ada_jax.models.tokenizer import Tokenizer
from ada_jax.rl import warmstart as warmstart_lib


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  """A model loaded by `load_model`.

  Attributes:
    params: the weights, placed on the mesh; None when nothing names weights and no
      `init_dir` was given (the caller initialises them).
    model_config: the architecture.
    tokenizer: `inputs.load_tokenizer`'s, checked against `model_config.vocab_size`.
    tag: identity of the weights in results caches (`evaluation.weights_tag`: their
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
  `hf_dir`'s config.json (in `cfg.model.dtype`); else `cfg.model` (with
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
  """
  if hf_dir is not None and checkpoint_path is not None:
    raise ValueError("give at most one of --hf_dir and --checkpoint")
  if init_dir is not None and hf_dir is None and checkpoint_path is None:
    checkpoint_path = cfg.ckpt.init_from or None  # resume order step 2: another run's
  model, field = cfg.model, "config.model.hf_dir"
  if hf_dir is not None:
    model, field = weights.ModelSpec(hf_dir=hf_dir, dtype=cfg.model.dtype), "--hf_dir"
  tokenizer = cfg.tokenizer
  if tokenizer_dir:
    tokenizer = dataclasses.replace(tokenizer, dir=tokenizer_dir)
  model_dir, model_config, tok = inputs.load_model_files(model, tokenizer, hf_field=field)
  if checkpoint_path is not None:
    path = pathlib.Path(checkpoint_path).absolute()
    target = sharding.abstract_params(model_config, mesh)
    params = checkpoint_lib.restore_params(path, target)
    return LoadedModel(params, model_config, tok, weights_tag(params, model_config), str(path))
  if model_dir is not None:
    shardings = sharding.param_shardings(model_config, mesh)
    _, params = weights.load_hf(model_dir, dtype=model_config.param_dtype, shardings=shardings)
    return LoadedModel(params, model_config, tok, weights_tag(params, model_config))
  if init_dir is None:
    return LoadedModel(None, model_config, tok, "")
  return _initial_policy(cfg, mesh, model_config, tok, pathlib.Path(init_dir), progress)


def _initial_policy(cfg, mesh, model_config, tokenizer, init_dir, progress) -> LoadedModel:
  """Resume order step 4, the loop's own start: random init (its init key) then the
  config's warm start; saved so that a rerun skips the warm start."""
  recipe = [dataclasses.asdict(cfg.model), cfg.warmstart and dataclasses.asdict(cfg.warmstart)]
  digest = hashlib.sha256(json.dumps([*recipe, cfg.seed], default=str).encode()).hexdigest()
  folder = init_dir.absolute() / f"base_params_{digest[:12]}"
  if (folder / "params").is_dir():
    params = checkpoint_lib.restore_params(folder, sharding.abstract_params(model_config, mesh))
  else:
    init_key = jax.random.split(jax.random.key(cfg.seed), 3)[0]  # As loop.train_run splits.
    params = model_lib.init_params(model_config, init_key)
    if cfg.warmstart is None:
      logging.warning("no checkpoint, hf_dir or warm start: measuring a RANDOM model")
    else:
      params, _ = warmstart_lib.warm_start(
        model_config, params, tokenizer, cfg.warmstart, progress=progress
      )
    params = jax.device_put(params, sharding.param_shardings(model_config, mesh))
    checkpoint_lib.save_params(folder, params)
  return LoadedModel(
    params, model_config, tokenizer, weights_tag(params, model_config), str(folder)
  )
