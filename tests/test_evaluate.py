"""Tests of ada_jax.evaluate (reports and the CLI): the Markdown table, and end-to-end CLI
runs on a tiny random Llama (real Llama 3 tokenizer, MATH500) and on the arithmetic task,
with full experiment configs built on `configs/common.py` as the training runs use."""

import dataclasses
import json
import pathlib
import sys

import jax
import pytest
from absl import flags

from ada_jax import evaluate as evaluate_cli
from ada_jax import testing
from ada_jax.eval import evaluator as evaluate
from ada_jax.models import decoder as model_lib
from ada_jax.rollout import sampler

# The config files below import `configs.common`, as experiment files run with `python -m`
# from the repository root do.
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))


def test_markdown_table_lists_benchmarks_and_weighted_average():
  results = {
    "a": {"avg@2": 0.75, "pass@2": 1.0, "response_tokens": 2.0, "num_problems": 2},
    "b": {"avg@2": 0.0, "pass@2": 0.0, "response_tokens": 2.4, "num_problems": 2},
    "average": {"avg@2": 0.375, "pass@2": 0.5, "response_tokens": 2.2, "num_problems": 4},
  }
  table = evaluate.markdown_table(results, "t")
  assert table.startswith("### t\n")
  assert "| benchmark | problems | avg@2 | pass@2 | mean tokens |" in table
  assert "| a | 2 | 75.0 | 100.0 | 2 |" in table
  assert "| **weighted average** | 4 | 37.5 | 50.0 | 2 |" in table


def test_a_report_never_replaces_one_of_other_weights_or_settings(tmp_path):
  settings = {"benchmarks": ("arith",), "k": 4}
  assert evaluate.report_name(tmp_path, "step_3", "checkpoint:/r/checkpoints:3", settings) == (
    "step_3"
  )
  (tmp_path / "step_3.json").write_text(
    json.dumps({"model": "checkpoint:/r/checkpoints:3", "settings": settings})
  )
  # The same evaluation (its numbers from the cache) keeps its name.
  assert evaluate.report_name(tmp_path, "step_3", "checkpoint:/r/checkpoints:3", settings) == (
    "step_3"
  )
  other = evaluate.report_name(tmp_path, "step_3", "checkpoint:/other/checkpoints:3", settings)
  assert other == "step_3.2"
  (tmp_path / "step_3.2.json").write_text(json.dumps({"model": "x", "settings": settings}))
  assert (
    evaluate.report_name(tmp_path, "step_3", "checkpoint:/r/checkpoints:3", {**settings, "k": 8})
    == "step_3.3"
  )


def _tiny_params(seed=0):
  config = model_lib.preset("tiny-llama", vocab_size=128, max_position_embeddings=64)
  return config, model_lib.init_params(config, jax.random.key(seed))


def _arith_eval_config():
  """Avg@2 on 4 held-out arithmetic problems, 8-token responses: an evaluation in seconds."""
  from ada_jax.eval.benchmarks import EvalConfig
  from ada_jax.rewards.verifier import VerifierConfig
  from ada_jax.rollout.spec import SamplerSpec

  return EvalConfig(
    benchmarks=("arith",),
    k=2,
    sampler=SamplerSpec(max_new_tokens=8, prompt_buckets=(16,), chunk_rows=8),
    max_prompt_tokens=16,
    arith_problems=4,
    verifier=VerifierConfig(judge="", num_workers=1),
  )


def test_the_cache_identity_is_the_weights_not_their_folder_or_layout():
  """Equal values give equal tags on any mesh (the loop's and the CLI's); one changed
  element of any leaf, or another architecture, gives another."""
  from ada_jax.models import sharding

  config, params = _tiny_params()
  tag = evaluate.weights_tag(params, config)
  mesh = sharding.make_mesh(1, 2, 4)
  placed = jax.device_put(params, sharding.param_shardings(config, mesh))
  assert evaluate.weights_tag(placed, config) == tag and tag.startswith("weights:")
  leaves, tree = jax.tree.flatten(params)
  for i in range(0, len(leaves), 5):
    bumped = list(leaves)
    bumped[i] = bumped[i].reshape(-1).at[i % bumped[i].size].add(1e-3).reshape(bumped[i].shape)
    assert evaluate.weights_tag(jax.tree.unflatten(tree, bumped), config) != tag
  other = dataclasses.replace(config, rope_theta=config.rope_theta * 2)
  assert evaluate.weights_tag(params, other) != tag


def test_a_reused_workdir_never_answers_for_other_weights(tmp_path):
  """A result is reused only for the same weights: other weights under the same report
  name and workdir sample again (the cache grows); the same weights again do not."""
  from ada_jax.data import arith

  eval_cfg = _arith_eval_config()
  tokenizer = arith.load_tokenizer()

  def run(seed):
    config, params = _tiny_params(seed)
    return evaluate.run(
      eval_cfg,
      tmp_path,
      params=params,
      model_config=config,
      tokenizer=tokenizer,
      model_tag=evaluate.weights_tag(params, config),
      name="step_8",
      progress=False,
    )

  cache = tmp_path / "eval" / "cache.jsonl"
  first = run(0)
  lines = cache.read_text().count("\n")
  # The report keeps each problem's correct and boxed counts of k, which give its scores.
  problems = first["problems"]["arith"]
  assert [p["prompt_id"] for p in problems] == [f"arith/test/0/{i}" for i in range(4)]
  assert all(p["k"] == 2 and 0 <= p["correct"] <= p["boxed"] <= 2 for p in problems)
  m = first["results"]["arith"]
  assert sum(p["correct"] for p in problems) / 8 == pytest.approx(m["avg@2"])
  assert sum(p["boxed"] for p in problems) / 8 == pytest.approx(m["boxed_rate"])
  saved = json.loads((tmp_path / "eval" / "step_8.json").read_text())
  assert saved["problems"] == first["problems"]
  second = run(1)
  assert cache.read_text().count("\n") == 2 * lines  # sampled again
  assert second["model"] != first["model"] and second["name"] == "step_8.2"
  again = run(0)
  assert cache.read_text().count("\n") == 2 * lines and again["results"] == first["results"]


def test_results_are_of_the_tokenizer_stop_and_pad_ids_too(tmp_path):
  """Same weights, same workdir, other stop ids (a folder's generation_config.json changed)
  or pad id: sampled again and reported under another name, never the cached results."""
  from ada_jax.data import arith

  eval_cfg = _arith_eval_config()
  config, params = _tiny_params(0)
  cache = tmp_path / "eval" / "cache.jsonl"
  reports = []
  for change in ({}, {"eos_ids": (2, 5)}, {"pad_id": 3}):
    tok = arith.load_tokenizer()
    for field, value in change.items():
      setattr(tok, field, value)
    reports.append(
      evaluate.run(
        eval_cfg,
        tmp_path,
        params=params,
        model_config=config,
        tokenizer=tok,
        name="step_0",
        progress=False,
      )
    )
    assert cache.read_text().count("\n") == 4 * len(reports)  # sampled again each time
  assert [r["name"] for r in reports] == ["step_0", "step_0.2", "step_0.3"]
  assert [r["settings"]["tokenizer"] for r in reports] == [
    {"stop_ids": [2], "pad_id": 0},
    {"stop_ids": [2, 5], "pad_id": 0},
    {"stop_ids": [2], "pad_id": 3},
  ]


def test_an_evaluator_keeps_its_verifier_pool_across_runs_until_closed(tmp_path):
  """The loop's held-out evaluations grade with one pool (its processes start once), and
  `close` (or the end of a `with` block) stops them; a later run starts a new one."""
  from ada_jax.data import arith

  config, params = _tiny_params(0)
  with evaluate.Evaluator.make(_arith_eval_config(), config, arith.load_tokenizer()) as ev:
    first = ev.run(tmp_path, params, name="a", model_tag="m0", progress=False)
    (pool,) = ev.pools.values()
    pids = pool.worker_pids
    second = ev.run(tmp_path, params, name="b", model_tag="m1", progress=False)
    assert list(ev.pools.values()) == [pool] and pool.worker_pids == pids
    assert first["results"] == second["results"]  # same weights, same key: same draws
  assert not ev.pools
  with pytest.raises(RuntimeError):  # a closed pool grades nothing
    pool.score(["\\boxed{1}"], ["1"])


# --------------------------------------------------------------------------- CLI


def _cli(argv):
  fv = flags.FlagValues()
  argv = ["evaluate", *argv]
  evaluate_cli.define_flags(fv, sys_argv=argv)
  fv(argv)
  return evaluate_cli.main([], fv)


def _write_config(path, **groups):
  """An experiment config file: `configs.common` with the given group fields replaced (a
  dict value becomes a ConfigDict)."""
  lines = ["import ml_collections", "from configs import common", "", "def get_config():"]
  lines.append("  c = common.get_config()")
  for group, fields in groups.items():
    for key, value in fields.items():
      value = f"ml_collections.ConfigDict({value!r})" if isinstance(value, dict) else repr(value)
      lines.append(f"  c.{group}.{key} = {value}")
  path.write_text("\n".join([*lines, "  return c", ""]))
  return path


def test_bad_config_or_flags_are_named_before_any_model_is_loaded(tmp_path):
  work = f"--workdir={tmp_path / 'work'}"
  cfg = _write_config(tmp_path / "cfg.py", model={"preset": "tiny-llama"}, eval={"kk": 3})
  with pytest.raises(ValueError, match=r"config\.eval\.kk"):
    _cli([f"--config={cfg}", work, "--checkpoint=1"])
  cfg = _write_config(tmp_path / "cfg.py", model={"preset": "tiny-llama"})
  with pytest.raises(ValueError, match=r"eval\.benchmarks=.*'mmlu'"):
    _cli([f"--config={cfg}", work, "--checkpoint=1", "--benchmarks=arith,mmlu"])
  with pytest.raises(ValueError, match="exactly one of --hf_dir"):
    _cli([f"--config={cfg}", work])
  with pytest.raises(ValueError, match="--workdir"):
    _cli([f"--config={cfg}", "--checkpoint=1"])
  with pytest.raises(ValueError, match="--hf_dir: .*no such folder"):
    _cli([work, f"--hf_dir={tmp_path / 'missing'}"])


LLAMA3_TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
  "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
  "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.mark.slow
def test_math500_tiny_llama_cli_writes_reports_and_resumes(shared_dir, tmp_path, monkeypatch):
  from ada_jax.models import weights

  folder = tmp_path / "tiny-llama3"
  mc = model_lib.ModelConfig(
    family="llama",
    vocab_size=128_256,
    embed_dim=32,
    mlp_dim=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    rope_scaling=model_lib.RopeScaling(factor=32.0),
    tie_embeddings=True,
  )
  weights.save_hf(mc, model_lib.init_params(mc, jax.random.key(1)), folder)
  (folder / "tokenizer.json").symlink_to(shared_dir / "tokenizers" / "llama3" / "tokenizer.json")
  (folder / "tokenizer_config.json").write_text(
    json.dumps(
      {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_TEMPLATE,
      }
    )
  )
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
  eval_fields = {
    "benchmarks": ("math500",),
    "k": 4,
    "sampler.max_new_tokens": 64,
    "limit": 16,
    "sampler.chunk_rows": 32,
    "problems_per_batch": 8,
    "sampler.prompt_buckets": (512,),
    "max_prompt_tokens": 512,
    "verifier": {"num_workers": 1},
    "manual_dir": str(shared_dir / "data"),
    "data_dir": str(tmp_path / "tfds"),
  }
  config = _write_config(
    tmp_path / "cfg.py", model={"hf_dir": str(folder), "dtype": "float32"}, eval=eval_fields
  )
  workdir = tmp_path / "work"
  argv = [f"--config={config}", f"--workdir={workdir}", f"--hf_dir={folder}"]

  calls = {"n": 0, "fail": 2}
  generate = sampler.Sampler.generate

  def counted(self, *args, **kwargs):
    calls["n"] += 1
    if calls["n"] == calls["fail"]:
      raise KeyboardInterrupt("simulated interruption")
    return generate(self, *args, **kwargs)

  monkeypatch.setattr(sampler.Sampler, "generate", counted)
  with pytest.raises(KeyboardInterrupt):
    _cli(argv)
  cache = workdir / "eval" / "cache.jsonl"
  assert len(cache.read_text().splitlines()) == 8  # the first batch of 8 problems
  assert not (workdir / "eval" / "hf_tiny-llama3.json").exists()

  calls.update(n=0, fail=None)
  report = _cli(argv)
  assert calls["n"] == 1  # only the unfinished batch
  saved = json.loads((workdir / "eval" / "hf_tiny-llama3.json").read_text())
  assert saved["results"] == report["results"]
  m = report["results"]["math500"]
  assert m["num_problems"] == 16 and 0.0 <= m["avg@4"] <= m["pass@4"] <= 1.0
  records = [json.loads(line) for line in cache.read_text().splitlines()]
  assert len(records) == 16  # one a problem: the first batch's kept, the second's added
  lengths = [n for r in records for n in r["lengths"]]
  assert len(lengths) == 16 * 4 and max(lengths) <= 64  # k = 4, max_new_tokens = 64
  assert m["response_tokens"] == pytest.approx(sum(lengths) / len(lengths))
  assert report["settings"]["k"] == 4 and report["model"].startswith("weights:")
  assert report["dropped_over_max_prompt_tokens"] == {"math500": 0}
  assert "| math500 | 16 |" in (workdir / "eval" / "hf_tiny-llama3.md").read_text()
  lines = [json.loads(line) for line in cache.read_text().splitlines()]
  assert len(lines) == 16 and all(len(r["rewards"]) == 4 for r in lines)
  assert [r["prompt_id"] for r in lines][:2] == [
    "math500/test/precalculus/807.json",
    "math500/test/intermediate_algebra/1994.json",
  ]

  calls.update(n=0)
  assert _cli(argv)["results"] == report["results"]
  assert calls["n"] == 0


def test_arith_from_orbax_checkpoint_equals_hf_folder(tmp_path):
  """The held-out arithmetic split on a random tiny model, loaded three ways: --checkpoint
  with the architecture from `model.preset` + `model.overrides` (the built-in arithmetic
  tokenizer), --checkpoint with it from `model.hf_dir`, and --hf_dir; all give the same
  numbers. --benchmarks, --k and --limit override the config's `eval` group."""
  folder = tmp_path / "hf"
  arch = testing.save_arith_model(
    *testing.tiny_arith_model(seed=3), folder, tmp_path / "work" / "checkpoints"
  )
  eval_fields = dict(
    k=2,  # --k=4 below
    **{"sampler.max_new_tokens": 12, "sampler.chunk_rows": 32, "sampler.prompt_buckets": (16,)},
    arith_problems=64,  # --limit=24 below
    arith_levels=(1, 2),
    problems_per_batch=16,
    max_prompt_tokens=16,
    verifier={"num_workers": 1},
    greedy=True,
  )
  preset = {"preset": "tiny-llama", "dtype": "float32", "overrides": arch}
  cfg_preset = _write_config(tmp_path / "preset.py", model=preset, eval=eval_fields)
  hf = {"hf_dir": str(folder), "dtype": "float32"}
  cfg_hf = _write_config(tmp_path / "hf.py", model=hf, eval=eval_fields)
  work = tmp_path / "work"
  flags_ = [f"--workdir={work}", "--benchmarks=arith", "--k=4", "--limit=24"]
  from_ckpt = _cli([f"--config={cfg_preset}", *flags_, "--checkpoint=3"])
  # In another workdir, so that the folder's numbers are computed, not read from the cache.
  hf_work = tmp_path / "work_hf"
  from_hf = _cli([f"--config={cfg_hf}", f"--workdir={hf_work}", *flags_[1:], f"--hf_dir={folder}"])
  # Flag overrides name the report apart from the run's own eval/step_3.* (never replaced).
  assert (work / "eval" / "step_3_arith_k4_limit24.json").exists()
  assert (hf_work / "eval" / "hf_hf_arith_k4_limit24.md").exists()
  # The same weights are one identity in the cache, whichever folder holds them.
  assert from_ckpt["model"] == from_hf["model"]
  m = from_ckpt["results"]["arith"]
  assert m == from_hf["results"]["arith"]
  assert m["num_problems"] == 24 and set(m) >= {"avg@4", "pass@4", "greedy"}
  settings = from_ckpt["settings"]
  assert settings["k"] == 4 and settings["benchmarks"] == ("arith",) and settings["limit"] == 24
  # Architecture and tokenizer from model.hf_dir; the results come from the cache.
  assert _cli([f"--config={cfg_hf}", *flags_, "--checkpoint=3"])["results"] == from_ckpt["results"]
