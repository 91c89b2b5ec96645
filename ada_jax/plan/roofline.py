"""How many slots a slice holds and how fast it can decode them, from compiled programs:
the search for the largest slot count whose phases fit (`largest_fitting`, a line
through compiles) and the decode roofline (`roofline_figures`: the bytes of one decode
step by XLA:TPU's cost analysis, `aot.decode_step_program`, against the weights and KV
cache it must read, and the tokens/s per chip the slice's HBM bandwidth allows).
Compiler-derived figures, not measurements; `plan.py` reports them,
`experiments/decode_roofline.py` sweeps them.
"""

from __future__ import annotations

from ada_jax import aot
from ada_jax.models import sharding as sharding_lib
from ada_jax.rollout import decode_kernel


def largest_fitting(measure, start: int, start_bytes, step: int, limit: int, tries: int = 5):
  """The largest multiple of `step` slots whose phases fit in `limit` bytes, from the
  compiler: a phase's bytes are linear in the slots (caches, per-slot temporaries) to
  within a few buffers, so a line through two compiles predicts the count, a compile at
  the prediction checks it, and the search ends when a count fits and one step more does
  not (or after `tries` compiles, with the largest count that fitted).

  Args:
    measure: `measure(slots)` -> the largest phase's bytes per device (at least, when the
      compiler refused a program and said what it needed), or None (refused, unsaid).
    start: the config's slots; `start_bytes` its `measure` (None: refused).
    step: the granularity (data-parallel devices x the kernel's slot block).
    limit: bytes a phase may use (usable memory less the spare).

  Returns:
    (slots, bytes), or (0, None) when not even `step` slots fit.
  """
  known = {start: start_bytes}
  fits = lambda n: known.get(n) is not None and known[n] <= limit
  down = not fits(start)
  probe = max(step, start // 2 // step * step) if down else 2 * start
  for _ in range(tries):
    if probe in known or probe < step:
      break
    known[probe] = measure(probe)
    good = [n for n in known if fits(n)]
    best = max(good, default=0)
    if best and best + step in known and not fits(best + step):
      break  # the answer: it fits, one step more does not
    points = sorted((n, b) for n, b in known.items() if b is not None)
    over = [p for p in points if p[1] > limit]
    under = [p for p in points if p[1] <= limit]
    line = (under[-1:] + over[:1]) if under and over else points[-2:]
    if len(line) < 2 or line[1][0] == line[0][0] or line[1][1] <= line[0][1]:
      probe = (2 * max(known) if not over else min(n for n, _ in over) // 2) // step * step
      continue
    (n0, b0), (n1, b1) = line
    guess = n0 + (limit - b0) * (n1 - n0) / (b1 - b0)
    probe = max(step, int(guess + 1e-6) // step * step)
    if fits(probe):  # measured already and fits: is one step more over?
      probe += step
    while probe in known and not fits(probe) and probe - step > best:
      probe -= step
  good = [n for n in known if fits(n)]
  if not good:
    return 0, None
  best = max(good)
  return best, known[best]


def roofline(cfg, model_cfg, t, mesh, programs, smp, pool) -> dict:
  """Compiler-derived (not measured) HBM traffic of one decode step, on TPU
  (`roofline_figures` of the config's rollout pool), and the train step's FLOPs.

  The train step's FLOPs are not derived: XLA's cost analysis counts a while loop's body
  once (the micro-batch and block scans), so its figure is one body's, not the step's
  (`train_flops_per_loop_body`); `experiments/accelerator_check.py` measures MFU.
  """
  out = {"what": f"from {t.compiler}'s cost analysis of the compiled programs, not measured"}
  if t.platform != "tpu":
    # The compiled GPU executable has no cost analysis, and XLA:CPU's analysis of its HLO
    # counts no cuBLAS custom call (a 6 MB gemm counted 0 bytes): no figure beats a wrong one.
    out["what"] = f"not derived: {t.compiler} gives no cost analysis of a compiled program"
    return out
  step = programs.get("decode_step")
  if step and step.get("bytes_accessed"):
    out |= roofline_figures(model_cfg, t, mesh, smp, pool, step)
  train = programs.get("train")
  if train and train.get("flops"):
    out["train_flops_per_loop_body"] = train["flops"]
  return out


def roofline_figures(model_cfg, t, mesh, smp, pool, step) -> dict:
  """One decode step's HBM traffic per device against what it must read.

  `decode_bytes_per_device`: what XLA:TPU's cost analysis gives one step of the rollout
  pool's decode loop at S slots, every slot live and reading its whole cache
  (`aot.decode_step_program`: the loop compiled with one and two steps per trip, VMEM and
  CMEM prefetching off so that every byte counted is an HBM byte). `decode_bytes_ratio`
  holds it against what a step must read: the rollout copy's weights on the device (of an
  untied input embedding only the S rows looked up, not counted) and the slot cache. The
  tokens/s per chip are what the slice's peak HBM bandwidth allows at that traffic, S
  tokens a step.
  """
  copy = aot.rollout_params(model_cfg, mesh)  # the weights the decode step reads
  if not model_cfg.tie_embeddings:
    copy = {k: v for k, v in copy.items() if k != "embed"}
  weights = aot.per_device_bytes(copy)
  kv = pool["slot_cache"]
  seconds = step["bytes_accessed"] / (t.hbm_gbs * 1e9)
  return {
    "decode_bytes_per_device": step["bytes_accessed"],
    "decode_weight_bytes": weights,
    "decode_kv_bytes": kv,
    "decode_bytes_ratio": round(step["bytes_accessed"] / (weights + kv), 4),
    "decode_tokens_per_s_per_chip": round(smp.slots / seconds / t.devices, 1),
    "hbm_gbs": t.hbm_gbs,
    "slots": smp.slots,
  }


def slot_step(mesh) -> int:
  """The granularity of a slot count: the data-parallel devices times the decode kernel's
  block of slots (`rollout.decode_kernel`), so that every device's slots fill its blocks."""
  return sharding_lib.data_parallel_size(mesh) * decode_kernel.SLOT_BLOCK
