"""The accelerators a run can be planned for: TPU slices and GPU hosts as users name them
(`TARGETS`), their vendor figures (memory, bandwidth, peak FLOP/s) and their compile-only
devices (`devices_for`), on which `plan.compiler` compiles a run's programs without the
hardware. What differs between their compilers is `Target.traits` (`ada_jax.platforms`).
"""

from __future__ import annotations

import dataclasses
import pathlib

from ada_jax import platforms

GIB = 2**30


def gib(nbytes: float) -> float:
  """Bytes as GiB, rounded to 4 decimals as every plan figure is."""
  return round(nbytes / GIB, 4)


@dataclasses.dataclass(frozen=True)
class Target:
  """A TPU slice or a GPU host (or hosts) as users name it.

  Attributes:
    name: e.g. 'v5e-8', 'h100x8' (one host of 8), 'h200x16' (2 hosts of 8).
    topology: `topologies.get_topology_desc`'s name for it: 'v5e:2x4'; for GPUs
      '<slices>x<hosts>x<gpus per host>', e.g. '1x2x8'.
    chip_config: a TPU's `chip_config_name` ('megacore' for v4: one device per chip), or ''.
    devices: JAX devices of the target.
    hbm_gib: memory per device (GiB): for a TPU what XLA:TPU lets a program use, as its
      out-of-memory message states it (libtpu 0.0.42); for a GPU the card's whole memory
      (`usable_gib` applies JAX's allocator fraction).
    hbm_gbs: peak HBM bandwidth per chip, GB/s (the vendor's figure).
    peak_tflops: peak dense bf16 TFLOP/s per chip (the vendor's figure).
    platform: 'tpu' or 'gpu' (as `jax.Device.platform` names them).
    spec: a GPU's `GpuTargetConfigProto` file in `ada_jax/gpu_targets/`, or ''.
  """

  name: str
  topology: str
  chip_config: str
  devices: int
  hbm_gib: float
  hbm_gbs: float
  peak_tflops: float
  platform: str = "tpu"
  spec: str = ""

  @property
  def traits(self) -> platforms.Platform:
    return platforms.of(self.platform)

  @property
  def compiler(self) -> str:
    return self.traits.compiler

  def usable_gib(self, mem_fraction: float) -> float:
    """Memory a run's programs may use per device: `hbm_gib` where the compiler refuses
    what does not fit (a TPU); else (a GPU) times the fraction JAX's allocator takes
    (`XLA_PYTHON_CLIENT_MEM_FRACTION`, default 0.75)."""
    return self.hbm_gib if self.traits.refuses_oversize else self.hbm_gib * mem_fraction


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip's vendor figures, the one table that plans (`Target`) and the
  measured accelerator check (experiments/accelerator_peaks.py) divide by.

  Attributes:
    kinds: a chip matches a `jax.Device.device_kind` when every substring of one of these
      tuples is in its lower case ('TPU v5 lite', 'NVIDIA H100 80GB HBM3').
    hbm_gbs: peak HBM bandwidth, GB/s.
    peak_tflops: peak dense bf16 TFLOP/s (no sparsity).
    source: where the figures come from.
  """

  kinds: tuple[tuple[str, ...], ...]
  hbm_gbs: float
  peak_tflops: float
  source: str


# The first match wins, so the more specific entries come first.
CHIPS = {
  "h200": Chip(
    (("h200",),), 4800.0, 989.0, "NVIDIA H200 datasheet (SXM): 4.8 TB/s, 989 TFLOPS bf16 dense"
  ),
  "h100_pcie": Chip(
    (("h100", "pcie"),), 2000.0, 756.0, "NVIDIA H100 datasheet (PCIe): 2.0 TB/s, 756 TFLOPS"
  ),
  # 3,352 GB/s: the datasheet's 3.35 TB/s as the XLA:GPU description (gpu_targets/) says.
  "h100": Chip(
    (("h100",),), 3352.0, 989.0, "NVIDIA H100 datasheet (SXM): 3.35 TB/s, 989 TFLOPS bf16 dense"
  ),
  "a100_40gb": Chip(
    (("a100", "40gb"),), 1555.0, 312.0, "NVIDIA A100 datasheet (40 GB): 1.555 TB/s, 312 TFLOPS"
  ),
  "a100": Chip(
    (("a100",),), 2000.0, 312.0, "NVIDIA A100 datasheet (80 GB): 2.0 TB/s, 312 TFLOPS bf16"
  ),
  "v6e": Chip(
    (("v6 lite",), ("v6e",)),
    1640.0,
    918.0,
    "Cloud TPU v6e documentation: 1,640 GB/s, 918 TFLOPS bf16",
  ),
  "v5e": Chip(
    (("v5 lite",), ("v5e",)), 819.0, 197.0, "Cloud TPU v5e documentation: 819 GB/s, 197 TFLOPS bf16"
  ),
  "v5p": Chip(
    (("v5",),), 2765.0, 459.0, "Cloud TPU v5p documentation: 2,765 GB/s, 459 TFLOPS bf16"
  ),
  "v4": Chip((("v4",),), 1200.0, 275.0, "Cloud TPU v4 documentation: 1,200 GB/s, 275 TFLOPS bf16"),
}


def chip_of(device_kind: str) -> Chip | None:
  """The `CHIPS` entry of a `jax.Device.device_kind`, or None (a CPU, an unknown chip)."""
  kind = device_kind.lower()
  return next((c for c in CHIPS.values() if any(all(n in kind for n in k) for k in c.kinds)), None)


# The GPUs' `GpuTargetConfigProto` descriptions.
GPU_TARGETS = pathlib.Path(__file__).resolve().parent.parent / "gpu_targets"
# JAX's GPU allocator takes this fraction of the card's memory unless told otherwise.
DEFAULT_MEM_FRACTION = 0.75
# (chip, spec file, bytes of memory as the spec states it).
_GPUS = (("h100", "h100_sxm.txtpb", 84942979072), ("h200", "h200.txtpb", 151397597184))


def _tpu(name: str, topology: str, chip_config: str, devices: int, hbm_gib: float) -> Target:
  c = CHIPS[name.split("-")[0]]
  return Target(name, topology, chip_config, devices, hbm_gib, c.hbm_gbs, c.peak_tflops)


TARGETS = {
  t.name: t
  for t in (
    _tpu("v5e-8", "v5e:2x4", "", 8, 15.75),
    _tpu("v4-8", "v4:2x2x1", "megacore", 4, 30.75),
    _tpu("v4-32", "v4:2x2x4", "megacore", 16, 30.75),
    _tpu("v5p-8", "v5p:2x2x1", "", 4, 95.74),
    _tpu("v6e-8", "v6e:2x4", "", 8, 31.25),
    *(
      Target(
        f"{gpu}x{hosts * per_host}",
        f"1x{hosts}x{per_host}",
        "",
        hosts * per_host,
        round(memory / GIB, 2),
        CHIPS[gpu].hbm_gbs,
        CHIPS[gpu].peak_tflops,
        platform="gpu",
        spec=spec,
      )  # fmt: skip
      for gpu, spec, memory in _GPUS
      for hosts, per_host in ((1, 1), (1, 8), (2, 8))
    ),
  )
}


def target(name: str) -> Target:
  """The `TARGETS` entry `name`. Raises ValueError naming the known targets."""
  if name not in TARGETS:
    raise ValueError(f"unknown TPU slice or GPU host {name!r}; known: {', '.join(TARGETS)}")
  return TARGETS[name]


def devices_for(t: Target) -> list:
  """The target's compile-only devices, for ahead-of-time compiles with no accelerator:
  libtpu's for a TPU slice, the CUDA plugin's (from the card's `gpu_targets/` file) for a
  GPU host. Run with `JAX_PLATFORMS=cpu`: the plugin then compiles without looking for a
  GPU.

  Raises:
    RuntimeError: the target's compiler is not installed (`pip install -r
      requirements-dev.txt` pins both).
  """
  from jax.experimental import topologies

  kwargs = {"platform": t.traits.topology}
  if t.spec:  # a GPU: its description, and the topology as '<slices>x<hosts>x<gpus>'
    spec = (GPU_TARGETS / t.spec).read_text()
    kwargs |= {"target_config": spec, "topology": t.topology}
  else:
    kwargs["topology_name"] = t.topology
    if t.chip_config:
      kwargs["chip_config_name"] = t.chip_config
  package = " and ".join(t.traits.packages)
  try:
    topo = topologies.get_topology_desc(**kwargs)
  except Exception as e:  # jax raises several kinds when the plugin is missing
    raise RuntimeError(
      f"no {t.compiler} compiler for {t.name}: {type(e).__name__}: {str(e)[:300]}; install "
      f"{package} (requirements-dev.txt pins them)"
    ) from None
  if len(topo.devices) != t.devices:
    raise RuntimeError(
      f"{t.name}: expected {t.devices} devices, {package} gives {len(topo.devices)}"
    )
  return list(topo.devices)
