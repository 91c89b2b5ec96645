"""experiments/profile_cpu.py's reading of a `jax.profiler` trace: the ops of each compiled
program, a loop's or conditional's time counted once (in its ops), relayouts and dots
named, the host's share the window's time with no op running."""

import time

import jax
import jax.numpy as jnp

from ada_jax import testing


def test_a_trace_is_summed_per_program_with_loops_counted_once(tmp_path):
  profile_cpu = testing.load_experiment("profile_cpu")

  @jax.jit
  def looped(x, w):
    body = lambda i, x: jnp.tanh(x @ w.T)  # a dot whose right operand XLA:CPU re-lays out
    return jax.lax.fori_loop(0, 50, body, x)

  x, w = jnp.ones((64, 256)), jnp.ones((256, 256)) / 256
  jax.block_until_ready(looped(x, w))  # compiled outside the window
  jax.profiler.start_trace(str(tmp_path))
  start = time.perf_counter()
  jax.block_until_ready(looped(x, w))
  time.sleep(0.2)  # the host alone
  wall = time.perf_counter() - start
  jax.profiler.stop_trace()
  summary = profile_cpu.summarize(str(tmp_path), wall)
  program = summary["programs"]["looped"]
  assert program["dot_thunks"] >= 50  # one per trip
  assert program["thunks"] >= 100
  assert 0 < program["op_s"] < wall  # the while's own span is not added to its ops'
  assert summary["host_only_s"] >= 0.2
  assert "ynn_fusion" in program["top_op_kinds_s"] or "dot" in program["top_op_kinds_s"]
