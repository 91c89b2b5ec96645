"""Maths data sets: TFDS builders, JSONL readers, data-set specs.

docs/design.md "Data". One TFDS builder, `AdaMath` (registered as `ada_math`, a name TFDS's own
catalogue does not use), with one config per data set: `gsm8k` (train/test), `math_train`
(the 4,500 MATH test problems outside MATH500, plus any JSONL files the user adds),
`math500`, `minerva_math`, `olympiadbench`, `aime24`, `amc23` (test). Offline they read the
JSONL files of a manual directory (the layout of `../shared/data`, see its README); online
they download the same files from their public sources. Data are written as array_record
and read back with random access (`tfds.data_source` / `builder.as_data_source`).

Every example has four text features: `prompt_id` (stable, e.g. `gsm8k/test/17`,
`math500/test/precalculus/807.json`), `problem`, `answer` (the reference final answer,
LaTeX, extracted as `ada_jax.rewards.reference_answer` does) and `source`. Turning examples
into tokenized prompts, and the order they are drawn in, is `ada_jax.prompts`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import socket
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import tensorflow_datasets as tfds
from absl import logging
from etils import epath

from ada_jax.rewards import grader as rewards

FEATURES = ("prompt_id", "problem", "answer", "source")

# --------------------------------------------------------------------------- data sets


@dataclasses.dataclass(frozen=True)
class JsonlSource:
  """One JSONL file of a data set, and how its rows become examples.

  Attributes:
    split: TFDS split the rows go to.
    file: file name inside the manual directory, or an absolute path (user files).
    problem_field: row field holding the problem text.
    id_format: `str.format` pattern of `prompt_id` over the row's fields plus `split` and
      `line` (0-based index of the row in the file); must be unique within the data set.
    reference: key of `rewards.REFERENCE_ANSWER_FNS` giving the answer extraction of a
      known data set; None for user files, which use `answer_field` / `answer_format`.
    answer_field: row field holding the answer (user files).
    answer_format: key of `ANSWER_FORMATS`: 'plain' (the field as is), 'boxed' (last
      \\boxed{} of the field, e.g. a worked solution), 'gsm8k' (text after '####').
    source: the `source` feature; empty means the data set's name.
    url: public download address of the file, used when the manual directory lacks it.
    context_field: row field with a preamble shared by several problems (OlympiadBench's
      `context`), put before the problem when non-empty.
  """

  split: str
  file: str
  problem_field: str = "problem"
  id_format: str = "{split}/{line}"
  reference: str | None = None
  answer_field: str = "answer"
  answer_format: str = "plain"
  source: str = ""
  url: str | None = None
  context_field: str | None = None


@dataclasses.dataclass(frozen=True)
class MathSetSpec:
  """A data set: its files, and the files whose problems it must not contain.

  Attributes:
    name: config name (`ada_math/<name>`).
    sources: the JSONL files, one or more per split.
    exclude: files whose problems are dropped from `sources` (decontamination, matched on
      whitespace-normalised problem text), e.g. MATH500 out of the MATH training prompts.
    description: one line for the TFDS catalogue.
  """

  name: str
  sources: tuple[JsonlSource, ...]
  exclude: tuple[JsonlSource, ...] = ()
  description: str = ""

  @property
  def splits(self) -> tuple[str, ...]:
    return tuple(dict.fromkeys(s.split for s in self.sources))


_QWEN_EVAL = "https://raw.githubusercontent.com/QwenLM/Qwen2.5-Math/main/evaluation/data"
_GSM8K = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data"
_PRM800K = "https://raw.githubusercontent.com/openai/prm800k/main/prm800k/math_splits"


def _test_file(name: str, id_key: str, problem_field: str = "problem", **kw) -> JsonlSource:
  """`<name>_test.jsonl` (Qwen2.5-Math's evaluation copy), ids `<name>/test/<row[id_key]>`."""
  return JsonlSource(
    "test",
    f"{name}_test.jsonl",
    problem_field=problem_field,
    id_format=f"{name}/test/{{{id_key}}}",
    reference=name,
    url=f"{_QWEN_EVAL}/{name}/test.jsonl",
    **kw,
  )


_MATH500 = JsonlSource(
  "test",
  "math500_test.jsonl",
  id_format="math500/{unique_id}",
  reference="math500",
  url=f"{_PRM800K}/test.jsonl",
)
_GSM8K_FILES = tuple(
  JsonlSource(
    split,
    f"gsm8k_{split}.jsonl",
    problem_field="question",
    id_format="gsm8k/{split}/{line}",
    reference="gsm8k",
    url=f"{_GSM8K}/{split}.jsonl",
  )
  for split in ("train", "test")
)
# MATH's full test split; its 4,500 problems outside MATH500 are the usual RL prompts.
_MATH_FULL = JsonlSource(
  "train",
  "math_test_full.jsonl",
  id_format="math/test/{idx}",
  reference="math",
  source="math",
  url=f"{_QWEN_EVAL}/math/test.jsonl",
)

SETS: dict[str, MathSetSpec] = {
  s.name: s
  for s in (
    MathSetSpec("gsm8k", _GSM8K_FILES, description="GSM8K (Cobbe et al., 2021)."),
    MathSetSpec(
      "math_train",
      (_MATH_FULL,),
      exclude=(_MATH500,),
      description="MATH test problems outside MATH500 (training prompts).",
    ),
    MathSetSpec("math500", (_MATH500,), description="MATH500 (Lightman et al., 2023)."),
    MathSetSpec(
      "minerva_math",
      (_test_file("minerva_math", "idx"),),
      description="Minerva Math (MIT OCW problems, Lewkowycz et al., 2022).",
    ),
    MathSetSpec(
      "olympiadbench",
      (_test_file("olympiadbench", "id", "question", context_field="context"),),
      description="OlympiadBench, English text-only open-ended maths.",
    ),
    MathSetSpec("aime24", (_test_file("aime24", "id"),), description="AIME 2024."),
    MathSetSpec("amc23", (_test_file("amc23", "id", "question"),), description="AMC 2023."),
  )
}


def _after_hashes(value: Any) -> str:
  text = str(value)
  if "####" not in text:
    raise ValueError("no '####' final-answer marker")
  return text.rsplit("####", 1)[1].strip().replace(",", "")


def _boxed(value: Any) -> str:
  answer = rewards.last_boxed(str(value))
  if answer is None:
    raise ValueError("no complete \\boxed{} answer")
  return answer


ANSWER_FORMATS: dict[str, Callable[[Any], str]] = {
  "plain": lambda value: str(value).strip(),
  "boxed": _boxed,
  "gsm8k": _after_hashes,
}


def user_jsonl_spec(
  name: str,
  paths: Sequence[str | pathlib.Path],
  *,
  problem_field: str = "problem",
  answer_field: str = "answer",
  answer_format: str = "plain",
  split: str = "train",
  exclude_math500: bool = True,
) -> MathSetSpec:
  """A data set of the user's own JSONL files (one JSON object per line).

  The config name carries a hash of the paths, field names, file sizes/mtimes and the
  MATH500 filter, so an edited file or a changed option is prepared again instead of read
  from a stale cache.

  Args:
    name: short name; prompt ids are `<name>/<file stem>/<line>`.
    paths: JSONL files.
    problem_field: field with the problem text.
    answer_field: field with the answer.
    answer_format: key of `ANSWER_FORMATS` ('plain', 'boxed', 'gsm8k').
    split: split name of all rows.
    exclude_math500: drop problems that are in MATH500 (needs math500_test.jsonl in the
      manual directory, or network).

  Returns:
    The spec; pass it to `builder` / `load_examples`.

  Raises:
    FileNotFoundError: a path does not exist.
    ValueError: unknown `answer_format`.
  """
  if answer_format not in ANSWER_FORMATS:
    raise ValueError(f"answer_format={answer_format!r}; known: {sorted(ANSWER_FORMATS)}")
  resolved = []
  digest = hashlib.blake2b(digest_size=6)
  for p in paths:
    p = pathlib.Path(p).resolve()
    if not p.is_file():
      raise FileNotFoundError(f"{p}: no such JSONL file")
    stat = p.stat()
    digest.update(f"{p}|{stat.st_size}|{stat.st_mtime_ns}|".encode())
    resolved.append(p)
  # The MATH500 filter changes the rows, so it is part of the cache key too.
  digest.update(
    f"{problem_field}|{answer_field}|{answer_format}|{split}|"
    f"exclude_math500={exclude_math500}".encode()
  )
  sources = tuple(
    JsonlSource(
      split,
      str(p),
      problem_field=problem_field,
      answer_field=answer_field,
      answer_format=answer_format,
      id_format=_escape(f"{name}/{p.stem}/") + "{line}",
      source=name,
    )
    for p in resolved
  )
  return MathSetSpec(
    f"{name}_{digest.hexdigest()}",
    sources,
    exclude=(_MATH500,) if exclude_math500 else (),
    description=f"user JSONL: {', '.join(str(p) for p in resolved)}",
  )


def _escape(text: str) -> str:
  return text.replace("{", "{{").replace("}", "}}")


# --------------------------------------------------------------------------- reading


def _normalize_problem(text: str) -> str:
  return " ".join(text.split())


def read_jsonl(path: pathlib.Path) -> Iterable[tuple[int, dict]]:
  """(1-based line number, object) for each non-blank line.

  Raises:
    ValueError: a line is not a JSON object; the message is `file:line: ...`.
  """
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      try:
        row = json.loads(raw.decode("utf-8"))
      except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not UTF-8: {e}") from None
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: malformed JSON: {e}") from None
      if not isinstance(row, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
      yield lineno, row


def _example(
  src: JsonlSource, set_name: str, path: pathlib.Path, lineno: int, index: int, row: Mapping
) -> dict[str, str]:
  where = f"{path}:{lineno}"
  problem = row.get(src.problem_field)
  if not isinstance(problem, str) or not problem.strip():
    raise ValueError(f"{where}: field {src.problem_field!r} is missing or not a non-empty string")
  context = row.get(src.context_field) if src.context_field else None
  if isinstance(context, str) and context.strip():
    problem = f"{context.strip()}\n\n{problem}"
  try:
    if src.reference is not None:
      answer = rewards.reference_answer(src.reference, row)
    else:
      if src.answer_field not in row:
        raise ValueError(f"no field {src.answer_field!r}")
      answer = ANSWER_FORMATS[src.answer_format](row[src.answer_field])
      if not answer:
        raise ValueError(f"field {src.answer_field!r} gives an empty answer")
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  try:
    prompt_id = src.id_format.format(**{**row, "split": src.split, "line": index})
  except (KeyError, IndexError, ValueError) as e:
    raise ValueError(f"{where}: prompt id {src.id_format!r} needs field {e}") from None
  return {
    "prompt_id": prompt_id,
    "problem": problem,
    "answer": answer,
    "source": src.source or set_name,
  }


def iter_examples(
  spec: MathSetSpec, split: str, paths: Mapping[JsonlSource, pathlib.Path]
) -> Iterable[dict[str, str]]:
  """The examples of one split, decontaminated against `spec.exclude` (no TFDS involved).

  Args:
    spec: the data set.
    split: one of `spec.splits`.
    paths: local path of every source and exclude file.

  Yields:
    Example dicts with the `FEATURES` keys.

  Raises:
    ValueError: a malformed line (`file:line` in the message) or a duplicate prompt id.
  """
  banned = {
    _normalize_problem(row[src.problem_field])
    for src in spec.exclude
    for _, row in read_jsonl(paths[src])
    if isinstance(row.get(src.problem_field), str)
  }
  seen: dict[str, str] = {}
  dropped = 0
  for src in spec.sources:
    if src.split != split:
      continue
    path = paths[src]
    for index, (lineno, row) in enumerate(read_jsonl(path)):
      ex = _example(src, spec.name, path, lineno, index, row)
      if _normalize_problem(ex["problem"]) in banned:
        dropped += 1
        continue
      if ex["prompt_id"] in seen:
        raise ValueError(
          f"{path}:{lineno}: duplicate prompt_id {ex['prompt_id']!r} "
          f"(first at {seen[ex['prompt_id']]})"
        )
      seen[ex["prompt_id"]] = f"{path}:{lineno}"
      yield ex
  if banned:
    logging.info(
      "%s/%s: dropped %d problems found in %s",
      spec.name,
      split,
      dropped,
      [s.file for s in spec.exclude],
    )


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


def missing_files(spec: MathSetSpec, manual_dir: str | pathlib.Path | None) -> list[JsonlSource]:
  """The files of `spec` (sources and excludes) that are not on disk: not in `manual_dir`
  (relative names) or absent (absolute paths of user files)."""
  out = []
  for src in spec.sources + spec.exclude:
    path = pathlib.Path(src.file)
    if not path.is_absolute():
      path = pathlib.Path(manual_dir) / src.file if manual_dir else None
    if path is None or not path.is_file():
      out.append(src)
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
    ValueError: unknown name, or a malformed file (`file:line`).
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
  b.download_and_prepare(
    download_config=tfds.download.DownloadConfig(manual_dir=manual_dir and str(manual_dir))
  )
  return b


def decode(raw: Mapping[str, Any]) -> dict[str, str]:
  """A data-source element (text features come back as bytes) as a dict of str."""
  return {k: v.decode("utf-8") if isinstance(v, bytes) else str(v) for k, v in raw.items()}


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
