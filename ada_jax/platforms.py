"""What differs between the compilers a program runs under, as properties of a platform:
the one place a platform's name (`jax.Device.platform`: 'tpu', 'gpu', 'cpu') is read.
Code that chooses a form by compiler asks a trait (`sharding.platform(mesh).decode_kernel`,
`Target.traits.refuses_oversize`), so a new platform is one entry of `PLATFORMS`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Platform:
  """One platform's traits.

  Attributes:
    name: `jax.Device.platform` ('tpu', 'gpu', 'cpu').
    compiler: the compiler's name in reports ('XLA:TPU').
    refuses_oversize: XLA refuses a program larger than the device's memory ("Ran out of
      memory on HBM": XLA:TPU); otherwise it compiles anything and a plan holds the
      program's figures against the memory JAX's allocator takes.
    decode_traffic: where the plan's decode roofline takes a step's bytes from: 'cost
      analysis' (the compiled loop's, XLA:TPU), 'optimized HLO' (summed op by op,
      `plan.hlo_walk`: XLA:GPU), '' (none: XLA:CPU, whose library calls no walk sees).
    cache_in_place_under_cond: a buffer passed through a `lax.cond` stays in place
      (XLA:TPU, XLA:CPU); XLA:GPU copies it into the branch (`slots.in_place_under_cond`).
    decode_kernel: the Pallas kernel decode attention runs as natively (`attention.KERNELS`:
      'tpu' the Mosaic TPU kernel `decode_kernel`, 'gpu' the Triton one
      `decode_kernel_gpu`), '' for XLA's form (the kernels then only in Pallas'
      interpreter).
    fused_layout: the rollout copy's fused projections (`decoder.fuse`, a
      `layers.made_layout` name): the MLP's `gate_up` 'gdf' `[2, D, F]` (XLA:TPU's tiles)
      or 'dgf' `[D, 2, F]` (what a cuBLAS gemm and XLA:CPU's dot read as it is; XLA:GPU
      and XLA:CPU re-lay `[2, D, F]` out in the decode loop, every layer and step); with
      '-dkgh' the attention's `qkv` `[D, K, G + 2, H]`, not `[K, G + 2, H, D]`, and o
      `[H, N, D]`, not `[N, H, D]` (`layers.fuse_qkv`: the orders XLA:CPU's dots read; from
      the others it re-laid both out at every layer of every decode step).
    shared_prompt: how XLA's form of decode attention reads a prompt its live rows share
      (`attention.slot_attention`): 'grouped', once per prompt-cache entry for all its rows
      (`shared_prompt.attend`: the bytes of a memory-bound step), or 'slot copy', each
      slot over its own copy of its row's prompt, made once when the row starts
      (`slots.copies_prompts`, `slots.admit`: S queries' score work, not P·R, and no
      per-step gather, where the step is bound by its arithmetic: XLA:CPU).
    key_axes: the KV caches' key axis order (`slots.cache_axes`) where it is not
      `slots.KV_AXES`, '' where it is. XLA:CPU: 'bkhs', the head dim before the columns,
      which its decode score dot reads as it lies; over `[.., S, H]` keys that dot ran
      4x slower (experiments/README.md, "Where the CPU's time goes").
    self_attention: the causal self-attention of training rows and prompts: '' XLA's
      blocked form (`layers.causal_attend`), 'splash' JAX's Pallas TPU splash-attention
      kernel (`flash`: the scores never in HBM, blocks above the diagonal skipped).
    compile_options: XLA options every ahead-of-time compile for it takes, (name, value).
    topology: `jax.experimental.topologies`' platform name for compile-only devices, or ''.
    packages: what to install for its compile-only devices, the compiler's own first.
  """

  name: str
  compiler: str
  refuses_oversize: bool = False
  decode_traffic: str = ""
  cache_in_place_under_cond: bool = True
  decode_kernel: str = ""
  fused_layout: str = "gdf"
  shared_prompt: str = "grouped"
  key_axes: str = ""
  self_attention: str = ""
  compile_options: tuple[tuple[str, object], ...] = ()
  topology: str = ""
  packages: tuple[str, ...] = ()

  @property
  def runs_mosaic(self) -> bool:
    """Pallas' Mosaic TPU kernels compile natively (XLA:TPU); elsewhere they run only in
    Pallas' interpreter (tests)."""
    return self.decode_kernel == "tpu"

  @property
  def cost_analysis(self) -> bool:
    """The compiled executable's cost analysis counts every byte a program moves (XLA:TPU,
    whose decode traffic comes from it); XLA:GPU gives none, and XLA:CPU's counts no
    library call."""
    return self.decode_traffic == "cost analysis"


PLATFORMS = {
  p.name: p
  for p in (
    Platform(
      "tpu",
      "XLA:TPU",
      refuses_oversize=True,
      decode_traffic="cost analysis",
      decode_kernel="tpu",
      self_attention="splash",
      topology="tpu",
      packages=("libtpu",),
    ),
    Platform(
      "gpu",
      "XLA:GPU",
      decode_traffic="optimized HLO",
      cache_in_place_under_cond=False,
      decode_kernel="gpu",
      fused_layout="dgf",
      # Triton gemm fusions need the autotuner, which needs a device ("Couldn't find output
      # tile sizes"): compile-only devices use cuBLAS.
      compile_options=(("xla_gpu_enable_triton_gemm", False),),
      topology="cuda",
      packages=("jax-cuda12-plugin", "nvidia-cuda-nvcc-cu12"),
    ),
    Platform("cpu", "XLA:CPU", fused_layout="dgf-dkgh", shared_prompt="slot copy", key_axes="bkhs"),
  )
}


def of(name: str) -> Platform:
  """The traits of platform `name`; an unknown one (a new backend) gets the traits that
  are right everywhere: XLA's forms, buffers copied into conditionals, no cost analysis."""
  return PLATFORMS.get(name) or Platform(
    name, f"XLA:{name.upper()}", cache_in_place_under_cond=False
  )
