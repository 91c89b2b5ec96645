"""What a run reads before anything compiles: its model's architecture and tokenizer, and
its training prompts (the evaluation's data: `eval.evaluator.Evaluator.make`).

Shared by the training loop (`loop`), the evaluation command (`evaluate`) and prompt
selection (`select_prompts`), so that all three tokenize exactly alike. Every failure is
a `config.ConfigError` naming the config field to change.
"""

from __future__ import annotations

import json
import pathlib

from absl import logging

from ada_jax.config import ConfigError
from ada_jax.data import arith, prompts, sources, verl
from ada_jax.data import sets as data
from ada_jax.models import decoder as model_lib
from ada_jax.models import folder as folder_lib
from ada_jax.models.chat_template import ChatTemplateError
from ada_jax.models.decoder import ModelConfig
from ada_jax.models.tokenizer import Tokenizer, TokenizerConfig
from ada_jax.models.weights import ModelSpec


def load_model_files(
  model: ModelSpec, tokenizer: TokenizerConfig, *, hf_field: str = "config.model.hf_dir"
) -> tuple[pathlib.Path | None, ModelConfig, Tokenizer]:
  """The model's Hugging Face folder (None for a preset; a Hub id is downloaded here, once,
  when online), its architecture and the run's tokenizer (from `tokenizer.dir`, else the
  model's folder, else the arithmetic task's built-in one), checked against each other
  before any weights are read.

  Raises:
    ConfigError: an unreadable folder (naming `hf_field`), an unreadable tokenizer, an
      architecture `ModelConfig` rejects, or a tokenizer larger than the model's
      vocabulary (naming `config.model`).
  """
  model_dir = hf_config = None
  if model.hf_dir:
    try:
      model_dir = folder_lib.resolve(model.hf_dir).absolute()
      hf_config = json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as e:  # its message names no file
      raise ConfigError(f"{hf_field}: {model_dir / 'config.json'}: not valid JSON ({e})") from None
    except (OSError, ValueError) as e:
      raise ConfigError(f"{hf_field}: {e}") from None
  # The built-in tokenizer takes the config's stop ids like any folder's (they were
  # recorded and ignored).
  folder = tokenizer.dir or model_dir or arith.TOKENIZER_DIR
  try:
    tok = Tokenizer.from_dir(folder, eos_ids=tokenizer.eos_ids or None)
  except (OSError, ValueError) as e:
    field = (
      "config.tokenizer.dir"
      if tokenizer.dir
      else f"{hf_field} (its tokenizer)"
      if model_dir
      else "config.tokenizer.eos_ids (the built-in tokenizer)"
    )
    raise ConfigError(f"{field}: {e}") from None
  try:
    model_config = model.model_config(hf_config)
    model_lib.check_vocab(model_config, tok.vocab_size)
  except ValueError as e:
    raise ConfigError(f"config.model: {e}") from None
  return model_dir, model_config, tok


def load_prompts(d: prompts.DataConfig, tokenizer: Tokenizer, *, seed: int) -> prompts.PromptSet:
  """The training prompts of the `data` group `d`, tokenized (too-long ones dropped and
  counted); `seed` draws the arithmetic task's problems.

  Raises:
    ConfigError: naming the `config.data` field of a bad source, file or row.
  """
  if d.source == "verl":
    examples = _verl_examples(d)
    kept = verl.drop_long_problems(examples, tokenizer)
    if len(kept) < len(examples):
      logging.warning(
        "%d of %d unformatted prompts over %d problem tokens dropped (the authors' reformat.py)",
        len(examples) - len(kept),
        len(examples),
        verl.REFORMAT_MAX_PROBLEM_TOKENS,
      )
    examples, style = kept, d.prompt_style
  elif d.source in ("arith", "arith_text"):
    question = d.source == "arith_text"
    examples = arith.examples(d.arith, "train", d.arith_prompts, seed=seed, question=question)
    # The bare `12+3=` of the character tokenizer is its own format (`arith.prompt_ids`).
    style = d.prompt_style if question else "raw"
  else:
    if d.source == "jsonl":
      try:
        spec = sources.user_jsonl_spec(
          "user",
          d.jsonl_paths,
          problem_field=d.problem_field,
          answer_field=d.answer_field,
          answer_format=d.answer_format,
          exclude_math500=d.exclude_math500,
        )
      except (OSError, ValueError) as e:
        raise ConfigError(f"config.data: {e}") from None
    elif d.source in sources.SETS:
      spec = d.source
    else:
      raise ConfigError(
        f"config.data.source {d.source!r}: use 'arith', 'arith_text', 'jsonl', 'verl' or one of "
        f"{sorted(sources.SETS)}"
      )
    data_dir = data.tfds_data_dir(d.data_dir)
    try:
      examples = data.load_examples(
        spec, d.split, data_dir=data_dir, manual_dir=d.manual_dir or None
      )
    except (OSError, ValueError) as e:  # a bad file (named, with its line) or no network
      raise ConfigError(
        f"config.data: {' '.join(str(e).split())}{data.offline_hint(e, 'config.data.manual_dir')}"
      ) from None
    style = d.prompt_style
  try:
    prompts.check_frame(style, d.frame)
  except ValueError as e:
    why = " (source 'arith' is the bare problem)" if d.source == "arith" else ""
    raise ConfigError(f"config.data.{e}{why}") from None
  try:
    ps = prompts.build_prompts(
      examples, tokenizer, style=style, max_prompt_tokens=d.max_prompt_tokens, frame=d.frame
    )
  except ChatTemplateError as e:  # the folder's template met the config's frame
    raise ConfigError(f"config.data (prompt_style {style!r}): {e}") from None
  if ps.num_dropped:
    logging.warning(
      "%d training prompts over %d tokens dropped", ps.num_dropped, d.max_prompt_tokens
    )
  return ps


def _verl_examples(d: prompts.DataConfig) -> list[dict]:
  """The examples of `d.verl_set` (source 'verl'), every failure a ConfigError."""
  if not d.verl_set:
    raise ConfigError("config.data.verl_set: empty; source 'verl' needs a Hub id or a path")
  if d.prompt_style != "chat":
    raise ConfigError(
      f"config.data.prompt_style {d.prompt_style!r}: source 'verl' renders each row's own "
      "chat messages through the chat template; use 'chat'"
    )
  try:
    return verl.load_examples(d.verl_set, d.split, manual_dir=d.manual_dir or None)
  except (OSError, ValueError) as e:
    hint = ""
    if isinstance(e, ConnectionError):
      name = d.verl_set.split("/")[-1]
      hint = (
        f"; download it where there is network (`huggingface-cli download {d.verl_set} "
        f"--repo-type dataset --local-dir DIR/{name}`) and set config.data.manual_dir to DIR, "
        "or config.data.verl_set to the folder"
      )
    raise ConfigError(f"config.data.verl_set: {' '.join(str(e).split())}{hint}") from None
