"""Chat templates as transformers renders them, without importing transformers.

A template is compiled under the environment `PreTrainedTokenizerFast.apply_chat_template`
uses: sandboxed jinja2 with `trim_blocks`, `lstrip_blocks`, `loopcontrols`, the
`{% generation %}` tag, `raise_exception`, `strftime_now` and a non-escaping `tojson`.
`read_templates` finds a folder's named templates (tokenizer_config.json's `chat_template`
field, overridden by template files, as transformers' `from_pretrained` does).
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
from collections.abc import Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Newer transformers saves templates as separate files, which take precedence over the
# `chat_template` field of tokenizer_config.json (as transformers loads them).
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"


# --------------------------------------------------------------------------- jinja


class _GenerationTag(jinja2.ext.Extension):
  """Accepts `{% generation %}...{% endgeneration %}` and renders its body unchanged.

  transformers uses the tag to track assistant spans; without the extension such templates
  would not even parse.
  """

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # jinja's own `tojson` HTML-escapes '<', '>', '&' and "'", which would put escapes into
  # tool schemas and change the prompt; transformers replaces it with plain json.dumps.
  return json.dumps(
    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


# The most characters a rendered prompt may have: far beyond any prompt a run can use
# (`max_prompt_tokens` is at most a few thousand tokens), far below a memory bomb.
MAX_RENDERED = 1 << 20


class ChatTemplateError(ValueError):
  """A chat template that does not compile, raises, or renders without bound, named with
  the file it came from."""


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
  """The sandbox with a bound on what its operators build: a sequence from `*` or `+` over
  `MAX_RENDERED` long, a power over 64, an integer over 4,096 bits (`'x' * 10**9`, doubling
  a string in a loop, `10 ** 10**9` would otherwise take the host's memory or hours). Not a
  full resource limit: filters (`center(10**8)`) and deep loops are bounded only by the
  output cap of `render` and jinja's own range limit."""

  intercepted_binops = frozenset(["*", "**", "+"])

  def call_binop(self, context, operator, left, right):
    sized = [x for x in (left, right) if isinstance(x, (str, list, tuple))]
    count = next((x for x in (left, right) if isinstance(x, int)), 1)
    if operator == "*" and sized and len(sized[0]) * max(count, 0) > MAX_RENDERED:
      raise jinja2.exceptions.SecurityError(f"the template builds a value over {MAX_RENDERED} long")
    if operator == "+" and len(sized) == 2 and len(left) + len(right) > MAX_RENDERED:
      raise jinja2.exceptions.SecurityError(f"the template builds a value over {MAX_RENDERED} long")
    if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
      raise jinja2.exceptions.SecurityError(f"the template raises to the power {right}")
    out = super().call_binop(context, operator, left, right)
    if isinstance(out, int) and out.bit_length() > 4096:
      raise jinja2.exceptions.SecurityError("the template builds an integer over 4,096 bits")
    return out


def render(template: str, source: str, **variables) -> str:
  """`template` rendered with `variables`, its output bounded by `MAX_RENDERED` characters.

  Raises:
    ChatTemplateError: naming `source` (the template's file): a syntax error, an error the
      template raises (`raise_exception`, a bad operation on the messages, a division by
      zero, a recursion too deep), a value `_BoundedEnvironment` refuses, an output over
      `MAX_RENDERED` characters.
  """
  out, size = [], 0
  try:
    for piece in compile_template(template).generate(**variables):
      size += len(piece)
      if size > MAX_RENDERED:
        raise jinja2.exceptions.SecurityError(f"the rendered prompt is over {MAX_RENDERED} long")
      out.append(piece)
  except (
    jinja2.exceptions.TemplateError,
    TypeError,
    ValueError,
    AttributeError,
    KeyError,
    ArithmeticError,
    RecursionError,
  ) as e:
    where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
    raise ChatTemplateError(f"chat template of {source}{where}: {type(e).__name__}: {e}") from None
  return "".join(out)


@functools.cache
def _jinja_env() -> ImmutableSandboxedEnvironment:
  # Templates come from checkpoint folders, i.e. untrusted code: sandboxed, immutable
  # (no list.append), as in transformers. `dict`, `range`, `namespace` are jinja defaults.
  env = _BoundedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env


@functools.lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
  """`template` compiled under transformers' chat-template environment (cached)."""
  return _jinja_env().from_string(template)


def read_templates(
  folder: pathlib.Path, config: dict | None, config_path: pathlib.Path
) -> dict[str, str]:
  """Named chat templates of a folder ('default' for the unnamed one); empty when none.

  Args:
    folder: the tokenizer folder.
    config: its tokenizer_config.json, parsed (its `chat_template` field), or None.
    config_path: that file's path, for error messages.

  Raises:
    ValueError: a `chat_template` field that is neither a string nor a list of
      {name, template} objects (naming the file).
  """
  templates: dict[str, str] = {}
  raw = (config or {}).get("chat_template")
  if isinstance(raw, str):
    templates["default"] = raw
  elif isinstance(raw, list):
    for i, entry in enumerate(raw):
      if not (
        isinstance(entry, Mapping)
        and isinstance(entry.get("name"), str)
        and isinstance(entry.get("template"), str)
      ):
        raise ValueError(
          f"{config_path}: field 'chat_template'[{i}] must be an object with "
          f"string 'name' and 'template', got {entry!r}"
        )
      templates[entry["name"]] = entry["template"]
  elif raw is not None:
    raise ValueError(
      f"{config_path}: field 'chat_template' must be a string or a list of "
      f"{{name, template}} objects, got {type(raw).__name__}"
    )
  # Template files override the config field, as transformers' from_pretrained does.
  files = {}
  if (folder / TEMPLATE_FILE).exists():
    files["default"] = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
  if (folder / TEMPLATE_DIR).is_dir():
    for f in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
      files[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
  return files or templates
