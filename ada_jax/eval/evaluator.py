"""Evaluation reports and the evaluation CLI, on top of `ada_jax.eval.benchmarks` (the core).

`Evaluator.make` checks the settings, loads the benchmarks and builds the samplers once;
`Evaluator.run` starts one verifier pool per judge, evaluates with the resumable results
cache `<workdir>/eval/cache.jsonl` and writes `<workdir>/eval/<name>.json` and `.md` (never
over a report of other weights or settings). The training loop keeps one `Evaluator` and
runs it before RL, every `eval.every_steps` steps and at the end; `run` is one of each.
The cache knows a model by its weights' values (`weights_tag`), so the loop and the CLI
reuse each other's finished batches, and nothing cached answers for other weights.

The CLI evaluates a Hugging Face folder (or Hub id) or an orbax checkpoint of a run. The
experiment config (`--config`, parsed by `config.parse` as for training) gives the `eval`
settings, the architecture (`model`), the tokenizer and the mesh; `--benchmarks`, `--k` and
`--limit` override its `eval` group. Without `--config`: the paper's evaluation settings
(`EvalConfig()`) and `RunConfig`'s other defaults.

  python -m ada_jax.evaluate --config=configs/<experiment>.py --workdir=DIR --checkpoint=STEP
  python -m ada_jax.evaluate --workdir=DIR --hf_dir=PATH --benchmarks=math500,aime24 --k=32

The CLI prints the results table (Markdown) on stdout, or the report as JSON with `--json`;
logs go to stderr at WARNING, as `ada_jax.main`'s. Exit codes: 0 done, 2 a bad flag or
config field (one line), 1 a failure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time
from collections.abc import Mapping
from typing import Any

import jax
from absl import logging

from ada_jax import distributed
from ada_jax.bounds import ConfigError
from ada_jax.data.sets import offline_hint
from ada_jax.eval import benchmarks as benchmarks_lib
from ada_jax.eval import sampling as eval_sampling
from ada_jax.eval.benchmarks import EvalConfig
from ada_jax.models.decoder import ModelConfig, Params
from ada_jax.models.tokenizer import Tokenizer
from ada_jax.rewards.verifier import Verifier

# --------------------------------------------------------------------------- reports


def markdown_table(results: Mapping[str, Mapping[str, float]], title: str = "") -> str:
  """Results as a Markdown table: one row per benchmark and the weighted average, scores in
  percent."""
  first = next(iter(results.values()), {})
  cols = [c for c in first if c not in ("num_problems", "response_tokens")]
  lines = [f"### {title}\n"] if title else []
  lines += [
    "| benchmark | problems | " + " | ".join(cols) + " | mean tokens |",
    "|---|---:|" + "---:|" * (len(cols) + 1),
  ]
  for name, m in results.items():
    label = "**weighted average**" if name == "average" else name
    lines.append(
      f"| {label} | {m['num_problems']} | "
      + " | ".join(f"{100 * m[c]:.1f}" for c in cols)
      + f" | {m['response_tokens']:.0f} |"
    )
  return "\n".join(lines) + "\n"


def weights_tag(params: Params, model_config: ModelConfig) -> str:
  """The cache identity of a model: a digest of its weights' values
  (`distributed.content_digest`) and of its architecture, whatever folder or step they came
  from. The loop's held-out evaluations and the CLI's `--checkpoint` / `--hf_dir` share it,
  so one reuses the other's results, and a reused workdir's cache never answers for other
  weights. A collective with several processes."""
  arch = hashlib.sha256(json.dumps(dataclasses.asdict(model_config), default=str).encode())
  return f"weights:{distributed.content_digest(params)}:{arch.hexdigest()[:8]}"


def report_name(
  out_dir: pathlib.Path, name: str, model_tag: str, settings: Mapping[str, Any]
) -> str:
  """`name`, or `name.2`, `name.3`, ... : the first whose report is absent or is of the same
  model and settings (the same evaluation, its numbers from the cache), so a report never
  replaces one of other weights or settings."""
  candidate, i = name, 1
  while (out_dir / f"{candidate}.json").exists():
    try:
      old = json.loads((out_dir / f"{candidate}.json").read_text())
    except (OSError, json.JSONDecodeError):
      old = {}
    if old.get("model") == model_tag and old.get("settings") == json.loads(json.dumps(settings)):
      break
    i += 1
    candidate = f"{name}.{i}"
  return candidate


@dataclasses.dataclass(frozen=True)
class Evaluator:
  """An evaluation set up once (`make`): every check done, the benchmarks read and
  tokenized, the samplers built (they compile on the first `run`), so that repeated runs
  (the training loop's held-out evaluations) read no data and compile nothing again; its
  verifier pools start with the first `run` and serve the next ones (starting a pool's
  processes took seconds per evaluation: experiments/README.md, "Where the CPU's time
  goes") until `close`, or the end of a `with` block.

  Attributes:
    config: the settings.
    model_config, tokenizer: the model's architecture and tokenizer.
    benchmarks: `config.benchmarks`, tokenized (`benchmarks.load_benchmark`).
    samplers: the `EvalSamplers` every run generates with.
    pools: the verifier pool of each judge a run has used.
  """

  config: EvalConfig
  model_config: ModelConfig
  tokenizer: Tokenizer
  benchmarks: tuple[benchmarks_lib.Benchmark, ...]
  samplers: eval_sampling.EvalSamplers
  pools: dict[str, Verifier] = dataclasses.field(default_factory=dict, compare=False)

  def close(self) -> None:
    """Stops the verifier pools (idempotent; a later `run` starts new ones)."""
    while self.pools:
      self.pools.popitem()[1].close()

  def __enter__(self) -> Evaluator:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  @classmethod
  def make(
    cls,
    config: EvalConfig,
    model_config: ModelConfig,
    tokenizer: Tokenizer,
    mesh: jax.sharding.Mesh | None = None,
    *,
    field: str = "config.eval",
  ) -> Evaluator:
    """Checks, reads and builds, before anything compiles.

    Args:
      config, model_config, tokenizer: as the attributes.
      mesh: the samplers' mesh (a training run's own: a replicated KV cache would not
        fit beside the train state), or None for one device.
      field: the config group's name in errors.

    Raises:
      ConfigError: a benchmark that cannot be read or downloaded (`<field>.benchmarks
        (<name>)`; offline, naming `<field>.manual_dir`), or a sampler group the sampler
        rejects, e.g. the largest prompt bucket plus `max_new_tokens` past the model's
        positions (`<field>.sampler`).
    """
    try:
      samplers = eval_sampling.EvalSamplers.make(model_config, tokenizer, config, mesh)
    except ValueError as e:
      raise ConfigError(f"{field}.sampler: {e}") from None
    benchmarks = []
    for name in config.benchmarks:
      try:
        benchmarks.append(benchmarks_lib.load_benchmark(name, config, tokenizer))
      except (OSError, ValueError) as e:
        hint = offline_hint(e, f"{field}.manual_dir")
        raise ConfigError(f"{field}.benchmarks ({name}): {e}{hint}") from None
    return cls(config, model_config, tokenizer, tuple(benchmarks), samplers)

  def run(
    self,
    workdir: str | os.PathLike,
    params: Params,
    *,
    name: str,
    model_tag: str | None = None,
    rng: jax.Array | None = None,
    progress: bool = True,
  ) -> dict[str, Any]:
    """Evaluates `params` with verifier pools (one per judge) and the results cache
    `<workdir>/eval/cache.jsonl`, and writes `<workdir>/eval/<name>.json` and `.md`.
    Rerunning after an interruption generates only the batches that were not finished.

    Args:
      workdir: run directory.
      params: the model's weights (placed as the samplers' mesh expects).
      name: file name stem of the reports, e.g. 'step_1000' or 'hf_Llama-3.2-3B-Instruct';
        `report_name` adds '.2', '.3', ... where a report of other weights or settings has it.
      model_tag: identity of the model in the cache; None = `weights_tag(params, ...)`.
      rng: the sampling key (a training run's `runstate.RunKeys.eval`); None =
        `jax.random.key(config.seed)`.
      progress: tqdm bars.

    Returns:
      The report written to the JSON file: `model`, `name` (the file stem used),
      `settings`, `results`, `dropped_over_max_prompt_tokens` (per benchmark), `wall_s`,
      `problems` (per benchmark, `benchmarks.problem_results`: correct and boxed of k per
      problem, for intervals).
    """
    config = self.config
    model_tag = weights_tag(params, self.model_config) if model_tag is None else model_tag
    # Where responses stop and what pads them are the tokenizer's (a folder's
    # generation_config.json can change under the same weights): part of every result's
    # identity and of the report's settings. The chat template changes the prompts' tokens,
    # which the cache checks per problem.
    stops = {"stop_ids": [int(i) for i in self.tokenizer.eos_ids], "pad_id": self.tokenizer.pad_id}
    out_dir = pathlib.Path(workdir) / "eval"
    start = time.perf_counter()
    rng = jax.random.key(config.seed) if rng is None else rng
    scorers = {}
    for judge in sorted({b.judge for b in self.benchmarks}):
      if judge not in self.pools:
        self.pools[judge] = Verifier(dataclasses.replace(config.verifier, judge=judge))
      scorers[judge] = self.pools[judge].score
    # One file per process: each process must find the same finished batches on resume
    # (every process launches the same sampler calls), even without a shared file system.
    suffix = f".p{jax.process_index()}" if jax.process_count() > 1 else ""
    cache = benchmarks_lib.ResultCache(out_dir / f"cache{suffix}.jsonl")
    records: dict[str, list[dict]] = {}
    cache_tag = f"{model_tag}|stop_ids={stops['stop_ids']}|pad_id={stops['pad_id']}"
    kw = dict(cache=cache, model_tag=cache_tag, progress=progress, records=records)
    results = eval_sampling.evaluate(
      params, self.samplers, self.tokenizer, self.benchmarks, config, rng, scorers, **kw
    )
    settings = {**dataclasses.asdict(config), "tokenizer": stops}
    name = report_name(out_dir, name, model_tag, settings)
    report = {
      "model": model_tag,
      "name": name,
      "settings": settings,
      "results": results,
      "dropped_over_max_prompt_tokens": {b.name: b.prompts.num_dropped for b in self.benchmarks},
      "wall_s": round(time.perf_counter() - start, 2),
      "problems": {b: benchmarks_lib.problem_results(r) for b, r in records.items()},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(markdown_table(results, f"{name} (Avg@{config.k})"))
    logging.info("evaluation of %s:\n%s", name, markdown_table(results))
    return report


def run(
  config: EvalConfig,
  workdir: str | os.PathLike,
  *,
  params: Params,
  model_config: ModelConfig,
  tokenizer: Tokenizer,
  name: str,
  model_tag: str | None = None,
  mesh: jax.sharding.Mesh | None = None,
  rng: jax.Array | None = None,
  progress: bool = True,
) -> dict[str, Any]:
  """One evaluation: `Evaluator.make(config, model_config, tokenizer, mesh).run(...)` (the
  CLI's; a run that evaluates repeatedly keeps its `Evaluator`).

  Raises:
    ConfigError: as `Evaluator.make`, before anything compiles.
  """
  with Evaluator.make(config, model_config, tokenizer, mesh) as evaluator:
    return evaluator.run(
      workdir, params, name=name, model_tag=model_tag, rng=rng, progress=progress
    )


# --------------------------------------------------------------------------- CLI


def report_text(
  report: Mapping[str, Any], workdir: str | os.PathLike, *, as_json: bool = False
) -> str:
  """What the CLI prints on stdout: the results table (Markdown) and where the report
  files are, or with `as_json` the report itself as JSON (for scripts)."""
  if as_json:
    return json.dumps(report, indent=2)
  title = f"{report['name']} (Avg@{report['settings']['k']})"
  files = pathlib.Path(workdir).absolute() / "eval" / f"{report['name']}.{{json,md}}"
  return f"{markdown_table(report['results'], title)}\nreports: {files}"
