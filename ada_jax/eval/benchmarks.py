"""Avg@k evaluation on the maths benchmarks (and the arithmetic task): the core that the
training loop calls and that `ada_jax.evaluate` (reports, CLI) wraps.

Reinforce-Ada (arXiv 2510.04996; docs/design.md "Reference figures") reports Avg@32: k = 32
responses per
problem at temperature 1.0, top-p 1.0, up to 4096 new tokens, in the training prompt format;
the score of a benchmark is the mean reward over all k·P samples, and the headline number is
the average over MATH500, Minerva Math, OlympiadBench and the AIME-like sets weighted by
their problem counts. Also reported: pass@j with the unbiased estimator of Chen et al. (2021,
"Evaluating Large Language Models Trained on Code", eq. 1), 1 - C(n-c, j) / C(n, j), and
(optionally) greedy accuracy.

Generation uses the training sampler (`rollout.sampler.Sampler`, built in `eval.sampling`):
the k rows of a problem are adjacent, so they share one prefill; rewards come from the same
verifier pool (docs/design.md "Algorithm").
Problems are processed in fixed batches; each finished batch is appended to a per-problem
results cache (JSONL, keyed by benchmark, prompt id, model and settings), so an interrupted
evaluation continues where it stopped. Batch b of a benchmark always samples with the key
`fold_in(fold_in(rng, benchmark), b)`, so a resumed evaluation gives the same numbers as an
uninterrupted one.

Entry points: `load_benchmark` (a tokenized set), `evaluate_policy` (any policy, e.g. a
stub), `flat_metrics` (for the metrics writer); `eval.sampling.evaluate` runs a model (the
trainer's periodic hook) through `evaluate_policy`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import tqdm
from absl import logging

from ada_jax import bounds
from ada_jax.data import arith, prompts
from ada_jax.data import sets as data
from ada_jax.eval.cache import ResultCache
from ada_jax.models.tokenizer import Tokenizer
from ada_jax.rewards.grader import last_boxed
from ada_jax.rewards.verifier import VerifierConfig
from ada_jax.rollout.spec import SamplerSpec

PAPER_BENCHMARKS = ("math500", "minerva_math", "olympiadbench", "aime24", "amc23")
# Benchmark name -> (default judge, default prompt style). The maths sets use the training
# prompt format of the maths runs; the arithmetic task its own bare `<bos>12+3=` prompt, and
# 'arith_text' the same held-out problems as questions for a real chat model.
BENCHMARKS: dict[str, tuple[str, str]] = {
  **{name: ("math", "chat") for name in (*PAPER_BENCHMARKS, "gsm8k")},
  "arith": ("exact", "raw"),
  "arith_text": ("math", "chat"),
}

# (prompt token arrays, row_prompt int[R], PRNG key) -> (R response texts, int32[R] lengths).
Policy = Callable[[Sequence[np.ndarray], np.ndarray, jax.Array], tuple[list[str], np.ndarray]]
# (R responses, R references) -> float32[R] rewards in {0, 1}: `Verifier.score`.
Scorer = Callable[[Sequence[str], Sequence[str]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """What is evaluated and how (the `eval` group of an experiment config).

  Attributes:
    benchmarks: names in `BENCHMARKS` (a comma-separated string is split).
    k: responses per problem (Avg@k, paper: 32).
    sampler: how the k responses are drawn, in the rollout's terms (`SamplerSpec`): the
      sampling rule (paper: temperature 1.0, top_p 1.0), `max_new_tokens` (paper: 4096),
      `chunk_rows` (rows per sampler launch), `prompts_per_chunk` (0 = chunk_rows // k, at
      least 1, so that the k rows of a problem share one prefill) and `prompt_buckets`
      (padded prompt lengths, one compile each; the largest must hold `max_prompt_tokens`).
    pass_at: j values of extra pass@j metrics (1 <= j <= k); pass@k is always reported.
    greedy: also report greedy accuracy (one more generation pass, one row per problem).
    prompt_style: key of `prompts.PROMPT_STYLES`; '' = the benchmark's default ('chat' for
      the maths sets and arith_text, 'raw' for arith).
    frame: instruction and worked examples around each problem (`prompts.PromptFrame`),
      for every benchmark not in style 'raw'; set it as the training data's
      (`data.frame`) to evaluate the prompts the run trains on.
    verifier: the reward pools (`rewards.verifier.VerifierConfig`); its `judge` '' = each
      benchmark's default ('math' for the maths sets, 'exact' for arith).
    max_prompt_tokens: longer prompts are dropped and counted (docs/design.md "Algorithm": 1024).
    limit: evaluate only the first `limit` problems of each benchmark; 0 = all.
    seed: seed of the held-out arithmetic split, and of the sampling key of an
      `eval.evaluator.run` given none (the prompt selection's K-sampling); a training run and
      `python -m ada_jax.evaluate` sample with the run's eval key (`runstate.RunKeys.eval`).
    problems_per_batch: problems per sampler call; also the granularity of the results
      cache and of the progress bar.
    data_dir: TFDS data directory; '' = $TFDS_DATA_DIR or ~/tensorflow_datasets.
    manual_dir: folder with the maths JSONL files (layout of ../shared/data); '' =
      download from their public sources.
    arith_levels: digit counts of the held-out arithmetic split (arith, arith_text); () =
      `ArithConfig`'s.
    arith_ops: its operators; () = `ArithConfig`'s.
    arith_problems: problems of the held-out arithmetic split.
    every_steps: the training loop evaluates every this many RL steps (0 = never); not used
      here.
  """

  benchmarks: tuple[str, ...] = PAPER_BENCHMARKS
  k: int = bounds.within("[1, 2**16]", 32)
  sampler: SamplerSpec = SamplerSpec(max_new_tokens=4096)
  pass_at: tuple[int, ...] = bounds.within("[1, 2**16]", ())
  greedy: bool = False
  prompt_style: str = ""
  frame: prompts.PromptFrame = prompts.PromptFrame()
  verifier: VerifierConfig = VerifierConfig(judge="")
  max_prompt_tokens: int = bounds.within("[1, TOKENS]", 1024)
  limit: int = bounds.within("[0, 10**9]", 0)
  seed: int = bounds.within("[0, 2**63)", 0)
  problems_per_batch: int = bounds.within("[1, ROWS]", 64)
  data_dir: str = ""
  manual_dir: str = ""
  arith_levels: tuple[int, ...] = bounds.within("[1, 9]", ())
  arith_ops: tuple[str, ...] = ()
  arith_problems: int = bounds.within("[1, 10**8]", 200)
  every_steps: int = bounds.within("[0, STEPS]", 0)

  def __post_init__(self):
    if isinstance(self.benchmarks, str):  # 'math500,aime24', e.g. from a command line.
      names = [b.strip() for b in self.benchmarks.split(",")]
      object.__setattr__(self, "benchmarks", [b for b in names if b])
    for name in ("benchmarks", "pass_at", "arith_levels", "arith_ops"):  # Hashable.
      object.__setattr__(self, name, tuple(getattr(self, name)))

    def need(ok: bool, field: str, what: str):
      if not ok:
        raise ValueError(f"eval.{field}={getattr(self, field)!r}: {what}")

    unknown = [b for b in self.benchmarks if b not in BENCHMARKS]
    need(not unknown, "benchmarks", f"unknown {unknown}; known: {sorted(BENCHMARKS)}")
    need(self.k >= 1, "k", "must be >= 1")
    need(all(1 <= j <= self.k for j in self.pass_at), "pass_at", f"each j in [1, k={self.k}]")
    need(
      self.prompt_style in ("", *prompts.PROMPT_STYLES),
      "prompt_style",
      f"known: {sorted(prompts.PROMPT_STYLES)}",
    )
    for field in ("problems_per_batch", "max_prompt_tokens"):
      need(getattr(self, field) >= 1, field, "must be >= 1")
    for field in ("limit", "every_steps"):
      need(getattr(self, field) >= 0, field, "must be >= 0")
    buckets = self.sampler.prompt_buckets
    if not buckets or max(buckets) < self.max_prompt_tokens:
      raise ValueError(
        f"eval.sampler.prompt_buckets={buckets!r}: the largest must be >= "
        f"max_prompt_tokens={self.max_prompt_tokens}"
      )

  @property
  def pass_ks(self) -> tuple[int, ...]:
    return tuple(sorted({*self.pass_at, self.k}))


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """One evaluation set, tokenized. judge: key of `rewards.judges.JUDGES` used to score it."""

  name: str
  prompts: prompts.PromptSet
  judge: str


# --------------------------------------------------------------------------- metrics


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one problem from n samples with c correct: 1 - C(n-c, k) / C(n, k).

  Chen et al. (2021), eq. 1, computed as a product so that large n does not overflow.

  Raises:
    ValueError: not 0 <= c <= n, or not 1 <= k <= n.
  """
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def benchmark_metrics(
  samples: Sequence[Mapping], greedy: Sequence[Mapping] | None, config: EvalConfig
) -> dict[str, float]:
  """Metrics of one benchmark from its per-problem records.

  Args:
    samples: one record per problem with `rewards` (k floats in {0, 1}), `lengths` and
      `boxed` (k flags: the response has a complete `\\boxed{...}`).
    greedy: one record per problem with a single reward, or None.
    config: gives k and the pass@j values.

  Returns:
    `avg@k` (mean reward over all samples: the mean over problems of the per-problem mean),
    `pass@j` for j in `config.pass_ks`, `greedy` (if given), `boxed_rate` (the fraction of
    samples with a complete, non-empty `\\boxed{...}`, `grader.last_boxed`: whether the
    model answers in the asked format at all, right or wrong), `response_tokens` (mean
    generated tokens per sample) and `num_problems`.
  """
  rewards_ = np.asarray([r["rewards"] for r in samples], np.float64).reshape(len(samples), -1)
  correct = (rewards_ > 0.5).sum(1)
  out = {f"avg@{config.k}": float(rewards_.mean()) if samples else 0.0}
  for j in config.pass_ks:
    out[f"pass@{j}"] = float(np.mean([pass_at_k(config.k, int(c), j) for c in correct] or [0]))
  if greedy is not None:
    out["greedy"] = float(np.mean([r["rewards"][0] for r in greedy] or [0]))
  out["boxed_rate"] = float(np.mean([b for r in samples for b in r["boxed"]])) if samples else 0.0
  out["response_tokens"] = float(np.mean([r["lengths"] for r in samples])) if samples else 0.0
  out["num_problems"] = len(samples)
  return out


def problem_results(samples: Sequence[Mapping]) -> list[dict[str, Any]]:
  """Per-problem results for a report, from which any interval can be computed:
  `{'prompt_id', 'correct' (rewards > 0.5 among k), 'boxed' (complete boxes among k), 'k'}`
  per problem, in benchmark order."""
  return [
    {
      "prompt_id": r["prompt_id"],
      "correct": int(sum(x > 0.5 for x in r["rewards"])),
      "boxed": int(sum(r["boxed"])),
      "k": len(r["rewards"]),
    }
    for r in samples
  ]


def weighted_average(per_benchmark: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
  """Every metric averaged over benchmarks weighted by `num_problems` (the paper's average);
  `num_problems` is summed."""
  total = sum(m["num_problems"] for m in per_benchmark.values())
  keys = [k for k in next(iter(per_benchmark.values()), {}) if k != "num_problems"]
  out = {
    k: sum(m[k] * m["num_problems"] for m in per_benchmark.values()) / max(total, 1) for k in keys
  }
  out["num_problems"] = total
  return out


def flat_metrics(
  results: Mapping[str, Mapping[str, float]], prefix: str = "eval/"
) -> dict[str, float]:
  """`{'eval/math500/avg@32': ..., 'eval/average/avg@32': ...}` for TensorBoard / JSONL."""
  return {f"{prefix}{b}/{k}": float(v) for b, m in results.items() for k, v in m.items()}


# --------------------------------------------------------------------------- results cache


def _settings_key(config: EvalConfig, mode: str, judge: str, model_tag: str, rng) -> str:
  # The prompt itself is checked per record (`_digest`), so style and template are not here.
  s = config.sampler
  rule = (config.k, s.temperature, s.top_p, s.top_k) if mode == "sample" else ()
  key_data = np.asarray(jax.random.key_data(rng)).tolist() if mode == "sample" else None
  settings = [model_tag, mode, judge, key_data, s.max_new_tokens, *rule]
  return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]


def _digest(tokens: np.ndarray) -> str:
  return hashlib.sha256(np.asarray(tokens, np.int32).tobytes()).hexdigest()[:12]


# --------------------------------------------------------------------------- running


def _stable_id(name: str) -> int:
  return zlib.crc32(name.encode()) & 0x7FFFFFFF


def run_benchmark(
  bench: Benchmark,
  policy: Policy,
  score: Scorer,
  config: EvalConfig,
  rng: jax.Array,
  *,
  mode: str = "sample",
  cache: ResultCache | None = None,
  model_tag: str = "",
  progress: bool = False,
) -> list[dict]:
  """Per-problem records of one benchmark: cached ones, and the rest generated and scored.

  Problems go in fixed batches of `config.problems_per_batch`; batch b samples with
  `fold_in(fold_in(rng, crc32(name)), b)` and is written to `cache` when scored.

  Args:
    bench: the benchmark.
    policy: generates responses (`sampler_policy`, or a stub).
    score: reward function for `bench.judge` (e.g. `Verifier.score`).
    config: k, batch size, settings.
    rng: PRNG key of this evaluation.
    mode: 'sample' (k rows per problem) or 'greedy' (one row).
    cache: results cache, or None.
    model_tag: identifies the model in cache keys (required with a cache).
    progress: show a tqdm bar.

  Returns:
    One record per problem, in benchmark order: `rewards` (float list of k, or 1 when
    greedy), `lengths` (generated tokens), `boxed` (1 where the response has a complete
    `\\boxed{...}`, else 0), `prompt_id`, `benchmark`, `mode`, `key`.

  Raises:
    ValueError: a cache without a `model_tag`, an unknown mode, duplicate prompt ids, or a
      policy returning the wrong number of rows.
  """
  if cache is not None and not model_tag:
    raise ValueError("run_benchmark: a results cache needs a model_tag naming the model")
  if mode not in ("sample", "greedy"):
    raise ValueError(f"run_benchmark: mode={mode!r}; known: 'sample', 'greedy'")
  if len(set(bench.prompts.prompt_ids)) != len(bench.prompts):
    raise ValueError(f"benchmark {bench.name!r} has duplicate prompt ids")
  key = _settings_key(config, mode, bench.judge, model_tag, rng)
  rows, p, n = (config.k if mode == "sample" else 1), bench.prompts, len(bench.prompts)
  digests = [_digest(t) for t in p.tokens]
  done = {}
  for i, pid in enumerate(p.prompt_ids if cache is not None else ()):
    r = cache.get(key, bench.name, mode, pid)
    # Same id, same prompt tokens; a line written before `boxed` was recorded is redone.
    if r is not None and r.get("prompt") == digests[i] and "boxed" in r:
      done[pid] = r
  bench_rng = jax.random.fold_in(rng, _stable_id(f"{bench.name}/{mode}"))
  desc = f"{bench.name} {mode}"
  bar = tqdm.tqdm(total=n, initial=len(done), desc=desc, disable=not progress, unit="problem")
  for b, start in enumerate(range(0, n, config.problems_per_batch)):
    batch = range(start, min(start + config.problems_per_batch, n))
    todo = [i for i in batch if p.prompt_ids[i] not in done]
    if not todo:
      continue
    row_prompt = np.repeat(np.arange(len(todo)), rows)
    rng_b = jax.random.fold_in(bench_rng, b)
    texts, lengths = policy([p.tokens[i] for i in todo], row_prompt, rng_b)
    if len(texts) != len(row_prompt):
      raise ValueError(f"policy returned {len(texts)} responses for {len(row_prompt)} rows")
    scores = np.asarray(score(texts, [p.answers[todo[j]] for j in row_prompt]), np.float32)
    lengths = np.asarray(lengths).astype(int)
    boxed = [int(last_boxed(t) is not None) for t in texts]
    records = []
    for j, i in enumerate(todo):
      part = slice(j * rows, (j + 1) * rows)
      records.append(
        dict(
          key=key,
          benchmark=bench.name,
          mode=mode,
          prompt_id=p.prompt_ids[i],
          prompt=digests[i],
          rewards=scores[part].tolist(),
          lengths=lengths[part].tolist(),
          boxed=boxed[part],
        )
      )
    if cache is not None:
      cache.add(records)
    done.update((r["prompt_id"], r) for r in records)
    bar.update(len(todo))
  bar.close()
  return [done[pid] for pid in p.prompt_ids]


def evaluate_policy(
  policy: Policy,
  benchmarks: Sequence[Benchmark],
  config: EvalConfig,
  rng: jax.Array,
  scorers: Mapping[str, Scorer],
  *,
  greedy_policy: Policy | None = None,
  cache: ResultCache | None = None,
  model_tag: str = "",
  progress: bool = False,
  records: dict[str, list[dict]] | None = None,
) -> dict[str, dict[str, float]]:
  """Metrics of `policy` on each benchmark plus their problem-weighted average.

  Args:
    policy: samples the k responses per problem.
    benchmarks: the sets.
    config: settings (k, pass@j values, batch size).
    rng: PRNG key.
    scorers: judge name -> reward function, for every judge the benchmarks use.
    greedy_policy: when given, greedy accuracy is measured with it too.
    cache, model_tag, progress: see `run_benchmark`.
    records: when given, receives each benchmark's sampled per-problem records
      (`run_benchmark`'s), for reports that keep them (`problem_results`).

  Returns:
    `{benchmark: metrics, ..., 'average': weighted metrics}` (see `benchmark_metrics`).

  Raises:
    ValueError: a benchmark's judge has no scorer.
  """
  missing = sorted({b.judge for b in benchmarks} - set(scorers))
  if missing:
    raise ValueError(f"no scorer for judge(s) {missing}; given {sorted(scorers)}")
  results = {}
  for bench in benchmarks:
    kw = dict(cache=cache, model_tag=model_tag, progress=progress)
    samples = run_benchmark(bench, policy, scorers[bench.judge], config, rng, **kw)
    if records is not None:
      records[bench.name] = samples
    greedy = None
    if greedy_policy is not None:
      greedy = run_benchmark(
        bench, greedy_policy, scorers[bench.judge], config, rng, mode="greedy", **kw
      )
    results[bench.name] = benchmark_metrics(samples, greedy, config)
  if results:
    results["average"] = weighted_average(results)
  return results


# --------------------------------------------------------------------------- data


def load_examples(name: str, config: EvalConfig) -> list[dict[str, str]]:
  """The examples of one benchmark (the first `config.limit` if set).

  Maths sets are read through their TFDS builders (`data.sets.load_examples`, test split); 'arith'
  is the held-out split of `arith.ArithConfig(levels=config.arith_levels)`, drawn with
  `config.seed`.

  Raises:
    ValueError: unknown benchmark name.
  """
  if name not in BENCHMARKS:
    raise ValueError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARKS)}")
  if name in ("arith", "arith_text"):
    fields = {"levels": config.arith_levels, "ops": config.arith_ops}
    task = arith.ArithConfig(**{k: v for k, v in fields.items() if v})
    n = min(config.limit or config.arith_problems, config.arith_problems)
    return arith.examples(task, "test", n, seed=config.seed, question=name == "arith_text")
  data_dir = data.tfds_data_dir(config.data_dir)
  examples = data.load_examples(
    name, "test", data_dir=data_dir, manual_dir=config.manual_dir or None
  )
  return examples[: config.limit] if config.limit else examples


def load_benchmark(name: str, config: EvalConfig, tokenizer: Tokenizer) -> Benchmark:
  """One benchmark of `config`, loaded and tokenized in its prompt style (too-long prompts
  are dropped and logged).

  Raises:
    ValueError: unknown name, or a malformed data file (`file:line`).
    OSError: its data can be neither read from `config.manual_dir` nor downloaded.
  """
  examples = load_examples(name, config)  # an unknown name raises here
  judge, style = BENCHMARKS[name]
  style = config.prompt_style or style
  ps = prompts.build_prompts(
    examples,
    tokenizer,
    style=style,
    max_prompt_tokens=config.max_prompt_tokens,
    frame=config.frame if style != "raw" else prompts.PromptFrame(),
  )
  if ps.num_dropped:
    logging.warning(
      "%s: %d problems over %d prompt tokens are not evaluated",
      name,
      ps.num_dropped,
      config.max_prompt_tokens,
    )
  return Benchmark(name, ps, config.verifier.judge or judge)
