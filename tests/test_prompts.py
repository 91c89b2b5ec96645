"""Tests for ada_jax.prompts: prompt construction and the seeded resumable prompt iterator."""

import json

import numpy as np
import pytest

from ada_jax.data import arith, prompts
from ada_jax.data import sets as data
from ada_jax.models.tokenizer import Tokenizer, pad_left

# --------------------------------------------------------------------------- prompts


def test_build_prompts_chat_style_with_arith_tokenizer():
  tok = arith.load_tokenizer()
  examples = [{"prompt_id": "p0", "problem": "1+1=", "answer": "2"}]
  pset = prompts.build_prompts(examples, tok, style="chat", max_prompt_tokens=1000)
  text = tok.decode(pset.tokens[0], skip_special_tokens=False)
  assert text == (
    f"<bos><|system|>{prompts.SYSTEM_PROMPT}<|end|>"
    f"<|user|>1+1= {prompts.USER_SUFFIX}<|end|><|assistant|>"
  )
  assert pset.num_dropped == 0 and pset.answers == ("2",)


FRAME = prompts.PromptFrame(
  system="Put the final answer in \\boxed{}.",
  suffix="",
  examples=("What is 2 + 3?", "2 + 3 = 5. \\boxed{5}"),
)


def test_frame_puts_instruction_and_worked_example_into_the_chat():
  tok = arith.load_tokenizer()
  examples = [{"prompt_id": "p0", "problem": "What is 12 + 30?", "answer": "42"}]
  text = lambda style, frame: tok.decode(
    prompts.build_prompts(examples, tok, style=style, frame=frame).tokens[0],
    skip_special_tokens=False,
  )
  assert text("chat", FRAME) == (
    "<bos><|system|>Put the final answer in \\boxed{}.<|end|>"
    "<|user|>What is 2 + 3?<|end|><|assistant|>2 + 3 = 5. \\boxed{5}<|end|>"
    "<|user|>What is 12 + 30?<|end|><|assistant|>"
  )
  # No system message of its own: the worked example and the (default) suffix only.
  shot = prompts.PromptFrame(examples=FRAME.examples)
  assert text("chat_no_system", shot) == (
    f"<bos><|user|>What is 2 + 3? {prompts.USER_SUFFIX}<|end|>"
    "<|assistant|>2 + 3 = 5. \\boxed{5}<|end|>"
    f"<|user|>What is 12 + 30? {prompts.USER_SUFFIX}<|end|><|assistant|>"
  )
  assert text("plain", shot) == (
    f"<bos>Question: What is 2 + 3?\n{prompts.USER_SUFFIX}\nAnswer: 2 + 3 = 5. \\boxed{{5}}\n\n"
    f"Question: What is 12 + 30?\n{prompts.USER_SUFFIX}\nAnswer:"
  )
  # The default frame is the released prompt.
  assert text("chat", prompts.PromptFrame()) == text("chat", prompts.DataConfig().frame)
  assert prompts.PromptFrame().user("1+1=") == f"1+1= {prompts.USER_SUFFIX}"


@pytest.mark.parametrize(
  "style, frame, match",
  [
    ("raw", prompts.PromptFrame(suffix=""), "style 'raw' is the bare problem"),
    ("chat_no_system", prompts.PromptFrame(system="x"), "frame.system: style 'chat_no_system'"),
    ("plain", prompts.PromptFrame(system="x"), "frame.system: style 'plain'"),
  ],
)
def test_frame_a_style_cannot_place_is_refused(style, frame, match):
  examples = [{"prompt_id": "p0", "problem": "1+1=", "answer": "2"}]
  with pytest.raises(ValueError, match=match):
    prompts.build_prompts(examples, arith.load_tokenizer(), style=style, frame=frame)
  with pytest.raises(ValueError, match="need question / answer pairs"):
    prompts.PromptFrame(examples=("only a question",))


def test_arith_text_source_and_benchmark_take_the_frame():
  from ada_jax import config as config_lib
  from ada_jax import inputs
  from ada_jax.eval import benchmarks

  tok = arith.load_tokenizer()
  run = config_lib.parse(
    {
      "data": {
        "source": "arith_text",
        "arith": {"levels": [1, 2], "ops": ["+"]},
        "arith_prompts": 50,
        "frame": {"system": FRAME.system, "suffix": "", "examples": list(FRAME.examples)},
      }
    }
  )
  assert run.data.frame == FRAME
  ps = inputs.load_prompts(run.data, tok, seed=0)
  assert len(ps) == 50 and ps.problems[0].startswith("What is ")
  first = tok.decode(ps.tokens[0], skip_special_tokens=False)
  assert first.startswith("<bos><|system|>Put the final answer") and "\\boxed{5}" in first
  # The held-out twin: the same phrasing and frame, the boxed-answer judge.
  ev = benchmarks.EvalConfig(benchmarks=("arith_text",), arith_levels=(1, 2), frame=FRAME)
  bench = benchmarks.load_benchmark("arith_text", ev, tok)
  assert bench.judge == "math" and bench.prompts.problems[0].startswith("What is ")
  assert tok.decode(bench.prompts.tokens[0], skip_special_tokens=False).startswith(
    "<bos><|system|>Put the final answer"
  )
  assert not set(bench.prompts.problems) & set(ps.problems)
  # The bare task keeps its own format: a frame there is a config error naming the field.
  bare = config_lib.parse({"data": {"source": "arith", "frame": {"suffix": ""}}})
  with pytest.raises(config_lib.ConfigError, match=r"config\.data\.frame: .*source 'arith'"):
    inputs.load_prompts(bare.data, tok, seed=0)


def test_build_prompts_raw_and_length_limit():
  tok = arith.load_tokenizer()
  examples = arith.examples(arith.ArithConfig(), "train", 200, seed=3)
  pset = prompts.build_prompts(examples, tok, style="raw", max_prompt_tokens=24)
  assert len(pset) == 200 and pset.num_dropped == 0
  assert pset.max_length <= 24
  assert all(t[0] == tok.bos_id for t in pset.tokens)
  assert tok.decode(pset.tokens[5]) == examples[5]["problem"]
  # A limit between the shortest and longest prompt drops exactly the longer ones.
  lengths = np.array([len(t) for t in pset.tokens])
  limit = int(np.median(lengths))
  short = prompts.build_prompts(examples, tok, style="raw", max_prompt_tokens=limit)
  assert short.num_dropped == int((lengths > limit).sum()) > 0
  assert len(short) + short.num_dropped == 200
  kept = [ex["prompt_id"] for ex, n in zip(examples, lengths, strict=True) if n <= limit]
  assert list(short.prompt_ids) == kept
  with pytest.raises(ValueError, match="style="):
    prompts.build_prompts(examples, tok, style="fancy")
  with pytest.raises(ValueError, match=r"examples\[0\] has no field 'answer'"):
    prompts.build_prompts([{"prompt_id": "a", "problem": "1+1="}], tok)


def test_prompt_batch_left_padded():
  tok = arith.load_tokenizer()
  examples = arith.examples(arith.ArithConfig(), "test", 16, seed=0)
  pset = prompts.build_prompts(examples, tok, style="raw", max_prompt_tokens=24)
  ids, mask = pad_left([pset.tokens[i] for i in (3, 0, 7)], tok.pad_id, buckets=(16, 32))
  assert ids.shape == (3, 16) and ids.dtype == np.int32
  assert pset.answers[3] == examples[3]["answer"] and pset.answers[7] == examples[7]["answer"]
  for row, i in enumerate([3, 0, 7]):
    n = len(pset.tokens[i])
    np.testing.assert_array_equal(ids[row, 16 - n :], pset.tokens[i])
    assert mask[row].sum() == n and mask[row, -1]


def test_build_prompts_real_math500(shared_dir, tmp_path):
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
  examples = data.load_examples(
    "math500", "test", data_dir=tmp_path / "tfds", manual_dir=shared_dir / "data"
  )
  full = prompts.build_prompts(examples, tok, style="chat", max_prompt_tokens=1024)
  assert len(full) == 500 and full.num_dropped == 0
  assert full.tokens[0][0] == 128000 and (full.tokens[0][1:] != 128000).all()
  text = tok.decode(full.tokens[0])
  # decode drops the header tokens, leaving the role names.
  assert text.startswith(f"system\n\n{prompts.SYSTEM_PROMPT}user\n\n{examples[0]['problem']} ")
  assert text.endswith(f"{prompts.USER_SUFFIX}assistant\n\n")
  capped = prompts.build_prompts(examples, tok, style="chat", max_prompt_tokens=100)
  lengths = np.array([len(t) for t in full.tokens])
  assert capped.num_dropped == int((lengths > 100).sum()) > 0
  plain = prompts.build_prompts(examples[:3], tok, style="plain")
  assert plain.tokens[0][0] == 128000
  assert tok.decode(plain.tokens[0]).startswith("Question: ")


# --------------------------------------------------------------------------- iterator


def _take(it, k):
  return [next(it) for _ in range(k)]


def test_iterator_epochs_are_permutations():
  it = prompts.PromptIterator(12, 4, seed=7)
  batches = _take(it, 6)
  for epoch in range(2):
    seen = np.concatenate(batches[3 * epoch : 3 * epoch + 3])
    assert sorted(seen.tolist()) == list(range(12))
  assert not np.array_equal(np.concatenate(batches[:3]), np.arange(12))  # shuffled
  assert not np.array_equal(np.concatenate(batches[:3]), np.concatenate(batches[3:]))
  again = prompts.PromptIterator(12, 4, seed=7)
  assert all(np.array_equal(a, b) for a, b in zip(batches, _take(again, 6), strict=True))
  other = prompts.PromptIterator(12, 4, seed=8)
  assert not all(np.array_equal(a, b) for a, b in zip(batches, _take(other, 6), strict=True))
  ordered = prompts.PromptIterator(5, 2, seed=0, shuffle=False)
  assert [b.tolist() for b in _take(ordered, 3)] == [[0, 1], [2, 3], [0, 1]]


def test_iterator_remainder_policies():
  dropping = prompts.PromptIterator(10, 4, seed=1)
  for b in _take(dropping, 10):
    assert len(b) == 4 and len(set(b.tolist())) == 4
  assert dropping.state()["epoch"] == 5  # two batches per epoch
  wrapping = prompts.PromptIterator(10, 4, seed=1, drop_remainder=False)
  counts = np.bincount(np.concatenate(_take(wrapping, 5)), minlength=10)
  np.testing.assert_array_equal(counts, np.full(10, 2))  # 20 draws = exactly 2 epochs
  with pytest.raises(ValueError, match="no full batch"):
    prompts.PromptIterator(3, 4, seed=0)


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_iterator_restores_exactly(drop_remainder):
  it = prompts.PromptIterator(37, 8, seed=3, drop_remainder=drop_remainder)
  _take(it, 7)
  state = it.state()
  assert all(v.dtype == np.int64 and v.shape == () for v in state.values())
  expected = _take(it, 9)
  # Through JSON and back, as a checkpoint would store it.
  saved = json.loads(json.dumps({k: int(v) for k, v in state.items()}))
  fresh = prompts.PromptIterator(37, 8, seed=999, drop_remainder=drop_remainder)
  fresh.restore(saved)
  assert all(np.array_equal(a, b) for a, b in zip(expected, _take(fresh, 9), strict=True))
  with pytest.raises(ValueError, match="prompt set changed"):
    prompts.PromptIterator(36, 8, seed=3).restore(saved)
