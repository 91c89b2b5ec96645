"""A run's device programs, built as the run builds them on abstract inputs and compiled for
a target (`compiler.compile_program`): the model a config names (`model_of`), its mesh,
and the programs a run holds in device memory beside the train state:

* the train step on one mini-batch (`train_program`; its arguments are the train state);
* one segment and one prefill launch of the rollout pool (`pool_programs`): the rollout
  copy of the parameters (compute dtype, `Sampler.rollout_params`), the slot cache, the
  prompt cache and the decode loop's temporaries; the prefill runs while the slot cache is
  allocated;
* the same of the held-out evaluation's pool (the run's mesh, its budget);
* one decode step of the rollout pool reading its whole cache (`decode_step_program`),
  compiled alone for its HBM traffic, not a phase of the run.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types
from typing import Any

import jax
import jax.numpy as jnp

from ada_jax import config as config_lib
from ada_jax.eval import sampling as eval_sampling
from ada_jax.models import decoder as model_lib
from ada_jax.models import flash
from ada_jax.models import sharding as sharding_lib
from ada_jax.models.architecture import HUB_PRESETS
from ada_jax.plan import compiler, hlo_walk
from ada_jax.plan.compiler import Program
from ada_jax.plan.targets import gib
from ada_jax.rl import train
from ada_jax.rollout import pool as pool_lib
from ada_jax.rollout import sampler as sampler_lib


def model_of(cfg: config_lib.RunConfig) -> model_lib.ModelConfig:
  """The config's architecture: its preset, a known Hub id's preset
  (`architecture.HUB_PRESETS`: a plan reads no config.json and downloads nothing), or a
  local folder's config.json. Raises ValueError naming `config.model.hf_dir` otherwise."""
  spec = cfg.model
  if spec.preset:
    return spec.model_config()
  if spec.hf_dir in HUB_PRESETS:
    return dataclasses.replace(spec, preset=HUB_PRESETS[spec.hf_dir], hf_dir="").model_config()
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
    f"id ({', '.join(HUB_PRESETS)}); pass --config.model.hf_dir=FOLDER"
  )


def shard_counts(mesh) -> dict[str, int]:
  """The mesh's axis sizes, e.g. {'data': 1, 'fsdp': 2, 'tensor': 4}."""
  return {k: int(v) for k, v in mesh.shape.items()}


def mesh_for(cfg: config_lib.RunConfig, devices) -> jax.sharding.Mesh:
  """The config's mesh over `devices`. Raises ValueError as `sharding.make_mesh`."""
  return sharding_lib.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)


def abstract_params(model_cfg: model_lib.ModelConfig, mesh) -> model_lib.Params:
  """The parameters as sharded `ShapeDtypeStruct`s (`sharding.param_shardings`)."""
  shardings = sharding_lib.param_shardings(model_cfg, mesh)
  return compiler.placed(model_lib.param_shapes(model_cfg), shardings)


def rollout_params(model_cfg: model_lib.ModelConfig, mesh) -> model_lib.Params:
  """The samplers' rollout copy of the parameters (`Sampler.rollout_params`: fused, in the
  compute dtype, on `sharding.rollout_param_shardings`) as sharded `ShapeDtypeStruct`s."""
  shapes = jax.tree.map(
    lambda x: x.update(dtype=model_cfg.compute_dtype),
    model_lib.param_shapes(model_cfg, sharding_lib.platform(mesh).fused_layout),
  )
  return compiler.placed(shapes, sharding_lib.rollout_param_shardings(model_cfg, mesh))


@dataclasses.dataclass(frozen=True)
class TrainProgram:
  """The train step compiled on one mini-batch of `mini_batch_rows` rows of `seq_len`
  tokens (prompt bucket + response budget); `matmul_flops` its matrix multiplications per
  device, read from its optimized HLO (`hlo_walk.matmul_flops`: XLA:TPU's cost analysis
  counts each scan's body once), when it was kept and the walk could read it (else None)."""

  program: Program
  mini_batch_rows: int
  seq_len: int
  matmul_flops: int | None = None

  def figures(self) -> dict:
    """JSON-ready: the program's figures, the batch's shape and the matmul FLOPs per
    device and per row (a packed mini-batch's step costs its rows times that, plus the
    optimizer's few)."""
    rows = self.mini_batch_rows
    return self.program.as_dict() | {
      "mini_batch_rows": rows,
      "seq_len": self.seq_len,
      "matmul_flops": self.matmul_flops,
      "matmul_flops_per_row": None if self.matmul_flops is None else self.matmul_flops / rows,
    }


def train_program(
  cfg: config_lib.RunConfig, model_cfg, mesh, rows: int | None = None, keep_hlo: bool = False
) -> TrainProgram:
  """The train step on one mini-batch, compiled: of the mini-batch's own rows (the most a
  packed mini-batch takes: every sequence its own row, `packing.row_counts`) or `rows`
  packed ones; with `keep_hlo` its optimized HLO kept and its matmul FLOPs read. Raises
  `compiler.OutOfMemory` when the compiler refuses it, ValueError when the batch does not
  divide over the mesh."""
  with_ref = cfg.loss.kl_coeff > 0
  train.check_batch_layout(cfg.train_rows, cfg.train, mesh)
  state = train.abstract_state(model_cfg, cfg.train, mesh, with_ref=with_ref)
  rows = rows or cfg.mini_batch_rows
  length = max(cfg.sampler.prompt_buckets) + cfg.sampler.max_new_tokens
  rows_sharding = sharding_lib.batch_sharding(mesh)
  sds = lambda dtype: jax.ShapeDtypeStruct((rows, length), dtype, sharding=rows_sharding)
  batch = train.TrainBatch(
    tokens=sds(jnp.int32),
    positions=sds(jnp.int32),
    segments=sds(jnp.int32),
    loss_mask=sds(bool),
    advantages=sds(jnp.float32),
    old_logprobs=sds(jnp.float32),
  )
  step = train.make_train_step(model_cfg, cfg.train, mesh, with_ref=with_ref)
  program = compiler.compile_program(step, state, batch, what="train step", keep_hlo=keep_hlo)
  flops = None
  if keep_hlo:
    try:
      flops = hlo_walk.matmul_flops(program.hlo, flash.KERNEL_FLOPS)
    except ValueError as e:  # an extra figure: the program's verdict stands without it
      print(f"train step matmul FLOPs not counted: {e}", flush=True)
  return TrainProgram(program, rows, length, flops)


def rollout_sampler(
  cfg: config_lib.RunConfig, model_cfg, mesh, slots: int | None = None
) -> sampler_lib.Sampler:
  """The run's rollout sampler, built as `loop.train_run` builds it; at `slots` slots
  when given (`SamplerSpec.with_slots`)."""
  spec = cfg.sampler if slots is None else cfg.sampler.with_slots(slots)
  return sampler_lib.Sampler.from_spec(
    model_cfg,
    spec,
    stop_ids=(0,),
    rows_per_prompt=cfg.min_rows_per_prompt,
    max_rows_per_prompt=cfg.max_rows_per_prompt,
    mesh=mesh,
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


def prompt_cache(smp: sampler_lib.Sampler, *, what: str = "pool"):
  """`smp`'s abstract prompt cache at its largest prompt bucket."""
  fns = smp.programs(max(smp.prompt_buckets))
  return compiler.abstract_outputs(fns.empty_prompts, what=f"{what} prompt cache")


def segment_args(smp: sampler_lib.Sampler, params, *, what: str = "pool"):
  """`smp`'s jitted pool functions at its largest prompt bucket and the abstract arguments
  of one segment: (programs, (params, state, prompt cache, queue, key)). Raises
  OutOfMemory when even the empty pool does not fit."""
  fns = smp.programs(max(smp.prompt_buckets))
  state = compiler.abstract_outputs(fns.init, what=f"{what} slot cache")
  prompts = prompt_cache(smp, what=what)
  q, s = smp.queue_rows, smp.slots
  i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  queue = pool_lib.Queue(
    prompt=i32((q,)),
    position=i32((q,)),
    row_id=i32((q,)),
    count=i32(()),
    more=jax.ShapeDtypeStruct((), bool),
    wait=jax.ShapeDtypeStruct((), bool),
    cancel=jax.ShapeDtypeStruct((s,), bool),
  )
  key = jax.eval_shape(lambda: jax.random.key(0))
  return fns, (params, state, prompts, queue, key)


@dataclasses.dataclass(frozen=True)
class SlotFigures:
  """One slot pool compiled: its sampler, one segment and one prefill launch at its largest
  prompt bucket, and per device the bytes of its slot cache, its whole state and its
  prompt cache; `state` its abstract `SlotState` (for `decode_step_program`)."""

  sampler: sampler_lib.Sampler
  segment: Program
  prefill: Program
  slot_cache: int
  pool_state: int
  prompt_cache: int
  state: Any

  @property
  def kv_read(self) -> tuple[int, int]:
    """`live_kv(...)` of this pool: (unique live KV bytes, per-row KV bytes) per device."""
    return live_kv(self.sampler, self.slot_cache, self.prompt_cache)

  def segment_figures(self) -> dict:
    """JSON-ready: the segment's figures, its slots and caches (GiB)."""
    return self.segment.as_dict() | {
      "slots": self.sampler.slots,
      "kv_cache_gib": gib(self.slot_cache),
      "prompt_cache_gib": gib(self.prompt_cache),
      "temp_over_kv": round(self.segment.temp / self.slot_cache, 4),
    }

  def prefill_figures(self) -> dict:
    """JSON-ready: the prefill's figures, its prompts and the prompt cache they fill."""
    smp = self.sampler
    filled = self.prompt_cache * smp.prompts_per_chunk / smp.prompt_entries
    return self.prefill.as_dict() | {
      "prompts": smp.prompts_per_chunk,
      "prompt_cache_filled_gib": gib(filled),
    }


def live_kv(smp: sampler_lib.Sampler, slot_cache: int, prompt_cache: int) -> tuple[int, int]:
  """The KV bytes per device a decode step must read with every slot live, R rows per
  prompt (`Sampler.entry_rows`): (unique: every ring once and each live entry's prompt
  once, S / R of the P entries; per row: every slot's ring and its own copy of its prompt,
  what a pool of per-slot prompt columns read). `slot_cache`, `prompt_cache`: bytes per
  device of the rings and of the whole prompt cache."""
  s, r, p = smp.slots, smp.entry_rows, smp.prompt_entries
  live = min(p, -(-s // r))
  return slot_cache + prompt_cache * live // p, slot_cache + prompt_cache * s // p


def pool_programs(smp: sampler_lib.Sampler, params, *, what: str) -> SlotFigures:
  """One segment and one prefill launch of `smp`'s pool at its largest prompt bucket,
  compiled, with its caches' bytes. Raises `compiler.OutOfMemory` (naming `what`)."""
  fns, args = segment_args(smp, params, what=what)
  _, state, prompts, _, _ = args
  lp, n = max(smp.prompt_buckets), smp.prompts_per_chunk
  i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  segment = compiler.compile_program(fns.run, *args, what=f"{what} segment")
  prefill = compiler.compile_program(
    fns.prefill,
    params,
    prompts,
    i32((n, lp)),
    jax.ShapeDtypeStruct((n, lp), bool),
    i32((n,)),
    what=f"{what} prefill",
  )
  per_device = compiler.per_device_bytes
  return SlotFigures(
    sampler=smp,
    segment=segment,
    prefill=prefill,
    slot_cache=per_device((state.cache.k, state.cache.v)),
    pool_state=per_device(state),
    prompt_cache=per_device(prompts),
    state=state,
  )


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


@dataclasses.dataclass(frozen=True)
class DecodeStep:
  """The decode loop compiled for the roofline (`decode_step_program`): with one and with
  two steps per trip where the compiler has a cost analysis (their difference is one
  step's HBM bytes per device, `bytes_accessed`), or with one step per trip whose
  optimized HLO gives the step's bytes and kernels (`walk`, `hlo_walk.walk_loop`)."""

  one_step: Program
  two_steps: Program | None = None
  walk: hlo_walk.StepWalk | None = None

  @property
  def bytes_accessed(self) -> float:
    if self.walk is not None:
      return float(self.walk.bytes)
    return self.two_steps.cost["bytes accessed"] - self.one_step.cost["bytes accessed"]

  def figures(self) -> dict:
    """JSON-ready: the step's bytes, the programs' figures, the memory spaces of two
    steps or the walk of one."""
    out = {"bytes_accessed": self.bytes_accessed, "one_step": self.one_step.as_dict()}
    if self.two_steps is not None:
      out |= {"two_steps": self.two_steps.as_dict(), "memory_spaces": self.two_steps.memory_spaces}
    if self.walk is not None:
      out["walk"] = self.walk.as_json()
    return out


def decode_step_program(smp: sampler_lib.Sampler, params, state) -> DecodeStep:
  """HBM bytes one step of `smp`'s decode loop reads and writes per device: the roofline's
  worst case, every slot live and reading its whole cache; where they come from is the
  platform's `decode_traffic`.

  XLA:TPU's cost analysis counts a while loop's body once, so the loop is compiled twice,
  with one and with two steps per trip (`pool.draw_and_decode`, tokens fed back from the
  step's own logits: nothing is shared between the two steps), and the difference is one
  step, without what the compiler hoisted out of the loop or runs once around it; compiled
  with the prefetches into on-chip memory off (`HBM_ONLY`). XLA:GPU's optimized HLO of the
  loop with one step per trip is walked op by op (`hlo_walk.walk_loop`: bytes and kernels).

  Args:
    smp: the sampler (its rule, stop ids, mesh, sizes).
    params: its abstract rollout copy.
    state: its abstract `SlotState` (`SlotFigures.state`).

  Raises:
    compiler.OutOfMemory: the compiler refused a loop.
  """
  key = jax.eval_shape(lambda: jax.random.key(0))
  trips = jax.ShapeDtypeStruct((), jnp.int32)
  prompts = prompt_cache(smp)

  def loop(steps):
    def run(params, state, prompts, key, n):
      def body(_, s):
        for _ in range(steps):
          s = pool_lib.draw_and_decode(
            smp.config, params, s, prompts, key, rule=smp.rule, stop_ids=smp.stop_ids,
            attention_block=smp.max_new_tokens, entry_rows=smp.entry_rows, mesh=smp.mesh,
          )  # fmt: skip
        return s

      return jax.lax.fori_loop(0, n, body, state)

    fn = jax.jit(run, donate_argnums=(1,))
    options = None if walk else HBM_ONLY
    return compiler.compile_program(
      fn, params, state, prompts, key, trips, what="decode loop", options=options,
      keep_hlo=walk,
    )  # fmt: skip

  walk = sharding_lib.platform(smp.mesh).decode_traffic == "optimized HLO"
  if walk:
    one = loop(1)
    return DecodeStep(one, walk=hlo_walk.walk_loop(one.hlo))
  return DecodeStep(loop(1), loop(2))
