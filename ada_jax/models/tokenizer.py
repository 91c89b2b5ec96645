"""Tokenizer: `tokenizers` (tokenizer.json) plus transformers-compatible chat templates.

A checkpoint folder holds `tokenizer.json` and usually `tokenizer_config.json` (special
tokens, chat template) and `generation_config.json` (stop ids). `Tokenizer.from_dir` reads
them without importing transformers; the chat template is rendered with jinja2 under the
same environment transformers uses (sandboxed, `trim_blocks`, `lstrip_blocks`,
`loopcontrols`, `raise_exception`, `strftime_now`, a non-escaping `tojson`, the
special-token strings as variables), so a prompt renders to the same text, hence the same
ids, as `PreTrainedTokenizerFast.apply_chat_template` (checked in tests/test_tokenizer.py).

Batches are left-padded (docs/design.md "One RL step": prompts end where generation starts) int32
arrays
with a bool mask.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tokenizers

from ada_jax import bounds
from ada_jax.models import chat_template as chat_template_lib

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
  """Which tokenizer a run uses (the run config's `tokenizer` group).

  Attributes:
    dir: folder with tokenizer.json (+ tokenizer_config.json / generation_config.json);
      '' = the model's folder, else the arithmetic task's built-in tokenizer.
    eos_ids: stop token ids overriding the folder's; () = the folder's.
  """

  dir: str = ""
  eos_ids: tuple[int, ...] = bounds.within("[0, 2**31)", ())


_SPECIAL_TOKEN_FIELDS = tuple(
  f"{k}_token" for k in ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
)


# --------------------------------------------------------------------------- files


def _read_json(path: pathlib.Path) -> dict[str, Any] | None:
  """The JSON object in `path`, or None when the file does not exist."""
  if not path.exists():
    return None
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: malformed JSON: {e}") from e
  if not isinstance(data, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
  return data


def _token_string(value: Any, path: pathlib.Path, field: str) -> str | None:
  """A special-token entry of tokenizer_config.json: a string, an AddedToken dict or null."""
  if value is None:
    return None
  if isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  raise ValueError(
    f"{path}: field {field!r} must be a string or an object with a string 'content', got {value!r}"
  )


def _int_list(value: Any, path: pathlib.Path, field: str) -> list[int]:
  """An id field of generation_config.json: an int, a list of ints or null."""
  if value is None:
    return []
  values = value if isinstance(value, list) else [value]
  if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
    raise ValueError(
      f"{path}: field {field!r} must be a non-negative int or a list of them, got {value!r}"
    )
  return list(values)


# --------------------------------------------------------------------------- padding


def pad_left(
  seqs: Sequence[Sequence[int]],
  pad_id: int,
  *,
  length: int | None = None,
  pad_to_multiple: int | None = None,
  buckets: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token sequences into one array.

  The padded length L is `length` if given, else the smallest of `buckets` that holds the
  longest sequence, else the longest length rounded up to `pad_to_multiple` (default 1).

  Args:
    seqs: B token-id sequences.
    pad_id: id written into padding positions (masked out; any valid id works).
    length: fixed padded length.
    pad_to_multiple: round the longest length up to a multiple of this.
    buckets: allowed lengths; the smallest that fits is used (static shapes, docs/design.md
      "Sampler").

  Returns:
    (ids int32[B, L], mask bool[B, L]); mask is True on real tokens, which sit at the right
    end of each row.

  Raises:
    ValueError: a sequence is longer than `length` or than every bucket.
  """
  lengths = [len(s) for s in seqs]
  longest = max(lengths, default=0)
  if length is None:
    if buckets is not None:
      fitting = sorted(b for b in buckets if b >= longest)
      if not fitting:
        raise ValueError(
          f"longest sequence has {longest} tokens, more than the largest bucket "
          f"{max(buckets, default=0)}"
        )
      length = fitting[0]
    else:
      multiple = pad_to_multiple or 1
      length = max(multiple, math.ceil(longest / multiple) * multiple)
  if longest > length:
    row = lengths.index(longest)
    raise ValueError(f"sequence {row} has {longest} tokens, more than length={length}")
  ids = np.full((len(seqs), length), pad_id, dtype=np.int32)
  mask = np.zeros((len(seqs), length), dtype=bool)
  for row, seq in enumerate(seqs):
    if len(seq):
      ids[row, length - len(seq) :] = seq
      mask[row, length - len(seq) :] = True
  return ids, mask


# --------------------------------------------------------------------------- tokenizer


class Tokenizer:
  """A `tokenizers.Tokenizer` with its special ids and chat template.

  Build it with `Tokenizer.from_dir`. Encoding never lets the tokenizer.json
  post-processor add special tokens: `encode(..., add_bos=True)` prepends `bos_id`
  explicitly, so the result does not depend on how a checkpoint configured its
  post-processor, and chat-template text (which writes its own BOS) is not doubled.

  Attributes:
    vocab_size: number of ids, added tokens included (the model's embedding may be larger).
    bos_id: beginning-of-sequence id, or None (Qwen has none).
    eos_ids: stop ids, tuple (Llama 3 Instruct stops on <|eot_id|> and <|end_of_text|>).
    pad_id: id used in padding positions (masked out).
    special_tokens: name -> string, e.g. {'bos_token': '<|begin_of_text|>'}; passed to the
      chat template as variables.
    chat_templates: name -> jinja source ('default' for the folder's unnamed template).
  """

  def __init__(
    self,
    tok: tokenizers.Tokenizer,
    *,
    bos_id: int | None,
    eos_ids: Sequence[int],
    pad_id: int,
    special_tokens: Mapping[str, str],
    chat_templates: Mapping[str, str],
    chat_template: str | None = None,
    source: str = "the tokenizer",
  ):
    self._tok = tok
    self.source = source  # where the files came from, for errors
    self.bos_id = bos_id
    self.eos_ids = tuple(int(i) for i in eos_ids)
    self.pad_id = int(pad_id)
    self.special_tokens = dict(special_tokens)
    self.chat_templates = dict(chat_templates)
    self._template = self._select_template(chat_template)

  @classmethod
  def from_dir(
    cls,
    path: str | pathlib.Path,
    *,
    chat_template: str | None = None,
    eos_ids: Sequence[int | str] | None = None,
    pad_id: int | None = None,
    bos_id: int | None = None,
  ) -> Tokenizer:
    """Loads tokenizer.json and, when present, tokenizer_config.json, generation_config.json
    and chat_template.jinja / additional_chat_templates/*.jinja from a folder.

    Stop ids are the config's `eos_token` followed by generation_config's `eos_token_id`
    (deduplicated, in that order). The pad id is tokenizer_config's `pad_token`, else
    generation_config's `pad_token_id`, else the first stop id (padding is masked, so any
    valid id works; Llama 3 defines none).

    Args:
      path: the folder.
      chat_template: a template name from the folder's templates, or jinja source; default:
        the folder's 'default' template.
      eos_ids: stop ids or token strings; replaces what the configs say.
      pad_id: replaces the configured pad id.
      bos_id: replaces the configured BOS id.

    Returns:
      The tokenizer.

    Raises:
      FileNotFoundError: the folder or its tokenizer.json is missing.
      ValueError: malformed JSON or a bad field (the message names file and field), a token
        string that is not in the vocabulary, or no stop id anywhere (pass `eos_ids`).
    """
    folder = pathlib.Path(path)
    tok_path = folder / TOKENIZER_FILE
    if not tok_path.is_file():
      raise FileNotFoundError(f"{tok_path}: no such file (a tokenizer folder needs tokenizer.json)")
    try:
      tok = tokenizers.Tokenizer.from_file(str(tok_path))
    except Exception as e:  # the Rust error type is not exported
      raise ValueError(f"{tok_path}: cannot be loaded by `tokenizers`: {e}") from e
    config_path = folder / CONFIG_FILE
    gen_path = folder / GENERATION_CONFIG_FILE
    config = _read_json(config_path) or {}
    gen = _read_json(gen_path) or {}

    def token_id(token: str, where: str) -> int:
      i = tok.token_to_id(token)
      if i is None:
        raise ValueError(f"{where}: token {token!r} is not in the vocabulary of {tok_path}")
      return i

    special = {}
    for field in _SPECIAL_TOKEN_FIELDS:
      value = _token_string(config.get(field), config_path, field)
      if value is not None:
        special[field] = value
    special_ids = {f: token_id(s, f"{config_path}: field {f!r}") for f, s in special.items()}

    def configured(name: str, default: int | None) -> int | None:
      # tokenizer_config's `<name>_token`, else generation_config's first `<name>_token_id`.
      if f"{name}_token" in special_ids:
        return special_ids[f"{name}_token"]
      ids = _int_list(gen.get(f"{name}_token_id"), gen_path, f"{name}_token_id")
      return ids[0] if ids else default

    if bos_id is None:
      bos_id = configured("bos", None)
    if eos_ids is not None:
      stops = [token_id(e, "eos_ids override") if isinstance(e, str) else int(e) for e in eos_ids]
    else:
      stops = [special_ids["eos_token"]] if "eos_token" in special_ids else []
      stops += _int_list(gen.get("eos_token_id"), gen_path, "eos_token_id")
    stops = list(dict.fromkeys(stops))
    if not stops:
      raise ValueError(
        f"{folder}: no stop id: neither {CONFIG_FILE} field 'eos_token' nor "
        f"{GENERATION_CONFIG_FILE} field 'eos_token_id' is present; pass eos_ids"
      )
    if pad_id is None:
      pad_id = configured("pad", stops[0])
    vocab = tok.get_vocab_size(with_added_tokens=True)
    for name, value in (*(("eos_ids", s) for s in stops), ("bos_id", bos_id), ("pad_id", pad_id)):
      if value is not None and not 0 <= value < vocab:
        raise ValueError(f"{folder}: {name}={value} is outside the vocabulary [0, {vocab})")
    # Templates that use bos_token/eos_token need strings even when only ids were given.
    if bos_id is not None:
      special.setdefault("bos_token", tok.id_to_token(bos_id))
    special.setdefault("eos_token", tok.id_to_token(stops[0]))
    return cls(
      tok,
      bos_id=bos_id,
      eos_ids=stops,
      pad_id=pad_id,
      special_tokens=special,
      chat_templates=chat_template_lib.read_templates(folder, config, folder / CONFIG_FILE),
      chat_template=chat_template,
      source=str(folder),
    )

  def _select_template(self, chat_template: str | None) -> str | None:
    # Same resolution as transformers' get_chat_template: a name picks a stored
    # template, anything else is template source.
    if chat_template is None:
      if len(self.chat_templates) > 1 and "default" not in self.chat_templates:
        raise ValueError(
          "the tokenizer has several chat templates and none is 'default' "
          f"({sorted(self.chat_templates)}): point config.tokenizer.dir at a folder whose "
          "template is named 'default' (in Python: Tokenizer.from_dir(chat_template=NAME))"
        )
      return self.chat_templates.get("default")
    return self.chat_templates.get(chat_template, chat_template)

  # ------------------------------------------------------------------ properties

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def chat_template(self) -> str | None:
    """The jinja source `apply_chat_template` renders, or None."""
    return self._template

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The underlying `tokenizers.Tokenizer`."""
    return self._tok

  def save(self, path: str | pathlib.Path) -> None:
    """Writes this tokenizer as a Hugging Face folder that `Tokenizer.from_dir` and
    transformers' `AutoTokenizer` / `GenerationConfig` load back.

    Files: tokenizer.json; tokenizer_config.json (tokenizer class
    `PreTrainedTokenizerFast`, the special-token strings as loaded, so the chat template
    renders as it did in the run); chat_template.jinja (the 'default' template) and
    additional_chat_templates/<name>.jinja (named ones); generation_config.json with
    `eos_token_id` = the stop ids (all of them, so that transformers' `generate` and
    inference servers stop where the sampler did), `bos_token_id` and `pad_token_id`.
    Existing files of those names are replaced.

    Args:
      path: the folder (created if missing).
    """
    folder = pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    self._tok.save(str(folder / TOKENIZER_FILE))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens}
    (folder / CONFIG_FILE).write_text(
      json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    for name, template in self.chat_templates.items():
      target = (
        folder / chat_template_lib.TEMPLATE_FILE
        if name == "default"
        else folder / chat_template_lib.TEMPLATE_DIR / f"{name}.jinja"
      )
      target.parent.mkdir(exist_ok=True)
      target.write_text(template, encoding="utf-8")
    generation = {"eos_token_id": list(self.eos_ids), "pad_token_id": self.pad_id}
    if self.bos_id is not None:
      generation["bos_token_id"] = self.bos_id
    (folder / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def id_to_token(self, i: int) -> str | None:
    return self._tok.id_to_token(int(i))

  # ------------------------------------------------------------------ text <-> ids

  def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
    """Token ids of `text`; special-token strings in it map to their ids.

    Args:
      text: the string.
      add_bos: prepend `bos_id` (ignored when the tokenizer has none).

    Returns:
      The ids.
    """
    return self.encode_many([text], add_bos=add_bos)[0]

  def encode_many(self, texts: Sequence[str], *, add_bos: bool = False) -> list[list[int]]:
    """`encode` over many texts (tokenized in parallel by the Rust library)."""
    encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
    prefix = [self.bos_id] if add_bos and self.bos_id is not None else []
    return [prefix + e.ids for e in encs]

  def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> str:
    """Text of `ids` (int sequence or 1-D array); no stopping at EOS, the caller trims."""
    return self.decode_many([ids], skip_special_tokens=skip_special_tokens)[0]

  def decode_many(
    self, rows: Sequence[Sequence[int]] | np.ndarray, *, skip_special_tokens: bool = True
  ) -> list[str]:
    """`decode` of each row (lists of ids, or int[B, L] — trim with masks first)."""
    lists = [np.asarray(r, dtype=np.int64).reshape(-1).tolist() for r in rows]
    return self._tok.decode_batch(lists, skip_special_tokens=skip_special_tokens)

  # ------------------------------------------------------------------ chat

  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
  ) -> str:
    """Renders a conversation with the chat template, as transformers'
    `apply_chat_template(..., tokenize=False)` does.

    Messages are copied with None-valued keys dropped (as transformers normalizes them);
    the template sees `messages`, `add_generation_prompt`, `tools=None`, `documents=None`,
    the special-token strings (`bos_token`, `eos_token`, ...) and `template_kwargs`
    (which override them, e.g. `date_string=` for Llama 3.1, `enable_thinking=` for Qwen3).

    Args:
      messages: [{'role': ..., 'content': ...}, ...].
      add_generation_prompt: end with the assistant header so that generation answers.
      **template_kwargs: extra template variables.

    Returns:
      The prompt text (encode it with `add_bos=False`: templates write their own BOS).

    Raises:
      ValueError: the tokenizer has no chat template, or a message is not a mapping.
      chat_template.ChatTemplateError (a ValueError): the template does not compile, raised
        (e.g. through `raise_exception`) or rendered without bound; it names the folder.
    """
    if self._template is None:
      raise ValueError(
        f"no chat template: the tokenizer folder has no {CONFIG_FILE} field "
        f"'chat_template' and no {chat_template_lib.TEMPLATE_FILE}; point config.tokenizer.dir "
        "at a folder with one (e.g. the instruct model's), or set config.data.prompt_style "
        "(and config.eval.prompt_style) to 'plain', which needs none"
      )
    chat = []
    for i, m in enumerate(messages):
      if not isinstance(m, Mapping):
        raise ValueError(f"messages[{i}] must be a mapping with 'role' and 'content', got {m!r}")
      chat.append({k: v for k, v in m.items() if v is not None})
    variables = {**self.special_tokens, **template_kwargs}
    return chat_template_lib.render(
      self._template,
      self.source,
      messages=chat,
      tools=None,
      documents=None,
      add_generation_prompt=add_generation_prompt,
      **variables,
    )
