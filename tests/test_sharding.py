"""Mesh construction, the logical-axis rule table and placement on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ada_jax.models import decoder as model_lib
from ada_jax.models import sharding


def test_eight_fake_devices():
  assert jax.device_count() == 8


@pytest.mark.parametrize(
  "sizes, shape",
  [
    ((2, 2, 2), (2, 2, 2)),
    ((-1, 1, 2), (4, 1, 2)),
    ((1, -1, 1), (1, 8, 1)),
    ((8, 1, 1), (8, 1, 1)),
  ],
)
def test_make_mesh_shapes(sizes, shape):
  mesh = sharding.make_mesh(*sizes)
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert tuple(mesh.shape[a] for a in mesh.axis_names) == shape


@pytest.mark.parametrize(
  "sizes, match",
  [
    ((2, 2, 1), "needs 4 devices, but there are 8"),
    ((-1, -1, 1), "only one mesh axis"),
    ((3, -1, 1), "mesh.fsdp=-1"),
    ((0, 1, 1), "mesh.data must be"),
  ],
)
def test_make_mesh_errors(sizes, match):
  with pytest.raises(ValueError, match=match):
    sharding.make_mesh(*sizes)


def test_rule_table_and_replication_fallback():
  mesh = sharding.make_mesh(1, 2, 4)
  assert sharding.logical_to_spec(("vocab", "embed"), (512, 64), mesh) == P("tensor", "fsdp")
  # 2 kv heads do not divide over tensor=4: replicated, not an error.
  assert sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 2, 16), mesh) == P(
    "fsdp", None, None
  )
  # Rows over both data axes; the size-1 'data' axis is dropped from the spec.
  assert sharding.logical_to_spec(("batch", "length"), (8, 5), mesh) == P("fsdp", None)
  # A mesh axis appears at most once per spec.
  assert sharding.logical_to_spec(("heads", "mlp"), (4, 8), mesh) == P("tensor", None)
  with pytest.raises(ValueError, match="no sharding rule"):
    sharding.logical_to_spec(("channels",), (4,), mesh)
  full = sharding.make_mesh(2, 2, 2)
  assert sharding.logical_to_spec(("batch",), (8,), full) == P(("data", "fsdp"))


def test_params_are_really_sharded():
  config = model_lib.preset("tiny-llama")  # V=512 D=64 N=4 K=2 H=16 F=128
  mesh = sharding.make_mesh(2, 2, 2)
  shardings = sharding.param_shardings(config, mesh)
  params = sharding.place_params(model_lib.init_params(config, jax.random.key(0)), shardings)
  local = lambda x: {s.data.shape for s in x.addressable_shards}
  assert local(params["embed"]) == {(256, 32)}  # vocab/tensor, embed/fsdp
  attn = params["layer_0"]["attn"]
  assert local(attn["q"]) == {(32, 2, 16)}  # embed/fsdp, heads/tensor, head_dim whole
  assert local(attn["k"]) == {(32, 1, 16)}
  assert local(attn["o"]) == {(2, 16, 32)}
  assert local(params["layer_0"]["mlp"]["down"]) == {(64, 32)}
  assert local(params["final_norm"]["scale"]) == {(32,)}
  assert len(params["embed"].addressable_shards) == 8


def test_place_batch_rows_and_errors():
  mesh = sharding.make_mesh(2, 2, 2)
  batch = {"tokens": np.arange(24, dtype=np.int32).reshape(8, 3), "adv": np.ones(8, np.float32)}
  placed = sharding.place_batch(batch, mesh)
  assert {s.data.shape for s in placed["tokens"].addressable_shards} == {(2, 3)}
  np.testing.assert_array_equal(np.asarray(placed["tokens"]), batch["tokens"])
  with pytest.raises(ValueError, match=r"rollout batch \(6 rows\).*data-parallel size 4"):
    sharding.place_batch({"tokens": np.zeros((6, 3))}, mesh, "rollout batch")
  with pytest.raises(ValueError, match="same leading row count"):
    sharding.place_batch({"a": np.zeros((8, 3)), "b": np.zeros(4)}, mesh)


def test_constrain_inside_jit():
  mesh = sharding.make_mesh(2, 2, 2)
  f = jax.jit(lambda x: sharding.constrain(x * 2, ("batch", "length", "vocab"), mesh))
  y = f(jnp.ones((8, 3, 4)))
  assert y.sharding.spec == P(("data", "fsdp"), None, "tensor")


def test_gather_embedding_drops_only_fsdp():
  config = model_lib.preset("tiny-llama")
  mesh = sharding.make_mesh(2, 2, 2)
  params = sharding.place_params(
    model_lib.init_params(config, jax.random.key(0)), sharding.param_shardings(config, mesh)
  )
  out = jax.jit(lambda p: sharding.gather_embedding(p, mesh))(params)
  assert {s.data.shape for s in out["embed"].addressable_shards} == {(256, 64)}  # V/tensor
  assert {s.data.shape for s in out["layer_0"]["attn"]["q"].addressable_shards} == {(32, 2, 16)}
  np.testing.assert_array_equal(np.asarray(out["embed"]), np.asarray(params["embed"]))
