"""Causal self-attention of training rows and prompts as JAX's Pallas TPU splash-attention
kernel (issue 53): flash attention (scores a block at a time in VMEM, the softmax carried
across key blocks, never an `[T, T]` score array in HBM), blocks above the causal diagonal
skipped by a static block mask, and packed sequences kept apart by their segment ids.

The kernel is the one JAX ships (`jax.experimental.pallas.ops.tpu.splash_attention`, the
kernel MaxText trains with), not our own: a well-kept kernel library beats one we write.
What is ours is the glue: grouped-query heads as one multi-query call per kv head, the
segment ids of a packed row (`rl.packing`), and `shard_map` over the mesh, since XLA does
not partition a Pallas call.

Same attention as `layers.causal_attend` at every real token: a query sees the keys at or
before it in its own segment. A padding query (segment 0) sees the padding keys before it,
where `causal_attend` gives it a mean over others; it is masked everywhere downstream.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ada_jax.models import sharding as sharding_lib
from ada_jax.models.architecture import ModelConfig

BLOCKS = (512, 256, 128)  # query and key block sizes tried, largest first; 128 is a lane
# One backward kernel for dq, dk and dv: each block's scores and dP made once, not once per
# gradient kernel (5 block matmuls, not 7); its dq comes as one partial per key block.
FUSED_BACKWARD = True


def applies(length: int) -> bool:
  """Whether the kernel takes rows of `length` tokens (a multiple of 128, its lane width)."""
  return length % BLOCKS[-1] == 0


@functools.cache
def _kernel(length: int, group: int, interpret: bool):
  """The multi-query kernel for `group` query heads of one kv head over `length` tokens."""
  b = next(b for b in BLOCKS if length % b == 0)
  sizes = splash.BlockSizes(
    block_q=b,
    block_kv=b,
    block_kv_compute=b,
    block_q_dkv=b,
    block_kv_dkv=b,
    block_kv_dkv_compute=b,
    use_fused_bwd_kernel=FUSED_BACKWARD,
    **({} if FUSED_BACKWARD else dict(block_q_dq=b, block_kv_dq=b)),
  )
  mask = masks.MultiHeadMask([masks.CausalMask((length, length))] * group)
  # Its block-mask tables as constants, not as values of the trace that first asks for it
  # (the kernel is kept for later traces).
  with jax.ensure_compile_time_eval():
    return splash.make_splash_mqa(
      mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def splash_attend(
  q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, *, interpret: bool = False
) -> jax.Array:
  """`layers.causal_attend`'s attention on one device's rows, as the splash kernel.

  Args:
    q: `[B, T, N, H]` queries (after RoPE), N = K · G heads, kv head major.
    k, v: `[B, K, T, H]` keys (after RoPE) and values.
    segments: `bool[B, T]` (True at real tokens) or `int32[B, T]` segment ids (0 at
      padding).
    interpret: run in Pallas' interpreter (off TPU: tests).

  Returns:
    `[B, T, N, H]` in v's dtype.

  Raises:
    ValueError: T is not a multiple of 128 (`applies`).
  """
  b, t, n, h = q.shape
  heads = k.shape[1]
  if not applies(t):
    raise ValueError(f"splash attention takes rows of a multiple of 128 tokens, not {t}")
  kernel = _kernel(t, n // heads, interpret)
  ids = segments.astype(jnp.int32)
  # The kernel does not scale the scores, so the queries are scaled: in bf16 they round once
  # more than in `layers.attend`, which scales the float32 scores, and the kernel weighs the
  # values by float32 probabilities where XLA's form rounds them to bf16 (not measured on TPU).
  grouped = (q * (1.0 / math.sqrt(h))).astype(k.dtype).reshape(b, t, heads, n // heads, h)
  grouped = grouped.transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
  one = lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(s, s))
  out = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)))(grouped, k, v, ids)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(v.dtype)


def self_attend(config: ModelConfig, mesh: Mesh | None, length: int) -> Callable | None:
  """The causal self-attention of `length`-token rows where the platform's form is the
  splash kernel (`platforms.Platform.self_attention`), `(q, k, v, segments) -> out` as
  `splash_attend` on each device's rows and heads; None for XLA's form
  (`layers.causal_attend`), the platform's or where the kernel does not take the rows."""
  platform = sharding_lib.platform(mesh)
  if platform.self_attention != "splash" or not applies(length):
    return None
  return on_mesh(config, mesh, interpret=not platform.runs_mosaic)


def on_mesh(config: ModelConfig, mesh: Mesh | None, *, interpret: bool = False) -> Callable:
  """`splash_attend` over `mesh`: rows split as the batch is ('batch'), heads as the
  model's ('heads', 'kv_heads', `sharding.model_rules`), whole without a mesh."""
  attend = functools.partial(splash_attend, interpret=interpret)
  if mesh is None:
    return attend
  rules = sharding_lib.model_rules(config, mesh)

  def run(q, k, v, segments):
    spec = lambda axes, x: sharding_lib.logical_to_spec(axes, x.shape, mesh, rules=rules)
    q_spec = spec(("batch", None, "heads", None), q)
    kv_spec = spec(("batch", "kv_heads", None, None), k)
    if q_spec[2] != kv_spec[1]:  # a query head must sit with its kv head: both whole
      q_spec, kv_spec = P(q_spec[0], None, None, None), P(kv_spec[0], None, None, None)
    return jax.shard_map(
      attend,
      mesh=mesh,
      in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[0], None)),
      out_specs=q_spec,
      check_vma=False,
    )(q, k, v, segments)

  return run


def _kernel_flops(matmuls: int, operands: list[tuple[str, list[int]]]) -> int:
  """FLOPs of one splash call from its operands (`hlo_walk.operand_types`): the int8 block
  mask `[.., nb, nb]` and the queries `[.., T, H]`, the leading dims the vmapped rows, kv
  heads and the G heads of each (Pallas' vmap drops those of size 1); `matmuls` `[block,
  block] x [block, H]` products per computed block and head. The mask is causal
  (`_kernel`'s): nb (nb + 1) / 2 blocks computed of nb².

  Raises:
    ValueError: no int8 mask or floating queries among `operands`.
  """
  mask = next((dims for kind, dims in operands if kind == "s8"), None)
  queries = next((dims for kind, dims in operands if kind in ("bf16", "f32")), None)
  if mask is None or queries is None:
    raise ValueError(f"a splash call's operands without its block mask or queries: {operands}")
  nb, (*heads, t, h) = mask[-1], queries
  block = t // nb
  return 2 * matmuls * block * block * h * (nb * (nb + 1) // 2) * math.prod(heads)


# The kernels' FLOPs by the prefix of their calls' names in the optimized HLO: forward
# (scores, weighted values); backward fused (scores, dP, dV, dK, dQ) or as dkv (scores, dP,
# dV, dK) and dq (scores, dP, dQ).
KERNEL_FLOPS = {
  "splash_mqa_fwd": functools.partial(_kernel_flops, 2),
  "splash_mqa_dkv": functools.partial(_kernel_flops, 5 if FUSED_BACKWARD else 4),
  "splash_mqa_dq": functools.partial(_kernel_flops, 3),
}
