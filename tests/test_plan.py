"""The plan's pure parts: a sampler group at another slot count, and the search for the
largest slot count that fits (`plan.search.largest_fitting`) on made-up byte counts."""

import hypothesis
import pytest
from hypothesis import strategies as st

from ada_jax.plan import search
from ada_jax.rollout.spec import SamplerSpec


def test_with_slots_scales_what_the_config_sets_and_keeps_derived_sizes_derived():
  spec = SamplerSpec(chunk_rows=192, queue_rows=192, prompts_per_chunk=48)
  assert spec.with_slots(384) == SamplerSpec(chunk_rows=384, queue_rows=384, prompts_per_chunk=96)
  derived = SamplerSpec(chunk_rows=64).with_slots(256)
  assert (derived.chunk_rows, derived.queue_rows, derived.prompts_per_chunk) == (256, 0, 0)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
  base=st.integers(0, 10**9),
  per_slot=st.integers(10**5, 10**8),
  wobble=st.integers(0, 10**6),
  start=st.sampled_from([16, 64, 192, 1024]),
  limit=st.integers(10**8, 4 * 10**10),
)
def test_largest_fitting_finds_the_largest_multiple_that_fits(base, per_slot, wobble, start, limit):
  """Bytes linear in the slots plus a wobble of a few buffers (a step function of the
  count, as buffer sizes round): the answer fits, the next multiple does not (or the
  search says why not), in a handful of compiles."""
  step = 16
  measure_calls = []

  def measure(slots):
    measure_calls.append(slots)
    return base + per_slot * slots + wobble * (slots // 64 % 3)

  best, best_bytes = search.largest_fitting(measure, start, measure(start), step, limit)
  measure_calls.pop(0)
  assert len(measure_calls) <= 5
  if best == 0:
    assert measure(step) > limit
    return
  assert best % step == 0 and best_bytes == measure(best) <= limit
  over = measure(best + step) > limit
  assert over


def test_largest_fitting_when_the_compiler_refuses():
  """A refused program (None) counts as not fitting: the count comes down to one that
  compiles."""

  def measure(slots):
    return None if slots > 100 else 10 * slots

  assert search.largest_fitting(measure, 192, None, 16, 10**6) == (96, 960)
  assert search.largest_fitting(lambda s: None, 192, None, 16, 10**6) == (0, None)


@pytest.mark.parametrize("start", [32, 48])
def test_largest_fitting_from_a_config_that_already_fits(start):
  measure = lambda slots: 1000 + 10 * slots
  assert search.largest_fitting(measure, start, measure(start), 16, 1000 + 10 * 400) == (
    400,
    5000,
  )
