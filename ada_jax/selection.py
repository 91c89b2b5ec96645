"""Training-prompt selection by the base model's pass rate (the "hard" / "easy" prompt sets).

Reinforce-Ada (arXiv 2510.04996) trains on prompt sets built by sampling the base model:
K responses per prompt (default 16, temperature 1.0); a prompt is kept when its pass rate
is at most a threshold AND at least one response is correct, so that no kept prompt is
hopeless and none is already solved (docs/design.md "Data": prompts at pass rate 0 teach nothing).
The two sets built in are `hard` (pass rate <= 0.125, i.e. 1-2 correct of 16) and
`easy` (pass rate <= 0.3125, 1-5 correct of 16); any `FilterRule` can be added.

The K-samples pass is `benchmarks.run_benchmark` (the evaluation's chunked sampler, verifier
pool and per-problem results cache), so an interrupted selection resumes where it stopped
and a seed fixes the result. Outputs, in `<workdir>/select/`:

  pass_rates.jsonl   one row per prompt: prompt_id, problem, answer, source, num_samples,
                     pass_count, pass_rate, mean_response_tokens
  <rule>.jsonl       the rows a rule keeps; they load as training prompts through the
                     user-JSONL path (`data.source='jsonl'`, `data.jsonl_paths`, fields
                     `problem` / `answer`)
  pass_rates.png     histogram of pass rates with the rules' thresholds
  pass_rates.md      the same as tables; summary.json: counts, settings, file paths
  cache.jsonl        per-prompt rewards (the resumable cache)
  base_params_<tag>/ the base policy when it was built here (random init + the config's
                     warm start): pass it as `ckpt.init_from` to train from the same model

  python -m ada_jax.select_prompts --config=configs/<experiment>.py --workdir=DIR [--hf_dir=PATH |
      --checkpoint=STEP] [--k=16] [--rules=hard:0.125:1,easy:0.3125:1] [--limit=N]

The prompts are the config's training prompts (`data` group, `inputs.load_prompts`: same
source, prompt style and length limit as training). The model is --hf_dir, or --checkpoint
of `<workdir>/checkpoints` (or --checkpoint_dir), or else the policy a fresh training run
of the config would start from: `ckpt.init_from`, else `model.hf_dir`, else random init
followed by the config's warm start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from ada_jax import config as config_lib
from ada_jax import inputs
from ada_jax.data import prompts as prompts_lib
from ada_jax.eval import benchmarks
from ada_jax.eval import sampling as eval_sampling
from ada_jax.models.decoder import ModelConfig, Params
from ada_jax.models.tokenizer import Tokenizer
from ada_jax.rewards.verifier import Verifier, VerifierConfig
from ada_jax.rollout.spec import SamplerSpec

_NAME = "train_prompts"  # benchmark name of the prompt set in the results cache
_RESERVED = ("pass_rates", "cache", "summary")  # output file stems a rule may not take


# --------------------------------------------------------------------------- rules


@dataclasses.dataclass(frozen=True)
class FilterRule:
  """Keep a prompt iff pass_count >= min_correct and pass_count / K <= max_pass_rate.

  Attributes:
    name: output file stem (`<name>.jsonl`); letters, digits, '_', '-', '.'.
    max_pass_rate: highest pass rate kept, in [0, 1].
    min_correct: fewest correct responses kept (1 drops the prompts the model never solves).
  """

  name: str
  max_pass_rate: float
  min_correct: int = 1

  def __post_init__(self):
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name) or self.name in _RESERVED:
      raise ValueError(
        f"rule name {self.name!r}: use letters, digits, '_', '-', '.', not one of {_RESERVED}"
      )
    if not 0.0 <= self.max_pass_rate <= 1.0:
      raise ValueError(f"rule {self.name!r}: max_pass_rate={self.max_pass_rate} not in [0, 1]")
    if self.min_correct < 0:
      raise ValueError(f"rule {self.name!r}: min_correct={self.min_correct} must be >= 0")

  def keeps(self, pass_count: int, k: int) -> bool:
    # The tolerance keeps thresholds such as 0.3125 = 5/16 inclusive despite rounding.
    return self.min_correct <= pass_count <= self.max_pass_rate * k + 1e-9


PAPER_RULES = (FilterRule("hard", 0.125, 1), FilterRule("easy", 0.3125, 1))


def parse_rules(text: str | Sequence[str]) -> tuple[FilterRule, ...]:
  """Rules from 'name:max_pass_rate[:min_correct]' items, comma-separated or a list.

  Raises:
    ValueError: a malformed item, bad values, or a duplicate name (the item is quoted).
  """
  items = text.split(",") if isinstance(text, str) else list(text)
  rules = []
  for item in (i.strip() for i in items):
    if not item:
      continue
    parts = item.split(":")
    try:
      if len(parts) not in (2, 3):
        raise ValueError("expected name:max_pass_rate[:min_correct]")
      rules.append(FilterRule(parts[0], float(parts[1]), int(parts[2]) if parts[2:] else 1))
    except ValueError as e:
      raise ValueError(f"rule {item!r}: {e}") from None
  names = [r.name for r in rules]
  if len(set(names)) != len(names):
    raise ValueError(f"rules: duplicate names in {names}")
  return tuple(rules)


# --------------------------------------------------------------------------- settings


# K-sampling defaults (paper: K = 16 at temperature 1.0, the rollout's budget); the rest is
# `EvalConfig`'s.
K_SAMPLING = benchmarks.EvalConfig(
  benchmarks=(), k=16, sampler=SamplerSpec(), verifier=VerifierConfig(judge="math")
)


@dataclasses.dataclass(frozen=True)
class SelectConfig:
  """How the pass rates are measured and which sets are written.

  Attributes:
    sampling: the K-samples pass, in the evaluation's terms (`benchmarks.EvalConfig`): `k`
      responses per prompt (K), its `sampler` group (rule, budget, chunking, buckets),
      `problems_per_batch` (the unit of the cache and progress bar), its `verifier`
      (a response is correct iff reward > 0.5), `seed`; `benchmarks` is unused (the
      prompts are the training set's).
    rules: the filtered sets to write.

  Raises:
    ValueError: duplicate rule names, or a rule needing more correct responses than k.
  """

  sampling: benchmarks.EvalConfig = K_SAMPLING
  rules: tuple[FilterRule, ...] = PAPER_RULES

  def __post_init__(self):
    if isinstance(self.rules, str):
      object.__setattr__(self, "rules", parse_rules(self.rules))
    object.__setattr__(self, "rules", tuple(self.rules))
    names = [r.name for r in self.rules]
    if len(set(names)) != len(names):
      raise ValueError(f"SelectConfig.rules: duplicate names in {names}")
    for r in self.rules:
      if r.min_correct > self.k:
        raise ValueError(f"rule {r.name!r}: min_correct={r.min_correct} > k={self.k}")

  @property
  def k(self) -> int:
    return self.sampling.k

  @classmethod
  def of(
    cls, rules: Any = PAPER_RULES, base: benchmarks.EvalConfig = K_SAMPLING, **sampling: Any
  ) -> SelectConfig:
    """`base` (default `K_SAMPLING`) with `sampling`'s `EvalConfig` fields replaced, where
    `sampler` and `verifier` may be dicts of their own fields (`EvalConfig`,
    `SamplerSpec` and `VerifierConfig` check and name them); `max_prompt_tokens` follows
    the largest prompt bucket unless given."""
    for group in ("sampler", "verifier"):
      if isinstance(sampling.get(group), Mapping):
        sampling[group] = dataclasses.replace(getattr(base, group), **sampling[group])
    if "sampler" in sampling:
      buckets = sampling["sampler"].prompt_buckets
      sampling.setdefault("max_prompt_tokens", max(buckets, default=1))
    return cls(dataclasses.replace(base, **sampling), rules)

  @classmethod
  def from_run_config(
    cls, cfg: config_lib.RunConfig, rules: Any = PAPER_RULES, **overrides: Any
  ) -> SelectConfig:
    """The experiment's own groups (its `sampler`, the `rl.verifier`, its seed) with
    K-sampling's K; `overrides` (`of`'s arguments; None values ignored) replace them."""
    base = dataclasses.replace(
      K_SAMPLING,
      sampler=cfg.sampler,
      verifier=cfg.rl.verifier,
      seed=cfg.seed,
      max_prompt_tokens=max(cfg.sampler.prompt_buckets),
    )
    return cls.of(rules, base, **{k: v for k, v in overrides.items() if v is not None})


# --------------------------------------------------------------------------- pass rates


def pass_rates(
  policy: benchmarks.Policy,
  score: benchmarks.Scorer,
  prompt_set: prompts_lib.PromptSet,
  config: SelectConfig,
  rng: jax.Array,
  *,
  cache: benchmarks.ResultCache | None = None,
  model_tag: str = "",
  progress: bool = False,
) -> list[dict[str, Any]]:
  """K responses per prompt, scored: one row per prompt, in `prompt_set` order.

  Args:
    policy: generates the responses (`eval_sampling.sampler_policy`, or a stub).
    score: reward function (`Verifier.score`).
    prompt_set: the prompts (unique `prompt_ids`).
    config: K, batch size, sampling rule, judge.
    rng: PRNG key; with fixed settings the rows are a function of it (batch b of the set
      samples with a key derived from `rng` and b, as in `run_benchmark`).
    cache: per-prompt results cache (resume), or None.
    model_tag: identifies the model in the cache (required with a cache).
    progress: tqdm bar.

  Returns:
    Dicts with `prompt_id`, `problem`, `answer`, `source` (str), `num_samples` (K),
    `pass_count` (responses with reward > 0.5), `pass_rate` (pass_count / K) and
    `mean_response_tokens` (float).

  Raises:
    ValueError: duplicate prompt ids, or a cache without a model_tag.
  """
  if cache is not None and model_tag:
    # The sampler's keys depend on how prompts are cut into batches and chunks, so a cache
    # entry is reused only under the same layout (a resumed run then equals a fresh one).
    c = config.sampling
    layout = (c.problems_per_batch, c.sampler.chunk_rows, c.sampler.prompts_per_chunk)
    model_tag = f"{model_tag}|layout={layout}"
  bench = benchmarks.Benchmark(_NAME, prompt_set, config.sampling.verifier.judge)
  kw = dict(cache=cache, model_tag=model_tag, progress=progress)
  records = benchmarks.run_benchmark(bench, policy, score, config.sampling, rng, **kw)
  rows = []
  for i, r in enumerate(records):
    count = int(np.sum(np.asarray(r["rewards"]) > 0.5))
    rows.append(
      {
        "prompt_id": prompt_set.prompt_ids[i],
        "problem": prompt_set.problems[i],
        "answer": prompt_set.answers[i],
        "source": prompt_set.sources[i],
        "num_samples": config.k,
        "pass_count": count,
        "pass_rate": count / config.k,
        "mean_response_tokens": float(np.mean(r["lengths"])),
      }
    )
  return rows


def apply_rule(rows: Sequence[Mapping[str, Any]], rule: FilterRule) -> list[Mapping[str, Any]]:
  """The rows (from `pass_rates`) that `rule` keeps, in order."""
  return [r for r in rows if rule.keeps(int(r["pass_count"]), int(r["num_samples"]))]


def histogram(rows: Sequence[Mapping[str, Any]], k: int) -> np.ndarray:
  """int64[k + 1]: entry c = number of prompts with c correct of k."""
  return np.bincount([int(r["pass_count"]) for r in rows], minlength=k + 1)[: k + 1]


# --------------------------------------------------------------------------- reports


def markdown_report(hist: np.ndarray, kept: Mapping[str, Mapping[str, Any]], k: int) -> str:
  """The pass-rate histogram and the kept sets as Markdown tables.

  Args:
    hist: `histogram(rows, k)`.
    kept: rule name -> `{'rule': str, 'prompts': int, 'file': str}`.
    k: samples per prompt.
  """
  total = max(int(hist.sum()), 1)
  lines = [
    f"### Pass rates of {int(hist.sum())} prompts ({k} samples each)\n",
    "| correct | pass rate | prompts | share % | cumulative % |",
    "|---:|---:|---:|---:|---:|",
  ]
  cumulative = 0
  for c, n in enumerate(hist):
    cumulative += int(n)
    lines.append(
      f"| {c} | {c / k:.4f} | {int(n)} | {100 * n / total:.1f} | {100 * cumulative / total:.1f} |"
    )
  lines += [
    "",
    "### Kept sets\n",
    "| set | rule | prompts | share % | file |",
    "|---|---|---:|---:|---|",
  ]
  for name, s in kept.items():
    lines.append(
      f"| {name} | {s['rule']} | {s['prompts']} | {100 * s['prompts'] / total:.1f} | {s['file']} |"
    )
  return "\n".join(lines) + "\n"


def plot_histogram(
  hist: np.ndarray, rules: Sequence[FilterRule], k: int, path: str | os.PathLike, title: str = ""
) -> None:
  """Writes a bar chart of prompts per pass rate, with each rule's threshold, as a PNG."""
  from matplotlib.figure import Figure  # Agg through Figure: no pyplot global state.

  fig = Figure(figsize=(7, 4), layout="constrained")
  ax = fig.subplots()
  rates = np.arange(k + 1) / k
  ax.bar(rates, hist, width=0.8 / k, color="tab:blue")
  for i, rule in enumerate(rules):
    label = f"{rule.name}: <= {rule.max_pass_rate:g}, >= {rule.min_correct} correct"
    ax.axvline(rule.max_pass_rate, color=f"C{i + 1}", linestyle="--", label=label)
  ax.set_xlabel(f"pass rate ({k} samples per prompt)")
  ax.set_ylabel("prompts")
  ax.set_title(title or f"{int(hist.sum())} prompts")
  if rules:
    ax.legend()
  fig.savefig(path, dpi=120)


def _write_jsonl(path: pathlib.Path, rows: Sequence[Mapping[str, Any]]) -> None:
  tmp = path.with_suffix(".tmp")
  tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
  os.replace(tmp, path)  # Atomic: a reader never sees half a set.


def write_outputs(
  rows: Sequence[Mapping[str, Any]],
  config: SelectConfig,
  out_dir: str | os.PathLike,
  info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """Writes pass_rates.jsonl, one `<rule>.jsonl` per rule, pass_rates.png / .md and
  summary.json to `out_dir`.

  Returns:
    The summary: `num_prompts`, `k`, `mean_pass_rate`, `histogram` (list of k + 1 counts),
    `sets` (rule name -> rule, prompts kept, file), `settings`, `files`, and `info`'s items.
  """
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  _write_jsonl(out / "pass_rates.jsonl", rows)
  kept = {}
  for rule in config.rules:
    path = out / f"{rule.name}.jsonl"
    selected = apply_rule(rows, rule)
    _write_jsonl(path, selected)
    desc = f"pass rate <= {rule.max_pass_rate:g}, >= {rule.min_correct} correct"
    kept[rule.name] = {"rule": desc, "prompts": len(selected), "file": str(path)}
    if not selected:
      logging.warning("rule %s keeps no prompt: %s is empty", rule.name, path)
  hist = histogram(rows, config.k)
  title = f"{len(rows)} prompts, {config.k} samples each"
  plot_histogram(hist, config.rules, config.k, out / "pass_rates.png", title)
  (out / "pass_rates.md").write_text(markdown_report(hist, kept, config.k))
  files = ("pass_rates.jsonl", "pass_rates.png", "pass_rates.md", "cache.jsonl")
  summary = dict(
    info or {},
    num_prompts=len(rows),
    k=config.k,
    mean_pass_rate=float(np.mean([r["pass_rate"] for r in rows])) if rows else 0.0,
    histogram=hist.tolist(),
    sets=kept,
    # The K-sampling pass's settings as the config spells them (settings.k,
    # settings.sampler.max_new_tokens, ...) and the rules (settings.rules).
    settings={**dataclasses.asdict(config.sampling), "rules": dataclasses.asdict(config)["rules"]},
    files={name: str(out / name) for name in files},
  )
  (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary


# --------------------------------------------------------------------------- model-level run


def run(
  config: SelectConfig,
  out_dir: str | os.PathLike,
  *,
  params: Params,
  model_config: ModelConfig,
  tokenizer: Tokenizer,
  prompt_set: prompts_lib.PromptSet,
  model_tag: str,
  mesh: jax.sharding.Mesh | None = None,
  progress: bool = True,
  info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """Measures every prompt's pass rate with the model and writes the sets (`write_outputs`).

  The verifier pool is started here; the cache is `<out_dir>/cache.jsonl` (one file per
  process in a multi-process run, which every process needs to resume identically), so a
  rerun after an interruption samples only the unfinished batches. Files are written by
  process 0.

  Args:
    config: settings.
    out_dir: output folder.
    params: the model's parameters (placed as `mesh` expects, if given).
    model_config, tokenizer: the model.
    prompt_set: prompts to measure (`inputs.load_prompts`).
    model_tag: identity of the model in the cache.
    mesh: sampler mesh, or None.
    progress: tqdm bar.
    info: extra items for summary.json (e.g. the model and how to train from it).

  Returns:
    The summary (`write_outputs`), plus `rows` (the per-prompt rows, not written to
    summary.json).

  Raises:
    ConfigError: a sampler group the sampler rejects, e.g. the largest prompt bucket plus
      `max_new_tokens` past the model's positions (before anything compiles).
  """
  c = config.sampling
  try:
    smp = eval_sampling.make_sampler(model_config, tokenizer, c, mesh=mesh)
  except ValueError as e:
    raise config_lib.ConfigError(f"SelectConfig.sampling.sampler: {e}") from None
  out = pathlib.Path(out_dir)
  policy = eval_sampling.sampler_policy(smp, params, tokenizer)
  suffix = f".p{jax.process_index()}" if jax.process_count() > 1 else ""
  cache = benchmarks.ResultCache(out / f"cache{suffix}.jsonl")
  start = time.perf_counter()
  kw = dict(cache=cache, model_tag=model_tag, progress=progress)
  with Verifier(c.verifier) as pool:
    rows = pass_rates(policy, pool.score, prompt_set, config, jax.random.key(c.seed), **kw)
  summary = {}
  if jax.process_index() == 0:
    info = {"model": model_tag, **dict(info or {}), "wall_s": round(time.perf_counter() - start, 2)}
    summary = write_outputs(rows, config, out, info)
    logging.info("prompt selection:\n%s", (out / "pass_rates.md").read_text())
  return {**summary, "rows": rows}


def training_prompts(
  cfg: config_lib.RunConfig, tokenizer: Tokenizer, limit: int = 0
) -> prompts_lib.PromptSet:
  """The config's training prompts exactly as training tokenizes them (the first `limit`
  if > 0)."""
  ps = inputs.load_prompts(cfg.data, tokenizer, seed=cfg.seed)
  if limit:
    fields = ("prompt_ids", "problems", "answers", "sources", "tokens")
    ps = dataclasses.replace(ps, **{f: getattr(ps, f)[:limit] for f in fields})
  return ps


# --------------------------------------------------------------------------- CLI
