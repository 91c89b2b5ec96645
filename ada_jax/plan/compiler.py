"""Ahead-of-time compiles of a run's device programs for a TPU slice or a GPU host, on a
machine with neither.

libtpu (the TPU compiler, on PyPI) compiles for a named topology without the chips
(`jax.experimental.topologies`, as MaxText's `train_compile.py`); the CUDA plugin
(`jax-cuda12-plugin`, with ptxas from `nvidia-cuda-nvcc-cu12`) does the same for GPUs
described by a `GpuTargetConfigProto` (`gpu_targets/*.txtpb`), as compile-only devices
"<slices>x<hosts>x<gpus per host>" (the targets and their devices: `targets`). Every input
here is a `jax.ShapeDtypeStruct` carrying its `NamedSharding` on a mesh over the target's
devices, so no weight is allocated, and XLA's buffer assignment says what each program
holds per device. XLA:TPU refuses a program that does not fit ("Ran out of memory on
HBM"); XLA:GPU never does, so the verdict compares its figures with the card's memory
times JAX's allocator fraction. `plan.py` turns these figures into a verdict;
`experiments/memory_plan.py` writes them for the shipped configs.

A run holds at once, per device: the train state (parameters, optimizer state and, with
a KL term, reference parameters) always, and one of these programs' working set:

* `train`: the train step on one mini-batch (its arguments are the train state);
* `sample`: one segment of the rollout pool (`pool.run_segment`): the rollout copy of the
  parameters (compute dtype, `Sampler.rollout_params`), the slot cache, the prompt cache
  and the decode loop's temporaries;
* `prefill`: the prompt prefill into the prompt cache, while the pool's slot cache is
  allocated;
* `eval`: one segment of the held-out evaluation's pool (the run's mesh, its budget);
* `decode_step`: one decode step of the rollout pool reading its whole cache, compiled
  alone for its HBM traffic (`decode_step_program`), not a phase of the run.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import tempfile
import types

import jax
import jax.numpy as jnp

from ada_jax import config as config_lib
from ada_jax.eval import sampling as eval_sampling
from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding as sharding_lib
from ada_jax.rl import train
from ada_jax.rollout import pool as pool_lib
from ada_jax.rollout import sampler as sampler_lib
from ada_jax.targets import GIB


def per_device_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded `ShapeDtypeStruct`s or arrays (the
  largest shard of each leaf)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shard = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
  return total


@dataclasses.dataclass
class Program:
  """One compiled program's per-device figures (bytes), from XLA's memory analysis.

  `peak = argument + output + temp - alias` (donated arguments alias their outputs).
  `largest` lists the largest temporary buffers of the TPU dump (bytes, shape, JAX op);
  `cost` is XLA's cost analysis (per device: 'flops', 'bytes accessed');
  `memory_spaces` the bytes the buffer assignment puts in each memory space ('default' is
  HBM; on TPU 'vmem' and, on v4, CMEM as 'hbm' hold prefetched blocks; empty where the
  compiler writes no report).
  """

  argument: int
  output: int
  alias: int
  temp: int
  largest: list[dict]
  cost: dict[str, float]
  memory_spaces: dict[str, int] = dataclasses.field(default_factory=dict)

  @property
  def peak(self) -> int:
    return self.argument + self.output + self.temp - self.alias

  def as_dict(self) -> dict:
    gib = lambda b: round(b / GIB, 4)
    return {
      "argument_gib": gib(self.argument),
      "output_gib": gib(self.output),
      "alias_gib": gib(self.alias),
      "temp_gib": gib(self.temp),
      "peak_gib": gib(self.peak),
      "largest_temps": self.largest,
      "flops": self.cost.get("flops"),
      "bytes_accessed": self.cost.get("bytes accessed"),
    }


class OutOfMemory(Exception):
  """XLA refused a program: its message (with the bytes it needed) is the argument;
  `needed` those bytes where the message states them (XLA:TPU: "the total memory required
  for HLO temporaries (39.12G) exceeds ..."), else None."""

  @property
  def needed(self) -> float | None:
    m = re.search(r"required[^(]*\((\d+(?:\.\d+)?)([KMGT])\)", str(self))
    return None if m is None else float(m.group(1)) * 1024 ** "KMGT".index(m.group(2)) * 1024


_SPACE = re.compile(r"^Memory Space: (\S+) \(color=\d+\)\nTotal bytes: (\d+)", re.M)


def memory_spaces(dump_dir: str) -> dict[str, int]:
  """Bytes per memory space of the one program dumped in `dump_dir` (its memory-usage
  report), e.g. {'default': ..., 'vmem': ...}."""
  reports = glob.glob(os.path.join(dump_dir, "*memory-usage-report.txt"))
  if not reports:
    return {}
  with open(reports[0]) as f:
    return {name: int(size) for name, size in _SPACE.findall(f.read())}


_ALLOC = re.compile(r"^allocation \d+: size (\d+), (.*)$")
_VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\w+\[[\d,]*\])")
_OP_NAME = re.compile(r'^\s*(?:ROOT )?%(\S+) = .*?op_name="([^"]*)"')


def largest_temps(dump_dir: str, top: int = 8) -> list[dict]:
  """The largest temporary allocations of the one program dumped in `dump_dir`, from its
  buffer assignment: bytes, the largest value's shape and the JAX op that made it."""
  assignment = glob.glob(os.path.join(dump_dir, "*after_optimizations-buffer-assignment.txt"))
  hlo = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
  if not assignment:
    return []
  op_of = {}
  for path in hlo[:1]:
    with open(path) as f:
      for line in f:
        m = _OP_NAME.match(line)
        if m:
          op_of[m.group(1)] = m.group(2)
  temps, current = [], None
  with open(assignment[0]) as f:
    for line in f:
      m = _ALLOC.match(line)
      if m:
        size, tags = int(m.group(1)), m.group(2)
        is_temp = not any(t in tags for t in ("parameter", "output", "live-out", "constant"))
        current = {"bytes": size, "values": []} if is_temp else None
        if current:
          temps.append(current)
      elif current is not None:
        v = _VALUE.search(line)
        if v:
          current["values"].append((int(v.group(2)), v.group(3), v.group(1)))
  out = []
  for t in sorted(temps, key=lambda t: -t["bytes"])[:top]:
    size, shape, name = max(t["values"], default=(0, "?", "?"))
    op = op_of.get(name, name)
    out.append({"bytes": t["bytes"], "shape": shape, "op": re.sub(r"^jit\([^)]*\)/", "", op)})
  return out


# Compiler options per platform. XLA:GPU's Triton gemm fusions need the autotuner, which
# needs a device ("Couldn't find output tile sizes"): compile-only devices use cuBLAS.
PLATFORM_OPTIONS = {"gpu": {"xla_gpu_enable_triton_gemm": False}}


def _platform(args) -> str:
  """The platform of the devices the arguments are placed on ('cpu' when none are)."""
  for leaf in jax.tree.leaves(args):
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      return next(iter(sharding.device_set)).platform
  return "cpu"


def _compile(fn, *args, what: str, options=None):
  options = {**PLATFORM_OPTIONS.get(_platform(args), {}), **(options or {})}
  try:
    return fn.lower(*args).compile(compiler_options=options)
  except Exception as e:  # XlaRuntimeError; its text carries the sizes
    text = str(e)
    if "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text:
      raise OutOfMemory(f"{what}: {text.splitlines()[0][:600]}") from None
    raise


def compile_program(fn, *args, what: str, options=None) -> Program:
  """`fn` (jitted) lowered on abstract `args` and compiled (with XLA `options`); its
  memory and cost analysis.

  Raises:
    OutOfMemory: XLA refused the program for lack of HBM (message names `what`).
  """
  with tempfile.TemporaryDirectory(prefix="aot_") as dump:
    compiled = _compile(fn, *args, what=what, options={**(options or {}), "xla_dump_to": dump})
    largest = largest_temps(dump)
    spaces = memory_spaces(dump)
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list):  # older jax: one dict per program
    cost = cost[0] if cost else {}
  return Program(
    argument=m.argument_size_in_bytes,
    output=m.output_size_in_bytes,
    alias=m.alias_size_in_bytes,
    temp=m.temp_size_in_bytes,
    largest=largest,
    cost={k: float(v) for k, v in cost.items() if k in ("flops", "bytes accessed")},
    memory_spaces=spaces,
  )


def _placed(tree, shardings):
  return jax.tree.map(
    lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings
  )


def abstract_outputs(fn, *args, what: str = "program"):
  """Shapes and shardings of a jitted `fn`'s outputs on abstract `args` (a cheap compile:
  XLA's choice of output shardings). Raises OutOfMemory as `compile_program`."""
  compiled = _compile(fn, *args, what=what)
  return _placed(jax.eval_shape(fn, *args), compiled.output_shardings)


def abstract_params(model_cfg: model_lib.ModelConfig, mesh) -> model_lib.Params:
  """The parameters as sharded `ShapeDtypeStruct`s (`sharding.param_shardings`)."""
  return _placed(model_lib.param_shapes(model_cfg), sharding_lib.param_shardings(model_cfg, mesh))


def rollout_params(model_cfg: model_lib.ModelConfig, mesh) -> model_lib.Params:
  """The samplers' rollout copy of the parameters (`Sampler.rollout_params`: fused, in the
  compute dtype, on `sharding.rollout_param_shardings`) as sharded `ShapeDtypeStruct`s."""
  shapes = jax.tree.map(
    lambda x: x.update(dtype=model_cfg.compute_dtype), model_lib.param_shapes(model_cfg, True)
  )
  return _placed(shapes, sharding_lib.rollout_param_shardings(model_cfg, mesh))


def train_program(cfg: config_lib.RunConfig, model_cfg, mesh) -> tuple[Program, dict]:
  """The train step on one mini-batch; (program, its resident state bytes and layout)."""
  with_ref = cfg.loss.kl_coeff > 0
  train.check_batch_layout(cfg.train_rows, cfg.train, mesh)
  state = train.abstract_state(model_cfg, cfg.train, mesh, with_ref=with_ref)
  rows = cfg.mini_batch_rows
  length = max(cfg.sampler.prompt_buckets) + cfg.sampler.max_new_tokens
  rows_sharding = sharding_lib.batch_sharding(mesh)
  sds = lambda dtype: jax.ShapeDtypeStruct((rows, length), dtype, sharding=rows_sharding)
  batch = train.TrainBatch(
    tokens=sds(jnp.int32),
    positions=sds(jnp.int32),
    attention_mask=sds(bool),
    loss_mask=sds(bool),
    advantages=jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=rows_sharding),
    old_logprobs=sds(jnp.float32),
  )
  step = train.make_train_step(model_cfg, cfg.train, mesh, with_ref=with_ref)
  program = compile_program(step, state, batch, what="train step")
  resident = {
    "params": per_device_bytes(state.params),
    "opt_state": per_device_bytes(state.opt_state),
    "ref_params": per_device_bytes(state.ref_params) if with_ref else 0,
    "mini_batch_rows": rows,
    "seq_len": length,
  }
  return program, resident


def rollout_sampler(
  cfg: config_lib.RunConfig, model_cfg, mesh, slots: int | None = None
) -> sampler_lib.Sampler:
  """The run's rollout sampler, built as `loop.train_run` builds it; at `slots` slots
  when given (`SamplerSpec.with_slots`)."""
  spec = cfg.sampler if slots is None else cfg.sampler.with_slots(slots)
  rows = cfg.min_rows_per_prompt
  return sampler_lib.Sampler.from_spec(
    model_cfg, spec, stop_ids=(0,), rows_per_prompt=rows, mesh=mesh
  )


def eval_sampler(
  cfg: config_lib.RunConfig, model_cfg, mesh, slots: int | None = None
) -> sampler_lib.Sampler:
  """The held-out evaluation's sampled (Avg@k) sampler on the run's mesh, as
  `loop.train_run` builds it (stop and pad ids do not change its memory); at `slots`
  slots when given."""
  ids = types.SimpleNamespace(eos_ids=(0,), pad_id=0)
  ev = cfg.eval
  if slots is not None:
    ev = dataclasses.replace(ev, sampler=ev.sampler.with_slots(slots))
  return eval_sampling.make_sampler(model_cfg, ids, ev, mesh=mesh)


def segment_args(smp: sampler_lib.Sampler, params, *, what: str = "pool"):
  """`smp`'s jitted pool functions at its largest prompt bucket and the abstract arguments
  of one segment: (programs, (params, state, prompt cache, queue, key)). Raises
  OutOfMemory when even the empty pool does not fit."""
  fns = smp.programs(max(smp.prompt_buckets))
  state = abstract_outputs(fns.init, what=f"{what} slot cache")
  prompts = abstract_outputs(fns.empty_prompts, what=f"{what} prompt cache")
  q, s = smp.queue_rows, smp.slots
  i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  queue = pool_lib.Queue(
    prompt=i32((q,)),
    position=i32((q,)),
    row_id=i32((q,)),
    count=i32(()),
    more=jax.ShapeDtypeStruct((), bool),
    cancel=jax.ShapeDtypeStruct((s,), bool),
  )
  key = jax.eval_shape(lambda: jax.random.key(0))
  return fns, (params, state, prompts, queue, key)


def pool_programs(smp: sampler_lib.Sampler, params, *, what: str) -> dict:
  """One segment and one prefill launch of `smp`'s pool at its largest prompt bucket, the
  per-device bytes of its slot and prompt caches, and the pool state's shapes (`state`)."""
  fns, args = segment_args(smp, params, what=what)
  _, state, prompts, _, _ = args
  lp, n = max(smp.prompt_buckets), smp.prompts_per_chunk
  i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  segment = compile_program(fns.run, *args, what=f"{what} segment")
  prefill = compile_program(
    fns.prefill,
    params,
    prompts,
    i32((n, lp)),
    jax.ShapeDtypeStruct((n, lp), bool),
    i32((n,)),
    what=f"{what} prefill",
  )
  return {
    "segment": segment,
    "prefill": prefill,
    "slot_cache": per_device_bytes((state.cache.prompt_k, state.cache.prompt_v))
    + per_device_bytes((state.cache.k, state.cache.v)),
    "pool_state": per_device_bytes(state),
    "prompt_cache": per_device_bytes(prompts),
    "state": state,
  }


# XLA:TPU's cost analysis counts an operand once per instruction that touches it, whatever
# memory holds it: a block its memory-space assignment prefetches into VMEM (v5e, v5p,
# v6e) or CMEM (v4) is counted on the copy in and again on each read from there, though
# HBM served it once (a 4-layer 3B decode loop on a v5e-8: 3.2x its weights and cache per
# step with the prefetches, 1.25x without). The roofline's programs are compiled with
# those prefetches off, so that every byte counted is an HBM byte.
HBM_ONLY = {
  "xla_tpu_cmem_memory_space_assignment": False,
  "xla_jf_vmem_memory_space_assignment": False,
  "xla_vf_vmem_memory_space_assignment": False,
  "xla_gf_vmem_memory_space_assignment": False,
}


def decode_step_program(smp: sampler_lib.Sampler, params, state) -> dict:
  """HBM bytes one step of `smp`'s decode loop reads and writes per device, from XLA's
  cost analysis: the roofline's worst case, every slot live and reading its whole cache.

  A while loop's body is counted once, so the loop is compiled twice, with one and with
  two steps per trip (`pool.draw_and_decode`, tokens fed back from the step's own logits:
  nothing is shared between the two steps), and the difference is one step, without what
  the compiler hoisted out of the loop or runs once around it. Compiled with the target's
  prefetches into on-chip memory off (`HBM_ONLY`).

  Args:
    smp: the sampler (its rule, stop ids, mesh, sizes).
    params: its abstract rollout copy.
    state: its abstract `PoolState` (`pool_programs`).

  Returns:
    {'bytes_accessed': per step per device, 'one_step', 'two_steps': the two programs'
    figures, 'memory_spaces': bytes by memory space of the two-step program}.
  """
  key = jax.eval_shape(lambda: jax.random.key(0))
  trips = jax.ShapeDtypeStruct((), jnp.int32)

  def loop(steps):
    def run(params, state, key, n):
      def body(_, s):
        for _ in range(steps):
          s = pool_lib.draw_and_decode(
            smp.config, params, s, key, rule=smp.rule, stop_ids=smp.stop_ids,
            attention_block=smp.max_new_tokens, mesh=smp.mesh,
          )  # fmt: skip
        return s

      return jax.lax.fori_loop(0, n, body, state)

    fn = jax.jit(run, donate_argnums=(1,))
    return compile_program(fn, params, state, key, trips, what="decode loop", options=HBM_ONLY)

  one, two = loop(1), loop(2)
  return {
    "bytes_accessed": two.cost["bytes accessed"] - one.cost["bytes accessed"],
    "one_step": one.as_dict(),
    "two_steps": two.as_dict(),
    "memory_spaces": two.memory_spaces,
  }


def shard_counts(mesh) -> dict[str, int]:
  """The mesh's axis sizes, e.g. {'data': 1, 'fsdp': 2, 'tensor': 4}."""
  return {k: int(v) for k, v in mesh.shape.items()}


def mesh_for(cfg: config_lib.RunConfig, devices) -> jax.sharding.Mesh:
  """The config's mesh over `devices`. Raises ValueError as `sharding.make_mesh`."""
  return sharding_lib.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
