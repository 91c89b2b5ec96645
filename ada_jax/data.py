"""Maths prompt data: TFDS builders, prompt construction, a seeded resumable prompt iterator.

DESIGN.md §6. One TFDS builder, `AdaMath` (registered as `ada_math`, a name TFDS's own
catalogue does not use), with one config per data set: `gsm8k` (train/test), `math_train`
(the 4,500 MATH test problems outside MATH500, plus any JSONL files the user adds),
`math500`, `minerva_math`, `olympiadbench`, `aime24`, `amc23` (test). Offline they read the
JSONL files of a manual directory (the layout of `../shared/data`, see its README); online
they download the same files from their public sources. Data are written as array_record
and read back with random access (`tfds.data_source` / `builder.as_data_source`).

Every example has four text features: `prompt_id` (stable, e.g. `gsm8k/test/17`,
`math500/test/precalculus/807.json`), `problem`, `answer` (the reference final answer,
LaTeX, extracted as `ada_jax.rewards.reference_answer` does) and `source`.

Prompts follow the authors' released code (DESIGN.md §2): system "Please reason step by
step, and put your final answer within \\boxed{}." and the problem followed by " Let's think
step by step and output the final answer within \\boxed{}.", through the tokenizer's chat
template; base models without one get a plain template, the arithmetic task the bare
problem. Prompts longer than `max_prompt_tokens` are dropped and counted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from absl import logging
from etils import epath

from ada_jax import rewards
from ada_jax.tokenizer import Tokenizer, pad_left

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

  The config name carries a hash of the paths, field names and file sizes/mtimes, so an
  edited file is prepared again instead of read from a stale cache.

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
  digest.update(f"{problem_field}|{answer_field}|{answer_format}|{split}".encode())
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


def with_extra_training_files(base: MathSetSpec, extra: MathSetSpec) -> MathSetSpec:
  """`base` (e.g. `SETS['math_train']`) plus the files of a `user_jsonl_spec`."""
  return MathSetSpec(
    f"{base.name}_plus_{extra.name}",
    base.sources + extra.sources,
    exclude=tuple(dict.fromkeys(base.exclude + extra.exclude)),
    description=f"{base.description} Plus {extra.description}",
  )


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
    # module (DESIGN.md §6).
    return tfds.core.DatasetInfo(
      builder=self,
      description=self.builder_config.description,
      features=tfds.features.FeaturesDict({k: tfds.features.Text() for k in FEATURES}),
      supervised_keys=None,
      # File order, so that example i of a split is row i of its file(s).
      disable_shuffling=True,
    )

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
    manual_dir: folder with the JSONL files; None: download.

  Returns:
    The builder; `builder.as_data_source(split)` gives random access to raw examples.

  Raises:
    ValueError: unknown name, or a malformed file (`file:line`).
    FileNotFoundError: a file is neither in `manual_dir` nor downloadable.
  """
  if isinstance(spec, str):
    if spec not in SETS:
      raise ValueError(f"unknown data set {spec!r}; known: {sorted(SETS)}")
    config = spec
  else:
    config = make_config(spec)
  b = AdaMath(config=config, data_dir=str(data_dir), file_format="array_record")
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


def hf_examples(
  repo_id: str,
  *,
  split: str = "train",
  data_dir: str | pathlib.Path,
  problem_field: str = "problem",
  answer_field: str = "gt",
  answer_format: str = "plain",
) -> list[dict[str, str]]:
  """A Hugging Face prompt set through TFDS's `huggingface:` namespace (needs network and
  the `datasets` package). Defaults fit the paper's sets (`problem`, `gt`), e.g.
  `RLHFlow/reinforce_ada_hard_prompt`.

  Returns:
    Example dicts with the `FEATURES` keys; ids are `<repo_id>/<split>/<row>`.
  """
  name = "huggingface:" + repo_id.replace("/", "__").lower()
  source = tfds.data_source(name, split=split, data_dir=str(data_dir))
  fmt = ANSWER_FORMATS[answer_format]
  out = []
  for i in range(len(source)):
    row = decode(source[i])
    out.append(
      {
        "prompt_id": f"{repo_id}/{split}/{i}",
        "problem": row[problem_field],
        "answer": fmt(row[answer_field]),
        "source": repo_id,
      }
    )
  return out


# --------------------------------------------------------------------------- prompts

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
USER_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."


def _chat(problem: str, tok: Tokenizer) -> tuple[str, bool]:
  messages = [
    {"role": "system", "content": SYSTEM_PROMPT},
    {"role": "user", "content": f"{problem} {USER_SUFFIX}"},
  ]
  return tok.apply_chat_template(messages, add_generation_prompt=True), False


def _chat_no_system(problem: str, tok: Tokenizer) -> tuple[str, bool]:
  messages = [{"role": "user", "content": f"{problem} {USER_SUFFIX}"}]
  return tok.apply_chat_template(messages, add_generation_prompt=True), False


def _plain(problem: str, tok: Tokenizer) -> tuple[str, bool]:
  return f"Question: {problem}\n{USER_SUFFIX}\nAnswer:", True


def _raw(problem: str, tok: Tokenizer) -> tuple[str, bool]:
  return problem, True


# style -> (problem, tokenizer) -> (prompt text, whether to prepend BOS). Chat templates
# write their own BOS; the others get the tokenizer's (if it has one).
PROMPT_STYLES: dict[str, Callable[[str, Tokenizer], tuple[str, bool]]] = {
  "chat": _chat,
  "chat_no_system": _chat_no_system,
  "plain": _plain,
  "raw": _raw,
}


@dataclasses.dataclass(frozen=True)
class PromptBatch:
  """B prompts, left-padded.

  Attributes:
    tokens: int32[B, L] prompt ids, padding on the left.
    mask: bool[B, L], True on prompt tokens.
    indices: int64[B] positions in the `PromptSet`.
    prompt_ids: B stable prompt ids.
    answers: B reference answers.
  """

  tokens: np.ndarray
  mask: np.ndarray
  indices: np.ndarray
  prompt_ids: tuple[str, ...]
  answers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PromptSet:
  """Tokenized prompts of a data set (only those within the length limit).

  Attributes:
    prompt_ids, problems, answers, sources: N strings each.
    tokens: N int32 arrays of prompt ids (variable length).
    num_dropped: prompts removed for exceeding `max_prompt_tokens`.
  """

  prompt_ids: tuple[str, ...]
  problems: tuple[str, ...]
  answers: tuple[str, ...]
  sources: tuple[str, ...]
  tokens: tuple[np.ndarray, ...]
  num_dropped: int

  def __len__(self) -> int:
    return len(self.prompt_ids)

  @property
  def max_length(self) -> int:
    return max((len(t) for t in self.tokens), default=0)

  def batch(
    self,
    indices: Sequence[int] | np.ndarray,
    *,
    pad_id: int,
    length: int | None = None,
    pad_to_multiple: int | None = None,
    buckets: Sequence[int] | None = None,
  ) -> PromptBatch:
    """The prompts at `indices`, left-padded (length chosen as in `tokenizer.pad_left`)."""
    idx = np.asarray(indices, dtype=np.int64)
    ids, mask = pad_left(
      [self.tokens[i] for i in idx],
      pad_id,
      length=length,
      pad_to_multiple=pad_to_multiple,
      buckets=buckets,
    )
    return PromptBatch(
      ids, mask, idx, tuple(self.prompt_ids[i] for i in idx), tuple(self.answers[i] for i in idx)
    )


def build_prompts(
  examples: Iterable[Mapping[str, str]],
  tokenizer: Tokenizer,
  *,
  style: str = "chat",
  max_prompt_tokens: int = 1024,
) -> PromptSet:
  """Renders and tokenizes prompts; drops (and counts) those over `max_prompt_tokens`.

  Args:
    examples: dicts with at least `prompt_id`, `problem`, `answer` (and optional `source`).
    tokenizer: the model's tokenizer.
    style: key of `PROMPT_STYLES`: 'chat' (system + suffix through the chat template,
      DESIGN.md §2), 'chat_no_system', 'plain' (base models), 'raw' (the problem as is).
    max_prompt_tokens: longest prompt kept (DESIGN.md §2: 1024).

  Returns:
    The `PromptSet`, in input order.

  Raises:
    ValueError: unknown style, or an example without a required field.
  """
  if style not in PROMPT_STYLES:
    raise ValueError(f"style={style!r}; known: {sorted(PROMPT_STYLES)}")
  render = PROMPT_STYLES[style]
  examples = list(examples)
  texts, bos = [], []
  for i, ex in enumerate(examples):
    for key in ("prompt_id", "problem", "answer"):
      if key not in ex:
        raise ValueError(f"examples[{i}] has no field {key!r}")
    text, add_bos = render(ex["problem"], tokenizer)
    texts.append(text)
    bos.append(add_bos)
  # One batched call per BOS setting keeps the Rust tokenizer's parallelism.
  encoded: list[list[int]] = [[] for _ in texts]
  for flag in (False, True):
    rows = [i for i, b in enumerate(bos) if b == flag]
    for i, ids in zip(
      rows, tokenizer.encode_many([texts[i] for i in rows], add_bos=flag), strict=True
    ):
      encoded[i] = ids
  keep = [i for i, ids in enumerate(encoded) if len(ids) <= max_prompt_tokens]
  dropped = len(examples) - len(keep)
  if dropped:
    logging.info(
      "build_prompts: dropped %d of %d prompts over %d tokens",
      dropped,
      len(examples),
      max_prompt_tokens,
    )
  return PromptSet(
    prompt_ids=tuple(examples[i]["prompt_id"] for i in keep),
    problems=tuple(examples[i]["problem"] for i in keep),
    answers=tuple(examples[i]["answer"] for i in keep),
    sources=tuple(examples[i].get("source", "") for i in keep),
    tokens=tuple(np.asarray(encoded[i], dtype=np.int32) for i in keep),
    num_dropped=dropped,
  )


# --------------------------------------------------------------------------- iterator


class PromptIterator:
  """Seeded, resumable order over N prompts: batches of B indices, epoch after epoch.

  Epoch e visits the prompts in the permutation `np.random.default_rng([seed, e])` (or in
  order when `shuffle=False`); with `drop_remainder` the last N mod B prompts of an epoch
  are skipped so that a batch never holds a prompt twice, otherwise batches run on into the
  next epoch. The order depends only on (seed, N, B, shuffle), so every process of a
  multi-host run draws the same batches (DESIGN.md §4), and `state()` — three ints — is
  all a checkpoint needs (DESIGN.md §7).
  """

  def __init__(
    self,
    num_prompts: int,
    batch_size: int,
    *,
    seed: int,
    shuffle: bool = True,
    drop_remainder: bool = True,
  ):
    if num_prompts <= 0 or batch_size <= 0:
      raise ValueError(f"num_prompts={num_prompts} and batch_size={batch_size} must be > 0")
    if drop_remainder and batch_size > num_prompts:
      raise ValueError(
        f"batch_size={batch_size} > num_prompts={num_prompts} with "
        "drop_remainder=True: no full batch exists"
      )
    self.num_prompts = int(num_prompts)
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.shuffle = shuffle
    self.drop_remainder = drop_remainder
    self.epoch = 0
    self.position = 0
    self._order_epoch = -1
    self._order = np.empty(0, np.int64)

  def _epoch_order(self, epoch: int) -> np.ndarray:
    if epoch != self._order_epoch:
      if self.shuffle:
        self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)
      else:
        self._order = np.arange(self.num_prompts)
      self._order_epoch = epoch
    return self._order

  def __iter__(self) -> PromptIterator:
    return self

  def __next__(self) -> np.ndarray:
    """The next int64[B] prompt indices."""
    out = []
    need = self.batch_size
    while need:
      take = self._epoch_order(self.epoch)[self.position : self.position + need]
      out.append(take)
      need -= len(take)
      self.position += len(take)
      # Advance eagerly so that a state saved between batches is canonical.
      left = self.num_prompts - self.position
      if left == 0 or (self.drop_remainder and left < self.batch_size):
        self.epoch, self.position = self.epoch + 1, 0
    return np.concatenate(out).astype(np.int64)

  def state(self) -> dict[str, np.ndarray]:
    """The checkpointable state: int64 scalars `seed`, `epoch`, `position`, `num_prompts`."""
    return {
      k: np.asarray(getattr(self, k), np.int64)
      for k in ("seed", "epoch", "position", "num_prompts")
    }

  def restore(self, state: Mapping[str, Any]) -> None:
    """Continues from `state()` of an iterator over the same prompts.

    Raises:
      ValueError: the state belongs to a different prompt count or is out of range.
    """
    n = int(state["num_prompts"])
    if n != self.num_prompts:
      raise ValueError(
        f"state is for {n} prompts, this iterator has {self.num_prompts}: the "
        "prompt set changed since the checkpoint"
      )
    position = int(state["position"])
    if not 0 <= position < n or int(state["epoch"]) < 0:
      raise ValueError(f"bad iterator state {dict(state)}")
    self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), position
    self._order_epoch = -1
