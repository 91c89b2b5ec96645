"""Device facts for `accelerator_check.py`: per-chip peaks, and memory used vs planned.

`peaks_of` reads the vendor's per-chip figures (dense bf16, no sparsity) that MBU and MFU
divide by from `ada_jax.plan.targets.CHIPS`, the table the plans use too; `memory_record` sets a
program's measured peak (`device.memory_stats()`) beside XLA's compiled memory analysis of
the same program.
"""

from __future__ import annotations

import jax

from ada_jax.plan import targets


def peaks_of(kind: str, hbm_bytes_per_s: float = 0.0, bf16_flops: float = 0.0) -> dict:
  """The peak HBM bandwidth (bytes/s) and bf16 FLOP/s of one chip of `kind` (a
  `device.device_kind`), and their source; a non-zero argument overrides the table's
  figure. None where neither knows the chip (e.g. a CPU)."""
  out = {"hbm_bytes_per_s": None, "bf16_flops": None, "source": f"no entry for {kind!r}"}
  if (chip := targets.chip_of(kind)) is not None:
    out = {
      "hbm_bytes_per_s": chip.hbm_gbs * 1e9,
      "bf16_flops": chip.peak_tflops * 1e12,
      "source": chip.source,
    }
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
