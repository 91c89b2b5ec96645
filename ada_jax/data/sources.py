"""The maths sets' sources and the user's JSONL files, read into examples.

docs/design.md "Data". `SETS` names each set's JSONL files (`JsonlSource`: file name in a
manual directory, public URL, field names, how the answer is written), `user_jsonl_spec`
describes the user's own files the same way, and `iter_examples` reads a set's split into
examples: four text features, `prompt_id` (stable, e.g. `gsm8k/test/17`,
`math500/test/precalculus/807.json`), `problem`, `answer` (the reference final answer,
LaTeX, extracted as `rewards.references.reference_answer` does) and `source`. `sets` turns
them into TFDS data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Callable, Iterable, Mapping, Sequence

from absl import logging

from ada_jax.rewards import grader as rewards
from ada_jax.rewards import references

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
    reference: key of `references.REFERENCE_ANSWER_FNS` giving the answer extraction of a
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


def _after_hashes(text: str) -> str:
  if "####" not in text:
    raise ValueError("no '####' final-answer marker")
  return references.drop_thousands(text.rsplit("####", 1)[1])


def _boxed(text: str) -> str:
  answer = rewards.last_boxed(text)
  if answer is None:
    raise ValueError("no complete \\boxed{} answer")
  return answer


# The answer field's text (`references.answer_text`) -> the answer.
ANSWER_FORMATS: dict[str, Callable[[str], str]] = {
  "plain": str.strip,
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
    ValueError: no paths, unknown `answer_format`.
  """
  if answer_format not in ANSWER_FORMATS:
    raise ValueError(f"answer_format={answer_format!r}; known: {sorted(ANSWER_FORMATS)}")
  if not paths:
    raise ValueError("jsonl_paths is empty: name the JSONL files to read")
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
  if context is not None and not isinstance(context, str):
    raise ValueError(f"{where}: field {src.context_field!r} is not a string")
  if context and context.strip():
    problem = f"{context.strip()}\n\n{problem}"
  try:
    if src.reference is not None:
      answer = references.reference_answer(src.reference, row)
    else:
      field = src.answer_field
      if field not in row:
        raise ValueError(f"no field {field!r}")
      text = references.answer_text(row[field], field)
      try:
        answer = ANSWER_FORMATS[src.answer_format](text)
      except ValueError as e:
        raise ValueError(f"field {field!r}: {e}") from None
      if not answer:
        raise ValueError(f"field {field!r} gives an empty answer")
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
    ValueError: a malformed line (`file:line` in the message), a duplicate prompt id, a file
      without rows, or a split left without examples.
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
    index = -1
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
    if index < 0:
      raise ValueError(f"{path}: no rows (the file is empty or blank)")
  if not seen:
    raise ValueError(
      f"{spec.name}/{split}: no examples left: every problem is in {[s.file for s in spec.exclude]}"
    )
  if banned:
    logging.info(
      "%s/%s: dropped %d problems found in %s",
      spec.name,
      split,
      dropped,
      [s.file for s in spec.exclude],
    )
