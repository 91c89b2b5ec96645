"""A policy's params alone on disk, apart from a run's full state (`checkpoint`): the params of
another run's checkpoint (`ckpt.init_from`, a checkpoint to evaluate), the scratch start's
cache (`start.initial_params`), and the final policy as a Hugging Face folder.
"""

from __future__ import annotations

import os
import pathlib

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging

from ada_jax.models import sharding, weights
from ada_jax.models.decoder import ModelConfig, Params
from ada_jax.models.tokenizer import Tokenizer


def params_step_dir(path: str | os.PathLike) -> pathlib.Path:
  """The step folder whose `params` `restore_params` reads: `path` itself when it is one
  step's folder, else the latest step of the checkpoint directory `path`.

  Raises:
    FileNotFoundError: `path` holds no checkpoint; the message lists the steps saved next
      to it, or points at `path/checkpoints` when `path` is a run folder.
  """

  def saved_steps(folder: pathlib.Path) -> list[int]:
    if not folder.is_dir():
      return []
    return sorted(
      int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / "params").is_dir()
    )

  path = pathlib.Path(path).absolute()
  if (path / "params").is_dir():
    return path
  steps = saved_steps(path)
  if steps:
    return path / str(steps[-1])
  nearby = saved_steps(path.parent)
  hint = f"; {path.parent} holds steps {nearby}" if nearby else ""
  if saved_steps(path / "checkpoints"):
    hint = f"; it is a run folder: use {path / 'checkpoints'}"
  raise FileNotFoundError(f"{path} holds no checkpoint (no <step>/params){hint}")


def restore_params(path: str | os.PathLike, target: Params) -> Params:
  """Only the policy params of another run's checkpoint (for `init_from`).

  Args:
    path: a checkpoint directory of `make_manager` (its latest step is used) or one step's
      folder in it.
    target: params tree of `jax.ShapeDtypeStruct`s with shardings. Params saved in another
      dtype (a run from before `model.param_dtype`: bfloat16) are restored cast to the
      target's, with one warning line.

  Raises:
    FileNotFoundError: `path` holds no checkpoint (see `params_step_dir`).
    weights.CheckpointError: the checkpoint's params tree or shapes are another model's
      (orbax's 50-line refusal in one line, the folder named).
  """
  folder = params_step_dir(path) / "params"
  with ocp.StandardCheckpointer() as checkpointer:
    saved = checkpointer.metadata(folder).item_metadata.tree
    stored = {str(m.dtype) for m in jax.tree.leaves(saved) if hasattr(m, "dtype")}
    wanted = {str(jnp.dtype(t.dtype)) for t in jax.tree.leaves(target)}
    if stored and stored != wanted:
      logging.warning(
        "%s: parameters stored in %s, restored cast to %s (model.param_dtype)",
        folder,
        "/".join(sorted(stored)),
        "/".join(sorted(wanted)),
      )
    try:
      return checkpointer.restore(folder, target)
    except ValueError as e:  # orbax: another tree or shapes
      first = " ".join(str(e).split("\n")[0].split())
      raise weights.CheckpointError(
        f"{folder}: a checkpoint of another model than the configured one ({first[:200]})"
      ) from None


def save_params(folder: str | os.PathLike, params: Params) -> None:
  """Writes `params` as `folder/params`, the layout `restore_params(folder, ...)` reads
  (and `ckpt.init_from` accepts)."""
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(pathlib.Path(folder).absolute() / "params", params)


def export_hf(
  config: ModelConfig, params: Params, path: str | os.PathLike, tokenizer: Tokenizer | None = None
) -> None:
  """Writes the final policy as a Hugging Face folder (`weights.save_hf`) in the compute
  dtype `config.dtype` (bfloat16 for the paper configs, as released checkpoints are; the
  float32 masters stay in the orbax checkpoints) and, when given,
  the run's tokenizer with its chat template and a generation_config.json holding the run's
  stop ids (`Tokenizer.save`), so that transformers and inference servers load the folder
  as is and stop where the sampler did. Call it on every process: the params are gathered
  to the host (a collective with several processes), process 0 writes."""
  params = sharding.host_copy(params)
  if jax.process_index() != 0:
    return
  weights.save_hf(config, params, path, dtype=config.dtype, tokenizer=tokenizer)
