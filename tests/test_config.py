"""Every experiment config loads and parses; the parser names bad fields."""

import dataclasses
import math
import pathlib
import re

import ml_collections
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ml_collections import config_flags

from ada_jax import bounds
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


def test_gpu_host_settings_parse_for_every_method():
  """`--config=configs/<name>.py:<host>`: each paper config's GPU hosts (the pos file's
  table, reached from balance and grpo) parse, fill every slot chunk whatever the method's
  fewest rows per prompt, and change only the sampler sizes; an unknown host is named."""
  modules = {p.stem: _module(p) for p in CONFIGS}
  tables = {name: m.HOSTS for name, m in modules.items() if hasattr(m, "HOSTS")}
  assert set(tables) == {"llama3b_pos", "qwen_math15b_pos", "qwen_math7b_pos"}
  for name, table in tables.items():
    for variant in ("pos", "balance", "grpo"):
      module = modules[name.replace("_pos", f"_{variant}")]
      plain = config_lib.parse(module.get_config())
      for host, sizes in table.items():
        run = config_lib.parse(module.get_config(host))
        assert run.sampler.chunk_rows == sizes["chunk_rows"], (name, variant, host)
        assert run.eval.sampler.chunk_rows == sizes["eval_chunk_rows"]
        assert run.prompts_per_chunk * run.min_rows_per_prompt >= run.sampler.chunk_rows
        assert (run.ada, run.train, run.mesh) == (plain.ada, plain.train, plain.mesh)
  with pytest.raises(ValueError, match=r"'h300x8'.*known: \['h100x8', 'h200x8'\]"):
    modules["qwen_math7b_grpo"].get_config("h300x8")


def _module(path: pathlib.Path):
  """configs/<path>'s module, loaded as `--config` loads it."""
  return config_flags.config_flags._LoadConfigModule(path.stem, str(path))


def test_paper_hyper_parameters_are_the_defaults():
  cfg = common.get_config()
  cfg.model.preset = "llama-3.2-3b"
  run = config_lib.parse(cfg)
  assert (run.ada.n, run.ada.seq.samples_per_round, run.ada.seq.max_rounds) == (4, 8, 4)
  assert (run.loss.clip_low, run.loss.clip_high, run.loss.dual_clip) == (0.2, 0.28, 10.0)
  assert run.optim.learning_rate == 1e-6 and run.rl.batch_prompts == 512
  assert run.sampler.max_new_tokens == 2048 and run.data.max_prompt_tokens == 1024


@pytest.mark.parametrize(
  "group,key,value,match",
  [
    ("sampler", "temprature", 1.0, r"config\.sampler\.temprature: unknown field"),
    ("ada", "seq", {"samples_per_round": 0}, r"config\.ada\.seq: SeqConfig\.samples_per_round=0"),
    ("ada", "method", "ppo", r"config\.ada: AdaConfig\.method='ppo': unknown method"),
    ("ada", "n", 64, r"config\.ada: AdaConfig\.seq\.samples_per_round=8: with n=64"),
    (
      "ada",
      "samples_per_round",
      8,
      r"config\.ada\.samples_per_round moved to config\.ada\.seq\.samp",
    ),
    ("ada", "est_decay", 0.5, r"config\.ada\.est_decay moved to config\.ada\.est\.decay"),
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
    (
      "tiny_arith_pos.py",
      "--config.ada.max_rounds=2",
      "ada_jax: config.ada.max_rounds moved to config.ada.seq.max_rounds",
    ),
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
  with pytest.raises(ValueError, match=r"config\.sampler\.prompts_per_chunk \(32: .*at least 64"):
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
  cfg["ada"]["n"] = n
  cfg["ada"]["seq"] = {"samples_per_round": max(m, n), "max_rounds": 4}
  cfg["sampler"]["prompts_per_chunk"] = cfg["sampler"]["chunk_rows"]  # full chunks for any M
  warnings = config_lib.parse(cfg).warnings()
  assert bool(warnings) == (max(m, n) > 16 * n)
  if warnings:
    assert f"config.ada.seq.samples_per_round={max(m, n)}" in warnings[0]


# ----------------------------------------------------------------------------- ranges


def _group_fields(cls=config_lib.RunConfig, path="config"):
  """(config path, dataclass, field name, type) of every leaf field of the run's groups,
  nested groups included (`train`'s copies of other groups left out)."""
  import typing

  out = []
  for name, hint in config_lib._fields(cls).items():
    if name in config_lib._FILLED.get(path.removeprefix("config."), {}):
      continue
    sub = config_lib._dataclass_of(hint)
    if sub is not None:
      out += _group_fields(sub, f"{path}.{name}")
    elif not (typing.get_origin(hint) is not None and "Mapping" in str(hint)):
      out.append((path, cls, name, hint))
  return out


def _is_numeric(hint) -> bool:
  import typing

  kinds = {hint, *typing.get_args(hint)}
  for k in list(kinds):
    kinds |= set(typing.get_args(k))  # tuple[int, ...]
  return bool(kinds & {int, float})


NUMERIC = [f for f in _group_fields() if _is_numeric(f[3])]


def test_every_numeric_field_has_a_range():
  """A field added without a range would let a value through that fails only later."""
  missing = sorted(
    f"{cls.__name__}.{name}" for _, cls, name, _ in NUMERIC if bounds.of(cls, name) is None
  )
  assert not missing
  assert len(NUMERIC) > 80  # the nested groups (eval.sampler, rl.verifier, ...) are walked


def _outside(interval: str) -> list[float]:
  low, high, low_closed, high_closed = bounds.parse(interval)
  return [low - 1 if low_closed else low, high + 1 if high_closed else high]


def _set(cfg: dict, path: str, name: str, value) -> None:
  group = cfg
  for part in path.split(".")[1:]:
    if group.get(part) is None:
      group[part] = {}
    group = group[part]
  group[name] = value


@settings(max_examples=150, deadline=None)
@given(
  field=st.sampled_from([f for f in NUMERIC if f[1] is not config_lib.RunConfig]),
  side=st.sampled_from([0, 1]),
)
def test_a_value_outside_its_range_is_refused_at_parse_naming_the_bound(field, side):
  """Just below the low end or just above the high end of every numeric field: a
  `ConfigError` naming the field (never another exception, nor a value let through)."""
  import typing

  path, cls, name, hint = field
  interval = bounds.of(cls, name)
  value = _outside(interval)[side]
  is_int = int in {hint, *typing.get_args(hint)} or hint == tuple[int, ...]
  value = int(value) if is_int and float(value).is_integer() else float(value)
  if "tuple" in str(hint):
    value = (value,)
  cfg = tiny_arith_pos.get_config().to_dict()
  _set(cfg, path, name, value)
  with pytest.raises(config_lib.ConfigError, match=re.escape(path.removeprefix("config."))):
    config_lib.parse(cfg)


@pytest.mark.parametrize(
  "edit,match",
  [
    # The examples: an overflow at RL step 1, a ZeroDivisionError in the config's own check.
    (
      {"rl": {"verifier": {"timeout_s": 1e9}}},
      r"rl\.verifier\.timeout_s=1000000000\.0: must be in \(0, 86400\]",
    ),
    ({"rl": {"batch_prompts": 0}}, r"config\.rl: batch_prompts must be >= 1, got 0"),
    # Neighbours: the evaluation's verifier, the start-up timeout, an int at its high end.
    ({"eval": {"verifier": {"timeout_s": 1e7}}}, r"eval\.verifier\.timeout_s"),
    ({"rl": {"verifier": {"startup_timeout_s": 1e9}}}, r"startup_timeout_s=.*\(0, 86400\]"),
    ({"rl": {"steps": 0}}, r"config\.rl: steps must be >= 1"),
    (
      {"sampler": {"max_new_tokens": 2**40}},
      r"sampler\.max_new_tokens=.*: must be in \[1, 2\*\*20\]",
    ),
    ({"mesh": {"fsdp": 0}}, r"config\.mesh\.fsdp=0"),
  ],
)
def test_range_examples(edit, match):
  cfg = tiny_arith_pos.get_config().to_dict()
  for group, fields in edit.items():
    for key, value in fields.items():
      if isinstance(value, dict):
        cfg[group].setdefault(key, {}).update(value)
      else:
        cfg[group][key] = value
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.parse(cfg)


# ----------------------------------------------------------------------------- the command line


def _flag_value(hint, default):
  """A value other than `default` for a field of type `hint`, as typed on a command line,
  and as the ConfigDict then holds it; None: not settable by one flag (a tuple)."""
  import typing

  kinds = [t for t in (hint, *typing.get_args(hint)) if t is not type(None)]
  if "tuple" in str(hint):
    return None
  if str in kinds and float in kinds:  # 'none', '1/p' or an α: a string the group reads
    return "0.375", "0.375"
  if bool in kinds:
    return ("false", False) if default else ("true", True)
  if int in kinds and float not in kinds:
    return str((default or 0) + 1), (default or 0) + 1
  if float in kinds:
    return "0.375", 0.375
  return "plain", "plain"


def _parse_flags(*overrides):
  from absl import flags

  from ada_jax import cli

  argv = ["prog", f"--config={CONFIGS[0].parent / 'tiny_arith_pos.py'}", *overrides]
  fv = flags.FlagValues()
  cli.define_config_file("config", "test", fv, sys_argv=argv)
  fv(argv)
  return fv.config


def test_every_field_is_settable_from_the_command_line():
  """`--config.<group>.<field>=value` for every field the run's groups have (the examples:
  ada.seq.k_pos / k_neg, default None; eval.prompt_style, not in the config file;
  eval.sampler.temperature, a nested group's field the file leaves out)."""
  base = _parse_flags()
  flags_, expected = [], {}
  for path, _, name, hint in _group_fields():
    dotted = f"{path.removeprefix('config')}.{name}".lstrip(".")
    node = base
    for part in dotted.split(".")[:-1]:
      node = node[part] if node is not None else None
    if node is None:
      continue  # a group the file sets to None
    value = _flag_value(hint, node[name])
    if value is not None:
      flags_.append(f"--config.{dotted}={value[0]}")
      expected[dotted] = value[1]
  assert {"ada.seq.k_pos", "ada.seq.k_neg", "eval.prompt_style", "eval.sampler.temperature"} <= set(
    expected
  )
  assert len(expected) > 100
  got = _parse_flags(*flags_)
  for dotted, value in expected.items():
    node = got
    for part in dotted.split("."):
      node = node[part]
    assert node == value, dotted


def test_completed_configs_parse_as_before():
  """Filling in the fields a file leaves out changes nothing `parse` returns."""
  from ada_jax import cli

  for path in CONFIGS:
    parser = cli._CompletingParser("config")
    plain = config_flags.config_flags._LoadConfigModule(path.stem, str(path)).get_config()
    assert config_lib.parse(parser.parse(str(path))) == config_lib.parse(plain), path.stem
  # A config of one group: the others are RunConfig's defaults, the warm start stays off.
  minimal = ml_collections.ConfigDict({"rl": {"steps": 3}})
  config_lib.complete(minimal)
  assert "warmstart" not in minimal and minimal.eval.k == config_lib.RunConfig().eval.k
  assert config_lib.parse(minimal) == config_lib.parse({"rl": {"steps": 3}})


def test_command_line_k_pos_reaches_the_run():
  argv = ("--config.ada.seq.k_pos=1", "--config.eval.prompt_style=plain")
  run = config_lib.parse(_parse_flags(*argv))
  assert run.ada.seq.k_pos == 1 and run.eval.prompt_style == "plain"


@pytest.mark.parametrize(("host", "chunk_rows"), [("h100x8", 2048), ("h200x8", 4096)])
def test_slots_changed_on_a_host_config_name_the_setting_the_host_made(host, chunk_rows):
  """`:h100x8 --config.sampler.chunk_rows=2048` failed on prompts_per_chunk, a value the
  user never set: the error says where it came from and to set it with chunk_rows."""
  from configs import llama3b_pos

  c = llama3b_pos.get_config(host)
  c.sampler.chunk_rows = chunk_rows
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.parse(c)
  text = str(e.value)
  assert "config.sampler.prompts_per_chunk" in text and "':host' settings'" in text
  assert f"({chunk_rows}) part empty: set it too" in text
  c.sampler.prompts_per_chunk = 0  # derived: accepted
  config_lib.parse(c)


def test_a_bound_is_declared_at_its_field_and_read_from_there():
  """A new group declares its bounds where its fields are: the parser reads them from the
  field, a malformed interval fails where it is written, and names read as numbers."""

  @dataclasses.dataclass(frozen=True)
  class Patience:
    rounds: int = bounds.within("[1, 2**4]", 2)

  assert bounds.of(Patience, "rounds") == "[1, 2**4]" and Patience().rounds == 2
  with pytest.raises(
    config_lib.ConfigError, match=r"config\.ada\.patience\.rounds=17: must be in \[1, 2\*\*4\]"
  ):
    config_lib.check_range(Patience, "rounds", 17, "ada.patience")
  config_lib.check_range(Patience, "rounds", 16, "ada.patience")
  with pytest.raises(ValueError, match="interval"):
    bounds.within("1..16", 2)
  assert bounds.written("[0, 16 * ROWS]") == "[0, 16 * 2**24]"
  assert bounds.outside("(0, 1]", (0.5, 0.0)) and not bounds.outside("(0, 1]", None)
