"""The verdict: does a run's every phase fit the target, with `SPARE_GIB` to spare? `plan`
compiles the run's programs (`programs`), adds what stays resident beside each (the train
state while sampling, the slot cache while prefilling), holds each phase against the
memory a program may use (`Target.usable_gib`), sizes the slots (`search`) and derives
the decode roofline where the compiler can (`roofline`); `report` prints it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ada_jax import config as config_lib
from ada_jax.models import decoder as model_lib
from ada_jax.plan import compiler, programs, roofline, search, targets
from ada_jax.plan.compiler import OutOfMemory
from ada_jax.rl import train

# Head room a plan asks for beyond the compiler's figures (runtime buffers, fragmentation).
SPARE_GIB = 0.5


@dataclasses.dataclass(frozen=True)
class Phase:
  """One phase of the run: the bytes per device its program holds with what is resident
  beside it, or the compiler's refusal (`refused`), against `usable_gib`; the largest
  temporaries of its program (bytes, shape, op)."""

  bytes: int | None
  usable_gib: float
  refused: str = ""
  largest_temps: tuple[dict, ...] = ()

  @property
  def gib(self) -> float:
    return targets.gib(self.bytes)

  @property
  def spare_gib(self) -> float:
    return round(self.usable_gib - self.gib, 4)

  @property
  def fits(self) -> bool:
    return not self.refused and self.gib + SPARE_GIB <= self.usable_gib

  def as_json(self) -> dict:
    if self.refused:
      return {"refused": self.refused, "fits": False}
    return {"gib": self.gib, "spare_gib": self.spare_gib, "fits": self.fits}


@dataclasses.dataclass(frozen=True)
class SlotPhases:
  """A slot pool compiled at one slot count (`pool`) or refused (`refused`), and the bytes
  per device of each phase it is in, resident state included (none when refused)."""

  names: tuple[str, ...]
  pool: programs.SlotFigures | None
  refused: OutOfMemory | None = None
  bytes: dict[str, int] = dataclasses.field(default_factory=dict)

  @property
  def peak(self) -> float | None:
    """The largest phase's bytes, or what the refusal says was needed (None: unsaid)."""
    return max(self.bytes.values()) if self.bytes else self.refused.needed

  def phases(self, usable_gib: float) -> dict[str, Phase]:
    if self.pool is None:
      return {name: Phase(None, usable_gib, str(self.refused)) for name in self.names}
    program = lambda name: self.pool.prefill if name == "prefill" else self.pool.segment
    return {
      name: Phase(b, usable_gib, largest_temps=tuple(program(name).largest))
      for name, b in self.bytes.items()
    }


@dataclasses.dataclass(frozen=True)
class SlotCount:
  """The largest slot count of a pool that fits every phase with the spare (0: none),
  against the config's, its phases' peak bytes, and (rollout, on TPU and GPU) its roofline."""

  config: int
  largest: int
  bytes: float | None
  roofline: roofline.DecodeRoofline | None = None

  def as_json(self) -> dict:
    out = {"config": self.config, "largest": self.largest}
    if self.largest:
      out["gib"] = targets.gib(self.bytes)
    if self.roofline is not None:
      out["roofline"] = self.roofline.as_json()
    return out


@dataclasses.dataclass(frozen=True)
class Resident:
  """GiB per device resident through the run: the parameters and optimizer state, the
  samplers' rollout copy (sampling phases only), and the train state offloaded to host
  memory while sampling (`train.offload_state`; 0 when not)."""

  params: float
  opt_state: float
  rollout_copy: float
  offloaded_while_sampling: float

  @classmethod
  def of(cls, state, rollout_copy, offloaded: bool) -> Resident:
    """From the abstract train state and rollout copy (sharded `ShapeDtypeStruct`s)."""
    per_device = compiler.per_device_bytes
    return cls(
      params=targets.gib(per_device(state.params)),
      opt_state=targets.gib(per_device(state.opt_state)),
      rollout_copy=targets.gib(per_device(rollout_copy)),
      offloaded_while_sampling=targets.gib(per_device(state)) if offloaded else 0.0,
    )


@dataclasses.dataclass(frozen=True)
class Plan:
  """`plan`'s answer: the target, the memory a program may use (`usable_gib`; on a GPU at
  `mem_fraction`), the mesh, the model, what stays resident, each phase's verdict, each
  program's figures (`programs`: JSON-ready, for the report file), the roofline, the
  largest slot counts and notes. `fits` when every phase does."""

  target: targets.Target
  usable_gib: float
  mem_fraction: float | None
  device_kind: str
  mesh: dict[str, int]
  model: model_lib.ModelConfig
  resident: Resident
  phases: dict[str, Phase]
  programs: dict[str, dict]
  roofline: roofline.Roofline
  slots: dict[str, SlotCount]
  notes: tuple[str, ...]

  @property
  def fits(self) -> bool:
    return bool(self.phases) and all(p.fits for p in self.phases.values())

  def as_json(self) -> dict:
    """The plan as the JSON `python -m ada_jax.plan --json` writes."""
    return {
      "target": dataclasses.asdict(self.target)
      | {"usable_gib": round(self.usable_gib, 4), "mem_fraction": self.mem_fraction},
      "device_kind": self.device_kind,
      "mesh": self.mesh,
      "model": dataclasses.asdict(self.model),
      "resident_gib": dataclasses.asdict(self.resident),
      "phases": {name: p.as_json() for name, p in self.phases.items()},
      "programs": self.programs,
      "roofline": self.roofline.as_json(),
      "slots": {name: s.as_json() for name, s in self.slots.items()},
      "notes": list(self.notes),
      "fits": self.fits,
    }


@dataclasses.dataclass(frozen=True)
class Setting:
  """What every stage of a plan reads: the run config, its model, the target, the mesh
  over its devices, the abstract rollout copy, the usable memory and the progress line."""

  cfg: config_lib.RunConfig
  model_cfg: model_lib.ModelConfig
  target: targets.Target
  mesh: Any
  params: Any
  usable_gib: float
  progress: Callable[[str], None]

  @property
  def limit(self) -> int:
    """Bytes a phase may use: the usable memory less the spare."""
    return int((self.usable_gib - SPARE_GIB) * targets.GIB)

  def timed(self, name: str, fn):
    """`fn()` with a progress line; the compiler's refusal is returned, not raised."""
    start = time.perf_counter()
    try:
      out = fn()
    except OutOfMemory as e:
      self.progress(
        f"  {name}: refused by {self.target.compiler} ({time.perf_counter() - start:.0f} s)"
      )
      return e
    self.progress(f"  {name}: compiled ({time.perf_counter() - start:.0f} s)")
    return out


def train_phase(s: Setting) -> tuple[Phase, programs.TrainProgram | None]:
  """The train step's phase (its arguments are the train state) and program."""
  out = s.timed("train", lambda: programs.train_program(s.cfg, s.model_cfg, s.mesh, keep_hlo=True))
  if isinstance(out, OutOfMemory):
    return Phase(None, s.usable_gib, str(out)), None
  return Phase(out.program.peak, s.usable_gib, largest_temps=tuple(out.program.largest)), out


def rollout_phases(s: Setting, slots: int, beside: int, name: str = "sample") -> SlotPhases:
  """The rollout pool at `slots`: the sample phase (a segment) and the prefill phase (a
  launch while the pool state is allocated), each with `beside` resident bytes."""
  smp = programs.rollout_sampler(s.cfg, s.model_cfg, s.mesh, slots)
  pool = s.timed(name, lambda: programs.pool_programs(smp, s.params, what="rollout pool"))
  if isinstance(pool, OutOfMemory):
    return SlotPhases(("sample", "prefill"), None, pool)
  sample = pool.segment.peak + beside
  prefill = pool.prefill.peak + pool.pool_state + beside
  return SlotPhases(("sample", "prefill"), pool, bytes={"sample": sample, "prefill": prefill})


def eval_phase(s: Setting, slots: int, beside: int, name: str = "eval") -> SlotPhases:
  """The held-out evaluation's pool at `slots`, with the train state beside it."""
  ev = programs.eval_sampler(s.cfg, s.model_cfg, s.mesh, slots)
  pool = s.timed(name, lambda: programs.pool_programs(ev, s.params, what="evaluation pool"))
  if isinstance(pool, OutOfMemory):
    return SlotPhases(("eval",), None, pool)
  return SlotPhases(("eval",), pool, bytes={"eval": pool.segment.peak + beside})


def decode_step(s: Setting, pool: programs.SlotFigures) -> programs.DecodeStep | None:
  """One decode step of `pool` compiled for the roofline; None when refused."""
  step = s.timed(
    f"decode step at {pool.sampler.slots} slots (roofline)",
    lambda: programs.decode_step_program(pool.sampler, s.params, pool.state),
  )
  return None if isinstance(step, OutOfMemory) else step


def largest_slots(
  s: Setting, which: str, at_config: SlotPhases, compile_at
) -> tuple[SlotCount, SlotPhases | None]:
  """The largest slot count of the `which` pool ('rollout', 'eval') that fits (`search`),
  from its compile at the config's count and `compile_at(slots) -> SlotPhases`; and the
  pool compiled at that count (None when none fits)."""
  granule = search.slot_step(s.mesh)
  name = "rollout" if which == "rollout" else "evaluation"
  s.progress(f"  sizing the {name} slots (multiples of {granule})")
  config = s.cfg.sampler.chunk_rows if which == "rollout" else s.cfg.eval.sampler.chunk_rows
  tried = {config: at_config}

  def measure(n):
    tried[n] = compile_at(n)
    return tried[n].peak

  best, best_bytes = search.largest_fitting(measure, config, at_config.peak, granule, s.limit)
  return SlotCount(config, best, best_bytes), tried.get(best)


def sized_slots(s: Setting, rollout, step, evaluation, beside: int, resident: int) -> dict:
  """The largest rollout and (with benchmarks) evaluation slot counts that fit, from the
  pools compiled at the config's counts; where the compiler gives a step's bytes
  (`decode_traffic`), the decode roofline at the largest rollout count (`step`: the
  config's decode step, reused when that is the one)."""
  compile_at = lambda n: rollout_phases(s, n, beside, name=f"sample at {n} slots")
  out = {}
  out["rollout"], best = largest_slots(s, "rollout", rollout, compile_at)
  if best is not None and s.target.traits.decode_traffic:
    step_at = step if best is rollout and step else decode_step(s, best.pool)
    if step_at is not None:
      at = best.pool
      decode = roofline.decode_roofline(
        s.model_cfg, s.target, s.mesh, at.sampler.slots, at.kv_read, step_at
      )
      out["rollout"] = dataclasses.replace(out["rollout"], roofline=decode)
  if evaluation:
    compile_at = lambda n: eval_phase(s, n, resident, name=f"eval at {n} slots")
    out["eval"], _ = largest_slots(s, "eval", evaluation, compile_at)
  return out


def program_figures(train_prog, rollout: SlotPhases, step, evaluation) -> dict[str, dict]:
  """JSON-ready figures of every program compiled at the config's sizes."""
  out = {"train": train_prog.figures()} if train_prog else {}
  if rollout.pool:
    out["pool_segment"] = rollout.pool.segment_figures()
    out["prefill"] = rollout.pool.prefill_figures()
    if step:
      out["decode_step"] = step.figures()
  if evaluation and evaluation.pool:
    out["eval_segment"] = evaluation.pool.segment_figures()
  return out


def notes(s: Setting, resident: int, offloaded: bool, mem_fraction: float) -> tuple[str, ...]:
  """What a reader of the plan should know beside the figures."""
  t, out = s.target, []
  if s.cfg.rule.needs_features(s.cfg.ada):
    out.append(
      "est head: its features come from the rollout pool's own prefill (the prefill "
      "phase) and its parameters are D + 1 floats"
    )
  if offloaded:
    out.append(
      f"train.offload_state: the train state ({targets.gib(resident)} GiB per device) is in host "
      "memory during the sample and prefill phases, on the device in train and eval"
    )
  out.append(
    f"rollout copy: the samplers decode from a fused {s.model_cfg.dtype} copy of the params "
    "whole along 'fsdp' (split over 'tensor'), made once per RL step and evaluation (in "
    "the sample, prefill and eval phases' arguments) and freed before the train step"
  )
  out.append(
    f"shared-prompt decode: at most {s.cfg.max_rows_per_prompt} rows of one prompt decode at "
    f"once ({s.cfg.ada.method}'s most rows per prompt in flight, `Rule.max_rows`); their "
    "prompt is read once per step for all of them, and a slot holds only its response ring"
  )
  if not t.traits.refuses_oversize:
    out.append(
      f"{t.compiler} never refuses a program for its size: each phase is held against "
      f"{s.usable_gib:.2f} GiB, {mem_fraction} of the card's {t.hbm_gib} GiB (JAX's "
      "allocator fraction, XLA_PYTHON_CLIENT_MEM_FRACTION; --mem_fraction)"
    )
  return tuple(out)


def plan(
  cfg, target_name: str, *, devices=None, progress=print, mem_fraction=None, size_slots=True
) -> Plan:
  """Compiles the run's programs for the target and says whether each phase fits.

  Args:
    cfg: a parsed `config.RunConfig`.
    target_name: a TPU slice or GPU host of `targets.TARGETS` ('v5e-8', 'h100x8', ...).
    devices: the devices to compile for; None: the target's compile-only devices.
    progress: called with a line as each program compiles.
    mem_fraction: where the compiler compiles anything (a GPU), the fraction of the card's
      memory JAX's allocator takes (None: `targets.DEFAULT_MEM_FRACTION`, JAX's default).
    size_slots: also find the largest rollout and evaluation slot counts that fit (a few
      more compiles of the pools) and, where the compiler gives a step's bytes, the decode
      roofline there.

  Raises:
    ValueError: an unknown slice, a mesh or batch that does not divide over it, or an
      architecture `programs.model_of` cannot find (the field named).
    RuntimeError: the target's compiler (libtpu, the CUDA plugin) is missing.
  """
  t = targets.target(target_name)
  mem_fraction = targets.DEFAULT_MEM_FRACTION if mem_fraction is None else mem_fraction
  model_cfg = programs.model_of(cfg)
  devices = devices or targets.devices_for(t)
  mesh = programs.mesh_for(cfg, devices)
  params = programs.rollout_params(model_cfg, mesh)  # what every sampler decodes from
  s = Setting(cfg, model_cfg, t, mesh, params, t.usable_gib(mem_fraction), progress)
  # Resident beside every sampling program: the train state (the master params, the
  # optimizer state and a KL term's reference params); the train step holds it as its
  # arguments, and the rollout copy is freed before it (`rollout.engine.SlotEngine.finish`).
  state = train.abstract_state(model_cfg, cfg.train, mesh, with_ref=cfg.loss.kl_coeff > 0)
  resident = compiler.per_device_bytes(state)
  # `train.offload_state`: during a step's rollouts the state waits in host memory.
  offloaded = cfg.train.offload_state and model_cfg.dtype != model_cfg.param_dtype
  beside = 0 if offloaded else resident

  train_ph, train_prog = train_phase(s)
  rollout = rollout_phases(s, cfg.sampler.chunk_rows, beside)
  step = decode_step(s, rollout.pool) if t.traits.decode_traffic and rollout.pool else None
  evaluation = eval_phase(s, cfg.eval.sampler.chunk_rows, resident) if cfg.eval.benchmarks else None
  slots = sized_slots(s, rollout, step, evaluation, beside, resident) if size_slots else {}
  return Plan(
    target=t,
    usable_gib=s.usable_gib,
    mem_fraction=None if t.traits.refuses_oversize else mem_fraction,
    device_kind=devices[0].device_kind,
    mesh=programs.shard_counts(mesh),
    model=model_cfg,
    resident=Resident.of(state, params, offloaded),
    phases={"train": train_ph}
    | rollout.phases(s.usable_gib)
    | (evaluation.phases(s.usable_gib) if evaluation else {}),
    programs=program_figures(train_prog, rollout, step, evaluation),
    roofline=roofline.roofline(model_cfg, t, mesh, rollout.pool, step, train_prog),
    slots=slots,
    notes=notes(s, resident, offloaded, mem_fraction),
  )


def report(p: Plan) -> str:
  """The plan as a short table: one line per phase, then the largest temporaries of any
  phase that does not fit, the roofline and the largest slot counts."""
  t, r = p.target, p.resident
  memory = f"{t.hbm_gib} GiB HBM"
  if not t.traits.refuses_oversize:
    memory = f"{p.usable_gib:.2f} of {t.hbm_gib} GiB usable at --mem_fraction={p.mem_fraction}"
  lines = [
    f"{t.name} ({p.device_kind}, {t.devices} devices, {memory} each), mesh {p.mesh}; "
    f"resident: params {r.params} GiB, optimizer state {r.opt_state} GiB, rollout copy "
    f"{r.rollout_copy} GiB (sampling only) per device",
    f"{'phase':<10}{'GiB/device':>11}{'spare':>8}  verdict",
  ]
  for name, ph in p.phases.items():
    if ph.refused:
      lines.append(f"{name:<10}{'-':>11}{'-':>8}  REFUSED: {ph.refused[:300]}")
    else:
      verdict = "fits" if ph.fits else f"DOES NOT FIT (needs {SPARE_GIB} GiB spare)"
      lines.append(f"{name:<10}{ph.gib:>11.2f}{ph.spare_gib:>8.2f}  {verdict}")
  for name, ph in p.phases.items():
    if not ph.fits and ph.largest_temps:
      lines.append(f"largest temporaries of {name}:")
      for buf in ph.largest_temps[:5]:
        lines.append(f"  {buf['bytes'] / 2**30:8.3f} GiB  {buf['shape']}  {buf['op'][:80]}")
  if (d := p.roofline.decode) is not None:
    lines.append(
      f"roofline (compiler-derived): decode step HBM bytes / (weights + unique live KV) = "
      f"{d.decode_bytes_ratio} (per-row KV: {d.decode_bytes_ratio_per_row}), "
      f"<= {d.decode_tokens_per_s_per_chip:.0f} tokens/s/chip "
      f"at {d.hbm_gbs:.0f} GB/s and {d.slots} slots"
      + (f", {d.kernels_per_step} kernels per step" if d.kernels_per_step is not None else "")
    )
  for which, sized in p.slots.items():
    line = f"largest {which} slots that fit every phase with {SPARE_GIB} GiB spare: "
    line += f"{sized.largest} (config: {sized.config})"
    if sized.largest:
      line += f", {targets.gib(sized.bytes):.2f} GiB/device"
    if (f := sized.roofline) is not None:
      line += (
        f"; decode bytes / (weights + unique live KV) = {f.decode_bytes_ratio}, "
        f"<= {f.decode_tokens_per_s_per_chip:.0f} tokens/s/chip"
      )
    lines.append(line)
  lines.append("FITS" if p.fits else "DOES NOT FIT")
  return "\n".join(lines)
