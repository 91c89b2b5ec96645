"""Every command line (`main`, `evaluate`, `select_prompts`, `plan`) ends a bad input in
one line on stderr and the exit code README.md's table gives it, never a traceback.

The inputs run in one subprocess: it imports the libraries once, then forks a child per
command line (each runs the module as `python -m` would), so the whole set costs about one
interpreter start instead of one each."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from test_loop import _write_config

from ada_jax import config as config_lib
from ada_jax import saved_params
from ada_jax.models import decoder as model_lib
from ada_jax.models import weights

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARITH_TOKENIZER = ROOT / "ada_jax" / "data" / "assets" / "arith_tokenizer"

# Runs each case (module, argv, stdout/stderr file stem) in a forked child of one process
# that has imported what the command lines import; prints {stem: exit code} as JSON.
DRIVER = textwrap.dedent(
  """
  import json, os, runpy, sys
  from ada_jax import checkpoint, cli, config, loop, runstate  # the shared imports, once
  from ada_jax import policy, selection
  from ada_jax.data import sets
  sets.reachable = lambda url, timeout_s=3.0: False  # no test reaches the network
  codes = {}
  for module, argv, stem in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
      out = os.open(stem + ".out", os.O_WRONLY | os.O_CREAT, 0o644)
      err = os.open(stem + ".err", os.O_WRONLY | os.O_CREAT, 0o644)
      os.dup2(out, 1)
      os.dup2(err, 2)
      sys.argv = [module, *argv]
      code = 0
      try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
      except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
      except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)
    codes[stem] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
  print(json.dumps(codes))
  """
)

# absl's log lines (`W1202 10:00:00.000 123 file.py:10] ...`) and the notice absl's C++
# logging prints before its first line (the dev requirements' CUDA compile plugin logs
# "no CUDA here" from C++ at start-up): the process's facts, not the error's line.
_LOG_LINE = re.compile(r"^([IWEF]\d{4} |WARNING: All log messages before absl::InitializeLog\(\))")


def _model_folder(path: pathlib.Path, cfg: config_lib.RunConfig) -> pathlib.Path:
  """A Hugging Face folder of the tiny model with the arithmetic tokenizer."""
  model_config = cfg.model.model_config()
  weights.save_hf(model_config, model_lib.init_params(model_config, jax.random.key(0)), path)
  for name in os.listdir(ARITH_TOKENIZER):
    shutil.copy(ARITH_TOKENIZER / name, path / name)
  return path


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
  """The cases, run: {name: (exit code, stderr, expected code, expected text)}."""
  tmp = tmp_path_factory.mktemp("bad_inputs")
  config_file = _write_config(tmp, 4)
  from test_loop import tiny_config

  cfg = config_lib.parse(tiny_config(4))
  a_file = tmp / "a_file"
  a_file.write_text("not a folder\n")
  other = tmp / "other_model"  # a checkpoint of params of another tree and shapes
  saved_params.save_params(other / "1", {"embed": jnp.ones((3, 5))})
  good = _model_folder(tmp / "hf_good", cfg)
  truncated = tmp / "hf_truncated"
  shutil.copytree(good, truncated)
  data = (good / "model.safetensors").read_bytes()
  (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
  empty = tmp / "hf_empty"
  shutil.copytree(good, empty)
  (empty / "model.safetensors").write_bytes(b"")
  broken = tmp / "hf_broken_config"
  shutil.copytree(good, broken)
  (broken / "config.json").write_text('{"model_type": "llama",')
  not_gguf = tmp / "not.gguf"
  not_gguf.write_bytes(b"GGUF but not really")
  conf, tok = f"--config={config_file}", f"--tokenizer_dir={ARITH_TOKENIZER}"
  main_w, eval_w, sel_w = (f"--workdir={tmp / n}" for n in ("main", "eval", "select"))
  cases = {
    # name: (module, argv, exit code, text of the one line)
    "main_empty_workdir": ("ada_jax.main", [conf, "--workdir="], 2, "--workdir is empty"),
    "main_workdir_file": ("ada_jax.main", [conf, f"--workdir={a_file}"], 2, "not a directory"),
    "main_batch_0": (
      "ada_jax.main",
      [conf, main_w, "--config.rl.batch_prompts=0"],
      2,
      "config.rl: batch_prompts must be >= 1, got 0",
    ),
    "main_timeout_1e9": (
      "ada_jax.main",
      [conf, main_w, "--config.rl.verifier.timeout_s=1e9"],
      2,
      "config.rl.verifier.timeout_s=1000000000.0: must be in (0, 86400]",
    ),
    "main_top_p_2": (
      "ada_jax.main",
      [conf, main_w, "--config.eval.sampler.top_p=2.0"],
      2,
      "config.eval.sampler",
    ),
    "main_unknown_field": (
      "ada_jax.main",
      [conf, main_w, "--config.rl.batch_prompt=3"],
      2,
      "no field named by config.rl.batch_prompt",
    ),
    "main_unknown_gpu_host": (
      "ada_jax.main",
      [f"--config={ROOT / 'configs' / 'llama3b_pos.py'}:h100", main_w],
      2,
      "llama3b_pos.py:h100: no GPU host settings named 'h100' in this config (known: ['h100x8', '",
    ),
    "main_host_on_a_config_without_hosts": (
      "ada_jax.main",
      [f"--config={ROOT / 'configs' / 'tiny_arith_pos.py'}:h100x8", main_w],
      2,
      "tiny_arith_pos.py has no host settings (its get_config() takes no argument)",
    ),
    "eval_host_on_a_config_without_hosts": (
      "ada_jax.evaluate",
      [f"--config={ROOT / 'configs' / 'tiny_arith_pos.py'}:v5e", eval_w, "--checkpoint=1"],
      2,
      "drop ':v5e'",
    ),
    "gguf_missing_file": (
      "ada_jax.models.from_gguf",
      [str(tmp / "none.gguf"), str(tmp / "gguf_out")],
      2,
      "none.gguf: no such GGUF file",
    ),
    "gguf_out_is_a_file": (
      "ada_jax.models.from_gguf",
      [str(not_gguf), str(a_file)],
      2,
      "exists and is not a folder",
    ),
    "gguf_not_a_gguf": (
      "ada_jax.models.from_gguf",
      [str(not_gguf), str(tmp / "gguf_out")],
      2,
      "not a readable GGUF file",
    ),
    "main_init_from_other_model": (
      "ada_jax.main",
      [conf, main_w, f"--config.ckpt.init_from={other}"],
      2,
      "another model",
    ),
    "eval_empty_workdir": ("ada_jax.evaluate", [conf, "--workdir=", "--checkpoint=1"], 2, "empty"),
    "eval_missing_checkpoint": (
      "ada_jax.evaluate",
      [conf, eval_w, "--checkpoint=7"],
      2,
      "--checkpoint=7",
    ),
    "eval_other_model": (
      "ada_jax.evaluate",
      [conf, eval_w, "--checkpoint=1", f"--checkpoint_dir={other}"],
      2,
      "another model",
    ),
    "eval_truncated_weights": (
      "ada_jax.evaluate",
      [conf, eval_w, f"--hf_dir={truncated}", tok],
      2,
      f"{truncated}/model.safetensors: not a readable safetensors file",
    ),
    "eval_empty_weights": (
      "ada_jax.evaluate",
      [conf, eval_w, f"--hf_dir={empty}", tok],
      2,
      f"{empty}/model.safetensors",
    ),
    "eval_broken_config_json": (
      "ada_jax.evaluate",
      [conf, eval_w, f"--hf_dir={broken}", tok],
      2,
      f"{broken}/config.json: not valid JSON",
    ),
    "eval_k_0": ("ada_jax.evaluate", [conf, eval_w, "--checkpoint=1", "--k=0"], 2, "k"),
    "select_k_0": ("ada_jax.select_prompts", [conf, sel_w, "--k=0"], 2, "a bad flag"),
    "select_bad_rule": ("ada_jax.select_prompts", [conf, sel_w, "--rules=hard"], 2, "rule"),
    "select_missing_checkpoint": (
      "ada_jax.select_prompts",
      [conf, sel_w, "--checkpoint=9"],
      2,
      "--checkpoint=9",
    ),
    "select_other_model": (
      "ada_jax.select_prompts",
      [conf, sel_w, "--checkpoint=1", f"--checkpoint_dir={other}"],
      2,
      "another model",
    ),
    "select_workdir_file": (
      "ada_jax.select_prompts",
      [conf, f"--workdir={a_file}"],
      2,
      "not a directory",
    ),
    "plan_unwritable_json": (
      "ada_jax.plan",
      [conf, "--topology=v5e-8", f"--json={tmp / 'no_such_folder' / 'plan.json'}"],
      2,
      "--json=",
    ),
    "plan_unknown_slice": ("ada_jax.plan", [conf, "--topology=v9-1"], 2, "unknown TPU slice"),
    "plan_unknown_field": (
      "ada_jax.plan",
      [conf, "--topology=v5e-8", "--config.rl.batchsize=3"],
      2,
      "batchsize",
    ),
    "plan_gpu_mem_fraction": (
      "ada_jax.plan",
      [conf, "--topology=h100x8", "--mem_fraction=1.5"],
      2,
      "--mem_fraction=1.5: must be in (0, 1]",
    ),
    "plan_batch_0": (
      "ada_jax.plan",
      [conf, "--topology=v5e-8", "--config.rl.batch_prompts=0"],
      2,
      "batch_prompts",
    ),
  }
  runs = [(module, argv, str(tmp / name)) for name, (module, argv, _, _) in cases.items()]
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  proc = subprocess.run(
    [sys.executable, "-c", DRIVER, json.dumps(runs)],
    cwd=tmp,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  codes = json.loads(proc.stdout.strip().splitlines()[-1])
  return {
    name: (codes[str(tmp / name)], (tmp / f"{name}.err").read_text(), code, text)
    for name, (_, _, code, text) in cases.items()
  }


CASES = [
  "main_empty_workdir",
  "main_workdir_file",
  "main_batch_0",
  "main_timeout_1e9",
  "main_top_p_2",
  "main_unknown_field",
  "main_unknown_gpu_host",
  "main_host_on_a_config_without_hosts",
  "eval_host_on_a_config_without_hosts",
  "gguf_missing_file",
  "gguf_out_is_a_file",
  "gguf_not_a_gguf",
  "main_init_from_other_model",
  "eval_empty_workdir",
  "eval_missing_checkpoint",
  "eval_other_model",
  "eval_truncated_weights",
  "eval_empty_weights",
  "eval_broken_config_json",
  "eval_k_0",
  "select_k_0",
  "select_bad_rule",
  "select_missing_checkpoint",
  "select_other_model",
  "select_workdir_file",
  "plan_unwritable_json",
  "plan_unknown_slice",
  "plan_unknown_field",
  "plan_gpu_mem_fraction",
  "plan_batch_0",
]


@pytest.mark.parametrize("name", CASES)
def test_a_bad_input_is_one_line_and_the_documented_code(bad_inputs, name):
  code, stderr, expected_code, text = bad_inputs[name]
  lines = [line for line in stderr.splitlines() if line.strip() and not _LOG_LINE.match(line)]
  assert "Traceback" not in stderr, stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("ada_jax: "), stderr[-3000:]
  assert text in lines[0], lines[0]
  assert code == expected_code, (code, lines[0])


def test_every_case_is_checked(bad_inputs):
  assert sorted(bad_inputs) == sorted(CASES)
