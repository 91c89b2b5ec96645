"""Every experiment config loads and parses; the parser names bad fields."""

import dataclasses
import math
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ml_collections import config_flags

from ada_jax import config as config_lib
from ada_jax.checkpoint import CheckpointConfig
from ada_jax.models.tokenizer import TokenizerConfig
from ada_jax.rl.train import TrainConfig
from configs import common, tiny_arith_pos

CONFIGS = sorted(
  p
  for p in (pathlib.Path(__file__).resolve().parents[1] / "configs").glob("*.py")
  if p.name not in ("__init__.py", "common.py")
)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_parses(path):
  cfg = config_flags.config_flags._LoadConfigModule(path.stem, str(path)).get_config()
  run = config_lib.parse(cfg)
  assert run.train_rows % run.train.num_minibatches == 0


def test_paper_hyper_parameters_are_the_defaults():
  cfg = common.get_config()
  cfg.model.preset = "llama-3.2-3b"
  run = config_lib.parse(cfg)
  assert (run.ada.n, run.ada.samples_per_round, run.ada.max_rounds) == (4, 8, 4)
  assert (run.loss.clip_low, run.loss.clip_high, run.loss.dual_clip) == (0.2, 0.28, 10.0)
  assert run.optim.learning_rate == 1e-6 and run.rl.batch_prompts == 512
  assert run.sampler.max_new_tokens == 2048 and run.data.max_prompt_tokens == 1024


@pytest.mark.parametrize(
  "group,key,value,match",
  [
    ("sampler", "temprature", 1.0, r"config\.sampler\.temprature: unknown field"),
    ("ada", "samples_per_round", 0, r"config\.ada"),
    ("optim", "learning_rate", -1.0, r"config\.optim.*learning_rate"),
    ("model", "preset", "gpt-9", r"model\.preset"),
  ],
)
def test_bad_field_is_named(group, key, value, match):
  cfg = tiny_arith_pos.get_config().to_dict()
  cfg[group][key] = value
  with pytest.raises(ValueError, match=match):
    config_lib.parse(cfg)


def test_unknown_group_and_indivisible_minibatches():
  cfg = tiny_arith_pos.get_config().to_dict()
  with pytest.raises(ValueError, match=r"config\.optimizer: unknown group"):
    config_lib.parse({**cfg, "optimizer": {}})
  cfg["train"]["mini_batch_prompts"] = 3  # 12 rows do not divide 64 × 4
  with pytest.raises(ValueError, match=r"config\.train\.mini_batch_prompts \(3\) × ada\.n"):
    config_lib.parse(cfg)
  cfg["train"]["mini_batch_prompts"] = 128  # more than the batch's 64 prompts
  with pytest.raises(ValueError, match=r"config\.train\.mini_batch_prompts"):
    config_lib.parse(cfg)
  cfg["train"] = {"num_minibatches": 4}  # derived, so not a config field
  with pytest.raises(ValueError, match=r"config\.train\.num_minibatches: set by .*mini_batch"):
    config_lib.parse(cfg)


@pytest.mark.parametrize(
  "method,n,updates",
  [("est", 4, 8), ("grpo", 8, 4), ("grpo", 4, 4), ("pos", 4, 4), ("balance", 4, 4)],
)
def test_updates_per_step_are_derived_from_the_mini_batch_as_released(method, n, updates):
  """verl cuts mini-batches of 128 prompts × n rows: at the paper's batch (512 prompts),
  Est's K·B = 4,096 rows give 8 updates, GRPO n = 8 and the Seq methods 4."""
  from configs import llama3b_pos

  cfg = llama3b_pos.get_config()
  cfg.ada.method, cfg.ada.n = method, n
  run = config_lib.parse(cfg)
  assert run.rl.batch_prompts == 512 and run.train.mini_batch_prompts == 128
  assert run.train.num_minibatches == updates
  assert run.train_rows // run.train.num_minibatches == 128 * n


@pytest.mark.parametrize("method", ["pos", "balance", "grpo", "est", "dapo"])
def test_toy_configs_keep_one_update_per_step(method):
  cfg = tiny_arith_pos.get_config()
  cfg.ada.method = method
  assert config_lib.parse(cfg).train.num_minibatches == 1


def test_groups_are_the_modules_own_configs_and_train_is_filled_once():
  """Each group parses into the frozen config of the module that uses it; the trainer's
  loss, optimizer and temperature come from the `loss`, `optim` and `sampler` groups only
  (a second place to set them is refused, naming the one to use)."""
  cfg = tiny_arith_pos.get_config().to_dict()
  cfg["loss"]["clip_high"] = 0.31
  cfg["optim"]["learning_rate"] = 3e-5
  cfg["sampler"]["temperature"] = 0.7
  cfg["ckpt"].update(init_from="/x", export_hf=True)
  run = config_lib.parse(cfg)
  assert isinstance(run.train, TrainConfig) and isinstance(run.ckpt, CheckpointConfig)
  assert isinstance(run.tokenizer, TokenizerConfig)
  assert run.train.loss is run.loss and run.train.loss.clip_high == 0.31
  assert run.train.optim.learning_rate == 3e-5 and run.train.temperature == 0.7
  assert (run.ckpt.init_from, run.ckpt.export_hf) == ("/x", True)
  replaced = dataclasses.replace(run, loss=dataclasses.replace(run.loss, clip_high=0.5))
  assert replaced.train.loss.clip_high == 0.5  # refilled, never stale
  for field, source in [("loss", "config.loss"), ("temperature", "config.sampler.temperature")]:
    bad = tiny_arith_pos.get_config().to_dict()
    bad["train"][field] = {} if field == "loss" else 0.5
    with pytest.raises(config_lib.ConfigError, match=rf"config\.train\.{field}: set by {source}"):
      config_lib.parse(bad)


@pytest.mark.parametrize(
  "config_name,override,message",
  [
    ("tiny_arith_pos.py", "--config.ada.method=reinforce", "ada_jax: config.ada"),
    (
      "tiny_arith_pos.py",
      "--config.rl.batchsize=3",
      "ada_jax: the config has no field named by config.rl.batchsize",
    ),
    ("no_such_config.py", "--config.rl.steps=3", "ada_jax: --config="),
  ],
)
def test_command_line_bad_config_is_one_line_exit_2_from_any_directory(
  tmp_path, config_name, override, message
):
  """`python -m ada_jax.main` from outside the checkout: the config file still loads, and a
  bad value, an unknown field or a missing file ends the run with exit code 2 and one line
  naming it, no traceback, and no workdir created."""
  import subprocess
  import sys

  config = pathlib.Path(__file__).resolve().parents[1] / "configs" / config_name
  workdir = tmp_path / "run"
  proc = subprocess.run(
    [sys.executable, "-m", "ada_jax.main", f"--config={config}", f"--workdir={workdir}", override],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(message)
  assert not workdir.exists()


def test_part_empty_chunks_are_refused():
  cfg = tiny_arith_pos.get_config()
  cfg.ada.method = "grpo"  # 4 rows per prompt: 32 prompts fill only 128 of 256 rows
  cfg.sampler.prompts_per_chunk = 32
  with pytest.raises(ValueError, match=r"config\.sampler\.prompts_per_chunk \(32\).*at least 64"):
    config_lib.parse(cfg)
  cfg.sampler.prompts_per_chunk = 0
  assert config_lib.parse(cfg).prompts_per_chunk == 64
  cfg.ada.method = "pos"
  assert config_lib.parse(cfg).prompts_per_chunk == 32


@pytest.mark.parametrize(
  "budget,segment,expected",
  [(2048, 0, 64), (12, 0, 1), (100, 0, 3), (2048, 7, 7)],
)
def test_stream_derives_its_segment_from_the_budget(budget, segment, expected):
  c = tiny_arith_pos.get_config()
  c.sampler.max_new_tokens, c.sampler.segment_steps = budget, segment
  c.ada.schedule = "stream"
  assert config_lib.parse(c).sampler.segment_steps == expected
  c.ada.schedule = "rounds"  # the sampler's own default: one call per budget
  assert config_lib.parse(c).sampler.segment_steps == segment


# ----------------------------------------------------------------------------- late errors


def _float_fields():
  """(group, field) of every float-typed field the config groups have (NaN passes every
  `x <= 0` check, so each of them needs the finite check)."""
  import typing

  out = []
  for group in dataclasses.fields(config_lib.RunConfig):
    cls = config_lib._dataclass_of(typing.get_type_hints(config_lib.RunConfig)[group.name])
    if cls is None or group.name == "train":
      continue
    for name, hint in config_lib._fields(cls).items():
      if float in (hint, *typing.get_args(hint)) and name not in config_lib._FILLED.get(
        group.name, {}
      ):
        out.append((group.name, name))
  return out


FLOAT_FIELDS = _float_fields()


def test_the_float_fields_are_found():
  assert ("optim", "learning_rate") in FLOAT_FIELDS and ("sampler", "temperature") in FLOAT_FIELDS
  assert len(FLOAT_FIELDS) > 20


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(FLOAT_FIELDS), bad=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_a_non_finite_value_is_refused_naming_the_field(field, bad):
  group, name = field
  cfg = tiny_arith_pos.get_config().to_dict()
  cfg.setdefault(group, {})
  if cfg[group] is None:
    cfg[group] = {}
  cfg[group][name] = bad
  with pytest.raises(config_lib.ConfigError, match=rf"config\.{group}\.{name}=.*finite"):
    config_lib.parse(cfg)


@pytest.mark.parametrize(
  "edit,match",
  [
    (lambda c: c["rl"]["verifier"].update(judge="foo"), r"config\.rl\.verifier: judge='foo'"),
    (lambda c: c["rl"]["verifier"].update(judge=""), r"RLConfig\.verifier\.judge is empty"),
    (lambda c: c["rl"]["verifier"].update(timeout_s=0), r"config\.rl\.verifier: timeout_s=0"),
    (lambda c: c["rl"]["verifier"].update(num_workers=-1), r"rl\.verifier: num_workers=-1"),
    (lambda c: c["eval"].update(verifier={"timeout_s": 0.0}), r"eval\.verifier: timeout_s=0"),
    (lambda c: c["eval"]["sampler"].update(top_k=-1), r"config\.eval\.sampler: .*top_k"),
    (lambda c: c["sampler"].update(prompt_buckets=()), r"config\.sampler\.prompt_buckets=\(\)"),
    (lambda c: c["sampler"].update(prompt_buckets=(8,)), r"prompt_buckets \(largest 8\).*16"),
    (lambda c: c["sampler"].update(prompt_buckets=(0, 16)), r"config\.sampler\.prompt_buckets"),
    (lambda c: c.update(seed=-1), r"config\.seed must be an int in \[0, 2\*\*63\), got -1"),
    (lambda c: c.update(seed=2**63), r"config\.seed"),
    (lambda c: c.update(seed=1.5), r"config\.seed"),
    (lambda c: c["sampler"].update(temperature=0.0), r"config\.sampler\.temperature=0"),
  ],
)
def test_late_found_errors_are_refused_at_parse(edit, match):
  """Each of these passed the checks and failed only after the warm start and the first
  evaluation (or trained nothing); `loop.run` parses before anything compiles."""
  cfg = tiny_arith_pos.get_config().to_dict()
  edit(cfg)
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.parse(cfg)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 2000), n=st.integers(2, 16))
def test_absurd_samples_per_round_is_warned(m, n):
  cfg = tiny_arith_pos.get_config().to_dict()
  cfg["ada"].update(samples_per_round=max(m, n), n=n, max_rounds=4)
  cfg["sampler"]["prompts_per_chunk"] = cfg["sampler"]["chunk_rows"]  # full chunks for any M
  warnings = config_lib.parse(cfg).warnings()
  assert bool(warnings) == (max(m, n) > 16 * n)
  if warnings:
    assert f"config.ada.samples_per_round={max(m, n)}" in warnings[0]
