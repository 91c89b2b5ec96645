"""Guards that real configs hit: the context length (training, evaluation, prompt
selection, the shipped configs), a dapo step with nothing to train on, and the root PRNG
key read back on resume."""

import json
import logging
import pathlib
import shutil

import jax
import numpy as np
import pytest
from ml_collections import config_flags
from test_loop import tiny_config

from ada_jax import config as config_lib
from ada_jax import loop
from ada_jax import metrics as metrics_lib
from ada_jax import selection as select_prompts
from ada_jax.data import arith
from ada_jax.eval import evaluator as evaluate
from ada_jax.eval.benchmarks import EvalConfig
from ada_jax.models import decoder as model_lib
from ada_jax.models import weights
from ada_jax.rollout import sampler as sampler_lib
from ada_jax.rollout.spec import SamplerSpec
from configs import smollm2_arith_pos

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted(
  p for p in (ROOT / "configs").glob("*.py") if p.name not in ("__init__.py", "common.py")
)
# The architectures behind the Hub ids the shipped configs name (no network in tests).
HUB_PRESETS = {
  "Qwen/Qwen2.5-Math-1.5B": "qwen2.5-math-1.5b",
  "Qwen/Qwen2.5-Math-7B": "qwen2.5-math-7b",
  "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b-instruct",
  smollm2_arith_pos.HF_DIR: "smollm2-135m",  # the converted GGUF's folder
}


@pytest.mark.parametrize(
  "edit,match",
  [
    # A 16-token prompt bucket + 60 new tokens > 64 positions.
    (
      lambda c: c.sampler.__setitem__("max_new_tokens", 60),
      r"config\.sampler: prompt_buckets \(largest 16\) \+ max_new_tokens \(60\) = 76 .*"
      r"max_position_embeddings \(64\)",
    ),
    (lambda c: c.sampler.__setitem__("prompt_buckets", (8, 60)), r"config\.sampler: prompt"),
    (
      lambda c: c.eval.sampler.__setitem__("max_new_tokens", 49),
      r"config\.eval\.sampler: prompt_buckets .* max_new_tokens \(49\)",
    ),
    (lambda c: c.sampler.__setitem__("top_k", 129), r"config\.sampler.*top_k"),
  ],
)
def test_bad_rollout_settings_fail_before_any_compile(tmp_path, edit, match):
  c = tiny_config()
  edit(c)
  with metrics_lib.CompileCounter() as compiles:
    with pytest.raises(config_lib.ConfigError, match=match):
      loop.run(c, str(tmp_path / "run"))
  assert compiles.count == 0
  assert not (tmp_path / "run").exists()


def test_context_that_just_fits_is_accepted():
  model = model_lib.preset("tiny-llama", max_position_embeddings=64)
  sampler_lib.check_context_length(model, (8, 16), 48)
  with pytest.raises(ValueError, match="max_new_tokens"):
    sampler_lib.check_context_length(model, (8, 16), 49)
  with pytest.raises(ValueError, match="prompt_buckets"):
    sampler_lib.Sampler(model, max_new_tokens=49, stop_ids=[1], prompt_buckets=(16,))


def _tiny_arith_model():
  tokenizer = arith.load_tokenizer()
  model = model_lib.preset("tiny-llama", vocab_size=128, max_position_embeddings=64)
  return model, tokenizer


def test_evaluation_checks_the_context_first(tmp_path):
  model, tokenizer = _tiny_arith_model()
  config = EvalConfig(
    benchmarks=("arith",),
    k=1,
    sampler=SamplerSpec(max_new_tokens=60, prompt_buckets=(16,)),
    max_prompt_tokens=16,
    arith_problems=4,
  )
  with metrics_lib.CompileCounter() as compiles:
    match = r"config\.eval\.sampler: .*max_new_tokens \(60\)"
    with pytest.raises(config_lib.ConfigError, match=match):
      evaluate.run(
        config,
        tmp_path,
        params=None,
        model_config=model,
        tokenizer=tokenizer,
        model_tag="x",
        name="y",
        progress=False,
      )
  assert compiles.count == 0 and not (tmp_path / "eval").exists()


def test_prompt_selection_checks_the_context_first(tmp_path):
  model, tokenizer = _tiny_arith_model()
  config = select_prompts.SelectConfig.of(
    k=2,
    sampler={"max_new_tokens": 60, "prompt_buckets": (16,)},
    verifier={"judge": "exact", "num_workers": 1},
  )
  with metrics_lib.CompileCounter() as compiles:
    with pytest.raises(
      config_lib.ConfigError, match=r"SelectConfig\.sampling\.sampler: .*max_new_tokens \(60\)"
    ):
      select_prompts.run(
        config,
        tmp_path / "out",
        params=None,
        model_config=model,
        tokenizer=tokenizer,
        prompt_set=None,
        model_tag="x",
        progress=False,
      )
  assert compiles.count == 0 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_fit_their_models(path):
  """Training and evaluation contexts fit. The Qwen2.5-Math configs run the released
  budgets (1,024 + 2,048 in training, 4,096 new tokens at T = 1 in evaluation) on the
  released position-limit override (32,768 instead of config.json's 4,096)."""
  cfg = config_lib.parse(
    config_flags.config_flags._LoadConfigModule(path.stem, str(path)).get_config()
  )
  spec = cfg.model
  if spec.hf_dir:
    spec = weights.ModelSpec(
      preset=HUB_PRESETS[spec.hf_dir], dtype=spec.dtype, overrides=spec.overrides
    )
  model = spec.model_config()
  for s in (cfg.sampler, cfg.eval.sampler):  # the eval's also when the config names no benchmark
    sampler_lib.check_context_length(model, s.prompt_buckets, s.max_new_tokens)
  s = cfg.eval.sampler
  if path.stem.startswith(("qwen_math", "llama3b")):
    assert max(cfg.sampler.prompt_buckets) == 1024 and cfg.sampler.max_new_tokens == 2048
    assert s.max_new_tokens == 4096 and s.temperature == 1.0
  if path.stem.startswith("qwen_math"):
    assert model.max_position_embeddings == 32768
    with pytest.raises(ValueError, match=r"max_new_tokens \(4096\) = 5120 tokens exceed"):
      sampler_lib.check_context_length(
        weights.ModelSpec(preset=HUB_PRESETS[cfg.model.hf_dir]).model_config(),
        s.prompt_buckets,
        s.max_new_tokens,
      )  # without the override, 1,024 + 4,096 exceeds config.json's 4,096 positions


# ----------------------------------------------------------------------- runs on the loop


def _no_signal_config(steps):
  """dapo from random weights: every reward is 0, so no group is ever mixed."""
  c = tiny_config(steps)
  c.warmstart = None
  c.ada.method = "dapo"
  c.ada.dapo.max_extra_passes = 1
  c.sampler.prompts_per_chunk = 0  # derived: dapo draws 4 rows a prompt, 8 would half-fill
  c.eval.benchmarks = ()
  c.ckpt.every_steps = 1
  c.ckpt.keep = 10
  c.ckpt.export_hf = True
  return c


class _Records(logging.Handler):
  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def no_signal_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("dapo")
  keys = []
  real = loop.rl_step

  def spy(*args):
    keys.append(np.asarray(jax.random.key_data(args[-1])).tolist())
    return real(*args)

  records = _Records()
  logging.getLogger().addHandler(records)
  try:
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(loop, "rl_step", spy)
      summary = loop.run(_no_signal_config(3), str(workdir))
  finally:
    logging.getLogger().removeHandler(records)
  return workdir, summary, keys, records.messages


def test_dapo_without_a_mixed_group_skips_the_update_and_goes_on(no_signal_run):
  workdir, summary, _, messages = no_signal_run
  lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert summary["steps_done"] == 3 and [m["step"] for m in lines] == [1, 2, 3]
  for m in lines:
    assert m["update_skipped"] == 1.0 and m["ada/rows_selected"] == 0
    assert m["ada/rounds"] == 2  # the first pass and the one extra pass allowed
    assert "loss" not in m
  assert sum("policy update is skipped" in x for x in messages) == 3


def test_run_exports_a_loadable_folder(no_signal_run):
  """`ckpt.export_hf`: the run's tokenizer and stop ids go with the weights."""
  workdir = no_signal_run[0]
  folder = workdir / "hf_final"
  for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
    assert (folder / name).is_file(), name
  gen = json.loads((folder / "generation_config.json").read_text())
  assert gen["eos_token_id"] == list(arith.load_tokenizer().eos_ids)


def test_resumed_run_draws_the_saved_runs_keys(no_signal_run, tmp_path):
  """The root key comes from the checkpoint: resuming at step 2, step 3 draws the
  uninterrupted run's key; another seed in the config is refused (`runstate.check_resume`),
  as it would draw other prompts from the same iterator position."""
  workdir, _, keys, _ = no_signal_run
  assert len({json.dumps(k) for k in keys}) == 3
  resumed = tmp_path / "resumed"
  (resumed / "checkpoints").mkdir(parents=True)
  for step in ("0", "1", "2"):
    shutil.copytree(workdir / "checkpoints" / step, resumed / "checkpoints" / step)
  c = _no_signal_config(3)
  c.seed = 7
  with pytest.raises(config_lib.ConfigError, match=r"config\.seed: 0 -> 7"):
    loop.run(c, str(resumed))
  c.seed = 0
  got = []
  real = loop.rl_step

  def spy(*args):
    got.append(np.asarray(jax.random.key_data(args[-1])).tolist())
    return real(*args)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(loop, "rl_step", spy)
    summary = loop.run(c, str(resumed))
  assert summary["source"] == "checkpoint:2" and got == keys[2:]
