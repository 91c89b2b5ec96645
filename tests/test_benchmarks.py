"""Tests of ada_jax.benchmarks (the evaluation core): Avg@k / pass@k against stub policies
of known accuracy, the problem-weighted average, the resumable results cache and the checks
of `EvalConfig` (also as the `eval` group of an experiment config)."""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest

from ada_jax import config as config_lib
from ada_jax import testing
from ada_jax.data import arith, prompts
from ada_jax.eval import benchmarks
from ada_jax.eval import sampling as eval_sampling
from ada_jax.eval.benchmarks import Benchmark, EvalConfig
from ada_jax.rewards import grader as rewards
from ada_jax.rollout.spec import SamplerSpec


def _exact_scorer(responses, references):
  judge = rewards.JUDGES["exact"]
  return np.array(
    [judge(r, f, None, 1000)[0] for r, f in zip(responses, references, strict=True)], np.float32
  )


def _bench(name, n, offset=0):
  """n hand-made arithmetic problems `i+1=` (unique prompts), raw style, exact judge."""
  examples = [
    {"prompt_id": f"{name}/{i}", "problem": f"{offset + i}+1=", "answer": str(offset + i + 1)}
    for i in range(n)
  ]
  return Benchmark(
    name, prompts.build_prompts(examples, arith.load_tokenizer(), style="raw"), "exact"
  )


class StubPolicy:
  """Answers problem i correctly in a known way; counts its calls and rows.

  `correct[prompt]` is either an int c (deterministic: the first c of a problem's rows are
  right) or a float p (each row right with probability p, drawn from the call's key).
  """

  def __init__(self, benchmarks, correct, fail_on_call=None):
    self.answer, self.correct = {}, {}
    for bench, values in zip(benchmarks, correct, strict=True):
      for tokens, ans, value in zip(
        bench.prompts.tokens, bench.prompts.answers, values, strict=True
      ):
        self.answer[tuple(tokens)], self.correct[tuple(tokens)] = ans, value
    self.calls, self.rows, self.fail_on_call = 0, 0, fail_on_call

  def __call__(self, prompt_tokens, row_prompt, rng):
    self.calls += 1
    if self.calls == self.fail_on_call:
      raise KeyboardInterrupt("simulated interruption")
    self.rows += len(row_prompt)
    gen = np.random.default_rng(np.asarray(jax.random.key_data(rng)))
    texts, lengths, seen = [], [], {}
    for p in row_prompt:
      key = tuple(prompt_tokens[p])
      pos = seen[p] = seen.get(p, -1) + 1
      value = self.correct[key]
      right = pos < value if isinstance(value, int) else gen.random() < value
      texts.append(f"\\boxed{{{self.answer[key] if right else 'wrong'}}}")
      lengths.append(pos + 1)
    return texts, np.asarray(lengths, np.int32)


def _run(policy, benches, config, **kw):
  return benchmarks.evaluate_policy(
    policy, benches, config, jax.random.key(0), {"exact": _exact_scorer}, **kw
  )


# --------------------------------------------------------------------------- metrics


@pytest.mark.parametrize(
  "n,c,k",
  [
    (4, 0, 1),
    (4, 1, 1),
    (4, 2, 2),
    (32, 3, 8),
    (32, 31, 4),
    (16, 16, 16),
    (10, 5, 10),
    (100, 7, 50),
  ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
  assert benchmarks.pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_pass_at_k_rejects_bad_counts():
  with pytest.raises(ValueError, match="n=4, c=5"):
    benchmarks.pass_at_k(4, 5, 1)
  with pytest.raises(ValueError, match="k=5"):
    benchmarks.pass_at_k(4, 1, 5)


def test_deterministic_stub_gives_exact_avg_pass_and_weighted_average():
  a, b = _bench("a", 5), _bench("b", 3, offset=100)
  counts = [[0, 1, 2, 3, 4], [4, 4, 0]]
  config = EvalConfig(k=4, pass_at=(1, 2), problems_per_batch=2, greedy=True)
  # The greedy stub gets problem i right iff c_i >= 1 (its single row is row 0).
  results = _run(
    StubPolicy([a, b], counts), [a, b], config, greedy_policy=StubPolicy([a, b], counts)
  )
  for name, cs in zip("ab", counts, strict=True):
    m = results[name]
    assert m["num_problems"] == len(cs)
    assert m["avg@4"] == pytest.approx(np.mean(cs) / 4, abs=1e-12)
    for j in (1, 2, 4):
      want = np.mean([1 - math.comb(4 - c, j) / math.comb(4, j) for c in cs])
      assert m[f"pass@{j}"] == pytest.approx(want, abs=1e-12)
    assert m["greedy"] == pytest.approx(np.mean([c >= 1 for c in cs]))
    assert m["response_tokens"] == pytest.approx(2.5)  # lengths 1..4 per problem
  avg = results["average"]
  assert results["a"]["avg@4"] == 0.5 and results["b"]["avg@4"] == pytest.approx(2 / 3)
  assert avg["num_problems"] == 8
  assert avg["avg@4"] == pytest.approx((5 * 0.5 + 3 * 2 / 3) / 8)  # not (0.5 + 2/3) / 2
  assert avg["pass@4"] == pytest.approx((5 * 0.8 + 3 * 2 / 3) / 8)
  flat = benchmarks.flat_metrics(results)
  assert (
    flat["eval/average/avg@4"] == avg["avg@4"] and flat["eval/a/pass@2"] == results["a"]["pass@2"]
  )


def test_random_stub_is_within_tolerance_of_its_accuracy():
  """k=32 Bernoulli(p_i) samples for 48 problems: |Avg@k - mean p| and |pass@4 - E pass@4|
  stay within 0.05, about 4 standard errors (SE of Avg@k = sqrt(mean p(1-p) / (kP)) = 0.011)."""
  ps = np.linspace(0.0, 1.0, 48)
  bench = _bench("r", len(ps))
  config = EvalConfig(k=32, pass_at=(4,), problems_per_batch=16)
  m = _run(StubPolicy([bench], [ps.tolist()]), [bench], config)["r"]
  assert abs(m["avg@32"] - ps.mean()) < 0.05
  assert abs(m["pass@4"] - np.mean(1 - (1 - ps) ** 4)) < 0.05
  assert m["pass@32"] >= m["pass@4"] >= m["avg@32"]


def test_interrupted_evaluation_resumes_without_recomputation(tmp_path):
  a, b = _bench("a", 7), _bench("b", 5, offset=50)
  values = [[0.1 * i for i in range(7)], [0.9, 0.5, 0.2, 0.0, 1.0]]
  config = EvalConfig(k=8, problems_per_batch=3)  # a: 3 batches (3, 3, 1), b: 2 (3, 2)
  whole = _run(StubPolicy([a, b], values), [a, b], config)

  path = tmp_path / "cache.jsonl"
  kw = dict(model_tag="stub", cache=benchmarks.ResultCache(path))
  first = StubPolicy([a, b], values, fail_on_call=4)  # dies in b's first batch
  with pytest.raises(KeyboardInterrupt):
    _run(first, [a, b], config, **kw)
  assert len(path.read_text().splitlines()) == 7  # benchmark a, all three batches
  with open(path, "a") as f:
    f.write('{"key": "torn')  # a write cut off by a kill
  second = StubPolicy([a, b], values)
  resumed = _run(second, [a, b], config, model_tag="stub", cache=benchmarks.ResultCache(path))
  assert (second.calls, second.rows) == (2, 5 * 8)  # only b was generated
  assert resumed == whole  # batch keys do not depend on what was cached
  third = StubPolicy([a, b], values)
  assert _run(third, [a, b], config, model_tag="stub", cache=benchmarks.ResultCache(path)) == whole
  assert third.calls == 0
  # Another model or other settings never reuse these results.
  fourth = StubPolicy([a, b], values)
  _run(fourth, [a, b], config, model_tag="other", cache=benchmarks.ResultCache(path))
  assert fourth.rows == 12 * 8
  with pytest.raises(ValueError, match="model_tag"):
    _run(fourth, [a, b], config, cache=benchmarks.ResultCache(path))
  # A stray non-UTF-8 byte costs its line only, in the middle of the file or at its end.
  lines = path.read_bytes().splitlines(keepends=True)
  path.write_bytes(b"".join([lines[0][:5] + b"\xff" + lines[0][5:], *lines[1:], b"\xfe\n"]))
  fifth = StubPolicy([a, b], values)
  assert _run(fifth, [a, b], config, model_tag="stub", cache=benchmarks.ResultCache(path)) == whole
  assert fifth.calls == 1 and fifth.rows == 8  # only the damaged line's problem again


class BoxingPolicy:
  """Row j of every problem answers `\\boxed{<answer>}` when j < boxed, else the bare answer
  (j = boxed) or an unclosed box (j > boxed): right or wrong, only boxes count as boxed."""

  def __init__(self, bench, boxed):
    self.answer = dict(zip(map(tuple, bench.prompts.tokens), bench.prompts.answers, strict=True))
    self.boxed, self.calls = boxed, 0

  def __call__(self, prompt_tokens, row_prompt, rng):
    self.calls += 1
    texts, seen = [], {}
    for p in row_prompt:
      j = seen[p] = seen.get(p, -1) + 1
      ans = self.answer[tuple(prompt_tokens[p])]
      texts.append(
        f"so \\boxed{{{ans}}}" if j < self.boxed else ans if j == self.boxed else "\\boxed{" + ans
      )
    return texts, np.ones(len(texts), np.int32)


def test_boxed_rate_counts_complete_boxes_and_old_cache_lines_are_redone(tmp_path):
  bench = _bench("a", 3)
  config = EvalConfig(k=4, problems_per_batch=2)
  m = _run(BoxingPolicy(bench, 1), [bench], config)["a"]
  assert m["boxed_rate"] == pytest.approx(1 / 4)  # one of 4 rows boxed, the rest not
  assert m["avg@4"] == pytest.approx(1 / 4)  # the exact judge reads the box only
  assert _run(BoxingPolicy(bench, 3), [bench], config)["a"]["boxed_rate"] == pytest.approx(3 / 4)
  assert benchmarks.flat_metrics({"a": m})["eval/a/boxed_rate"] == m["boxed_rate"]
  # A cache line written before `boxed` was recorded is generated again, not read back.
  path = tmp_path / "cache.jsonl"
  kw = dict(model_tag="stub", cache=benchmarks.ResultCache(path))
  _run(BoxingPolicy(bench, 2), [bench], config, **kw)
  lines = [json.loads(x) for x in path.read_text().splitlines()]
  assert [r["boxed"] for r in lines] == [[1, 1, 0, 0]] * 3
  lines[0].pop("boxed")
  path.write_text("".join(json.dumps(r) + "\n" for r in lines))
  again = BoxingPolicy(bench, 2)
  m = _run(again, [bench], config, model_tag="stub", cache=benchmarks.ResultCache(path))["a"]
  assert again.calls == 1 and m["boxed_rate"] == pytest.approx(1 / 2)


def test_missing_scorer_is_named():
  bench = _bench("a", 2)
  with pytest.raises(ValueError, match=r"no scorer for judge\(s\) \['exact'\]"):
    benchmarks.evaluate_policy(
      StubPolicy([bench], [[1, 1]]),
      [bench],
      EvalConfig(k=2),
      jax.random.key(0),
      {"math": _exact_scorer},
    )


def test_evaluate_hook_on_a_tiny_model_reuses_its_sampler():
  """The trainer's hook on the held-out arithmetic split of a random tiny model: a second
  call with the same settings reuses the compiled sampler and repeats the numbers."""
  tok = arith.load_tokenizer()
  mc, params = testing.tiny_arith_model(seed=0)
  config = EvalConfig(
    benchmarks=("arith",),
    k=2,
    sampler=SamplerSpec(max_new_tokens=8, chunk_rows=16, prompt_buckets=(16,)),
    arith_problems=8,
    problems_per_batch=8,
    max_prompt_tokens=16,
  )
  benches = [benchmarks.load_benchmark("arith", config, tok)]
  assert [(b.name, b.judge, len(b.prompts)) for b in benches] == [("arith", "exact", 8)]
  samplers = eval_sampling.EvalSamplers.make(mc, tok, config)
  assert samplers.greedy is None  # config.greedy is off: no second sampler
  args = (params, samplers, tok, benches, config, jax.random.key(1), {"exact": _exact_scorer})
  first = eval_sampling.evaluate(*args)
  compiled = samplers.sampled.compiles  # the pool's programs for the one prompt bucket
  assert compiled >= 1
  assert eval_sampling.evaluate(*args) == first
  assert samplers.sampled.compiles == compiled  # the second call reused the compiled sampler
  with pytest.raises(ValueError, match="samplers.greedy is None"):
    eval_sampling.evaluate(
      params, samplers, tok, benches, dataclasses.replace(config, greedy=True), *args[5:]
    )
  assert set(first) == {"arith", "average"} and first["arith"]["num_problems"] == 8
  assert 1 <= first["arith"]["response_tokens"] <= 8


# --------------------------------------------------------------------------- config

BAD_GROUPS = [
  ({"k": 4, "pass_at": (8,)}, r"eval\.pass_at=\(8,\)"),
  ({"benchmarks": "math500,mmlu"}, r"eval\.benchmarks=.*'mmlu'"),
  ({"sampler": {"top_p": 0.0}}, r"eval\.sampler: .*top_p"),
  ({"max_prompt_tokens": 2048}, r"eval\.sampler\.prompt_buckets=.*max_prompt_tokens=2048"),
  ({"verifier": {"judge": "fuzzy"}}, r"eval\.verifier: judge='fuzzy'"),
  ({"sampler": {"chunk_rows": 0}}, r"eval\.sampler: SamplerSpec\.chunk_rows"),
]


@pytest.mark.parametrize("group,match", BAD_GROUPS)
def test_bad_eval_config_names_the_field(group, match):
  with pytest.raises(ValueError, match=match):
    config_lib.build(EvalConfig, group, "eval")


@pytest.mark.parametrize("group,match", [({"kk": 3}, r"config\.eval\.kk"), *BAD_GROUPS])
def test_bad_eval_group_of_an_experiment_config_is_named(group, match):
  with pytest.raises(ValueError, match=match):
    config_lib.parse({"eval": group})


def test_eval_config_normalizes_benchmarks_and_sequences():
  config = EvalConfig(benchmarks="math500, aime24", pass_at=[1, 8], k=16)
  assert config.benchmarks == ("math500", "aime24") and config.pass_at == (1, 8)
  assert config.pass_ks == (1, 8, 16) and config.limit == 0
  parsed = config_lib.parse({"eval": {"benchmarks": ["arith"], "k": 2, "pass_at": [1]}}).eval
  assert parsed == EvalConfig(benchmarks=("arith",), k=2, pass_at=(1,))
