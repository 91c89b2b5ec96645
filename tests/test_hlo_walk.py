"""XLA:GPU's decode step read from its optimized HLO (`plan.hlo_walk`): the walk's rules on a
hand-written module whose bytes are worked out below, on small programs XLA:GPU compiles
ahead of time (an in-place update counts its update, a gemm its operands), and one decode
step of a tiny model, whose kernels and bytes per layer are pinned: a weight relayout or a
cache copy that comes back into the loop changes them (issue 51).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

from ada_jax.models import flash
from ada_jax.plan import compiler, hlo_walk, programs, targets

HAND = """
HloModule m

%fused_row (param_0.1: f32[16,8], param_1.1: s32[]) -> f32[1,8] {
  %param_0.1 = f32[16,8]{1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %zero.1 = s32[] constant(0)
  %b = f32[16,8]{1,0} bitcast(%param_0.1)
  ROOT %ds = f32[1,8]{1,0} dynamic-slice(%b, %param_1.1, %zero.1), dynamic_slice_sizes={1,8}
}

%fused_update (param_0: f32[16,8], param_1: f32[1,8], param_2: s32[]) -> f32[16,8] {
  %param_0 = f32[16,8]{1,0} parameter(0)
  %param_1 = f32[1,8]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[16,8]{1,0} dynamic-update-slice(%param_0, %param_1, %param_2, %zero)
}

%branch_a (pa: f32[1,8]) -> f32[1,8] {
  %pa = f32[1,8]{1,0} parameter(0)
  ROOT %na = f32[1,8]{1,0} negate(%pa)
}

%branch_b (pb: f32[1,8]) -> f32[1,8] {
  %pb = f32[1,8]{1,0} parameter(0)
  %e = f32[1,8]{1,0} exponential(%pb)
  ROOT %n2 = f32[1,8]{1,0} negate(%e)
}

%body (state: (s32[], f32[16,8], f32[8,8])) -> (s32[], f32[16,8], f32[8,8]) {
  %state = (s32[], f32[16,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %buf = f32[16,8]{1,0} get-tuple-element(%state), index=1
  %w = f32[8,8]{1,0} get-tuple-element(%state), index=2
  %row = f32[1,8]{1,0} fusion(%buf, %i), kind=kLoop, calls=%fused_row
  %mm = (f32[1,8]{1,0}, s8[1024]{0}) custom-call(%row, %w), custom_call_target="__cublas$lt$matmul"
  %out = f32[1,8]{1,0} get-tuple-element(%mm), index=0
  %pick = s32[] constant(1)
  %c = f32[1,8]{1,0} conditional(%pick, %out, %out), branch_computations={%branch_a, %branch_b}
  %new = f32[16,8]{1,0} fusion(%buf, %c, %i), kind=kLoop, calls=%fused_update
  %wc = f32[8,8]{1,0} copy(%w)
  ROOT %t = (s32[], f32[16,8]{1,0}, f32[8,8]{1,0}) tuple(%i, %new, %wc)
}

%cond (s: (s32[], f32[16,8], f32[8,8])) -> pred[] {
  %s = (s32[], f32[16,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: (s32[], f32[16,8], f32[8,8])) -> (s32[], f32[16,8], f32[8,8]) {
  %a = (s32[], f32[16,8]{1,0}, f32[8,8]{1,0}) parameter(0)
  ROOT %loop = (s32[], f32[16,8]{1,0}, f32[8,8]{1,0}) while(%a), condition=%cond, body=%body
}
"""


def test_type_bytes():
  assert hlo_walk.type_bytes("bf16[64,96]{1,0}") == 64 * 96 * 2
  assert hlo_walk.type_bytes("(f32[2,3]{1,0}, pred[5]{0}, s32[])") == 24 + 5 + 4
  assert hlo_walk.type_bytes("token[]") == 0


def test_the_walk_by_hand():
  """Per trip of %body, f32 everywhere:
  - %row reads one row through a bitcast and a dynamic slice (32 B), its index (4 B), and
    writes the row (32 B): 68;
  - the gemm reads the row (32) and %w (256) and writes [1, 8] (32), not its workspace: 320;
  - the conditional's larger branch (exp then negate, 2 kernels): 2 x (32 + 32) = 128;
  - %new writes its row into %buf in place: it reads the update (32) and index (4) and
    writes the update (32), never reading or writing the whole buffer: 68;
  - the copy of %w reads and writes it: 512.
  """
  walk = hlo_walk.walk_loop(HAND)
  assert walk.bytes == 68 + 320 + 128 + 68 + 512
  assert walk.kernels == 6 and walk.conditionals == 1
  assert walk.kinds == {"copy": 1, "fusion": 2, "library": 1, "other": 2}
  assert walk.largest[0] == ("wc", "copy", 512) and walk.largest[1] == ("mm", "library", 320)


ASYNC = """
HloModule a

%body (s: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %s = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %w = f32[8,8]{1,0} get-tuple-element(%s), index=1
  %cs = (f32[8,8]{1,0}, f32[8,8]{1,0}, u32[]) copy-start(%w)
  %cd = f32[8,8]{1,0} copy-done(%cs)
  ROOT %t = (s32[], f32[8,8]{1,0}) tuple(%i, %cd)
}

%cond (c: (s32[], f32[8,8])) -> pred[] {
  %c = (s32[], f32[8,8]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (a: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %a = (s32[], f32[8,8]{1,0}) parameter(0)
  ROOT %loop = (s32[], f32[8,8]{1,0}) while(%a), condition=%cond, body=%body
}
"""


def test_an_async_copy_counts_its_buffer_and_the_condition_runs_each_trip():
  """A copy-start's type holds destination, source and a context: it moves 2 x 256 B, at
  its start (its done launches nothing); the loop's condition is a kernel every trip
  (the compare: two s32 in, one pred out)."""
  walk = hlo_walk.walk_loop(ASYNC)
  assert walk.bytes == 2 * 256 + (4 + 4 + 1)
  assert walk.kinds == {"copy": 1, "other": 1} and walk.kernels == 2


def test_a_kernels_output_aliased_to_an_operand_counts_the_operand_once():
  """A Pallas call (a custom call) that updates %buf in place (output 1 aliased to operand
  0) and writes a fresh [1, 8]: its operands (512 + 32) and the fresh output (32), not
  the aliased buffer again; without the aliasing the buffer's write counts too."""
  kernel = (
    "%k = (f32[1,8]{1,0}, f32[16,8]{1,0}) custom-call(%buf, %out), "
    'custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{1}: (0, {})}\n'
    "  %kbuf = f32[16,8]{1,0} get-tuple-element(%k), index=1\n"
    "  %new = f32[16,8]{1,0} fusion(%kbuf, %c, %i)"
  )
  aliased = HAND.replace("%new = f32[16,8]{1,0} fusion(%buf, %c, %i)", kernel)
  base, walk = hlo_walk.walk_loop(HAND), hlo_walk.walk_loop(aliased)
  assert walk.kinds["custom"] == 1 and walk.bytes - base.bytes == 512 + 32 + 32
  plain = hlo_walk.walk_loop(aliased.replace(", output_to_operand_aliasing={{1}: (0, {})}", ""))
  assert plain.bytes - walk.bytes == 512


def test_a_module_without_a_loop_is_refused():
  with pytest.raises(ValueError, match="no while loop"):
    hlo_walk.walk_loop(HAND.replace("while(%a), condition=%cond, body=%body", "copy(%a)"))
  with pytest.raises(ValueError, match="no ENTRY"):
    hlo_walk.walk_loop("HloModule m\n")


pytest.importorskip("jax_plugins.xla_cuda12", reason="jax-cuda12-plugin (requirements-dev.txt)")


@pytest.fixture(scope="module")
def h200():
  return targets.devices_for(targets.target("h200x1"))[0]


def _compiled_loop(device, body, *args):
  sharding = jax.sharding.SingleDeviceSharding(device)
  placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]

  def run(n, *xs):
    return jax.lax.fori_loop(0, n, lambda i, s: body(i, *s), tuple(xs))

  trips = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)
  fn = jax.jit(run, donate_argnums=tuple(range(1, len(args) + 1)))
  return compiler.compile_program(fn, trips, *placed, what="loop", keep_hlo=True)


def test_xla_gpu_in_place_update_counts_the_update(h200):
  """A row written into a 64 MiB cache each trip, as the decode loop writes its keys: what
  XLA:GPU moves is the row (and the gemm's operands), never the cache."""
  cache = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
  w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
  x = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16)

  def body(i, cache, w, x):
    row = (x @ w).astype(jnp.float32)
    return jax.lax.dynamic_update_slice(cache, row, (i, 0)), w, row.astype(jnp.bfloat16)

  walk = hlo_walk.walk_loop(_compiled_loop(h200, body, cache, w, x).hlo)
  weights = 4096 * 4096 * 2
  assert walk.kinds.get("library") == 1  # cuBLAS reads the weights once
  assert weights <= walk.bytes < weights + 4096 * 64, walk
  assert max(n for _, _, n in walk.largest) < weights + 4096 * 16


def _scan_of_matmuls(device, trips: int) -> compiler.Program:
  """`trips` chained [64, 256] x [256, 256] matmuls in a scan, compiled for `device`."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  w = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=sharding)
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=sharding)

  def run(w, x):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=trips)[0]

  return compiler.compile_program(jax.jit(run), w, x, what="scan", keep_hlo=True)


@pytest.mark.parametrize("target", ["h200x1", "v5e-8"])
def test_matmul_flops_count_every_trip_of_a_loop(target):
  """The walk counts a scan's matmuls once per trip on both compilers: XLA:GPU states the
  trip count, XLA:TPU leaves a counted loop (counter, step, bound) to read, and its cost
  analysis counts the body once whatever the trips."""
  device = targets.devices_for(targets.target(target))[0]
  one = 2 * 64 * 256 * 256
  for trips in (1, 3, 16):
    program = _scan_of_matmuls(device, trips)
    assert hlo_walk.matmul_flops(program.hlo) == trips * one
  if target == "v5e-8":
    assert program.cost["flops"] < 2 * one  # why the walk exists


EINSUMS = [  # the model's contractions, at small sizes with distinct extents
  ("btd,kghd->btkgh", {"b": 3, "t": 40, "d": 64, "k": 2, "g": 5, "h": 16}),
  ("btkgh,bksh->bkgts", {"b": 3, "t": 40, "k": 2, "g": 5, "h": 16, "s": 24}),
  ("bkgts,bksh->btkgh", {"b": 3, "t": 40, "k": 2, "g": 5, "h": 16, "s": 24}),
  ("btd,gdf->btgf", {"b": 3, "t": 40, "d": 64, "g": 2, "f": 96}),
  ("btnh,nhd->btd", {"b": 3, "t": 40, "n": 10, "h": 16, "d": 64}),
]


@pytest.mark.parametrize("target", ["h200x1", "v5e-8"])
@pytest.mark.parametrize("spec,sizes", EINSUMS)
def test_matmul_flops_of_a_contraction_and_its_gradient(target, spec, sizes):
  """2 · the product of every extent for the contraction, 3 times that with both
  gradients, however the compiler writes them (XLA:TPU: convolutions whose padded,
  reversed windows carry batch dimensions, one real tap per output)."""
  device = targets.devices_for(targets.target(target))[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  ins, out = spec.split("->")
  shape = lambda letters: tuple(sizes[c] for c in letters)
  a, b = (jax.ShapeDtypeStruct(shape(x), jnp.float32, sharding=sharding) for x in ins.split(","))
  c = jax.ShapeDtypeStruct(shape(out), jnp.float32, sharding=sharding)
  loss = lambda a, b, c: jnp.sum(jnp.einsum(spec, a, b) * c)
  one = 2 * math.prod(sizes.values())
  for fn, times in ((loss, 1), (jax.value_and_grad(loss, argnums=(0, 1)), 3)):
    program = compiler.compile_program(jax.jit(fn), a, b, c, what=spec, keep_hlo=True)
    assert hlo_walk.matmul_flops(program.hlo) == times * one


def _module(body: str, step: int = 1, direction: str = "LT") -> str:
  """An entry that runs `body`'s one instruction (operands %a f32[8,16], %b f32[16,4]) in
  a loop of a counter from 0 by `step` while `counter <direction> 3`."""
  return f"""
HloModule m

%body (s: (s32[], f32[8,16], f32[16,4])) -> (s32[], f32[8,16], f32[16,4]) {{
  %s = (s32[], f32[8,16]{{1,0}}, f32[16,4]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %a = f32[8,16]{{1,0}} get-tuple-element(%s), index=1
  %b = f32[16,4]{{1,0}} get-tuple-element(%s), index=2
  {body}
  %one = s32[] constant({step})
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8,16]{{1,0}}, f32[16,4]{{1,0}}) tuple(%next, %a, %b)
}}

%cond (c: (s32[], f32[8,16], f32[16,4])) -> pred[] {{
  %c = (s32[], f32[8,16]{{1,0}}, f32[16,4]{{1,0}}) parameter(0)
  %j = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %n), direction={direction}
}}

ENTRY %main (a0: f32[8,16], b0: f32[16,4]) -> (s32[], f32[8,16], f32[16,4]) {{
  %a0 = f32[8,16]{{1,0}} parameter(0)
  %b0 = f32[16,4]{{1,0}} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{{1,0}}, f32[16,4]{{1,0}}) tuple(%zero, %a0, %b0)
  ROOT %loop = (s32[], f32[8,16]{{1,0}}, f32[16,4]{{1,0}}) while(%init), condition=%cond, body=%body
}}
"""


DOT = "%d = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}"


def test_matmul_flops_refuse_what_they_cannot_count():
  """A counted loop of a dot: 3 trips of 2 · 8 · 4 · 16. An output type the walk cannot
  read, a computing custom call (cuDNN, a Pallas kernel), a counter stepping away from its
  bound: each raises rather than count too little."""
  assert hlo_walk.matmul_flops(_module(DOT)) == 3 * 2 * 8 * 4 * 16
  with pytest.raises(ValueError, match="an HLO array type this walk cannot read"):
    hlo_walk.matmul_flops(_module(DOT.replace("f32[8,4]", "f8e3m4[8,4]")))
  cudnn = '%d = f32[8,4]{1,0} custom-call(%a, %b), custom_call_target="__cudnn$convForward"'
  with pytest.raises(ValueError, match="whose FLOPs this walk cannot count"):
    hlo_walk.matmul_flops(_module(cudnn))
  with pytest.raises(ValueError, match="trip count is neither known nor"):
    hlo_walk.matmul_flops(_module(DOT, step=-1))
  assert hlo_walk.matmul_flops(_module(DOT, direction="NE")) == 3 * 2 * 8 * 4 * 16


def test_a_kernel_counts_by_its_name_even_over_lines():
  """A Pallas call whose metadata runs over lines (XLA:TPU prints a splash kernel's so,
  with lines that start with a brace, one a brace alone) stays one instruction of its
  loop's body; it counts where `kernels` names it, from its operands
  (`flash.KERNEL_FLOPS`: a causal 2 x 2 block mask of 128-token blocks computes 3 blocks),
  and is refused where nothing does, as is a call without its operands' types."""
  call = (
    "%splash_mqa_fwd_segmented.1 = f32[2,3,256,16]{3,2,1,0} custom-call(%a, %b), "
    'custom_call_target="tpu_custom_call", operand_layout_constraints={s8[1,2,2]{2,1,0}, '
    "s8[1,2,2]{2,1,0}, bf16[2,3,256,16]{3,2,1,0}, bf16[2,256,16]{2,1,0}}, "
    'frontend_attributes={kernel_metadata={\n"xprof_metadata":"{\\"block_q\\": 128}"\n}\n}, '
    'metadata={op_name="splash"}'
  )
  comps, _ = hlo_walk.parse(_module(call))
  (inst,) = (i for i in comps["body"].instructions if i.name.startswith("splash"))
  assert hlo_walk.operand_types(inst) == [
    ("s8", [1, 2, 2]),
    ("s8", [1, 2, 2]),
    ("bf16", [2, 3, 256, 16]),
    ("bf16", [2, 256, 16]),
  ]
  per_call = 2 * 2 * 128 * 128 * 16 * 3 * 2 * 3  # 2 matmuls, 3 blocks, V 2, G 3
  assert hlo_walk.matmul_flops(_module(call), flash.KERNEL_FLOPS) == 3 * per_call
  # With one row and kv head per device XLA drops their dims: queries [G, T, H].
  one = call.replace("bf16[2,3,256,16]", "bf16[3,256,16]").replace("bf16[2,256,16]", "bf16[256,16]")
  assert hlo_walk.matmul_flops(_module(one), flash.KERNEL_FLOPS) == 3 * per_call // 2
  with pytest.raises(ValueError, match="whose FLOPs this walk cannot count"):
    hlo_walk.matmul_flops(_module(call))
  bare = call[: call.index("operand_layout_constraints")] + 'metadata={op_name="splash"}'
  with pytest.raises(ValueError, match="without its block mask or queries"):
    hlo_walk.matmul_flops(_module(bare), flash.KERNEL_FLOPS)


def test_a_loop_of_unknown_trips_is_refused():
  """HAND's loop runs until its condition says (no counter): its FLOPs are unknown."""
  with pytest.raises(ValueError, match="while loop: its trip count is neither known nor"):
    hlo_walk.matmul_flops(HAND)


def _decode_walk(h200, layers: int) -> hlo_walk.StepWalk:
  """One decode step of a bf16 tiny Llama with `layers` layers at 64 slots, for XLA:GPU."""
  from ada_jax import config as config_lib
  from ada_jax.cli import make_configs_importable

  make_configs_importable()
  from configs import tiny_arith_pos

  c = tiny_arith_pos.get_config()
  c.model.dtype = "bfloat16"
  c.model.overrides.num_layers = layers
  c.mesh.data = c.mesh.fsdp = c.mesh.tensor = 1
  c.sampler.chunk_rows, c.sampler.prompts_per_chunk, c.rl.batch_prompts = 64, 0, 8
  c.sampler.max_new_tokens, c.sampler.attention_block = 16, 4
  c.model.overrides.head_dim = 32
  cfg = config_lib.parse(c)
  mesh = programs.mesh_for(cfg, [h200])
  model_cfg = programs.model_of(cfg)
  params = programs.rollout_params(model_cfg, mesh)
  smp = programs.rollout_sampler(cfg, model_cfg, mesh)
  _, (_, state, *_) = programs.segment_args(smp, params)
  step = programs.decode_step_program(smp, params, state)
  assert step.two_steps is None and step.bytes_accessed == step.walk.bytes
  return step.walk


# What one more layer adds to a tiny bf16 decode step on XLA:GPU today (d = 96, 4 heads of
# 32, 64 slots, prompt bucket 16 + ring 16): 4 cuBLAS gemms (qkv, o, gate_up, down), the
# decode kernel (`rollout.decode_kernel_gpu`: RoPE, the ring's write in place and the
# attention; its operands the layer's projections, the rings and the prompt cache, read at
# each slot's entry since issue 52) and 3 fusions (2 norms, the MLP's product); 1,788,620 B.
# With each slot's own prompt columns it took 1,919,692 B, 1.40x the layer's weights
# (319,872 B) and cache (1,048,576 B), the rest the activations the gemms read and write at
# this tiny width. With RoPE and the two cache writes as fusions beside an attention-only kernel it
# took 11 kernels and 2,050,448 B; XLA's form of the attention (scores, softmax and
# weighted sum as fusions, the prompt keys and the ring concatenated first) 13 kernels and
# 2,462,088 B; with the rollout copy's gate_up in `[2, D, F]` XLA:GPU also re-laid those
# weights out in every layer (one more kernel).
LAYER_KERNELS = 8
LAYER_BYTES = 1_788_620


@pytest.mark.slow
def test_a_decode_steps_kernels_and_bytes_per_layer_are_pinned(h200):
  two, three = _decode_walk(h200, 2), _decode_walk(h200, 3)
  per_layer = dataclasses.replace(
    three,
    bytes=three.bytes - two.bytes,
    kernels=three.kernels - two.kernels,
    conditionals=three.conditionals - two.conditionals,
  )
  assert three.kinds["library"] - two.kinds["library"] == 4
  assert three.kinds["custom"] - two.kinds["custom"] == 1
  assert per_layer.conditionals == 0
  assert (per_layer.kernels, per_layer.bytes) == (LAYER_KERNELS, LAYER_BYTES)
