"""The package's imports only go down: no cycle, no `ada_jax` import tucked inside a
function to dodge one, every import from a layer to the same or a lower one (the layers of
docs/design.md "Architecture"), and no module over `MAX_LINES` lines. Read from the source
with `ast`, nothing imported."""

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ada_jax"
# These command-line entries may import late on purpose: logging is quieted, the
# multi-process runtime joined (main) or JAX kept off the TPU it compiles for (plan)
# before JAX, and so the library, is first imported.
LATE_IMPORTS_ALLOWED = {"ada_jax.main", "ada_jax.plan.__main__"}

# The layers, lowest first; a module imports only from its own layer or lower ones (the
# most specific prefix places a module; a package's `__init__` imports nothing).
LAYERS = (
  ("models", ("ada_jax.models", "ada_jax.platforms", "ada_jax.bounds")),
  ("rewards", ("ada_jax.rewards",)),
  ("data", ("ada_jax.data",)),
  ("rollout engine", ("ada_jax.rollout",)),
  ("rl", ("ada_jax.rl",)),
  ("evaluation core", ("ada_jax.eval.benchmarks", "ada_jax.eval.cache", "ada_jax.eval.sampling")),
  (
    "run foundation",
    ("ada_jax.config", "ada_jax.checkpoint", "ada_jax.distributed", "ada_jax.metrics")
    + ("ada_jax.inputs", "ada_jax.testing", "ada_jax.runstate", "ada_jax.start")
    + ("ada_jax.checksums", "ada_jax.saved_params"),
  ),
  ("the RL step", ("ada_jax.step",)),
  (
    "run drivers",
    ("ada_jax.loop", "ada_jax.eval.evaluator", "ada_jax.policy", "ada_jax.selection")
    + ("ada_jax.plan",),
  ),
  (
    "command lines",
    ("ada_jax.main", "ada_jax.evaluate", "ada_jax.select_prompts", "ada_jax.plan.__main__")
    + ("ada_jax.cli",),
  ),
)
PACKAGES = {"ada_jax", "ada_jax.models", "ada_jax.rewards", "ada_jax.data", "ada_jax.rl"}
PACKAGES |= {"ada_jax.rollout", "ada_jax.eval", "ada_jax.plan"}

MAX_LINES = 500


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
  parts = path.relative_to(root.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
  return {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _targets(node: ast.AST, module: str, known: set[str]) -> list[str]:
  """The package modules an import statement loads (`from ada_jax import x` names module
  `ada_jax.x` when that is a module, else `ada_jax` itself)."""
  if isinstance(node, ast.Import):
    names = [a.name for a in node.names]
  else:
    base = node.module or ""
    if node.level:  # relative: resolve against the importing module's package
      pkg = module.split(".")[: -node.level] if not module.endswith("__init__") else []
      base = ".".join([*pkg, base] if base else pkg)
    names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
  return [n for n in names if n in known]


def _imports(root: pathlib.Path = PACKAGE) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
  """(module-level edges, function-level edges) between the package's modules."""
  known = set(_modules(root))
  top: dict[str, set[str]] = {m: set() for m in known}
  late: dict[str, set[str]] = {m: set() for m in known}
  for module, path in _modules(root).items():
    tree = ast.parse(path.read_text(), str(path))
    inside = set()
    for fn in ast.walk(tree):
      if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        inside.update(id(n) for n in ast.walk(fn) if n is not fn)
    for node in ast.walk(tree):
      if isinstance(node, ast.Import | ast.ImportFrom):
        edges = late if id(node) in inside else top
        edges[module].update(t for t in _targets(node, module, known) if t != module)
  return top, late


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
  """One cycle of the graph as a list of modules, or None (depth-first search)."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(m):
    state[m] = 1
    path.append(m)
    for t in sorted(edges[m]):
      if state.get(t) == 1:
        return path[path.index(t) :] + [t]
      if t not in state and (found := visit(t)):
        return found
    state[m] = 2
    path.pop()
    return None

  for m in sorted(edges):
    if m not in state and (found := visit(m)):
      return found
  return None


def test_module_imports_have_no_cycle():
  known = set(_modules())
  top, _ = _imports()
  assert len(known) > 20 and sum(map(len, top.values())) > 40  # the walk sees the package
  cycle = _cycle(top)
  assert cycle is None, " -> ".join(cycle)


def test_no_function_level_import_hides_a_cycle():
  """Every import inside a function is one that could sit at the top of its module: with
  them added, the graph still has no cycle; and only the entry module has any."""
  known = set(_modules())
  top, late = _imports()
  both = {m: top[m] | late[m] for m in known}
  cycle = _cycle(both)
  assert cycle is None, "a function-level import closes " + " -> ".join(cycle)
  hidden = {m: sorted(t) for m, t in late.items() if t and m not in LATE_IMPORTS_ALLOWED}
  assert not hidden, f"move these imports to the top of their modules: {hidden}"


def _layer(module: str) -> int:
  """Index in `LAYERS` of the longest prefix naming `module`."""
  best = (-1, -1)
  for i, (_, prefixes) in enumerate(LAYERS):
    for prefix in prefixes:
      if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[1]:
        best = (i, len(prefix))
  if best[0] < 0:
    raise KeyError(f"{module} is in no layer of tests/test_imports.py LAYERS: place it")
  return best[0]


def _upward(edges: dict[str, set[str]]) -> list[str]:
  """Imports from a lower layer to a higher one, as 'a (layer) -> b (layer)'."""
  out = []
  for module, targets in sorted(edges.items()):
    if module in PACKAGES:
      continue
    for target in sorted(targets):
      if _layer(target) > _layer(module):
        name = lambda m: f"{m} ({LAYERS[_layer(m)][0]})"
        out.append(f"{name(module)} -> {name(target)}")
  return out


def test_imports_only_go_down_the_layers():
  top, late = _imports()
  edges = {m: top[m] | late[m] for m in top}
  for module in edges.keys() - PACKAGES:
    _layer(module)  # every module has its place (KeyError names one that has none)
  assert _upward(edges) == []
  # The check has teeth: the decoder importing the loop, or the run config importing a
  # command line, would be refused.
  planted = {"ada_jax.models.decoder": {"ada_jax.loop"}, "ada_jax.config": {"ada_jax.main"}}
  assert len(_upward({**edges, **planted})) == 2


def test_the_rollout_engine_needs_only_the_model():
  """`rollout/` is self-contained: it imports the model, the bottom layer's field bounds
  and itself, nothing of the RL algorithm or the run (the step module, above both, joins
  them)."""
  top, late = _imports()
  for module in [m for m in top if m.startswith("ada_jax.rollout")]:
    outside = {
      t
      for t in top[module] | late[module]
      if not t.startswith(("ada_jax.models", "ada_jax.rollout", "ada_jax.bounds"))
    }
    assert outside == set(), f"{module} imports {sorted(outside)}"


def test_every_module_is_at_most_max_lines():
  over = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    name = path.relative_to(PACKAGE.parent).as_posix()
    lines = len(path.read_text().splitlines())
    if lines > MAX_LINES:
      over[name] = lines
  assert over == {}, f"split these modules along their responsibilities (> {MAX_LINES} lines)"


@pytest.mark.parametrize("late", [False, True])
def test_the_walk_finds_a_planted_cycle(tmp_path, late):
  """The checks have teeth: in a two-module package `a` imports `b` at the top, and `b`
  imports `a` at the top (a cycle) or inside a function (a hidden one)."""
  pkg = tmp_path / "ada_jax"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from ada_jax import b\n")
  (pkg / "b.py").write_text("def f():\n  from ada_jax import a\n" if late else "import ada_jax.a\n")
  top, hidden = _imports(pkg)
  both = {m: top[m] | hidden[m] for m in top}
  assert _cycle(both) in (
    ["ada_jax.a", "ada_jax.b", "ada_jax.a"],
    ["ada_jax.b", "ada_jax.a", "ada_jax.b"],
  )
  assert (_cycle(top) is None) == late and (hidden["ada_jax.b"] == {"ada_jax.a"}) == late


# A platform's name compared with a string: `== "tpu"`, `"gpu" !=`, `in ("tpu", "gpu")`.
_PLATFORM = r"(?:tpu|gpu|cpu|cuda|rocm)"
PLATFORM_COMPARE = re.compile(
  rf"""(?:[!=]=|\bin)\s*[(\[{{]?\s*["']{_PLATFORM}["']|["']{_PLATFORM}["']\s*(?:[!=]=|\bin\b)"""
)
# The modules that own the platforms' traits (`platforms.Platform`) and the targets.
PLATFORM_OWNERS = {"ada_jax/platforms.py", "ada_jax/plan/targets.py"}


def test_only_the_targets_compare_a_platform_name():
  """A choice that depends on the compiler asks a trait of `ada_jax.platforms`, so a new
  platform is one table entry, not an edit in every module that tests a name."""
  found = []
  for path in sorted(PACKAGE.rglob("*.py")):
    name = path.relative_to(PACKAGE.parent).as_posix()
    for i, line in enumerate(path.read_text().splitlines(), 1):
      if name not in PLATFORM_OWNERS and PLATFORM_COMPARE.search(line.split("#")[0]):
        found.append(f"{name}:{i}: {line.strip()}")
  assert found == []
  planted = ['if sharding.platform(mesh) == "tpu":', "x = p != 'gpu'", 'if kind in ("tpu", "gpu"):']
  assert all(PLATFORM_COMPARE.search(line) for line in planted)
  assert not PLATFORM_COMPARE.search('JAX_PLATFORMS="cpu"') and not PLATFORM_COMPARE.search(
    'platform="gpu",'
  )
