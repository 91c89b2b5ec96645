"""Prompt sets in verl's layout (Parquet, or the same rows as JSONL), read into examples.

The authors train on filtered prompt sets published as verl-format files
(`RLHFlow/reinforce_ada_hard_prompt`, `..._easy_prompt`, `..._hard_prompt_llama`, the
1.5B variants; docs/design.md "Data"). A row, as the authors' `data_process/reformat.py`
and most verl recipes write it:

  data_source: str               the set's name
  prompt: [{role, content}, ...] the chat messages, used as given (their own system line)
  ability: str                   e.g. 'math'
  reward_model: {style: 'rule', ground_truth: str}   the reference answer
  extra_info: {split, index}

Only `prompt` and `reward_model.ground_truth` are required; `data_source` becomes the
example's `source`. Rows in the authors' unformatted layout (`problem`, `gt`: what
`reformat.py` reads; the Hub prompt sets hold these) are turned into the verl layout as
`reformat.py` does: its system message, its instruction after the problem, and its filter
(`drop_long_problems`: a problem over 700 tokens of the model's tokenizer is dropped).

Where the files are (`resolve`): a local file or folder; else `<manual_dir>/<name>` for a
Hub id `owner/name` (the offline rule of every other set); else the Hub data set,
downloaded once into the Hugging Face cache when online. Parquet is read with pyarrow
directly (no TFDS preparation: the files are already columnar and hold ~10^4 rows).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ada_jax.data import prompts, sets, sources
from ada_jax.models import folder as folder_lib

SUFFIXES = (".parquet", ".jsonl")
_HUB = "https://huggingface.co"
# reformat.py keeps an unformatted row when `len(tokenizer.encode(problem)) <= 700`.
REFORMAT_MAX_PROBLEM_TOKENS = 700


def resolve(name: str, manual_dir: str | pathlib.Path | None = None) -> list[pathlib.Path]:
  """The data files of a verl-format set, sorted.

  Args:
    name: a local `.parquet` / `.jsonl` file, a folder holding them (searched
      recursively), or a Hub data set id `owner/name`.
    manual_dir: folder searched for `<name after the slash>` (file or folder) before
      the Hub is asked.

  Raises:
    FileNotFoundError: a local path or folder without data files, or a name that is no
      Hub id; the message names it.
    ConnectionError: a Hub id neither in `manual_dir` nor downloadable (offline).
  """
  local = pathlib.Path(name).expanduser()
  candidates = [local]
  if manual_dir and folder_lib.is_hub_id(name):
    candidates.append(pathlib.Path(manual_dir) / name.split("/")[1])
  for path in candidates:
    if path.exists():
      return _data_files(path)
  if not folder_lib.is_hub_id(name):
    raise FileNotFoundError(f"{name}: no such file or folder (and not a Hub data set id)")
  where = f"{candidates[-1]}" if len(candidates) > 1 else "a manual directory (none set)"
  if not sets.reachable(_HUB):  # the one quick probe every other set uses
    raise ConnectionError(f"{name}: not at {where}, and huggingface.co is unreachable (offline?)")
  try:
    import huggingface_hub

    folder = huggingface_hub.snapshot_download(
      name, repo_type="dataset", allow_patterns=[f"*{s}" for s in SUFFIXES]
    )
  except Exception as e:  # unknown, gated or offline: one message for all
    raise ConnectionError(
      f"{name}: not at {where} and not downloadable from the Hub ({type(e).__name__}: {e})"
    ) from None
  return _data_files(pathlib.Path(folder))


def _data_files(path: pathlib.Path) -> list[pathlib.Path]:
  if path.is_file():
    if path.suffix not in SUFFIXES:
      raise FileNotFoundError(f"{path}: not a {' or '.join(SUFFIXES)} file")
    return [path]
  files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
  if not files:
    raise FileNotFoundError(f"{path}: no {' or '.join(SUFFIXES)} files in this folder")
  return files


def split_files(files: Sequence[pathlib.Path], split: str) -> list[pathlib.Path]:
  """The files of `split`: those whose name starts with it (`train.parquet`,
  `train-00000-of-00001.parquet`), or all of them when none does."""
  named = [f for f in files if f.name.startswith(split)]
  return named or list(files)


def read_rows(path: pathlib.Path) -> Iterable[tuple[str, dict]]:
  """(where, row) for each row of a Parquet or JSONL file; `where` is `file: row i`
  (0-based) for Parquet and `file:line (row i)` for JSONL.

  Raises:
    ValueError: an unreadable file, or a JSONL line that is not a JSON object (named).
  """
  if path.suffix == ".parquet":
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
      table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
      raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    for i, row in enumerate(table.to_pylist()):
      yield f"{path}: row {i}", row
  else:
    for i, (lineno, row) in enumerate(sources.read_jsonl(path)):
      yield f"{path}:{lineno} (row {i})", row


def _messages(value: Any, where: str) -> list[dict[str, str]]:
  if isinstance(value, str):  # JSONL writers sometimes store the list as a JSON string
    try:
      value = json.loads(value)
    except json.JSONDecodeError:
      pass
  if not isinstance(value, (list, tuple)) or not value:
    raise ValueError(f"{where}: field 'prompt' is not a non-empty list of chat messages")
  out = []
  for j, m in enumerate(value):
    if not isinstance(m, Mapping):
      raise ValueError(f"{where}: field 'prompt[{j}]' is not a {{role, content}} message")
    for key in ("role", "content"):
      if not isinstance(m.get(key), str) or (key == "role" and not m[key]):
        raise ValueError(f"{where}: field 'prompt[{j}].{key}' is missing or not a string")
    out.append({"role": m["role"], "content": m["content"]})
  if not any(m["role"] == "user" and m["content"].strip() for m in out):
    raise ValueError(f"{where}: field 'prompt' has no non-empty user message")
  return out


def _a(noun: str) -> str:
  return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def _answer(value: Any, where: str, field: str) -> str:
  # Only text: a float column turns a missing answer into NaN, whose text 'nan' a
  # `\boxed{nan}` would match, and a float's text is not the number as written (1e-05).
  if not isinstance(value, str):
    kind = "missing" if value is None else f"{_a(type(value).__name__)} ({value!r}), not a string"
    raise ValueError(f"{where}: field {field!r} is {kind}")
  text = value.strip()
  if not text:
    raise ValueError(f"{where}: field {field!r} is empty")
  return text


def example(row: Mapping[str, Any], where: str, prompt_id: str) -> dict[str, Any]:
  """One example (`prompt_id`, `problem`, `answer`, `source`, `messages`) from a row.

  `problem` is the last user message (for logs and decontamination); `messages` is what
  the chat template renders (`prompts.build_prompts`). An unformatted row's example also
  holds `reformat_problem`, its problem as `reformat.py` measures it (`drop_long_problems`).

  Raises:
    ValueError: a missing or malformed field; the message is `<where>: field <name> ...`.
  """
  if "prompt" not in row and "problem" in row:  # the authors' unformatted layout
    problem = _answer(row.get("problem"), where, "problem")
    messages = [
      {"role": "system", "content": prompts.SYSTEM_PROMPT},
      {"role": "user", "content": f"{problem} {prompts.USER_SUFFIX}"},
    ]
    answer = _answer(row.get("gt"), where, "gt")
    extra = {"reformat_problem": problem}
  else:
    extra = {}
    if "prompt" not in row:
      raise ValueError(f"{where}: no field 'prompt' (verl layout) or 'problem' (unformatted)")
    messages = _messages(row["prompt"], where)
    reward_model = row.get("reward_model")
    if isinstance(reward_model, str):
      try:
        reward_model = json.loads(reward_model)
      except json.JSONDecodeError:
        pass
    if not isinstance(reward_model, Mapping):
      raise ValueError(f"{where}: field 'reward_model' is missing or not a mapping")
    answer = _answer(reward_model.get("ground_truth"), where, "reward_model.ground_truth")
  source = row.get("data_source")
  return {
    "prompt_id": prompt_id,
    "problem": next(m["content"] for m in reversed(messages) if m["role"] == "user"),
    "answer": answer,
    "source": source if isinstance(source, str) and source else "verl",
    "messages": tuple(messages),
    **extra,
  }


def drop_long_problems(examples: Sequence[dict[str, Any]], tokenizer) -> list[dict[str, Any]]:
  """`examples` without the unformatted rows whose problem is over
  `REFORMAT_MAX_PROBLEM_TOKENS` tokens, as the authors' `data_process/reformat.py` filters
  the Hub prompt sets before training (its `encode` adds the BOS token where the tokenizer
  has one). Rows already in the verl layout were filtered by whoever wrote them.

  Args:
    examples: from `load_examples`.
    tokenizer: the model's (`models.tokenizer.Tokenizer`).
  """
  raw = [i for i, ex in enumerate(examples) if "reformat_problem" in ex]
  lengths = tokenizer.encode_many([examples[i]["reformat_problem"] for i in raw], add_bos=True)
  long = {i for i, ids in zip(raw, lengths, strict=True) if len(ids) > REFORMAT_MAX_PROBLEM_TOKENS}
  return [ex for i, ex in enumerate(examples) if i not in long]


def load_examples(
  name: str, split: str = "train", *, manual_dir: str | pathlib.Path | None = None
) -> list[dict[str, Any]]:
  """All examples of a verl-format set's split, in file and row order.

  Prompt ids are `<set>/<file stem>/<row>` (stable while the files are); `<set>` is the
  Hub name after the slash, the folder's name, or a file's folder's name.

  Raises:
    FileNotFoundError, ConnectionError: from `resolve`.
    ValueError: a malformed row (file, row and field named) or an empty split.
  """
  files = split_files(resolve(name, manual_dir), split)
  named = pathlib.Path(name.rstrip("/"))
  stem = (named.parent.name if named.suffix in SUFFIXES else named.name) or "verl"
  out = []
  for path in files:
    for i, (where, row) in enumerate(read_rows(path)):
      out.append(example(row, where, f"{stem}/{path.stem}/{i}"))
  if not out:
    raise ValueError(f"{name}: no rows in {', '.join(str(f) for f in files)}")
  return out
