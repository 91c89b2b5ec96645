"""Per-device memory of the 3B / 7B experiment configs, from XLA's compiled memory analysis.

  python experiments/memory_plan.py                       # both configs, 8 and 32 devices
  python experiments/memory_plan.py --configs=llama3b_pos --devices=4,8

For each config and fake device count, compiles (on this CPU, without allocating any
weight: every input is a `jax.ShapeDtypeStruct` carrying its sharding) the two programs
that hold the most memory:

* the train step (`train.make_train_step`) on one mini-batch of the paper's batch
  (512 prompts × 4 responses / 4 mini-batches = 512 rows of 1024 prompt + 2048 response
  tokens), with the config's micro-batching and remat;
* one segment of the rollout pool (`pool.run_segment`) with `sampler.chunk_rows` slots,
  prompts of the largest bucket (1024) and 2048 new tokens.

and reports per-device bytes: params and optimizer state (exact, from their shardings),
the KV cache of one chunk (exact), and XLA's argument / temp / output / alias sizes, whose
sum is the program's peak (`peak = argument + temp + output - alias`). The optimizer state
stays in HBM while the sampler runs, so the sampling peak adds it. Peaks are compared
with the HBM of TPU v4 (32 GiB), v5e (16 GiB), v5p (95 GiB) and H100 (80 GiB).

Caveats, read before trusting a number: this is XLA:CPU's buffer assignment with its
memory-minimising scheduler (`--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED`;
the default concurrency-optimised one adds ~70% to the train step's temp). XLA:CPU
computes bf16 matmuls in fp32, so gathered weights and activations take twice their TPU
size: the figures are upper bounds for a TPU, not predictions of its allocator.

A micro-batch must split evenly over data × fsdp; when the config's `micro_batch_size`
does not on a mesh (e.g. 32 devices), the plan uses one row per data-parallel group
(`micro_used`) and says so.

For each program it also lists the largest slots of XLA's temporary allocation
(`largest_buffers`: bytes, the shapes and the JAX op of the values sharing each slot, read
from XLA's buffer-assignment dump) and marks those that are XLA:CPU artefacts: float32
copies of what the program computes in bfloat16 (CPU has no bf16 matmul kernels), which a
TPU or GPU compile would not hold.

Output: a table on stdout and JSON (default experiments/results/memory_plan.json) naming
the git commit and each row's full run config.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def _parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--configs",
    default="llama3b_pos,qwen_math7b_pos",
    help="comma-separated config modules under configs/",
  )
  parser.add_argument("--devices", default="8,32", help="comma-separated fake device counts")
  parser.add_argument("--programs", default="train,sampler", help="train and/or sampler")
  parser.add_argument(
    "--out", default=os.path.join(os.path.dirname(__file__), "results", "memory_plan.json")
  )
  parser.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="GROUP.FIELD=VALUE",
    help="override a config value for exploration, e.g. "
    "train.micro_batch_size=8 or mesh.tensor=2 (repeatable)",
  )
  return parser.parse_args(argv)


ARGS = _parse_args(sys.argv[1:])
_MAX_DEVICES = max(int(d) for d in ARGS.devices.split(","))
# XLA writes each compiled program's buffer assignment here; `largest_buffers` reads it.
_DUMP_DIR = tempfile.mkdtemp(prefix="memory_plan_")
# Before JAX is imported: fake CPU devices and XLA:CPU's memory-minimising scheduler.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join(
  [
    os.environ.get("XLA_FLAGS", ""),
    f"--xla_force_host_platform_device_count={_MAX_DEVICES}",
    "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
    f"--xla_dump_to={_DUMP_DIR}",
    "--xla_dump_hlo_module_re=jit_(train_step|run_segment)$",
  ]
).strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ast  # noqa: E402
import dataclasses  # noqa: E402
import glob  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ada_jax import config as config_lib  # noqa: E402
from ada_jax import metrics as metrics_lib  # noqa: E402
from ada_jax.models import decoder as model_lib  # noqa: E402
from ada_jax.models import sharding as sharding_lib  # noqa: E402
from ada_jax.models import weights  # noqa: E402
from ada_jax.rl import train  # noqa: E402
from ada_jax.rollout import pool as pool_lib  # noqa: E402
from ada_jax.rollout import sampler as sampler_lib  # noqa: E402

GIB = 2**30
HBM_GIB = {"tpu_v4": 32, "tpu_v5e": 16, "tpu_v5p": 95, "h100": 80}
# The Hugging Face checkpoints of the experiment configs -> their architecture presets (the
# plan needs no config.json and no download).
PRESET_OF_HF = {
  "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b",
  "meta-llama/Llama-3.2-3B": "llama-3.2-3b",
  "Qwen/Qwen2.5-Math-7B": "qwen2.5-math-7b",
  "Qwen/Qwen2.5-Math-1.5B": "qwen2.5-math-1.5b",
}


def load_config(name: str, overrides: list[str]) -> config_lib.RunConfig:
  """configs/<name>.py's `get_config()` with `--set` overrides, parsed and checked."""
  c = importlib.import_module(f"configs.{name}").get_config()
  for item in overrides:
    key, _, raw = item.partition("=")
    group, _, field = key.partition(".")
    try:
      value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      value = raw
    c[group][field] = value
  return config_lib.parse(c)


def model_of(cfg: config_lib.RunConfig) -> model_lib.ModelConfig:
  """The config's architecture, from its preset or its Hugging Face id (no download)."""
  name = cfg.model.preset or PRESET_OF_HF.get(cfg.model.hf_dir)
  if name is None:
    raise ValueError(
      f"config.model.hf_dir {cfg.model.hf_dir!r}: no preset known for it; add it to PRESET_OF_HF"
    )
  return weights.ModelSpec(
    preset=name, dtype=cfg.model.dtype, overrides=cfg.model.overrides
  ).model_config()


def per_device_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded `ShapeDtypeStruct`s (the largest shard
  of each leaf: shardings here are even, so every device holds the same)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shard = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
  return total


def memory(compiled) -> dict[str, float]:
  """XLA's per-device memory analysis of a compiled program, in GiB."""
  m = compiled.memory_analysis()
  out = {k: getattr(m, f"{k}_size_in_bytes") / GIB for k in ("argument", "output", "alias", "temp")}
  out["peak"] = out["argument"] + out["temp"] + out["output"] - out["alias"]
  return out


_SLOT = re.compile(r"^\s*[\d.]+\w*iB\(\s*\d+%\);\s*[\d.]+\w*iB;\s*(\d+);\s*(\d+);\s*(.*)$")
_VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\w+)\[([\d,]*)\]")
_OP_NAME = re.compile(r'^\s*(?:ROOT )?%(\S+) = (\w+)\[.*?op_name="([^"]*)"')


def _newest(pattern: str) -> str:
  files = glob.glob(os.path.join(_DUMP_DIR, pattern))
  if not files:
    raise FileNotFoundError(f"no XLA dump matches {pattern} in {_DUMP_DIR}")
  return max(files, key=os.path.getmtime)


def _op_dtypes(hlo_path: str) -> tuple[dict[str, str], dict[str, set[str]]]:
  """From an HLO text dump: instruction -> op_name, and op_name -> result dtypes."""
  op_of, dtypes = {}, {}
  with open(hlo_path) as f:
    for line in f:
      m = _OP_NAME.match(line)
      if m:
        op_of[m.group(1)] = m.group(3)
        dtypes.setdefault(m.group(3), set()).add(m.group(2))
  return op_of, dtypes


def largest_buffers(module: str, model_dtype: str, top: int = 12) -> dict:
  """The largest slots of a compiled program's temporary allocation, from XLA's dump.

  XLA packs temporaries into one allocation; a slot is a range of it that several values
  share over time. For each of the `top` largest slots: its bytes, the values that use it
  (shape, dtype, the JAX op that made them) and whether its largest value is an XLA:CPU
  artefact: a float32 buffer where the program (the HLO before XLA:CPU's passes) computes
  that op in `model_dtype` (bfloat16). XLA:CPU has no bfloat16 matmul kernels, so it
  upcasts dot operands (and the stacks, gathers and copies that feed them) to float32; a
  TPU or GPU compile keeps them in bfloat16, at half the bytes, or fuses them away.

  Returns:
    {'slots': [...], 'xla_cpu_f32_bytes': bytes of the slots whose largest value is such
    an artefact, 'top_slots_bytes': bytes of the listed slots}.
  """
  report = _newest(f"*{module}.cpu_after_optimizations-memory-usage-report.txt")
  assignment = _newest(f"*{module}.cpu_after_optimizations-buffer-assignment.txt")
  op_of, _ = _op_dtypes(_newest(f"*{module}.cpu_after_optimizations.txt"))
  _, program_dtypes = _op_dtypes(_newest(f"*{module}.before_optimizations.txt"))
  slots = []
  with open(report) as f:
    for line in f:  # the first table is the temporary allocation's; parameters' follow
      m = _SLOT.match(line)
      if m:
        slots.append({"bytes": 0, "offset": int(m.group(1)), "shapes": m.group(3).strip()})
      elif slots and not line.strip():
        break
  by_offset: dict[int, list] = {}
  in_temp = False
  with open(assignment) as f:
    for line in f:
      if line.startswith("allocation "):
        in_temp = "preallocated-temp" in line
      elif in_temp:
        m = _VALUE.search(line)
        if m:
          name, size, offset, dtype, dims = m.groups()
          by_offset.setdefault(int(offset), []).append((int(size), name, dtype, dims))
  out, cpu_bytes = [], 0
  for slot in slots:
    values = sorted(by_offset.get(slot["offset"], []), reverse=True)
    if not values:
      continue
    slot["bytes"] = values[0][0]
    size, name, dtype, dims = values[0]
    op = op_of.get(name, "")
    slot["xla_cpu_f32"] = (
      model_dtype == "bfloat16"
      and dtype == "f32"
      and (program_dtypes.get(op) == {"bf16"} or (not op and "convert" in name))
    )
    slot["values"] = [
      {"shape": f"{d}[{s}]", "op": op_of.get(n, n).replace("jit(train_step)/", "")}
      for _, n, d, s in values[:3]
    ]
    out.append(slot)
  out.sort(key=lambda x: -x["bytes"])
  out = out[:top]
  for slot in out:
    cpu_bytes += slot["bytes"] if slot["xla_cpu_f32"] else 0
    del slot["offset"]
  return {
    "slots": out,
    "xla_cpu_f32_bytes": cpu_bytes,
    "top_slots_bytes": sum(x["bytes"] for x in out),
  }


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def plan_train(cfg, model_cfg, mesh) -> dict:
  """Compiles the train step on one mini-batch of abstract arrays; returns its figures."""
  dp = sharding_lib.data_parallel_size(mesh)
  rows = cfg.train_rows // cfg.train.num_minibatches
  micro = cfg.train.micro_batch_size or rows
  micro_used = _round_up(micro, dp)
  train_cfg = dataclasses.replace(cfg.train, micro_batch_size=micro_used)
  train.check_batch_layout(cfg.train_rows, train_cfg, mesh)
  length = max(cfg.sampler.prompt_buckets) + cfg.sampler.max_new_tokens
  state = train.abstract_state(model_cfg, train_cfg, mesh)
  rows_sharding = sharding_lib.batch_sharding(mesh)
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows_sharding)
  batch = train.TrainBatch(
    tokens=sds((rows, length), jnp.int32),
    positions=sds((rows, length), jnp.int32),
    attention_mask=sds((rows, length), bool),
    loss_mask=sds((rows, length), bool),
    advantages=sds((rows,), jnp.float32),
    old_logprobs=sds((rows, length), jnp.float32),
  )
  start = time.perf_counter()
  compiled = train.make_train_step(model_cfg, train_cfg, mesh).lower(state, batch).compile()
  return {
    "mini_batch_rows": rows,
    "seq_len": length,
    "micro_batch_size": micro,
    "micro_used": micro_used,
    "rows_per_device_per_micro": micro_used // dp,
    "remat": cfg.train.remat,
    "params_gib": per_device_bytes(state.params) / GIB,
    "opt_state_gib": per_device_bytes(state.opt_state) / GIB,
    "xla": memory(compiled),
    "compile_s": time.perf_counter() - start,
    "largest_buffers": largest_buffers("jit_train_step", cfg.model.dtype),
  }


def plan_sampler(cfg, model_cfg, mesh) -> dict:
  """Compiles one segment of the rollout pool on abstract params and state; returns its
  figures."""
  dp = sharding_lib.data_parallel_size(mesh)
  s = cfg.sampler
  chunk = s.chunk_rows if s.chunk_rows % dp == 0 else _round_up(s.chunk_rows, dp)
  ppc = min(cfg.prompts_per_chunk, chunk)  # derived from chunk_rows when the config leaves it 0
  lp = max(s.prompt_buckets)
  params = jax.tree.map(
    lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
    model_lib.param_shapes(model_cfg),
    sharding_lib.param_shardings(model_cfg, mesh),
  )
  smp = sampler_lib.Sampler.from_spec(
    model_cfg,
    dataclasses.replace(s, chunk_rows=chunk),
    stop_ids=(0,),
    prompts_per_chunk=ppc,
    mesh=mesh,
  )
  init, empty, _, run = smp._compiled(lp)
  cache_len = lp + s.max_new_tokens
  kv = sharding_lib.kv_cache_shardings(model_cfg, mesh, chunk, cache_len)
  placed = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
  state = jax.eval_shape(init)
  state = state.replace(
    cache=state.cache.replace(
      k=tuple(map(placed, state.cache.k, kv.k)),
      v=tuple(map(placed, state.cache.v, kv.v)),
      mask=placed(state.cache.mask, kv.mask),
    )
  )
  q = smp.queue_rows
  queue = pool_lib.Queue(
    prompt=jax.ShapeDtypeStruct((q,), jnp.int32),
    position=jax.ShapeDtypeStruct((q,), jnp.int32),
    row_id=jax.ShapeDtypeStruct((q,), jnp.int32),
    count=jax.ShapeDtypeStruct((), jnp.int32),
    more=jax.ShapeDtypeStruct((), bool),
    cancel=jax.ShapeDtypeStruct((chunk,), bool),
  )
  key = jax.eval_shape(lambda: jax.random.key(0))
  start = time.perf_counter()
  pk = sharding_lib.kv_cache_shardings(model_cfg, mesh, smp.prompt_entries, lp)
  prompts = jax.eval_shape(empty)
  prompts = prompts.replace(
    k=tuple(map(placed, prompts.k, pk.k)),
    v=tuple(map(placed, prompts.v, pk.v)),
    mask=placed(prompts.mask, pk.mask),
  )
  compiled = run.lower(params, state, prompts, queue, key).compile()
  kv_shape = (chunk, model_cfg.num_kv_heads, cache_len, model_cfg.head_dim)
  kv_bytes = (
    2
    * model_cfg.num_layers
    * math.prod(kv.k[0].shard_shape(kv_shape))
    * jnp.dtype(model_cfg.compute_dtype).itemsize
  )
  prompt_bytes = (
    2
    * model_cfg.num_layers
    * math.prod(pk.k[0].shard_shape(prompts.k[0].shape))
    * jnp.dtype(model_cfg.compute_dtype).itemsize
  )
  return {
    "chunk_rows": s.chunk_rows,
    "chunk_used": chunk,
    "prompts_per_chunk": ppc,
    "prompt_cache_entries": smp.prompt_entries,
    "queue_rows": q,
    "prompt_len": lp,
    "max_new_tokens": s.max_new_tokens,
    "kv_cache_gib": kv_bytes / GIB,
    "prompt_cache_gib": prompt_bytes / GIB,
    "xla": memory(compiled),
    "compile_s": time.perf_counter() - start,
    "largest_buffers": largest_buffers("jit_run_segment", cfg.model.dtype),
  }


def plan(name: str, devices: int, programs: set[str]) -> dict:
  cfg = load_config(name, ARGS.set)
  model_cfg = model_of(cfg)
  mesh = sharding_lib.make_mesh(
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=jax.devices()[:devices]
  )
  row = {
    "config": name,
    "model": PRESET_OF_HF.get(cfg.model.hf_dir, cfg.model.preset),
    "dtype": cfg.model.dtype,
    "devices": devices,
    "mesh": dict(mesh.shape),
    "batch": {
      "prompts": cfg.rl.batch_prompts,
      "responses_per_prompt": cfg.ada.n,
      "rows": cfg.train_rows,
      "num_minibatches": cfg.train.num_minibatches,
    },
  }
  row["run_config"] = dataclasses.asdict(cfg)
  if "train" in programs:
    row["train"] = plan_train(cfg, model_cfg, mesh)
  if "sampler" in programs:
    row["sampler"] = plan_sampler(cfg, model_cfg, mesh)
  if "train" in row and "sampler" in row:
    # Between updates the optimizer state stays in HBM while the sampler runs.
    row["sampler"]["peak_with_opt_state_gib"] = (
      row["sampler"]["xla"]["peak"] + row["train"]["opt_state_gib"]
    )
  peaks = [row["train"]["xla"]["peak"]] if "train" in row else []
  if "sampler" in row:
    peaks.append(row["sampler"].get("peak_with_opt_state_gib", row["sampler"]["xla"]["peak"]))
  row["peak_gib"] = max(peaks)
  row["fits"] = {hw: row["peak_gib"] <= gib for hw, gib in HBM_GIB.items()}
  return row


def table(rows: list[dict]) -> str:
  head = (
    f"{'config':<16}{'dev':>4} {'mesh d/f/t':<11}{'micro':>6}{'params':>8}{'opt':>7}"
    f"{'train':>8}{'chunk':>6}{'kv':>7}{'sample':>8}{'peak':>7}  fits (GiB/device)"
  )
  lines = [head, "-" * len(head)]
  for r in rows:
    t, s = r.get("train", {}), r.get("sampler", {})
    mesh = "/".join(str(r["mesh"][a]) for a in ("data", "fsdp", "tensor"))
    fits = " ".join(hw for hw, ok in r["fits"].items() if ok) or "none"
    lines.append(
      f"{r['config']:<16}{r['devices']:>4} {mesh:<11}{t.get('micro_used', '-'):>6}"
      f"{t.get('params_gib', float('nan')):>8.2f}{t.get('opt_state_gib', float('nan')):>7.2f}"
      f"{t.get('xla', {}).get('peak', float('nan')):>8.2f}{s.get('chunk_used', '-'):>6}"
      f"{s.get('kv_cache_gib', float('nan')):>7.2f}"
      f"{s.get('peak_with_opt_state_gib', s.get('xla', {}).get('peak', float('nan'))):>8.2f}"
      f"{r['peak_gib']:>7.2f}  {fits}"
    )
  return "\n".join(lines)


def main() -> None:
  programs = set(ARGS.programs.split(","))
  rows = []
  start = time.perf_counter()
  for name in ARGS.configs.split(","):
    for devices in (int(d) for d in ARGS.devices.split(",")):
      rows.append(plan(name, devices, programs))
      print(
        f"[{time.perf_counter() - start:6.0f} s] {name} on {devices} devices: peak "
        f"{rows[-1]['peak_gib']:.2f} GiB/device",
        flush=True,
      )
  result = {
    "what": "per-device memory of the train step and a sampler chunk, XLA:CPU compiled "
    "memory analysis on abstract (unallocated) inputs; GiB = 2**30 bytes",
    "hbm_gib": HBM_GIB,
    "overrides": ARGS.set,
    "xla_flags": os.environ["XLA_FLAGS"],
    "git_commit": metrics_lib.git_commit(),
    "jax": jax.__version__,
    "host": platform.machine(),
    "wall_s": time.perf_counter() - start,
    "rows": rows,
  }
  print(table(rows))
  os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
  with open(ARGS.out, "w") as f:
    json.dump(
      result, f, indent=2, default=lambda x: x.item() if isinstance(x, np.generic) else str(x)
    )
    f.write("\n")
  print(f"wrote {ARGS.out}")
  shutil.rmtree(_DUMP_DIR, ignore_errors=True)


if __name__ == "__main__":
  main()
