"""The compiler, ahead of time: a jitted function lowered on abstract, sharded inputs
(`jax.ShapeDtypeStruct`s on a mesh over a target's compile-only devices, `plan.targets`)
and compiled by the target's own XLA with no weight allocated; what XLA's memory and cost
analyses and its buffer-assignment dump say about the program (`Program`), and its refusal
when a program does not fit (`OutOfMemory`: XLA:TPU refuses, XLA:GPU never does).
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import pathlib
import re
import tempfile

import jax
import jax.numpy as jnp

from ada_jax import platforms
from ada_jax.plan.targets import gib


def per_device_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded `ShapeDtypeStruct`s or arrays (the
  largest shard of each leaf)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shard = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
  return total


@dataclasses.dataclass
class Program:
  """One compiled program's per-device figures (bytes), from XLA's memory analysis.

  `peak = argument + output + temp - alias` (donated arguments alias their outputs).
  `largest` lists the largest temporary buffers of the TPU dump (bytes, shape, JAX op);
  `cost` is XLA's cost analysis (per device: 'flops', 'bytes accessed');
  `memory_spaces` the bytes the buffer assignment puts in each memory space ('default' is
  HBM; on TPU 'vmem' and, on v4, CMEM as 'hbm' hold prefetched blocks; empty where the
  compiler writes no report); `hlo` the optimized HLO's text when asked for
  (`compile_program(keep_hlo=True)`), else ''.
  """

  argument: int
  output: int
  alias: int
  temp: int
  largest: list[dict]
  cost: dict[str, float]
  memory_spaces: dict[str, int] = dataclasses.field(default_factory=dict)
  hlo: str = dataclasses.field(default="", repr=False)

  @property
  def peak(self) -> int:
    return self.argument + self.output + self.temp - self.alias

  def as_dict(self) -> dict:
    return {
      "argument_gib": gib(self.argument),
      "output_gib": gib(self.output),
      "alias_gib": gib(self.alias),
      "temp_gib": gib(self.temp),
      "peak_gib": gib(self.peak),
      "largest_temps": self.largest,
      "flops": self.cost.get("flops"),
      "bytes_accessed": self.cost.get("bytes accessed"),
    }


class OutOfMemory(Exception):
  """XLA refused a program: its message (with the bytes it needed) is the argument;
  `needed` those bytes where the message states them (XLA:TPU: "the total memory required
  for HLO temporaries (39.12G) exceeds ..."), else None."""

  @property
  def needed(self) -> float | None:
    m = re.search(r"required[^(]*\((\d+(?:\.\d+)?)([KMGT])\)", str(self))
    return None if m is None else float(m.group(1)) * 1024 ** "KMGT".index(m.group(2)) * 1024


_SPACE = re.compile(r"^Memory Space: (\S+) \(color=\d+\)\nTotal bytes: (\d+)", re.M)


def memory_spaces(dump_dir: str) -> dict[str, int]:
  """Bytes per memory space of the one program dumped in `dump_dir` (its memory-usage
  report), e.g. {'default': ..., 'vmem': ...}."""
  reports = glob.glob(os.path.join(dump_dir, "*memory-usage-report.txt"))
  if not reports:
    return {}
  with open(reports[0]) as f:
    return {name: int(size) for name, size in _SPACE.findall(f.read())}


_ALLOC = re.compile(r"^allocation \d+: size (\d+), (.*)$")
_VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\w+\[[\d,]*\])")
_OP_NAME = re.compile(r'^\s*(?:ROOT )?%(\S+) = .*?op_name="([^"]*)"')


def largest_temps(dump_dir: str, top: int = 8) -> list[dict]:
  """The largest temporary allocations of the one program dumped in `dump_dir`, from its
  buffer assignment: bytes, the largest value's shape and the JAX op that made it."""
  assignment = glob.glob(os.path.join(dump_dir, "*after_optimizations-buffer-assignment.txt"))
  hlo = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
  if not assignment:
    return []
  op_of = {}
  for path in hlo[:1]:
    with open(path) as f:
      for line in f:
        m = _OP_NAME.match(line)
        if m:
          op_of[m.group(1)] = m.group(2)
  temps, current = [], None
  with open(assignment[0]) as f:
    for line in f:
      m = _ALLOC.match(line)
      if m:
        size, tags = int(m.group(1)), m.group(2)
        is_temp = not any(t in tags for t in ("parameter", "output", "live-out", "constant"))
        current = {"bytes": size, "values": []} if is_temp else None
        if current:
          temps.append(current)
      elif current is not None:
        v = _VALUE.search(line)
        if v:
          current["values"].append((int(v.group(2)), v.group(3), v.group(1)))
  out = []
  for t in sorted(temps, key=lambda t: -t["bytes"])[:top]:
    size, shape, name = max(t["values"], default=(0, "?", "?"))
    op = op_of.get(name, name)
    out.append({"bytes": t["bytes"], "shape": shape, "op": re.sub(r"^jit\([^)]*\)/", "", op)})
  return out


def _platform(args) -> platforms.Platform:
  """The traits of the devices the arguments are placed on (XLA:CPU's when none are)."""
  for leaf in jax.tree.leaves(args):
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      return platforms.of(next(iter(sharding.device_set)).platform)
  return platforms.of("cpu")


def _compile(fn, *args, what: str, options=None):
  options = {**dict(_platform(args).compile_options), **(options or {})}
  try:
    return fn.lower(*args).compile(compiler_options=options)
  except Exception as e:  # XlaRuntimeError; its text carries the sizes
    text = str(e)
    if "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text:
      raise OutOfMemory(f"{what}: {text.splitlines()[0][:600]}") from None
    raise


def compile_program(fn, *args, what: str, options=None, keep_hlo: bool = False) -> Program:
  """`fn` (jitted) lowered on abstract `args` and compiled (with XLA `options`); its
  memory and cost analysis, and with `keep_hlo` the optimized HLO's text (`optimized_hlo`).

  Raises:
    OutOfMemory: XLA refused the program for lack of HBM (message names `what`).
  """
  with tempfile.TemporaryDirectory(prefix="aot_") as dump:
    compiled = _compile(fn, *args, what=what, options={**(options or {}), "xla_dump_to": dump})
    largest = largest_temps(dump)
    spaces = memory_spaces(dump)
    hlo = optimized_hlo(dump) if keep_hlo else ""
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  if isinstance(cost, list):  # older jax: one dict per program
    cost = cost[0] if cost else {}
  return Program(
    argument=m.argument_size_in_bytes,
    output=m.output_size_in_bytes,
    alias=m.alias_size_in_bytes,
    temp=m.temp_size_in_bytes,
    largest=largest,
    cost={k: float(v) for k, v in cost.items() if k in ("flops", "bytes accessed")},
    memory_spaces=spaces,
    hlo=hlo,
  )


def optimized_hlo(dump_dir: str) -> str:
  """The text of the largest module XLA wrote after its optimizations into `dump_dir`
  (`*after_optimizations.txt`; the program's own, not a helper's), or '' when none."""
  paths = sorted(
    pathlib.Path(dump_dir).glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size
  )
  return paths[-1].read_text() if paths else ""


def placed(tree, shardings):
  """`tree`'s shapes and dtypes as `ShapeDtypeStruct`s carrying `shardings`."""
  return jax.tree.map(
    lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings
  )


def abstract_outputs(fn, *args, what: str = "program"):
  """Shapes and shardings of a jitted `fn`'s outputs on abstract `args` (a cheap compile:
  XLA's choice of output shardings). Raises OutOfMemory as `compile_program`."""
  compiled = _compile(fn, *args, what=what)
  return placed(jax.eval_shape(fn, *args), compiled.output_shardings)
