"""Tests for ada_jax.data.verl: verl-format Parquet and JSONL prompt sets, written here with
exactly the columns of the authors' `data_process/reformat.py`."""

import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ada_jax import config as config_lib
from ada_jax import inputs
from ada_jax.data import arith, prompts, verl
from ada_jax.data import sets as data_sets  # noqa: F401  (conftest's offline probe patch)

ROOT = pathlib.Path(__file__).resolve().parents[1]
SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."


def _row(i, problem, answer):
  return {
    "data_source": "numina_math",
    "prompt": [
      {"role": "system", "content": SYSTEM},
      {"role": "user", "content": f"{problem} {SUFFIX}"},
    ],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": answer},
    "extra_info": {"split": "train", "index": i},
  }


ROWS = [_row(0, "What is 1+2?", "3"), _row(1, "What is 10-4?", "6"), _row(2, "2*3?", "6")]


def write_parquet(path, rows=ROWS):
  path.parent.mkdir(parents=True, exist_ok=True)
  pq.write_table(pa.Table.from_pylist(rows), path)
  return path


def write_jsonl(path, rows=ROWS):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def test_parquet_has_exactly_the_released_columns(tmp_path):
  path = write_parquet(tmp_path / "train.parquet")
  assert pq.read_schema(path).names == [
    "data_source",
    "prompt",
    "ability",
    "reward_model",
    "extra_info",
  ]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_rows_become_examples_with_messages_as_given(tmp_path, suffix):
  write = write_parquet if suffix == ".parquet" else write_jsonl
  path = write(tmp_path / "hard" / f"train{suffix}")
  examples = verl.load_examples(str(tmp_path / "hard"))
  assert [ex["prompt_id"] for ex in examples] == ["hard/train/0", "hard/train/1", "hard/train/2"]
  assert [ex["answer"] for ex in examples] == ["3", "6", "6"]
  assert {ex["source"] for ex in examples} == {"numina_math"}
  assert examples[1]["problem"] == f"What is 10-4? {SUFFIX}"
  assert [list(ex["messages"]) for ex in examples] == [r["prompt"] for r in ROWS]
  assert verl.load_examples(str(path)) == examples  # the file itself, same ids


def test_jsonl_and_parquet_give_the_same_prompts(tmp_path):
  tok = arith.load_tokenizer()
  a = prompts.build_prompts(
    verl.load_examples(str(write_parquet(tmp_path / "p" / "train.parquet"))), tok
  )
  b = prompts.build_prompts(
    verl.load_examples(str(write_jsonl(tmp_path / "j" / "train.jsonl"))), tok
  )
  assert a.answers == b.answers == ("3", "6", "6")
  assert all((x == y).all() for x, y in zip(a.tokens, b.tokens, strict=True))


def test_chat_messages_render_once_without_a_second_system_line(tmp_path):
  tok = arith.load_tokenizer()
  examples = verl.load_examples(str(write_parquet(tmp_path / "train.parquet")))
  ps = prompts.build_prompts(examples, tok, style="chat")
  expected = tok.apply_chat_template(ROWS[0]["prompt"], add_generation_prompt=True)
  text = tok.decode(ps.tokens[0].tolist(), skip_special_tokens=False)
  assert text == expected
  assert text.count("<|system|>") == 1 and text.count(SUFFIX) == 1
  # The same problem without messages gets our system line and suffix added: one each too.
  own = prompts.build_prompts([{**examples[0], "messages": (), "problem": "What is 1+2?"}], tok)
  assert (own.tokens[0] == ps.tokens[0]).all()


def test_unformatted_rows_get_the_reformat_layout(tmp_path):
  path = write_parquet(tmp_path / "train.parquet", [{"problem": "What is 1+2?", "gt": "3"}])
  (ex,) = verl.load_examples(str(path))
  assert list(ex["messages"]) == ROWS[0]["prompt"] and ex["answer"] == "3"


def test_unformatted_problems_over_700_tokens_are_dropped_as_reformat_does(tmp_path):
  """reformat.py keeps a row when its problem encodes (BOS included) to <= 700 tokens; rows
  already in the verl layout are kept whatever their length."""
  tok = arith.load_tokenizer()  # one token per character, plus BOS
  rows = [{"problem": "1" * n, "gt": str(n)} for n in (698, 699, 700, 5000)]
  write_parquet(tmp_path / "train-0.parquet", rows)
  write_parquet(tmp_path / "train-1.parquet", [_row(9, "2" * 5000, "x")])
  kept = verl.drop_long_problems(verl.load_examples(str(tmp_path)), tok)
  assert [ex["answer"] for ex in kept] == ["698", "699", "x"]


def _bad(field, value):
  rows = [dict(r) for r in ROWS]
  if field.startswith("reward_model."):
    rows[1]["reward_model"] = {**rows[1]["reward_model"], field.split(".")[1]: value}
  elif field.startswith("prompt["):
    rows[1]["prompt"] = [rows[1]["prompt"][0], {"role": "user", "content": value}]
  else:
    rows[1][field] = value
  return rows


@pytest.mark.parametrize(
  "field,value,named",
  [
    ("reward_model.ground_truth", None, "reward_model.ground_truth"),
    ("reward_model.ground_truth", "  ", "reward_model.ground_truth"),
    ("reward_model", None, "reward_model"),
    ("prompt", [], "prompt"),
    ("prompt", [{"role": "system", "content": "x"}], "prompt"),
    ("prompt[1].content", None, "prompt[1].content"),
  ],
)
@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_a_malformed_row_names_file_row_and_field(tmp_path, field, value, named, suffix):
  write = write_parquet if suffix == ".parquet" else write_jsonl
  path = write(tmp_path / f"train{suffix}", _bad(field, value))
  with pytest.raises(ValueError) as e:
    verl.load_examples(str(path))
  message = str(e.value)
  assert str(path) in message and "row 1" in message and f"'{named}'" in message
  if suffix == ".jsonl":
    assert f"{path}:2 " in message  # and the file's line


def test_hub_id_resolves_in_the_manual_dir_else_fails_fast_offline(tmp_path):
  write_parquet(tmp_path / "manual" / "reinforce_ada_hard_prompt" / "data" / "train-0.parquet")
  write_parquet(
    tmp_path / "manual" / "reinforce_ada_hard_prompt" / "data" / "test-0.parquet", ROWS[:1]
  )
  examples = verl.load_examples("RLHFlow/reinforce_ada_hard_prompt", manual_dir=tmp_path / "manual")
  assert len(examples) == 3 and examples[0]["prompt_id"] == "reinforce_ada_hard_prompt/train-0/0"
  with pytest.raises(ConnectionError, match=r"RLHFlow/other: not at .*manual.*other.*offline"):
    verl.resolve("RLHFlow/other", tmp_path / "manual")
  with pytest.raises(FileNotFoundError, match="no .parquet or .jsonl files"):
    (tmp_path / "empty").mkdir()
    verl.resolve(str(tmp_path / "empty"))


@pytest.mark.parametrize("name", ["RLHFlow/..", "RLHFlow/.", "../x", "a/..b", "RLHFlow/.hidden"])
def test_a_hub_id_is_a_name_never_a_path(tmp_path, name, monkeypatch):
  """`RLHFlow/..` was a Hub id and resolved to `<manual_dir>/..`, reading every JSONL beside
  it; a model folder's Hub id is checked the same way."""
  from ada_jax.models import folder

  monkeypatch.chdir(tmp_path)
  write_parquet(tmp_path / "data" / "train-0.parquet")
  manual = tmp_path / "data" / "manual"
  manual.mkdir()
  assert not folder.is_hub_id(name)
  with pytest.raises(FileNotFoundError, match="not a Hub data set id"):
    verl.resolve(name, manual)
  with pytest.raises(folder.CheckpointError, match="not a Hugging Face repo id"):
    folder.resolve(name + "_absent")
  assert folder.is_hub_id("RLHFlow/reinforce_ada_hard_prompt")
  assert folder.is_hub_id("Qwen/Qwen2.5-Math-1.5B") and folder.is_hub_id("meta-llama/Llama-3.2-3B")


def _cfg(tmp_path, verl_set, **data):
  return config_lib.RunConfig(
    data=prompts.DataConfig(source="verl", verl_set=verl_set, **data),
    rl=config_lib.RLConfig(batch_prompts=2),
  )


def _prompts(cfg, tok):
  return inputs.load_prompts(cfg.data, tok, seed=cfg.seed)


def test_load_prompts_reads_a_verl_set_and_names_the_field_on_errors(tmp_path):
  tok = arith.load_tokenizer()
  path = write_parquet(tmp_path / "train.parquet")
  ps = _prompts(_cfg(tmp_path, str(path)), tok)
  assert len(ps) == 3 and ps.answers == ("3", "6", "6")
  bad = write_parquet(tmp_path / "bad" / "train.parquet", _bad("reward_model.ground_truth", None))
  with pytest.raises(
    config_lib.ConfigError, match=r"config\.data\.verl_set: .*row 1.*ground_truth"
  ):
    _prompts(_cfg(tmp_path, str(bad)), tok)
  with pytest.raises(config_lib.ConfigError, match=r"config\.data\.prompt_style"):
    _prompts(_cfg(tmp_path, str(path), prompt_style="plain"), tok)
  with pytest.raises(config_lib.ConfigError, match=r"config\.data\.manual_dir"):
    _prompts(_cfg(tmp_path, "RLHFlow/reinforce_ada_hard_prompt"), tok)


def _load(name):
  from ml_collections import config_flags

  path = ROOT / "configs" / f"{name}.py"
  return config_flags.config_flags._LoadConfigModule(name, str(path)).get_config()


@pytest.mark.parametrize(
  "name,hub_id",
  [
    ("llama3b_pos", "RLHFlow/reinforce_ada_hard_prompt_llama"),
    ("llama3b_balance", "RLHFlow/reinforce_ada_hard_prompt_llama"),
    ("llama3b_grpo", "RLHFlow/reinforce_ada_hard_prompt_llama"),
    ("qwen_math7b_balance", "RLHFlow/reinforce_ada_hard_prompt"),
    ("qwen_math15b_balance", "RLHFlow/reinforce_ada_hard_prompt_1-5b"),
  ],
)
def test_paper_configs_train_on_the_matching_released_set(name, hub_id):
  c = _load(name)
  assert c.data.source == "verl" and c.data.verl_set == hub_id


def test_a_float_reference_column_is_refused_naming_file_row_and_field(tmp_path):
  """The example: a Parquet float column, where a missing answer is NaN, was read as the
  reference 'nan' (which `\\boxed{nan}` then matched, scoring 1)."""
  rows = [_row(i, f"{i}+1?", a) for i, a in enumerate([3.0, float("nan"), 6.0])]
  path = write_parquet(tmp_path / "train.parquet", rows)
  with pytest.raises(ValueError) as e:
    verl.load_examples(str(path))
  message = str(e.value)
  assert str(path) in message and "row 0" in message and "'reward_model.ground_truth'" in message
  assert "a float (3.0), not a string" in message


@pytest.mark.parametrize(
  "value,kind",
  [(float("nan"), "a float (nan)"), (float("inf"), "a float (inf)"), (7, "an int (7)")],
)
def test_a_non_string_reference_is_refused_in_jsonl_too(tmp_path, value, kind):
  """Neighbours: NaN and infinity in a JSONL file (json writes them), an int, and the
  unformatted layout's `gt` field."""
  path = write_jsonl(tmp_path / "train.jsonl", _bad("reward_model.ground_truth", value))
  with pytest.raises(ValueError, match=r"row 1.*'reward_model\.ground_truth' is a"):
    verl.load_examples(str(path))
  unformatted = [{"problem": "1+1?", "gt": "2"}, {"problem": "2+2?", "gt": value}]
  path = write_jsonl(tmp_path / "raw.jsonl", unformatted)
  with pytest.raises(ValueError, match=r"row 1.*'gt' is a"):
    verl.load_examples(str(path))
