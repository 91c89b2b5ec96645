"""The decode roofline, compiler-derived (not measured): one decode step's HBM bytes per
device (`programs.decode_step_program`: XLA:TPU's cost analysis, or XLA:GPU's optimized HLO
walked op by op, `hlo_walk`, with its kernel launches) against the weights and KV cache it
must read, and the tokens/s per chip the target's HBM bandwidth allows at that traffic.
`verdict.plan` reports it; `experiments/decode_roofline.py` sweeps it.
"""

from __future__ import annotations

import dataclasses

from ada_jax.models import decoder as model_lib
from ada_jax.plan import compiler, programs
from ada_jax.plan.targets import Target


@dataclasses.dataclass(frozen=True)
class DecodeRoofline:
  """One decode step's HBM traffic per device against what it must read.

  Attributes:
    decode_bytes_per_device: one step of the rollout pool's decode loop at `slots` slots,
      every slot live and reading its whole cache (`programs.decode_step_program`: XLA:TPU's
      cost analysis with on-chip prefetching off, or XLA:GPU's HLO walked; every byte an
      HBM byte).
    decode_weight_bytes: the rollout copy's weights on the device (of an untied input
      embedding only the rows looked up, not counted).
    decode_kv_bytes: the unique live KV per device: every slot's ring and each live
      prompt once (`programs.live_kv`, R rows per prompt).
    decode_bytes_ratio: the first over the sum of the other two.
    decode_kv_bytes_per_row: every slot's ring and its own copy of its prompt (what a
      pool that read the prompt per row had to read).
    decode_bytes_ratio_per_row: the step's bytes over weights + that.
    decode_tokens_per_s_per_chip: what the chip's peak HBM bandwidth allows at that
      traffic, `slots` tokens a step.
    hbm_gbs: that bandwidth, GB/s.
    slots: the slots of the step.
    kernels_per_step: kernel launches of one step (XLA:GPU's walk; None from a cost
      analysis).
    conditionals_per_step: conditionals of one step (likewise).
  """

  decode_bytes_per_device: float
  decode_weight_bytes: int
  decode_kv_bytes: int
  decode_bytes_ratio: float
  decode_kv_bytes_per_row: int
  decode_bytes_ratio_per_row: float
  decode_tokens_per_s_per_chip: float
  hbm_gbs: float
  slots: int
  kernels_per_step: int | None = None
  conditionals_per_step: int | None = None

  def as_json(self) -> dict:
    """The fields, those a cost analysis leaves None left out."""
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def decode_roofline(
  model_cfg: model_lib.ModelConfig, t: Target, mesh, slots: int, kv_bytes: tuple[int, int], step
) -> DecodeRoofline:
  """The roofline on target `t` of a decode `step` (`programs.DecodeStep`) at `slots`
  slots whose caches hold `kv_bytes` per device (`programs.live_kv`: unique, per row)."""
  copy = programs.rollout_params(model_cfg, mesh)  # the weights the decode step reads
  if not model_cfg.tie_embeddings:
    copy = {k: v for k, v in copy.items() if k != "embed"}
  weights = compiler.per_device_bytes(copy)
  seconds = step.bytes_accessed / (t.hbm_gbs * 1e9)
  walk = step.walk
  return DecodeRoofline(
    decode_bytes_per_device=step.bytes_accessed,
    decode_weight_bytes=weights,
    decode_kv_bytes=kv_bytes[0],
    decode_bytes_ratio=round(step.bytes_accessed / (weights + kv_bytes[0]), 4),
    decode_kv_bytes_per_row=kv_bytes[1],
    decode_bytes_ratio_per_row=round(step.bytes_accessed / (weights + kv_bytes[1]), 4),
    decode_tokens_per_s_per_chip=round(slots / seconds / t.devices, 1),
    hbm_gbs=t.hbm_gbs,
    slots=slots,
    kernels_per_step=walk and walk.kernels,
    conditionals_per_step=walk and walk.conditionals,
  )


@dataclasses.dataclass(frozen=True)
class Roofline:
  """What the compiler says of the run's traffic: `what` (where the figures come from or
  why there are none), the config's decode roofline, and one loop body's FLOPs of the
  train step (XLA's cost analysis counts a while loop's body once, so this is not the
  step's; `experiments/accelerator_check.py` measures MFU)."""

  what: str
  decode: DecodeRoofline | None = None
  train_flops_per_loop_body: float | None = None

  def as_json(self) -> dict:
    out = {"what": self.what}
    if self.decode is not None:
      out |= self.decode.as_json()
    if self.train_flops_per_loop_body:
      out["train_flops_per_loop_body"] = self.train_flops_per_loop_body
    return out


def roofline(model_cfg, t: Target, mesh, pool, step, train) -> Roofline:
  """The run's `Roofline` on `t`: from the compiled rollout `pool`, its decode `step`
  (`programs.DecodeStep` or None) and the `train` program (`programs.TrainProgram` or
  None); the decode step's bytes as the platform derives them (`decode_traffic`: XLA:TPU's
  cost analysis, XLA:GPU's optimized HLO walked), none on XLA:CPU, whose analysis counts no
  library call (no figure beats a wrong one)."""
  if not t.traits.decode_traffic:
    return Roofline(f"not derived: {t.compiler} gives no cost analysis of a compiled program")
  decode = None
  if step is not None and pool is not None and step.bytes_accessed:
    decode = decode_roofline(model_cfg, t, mesh, pool.sampler.slots, pool.kv_read, step)
  flops = train.program.cost.get("flops") if train is not None and t.traits.cost_analysis else None
  source = f"{t.compiler}'s {t.traits.decode_traffic} of the compiled programs"
  if t.traits.decode_traffic != "cost analysis":
    source += " (the decode step's bytes summed op by op, and its kernels)"
  return Roofline(f"from {source}, not measured", decode, flops)
