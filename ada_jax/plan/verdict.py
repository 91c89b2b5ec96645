"""Will this config fit that TPU slice or GPU host? `python -m ada_jax.plan
--config=configs/<experiment>.py --topology=v5e-8|h100x8|... [--config.group.field=value ...]
[--json=PATH] [--mem_fraction=0.75]`, on a laptop, before renting the machines.

Compiles every program the run holds in device memory with the target's own compiler
(libtpu for TPU slices, the CUDA plugin for GPUs; ahead of time, no accelerator needed:
`aot.py`) on the config's mesh over the target's devices, and adds what stays resident
beside each (the train state while sampling, the slot cache while prefilling). Prints per
phase the bytes per device against the memory a program may use (a TPU's HBM; a GPU's
memory times JAX's allocator fraction, `--mem_fraction`), the largest temporary buffers,
and on TPU a compiler-derived decode roofline (not a measurement). Exit codes: 0 every
phase fits, 1 one does not (named, with its buffers, or XLA's refusal), 2 a bad flag,
config field or target name (one line, nothing compiled).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time

from absl import app, flags

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_USAGE = 0, 1, 2
# Hub ids of the experiment configs -> their architecture presets: a plan reads no
# config.json and downloads nothing. A local folder is read for its config.json.
PRESET_OF_HF = {
  "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b",
  "meta-llama/Llama-3.2-3B": "llama-3.2-3b",
  "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
  "Qwen/Qwen2.5-Math-1.5B": "qwen2.5-math-1.5b",
  "Qwen/Qwen2.5-Math-7B": "qwen2.5-math-7b",
  "Qwen/Qwen3-4B": "qwen3-4b",
}
# Head room a plan asks for beyond the compiler's figures (runtime buffers, fragmentation).
SPARE_GIB = 0.5


def model_of(cfg):
  """The config's architecture: its preset, a known Hub id's preset, or a local folder's
  config.json. Raises ValueError naming `config.model.hf_dir` otherwise."""
  spec = cfg.model
  if spec.preset:
    return spec.model_config()
  if spec.hf_dir in PRESET_OF_HF:
    return dataclasses.replace(spec, preset=PRESET_OF_HF[spec.hf_dir], hf_dir="").model_config()
  folder = pathlib.Path(spec.hf_dir)
  if (folder / "config.json").is_file():
    try:
      return spec.model_config(json.loads((folder / "config.json").read_text()))
    except json.JSONDecodeError as e:  # its message names no file
      raise ValueError(
        f"config.model.hf_dir: {folder / 'config.json'}: not valid JSON ({e})"
      ) from None
  raise ValueError(
    f"config.model.hf_dir {spec.hf_dir!r}: not a folder with config.json and no known Hub "
    f"id ({', '.join(PRESET_OF_HF)}); pass --config.model.hf_dir=FOLDER"
  )


def plan(
  cfg, target_name: str, *, devices=None, progress=print, mem_fraction=None, size_slots=True
) -> dict:
  """Compiles the run's programs for the target and says whether each phase fits.

  Args:
    cfg: a parsed `config.RunConfig`.
    target_name: a TPU slice or GPU host of `targets.TARGETS` ('v5e-8', 'h100x8', ...).
    devices: the devices to compile for; None: the target's compile-only devices.
    progress: called with a line as each program compiles.
    mem_fraction: on a GPU, the fraction of the card's memory JAX's allocator takes
      (None: `targets.DEFAULT_MEM_FRACTION`, JAX's default); ignored on a TPU.
    size_slots: also find the largest rollout and evaluation slot counts that fit
      (`largest_fitting`: a few more compiles of the pools) and, on TPU, the decode
      roofline at the largest.

  Returns:
    A JSON-ready dict: the slice, the mesh, per phase its bytes per device
    (`phases[name]['gib']`), whether it fits with `SPARE_GIB` to spare, the programs'
    memory analyses and largest temporaries, the roofline figures, the largest slot
    counts (`slots`), and `fits` overall. A phase XLA refused has `refused` (XLA's
    message) instead of figures.

  Raises:
    ValueError: an unknown slice, a mesh or batch that does not divide over it, or an
      architecture `model_of` cannot find (the field named).
    RuntimeError: the target's compiler (libtpu, the CUDA plugin) is missing.
  """
  from ada_jax import aot, capacity, targets

  t = targets.target(target_name)
  mem_fraction = targets.DEFAULT_MEM_FRACTION if mem_fraction is None else mem_fraction
  model_cfg = model_of(cfg)
  devices = devices or targets.devices_for(t)
  mesh = aot.mesh_for(cfg, devices)
  params = aot.rollout_params(model_cfg, mesh)  # what every sampler decodes from
  gib = lambda b: round(b / targets.GIB, 4)
  usable = t.usable_gib(mem_fraction)
  limit = int((usable - SPARE_GIB) * targets.GIB)
  phases, programs, notes = {}, {}, []

  def timed(name, fn):
    start = time.perf_counter()
    try:
      out = fn()
    except aot.OutOfMemory as e:
      progress(f"  {name}: refused by {t.compiler} ({time.perf_counter() - start:.0f} s)")
      return e
    progress(f"  {name}: compiled ({time.perf_counter() - start:.0f} s)")
    return out

  train_out = timed("train", lambda: aot.train_program(cfg, model_cfg, mesh))
  # Resident beside every sampling program: the train state (the master params, the
  # optimizer state and a KL term's reference params); the train step holds it as its
  # arguments, and the rollout copy is freed before it (`rollout.engine.PoolEngine.finish`).
  state = aot.train.abstract_state(model_cfg, cfg.train, mesh, with_ref=cfg.loss.kl_coeff > 0)
  resident = aot.per_device_bytes(state)
  params_differ = model_cfg.dtype != model_cfg.param_dtype
  # `train.offload_state`: during a step's rollouts the state waits in host memory
  # (`sharding.to_memory`); evaluations run with it on the device.
  offloaded = cfg.train.offload_state and params_differ
  resident_rollout = 0 if offloaded else resident
  if isinstance(train_out, aot.OutOfMemory):
    phases["train"] = {"refused": str(train_out), "fits": False}
  else:
    program, layout = train_out
    programs["train"] = program.as_dict() | {
      "mini_batch_rows": layout["mini_batch_rows"],
      "seq_len": layout["seq_len"],
    }
    phases["train"] = {"bytes": program.peak}

  def segment_figures(smp, pool):
    return pool["segment"].as_dict() | {
      "slots": smp.slots,
      "kv_cache_gib": gib(pool["slot_cache"]),
      "prompt_cache_gib": gib(pool["prompt_cache"]),
      "temp_over_kv": round(pool["segment"].temp / pool["slot_cache"], 4),
    }

  def rollout(slots, name="sample"):
    """The rollout pool at `slots`: (sampler, its programs or the refusal, phase bytes)."""
    smp = aot.rollout_sampler(cfg, model_cfg, mesh, slots)
    pool = timed(name, lambda: aot.pool_programs(smp, params, what="rollout pool"))
    if isinstance(pool, aot.OutOfMemory):
      return smp, pool, None
    return (
      smp,
      pool,
      {
        "sample": pool["segment"].peak + resident_rollout,
        "prefill": pool["prefill"].peak + pool["pool_state"] + resident_rollout,
      },
    )

  def evaluation(slots, name="eval"):
    ev = aot.eval_sampler(cfg, model_cfg, mesh, slots)
    pool = timed(name, lambda: aot.pool_programs(ev, params, what="evaluation pool"))
    if isinstance(pool, aot.OutOfMemory):
      return ev, pool, None
    return ev, pool, {"eval": pool["segment"].peak + resident}

  def decode_roofline(smp, pool):
    step = timed(
      f"decode step at {smp.slots} slots (roofline)",
      lambda: aot.decode_step_program(smp, params, pool["state"]),
    )
    return None if isinstance(step, aot.OutOfMemory) else step

  smp, pool, sampled = rollout(cfg.sampler.chunk_rows)
  if sampled is None:
    phases["sample"] = phases["prefill"] = {"refused": str(pool), "fits": False}
  else:
    programs["pool_segment"] = segment_figures(smp, pool)
    programs["prefill"] = pool["prefill"].as_dict() | {
      "prompts": smp.prompts_per_chunk,
      "prompt_cache_filled_gib": gib(
        pool["prompt_cache"] * smp.prompts_per_chunk / smp.prompt_entries
      ),
    }
    phases |= {name: {"bytes": b} for name, b in sampled.items()}
    if t.platform == "tpu":  # the roofline reads XLA:TPU's cost analysis (`roofline`)
      step = decode_roofline(smp, pool)
      if step is not None:
        programs["decode_step"] = step
  if cfg.eval.benchmarks:
    ev, ev_pool, evaluated = evaluation(cfg.eval.sampler.chunk_rows)
    if evaluated is None:
      phases["eval"] = {"refused": str(ev_pool), "fits": False}
    else:
      programs["eval_segment"] = segment_figures(ev, ev_pool)
      phases["eval"] = {"bytes": evaluated["eval"]}
  slots = {}
  if size_slots:
    granule = capacity.slot_step(mesh)
    peak = lambda phases_bytes: None if phases_bytes is None else max(phases_bytes.values())
    progress(f"  sizing the rollout slots (multiples of {granule})")
    memo = {}

    def rollout_bytes(n):
      memo[n] = rollout(n, name=f"sample at {n} slots")
      return peak(memo[n][2]) if memo[n][2] else memo[n][1].needed

    best, best_bytes = capacity.largest_fitting(
      rollout_bytes, cfg.sampler.chunk_rows, peak(sampled) if sampled else pool.needed,
      granule, limit,
    )  # fmt: skip
    slots["rollout"] = {"config": cfg.sampler.chunk_rows, "largest": best}
    if best:
      slots["rollout"]["gib"] = gib(best_bytes)
      if t.platform == "tpu":
        at = (smp, pool) if best == cfg.sampler.chunk_rows else memo[best][:2]
        step_at = programs.get("decode_step") if best == cfg.sampler.chunk_rows else None
        step_at = step_at or decode_roofline(*at)
        if step_at is not None:
          figures = capacity.roofline_figures(model_cfg, t, mesh, *at, step_at)
          slots["rollout"]["roofline"] = figures
    if cfg.eval.benchmarks:
      progress(f"  sizing the evaluation slots (multiples of {granule})")

      def eval_bytes(n):
        _, pool, phase = evaluation(n, name=f"eval at {n} slots")
        return peak(phase) if phase else pool.needed

      best, best_bytes = capacity.largest_fitting(
        eval_bytes,
        cfg.eval.sampler.chunk_rows,
        peak(evaluated) if evaluated else ev_pool.needed,
        granule,
        limit,
      )
      slots["eval"] = {"config": cfg.eval.sampler.chunk_rows, "largest": best}
      if best:
        slots["eval"]["gib"] = gib(best_bytes)
  roofline = capacity.roofline(cfg, model_cfg, t, mesh, programs, smp, pool)
  if cfg.rule.needs_features(cfg.ada):
    notes.append(
      "est head: its features come from the rollout pool's own prefill (the prefill "
      "phase) and its parameters are D + 1 floats"
    )
  if offloaded:
    notes.append(
      f"train.offload_state: the train state ({gib(resident)} GiB per device) is in host "
      "memory during the sample and prefill phases, on the device in train and eval"
    )
  notes.append(
    f"rollout copy: the samplers decode from a fused {model_cfg.dtype} copy of the params "
    "whole along 'fsdp' (split over 'tensor'), made once per RL step and evaluation (in "
    "the sample, prefill and eval phases' arguments) and freed before the train step"
  )
  if t.platform != "tpu":
    notes.append(
      f"{t.compiler} never refuses a program for its size: each phase is held against "
      f"{usable:.2f} GiB, {mem_fraction} of the card's {t.hbm_gib} GiB (JAX's allocator "
      "fraction, XLA_PYTHON_CLIENT_MEM_FRACTION; --mem_fraction)"
    )
  for phase in phases.values():
    if "bytes" in phase:
      phase["gib"] = gib(phase.pop("bytes"))
      phase["spare_gib"] = round(usable - phase["gib"], 4)
      phase["fits"] = phase["gib"] + SPARE_GIB <= usable
  return {
    "target": dataclasses.asdict(t)
    | {
      "usable_gib": round(usable, 4),
      "mem_fraction": mem_fraction if t.platform != "tpu" else None,
    },
    "device_kind": devices[0].device_kind,
    "mesh": aot.shard_counts(mesh),
    "model": dataclasses.asdict(model_cfg),
    "resident_gib": {
      "params": gib(aot.per_device_bytes(state.params)),
      "opt_state": gib(aot.per_device_bytes(state.opt_state)),
      "rollout_copy": gib(aot.per_device_bytes(params)),
      "offloaded_while_sampling": gib(resident) if offloaded else 0.0,
    },
    "phases": phases,
    "programs": programs,
    "roofline": roofline,
    "slots": slots,
    "notes": notes,
    "fits": bool(phases) and all(p["fits"] for p in phases.values()),
  }


def report(result: dict) -> str:
  """The plan as a short table: one line per phase, then the largest temporaries of any
  phase that does not fit."""
  t = result["target"]
  memory = f"{t['hbm_gib']} GiB HBM"
  if t["platform"] != "tpu":
    memory = (
      f"{t['usable_gib']:.2f} of {t['hbm_gib']} GiB usable at --mem_fraction={t['mem_fraction']}"
    )
  lines = [
    f"{t['name']} ({result['device_kind']}, {t['devices']} devices, {memory} "
    f"each), mesh {result['mesh']}; resident: params {result['resident_gib']['params']} GiB, "
    f"optimizer state {result['resident_gib']['opt_state']} GiB, rollout copy "
    f"{result['resident_gib']['rollout_copy']} GiB (sampling only) per device",
    f"{'phase':<10}{'GiB/device':>11}{'spare':>8}  verdict",
  ]
  for name, p in result["phases"].items():
    if "refused" in p:
      lines.append(f"{name:<10}{'-':>11}{'-':>8}  REFUSED: {p['refused'][:300]}")
    else:
      verdict = "fits" if p["fits"] else f"DOES NOT FIT (needs {SPARE_GIB} GiB spare)"
      lines.append(f"{name:<10}{p['gib']:>11.2f}{p['spare_gib']:>8.2f}  {verdict}")
  program_of = {"train": "train", "sample": "pool_segment", "prefill": "prefill"}
  program_of["eval"] = "eval_segment"
  for name, p in result["phases"].items():
    prog = result["programs"].get(program_of.get(name, ""), {})
    if not p["fits"] and prog:
      lines.append(f"largest temporaries of {name}:")
      for buf in prog["largest_temps"][:5]:
        lines.append(f"  {buf['bytes'] / 2**30:8.3f} GiB  {buf['shape']}  {buf['op'][:80]}")
  r = result["roofline"]
  if "decode_bytes_ratio" in r:
    lines.append(
      f"roofline (compiler-derived): decode step HBM bytes / (weights + KV) = "
      f"{r['decode_bytes_ratio']}, <= {r['decode_tokens_per_s_per_chip']:.0f} tokens/s/chip "
      f"at {r['hbm_gbs']:.0f} GB/s and {r['slots']} slots"
    )
  for which, sized in result.get("slots", {}).items():
    line = f"largest {which} slots that fit every phase with {SPARE_GIB} GiB spare: "
    line += f"{sized['largest']} (config: {sized['config']})"
    if sized["largest"]:
      line += f", {sized['gib']:.2f} GiB/device"
    if "roofline" in sized:
      f = sized["roofline"]
      line += (
        f"; decode bytes / (weights + KV) = {f['decode_bytes_ratio']}, "
        f"<= {f['decode_tokens_per_s_per_chip']:.0f} tokens/s/chip"
      )
    lines.append(line)
  lines.append("FITS" if result["fits"] else "DOES NOT FIT")
  return "\n".join(lines)


def _check_writable(path: str) -> None:
  """Refuses a `--json` path that cannot be written (checked, nothing created).

  Raises:
    ConfigError: naming the flag and why.
  """
  from ada_jax.config import ConfigError

  target = pathlib.Path(path).absolute()
  if not path or target.is_dir():
    raise ConfigError(f"--json={path}: not a file name")
  folder = target.parent
  if not folder.is_dir():
    raise ConfigError(f"--json={path}: no folder {folder}")
  if not os.access(target if target.exists() else folder, os.W_OK):
    raise ConfigError(f"--json={path}: not writable")


def define_flags() -> None:
  """The command's flags, on absl's global FLAGS (only when run as the command: importing
  this module defines none, so it sits beside other entry points in one process)."""
  from ada_jax import cli, targets

  cli.define_config_file("config", "Experiment config file.")
  flags.DEFINE_string("topology", None, f"TPU slice or GPU host(s): {', '.join(targets.TARGETS)}.")
  flags.DEFINE_float(
    "mem_fraction",
    targets.DEFAULT_MEM_FRACTION,
    "GPU targets: the fraction of each card's memory JAX's allocator takes "
    "(XLA_PYTHON_CLIENT_MEM_FRACTION).",
  )
  flags.DEFINE_string("json", None, "Also write the whole plan as JSON here.")
  flags.DEFINE_bool(
    "size_slots",
    True,
    "Also find the largest rollout and evaluation slot counts that fit (more compiles).",
  )


def main(argv) -> int:
  del argv
  topology, json_path = flags.FLAGS.topology, flags.FLAGS.json
  mem_fraction = flags.FLAGS.mem_fraction
  from ada_jax import aot, cli, metrics, targets
  from ada_jax import config as config_lib

  with cli.exit_on_config_error():
    if topology not in targets.TARGETS:
      raise config_lib.ConfigError(
        f"--topology={topology}: unknown TPU slice or GPU host; known: {', '.join(targets.TARGETS)}"
      )
    if not 0 < mem_fraction <= 1:
      raise config_lib.ConfigError(f"--mem_fraction={mem_fraction}: must be in (0, 1]")
    cfg = config_lib.parse(flags.FLAGS.config)
    try:
      model_of(cfg)
    except ValueError as e:
      raise config_lib.ConfigError(str(e)) from None
    if json_path is not None:  # before minutes of compiling, not after them
      _check_writable(json_path)
    try:
      devices = targets.devices_for(targets.TARGETS[topology])
    except RuntimeError as e:
      raise config_lib.ConfigError(f"--topology={topology}: {e}") from None
    try:
      aot.mesh_for(cfg, devices)
    except ValueError as e:
      raise config_lib.ConfigError(f"config.mesh on {topology}: {e}") from None
  compiler = targets.TARGETS[topology].compiler
  print(f"compiling for {topology} with {compiler} (minutes on a laptop)", flush=True)
  try:
    result = plan(
      cfg,
      topology,
      devices=devices,
      progress=lambda line: print(line, flush=True),
      mem_fraction=mem_fraction,
      size_slots=flags.FLAGS.size_slots,
    )
  except ValueError as e:  # a batch or chunk that does not divide over this mesh
    print(f"ada_jax: {e}", file=sys.stderr)
    return EXIT_USAGE
  result["git_commit"] = metrics.git_commit()
  result["config"] = dataclasses.asdict(cfg)
  print(report(result), flush=True)
  if json_path:
    try:
      with open(json_path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    except OSError as e:  # the file's folder went away while compiling
      print(f"ada_jax: --json={json_path}: {e.strerror}", file=sys.stderr, flush=True)
      return EXIT_USAGE
  return EXIT_FITS if result["fits"] else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the target; run nothing
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from ada_jax import cli

  cli.make_configs_importable()
  define_flags()
  flags.mark_flags_as_required(["config", "topology"])
  app.run(main, flags_parser=cli.parse_flags)
