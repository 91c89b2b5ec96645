"""Evaluation reports and the evaluation CLI, on top of `ada_jax.benchmarks` (the core).

`run` loads the benchmarks, starts one verifier pool per judge, evaluates with the resumable
results cache `<workdir>/eval/cache.jsonl` and writes `<workdir>/eval/<name>.json` and `.md`
(never over a report of other weights or settings); the training loop calls it before RL,
every `eval.every_steps` steps and at the end. A run's checkpoint at step s has one cache
identity (`checkpoint_tag`) whether the loop or the CLI evaluates it, so either reuses the
other's finished batches.

The CLI evaluates a Hugging Face folder (or Hub id) or an orbax checkpoint of a run. The
experiment config (`--config`, parsed by `config.parse` as for training) gives the `eval`
settings, the architecture (`model`), the tokenizer and the mesh; `--benchmarks`, `--k` and
`--limit` override its `eval` group. Without `--config`: the paper's evaluation settings
(`EvalConfig()`) and `RunConfig`'s other defaults.

  python -m ada_jax.evaluate --config=configs/x.py --workdir=DIR --checkpoint=STEP
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
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from absl import logging

from ada_jax import benchmarks as benchmarks_lib
from ada_jax import checkpoint as checkpoint_lib
from ada_jax import config as config_lib
from ada_jax import inputs, sharding, weights
from ada_jax import model as model_lib
from ada_jax.benchmarks import EvalConfig
from ada_jax.model import ModelConfig, Params
from ada_jax.tokenizer import Tokenizer
from ada_jax.verifier import RewardPool, VerifierConfig

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


def checkpoint_tag(directory: str | os.PathLike, step: int) -> str:
  """The cache identity of the weights of checkpoint `step` in the orbax folder
  `directory` (the step apart from its folder, as the cache has always keyed it)."""
  return f"checkpoint:{pathlib.Path(directory).absolute()}:{int(step)}"


def run_model_tag(workdir: str | os.PathLike, step: int) -> str:
  """The cache identity of a training run's policy after RL step `step` (its checkpoint
  `<workdir>/checkpoints/<step>`): the training loop's held-out evaluations and the CLI's
  `--checkpoint=step` share it, so one reuses the other's results."""
  return checkpoint_tag(pathlib.Path(workdir) / "checkpoints", step)


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
    model_tag: identity of the model in the cache (path and version of its weights).
    name: file name stem of the reports, e.g. 'step_1000' or 'hf_Llama-3.2-3B-Instruct';
      `report_name` adds '.2', '.3', ... where a report of other weights or settings has it.
    mesh: sampler mesh or None.
    progress: tqdm bars.

  Returns:
    The report written to the JSON file: `model`, `name` (the file stem used), `settings`,
    `results`, `dropped_over_max_prompt_tokens` (per benchmark), `wall_s`.

  Raises:
    ConfigError: the largest prompt bucket plus `max_new_tokens` exceed the model's
      positions (before anything compiles).
  """
  config_lib.context_fits(model_config, config.prompt_buckets, config.max_new_tokens, "config.eval")
  out_dir = pathlib.Path(workdir) / "eval"
  start = time.perf_counter()
  benchmarks = benchmarks_lib.load_benchmarks(config, tokenizer)
  with contextlib.ExitStack() as stack:
    scorers = {}
    for judge in sorted({b.judge for b in benchmarks}):
      pool = RewardPool(
        VerifierConfig(
          judge=judge, num_workers=config.verifier_workers, timeout_s=config.verifier_timeout_s
        )
      )
      scorers[judge] = stack.enter_context(pool).score
    # One file per process: each process must find the same finished batches on resume
    # (every process launches the same sampler calls), even without a shared file system.
    suffix = f".p{jax.process_index()}" if jax.process_count() > 1 else ""
    cache = benchmarks_lib.ResultCache(out_dir / f"cache{suffix}.jsonl")
    model = (params, model_config, tokenizer)
    kw = dict(mesh=mesh, cache=cache, model_tag=model_tag, progress=progress)
    results = benchmarks_lib.evaluate(
      *model, benchmarks, config, jax.random.key(config.seed), scorers, **kw
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


def _files_tag(folder: pathlib.Path) -> str:
  # Path alone would reuse stale cache entries after the folder's weights are replaced.
  stats = [
    (p.name, p.stat().st_size, p.stat().st_mtime_ns)
    for p in sorted(folder.glob("*"))
    if p.suffix in (".json", ".safetensors")
  ]
  return hashlib.sha256(repr(stats).encode()).hexdigest()[:12]


def _resolve(path: str, what: str) -> tuple[pathlib.Path, dict[str, Any]]:
  """A Hugging Face folder (or Hub id) and its config.json; ValueError naming `what`."""
  try:
    folder = weights.resolve(path).absolute()
    return folder, json.loads((folder / "config.json").read_text())
  except (OSError, ValueError) as e:
    raise ValueError(f"{what}: {e}") from None


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  """A model loaded by `load_model`.

  Attributes:
    params: the weights, placed on the mesh; None when nothing names weights (the caller
      initialises them).
    model_config: the architecture.
    tokenizer: `inputs.load_tokenizer`'s, checked against `model_config.vocab_size`.
    tag: identity of the weights in results caches: 'hf:<folder>:<files hash>',
      'checkpoint:<absolute path>', or '' when params is None.
  """

  params: Params | None
  model_config: ModelConfig
  tokenizer: Tokenizer
  tag: str


def load_model(
  cfg: config_lib.RunConfig,
  mesh: jax.sharding.Mesh,
  *,
  hf_dir: str | None = None,
  checkpoint_path: str | os.PathLike | None = None,
  tokenizer_dir: str | None = None,
) -> LoadedModel:
  """The model named by `hf_dir`, `checkpoint_path` or the config, placed on `mesh`.

  Weights: `hf_dir`'s safetensors; else the orbax checkpoint at `checkpoint_path`; else
  `cfg.model.hf_dir`'s safetensors; else none (params None). Architecture: `hf_dir`'s
  config.json (in `cfg.model.dtype`); else `cfg.model` (with `cfg.model.hf_dir`'s
  config.json if set), exactly as the run that wrote a checkpoint built it. Tokenizer:
  `tokenizer_dir`, else `cfg.tokenizer.dir`, else the model's folder, else the arithmetic
  task's. The tokenizer is checked before any weights are read.

  Args:
    cfg: the experiment (`model`, `tokenizer` groups).
    mesh: parameter placement (`sharding.param_shardings`).
    hf_dir: a Hugging Face folder or Hub id.
    checkpoint_path: an orbax checkpoint: a run's checkpoint folder (its latest step) or
      one step's folder.
    tokenizer_dir: overrides `cfg.tokenizer.dir`.

  Raises:
    ValueError: both hf_dir and checkpoint_path, an unreadable model folder (named as
      '--hf_dir' or 'config.model.hf_dir'), or a tokenizer larger than the model's
      vocabulary.
    FileNotFoundError: a checkpoint path without a checkpoint.
  """

  if hf_dir is not None and checkpoint_path is not None:
    raise ValueError("give at most one of --hf_dir and --checkpoint")
  model_dir = hf_config = None
  spec = cfg.model
  if hf_dir is not None:
    model_dir, hf_config = _resolve(hf_dir, "--hf_dir")
    spec = config_lib.ModelSpec(hf_dir=str(model_dir), dtype=cfg.model.dtype)
  elif cfg.model.hf_dir:
    model_dir, hf_config = _resolve(cfg.model.hf_dir, "config.model.hf_dir")
  model_config = config_lib.model_config(spec, hf_config)
  tokenizer_spec = cfg.tokenizer
  if tokenizer_dir:
    tokenizer_spec = dataclasses.replace(tokenizer_spec, dir=tokenizer_dir)
  tokenizer = inputs.load_tokenizer(tokenizer_spec, model_dir)
  model_lib.check_vocab(model_config, tokenizer.vocab_size)
  shardings = sharding.param_shardings(model_config, mesh)
  params, tag = None, ""
  if checkpoint_path is not None:
    path = pathlib.Path(checkpoint_path).absolute()
    target = sharding.abstract_params(model_config, mesh)
    params, tag = checkpoint_lib.restore_params(path, target), f"checkpoint:{path}"
  elif model_dir is not None:
    _, params = weights.load_hf(model_dir, dtype=model_config.param_dtype, shardings=shardings)
    tag = f"hf:{model_dir}:{_files_tag(model_dir)}"
  return LoadedModel(params, model_config, tokenizer, tag)


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


def define_flags(flag_values=None, sys_argv: list[str] | None = None) -> None:
  """Registers the CLI flags on `flag_values` (default: absl's global FLAGS)."""
  from absl import flags
  from ml_collections import config_flags

  fv = flags.FLAGS if flag_values is None else flag_values
  help_ = "Experiment config file (as for training); its eval, model, tokenizer, mesh are read."
  config_flags.DEFINE_config_file("config", None, help_, fv, lock_config=True, sys_argv=sys_argv)
  for define, name, help_ in (
    (flags.DEFINE_string, "workdir", "Run directory; reports go to <workdir>/eval."),
    (flags.DEFINE_integer, "checkpoint", "Orbax checkpoint step to evaluate."),
    (flags.DEFINE_string, "checkpoint_dir", "Orbax directory (default <workdir>/checkpoints)."),
    (flags.DEFINE_string, "hf_dir", "Hugging Face folder or Hub id to evaluate."),
    (flags.DEFINE_string, "tokenizer_dir", "Default: config.tokenizer.dir, else the model's."),
    (
      flags.DEFINE_list,
      "benchmarks",
      f"Comma-separated, from {sorted(benchmarks_lib.BENCHMARKS)}.",
    ),
    (flags.DEFINE_integer, "k", "Responses per problem (Avg@k)."),
    (flags.DEFINE_integer, "limit", "Only the first N problems of each benchmark."),
  ):
    define(name, None, help_, flag_values=fv)
  flags.DEFINE_bool(
    "json", False, "Print the report as JSON on stdout instead of the table.", flag_values=fv
  )


def main(argv: Sequence[str], flag_values=None) -> dict[str, Any]:
  """The CLI: loads the model named by --hf_dir or --checkpoint and calls `run`.

  The model is `load_model`'s: with --checkpoint the architecture is the config's `model`
  group, exactly as the run that wrote the checkpoint built it; with --hf_dir it is the
  folder's config.json (in the config's `model.dtype`). The tokenizer: --tokenizer_dir,
  else `tokenizer.dir`, else the model's folder, else the arithmetic task's.

  Raises:
    ValueError: neither or both of --hf_dir / --checkpoint, no --workdir, an unreadable model
      folder, a tokenizer larger than the model's vocabulary, or a bad config field (named).
  """
  del argv
  from absl import flags

  fv = flags.FLAGS if flag_values is None else flag_values
  if not fv.workdir:
    raise config_lib.ConfigError("--workdir is required")
  if (fv.hf_dir is None) == (fv.checkpoint is None):
    raise config_lib.ConfigError("give exactly one of --hf_dir=PATH and --checkpoint=STEP")
  if fv.config is not None:
    cfg = config_lib.parse(fv.config)
  else:
    cfg = dataclasses.replace(config_lib.RunConfig(), eval=EvalConfig())
  flags_ = {
    k: v
    for k, v in {"benchmarks": fv.benchmarks, "k": fv.k, "limit": fv.limit}.items()
    if v is not None
  }
  try:
    config = dataclasses.replace(cfg.eval, **flags_)
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  except ValueError as e:
    raise config_lib.ConfigError(str(e)) from None
  # A report made with other benchmarks / k / limit than the config's gets its own name, so
  # it never replaces the run's own eval/step_<n> report.
  suffix = "".join(
    "_" + ("+".join(v) if k == "benchmarks" else f"{k}{v}") for k, v in sorted(flags_.items())
  )
  if fv.hf_dir is not None:
    model = load_model(cfg, mesh, hf_dir=fv.hf_dir, tokenizer_dir=fv.tokenizer_dir)
    tag, name = model.tag, f"hf_{pathlib.Path(fv.hf_dir).absolute().name}"
  else:
    directory = pathlib.Path(fv.checkpoint_dir or pathlib.Path(fv.workdir) / "checkpoints")
    directory = directory.absolute()
    ckpt = directory / str(fv.checkpoint)
    try:
      checkpoint_lib.params_step_dir(ckpt)
    except FileNotFoundError as e:
      raise config_lib.ConfigError(f"--checkpoint={fv.checkpoint}: {e}") from None
    model = load_model(cfg, mesh, checkpoint_path=ckpt, tokenizer_dir=fv.tokenizer_dir)
    # The training loop's tag for the same step: its cached results are reused.
    tag, name = checkpoint_tag(directory, fv.checkpoint), f"step_{fv.checkpoint}"
  return run(
    config,
    fv.workdir,
    params=model.params,
    model_config=model.model_config,
    tokenizer=model.tokenizer,
    model_tag=tag,
    name=name + suffix,
    mesh=mesh,
  )


if __name__ == "__main__":
  from absl import app

  define_flags()
  config_lib.make_configs_importable()

  def _main(argv):
    from absl import flags

    config_lib.quiet_logs()
    with config_lib.exit_on_config_error():
      report = main(argv)
    print(report_text(report, flags.FLAGS.workdir, as_json=flags.FLAGS.json), flush=True)
    # Not returned: app.run would sys.exit() a returned report.

  app.run(_main, flags_parser=config_lib.parse_flags)
