"""Evaluation reports and the evaluation CLI, on top of `ada_jax.eval.benchmarks` (the core).

`run` loads the benchmarks, starts one verifier pool per judge, evaluates with the resumable
results cache `<workdir>/eval/cache.jsonl` and writes `<workdir>/eval/<name>.json` and `.md`
(never over a report of other weights or settings); the training loop calls it before RL,
every `eval.every_steps` steps and at the end. The cache knows a model by its weights'
values (`weights_tag`), so the loop and the CLI reuse each other's finished batches, and
nothing cached answers for other weights.

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

import contextlib
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

from ada_jax import config as config_lib
from ada_jax import distributed
from ada_jax.eval import benchmarks as benchmarks_lib
from ada_jax.eval import sampling as eval_sampling
from ada_jax.eval.benchmarks import EvalConfig
from ada_jax.models.decoder import ModelConfig, Params
from ada_jax.models.tokenizer import Tokenizer
from ada_jax.rewards.verifier import RewardPool

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


def run(
  config: EvalConfig,
  workdir: str | os.PathLike,
  *,
  params: Params,
  model_config: ModelConfig,
  tokenizer: Tokenizer,
  model_tag: str,
  name: str,
  mesh: jax.sharding.Mesh | None = None,
  samplers: eval_sampling.EvalSamplers | None = None,
  rng: jax.Array | None = None,
  progress: bool = True,
) -> dict[str, Any]:
  """Evaluates a model on `config.benchmarks` with verifier pools and the results cache,
  and writes `<workdir>/eval/<name>.json` and `<workdir>/eval/<name>.md`.

  The cache is `<workdir>/eval/cache.jsonl`; rerunning after an interruption generates only
  the batches that were not finished.

  Args:
    config: settings.
    workdir: run directory.
    params, model_config, tokenizer: the model.
    model_tag: identity of the model in the cache (`weights_tag`).
    name: file name stem of the reports, e.g. 'step_1000' or 'hf_Llama-3.2-3B-Instruct';
      `report_name` adds '.2', '.3', ... where a report of other weights or settings has it.
    mesh: sampler mesh or None.
    samplers: the run's `EvalSamplers` (built once, so repeated calls do not recompile);
      None = built here for this call on `mesh`.
    rng: the sampling key (a training run's `loop.RunKeys.eval`); None =
      `jax.random.key(config.seed)`.
    progress: tqdm bars.

  Returns:
    The report written to the JSON file: `model`, `name` (the file stem used), `settings`,
    `results`, `dropped_over_max_prompt_tokens` (per benchmark), `wall_s`.

  Raises:
    ConfigError: the largest prompt bucket plus `max_new_tokens` exceed the model's
      positions (before anything compiles).
  """
  s = config.sampler
  config_lib.context_fits(model_config, s.prompt_buckets, s.max_new_tokens, "config.eval.sampler")
  out_dir = pathlib.Path(workdir) / "eval"
  start = time.perf_counter()
  benchmarks = benchmarks_lib.load_benchmarks(config, tokenizer)
  rng = jax.random.key(config.seed) if rng is None else rng
  with contextlib.ExitStack() as stack:
    scorers = {}
    for judge in sorted({b.judge for b in benchmarks}):
      pool = RewardPool(dataclasses.replace(config.verifier, judge=judge))
      scorers[judge] = stack.enter_context(pool).score
    # One file per process: each process must find the same finished batches on resume
    # (every process launches the same sampler calls), even without a shared file system.
    suffix = f".p{jax.process_index()}" if jax.process_count() > 1 else ""
    cache = benchmarks_lib.ResultCache(out_dir / f"cache{suffix}.jsonl")
    if samplers is None:
      samplers = eval_sampling.EvalSamplers.make(model_config, tokenizer, config, mesh)
    kw = dict(cache=cache, model_tag=model_tag, progress=progress)
    results = eval_sampling.evaluate(
      params, samplers, tokenizer, benchmarks, config, rng, scorers, **kw
    )
  settings = dataclasses.asdict(config)
  name = report_name(out_dir, name, model_tag, settings)
  report = {
    "model": model_tag,
    "name": name,
    "settings": settings,
    "results": results,
    "dropped_over_max_prompt_tokens": {b.name: b.prompts.num_dropped for b in benchmarks},
    "wall_s": round(time.perf_counter() - start, 2),
  }
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
  (out_dir / f"{name}.md").write_text(markdown_table(results, f"{name} (Avg@{config.k})"))
  logging.info("evaluation of %s:\n%s", name, markdown_table(results))
  return report


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
