"""Tests for ada_jax.tokenizer: real Llama 3 tokenizer, transformers as the chat-template oracle."""

import json
import re
import shutil

import jinja2
import numpy as np
import pytest

from ada_jax.models import chat_template as chat_template_lib
from ada_jax.models.chat_template import ChatTemplateError
from ada_jax.models.tokenizer import Tokenizer, pad_left

# A Llama-3-style template written for this test. It exercises what transformers' jinja
# environment changes from jinja's defaults: trim_blocks/lstrip_blocks (indented block tags
# on their own lines), loop controls, raise_exception, strftime_now, a non-escaping tojson,
# namespace, and the bos_token variable.
LLAMA3_STYLE_TEMPLATE = """\
{{- bos_token }}
{% if not date_string is defined %}
    {% set date_string = strftime_now("%d %b %Y") %}
{% endif %}
{% set ns = namespace(turns=0) %}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] | trim %}
    {% set rest = messages[1:] %}
{% else %}
    {% set system = "" %}
    {% set rest = messages %}
{% endif %}
<|start_header_id|>system<|end_header_id|>

Today Date: {{ date_string }}
{% if system %}
{{ system }}
{% endif %}
<|eot_id|>
{% for message in rest %}
    {% if message['role'] not in ['user', 'assistant', 'ipython'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message.get('skip') %}
        {% continue %}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

    {% if message.get('meta') %}
{{ message['meta'] | tojson }}
    {% endif %}
{{ message['content'] | trim }}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

CONVERSATIONS = [
  [{"role": "user", "content": "What is 2+2?"}],
  [
    {
      "role": "system",
      "content": "Please reason step by step, and put your final answer within \\boxed{}.",
    },
    {"role": "user", "content": "Compute $\\frac{1}{2}+\\frac{1}{3}$.  "},
  ],
  [
    {"role": "user", "content": "héllo <b>&</b>", "meta": {"tag": "<é&'>", "n": [1, 2]}},
    {"role": "assistant", "content": "\\boxed{5}"},
    {"role": "user", "content": "ignored", "skip": True},
    {"role": "user", "content": "again", "name": None},
  ],
]


@pytest.fixture(scope="module")
def llama3_dir(shared_dir, tmp_path_factory):
  """A tokenizer folder: the real tokenizer.json plus a config carrying our template."""
  src = shared_dir / "tokenizers" / "llama3" / "tokenizer.json"
  folder = tmp_path_factory.mktemp("llama3")
  (folder / "tokenizer.json").symlink_to(src)
  (folder / "tokenizer_config.json").write_text(
    json.dumps(
      {
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "special": True},
        "chat_template": LLAMA3_STYLE_TEMPLATE,
      }
    )
  )
  (folder / "generation_config.json").write_text(
    json.dumps(
      {
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128009],
      }
    )
  )
  return folder


@pytest.fixture(scope="module")
def tok(llama3_dir):
  return Tokenizer.from_dir(llama3_dir)


@pytest.fixture(scope="module")
def oracle(llama3_dir):
  transformers = pytest.importorskip("transformers")
  return transformers.PreTrainedTokenizerFast.from_pretrained(str(llama3_dir))


def _jsonl(path, field):
  return [json.loads(line)[field] for line in path.read_text().splitlines() if line.strip()]


def test_special_ids_from_configs(tok):
  assert tok.bos_id == 128000
  # tokenizer_config's eos first, then generation_config's, deduplicated.
  assert tok.eos_ids == (128009, 128001)
  assert tok.pad_id == 128009  # Llama 3 has no pad token: first stop id
  assert tok.vocab_size == 128256
  assert tok.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def test_round_trip_real_problems(tok, shared_dir):
  data = shared_dir / "data"
  texts = _jsonl(data / "gsm8k_test.jsonl", "question") + _jsonl(
    data / "math500_test.jsonl", "problem"
  )
  assert len(texts) == 1319 + 500
  ids = tok.encode_many(texts)
  assert all(len(i) > 5 for i in ids)
  decoded = tok.decode_many(ids)
  mismatches = [i for i, (a, b) in enumerate(zip(decoded, texts, strict=True)) if a != b]
  assert mismatches == []
  # Single-text path agrees with the batched one.
  assert tok.encode(texts[7]) == ids[7]
  assert tok.decode(np.asarray(ids[7], np.int32)) == texts[7]


def test_encode_bos_and_decode_skips_special(tok):
  ids = tok.encode("Hello world", add_bos=True)
  assert ids[0] == 128000 and ids[1:] == tok.encode("Hello world")
  with_stop = ids + [128009]
  assert tok.decode(with_stop) == "Hello world"
  assert tok.decode(with_stop, skip_special_tokens=False) == (
    "<|begin_of_text|>Hello world<|eot_id|>"
  )
  # Special-token strings inside text map to their ids (chat-template output relies on it).
  assert tok.encode("<|eot_id|>") == [128009]


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, oracle, conv, add_generation_prompt):
  kwargs = {"date_string": "26 Jul 2024"}
  ours = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, **kwargs)
  theirs = oracle.apply_chat_template(
    conv, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
  )
  assert ours == theirs
  theirs_ids = oracle.apply_chat_template(
    conv, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt, **kwargs
  )
  assert tok.encode(ours) == list(theirs_ids)


def test_chat_template_details(tok, oracle):
  # strftime_now, trim_blocks/lstrip_blocks, tojson without HTML escaping.
  conv = CONVERSATIONS[2]
  ours = tok.apply_chat_template(conv)
  assert ours == oracle.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
  assert re.match(
    r"<\|begin_of_text\|>\n<\|start_header_id\|>system<\|end_header_id\|>\n\n"
    r"Today Date: \d\d \w\w\w \d{4}\n<\|eot_id\|>\n",
    ours,
  )
  assert '{"tag": "<é&\'>", "n": [1, 2]}' in ours
  assert "ignored" not in ours
  assert ours.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
  assert not any(line.startswith(" ") for line in ours.splitlines())


def test_raise_exception_in_template(tok, oracle):
  bad = [{"role": "robot", "content": "x"}]
  with pytest.raises(ChatTemplateError, match="chat template of .*unknown role robot"):
    tok.apply_chat_template(bad)
  with pytest.raises(jinja2.TemplateError, match="unknown role robot"):
    oracle.apply_chat_template(bad, tokenize=False)


@pytest.mark.parametrize(
  ("template", "words"),
  [
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),  # a syntax error
    (
      "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}"
      "{% endif %}",
      "System role not supported",
    ),  # Gemma/Mistral-style, meeting a system line
    ("{{ messages[0].content + 1 }}", "TypeError"),  # an operation the messages do not allow
    ("{{ 'x' * 1000000000 }}", "builds a value over"),  # a memory bomb
    ("{{ 10 ** 100000000 }}", "raises to the power"),  # hours of arithmetic
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "rendered prompt is over"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    (
      "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
      "{% endfor %}",
      "builds a value over",
    ),  # doubling a string
    (
      "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
      "{% endfor %}",
      "integer over 4,096 bits",
    ),  # squaring an integer
  ],
)
def test_a_bad_template_is_one_error_naming_its_folder(tmp_path, template, words):
  from ada_jax.data import arith

  folder = tmp_path / "tok"
  shutil.copytree(arith.TOKENIZER_DIR, folder)
  (folder / "chat_template.jinja").write_text(template)
  tok = Tokenizer.from_dir(folder)
  with pytest.raises(ChatTemplateError, match=f"chat template of {re.escape(str(folder))}") as e:
    tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
  assert words in str(e.value) and "\n" not in str(e.value)


def test_pad_left_of_encoded_texts(tok):
  texts = ["a", "Hello world, how are you?", ""]
  ids, mask = pad_left(tok.encode_many(texts), tok.pad_id, pad_to_multiple=8)
  assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == (3, 8)
  lengths = [len(tok.encode(t)) for t in texts]
  np.testing.assert_array_equal(mask.sum(1), lengths)
  for row, n in enumerate(lengths):
    assert not mask[row, : 8 - n].any() and mask[row, 8 - n :].all()
    assert list(ids[row, 8 - n :]) == tok.encode(texts[row])
    assert (ids[row, : 8 - n] == tok.pad_id).all()
  ids, _ = pad_left(tok.encode_many(texts), tok.pad_id, length=12)
  assert ids.shape == (3, 12)
  ids, _ = pad_left(tok.encode_many(texts), tok.pad_id, buckets=(4, 16, 64))
  assert ids.shape == (3, 16)
  with pytest.raises(ValueError, match="sequence 1 has"):
    pad_left(tok.encode_many(texts), tok.pad_id, length=3)
  with pytest.raises(ValueError, match="largest bucket"):
    pad_left(tok.encode_many(texts), tok.pad_id, buckets=(2, 4))


def test_pad_left_literal():
  ids, mask = pad_left([[5, 6], [7], []], pad_id=0, length=3)
  np.testing.assert_array_equal(ids, [[0, 5, 6], [0, 0, 7], [0, 0, 0]])
  np.testing.assert_array_equal(mask, [[0, 1, 1], [0, 0, 1], [0, 0, 0]])


# ------------------------------------------------------------------ folder variants, errors


def _folder(tmp_path, llama3_dir, config=None, generation=None):
  folder = tmp_path / "tok"
  folder.mkdir()
  (folder / "tokenizer.json").symlink_to((llama3_dir / "tokenizer.json").resolve())
  if config is not None:
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / "tokenizer_config.json").write_text(text)
  if generation is not None:
    (folder / "generation_config.json").write_text(json.dumps(generation))
  return folder


def test_tokenizer_json_alone_needs_overrides(tmp_path, llama3_dir):
  folder = _folder(tmp_path, llama3_dir)
  with pytest.raises(ValueError, match="eos_ids"):
    Tokenizer.from_dir(folder)
  tok = Tokenizer.from_dir(
    folder,
    eos_ids=["<|eot_id|>", 128001],
    pad_id=0,
    bos_id=128000,
    chat_template="{{ bos_token }}{{ messages[0]['content'] }}",
  )
  assert tok.eos_ids == (128009, 128001) and tok.pad_id == 0 and tok.bos_id == 128000
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|begin_of_text|>hi"
  no_template = Tokenizer.from_dir(folder, eos_ids=[128009])
  assert no_template.bos_id is None
  with pytest.raises(ValueError, match="no chat template") as e:
    no_template.apply_chat_template([{"role": "user", "content": "hi"}])
  # A user of the command lines is told which config fields help, not a Python argument.
  assert "config.tokenizer.dir" in str(e.value) and "prompt_style" in str(e.value)
  assert "chat_template=" not in str(e.value)


def test_named_templates_and_template_file(tmp_path, llama3_dir):
  config = {
    "eos_token": "<|eot_id|>",
    "chat_template": [
      {"name": "default", "template": "D{{ messages[0]['content'] }}"},
      {"name": "tool_use", "template": "T{{ messages[0]['content'] }}"},
    ],
  }
  folder = _folder(tmp_path, llama3_dir, config)
  msg = [{"role": "user", "content": "x"}]
  assert Tokenizer.from_dir(folder).apply_chat_template(msg) == "Dx"
  assert Tokenizer.from_dir(folder, chat_template="tool_use").apply_chat_template(msg) == "Tx"
  # chat_template.jinja overrides the config field, as in transformers.
  (folder / chat_template_lib.TEMPLATE_FILE).write_text("J{{ messages[0]['content'] }}")
  assert Tokenizer.from_dir(folder).apply_chat_template(msg) == "Jx"


def test_several_templates_without_default(tmp_path, llama3_dir):
  config = {
    "eos_token": "<|eot_id|>",
    "chat_template": [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}],
  }
  folder = _folder(tmp_path, llama3_dir, config)
  with pytest.raises(ValueError, match=r"\['a', 'b'\]\): point config\.tokenizer\.dir"):
    Tokenizer.from_dir(folder)


def test_missing_tokenizer_json(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
  ("config", "generation", "match"),
  [
    ("{not json", None, r"tokenizer_config.json: malformed JSON"),
    ("[1, 2]", None, r"tokenizer_config.json: expected a JSON object"),
    (
      {"eos_token": "<|eot_id|>", "chat_template": 5},
      None,
      r"tokenizer_config.json: field 'chat_template'",
    ),
    (
      {"eos_token": "<|eot_id|>", "chat_template": [{"name": "x"}]},
      None,
      r"tokenizer_config.json: field 'chat_template'\[0\]",
    ),
    (
      {"eos_token": "<|no_such_token|>"},
      None,
      r"tokenizer_config.json: field 'eos_token': token '<\|no_such_token\|>'",
    ),
    (
      {"bos_token": {"id": 3}, "eos_token": "<|eot_id|>"},
      None,
      r"tokenizer_config.json: field 'bos_token'",
    ),
    ({}, {"eos_token_id": "eot"}, r"generation_config.json: field 'eos_token_id'"),
    ({}, {"eos_token_id": [999999]}, r"eos_ids=999999 is outside the vocabulary"),
  ],
)
def test_malformed_config_names_file_and_field(tmp_path, llama3_dir, config, generation, match):
  folder = _folder(tmp_path, llama3_dir, config, generation)
  with pytest.raises(ValueError, match=match):
    Tokenizer.from_dir(folder)


def test_a_template_that_raises_at_set_up_is_a_config_error(tmp_path):
  """The run's set-up renders the training prompts: a template that raises on the config's
  system line is one ConfigError naming the data group and the template's folder."""
  from ada_jax import inputs
  from ada_jax.config import ConfigError
  from ada_jax.data import arith, prompts

  folder = tmp_path / "tok"
  shutil.copytree(arith.TOKENIZER_DIR, folder)
  (folder / "chat_template.jinja").write_text(
    "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
  )
  d = prompts.DataConfig(source="arith_text", arith_prompts=4)
  with pytest.raises(
    ConfigError, match=rf"config\.data .*chat template of {re.escape(str(folder))}"
  ):
    inputs.load_prompts(d, Tokenizer.from_dir(folder), seed=0)
