"""The Colab notebooks: saved clean, every cell parses, their library imports resolve, and
01/02 run top to bottom in small mode (`ADA_JAX_NOTEBOOK_SMALL=1`) in a kernel of this venv.

03 (Llama-3.2-3B on TPU) is not executed: its config cell is run against the real config
file for 1, 4 and 8 devices and must pass the library's own checks.
"""

import ast
import importlib
import json
import pathlib
import re
import sys
import types

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLAB = ROOT / "colab"
NOTEBOOKS = ("01_quickstart", "02_adaptive_sampling", "03_llama3b_tpu")
BADGE = "https://colab.research.google.com/github/ada-jax/ada_jax/blob/main/colab/{}.ipynb"
LIBRARIES = ("ada_jax", "configs")
MAGIC = re.compile(r"^(\s*)[%!].*$", re.MULTILINE)


def _read(name: str) -> nbformat.NotebookNode:
  return nbformat.read(COLAB / f"{name}.ipynb", as_version=4)


def _python(source: str) -> str:
  """A cell's source with IPython magics / shell lines replaced by `pass` (same indent)."""
  return MAGIC.sub(lambda m: f"{m.group(1)}pass", source)


def _code(nb) -> list[str]:
  return [_python(c.source) for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_saved_clean_with_badge(name):
  nb = _read(name)
  nbformat.validate(nb)
  assert nb.nbformat == 4
  first = nb.cells[0]
  assert first.cell_type == "markdown" and first.source.startswith("# ")
  assert BADGE.format(name) in first.source
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, "save without outputs"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_cells_parse_and_library_names_exist(name):
  """Every `ada_jax` / `configs` import resolves, and every attribute taken from an
  imported library module (`loop.run`, `evaluate.load_model`, ...) exists."""
  modules: dict[str, types.ModuleType] = {}
  checked = 0
  for source in _code(_read(name)):
    tree = ast.parse(source)
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        for alias in node.names:
          if alias.name.split(".")[0] in LIBRARIES:
            module = importlib.import_module(alias.name)
            local = alias.asname or alias.name.split(".")[0]
            modules[local] = module if alias.asname else sys.modules[local]
      elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
        module = importlib.import_module(node.module)
        for alias in node.names:
          if not hasattr(module, alias.name):  # a submodule not yet imported
            importlib.import_module(f"{node.module}.{alias.name}")
          assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
          value = getattr(module, alias.name)
          if isinstance(value, types.ModuleType):
            modules[alias.asname or alias.name] = value
    for node in ast.walk(tree):
      if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in modules
      ):
        module = modules[node.value.id]
        assert hasattr(module, node.attr), f"{module.__name__} has no {node.attr}"
        checked += 1
  assert checked >= 3, "the notebook should use the library"


@pytest.mark.parametrize("devices", [1, 4, 8])
def test_llama_notebook_config_passes_the_library_checks(devices):
  """03's parameter and config cells, run for a runtime with `devices` devices, give a
  config that parses, whose batch fits the mesh and whose sampler chunks split over it; its
  evaluation-settings cell, run after them, gives an evaluation config that parses too."""
  import jax

  from ada_jax import config as config_lib
  from ada_jax.models import sharding
  from ada_jax.rl import train

  cells = _code(_read("03_llama3b_tpu"))
  params = next(c for c in cells if "HF_DIR =" in c)
  config_cell = next(c for c in cells if "llama3b_balance.get_config()" in c)
  eval_cell = next(c for c in cells if "config.eval.k = EVAL_K" in c)
  namespace = {"jax": types.SimpleNamespace(device_count=lambda: devices)}
  sys.path.insert(0, str(ROOT))
  try:
    exec(compile(params, "params", "exec"), namespace)
    exec(compile(config_cell, "config", "exec"), namespace)
    cfg = config_lib.parse(namespace["config"])
    exec(compile(eval_cell, "eval settings", "exec"), namespace)
  finally:
    sys.path.remove(str(ROOT))
  evaluation = config_lib.parse(namespace["config"]).eval
  assert evaluation.benchmarks == ("math500",) and evaluation.k == namespace["EVAL_K"]
  assert evaluation.sampler.max_new_tokens == namespace["MAX_NEW_TOKENS"]
  assert cfg.rl.steps == namespace["STEPS"] and cfg.eval.benchmarks == ()
  mesh = sharding.make_mesh(
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=jax.devices()[:devices]
  )
  train.check_batch_layout(cfg.train_rows, cfg.train, mesh)
  rows = mesh.shape["data"] * mesh.shape["fsdp"]
  assert cfg.sampler.chunk_rows % rows == 0 and cfg.prompts_per_chunk % rows == 0


def _execute(name: str, monkeypatch, **env) -> nbformat.NotebookNode:
  import nbclient
  from jupyter_client.kernelspec import KernelSpecManager

  # jupyter_client starts a kernel whose argv[0] is 'python' with sys.executable: this venv.
  assert KernelSpecManager().get_kernel_spec("python3").argv[0] in ("python", sys.executable)
  monkeypatch.setenv("ADA_JAX_NOTEBOOK_SMALL", "1")
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  nb = _read(name)
  client = nbclient.NotebookClient(
    nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(COLAB)}}
  )
  client.execute()  # raises CellExecutionError on the first failing cell
  return nb


def _outputs(nb, kind: str) -> list:
  return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == kind]


def _text(nb) -> str:
  return "".join(o.text for o in _outputs(nb, "stream") if o.name == "stdout")


@pytest.mark.slow  # ~50 s on 2 cores
def test_quickstart_runs(monkeypatch, tmp_path):
  workdir = tmp_path / "run"
  nb = _execute("01_quickstart", monkeypatch, ADA_JAX_NOTEBOOK_WORKDIR=str(workdir))
  assert not _outputs(nb, "error")
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [line["step"] for line in lines] == [1, 2, 3]
  assert all(line["samples_drawn"] >= 64 * 8 for line in lines)  # >= one round of M=8
  assert (workdir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert any("image/png" in o.data for o in _outputs(nb, "display_data"))
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps_done"] == 3
  text = _text(nb)
  assert re.search(r"eval/arith/avg@2 +before RL \d\.\d{3} +after RL \d\.\d{3}", text)
  samples = re.findall(r"-> .*? reward [01] +\(answer \d+\)", text, re.S)
  assert len(samples) == 16  # 4 problems x 4 samples


def test_adaptive_sampling_runs(monkeypatch):
  nb = _execute("02_adaptive_sampling", monkeypatch)
  text = _text(nb)
  scored = int(re.search(r"scored prompts per method: N = (\d+)", text).group(1))
  assert scored == 2 * 1024  # small mode: 2 scored epochs of 1024 prompts
  checks = re.findall(r"grpo_n(\d+): simulated signal ([\d.]+), closed form ([\d.]+)", text)
  assert [int(n) for n, _, _ in checks] == [4, 8, 16, 32]
  for _, simulated, exact in checks:
    assert abs(float(simulated) - float(exact)) < 4 * 0.5 / scored**0.5
  pos = re.search(
    r"ada_pos: simulated samples/prompt ([\d.]+), signal ([\d.]+); "
    r"closed form ([\d.]+), ([\d.]+)",
    text,
  )
  assert float(pos.group(1)) == pytest.approx(float(pos.group(3)), rel=0.05)
  assert re.search(r"exit rule \(k_pos, k_neg\) = \(2, 2\)", text)
  figures = [o for o in _outputs(nb, "display_data") if "image/png" in o.data]
  assert len(figures) == 3  # pass-rate histogram, cost vs signal, rounds
  table = [o for o in _outputs(nb, "display_data") if "text/markdown" in o.data]
  assert "| ada_balance |" in table[0].data["text/markdown"]
