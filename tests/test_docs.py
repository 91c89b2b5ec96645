"""Every `ada_jax.…` dotted name and every repository file path that the package's
docstrings and comments, docs/*.md, README.md and configs/*.py mention exists: a module
that is renamed or a function that moves fails here instead of leaving a pointer to
nowhere. Names in shell commands (`python -m ada_jax.main`) must resolve as modules."""

import ast
import dataclasses
import importlib
import importlib.util
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# A dotted name starting at the package; a trailing sentence full stop is not part of it.
DOTTED = re.compile(r"(?<![\w./])ada_jax(?:\.[A-Za-z_]\w*)+")
# `python -m MODULE` names a module, never an attribute.
RUN_MODULE = re.compile(r"-m\s+(ada_jax(?:\.[A-Za-z_]\w*)+)")
# A path inside the repository: one of its top-level folders, then a file with a suffix.
PATH = re.compile(
  r"(?<![\w./-])((?:ada_jax|configs|docs|tests|colab|experiments)(?:/[\w.-]+)*/[\w-]+\.\w+)"
)


# A path given to one of these flags is a file the command writes, not one that exists.
OUTPUT_FLAG = re.compile(r"--(?:out|json|workdir)=$")


def _sources() -> list[pathlib.Path]:
  files = sorted((ROOT / "ada_jax").rglob("*.py"))
  files += sorted((ROOT / "docs").glob("*.md"))
  files += [ROOT / "README.md"]
  files += sorted((ROOT / "configs").glob("*.py"))
  return files


def _mentions(pattern: re.Pattern) -> list[tuple[str, str]]:
  """(where, text) of each match, where is `path:line`; a command's output paths left out."""
  found = []
  for path in _sources():
    for number, line in enumerate(path.read_text().splitlines(), 1):
      for match in pattern.finditer(line):
        if OUTPUT_FLAG.search(line[: match.start()]):
          continue
        found.append((f"{path.relative_to(ROOT)}:{number}", match.group(match.lastindex or 0)))
  return found


def _is_module(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except ModuleNotFoundError:  # A parent is not a package.
    return False


def _top_level_names(module: str) -> set[str]:
  """The names a module's source binds at top level, read with `ast` (not imported)."""
  tree = ast.parse(pathlib.Path(importlib.util.find_spec(module).origin).read_text())
  names = set()
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    else:
      for target in getattr(node, "targets", [getattr(node, "target", None)]):
        names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)} if target else set()
  return names


def resolve(name: str) -> None:
  """Checks that `name` denotes a module or an attribute: the longest module prefix, then
  `getattr` for the rest (a dataclass field without a default counts as an attribute). A
  command-line module defines its absl flags when imported, and two of them in one process
  collide, so its first attribute is looked up in its source instead.

  Raises:
    LookupError: naming the first part that does not exist.
  """
  parts = name.split(".")
  used = next((end for end in range(len(parts), 0, -1) if _is_module(".".join(parts[:end]))), 0)
  if not used:
    raise LookupError(f"no module {parts[0]}")
  module = ".".join(parts[:used])
  if used == len(parts):
    return
  if "DEFINE_" in pathlib.Path(importlib.util.find_spec(module).origin).read_text():
    if parts[used] not in _top_level_names(module):
      raise LookupError(f"{module} has no attribute {parts[used]!r}")
    return
  obj = importlib.import_module(module)
  for part in parts[used:]:
    if hasattr(obj, part):
      obj = getattr(obj, part)
    elif dataclasses.is_dataclass(obj) and part in {f.name for f in dataclasses.fields(obj)}:
      return  # A field without a default: nothing further down can be looked up.
    else:
      raise LookupError(f"{'.'.join(parts[:used])} has no attribute {part!r}")
    used += 1


def test_resolve_catches_a_stale_name():
  resolve("ada_jax.rl.rules.AdaConfig")
  resolve("ada_jax.main")
  with pytest.raises(LookupError, match="ada_jax has no attribute 'adaptive'"):
    resolve("ada_jax.adaptive.run_step")
  with pytest.raises(LookupError, match="ada_jax.rollout has no attribute 'streaming'"):
    resolve("ada_jax.rollout.streaming.StreamRollouts")


def test_patterns_find_names_and_paths():
  assert DOTTED.findall("see `ada_jax.rl.adaptive.run_step`. Then") == [
    "ada_jax.rl.adaptive.run_step"
  ]
  assert DOTTED.findall("in ../ada_jax.x or ada_jax/x.py") == []
  assert RUN_MODULE.findall("python -m ada_jax.main --config=c") == ["ada_jax.main"]
  assert PATH.findall("fields in `ada_jax/config.py`, tests in tests/test_x.py.") == [
    "ada_jax/config.py",
    "tests/test_x.py",
  ]
  assert SHORT.findall("`rl.judge` and `loop.rl_step` but not rl.judge") == [
    "rl.judge",
    "loop.rl_step",
  ]
  assert _is_setting("rl.verifier.judge") and _is_setting("data.source")
  assert not _is_setting("rl.judge") and not _is_setting("rl.stream")


def test_dotted_names_resolve():
  stale = []
  for where, name in _mentions(DOTTED):
    try:
      resolve(name)
    except LookupError as e:
      stale.append(f"{where}: {name} ({e})")
  assert not stale, "stale dotted names:\n" + "\n".join(stale)


def test_run_module_names_are_modules():
  mentions = _mentions(RUN_MODULE)
  stale = [f"{where}: python -m {name}" for where, name in mentions if not _is_module(name)]
  assert not stale, "`python -m` names that are not modules:\n" + "\n".join(stale)


def test_file_paths_exist():
  stale = [f"{where}: {p}" for where, p in _mentions(PATH) if not (ROOT / p).exists()]
  assert not stale, "paths to no file:\n" + "\n".join(stale)


# Names written relative to the package (`rollout.draw.Rollouts`, `loop.rl_step`). `data`,
# `rl` and `eval` are also config groups: `data.source` may be the setting.
SHORT = re.compile(
  r"`((?:models|rewards|rollout|data|rl|eval|inputs|checkpoint|distributed|metrics|loop|platforms"
  r"|plan|testing|evaluate|evaluation|select_prompts)(?:\.[A-Za-z_]\w*)+)`"
)
FILE_NAME = re.compile(r"\.(?:py|md|json|jsonl|npz|png)$")


def _is_setting(name: str) -> bool:
  """`name` is `group.field` of the run config (`config.RunConfig`)."""
  from ada_jax import config

  value = config.RunConfig()
  for part in name.split("."):
    if not dataclasses.is_dataclass(value) or part not in {
      f.name for f in dataclasses.fields(value)
    }:
      return False
    value = getattr(value, part)
  return True


def test_short_names_resolve():
  stale = []
  for where, name in _mentions(SHORT):
    if FILE_NAME.search(name) or _is_setting(name):
      continue
    try:
      resolve(f"ada_jax.{name}")
    except LookupError as e:
      stale.append(f"{where}: {name} ({e})")
  assert not stale, "stale package-relative names:\n" + "\n".join(stale)


# --------------------------------------------------------------------------- plan figures


def _plan(target: str, config: str) -> dict:
  rows = json.loads((ROOT / "experiments" / "results" / f"memory_plan_{target}.json").read_text())
  return next(r for r in rows["rows"] if r["config"] == config)


def _peak(row: dict) -> tuple[float, float, str]:
  """(GiB, usable GiB, phase) of a plan row's largest phase, as the docs round them."""
  phase, p = max(row["phases"].items(), key=lambda kv: kv[1]["gib"])
  return round(p["gib"], 2), round(p["gib"] + p["spare_gib"], 2), phase


def _slots(row: dict) -> tuple[int, int]:
  c = row["run_config"]
  return c["sampler"]["chunk_rows"], c["eval"]["sampler"]["chunk_rows"]


def test_readme_plan_figures_are_the_committed_plans():
  """README's sentence on the TPU defaults quotes the committed XLA:TPU plans: slots and
  the peak phase (it once said 192 slots and 12.3 GiB in the train step, long after the
  plan moved to 304 slots peaking at 15.07 GiB in the evaluation phase)."""
  text = " ".join((ROOT / "README.md").read_text().split())
  m = re.search(
    r"(\d+) rollout and (\d+) evaluation slots;.*?: ([\d.]+) GiB of ([\d.]+) per device at the "
    r"peak \(the (\w+) phase\), and the 7B Qwen config fits a v4-32 with (\d+) rollout and "
    r"(\d+) evaluation slots \(([\d.]+) GiB of ([\d.]+) at the peak, the (\w+) phase\)",
    text,
  )
  assert m, "README's plan sentence changed shape: update this test with it"
  llama, qwen = _plan("v5e-8", "llama3b_pos"), _plan("v4-32", "qwen_math7b_pos")
  assert (int(m[1]), int(m[2])) == _slots(llama)
  assert (float(m[3]), float(m[4]), m[5]) == _peak(llama)
  assert (int(m[6]), int(m[7])) == _slots(qwen)
  assert (float(m[8]), float(m[9]), m[10]) == _peak(qwen)


def test_gpu_doc_slots_and_table_are_the_committed_plans():
  text = " ".join((ROOT / "docs" / "gpu.md").read_text().split())
  m = re.search(
    r"llama3b_pos: (\d+) rollout and (\d+) evaluation slots on a v5e-8; qwen_math7b_pos: "
    r"(\d+) rollout and (\d+) evaluation slots on a v4-32",
    text,
  )
  assert m, "docs/gpu.md's slots sentence changed shape: update this test with it"
  assert (int(m[1]), int(m[2])) == _slots(_plan("v5e-8", "llama3b_pos"))
  assert (int(m[3]), int(m[4])) == _slots(_plan("v4-32", "qwen_math7b_pos"))
  rows = re.findall(
    r"^\| (\w+) \| (h\d00x8) \| (\d+) / (\d+) / (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| "
    r"([\d.]+) \| ([\d.]+) \|",
    (ROOT / "docs" / "gpu.md").read_text(),
    re.M,
  )
  assert len(rows) == 6
  for config, host, slots, prompts, eval_slots, *gib in rows:
    row = _plan(host, f"{config}:{host}")
    assert (int(slots), int(eval_slots)) == _slots(row), (config, host)
    assert int(prompts) == row["run_config"]["sampler"]["prompts_per_chunk"], (config, host)
    phases = [round(row["phases"][k]["gib"], 2) for k in ("train", "sample", "prefill", "eval")]
    usable = round(row["phases"]["train"]["gib"] + row["phases"]["train"]["spare_gib"], 2)
    assert [float(g) for g in gib] == [*phases, usable], (config, host)
