"""Tests for ada_jax.arith: deterministic problems, honest levels, disjoint splits, tokenizer."""

import dataclasses
import filecmp
import itertools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ada_jax.data import arith
from ada_jax.models.tokenizer import Tokenizer
from ada_jax.rewards import grader as rewards

PROBLEM = re.compile(r"(\d+)([-+*])(\d+)=")


def _parse(problem):
  m = PROBLEM.fullmatch(problem)
  assert m, problem
  return int(m.group(1)), m.group(2), int(m.group(3))


def test_deterministic_for_a_seed():
  cfg = arith.ArithConfig()
  a = arith.examples(cfg, "train", 300, seed=11)
  assert a == arith.examples(cfg, "train", 300, seed=11)
  assert a[:50] == arith.examples(cfg, "train", 50, seed=11)  # a prefix, not a new draw
  b = arith.examples(cfg, "train", 300, seed=12)
  assert [e["problem"] for e in a] != [e["problem"] for e in b]
  assert len({e["prompt_id"] for e in a}) == 300


@pytest.mark.parametrize("split", arith.SPLITS)
def test_levels_are_digit_counts_and_answers_exact(split):
  cfg = arith.ArithConfig(levels=(1, 2, 3, 4, 5))
  examples = arith.examples(cfg, split, 1500, seed=0)
  levels_seen = set()
  for ex in examples:
    a, op, b = _parse(ex["problem"])
    level = int(ex["source"].removeprefix("arith/L"))
    levels_seen.add(level)
    assert len(str(a)) == len(str(b)) == level
    expected = {"+": a + b, "-": a - b, "*": a * b}[op]
    assert ex["answer"] == str(expected)
    assert expected >= 0
  assert levels_seen == {1, 2, 3, 4, 5}


def test_level_weights_and_ops():
  cfg = arith.ArithConfig(levels=(2, 4), level_weights=(3.0, 1.0), ops=("*",))
  examples = arith.examples(cfg, "train", 2000, seed=5)
  level2 = np.mean([e["source"] == "arith/L2" for e in examples])
  assert 0.71 < level2 < 0.79  # 0.75 expected; sd ~0.01
  assert all(_parse(e["problem"])[1] == "*" for e in examples)
  only2 = arith.ArithConfig(levels=(2, 3), level_weights=(1.0, 0.0))
  assert {e["source"] for e in arith.examples(only2, "test", 100, seed=0)} == {"arith/L2"}


def test_splits_never_overlap():
  cfg = arith.ArithConfig(levels=(1, 2))
  train = {e["problem"] for e in arith.examples(cfg, "train", 4000, seed=1)}
  test = {e["problem"] for e in arith.examples(cfg, "test", 600, seed=1)}
  assert train and test and not train & test
  # Another seed draws from the same partition.
  test2 = {e["problem"] for e in arith.examples(cfg, "test", 600, seed=2)}
  assert not train & test2
  # The held-out share over all 2-digit additions is close to the fixed fraction.
  pairs = list(itertools.product(range(10, 100), repeat=2))
  share = np.mean([arith.is_heldout(a, "+", b) for a, b in pairs])
  assert 0.08 < share < 0.12


def _key(problem: str) -> tuple[int, str, int]:
  return arith.canonical(*_parse(problem))


@settings(max_examples=25, deadline=None)
@given(
  levels=st.lists(st.integers(1, 5), min_size=1, max_size=3, unique=True),
  ops=st.lists(st.sampled_from(sorted(arith.OPS)), min_size=1, max_size=3, unique=True),
  seed=st.integers(0, 2**16),
  n=st.integers(1, 300),
)
def test_heldout_problems_are_distinct_and_twins_share_a_split(levels, ops, seed, n):
  cfg = arith.ArithConfig(levels=tuple(sorted(levels)), ops=tuple(ops))
  n = min(n, arith.heldout_size(cfg))
  test = arith.examples(cfg, "test", n, seed=seed)
  keys = [_key(e["problem"]) for e in test]
  assert len(test) == n and len(set(keys)) == n  # distinct, twins counted once
  assert test[: n // 2] == arith.examples(cfg, "test", n // 2, seed=seed)  # a prefix
  for a, op, b in keys:
    assert arith.is_heldout(a, op, b)
    assert op not in arith.COMMUTATIVE or arith.is_heldout(b, op, a)
  train = arith.examples(cfg, "train", 400, seed=seed)
  # Neither a training problem nor its commuted twin is held out.
  assert not {_key(e["problem"]) for e in train} & set(keys)


@pytest.mark.parametrize(
  ("levels", "ops"), [((1,), ("+",)), ((1,), ("+", "-", "*")), ((1, 2), ("-",)), ((2,), ("*",))]
)
def test_asking_for_more_heldout_problems_than_the_split_holds_is_refused(levels, ops):
  cfg = arith.ArithConfig(levels=levels, ops=ops)
  size = arith.heldout_size(cfg)
  # The exact count of a listed cell: every canonical problem, hashed.
  expected = sum(
    arith.is_heldout(*(arith.canonical(a, op, b) if op != "-" else (b, op, a)))
    for lv in levels
    for op in ops
    for a in (range(10) if lv == 1 else range(10 ** (lv - 1), 10**lv))
    for b in (range(10) if lv == 1 else range(10 ** (lv - 1), 10**lv))
    if a <= b
  )
  assert size == expected
  everything = arith.examples(cfg, "test", size, seed=3)
  assert len({_key(e["problem"]) for e in everything}) == size
  with pytest.raises(
    ValueError, match=f"{size + 1} distinct held-out problems asked for.* hold {size}"
  ):
    arith.examples(cfg, "test", size + 1, seed=3)


def test_the_split_is_fixed_not_a_setting():
  assert "heldout_fraction" not in {f.name for f in dataclasses.fields(arith.ArithConfig)}


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"levels": (0, 2)}, "levels="),
    ({"levels": (1, 2), "level_weights": (1.0,)}, "level_weights="),
    ({"ops": ("/",)}, "ops="),
    ({"levels": (2, 2)}, "levels=.*each may appear once"),
    ({"ops": ("+", "-", "+")}, "ops=.*each may appear once"),
  ],
)
def test_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    arith.ArithConfig(**kwargs)


def test_bad_split():
  with pytest.raises(ValueError, match="split="):
    arith.examples(arith.ArithConfig(), "valid", 3, seed=0)


# --------------------------------------------------------------------------- tokenizer


def test_shipped_tokenizer_is_the_generated_one(tmp_path):
  folder = arith.write_tokenizer(tmp_path)
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    assert filecmp.cmp(folder / name, arith.TOKENIZER_DIR / name, shallow=False), name


def test_tokenizer_ids_and_round_trip():
  tok = arith.load_tokenizer()
  assert isinstance(tok, Tokenizer)
  assert tok.vocab_size == len(arith.VOCAB)
  assert (tok.pad_id, tok.bos_id, tok.eos_ids) == (0, 1, (2,))
  boxed = tok.token_to_id(arith.BOXED)
  assert tok.encode("\\boxed{357}") == [boxed, *tok.encode("357"), tok.token_to_id("}")]
  assert tok.encode("12+345=") == [tok.token_to_id(c) for c in "12+345="]
  examples = arith.examples(arith.ArithConfig(), "train", 300, seed=0)
  for ex in examples:
    prompt = tok.encode(ex["problem"], add_bos=True)
    response = tok.encode(arith.response_text(ex["answer"])) + [tok.eos_ids[0]]
    # Short sequences for tiny models: prompt <= 24 tokens, answer a handful.
    assert len(prompt) <= 24 and len(response) <= 14
    assert tok.decode(prompt) == ex["problem"]
    assert tok.decode(response) == arith.response_text(ex["answer"])
    assert rewards.last_boxed(tok.decode(response)) == ex["answer"]
  text = "Please reason step by step,\nand put {it} in \\boxed{}!"
  assert tok.decode(tok.encode(text)) == text
  assert tok.encode("é") == [tok.token_to_id(arith.UNK)]


def test_tokenizer_chat_template():
  tok = arith.load_tokenizer()
  text = tok.apply_chat_template([{"role": "user", "content": "1+1="}])
  assert text == "<bos><|user|>1+1=<|end|><|assistant|>"
  ids = tok.encode(text)
  assert ids[:2] == [tok.bos_id, tok.token_to_id("<|user|>")] and len(ids) == 8
  with pytest.raises(ValueError, match="role must be"):
    tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_transformers_reads_the_same_folder():
  transformers = pytest.importorskip("transformers")
  hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(arith.TOKENIZER_DIR))
  tok = arith.load_tokenizer()
  msgs = [{"role": "system", "content": "Add."}, {"role": "user", "content": "12+9="}]
  assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
    tok.apply_chat_template(msgs)
  )
  assert hf.encode("7*8=", add_special_tokens=False) == tok.encode("7*8=")
  assert hf.eos_token_id == tok.eos_ids[0] and hf.pad_token_id == tok.pad_id


def test_prompt_and_response_ids_are_the_rl_format():
  tok = arith.load_tokenizer()
  prompt = arith.prompt_ids(tok, "12+345=")
  assert prompt == [tok.bos_id, *[tok.token_to_id(c) for c in "12+345="]]
  response = arith.response_ids(tok, "357")
  assert response == [*tok.encode("\\boxed{357}"), tok.eos_ids[0]]
  assert rewards.last_boxed(tok.decode(response)) == "357"


# --------------------------------------------------------------------------- question phrasing


def test_question_phrasing_draws_the_same_problems():
  cfg = arith.ArithConfig(levels=(1, 2, 3), ops=("+", "-", "*"))
  for split in arith.SPLITS:
    bare = arith.examples(cfg, split, 300, seed=4)
    asked = arith.examples(cfg, split, 300, seed=4, question=True)
    for b, q in zip(bare, asked, strict=True):
      a, op, c = _parse(b["problem"])
      assert q["problem"] == f"What is {a} {op} {c}?"
      assert (q["answer"], q["source"]) == (b["answer"], b["source"])
      assert q["prompt_id"] == b["prompt_id"].replace("arith/", "arith_text/", 1)
  test = {e["problem"] for e in arith.examples(cfg, "test", 300, seed=0, question=True)}
  train = {e["problem"] for e in arith.examples(cfg, "train", 3000, seed=1, question=True)}
  assert not test & train


def test_question_answers_grade_with_the_boxed_judge():
  ex = arith.examples(arith.ArithConfig(levels=(2,), ops=("+",)), "train", 1, seed=0)[0]
  a, _, b = _parse(ex["problem"])
  good = f"{a} + {b} = {a + b}, so the answer is \\boxed{{{a + b}}}."
  assert rewards.math_reward(good, ex["answer"]) == 1.0
  assert rewards.math_reward(f"\\boxed{{{a + b + 1}}}", ex["answer"]) == 0.0
  assert rewards.math_reward(f"The answer is {a + b}.", ex["answer"]) == 0.0  # no box
