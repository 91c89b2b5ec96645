"""Parity of the decoder with transformers (torch CPU, fp32) through `weights.load_hf`."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ada_jax import testing
from ada_jax.models import decoder as model_lib
from ada_jax.models import weights

torch = pytest.importorskip("torch", reason="torch is the parity oracle (requirements-dev)")
pytest.importorskip("transformers", reason="transformers is the parity oracle")
import transformers  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3"]
LENGTHS = [5, 9, 12, 1]  # mixed lengths, left-padded to 12, including a 1-token prompt


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
  folder = tmp_path_factory.mktemp(request.param)
  hf_model = testing.save_tiny_hf(request.param, folder, seed=FAMILIES.index(request.param))
  return request.param, folder, hf_model


def _hf_logits(hf_model, tokens, mask):
  pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    return hf_model(
      input_ids=torch.tensor(tokens, dtype=torch.long),
      attention_mask=torch.tensor(mask, dtype=torch.long),
      position_ids=torch.tensor(pos, dtype=torch.long),
    ).logits.numpy()


def _our_logits(config, params, tokens, mask):
  pos = model_lib.positions_from_mask(jnp.asarray(mask))
  return np.asarray(model_lib.logits(config, params, tokens, pos, mask))


def test_logits_match_transformers(checkpoint):
  family, folder, hf_model = checkpoint
  config, params = weights.load_hf(folder)
  assert config.family == family
  if family == "llama":
    assert config.rope_scaling is not None and config.rope_scaling.factor == 32.0
    assert config.tie_embeddings
  tokens, mask = testing.left_padded_batch(LENGTHS, 12, config.vocab_size, seed=1)
  diff = np.abs(_our_logits(config, params, tokens, mask) - _hf_logits(hf_model, tokens, mask))
  assert diff[mask].max() <= 1e-4


def test_greedy_continuation_matches_transformers(checkpoint):
  family, folder, hf_model = checkpoint
  config, params = weights.load_hf(folder)
  tokens, mask = testing.left_padded_batch(LENGTHS, 12, config.vocab_size, seed=2)
  ours = testing.greedy_reference(config, params, tokens, mask, steps=32)
  hf_model.generation_config.eos_token_id = None
  hf_model.generation_config.pad_token_id = 0
  with torch.no_grad():
    ref = hf_model.generate(
      torch.tensor(tokens, dtype=torch.long),
      attention_mask=torch.tensor(mask, dtype=torch.long),
      max_new_tokens=32,
      min_new_tokens=32,
      do_sample=False,
    )
  np.testing.assert_array_equal(ours, ref[:, tokens.shape[1] :].numpy())


def test_save_hf_round_trips_through_transformers(checkpoint, tmp_path):
  family, folder, hf_model = checkpoint
  config, params = weights.load_hf(folder)
  weights.save_hf(config, params, tmp_path / "out")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
  tokens, mask = testing.left_padded_batch(LENGTHS, 12, config.vocab_size, seed=3)
  diff = np.abs(_hf_logits(reloaded, tokens, mask) - _hf_logits(hf_model, tokens, mask))
  assert diff[mask].max() <= 1e-5


def test_sharded_save_and_load_onto_a_mesh(tmp_path):
  config = model_lib.preset("tiny-qwen2")
  params = model_lib.init_params(config, jax.random.key(0))
  weights.save_hf(config, params, tmp_path, max_shard_bytes=64 << 10)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  shardings = jax.tree.map(lambda _: sharding, params)
  loaded_config, loaded = weights.load_hf(tmp_path, shardings=shardings)
  assert loaded_config == config
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
    np.testing.assert_array_equal(a, b)
    assert b.sharding == sharding


def test_bfloat16_load(checkpoint):
  _, folder, _ = checkpoint
  config, params = weights.load_hf(folder, dtype=jnp.bfloat16)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  tokens, mask = testing.left_padded_batch([3, 6], 6, config.vocab_size)
  out = model_lib.logits(config, params, tokens, model_lib.positions_from_mask(mask), mask)
  assert out.dtype == jnp.float32 and np.isfinite(np.asarray(out)).all()


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def saved(tmp_path):
  config = model_lib.preset("tiny-llama")
  weights.save_hf(config, model_lib.init_params(config, jax.random.key(0)), tmp_path)
  return tmp_path


def _edit_config(folder, **changes):
  path = pathlib.Path(folder) / "config.json"
  cfg = json.loads(path.read_text())
  for k, v in changes.items():
    if v is None:
      cfg.pop(k)
    else:
      cfg[k] = v
  path.write_text(json.dumps(cfg))


def _rewrite_tensors(folder, edit):
  from safetensors.numpy import load_file, save_file

  file = pathlib.Path(folder) / "model.safetensors"
  tensors = load_file(str(file))
  edit(tensors)
  save_file(tensors, str(file))


def test_missing_config_field_is_named(saved):
  _edit_config(saved, hidden_size=None)
  with pytest.raises(weights.CheckpointError, match="hidden_size"):
    weights.load_hf(saved)


def test_bad_config_value_is_named(saved):
  _edit_config(saved, num_key_value_heads=3)
  with pytest.raises(weights.CheckpointError, match="num_kv_heads"):
    weights.load_hf(saved)


def test_unsupported_model_type(saved):
  _edit_config(saved, model_type="gpt2")
  with pytest.raises(weights.CheckpointError, match="gpt2"):
    weights.load_hf(saved)


def test_wrong_shape_tensor_is_named(saved):
  name = "model.layers.1.mlp.up_proj.weight"
  _rewrite_tensors(saved, lambda t: t.__setitem__(name, t[name][:-1]))
  with pytest.raises(weights.CheckpointError, match=name.replace(".", r"\.")):
    weights.load_hf(saved)


def test_missing_tensor_is_named(saved):
  name = "model.layers.0.self_attn.k_proj.weight"
  _rewrite_tensors(saved, lambda t: t.pop(name))
  with pytest.raises(weights.CheckpointError, match="missing.*k_proj"):
    weights.load_hf(saved)


def test_unexpected_tensor_is_named(saved):
  _rewrite_tensors(
    saved,
    lambda t: t.__setitem__("model.layers.7.mlp.up_proj.weight", np.zeros((2, 2), np.float32)),
  )
  with pytest.raises(weights.CheckpointError, match="layers.7"):
    weights.load_hf(saved)


def test_missing_folder_and_offline_hub_id(tmp_path, monkeypatch):
  with pytest.raises(weights.CheckpointError, match="no such folder"):
    weights.load_hf(tmp_path / "nope" / "deeper")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  with pytest.raises(weights.CheckpointError, match="huggingface-cli download"):
    weights.load_hf("meta-llama/Llama-3.2-3B-Instruct")


@pytest.mark.parametrize("keep", [0.5, 0.0, 8])
def test_a_truncated_or_empty_weights_file_is_named(saved, keep):
  """Half a file (the example: a copy cut short), an empty one, or a header cut short:
  safetensors' own error named no file."""
  file = saved / "model.safetensors"
  data = file.read_bytes()
  file.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
  with pytest.raises(weights.CheckpointError, match=f"{file}: not a readable safetensors file"):
    weights.load_hf(saved)


@pytest.mark.parametrize("shard_bytes", [4 << 30, 64 << 10])
def test_saved_weights_have_the_mode_of_the_other_files(tmp_path, shard_bytes):
  """0644 under the usual umask, as config.json (safetensors writes 0600: an inference
  server run as another user could not read the exported folder); every shard alike."""
  import os
  import stat

  config = model_lib.preset("tiny-llama")
  old = os.umask(0o022)
  try:
    weights.save_hf(
      config,
      model_lib.init_params(config, jax.random.key(0)),
      tmp_path,
      max_shard_bytes=shard_bytes,
    )
  finally:
    os.umask(old)
  shards = sorted(tmp_path.glob("*.safetensors"))
  assert len(shards) == (1 if shard_bytes > 1 << 20 else len(shards)) and shards
  for path in [*shards, tmp_path / "config.json"]:
    assert stat.S_IMODE(path.stat().st_mode) == 0o644, path.name
