"""Maths data sets as TFDS data: the builder, the availability checks, `load_examples`.

docs/design.md "Data". One TFDS builder, `AdaMath` (registered as `ada_math`, a name TFDS's own
catalogue does not use), with one config per data set: `gsm8k` (train/test), `math_train`
(the 4,500 MATH test problems outside MATH500, plus any JSONL files the user adds),
`math500`, `minerva_math`, `olympiadbench`, `aime24`, `amc23` (test). Offline they read the
JSONL files of a manual directory (the layout of `../shared/data`, see its README); online
they download the same files from their public sources. Data are written as array_record
and read back with random access (`tfds.data_source` / `builder.as_data_source`).

The sets, their JSONL files and the examples read from them (`prompt_id`, `problem`,
`answer`, `source`) are `data.sources`'. Turning examples into tokenized prompts, and the
order they are drawn in, is `data.prompts`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import socket
import urllib.parse
from collections.abc import Mapping
from typing import Any

import tensorflow_datasets as tfds
from absl import logging
from etils import epath

from ada_jax.data.sources import FEATURES, SETS, JsonlSource, MathSetSpec, iter_examples

# --------------------------------------------------------------------------- TFDS


@dataclasses.dataclass(eq=False)
class AdaMathConfig(tfds.core.BuilderConfig):
  """TFDS config carrying a `MathSetSpec` (TFDS requires configs to subclass this)."""

  spec: MathSetSpec | None = None


_VERSION = tfds.core.Version("1.0.0")


def make_config(spec: MathSetSpec) -> AdaMathConfig:
  return AdaMathConfig(name=spec.name, version=_VERSION, description=spec.description, spec=spec)


class AdaMath(tfds.core.GeneratorBasedBuilder):
  """Maths prompt sets as TFDS data (array_record); one config per data set."""

  VERSION = _VERSION
  RELEASE_NOTES = {"1.0.0": "First release."}
  # TFDS derives this through `importlib_resources` (a package it only declares for Python
  # < 3.9, so it is absent here); the file path is all it needs (checksums live beside it).
  code_path = epath.Path(__file__)
  BUILDER_CONFIGS = [make_config(s) for s in SETS.values()]
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
    "Optional. Put the JSONL files (gsm8k_train.jsonl, gsm8k_test.jsonl, math500_test.jsonl, "
    "math_test_full.jsonl, minerva_math_test.jsonl, olympiadbench_test.jsonl, "
    "aime24_test.jsonl, amc23_test.jsonl; layout of ../shared/data) in the manual directory; "
    "missing files are downloaded from their public sources."
  )

  def _info(self) -> tfds.core.DatasetInfo:
    # Built directly: `dataset_info_from_configs` looks for metadata files next to this
    # module (docs/design.md "Data").
    return tfds.core.DatasetInfo(
      builder=self,
      description=self.builder_config.description,
      features=tfds.features.FeaturesDict({k: tfds.features.Text() for k in FEATURES}),
      supervised_keys=None,
      # File order, so that example i of a split is row i of its file(s).
      disable_shuffling=True,
    )

  def _log_download_bytes(self) -> None:
    # TFDS prints "Downloading and preparing dataset ..." to stdout even when every file is
    # local; what is read from where is `builder`'s INFO line.
    pass

  def _log_download_done(self) -> None:
    pass

  def _split_generators(self, dl_manager):
    spec = self.builder_config.spec
    try:
      manual = pathlib.Path(dl_manager.manual_dir)
    except (AssertionError, ValueError):  # no or empty manual directory: download
      manual = None
    paths = {}
    for src in spec.sources + spec.exclude:
      if pathlib.Path(src.file).is_absolute():
        path = pathlib.Path(src.file)
        if not path.is_file():
          raise FileNotFoundError(f"{path}: no such JSONL file")
      elif manual is not None and (manual / src.file).is_file():
        path = manual / src.file
      elif src.url is not None:
        path = pathlib.Path(dl_manager.download(src.url))
      else:
        raise FileNotFoundError(f"{src.file}: not in the manual directory {manual} and no URL")
      paths[src] = path
    return {split: self._generate_examples(spec, split, paths) for split in spec.splits}

  def _generate_examples(self, spec, split, paths):
    for ex in iter_examples(spec, split, paths):
      yield ex["prompt_id"], ex


def reachable(url: str, timeout_s: float = 3.0) -> bool:
  """Whether a TCP connection to `url`'s host (port 443/80) opens within `timeout_s`
  seconds: one quick probe, so that an offline machine is told at once instead of after
  TFDS's download retries (minutes)."""
  parts = urllib.parse.urlsplit(url)
  port = parts.port or (443 if parts.scheme == "https" else 80)
  try:
    with socket.create_connection((parts.hostname, port), timeout=timeout_s):
      return True
  except OSError:
    return False


def _local_path(src: JsonlSource, manual_dir: str | pathlib.Path | None) -> pathlib.Path | None:
  """Where `src` is on disk (its absolute path, or its name in `manual_dir`); None if not."""
  path = pathlib.Path(src.file)
  if not path.is_absolute():
    path = pathlib.Path(manual_dir) / src.file if manual_dir else None
  return path if path is not None and path.is_file() else None


def missing_files(spec: MathSetSpec, manual_dir: str | pathlib.Path | None) -> list[JsonlSource]:
  """The files of `spec` (sources and excludes) that are not on disk: not in `manual_dir`
  (relative names) or absent (absolute paths of user files)."""
  out = [src for src in spec.sources + spec.exclude if _local_path(src, manual_dir) is None]
  return list(dict.fromkeys(out))


def check_available(
  spec: str | MathSetSpec,
  *,
  data_dir: str | pathlib.Path,
  manual_dir: str | pathlib.Path | None = None,
) -> None:
  """Fails fast when `builder` could not prepare `spec`: not yet prepared in `data_dir`,
  and a file neither in `manual_dir` nor downloadable (no URL, or its host unreachable by
  one `reachable` probe). Nothing is probed when all files are local or the data set is
  prepared already.

  Raises:
    ValueError: unknown name.
    FileNotFoundError: a user file does not exist, or a file without URL is missing.
    ConnectionError: offline and files missing; the message names them.
  """
  b = _builder(spec, data_dir)
  if not _prepared(b):
    _check_files(b.builder_config.spec, manual_dir)


def _check_files(spec: MathSetSpec, manual_dir: str | pathlib.Path | None) -> None:
  missing = missing_files(spec, manual_dir)
  where = f"the manual directory {manual_dir}" if manual_dir else "a manual directory (none set)"
  for src in missing:
    if pathlib.Path(src.file).is_absolute():
      raise FileNotFoundError(f"{src.file}: no such JSONL file")
    if src.url is None:
      raise FileNotFoundError(f"{src.file}: not in {where} and no URL to download it from")
  names = ", ".join(src.file for src in missing)
  for url in dict.fromkeys(src.url for src in missing):
    if not reachable(url):
      host = urllib.parse.urlsplit(url).hostname
      raise ConnectionError(
        f"{spec.name}: {names} not in {where}, and {host} is unreachable (offline?)"
      )


def _prepared(b: AdaMath) -> bool:
  # `is_prepared()` logs a warning for a folder that does not exist yet.
  return (b.data_path / "dataset_info.json").exists()


def _builder(spec: str | MathSetSpec, data_dir: str | pathlib.Path) -> AdaMath:
  if isinstance(spec, str):
    if spec not in SETS:
      raise ValueError(f"unknown data set {spec!r}; known: {sorted(SETS)}")
    config = spec
  else:
    config = make_config(spec)
  return AdaMath(config=config, data_dir=str(data_dir), file_format="array_record")


def builder(
  spec: str | MathSetSpec,
  *,
  data_dir: str | pathlib.Path,
  manual_dir: str | pathlib.Path | None = None,
) -> AdaMath:
  """A prepared `AdaMath` builder (prepared on first use, then read from `data_dir`).

  Args:
    spec: a `SETS` name or a spec (e.g. from `user_jsonl_spec`).
    data_dir: TFDS data directory (prepared array_record files live here).
    manual_dir: folder with the JSONL files; files it lacks are downloaded.

  Returns:
    The builder; `builder.as_data_source(split)` gives random access to raw examples.

  Raises:
    ValueError: unknown name, or a malformed file (`file:line`; when every file is local,
      before anything is written to `data_dir`).
    FileNotFoundError: a file is neither in `manual_dir` nor downloadable.
    ConnectionError: files to download and no network (`check_available`, in seconds).
  """
  b = _builder(spec, data_dir)
  if not _prepared(b):
    spec = b.builder_config.spec
    _check_files(spec, manual_dir)
    missing = [src.file for src in missing_files(spec, manual_dir)]
    logging.info(
      "preparing %s/%s in %s: reading %s%s",
      b.name,
      spec.name,
      data_dir,
      manual_dir or "no manual directory",
      f", downloading {', '.join(missing)}" if missing else "",
    )
    if not missing:  # A bad row, an empty file: named before TFDS writes anything.
      paths = {src: _local_path(src, manual_dir) for src in spec.sources + spec.exclude}
      for split in spec.splits:
        for _ in iter_examples(spec, split, paths):
          pass
  b.download_and_prepare(
    download_config=tfds.download.DownloadConfig(manual_dir=manual_dir and str(manual_dir))
  )
  return b


def decode(raw: Mapping[str, Any]) -> dict[str, str]:
  """A data-source element (text features come back as bytes) as a dict of str."""
  return {k: v.decode("utf-8") if isinstance(v, bytes) else str(v) for k, v in raw.items()}


def tfds_data_dir(given: str = "") -> str:
  """The TFDS data directory: `given`, else $TFDS_DATA_DIR when set and not empty, else
  ~/tensorflow_datasets (the `data_dir` fields of `data` and `eval`)."""
  return (
    given or os.environ.get("TFDS_DATA_DIR") or str(pathlib.Path.home() / "tensorflow_datasets")
  )


def load_examples(
  spec: str | MathSetSpec,
  split: str,
  *,
  data_dir: str | pathlib.Path,
  manual_dir: str | pathlib.Path | None = None,
) -> list[dict[str, str]]:
  """All examples of one split, read through TFDS (`as_data_source`), in file order."""
  source = builder(spec, data_dir=data_dir, manual_dir=manual_dir).as_data_source(split)
  examples = [decode(source[i]) for i in range(len(source))]
  return examples


def offline_hint(error: Exception, field: str) -> str:
  """For a `ConnectionError` (data to download, no network): what to set `field` to."""
  if not isinstance(error, ConnectionError):
    return ""
  return (
    f"; set {field} to a folder with these JSONL files (a folder shared/data beside "
    "the checkout is the configs' default when present)"
  )
