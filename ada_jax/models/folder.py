"""A Hugging Face model folder on disk: where it is (a path or a Hub id), which files make
the model, and writing one whole.

A folder is one model or another, never a mix: `model_folder` writes into a new sibling and
swaps it in, taking every old model file with the old folder (a stale shard index would
win over new weights at load, a stale chat template over the new model's). The writers of
model folders (`weights.save_hf`, the run's export, `from_gguf`) go through it.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import pathlib
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping

import numpy as np
from safetensors.numpy import save_file


class CheckpointError(ValueError):
  """A Hugging Face folder that cannot be found, loaded as-is or written; the message names
  the file or field."""


def is_hub_id(name: str) -> bool:
  """Whether `name` is a Hugging Face Hub repo id, `owner/name`: each part starts and ends
  with a letter or digit and holds no '..', so no id is a relative path (`RLHFlow/..`)."""
  part = r"[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?"
  return bool(re.fullmatch(f"{part}/{part}", name)) and ".." not in name


def resolve(path: str | os.PathLike) -> pathlib.Path:
  """A local folder, or a Hub repo id downloaded into the usual cache."""
  local = pathlib.Path(path).expanduser()
  if local.exists():
    if not local.is_dir():
      raise CheckpointError(f"{local}: expected a Hugging Face checkpoint folder, got a file")
    return local
  repo_id = str(path)
  if not is_hub_id(repo_id):
    raise CheckpointError(f"{path}: no such folder (and not a Hugging Face repo id)")
  try:
    import huggingface_hub

    return pathlib.Path(
      huggingface_hub.snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"])
    )
  except Exception as e:  # offline, gated, or unknown repo: one clear message for all.
    raise CheckpointError(
      f"{repo_id}: not a local folder and it could not be downloaded from the Hugging Face "
      f"Hub ({type(e).__name__}: {e}). On a machine with network access run "
      f"`huggingface-cli download {repo_id} --local-dir DIR` (gated models need "
      f"`huggingface-cli login` first), copy DIR here, and point the config's "
      f"model.hf_dir at it."
    ) from None


# What makes a Hugging Face model folder a model: weights, their index, the config, the
# tokenizer and its templates, the generation config. `model_folder` replaces all of them at
# once; anything else in a folder (README.md, LICENSE) is carried over.
MODEL_FILES = (
  "*.safetensors",
  "*.safetensors.index.json",
  "pytorch_model*.bin",
  "pytorch_model*.bin.index.json",
  "config.json",
  "generation_config.json",
  "tokenizer.json",
  "tokenizer_config.json",
  "tokenizer.model",
  "special_tokens_map.json",
  "added_tokens.json",
  "vocab.json",
  "merges.txt",
  "chat_template.jinja",
  "chat_template.json",
  "additional_chat_templates",
)


def is_model_file(name: str) -> bool:
  """Whether `name` (a file or folder in a model folder) is one of `MODEL_FILES`."""
  return any(fnmatch.fnmatchcase(name, pattern) for pattern in MODEL_FILES)


def check_output_folder(
  path: str | os.PathLike, *, source: str | os.PathLike | None = None
) -> None:
  """Refuses an output model folder that `model_folder` cannot write, before any work.

  Raises:
    CheckpointError: `path` is a file (or `source` itself), holds a folder that is not a
      model's (the folder is not a model folder: a home directory, a project), or its
      nearest existing parent is not writable.
  """
  out = pathlib.Path(path)
  if out.is_symlink():
    raise CheckpointError(f"{out}: a symbolic link; give the folder it points to")
  if out.exists() and pathlib.Path.cwd().resolve().is_relative_to(out.resolve()):
    raise CheckpointError(f"{out}: holds the current directory, which a swap would remove")
  if source is not None and out.exists() and out.resolve() == pathlib.Path(source).resolve():
    raise CheckpointError(f"{out}: the output folder is the input file")
  if out.exists() and not out.is_dir():
    raise CheckpointError(f"{out}: exists and is not a folder; give a new or a model folder")
  if out.is_dir():
    folders = sorted(p.name for p in out.iterdir() if p.is_dir() and not is_model_file(p.name))
    if folders:
      raise CheckpointError(
        f"{out}: holds folders {folders[:5]}, so it is not a model folder; give a new one"
      )
  parent = out.parent
  while not parent.exists():
    parent = parent.parent
  if not os.access(parent, os.W_OK | os.X_OK) or (out.is_dir() and not os.access(out, os.W_OK)):
    raise CheckpointError(f"{out}: not writable")


@contextlib.contextmanager
def model_folder(path: str | os.PathLike) -> Iterator[pathlib.Path]:
  """Writes a model folder whole or not at all: yields a new empty sibling folder to write
  into; on success it takes `path`'s place, on an error (a full disk, a kill signal turned
  into an exception) it is removed and `path` is left as it was.

  The old folder's model files (`MODEL_FILES`) all go with it, so a folder never mixes two
  models (a stale shard index or chat template beside new weights); its other files are
  carried over. The swap is two renames: a kill between them leaves `path` absent and the
  old folder beside it as `.<name>.old-<pid>-<ns>`, never a mix.

  Raises:
    CheckpointError: `check_output_folder`'s refusals; no space left (the partial folder
      removed).
  """
  out = pathlib.Path(path)
  check_output_folder(out)
  out = out.absolute()
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the model from other users
  try:
    yield tmp
    if out.exists():
      for f in out.iterdir():
        if not is_model_file(f.name) and not (tmp / f.name).exists():
          shutil.copy2(f, tmp / f.name)
      old = out.with_name(f".{out.name}.old-{os.getpid()}-{time.time_ns()}")
      os.replace(out, old)
      os.replace(tmp, out)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.replace(tmp, out)
  except BaseException as e:
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
      raise CheckpointError(f"{out}: no space left on the device; nothing written") from None
    raise


def write_safetensors(tensors: Mapping[str, np.ndarray], path: pathlib.Path) -> None:
  """Writes one safetensors file (transformers' `format: pt` metadata) with the mode `open`
  gives a new file (0644 under the usual umask 022), as the folder's other files have:
  safetensors writes its files 0600, readable by their owner only, which an inference
  server run as another user cannot load."""
  save_file(dict(tensors), str(path), metadata={"format": "pt"})
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)
