"""Device facts for `accelerator_check.py`: per-chip peaks, and memory used vs planned.

`PEAKS` holds the vendor's per-chip figures (dense bf16, no sparsity) that MBU and MFU
divide by; `memory_record` sets a program's measured peak (`device.memory_stats()`)
beside XLA's compiled memory analysis of the same program.
"""

from __future__ import annotations

import jax

# Per chip: (substrings that must all be in device_kind.lower(), HBM bytes/s, dense bf16
# FLOP/s, source). The first match wins, so the more specific entries come first.
PEAKS = (
  (("h200",), 4.8e12, 989e12, "NVIDIA H200 datasheet (SXM): 4.8 TB/s, 989 TFLOPS bf16 dense"),
  (("h100", "pcie"), 2.0e12, 756e12, "NVIDIA H100 datasheet (PCIe): 2.0 TB/s, 756 TFLOPS"),
  (("h100",), 3.35e12, 989e12, "NVIDIA H100 datasheet (SXM): 3.35 TB/s, 989 TFLOPS bf16 dense"),
  (("a100", "40gb"), 1.555e12, 312e12, "NVIDIA A100 datasheet (40 GB): 1.555 TB/s, 312 TFLOPS"),
  (("a100",), 2.0e12, 312e12, "NVIDIA A100 datasheet (80 GB): 2.0 TB/s, 312 TFLOPS bf16"),
  (("v6 lite",), 1.64e12, 918e12, "Cloud TPU v6e documentation: 1,640 GB/s, 918 TFLOPS bf16"),
  (("v6e",), 1.64e12, 918e12, "Cloud TPU v6e documentation: 1,640 GB/s, 918 TFLOPS bf16"),
  (("v5 lite",), 819e9, 197e12, "Cloud TPU v5e documentation: 819 GB/s, 197 TFLOPS bf16"),
  (("v5e",), 819e9, 197e12, "Cloud TPU v5e documentation: 819 GB/s, 197 TFLOPS bf16"),
  (("v5",), 2.765e12, 459e12, "Cloud TPU v5p documentation: 2,765 GB/s, 459 TFLOPS bf16"),
  (("v4",), 1.2e12, 275e12, "Cloud TPU v4 documentation: 1,200 GB/s, 275 TFLOPS bf16"),
)


def peaks_of(kind: str, hbm_bytes_per_s: float = 0.0, bf16_flops: float = 0.0) -> dict:
  """The peak HBM bandwidth (bytes/s) and bf16 FLOP/s of one chip of `kind` (a
  `device.device_kind`), and their source; a non-zero argument overrides the table's
  figure. None where neither knows the chip (e.g. a CPU)."""
  out = {"hbm_bytes_per_s": None, "bf16_flops": None, "source": f"no entry for {kind!r}"}
  for needles, bw, flops, source in PEAKS:
    if all(n in kind.lower() for n in needles):
      out = {"hbm_bytes_per_s": bw, "bf16_flops": flops, "source": source}
      break
  if hbm_bytes_per_s:
    out.update(hbm_bytes_per_s=hbm_bytes_per_s, source="--peak_hbm_bytes_per_s")
  if bf16_flops:
    out["bf16_flops"] = bf16_flops
    out["source"] += "; --peak_bf16_flops"
  return out


def device_memory() -> dict | None:
  """`device.memory_stats()` of the first device, or None where the backend has none."""
  stats = jax.devices()[0].memory_stats()
  return dict(stats) if stats else None


def xla_memory(compiled) -> dict:
  """XLA's memory analysis of a compiled program, bytes; peak = args + temp + out - alias."""
  m = compiled.memory_analysis()
  out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
  out["peak"] = out["argument"] + out["temp"] + out["output"] - out["alias"]
  return out


def memory_record(
  program: str,
  before: dict | None,
  after: dict | None,
  predicted: dict | None,
  live_args: int,
  platform: str,
) -> dict:
  """The peak bytes in use while `program` ran, beside XLA's plan for it.

  `device.memory_stats()` keeps one high-water mark per process, with no reset, so the
  measured peak is this program's only where the mark rose while it ran (else null, with
  the reason). XLA's peak is turned into the same quantity: the bytes in use before the
  program, less its arguments that were already live (`live_args` bytes), plus XLA's
  peak (which counts the arguments).

  Args:
    program: its name in the table.
    before, after: `device_memory()` before and after the program (None on a CPU).
    predicted: `xla_memory` of the program, or None when it could not be had.
    live_args: bytes of the program's arguments already in use before it.
    platform: the device's platform, for the reason of a missing figure.
  """
  rec = {"program": program, "xla": predicted, "predicted_peak_bytes": None}
  if after is None or before is None:
    rec.update(measured_peak_bytes=None, reason=f"device.memory_stats() is None on {platform}")
  else:
    rose = after.get("peak_bytes_in_use", 0) > before.get("peak_bytes_in_use", 0)
    rec.update(
      bytes_in_use_before=before.get("bytes_in_use"),
      peak_bytes_in_use_after=after.get("peak_bytes_in_use"),
      bytes_limit=after.get("bytes_limit"),
      measured_peak_bytes=after.get("peak_bytes_in_use") if rose else None,
      reason=None if rose else "the high-water mark was set by an earlier program",
    )
    if predicted is not None:
      rec["predicted_peak_bytes"] = before.get("bytes_in_use", 0) - live_args + predicted["peak"]
  m, p = rec["measured_peak_bytes"], rec["predicted_peak_bytes"]
  rec["measured_over_predicted"] = m / p if m and p else None
  return rec
