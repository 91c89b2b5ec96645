"""One decode step's HBM bytes and kernel launches as XLA:GPU compiled it, read from the
optimized HLO (XLA:GPU gives no cost analysis of a compiled program; issue 51's probe read
the same program by hand).

`walk_loop` takes the text XLA writes as `*after_optimizations.txt` (`xla_dump_to`) for a
program whose largest `while` is the decode loop (`programs.decode_step_program`: one
decode step per trip) and sums, over one trip of its body, what each instruction that runs
as a kernel reads and writes:

- a fusion: its outputs and its inputs, where an input the fused computation reads only
  through slices counts the slices (what it reads), and an output a dynamic-update-slice
  writes into one of the fusion's own inputs counts the update (an in-place write; that
  input is not read);
- a library call (cuBLAS): its operands and outputs, not its workspace; another custom
  call (a Pallas kernel) its operands and the outputs not aliased to one of them (an
  aliased output is updated in place: what the kernel writes of it is not in the HLO);
- a copy twice its bytes (read and write); an unfused slice or update likewise; an
  asynchronous op once, at its start;
- a conditional: its largest branch (one runs per step), walked the same way; a while:
  its body and its condition times its known trip count (once when unknown); the decode
  loop's own condition is part of its trip.

Parameters, constants, tuples, `get-tuple-element` and bitcasts move nothing and launch
nothing. Kernels count what launches per step: fusions, library calls, copies and the
other unfused ops; a conditional counts apart (it syncs with the host on XLA:GPU unless
a command buffer holds it). Compiler-derived, not measured: the L2 cache is in no figure
(every byte counted is counted as an HBM byte).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re

import numpy as np

# Bytes per element of HLO's primitive types (sub-byte types rounded up per element).
DTYPE_BYTES = {
  "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
  "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
  "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(
  r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]"
)
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
# Ops that move no bytes and launch nothing.
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"}
# Ops inside a fusion that read a part of their operand.
_READS_PART = {"slice", "dynamic-slice", "gather"}
_LIBRARY = ("matmul", "gemm", "cublas", "cudnn")
# Custom calls that compute (cuDNN, Pallas kernels on TPU and GPU): `matmul_flops` refuses a
# program with one rather than count it as nothing.
_COMPUTING_CALLS = ("cudnn", "tpu_custom_call", "triton", "mosaic")


def type_bytes(text: str) -> int:
  """Bytes of an HLO type written as text (`bf16[64,96]{1,0}`, a tuple of them: the sum)."""
  return _bytes(_ARRAY.findall(text))


def _bytes(arrays: list[tuple[str, str]]) -> int:
  """Bytes of `_ARRAY.findall`'s (dtype, dims) pairs."""
  return sum(DTYPE_BYTES[d] * math.prod(int(n) for n in dims.split(",") if n) for d, dims in arrays)


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: its name, result type (text), opcode, operand names and the
  attributes after its operands (text)."""

  name: str
  type: str
  opcode: str
  operands: tuple[str, ...]
  attrs: str
  root: bool = False
  args: str = ""  # the text between its parentheses (a constant's literal)

  def branches(self) -> list[str]:
    """A conditional's branch computations (indexed, or true / false)."""
    return self.called("branch_computations") or (
      self.called("true_computation") + self.called("false_computation")
    )

  def called(self, key: str) -> list[str]:
    """The computations named by attribute `key` (`calls`, `body`, `branch_computations`)."""
    m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", self.attrs)
    return _NAME.findall(m.group(1)) or [m.group(1)] if m else []


@dataclasses.dataclass(frozen=True)
class Computation:
  """An HLO computation: its instructions in order, by name."""

  name: str
  instructions: tuple[Instruction, ...]

  @functools.cached_property
  def by_name(self) -> dict[str, Instruction]:
    return {i.name: i for i in self.instructions}

  @property
  def root(self) -> Instruction:
    return next(i for i in self.instructions if i.root)


def _closing(text: str, pair: str, depth: int = 0) -> int:
  """Where `text` closes its `pair` ('()', '{}'), `depth` open before it; len(text): not."""
  for k, ch in enumerate(text):
    depth += {pair[0]: 1, pair[1]: -1}.get(ch, 0)
    if depth == 0:
      return k
  return len(text)


def parse(text: str) -> tuple[dict[str, Computation], str]:
  """(computations by name, the entry computation's name) of an HLO module's text.

  Raises:
    ValueError: no entry computation in `text`.
  """
  comps, entry, name, body = {}, None, None, []
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      name, body = header.group(2), []
      entry = name if header.group(1) else entry
      continue
    if name is None:
      continue
    m = _INSTRUCTION.match(line)
    if not m and body and body[-1].attrs.count("{") > body[-1].attrs.count("}"):
      body[-1] = dataclasses.replace(body[-1], attrs=f"{body[-1].attrs}\n{line}")  # metadata
    elif line.rstrip() == "}":
      comps[name], name = Computation(name, tuple(body)), None
    elif m:
      root, inst, type_text, opcode, rest = m.groups()
      end = _closing(rest, "()", depth=1)  # the operand list's closing parenthesis
      operands = tuple(_NAME.findall(re.sub(r"/\*.*?\*/", "", rest[:end])))
      body.append(
        Instruction(inst, type_text, opcode, operands, rest[end + 1 :], bool(root), rest[:end])
      )
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return comps, entry


@dataclasses.dataclass(frozen=True)
class StepWalk:
  """What one trip of a loop body moves and launches (`walk_loop`).

  Attributes:
    bytes: bytes read and written per trip (every one counted as an HBM byte).
    kernels: launches per trip: fusions, library calls, copies and other unfused ops
      (a conditional's largest branch counted).
    conditionals: conditionals per trip.
    kinds: kernels by kind ('fusion', 'library' (cuBLAS, cuDNN), 'copy', 'custom' (another
      custom call: a Pallas kernel), 'other' (an unfused op)).
    largest: the instructions moving the most bytes, (name, kind, bytes), largest first.
  """

  bytes: int
  kernels: int
  conditionals: int
  kinds: dict[str, int]
  largest: tuple[tuple[str, str, int], ...]

  def as_json(self) -> dict:
    return {**dataclasses.asdict(self), "largest": [list(x) for x in self.largest]}


def _source(comp: Computation, name: str) -> Instruction:
  """`name`'s instruction in `comp`, through bitcasts."""
  inst = comp.by_name[name]
  while inst.opcode == "bitcast":
    inst = comp.by_name[inst.operands[0]]
  return inst


def _fusion_bytes(inst: Instruction, fused: Computation, types: dict[str, str]) -> int:
  """What fusion `inst` (computation `fused`) reads and writes; `types`: its operands'."""
  by_name = fused.by_name
  users = collections.defaultdict(list)
  for i in fused.instructions:
    for o in i.operands:
      users[o].append(i)
  root = fused.root
  outputs = [by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
  outputs = [_source(fused, out.name) for out in outputs]
  written = 0
  for out in outputs:
    if out.opcode == "dynamic-update-slice" and _source(fused, out.operands[0]).opcode == (
      "parameter"
    ):
      written += type_bytes(by_name[out.operands[1]].type)  # in place: the update alone
    else:
      written += type_bytes(out.type)
  read = 0
  params = [i for i in fused.instructions if i.opcode == "parameter"]
  for p in params:
    chain, frontier, parts, whole = {p.name}, [p.name], 0, False
    while frontier:  # the parameter's users, through bitcasts
      for u in users[frontier.pop()]:
        if u.opcode == "bitcast":
          chain.add(u.name)
          frontier.append(u.name)
        elif u.opcode in _READS_PART and u.operands[0] in chain:
          parts += type_bytes(u.type)
        elif u in outputs and u.opcode == "dynamic-update-slice" and u.operands[0] in chain:
          continue  # the buffer written in place: not read
        else:
          whole = True
    read += type_bytes(p.type) if whole else parts
  return read + written


@dataclasses.dataclass
class _Tally:
  """What a run of some computations moved and launched, summed as `_walk` goes."""

  bytes: int = 0
  kernels: int = 0
  conditionals: int = 0
  kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  items: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)

  def add(self, other: _Tally, times: int = 1) -> None:
    self.bytes += other.bytes * times
    self.kernels += other.kernels * times
    self.conditionals += other.conditionals * times
    self.kinds.update({kind: n * times for kind, n in other.kinds.items()})
    self.items += [(name, kind, n * times) for name, kind, n in other.items]


def _trip(comps: dict[str, Computation], loop: Instruction) -> _Tally:
  """One trip of while `loop`: its body and its condition."""
  tally = _walk(comps, comps[loop.called("body")[0]])
  tally.add(_walk(comps, comps[loop.called("condition")[0]]))
  return tally


def _walk(comps: dict[str, Computation], comp: Computation) -> _Tally:
  """What one run of `comp` moves and launches."""
  types = {i.name: i.type for i in comp.instructions}
  tally = _Tally()
  for inst in comp.instructions:
    op = inst.opcode
    if op in FREE or op.endswith("-done"):  # a `-done`'s `-start` launched it
      continue
    if op == "while":
      trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.attrs)
      tally.add(_trip(comps, inst), int(trips.group(1)) if trips else 1)
      continue
    if op == "conditional":
      branches = inst.branches()
      walks = [_walk(comps, comps[b]) for b in branches]
      tally.add(max(walks, key=lambda w: (w.bytes, w.kernels)))
      tally.conditionals += 1
      continue
    operands = sum(type_bytes(types.get(o, "")) for o in inst.operands)
    if op == "fusion":
      moved, kind = _fusion_bytes(inst, comps[inst.called("calls")[0]], types), "fusion"
    elif op == "custom-call" and any(k in inst.attrs.lower() for k in _LIBRARY):
      outputs = _ARRAY.findall(inst.type)
      if len(outputs) > 1 and outputs[-1][0] in ("s8", "u8"):  # the library's workspace
        outputs = outputs[:-1]
      moved, kind = operands + _bytes(outputs), "library"
    elif op in ("copy", "copy-start"):  # a copy-start's type: (destination, source, context)
      moved, kind = 2 * _bytes(_ARRAY.findall(inst.type)[:1]), "copy"
    elif op == "dynamic-update-slice":
      moved, kind = 2 * type_bytes(types.get(inst.operands[1], "")), "other"
    elif op in ("slice", "dynamic-slice"):
      moved, kind = 2 * type_bytes(inst.type), "other"
    elif op == "custom-call":
      moved, kind = operands + _bytes(_unaliased_outputs(inst)), "custom"
    else:
      moved, kind = operands + type_bytes(inst.type), "other"
    tally.bytes, tally.kernels = tally.bytes + moved, tally.kernels + 1
    tally.kinds[kind] += 1
    tally.items.append((inst.name, kind, moved))
  return tally


def _unaliased_outputs(inst: Instruction) -> list[tuple[str, str]]:
  """A custom call's outputs but those aliased to an operand (updated in place: the Pallas
  GPU decode kernel's ring, of which it writes one column; what a kernel writes of such
  an output is not in the HLO, its operand's read is counted)."""
  outputs = _ARRAY.findall(inst.type)
  aliasing = re.search(r"output_to_operand_aliasing=\{(.*?)\}\)\}", inst.attrs)
  aliased = {int(i) for i in re.findall(r"\{(\d+)\}:", aliasing.group(1))} if aliasing else set()
  return [x for i, x in enumerate(outputs) if i not in aliased]


def walk_loop(text: str, top: int = 12) -> StepWalk:
  """One trip of the largest `while` of the entry computation of HLO module `text` (by the
  instructions its body holds): the decode loop of `programs.decode_step_program`.

  Raises:
    ValueError: `text` has no entry computation or its entry no while loop.
  """
  comps, entry = parse(text)
  loops = [i for i in comps[entry].instructions if i.opcode == "while"]
  if not loops:
    raise ValueError(f"the entry computation {entry} has no while loop")
  loop = max(loops, key=lambda i: len(comps[i.called("body")[0]].instructions))
  t = _trip(comps, loop)
  largest = tuple(sorted(t.items, key=lambda x: -x[2])[:top])
  return StepWalk(t.bytes, t.kernels, t.conditionals, dict(sorted(t.kinds.items())), largest)


def _dims(type_text: str) -> list[int]:
  """The first array's dimensions in an HLO type's text.

  Raises:
    ValueError: the text holds an array this module cannot read (an unknown element type,
      a dynamic `<=` dimension): its size would be miscounted.
  """
  arrays = _ARRAY.findall(type_text)
  if not arrays and "[" in type_text:
    raise ValueError(f"an HLO array type this walk cannot read: {type_text[:80]!r}")
  return [int(n) for n in arrays[0][1].split(",") if n] if arrays else []


def _window(attrs: str, key: str, spatial: int, default: int) -> list[int]:
  """One field of a convolution's `window={...}` per spatial dimension (for `pad`, the
  low side's)."""
  window = re.search(r"window=\{([^}]*)\}", attrs)
  m = re.search(rf"\b{key}=([\d_x-]+)", window.group(1)) if window else None
  return [default] * spatial if m is None else [int(v.split("_")[0]) for v in m.group(1).split("x")]


def _convolution_macs(inst: Instruction, lhs: list[int], rhs: list[int]) -> int:
  """Multiply-adds of a convolution that touch a real input element: output batch ×
  output features × input features per group × per spatial dimension the (output
  position, kernel tap) pairs that land on an input element, not on padding or a dilation
  hole. XLA:TPU writes matmuls as convolutions whose spatial dimensions carry batch or
  contracting dimensions, some through a padded, reversed window of which one tap per
  output is real: output × window would count every tap."""
  out = _dims(inst.type)
  lhs_l, rhs_l, out_l = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", inst.attrs).groups()
  spatial = sum(ch.isdigit() for ch in lhs_l)
  macs = out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")]
  if not spatial:
    return macs
  size = _window(inst.attrs, "size", spatial, 1)
  stride = _window(inst.attrs, "stride", spatial, 1)
  lhs_dilate = _window(inst.attrs, "lhs_dilate", spatial, 1)
  rhs_dilate = _window(inst.attrs, "rhs_dilate", spatial, 1)
  low = _window(inst.attrs, "pad", spatial, 0)
  for d in range(spatial):
    n_in, n_out = lhs[lhs_l.index(str(d))], out[out_l.index(str(d))]
    at = (
      np.arange(n_out)[:, None] * stride[d] + np.arange(size[d])[None, :] * rhs_dilate[d] - low[d]
    )
    real = (at >= 0) & (at <= (n_in - 1) * lhs_dilate[d]) & (at % lhs_dilate[d] == 0)
    macs *= int(real.sum())
  return macs


def _matmul_flops(inst: Instruction, types: dict[str, str]) -> int:
  """2 · output elements · contracted size of a dot, a convolution or a library GEMM."""
  out = math.prod(_dims(inst.type))
  lhs, rhs = (_dims(types.get(o, "")) for o in (inst.operands + ("", ""))[:2])
  if inst.opcode == "dot":
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)
    contracted = [int(d) for d in m.group(1).split(",") if d] if m else []
    return 2 * out * math.prod(lhs[d] for d in contracted)
  if inst.opcode == "convolution":
    return 2 * _convolution_macs(inst, lhs, rhs)
  m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.attrs)  # cuBLAS
  if m is None:
    raise ValueError(f"{inst.name}: a library GEMM without its dot dimensions")
  return 2 * out * math.prod(lhs[int(d)] for d in re.findall(r"\d+", m.group(1)))


def _through_copies(comp: Computation, name: str) -> Instruction | None:
  """The instruction `name` holds the value of, through copies, converts and bitcasts."""
  inst = comp.by_name.get(name)
  while inst is not None and inst.opcode in ("copy", "convert", "bitcast") and inst.operands:
    inst = comp.by_name.get(inst.operands[0])
  return inst


def _constant(comp: Computation, name: str) -> int | None:
  """The integer a scalar operand holds, through copies and converts; None if not one."""
  inst = _through_copies(comp, name)
  if inst is None or inst.opcode != "constant" or not re.fullmatch(r"-?\d+", inst.args.strip()):
    return None
  return int(inst.args)


def trip_count(comps: dict[str, Computation], parent: Computation, loop: Instruction) -> int:
  """A while's trips: XLA:GPU's `known_trip_count`, else read from the loop as XLA:TPU
  leaves a scan: a counter (tuple element i) starting at a constant, stepped by a
  constant, compared with a constant by the condition.

  Raises:
    ValueError: neither gives the count (a loop whose trips depend on data).
  """
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
  if known:
    return int(known.group(1))
  cond, body = comps[loop.called("condition")[0]], comps[loop.called("body")[0]]
  root = cond.root

  def index(c: Computation, n: str) -> int | None:  # the tuple element n is, through copies
    inst = _through_copies(c, n)
    if inst is None or inst.opcode != "get-tuple-element":
      return None
    return int(re.search(r"index=(\d+)", inst.attrs).group(1))

  if root.opcode == "compare" and len(root.operands) == 2:
    (a, b), direction = root.operands, re.search(r"direction=(\w+)", root.attrs).group(1)
    if index(cond, a) is None:
      a, b = b, a
      direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(direction, direction)
    i, bound = index(cond, a), _constant(cond, b)
    init_tuple = parent.by_name.get(loop.operands[0])
    if init_tuple is not None and init_tuple.opcode != "tuple":
      init_tuple = None  # a loop state passed whole: its counter's start is not in sight
    step_inst = body.root.operands[i] if i is not None and body.root.opcode == "tuple" else ""
    step_inst = body.by_name.get(step_inst)
    if None not in (i, bound, init_tuple, step_inst) and step_inst.opcode == "add":
      start = _constant(parent, init_tuple.operands[i])
      x, y = step_inst.operands
      step = _constant(body, y) if index(body, x) == i else _constant(body, x)
      # Counting up towards an upper bound (LT, LE, NE) or down towards a lower one.
      up = direction in ("LT", "LE", "NE")
      if start is not None and step and (step > 0) == up:
        span = {"LT": bound - start, "LE": bound - start + 1, "NE": bound - start}.get(direction)
        span = {"GT": start - bound, "GE": start - bound + 1}.get(direction, span)
        if span is not None and (direction != "NE" or span % step == 0):
          return max(0, -(-span // abs(step)))
  raise ValueError(f"while {loop.name}: its trip count is neither known nor a counted loop's")


def operand_types(inst: Instruction) -> list[tuple[str, list[int]]]:
  """(element type, dims) of a custom call's operands, from its operand constraints."""
  start = inst.attrs.find("operand_layout_constraints={")
  text = inst.attrs[start + len("operand_layout_constraints=") :] if start >= 0 else ""
  found = re.findall(r"(\w+)(\[[\d,]*\])", text[: _closing(text, "{}")])
  return [(kind, _dims(kind + dims)) for kind, dims in found]


def matmul_flops(text: str, kernels: dict | None = None) -> int:
  """The matrix multiplications' FLOPs of one run of HLO module `text` (optimized HLO, as
  `walk_loop` reads it): every dot and convolution, fused or not, and every library GEMM
  (cuBLAS), as 2 · output elements · contracted size; a while's body times its known trip
  count, a conditional's largest branch; a Pallas kernel's call where `kernels` maps its
  name's prefix to its FLOPs from its `operand_types` (`flash.KERNEL_FLOPS`).

  Why not XLA's cost analysis: XLA:TPU's counts a while's body once whatever its trip
  count (a scan of 16 matmuls reported as one), and the train step is loops: micro-
  batches, the rematerialised layers, the log-prob blocks. Elementwise FLOPs are not
  counted (a few per cent of a transformer step).

  Raises:
    ValueError: `text` has no entry computation, a while's trips are unknown
      (`trip_count`), an array type it cannot read, or a computing custom call (cuDNN, a
      Pallas kernel) whose FLOPs it cannot count (none of `kernels`).
  """
  comps, entry = parse(text)

  @functools.cache
  def run(name: str) -> int:
    comp = comps[name]
    types = {i.name: i.type for i in comp.instructions}
    total = 0
    for inst in comp.instructions:
      op = inst.opcode
      if op == "while":
        trips = trip_count(comps, comp, inst)
        total += trips * (run(inst.called("body")[0]) + run(inst.called("condition")[0]))
      elif op == "conditional":
        branches = inst.branches()
        total += max(run(b) for b in branches)
      elif op in ("fusion", "call", "async-start"):
        total += sum(run(c) for c in inst.called("calls") + inst.called("to_apply"))
      elif op in ("dot", "convolution"):
        total += _matmul_flops(inst, types)
      elif op == "custom-call":
        target = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
        target = target.group(1).lower() if target else ""
        if any(k in target for k in ("gemm", "matmul")):  # cuBLAS
          total += _matmul_flops(inst, types)
        elif any(k in target for k in _COMPUTING_CALLS):
          count = next((f for p, f in (kernels or {}).items() if inst.name.startswith(p)), None)
          if count is None:
            raise ValueError(f"{inst.name}: a {target} call, whose FLOPs this walk cannot count")
          total += count(operand_types(inst))
    return total

  return run(entry)
