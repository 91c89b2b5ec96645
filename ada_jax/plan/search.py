"""The slot search: the largest slot count whose phases fit a target's memory, found by a
line through compiles (`largest_fitting`), in multiples of `slot_step`.
"""

from __future__ import annotations

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


def slot_step(mesh) -> int:
  """The granularity of a slot count: the data-parallel devices times the decode kernel's
  block of slots (`rollout.decode_kernel`), so that every device's slots fill its blocks."""
  return sharding_lib.data_parallel_size(mesh) * decode_kernel.SLOT_BLOCK
