"""Tests for ada_jax.data: TFDS builders on the real JSONL sets, prompts, the prompt iterator."""

import json
import shutil

import numpy as np
import pytest

from ada_jax import arith, data
from ada_jax.tokenizer import Tokenizer

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
      assert set(ex) == set(data.FEATURES)
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
  spec = data.user_jsonl_spec(
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
  # MATH training prompts plus the user's file.
  both = data.with_extra_training_files(data.SETS["math_train"], spec)
  combined = data.load_examples(both, "train", data_dir=data_dir, manual_dir=manual_dir)
  assert len(combined) == 4500 + 2
  assert combined[-1]["prompt_id"] == "mine/mine/2"
  # Wrong field name: file, line and field in the message.
  bad = data.user_jsonl_spec("bad", [user], problem_field="question")
  with pytest.raises(ValueError, match=r"mine\.jsonl:1: field 'question'"):
    data.load_examples(bad, "train", data_dir=data_dir, manual_dir=manual_dir)
  with pytest.raises(FileNotFoundError, match="no such JSONL"):
    data.user_jsonl_spec("x", [tmp_path / "absent.jsonl"])


def test_manual_dir_without_file_and_no_url(tmp_path):
  empty = tmp_path / "manual"
  empty.mkdir()
  (empty / "other.txt").write_text("x")
  spec = data.MathSetSpec("nourl", (data.JsonlSource("test", "nourl.jsonl"),))
  with pytest.raises(FileNotFoundError, match="nourl.jsonl: not in the manual directory"):
    data.builder(spec, data_dir=tmp_path / "tfds", manual_dir=empty)


# --------------------------------------------------------------------------- prompts


def test_build_prompts_chat_style_with_arith_tokenizer():
  tok = arith.load_tokenizer()
  examples = [{"prompt_id": "p0", "problem": "1+1=", "answer": "2"}]
  prompts = data.build_prompts(examples, tok, style="chat", max_prompt_tokens=1000)
  text = tok.decode(prompts.tokens[0], skip_special_tokens=False)
  assert text == (
    f"<bos><|system|>{data.SYSTEM_PROMPT}<|end|><|user|>1+1= {data.USER_SUFFIX}<|end|><|assistant|>"
  )
  assert prompts.num_dropped == 0 and prompts.answers == ("2",)


def test_build_prompts_raw_and_length_limit():
  tok = arith.load_tokenizer()
  examples = arith.examples(arith.ArithConfig(), "train", 200, seed=3)
  prompts = data.build_prompts(examples, tok, style="raw", max_prompt_tokens=24)
  assert len(prompts) == 200 and prompts.num_dropped == 0
  assert prompts.max_length <= 24
  assert all(t[0] == tok.bos_id for t in prompts.tokens)
  assert tok.decode(prompts.tokens[5]) == examples[5]["problem"]
  # A limit between the shortest and longest prompt drops exactly the longer ones.
  lengths = np.array([len(t) for t in prompts.tokens])
  limit = int(np.median(lengths))
  short = data.build_prompts(examples, tok, style="raw", max_prompt_tokens=limit)
  assert short.num_dropped == int((lengths > limit).sum()) > 0
  assert len(short) + short.num_dropped == 200
  kept = [ex["prompt_id"] for ex, n in zip(examples, lengths, strict=True) if n <= limit]
  assert list(short.prompt_ids) == kept
  with pytest.raises(ValueError, match="style="):
    data.build_prompts(examples, tok, style="fancy")
  with pytest.raises(ValueError, match=r"examples\[0\] has no field 'answer'"):
    data.build_prompts([{"prompt_id": "a", "problem": "1+1="}], tok)


def test_prompt_batch_left_padded():
  tok = arith.load_tokenizer()
  examples = arith.examples(arith.ArithConfig(), "test", 16, seed=0)
  prompts = data.build_prompts(examples, tok, style="raw", max_prompt_tokens=24)
  batch = prompts.batch([3, 0, 7], pad_id=tok.pad_id, buckets=(16, 32))
  assert batch.tokens.shape == (3, 16) and batch.tokens.dtype == np.int32
  assert batch.prompt_ids == (prompts.prompt_ids[3], prompts.prompt_ids[0], prompts.prompt_ids[7])
  assert batch.answers == (examples[3]["answer"], examples[0]["answer"], examples[7]["answer"])
  for row, i in enumerate([3, 0, 7]):
    n = len(prompts.tokens[i])
    np.testing.assert_array_equal(batch.tokens[row, 16 - n :], prompts.tokens[i])
    assert batch.mask[row].sum() == n and batch.mask[row, -1]


def test_build_prompts_real_math500(shared_dir, loaded, tmp_path):
  folder = tmp_path / "llama3"
  folder.mkdir()
  (folder / "tokenizer.json").symlink_to(shared_dir / "tokenizers" / "llama3" / "tokenizer.json")
  template = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
  )
  tok = Tokenizer.from_dir(folder, chat_template=template, eos_ids=[128009, 128001], bos_id=128000)
  examples = loaded["math500", "test"]
  full = data.build_prompts(examples, tok, style="chat", max_prompt_tokens=1024)
  assert len(full) == 500 and full.num_dropped == 0
  assert full.tokens[0][0] == 128000 and (full.tokens[0][1:] != 128000).all()
  text = tok.decode(full.tokens[0])
  # decode drops the header tokens, leaving the role names.
  assert text.startswith(f"system\n\n{data.SYSTEM_PROMPT}user\n\n{examples[0]['problem']} ")
  assert text.endswith(f"{data.USER_SUFFIX}assistant\n\n")
  capped = data.build_prompts(examples, tok, style="chat", max_prompt_tokens=100)
  lengths = np.array([len(t) for t in full.tokens])
  assert capped.num_dropped == int((lengths > 100).sum()) > 0
  plain = data.build_prompts(examples[:3], tok, style="plain")
  assert plain.tokens[0][0] == 128000
  assert tok.decode(plain.tokens[0]).startswith("Question: ")


# --------------------------------------------------------------------------- iterator


def _take(it, k):
  return [next(it) for _ in range(k)]


def test_iterator_epochs_are_permutations():
  it = data.PromptIterator(12, 4, seed=7)
  batches = _take(it, 6)
  for epoch in range(2):
    seen = np.concatenate(batches[3 * epoch : 3 * epoch + 3])
    assert sorted(seen.tolist()) == list(range(12))
  assert not np.array_equal(np.concatenate(batches[:3]), np.arange(12))  # shuffled
  assert not np.array_equal(np.concatenate(batches[:3]), np.concatenate(batches[3:]))
  again = data.PromptIterator(12, 4, seed=7)
  assert all(np.array_equal(a, b) for a, b in zip(batches, _take(again, 6), strict=True))
  other = data.PromptIterator(12, 4, seed=8)
  assert not all(np.array_equal(a, b) for a, b in zip(batches, _take(other, 6), strict=True))
  ordered = data.PromptIterator(5, 2, seed=0, shuffle=False)
  assert [b.tolist() for b in _take(ordered, 3)] == [[0, 1], [2, 3], [0, 1]]


def test_iterator_remainder_policies():
  dropping = data.PromptIterator(10, 4, seed=1)
  for b in _take(dropping, 10):
    assert len(b) == 4 and len(set(b.tolist())) == 4
  assert dropping.state()["epoch"] == 5  # two batches per epoch
  wrapping = data.PromptIterator(10, 4, seed=1, drop_remainder=False)
  counts = np.bincount(np.concatenate(_take(wrapping, 5)), minlength=10)
  np.testing.assert_array_equal(counts, np.full(10, 2))  # 20 draws = exactly 2 epochs
  with pytest.raises(ValueError, match="no full batch"):
    data.PromptIterator(3, 4, seed=0)


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_iterator_restores_exactly(drop_remainder):
  it = data.PromptIterator(37, 8, seed=3, drop_remainder=drop_remainder)
  _take(it, 7)
  state = it.state()
  assert all(v.dtype == np.int64 and v.shape == () for v in state.values())
  expected = _take(it, 9)
  # Through JSON and back, as a checkpoint would store it.
  saved = json.loads(json.dumps({k: int(v) for k, v in state.items()}))
  fresh = data.PromptIterator(37, 8, seed=999, drop_remainder=drop_remainder)
  fresh.restore(saved)
  assert all(np.array_equal(a, b) for a, b in zip(expected, _take(fresh, 9), strict=True))
  with pytest.raises(ValueError, match="prompt set changed"):
    data.PromptIterator(36, 8, seed=3).restore(saved)


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
    list(data.read_jsonl(path))
  path.write_text('{"problem": "a"}\n[1, 2]\n')
  with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected a JSON object"):
    list(data.read_jsonl(path))
