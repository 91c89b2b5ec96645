"""Tests for ada_jax.data: TFDS builders on the real JSONL sets, JSONL reading, specs, and
rows, files and paths that would become wrong references (refused, nothing written)."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from ada_jax.data import sets as data
from ada_jax.data import sources

# Row counts of ../shared/data/README.md (math_train: 5000 MATH test problems minus MATH500).
README_ROWS = {
  ("gsm8k", "train"): 7473,
  ("gsm8k", "test"): 1319,
  ("math_train", "train"): 4500,
  ("math500", "test"): 500,
  ("minerva_math", "test"): 272,
  ("olympiadbench", "test"): 675,
  ("aime24", "test"): 30,
  ("amc23", "test"): 40,
}


@pytest.fixture(scope="module")
def manual_dir(shared_dir):
  return shared_dir / "data"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def loaded(manual_dir, data_dir):
  """(set, split) -> examples, every builder prepared from the manual directory."""
  out = {}
  for name, split in README_ROWS:
    out[name, split] = data.load_examples(name, split, data_dir=data_dir, manual_dir=manual_dir)
  return out


def _rows(path):
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_builders_prepare_with_readme_row_counts(loaded, manual_dir, data_dir):
  for (name, split), examples in loaded.items():
    assert len(examples) == README_ROWS[name, split], (name, split)
    for ex in examples:
      assert set(ex) == set(sources.FEATURES)
      assert all(isinstance(v, str) and v for v in ex.values()), ex
    ids = [ex["prompt_id"] for ex in examples]
    assert len(set(ids)) == len(ids)
  # The split info recorded by TFDS agrees, and a second call reads the prepared files.
  b = data.builder("gsm8k", data_dir=data_dir, manual_dir=manual_dir)
  assert b.info.splits["train"].num_examples == 7473
  assert b.info.splits["test"].num_examples == 1319
  assert (data_dir / "ada_math" / "gsm8k" / "1.0.0").is_dir()


def test_fields_and_stable_ids(loaded, manual_dir):
  m500 = loaded["math500", "test"]
  first = _rows(manual_dir / "math500_test.jsonl")[0]
  assert m500[0] == {
    "prompt_id": "math500/test/precalculus/807.json",
    "problem": first["problem"],
    "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
    "source": "math500",
  }
  gsm = loaded["gsm8k", "test"]
  row17 = _rows(manual_dir / "gsm8k_test.jsonl")[17]
  assert gsm[17]["prompt_id"] == "gsm8k/test/17"
  assert gsm[17]["problem"] == row17["question"]
  assert gsm[17]["answer"] == row17["answer"].split("####")[-1].strip().replace(",", "")
  assert gsm[0]["answer"] == "18"
  # Thousands separators are dropped from GSM8K answers.
  assert all("," not in ex["answer"] for ex in loaded["gsm8k", "train"])
  assert loaded["amc23", "test"][0]["answer"] == "27"  # stored as the float 27.0
  assert loaded["olympiadbench", "test"][0]["answer"] == "2"  # stored as ['2']
  assert all("$" not in ex["answer"] for ex in loaded["olympiadbench", "test"])
  assert loaded["aime24", "test"][0]["answer"] == "204"
  minerva = loaded["minerva_math", "test"]
  assert minerva[0]["prompt_id"] == "minerva_math/test/0"
  assert "\\boxed" not in minerva[0]["answer"]
  math_train = loaded["math_train", "train"]
  assert all(ex["prompt_id"].startswith("math/test/") for ex in math_train)
  assert {ex["source"] for ex in math_train} == {"math"}


def test_math500_never_in_math_train(loaded):
  def norm(s):
    return " ".join(s.split())

  m500 = {norm(ex["problem"]) for ex in loaded["math500", "test"]}
  train = [norm(ex["problem"]) for ex in loaded["math_train", "train"]]
  assert len(m500) == 500
  assert not m500.intersection(train)


def test_malformed_line_names_file_and_line(tmp_path, manual_dir):
  manual = tmp_path / "manual"
  manual.mkdir()
  lines = (manual_dir / "aime24_test.jsonl").read_text().splitlines()
  lines[2] = lines[2][:40]  # truncated JSON on line 3
  (manual / "aime24_test.jsonl").write_text("\n".join(lines) + "\n")
  with pytest.raises(ValueError, match=r"aime24_test\.jsonl:3: malformed JSON"):
    data.builder("aime24", data_dir=tmp_path / "tfds", manual_dir=manual)


def test_missing_field_names_file_line_and_field(tmp_path, manual_dir):
  manual = tmp_path / "manual"
  manual.mkdir()
  rows = _rows(manual_dir / "amc23_test.jsonl")
  del rows[4]["question"]
  (manual / "amc23_test.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  with pytest.raises(ValueError, match=r"amc23_test\.jsonl:5: field 'question'"):
    data.builder("amc23", data_dir=tmp_path / "tfds", manual_dir=manual)


def test_unknown_set():
  with pytest.raises(ValueError, match="unknown data set"):
    data.builder("gsm9k", data_dir="/nonexistent")


def test_user_jsonl_dataset(tmp_path, manual_dir, data_dir):
  m500 = _rows(manual_dir / "math500_test.jsonl")
  user = tmp_path / "mine.jsonl"
  rows = [
    {"q": "What is 1+1?", "sol": "It is $\\boxed{2}$."},
    {"q": m500[5]["problem"], "sol": "\\boxed{0}"},  # a MATH500 problem: dropped
    {"q": "Simplify $\\frac{4}{6}$.", "sol": "\\boxed{\\frac{2}{3}}"},
  ]
  user.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  spec = sources.user_jsonl_spec(
    "mine", [user], problem_field="q", answer_field="sol", answer_format="boxed"
  )
  examples = data.load_examples(spec, "train", data_dir=data_dir, manual_dir=manual_dir)
  assert examples == [
    {"prompt_id": "mine/mine/0", "problem": "What is 1+1?", "answer": "2", "source": "mine"},
    {
      "prompt_id": "mine/mine/2",
      "problem": "Simplify $\\frac{4}{6}$.",
      "answer": "\\frac{2}{3}",
      "source": "mine",
    },
  ]
  # Wrong field name: file, line and field in the message.
  bad = sources.user_jsonl_spec("bad", [user], problem_field="question")
  with pytest.raises(ValueError, match=r"mine\.jsonl:1: field 'question'"):
    data.load_examples(bad, "train", data_dir=data_dir, manual_dir=manual_dir)
  with pytest.raises(FileNotFoundError, match="no such JSONL"):
    sources.user_jsonl_spec("x", [tmp_path / "absent.jsonl"])


def test_manual_dir_without_file_and_no_url(tmp_path):
  empty = tmp_path / "manual"
  empty.mkdir()
  (empty / "other.txt").write_text("x")
  spec = sources.MathSetSpec("nourl", (sources.JsonlSource("test", "nourl.jsonl"),))
  with pytest.raises(FileNotFoundError, match="nourl.jsonl: not in the manual directory"):
    data.builder(spec, data_dir=tmp_path / "tfds", manual_dir=empty)


def test_copy_of_manual_dir_is_enough(tmp_path, manual_dir):
  """A manual directory holding only the needed file works (no other files, no network)."""
  manual = tmp_path / "manual"
  manual.mkdir()
  shutil.copy(manual_dir / "amc23_test.jsonl", manual)
  examples = data.load_examples("amc23", "test", data_dir=tmp_path / "tfds", manual_dir=manual)
  assert len(examples) == 40


def test_invalid_utf8_and_non_object_lines(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_bytes(b'{"problem": "a", "answer": "1"}\n\n{"problem": "\xff\xfe"}\n')
  with pytest.raises(ValueError, match=r"bad\.jsonl:3: not UTF-8"):
    list(sources.read_jsonl(path))
  path.write_text('{"problem": "a"}\n[1, 2]\n')
  with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected a JSON object"):
    list(sources.read_jsonl(path))


def test_user_set_cache_name_changes_with_the_math500_filter(tmp_path):
  """The filter changes the rows, so a set prepared without it is never read back with it."""
  user = tmp_path / "mine.jsonl"
  user.write_text('{"problem": "1+1", "answer": "2"}\n')
  names = {
    sources.user_jsonl_spec("u", [user], exclude_math500=flag).name for flag in (True, False)
  }
  assert len(names) == 2


# ----------------------------------------------------------- data that is no reference

_GOOD_ANSWER = {"plain": '"2"', "gsm8k": '"1 + 1 = 2\\n#### 2"', "boxed": '"so \\\\boxed{2}"'}


@pytest.mark.parametrize(
  "value, answer_format, message",
  [
    ("null", "plain", "field 'answer' is null, not a string or a number"),
    ('["1", "2"]', "plain", "field 'answer' is a list"),
    ('{"v": 1}', "plain", "field 'answer' is an object"),
    ("true", "plain", "field 'answer' is a boolean"),
    ("NaN", "plain", "field 'answer' is nan, not a finite number"),
    ('" \\t "', "plain", "field 'answer' gives an empty answer"),
    ('""', "plain", "field 'answer' gives an empty answer"),
    ('["#### 5"]', "gsm8k", "field 'answer' is a list"),
    ('"#### "', "gsm8k", "field 'answer' gives an empty answer"),
    ('"5"', "gsm8k", "field 'answer': no '####' final-answer marker"),
    ('["\\\\boxed{2}"]', "boxed", "field 'answer' is a list"),
    ('"\\\\boxed{ }"', "boxed", "field 'answer': no complete \\boxed{} answer"),
  ],
)
def test_answer_that_is_no_answer_names_file_line_and_field(
  tmp_path, value, answer_format, message
):
  user = tmp_path / "mine.jsonl"
  good = _GOOD_ANSWER[answer_format]
  user.write_text(
    f'{{"problem": "1+1?", "answer": {good}}}\n\n{{"problem": "2+2?", "answer": {value}}}\n'
  )
  spec = sources.user_jsonl_spec("mine", [user], answer_format=answer_format, exclude_math500=False)
  with pytest.raises(ValueError, match=rf"mine\.jsonl:3: {re.escape(message)}"):
    data.load_examples(spec, "train", data_dir=tmp_path / "tfds")
  assert not (tmp_path / "tfds").exists()  # refused before TFDS writes anything
  user.write_text(f'{{"problem": "1+1?", "answer": {good}}}\n{{"problem": "2", "answer": 2.0}}\n')
  examples = data.load_examples(
    sources.user_jsonl_spec("mine", [user], exclude_math500=False), "train", data_dir=tmp_path
  )
  assert examples[1]["answer"] == "2"  # a JSON number is its digits


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_file_is_named_before_tfds_writes(tmp_path, text):
  user = tmp_path / "mine.jsonl"
  user.write_text(text)
  spec = sources.user_jsonl_spec("mine", [user], exclude_math500=False)
  with pytest.raises(ValueError, match=r"mine\.jsonl: no rows \(the file is empty or blank\)"):
    data.load_examples(spec, "train", data_dir=tmp_path / "tfds")
  manual = _tiny_gsm8k(tmp_path / "manual")
  (manual / "gsm8k_test.jsonl").write_text(text)
  with pytest.raises(ValueError, match=r"gsm8k_test\.jsonl: no rows"):
    data.load_examples("gsm8k", "train", data_dir=tmp_path / "tfds", manual_dir=manual)
  assert not (tmp_path / "tfds").exists()


def test_split_without_examples_after_decontamination(tmp_path):
  train, banned = tmp_path / "train.jsonl", tmp_path / "banned.jsonl"
  train.write_text('{"problem": "What is  1+1?", "answer": "2"}\n')
  banned.write_text('{"problem": "What is 1+1?", "answer": "2"}\n')
  src, ex = sources.JsonlSource("train", str(train)), sources.JsonlSource("test", str(banned))
  spec = sources.MathSetSpec("t", (src,), exclude=(ex,))
  with pytest.raises(ValueError, match=r"t/train: no examples left: every problem is in"):
    list(sources.iter_examples(spec, "train", {src: train, ex: banned}))


def test_no_paths_is_refused():
  with pytest.raises(ValueError, match="jsonl_paths is empty"):
    sources.user_jsonl_spec("mine", [])


def _jsonl_run_config(tmp_path, rows):
  from configs import tiny_arith_pos

  c = tiny_arith_pos.get_config()
  c.data.source = "jsonl"
  c.data.exclude_math500 = False
  if rows is not None:
    (tmp_path / "mine.jsonl").write_text(rows)
    c.data.jsonl_paths = (str(tmp_path / "mine.jsonl"),)
  return c


@pytest.mark.parametrize(
  "rows, match",
  [
    (None, r"config\.data: jsonl_paths is empty"),
    (
      '{"problem": "1+1?", "answer": null}\n',
      r"config\.data: .*mine\.jsonl:1: field 'answer' is null",
    ),
    ('{"problem": "1+1?", "answer": ["1", "2"]}\n', r"mine\.jsonl:1: field 'answer' is a list"),
    ("", r"config\.data: .*mine\.jsonl: no rows"),
  ],
)
def test_bad_user_data_is_a_config_error_with_nothing_written(tmp_path, monkeypatch, rows, match):
  """TFDS's default data directory (~/tensorflow_datasets) stays untouched."""
  from ada_jax import config as config_lib
  from ada_jax import inputs
  from ada_jax.data import arith

  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.delenv("TFDS_DATA_DIR", raising=False)
  cfg = config_lib.parse(_jsonl_run_config(tmp_path, rows))
  with pytest.raises(config_lib.ConfigError, match=match):
    inputs.load_prompts(cfg.data, arith.load_tokenizer(), seed=cfg.seed)
  assert not (tmp_path / "home").exists()


def test_main_without_jsonl_paths_exits_2_with_one_line(tmp_path):
  root = pathlib.Path(__file__).resolve().parents[1]
  env = {k: v for k, v in os.environ.items() if k != "TFDS_DATA_DIR"}
  env.update(HOME=str(tmp_path / "home"), PYTHONPATH=str(root))
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "ada_jax.main",
      f"--config={root / 'configs' / 'tiny_arith_pos.py'}",
      f"--workdir={tmp_path / 'run'}",
      "--config.data.source=jsonl",
    ],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert (
    proc.stderr.strip().splitlines()[-1].startswith("ada_jax: config.data: jsonl_paths is empty")
  )
  assert "Traceback" not in proc.stderr
  assert not (tmp_path / "home").exists() and not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- offline


def _tiny_gsm8k(folder, rows=3):
  folder.mkdir(parents=True, exist_ok=True)
  for split in ("train", "test"):
    with open(folder / f"gsm8k_{split}.jsonl", "w") as f:
      for i in range(rows):
        f.write(
          json.dumps({"question": f"{split} {i}: 2 + {i}?", "answer": f"... #### {2 + i}"}) + "\n"
        )
  return folder


def test_local_files_are_read_without_probe_or_download_banner(tmp_path, monkeypatch, capfd):
  def probe(url, timeout_s=3.0):
    raise AssertionError(f"probed {url} although every file is local")

  monkeypatch.setattr(data, "reachable", probe)
  manual = _tiny_gsm8k(tmp_path / "manual")
  examples = data.load_examples("gsm8k", "train", data_dir=tmp_path / "tfds", manual_dir=manual)
  assert [e["answer"] for e in examples] == ["2", "3", "4"]
  out, err = capfd.readouterr()
  assert "Downloading and preparing" not in out + err
  assert "downloaded and prepared" not in out + err


@pytest.mark.parametrize("manual", [None, "empty", "only_train"])
def test_offline_and_files_missing_fails_at_once_naming_them(tmp_path, monkeypatch, manual):
  probes = []
  monkeypatch.setattr(data, "reachable", lambda url, timeout_s=3.0: probes.append(url) or False)
  folder = None
  if manual is not None:
    folder = tmp_path / "manual"
    folder.mkdir()
    if manual == "only_train":
      _tiny_gsm8k(folder)
      (folder / "gsm8k_test.jsonl").unlink()
  expected = "gsm8k_test.jsonl" if manual == "only_train" else "gsm8k_train.jsonl, gsm8k_test"
  with pytest.raises(ConnectionError, match=f"{expected}.* not in .*unreachable"):
    data.load_examples("gsm8k", "train", data_dir=tmp_path / "tfds", manual_dir=folder)
  assert len(probes) == 1  # one probe, no download retries
  assert not (tmp_path / "tfds" / "ada_math" / "gsm8k" / "1.0.0").exists()


def test_prepared_data_needs_neither_files_nor_network(tmp_path, monkeypatch):
  manual = _tiny_gsm8k(tmp_path / "manual")
  data.load_examples("gsm8k", "test", data_dir=tmp_path / "tfds", manual_dir=manual)
  monkeypatch.setattr(data, "reachable", lambda url, timeout_s=3.0: False)
  shutil.rmtree(manual)
  data.check_available("gsm8k", data_dir=tmp_path / "tfds", manual_dir=None)
  assert len(data.load_examples("gsm8k", "test", data_dir=tmp_path / "tfds")) == 3


_REACHABLE = data.reachable  # the module's own (tests/conftest.py patches it per test)


def test_reachable_probes_one_local_port():
  import socket

  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  port = server.getsockname()[1]
  reachable = _REACHABLE
  try:
    assert reachable(f"http://127.0.0.1:{port}/x.jsonl", timeout_s=2.0)
  finally:
    server.close()
  assert not reachable(f"http://127.0.0.1:{port}/x.jsonl", timeout_s=2.0)


def test_the_tfds_data_directory_has_one_default(monkeypatch, tmp_path):
  monkeypatch.setenv("TFDS_DATA_DIR", "")  # set but empty: the home default, as if unset
  home = str(pathlib.Path.home() / "tensorflow_datasets")
  assert data.tfds_data_dir() == home == data.tfds_data_dir("")
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
  assert data.tfds_data_dir() == str(tmp_path)
  assert data.tfds_data_dir("/given") == "/given"
