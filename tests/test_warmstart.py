"""Tests for ada_jax.warmstart: response-only loss, batch layout, learning, determinism."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ada_jax import metrics as metrics_lib
from ada_jax.data import arith
from ada_jax.models import decoder as model_lib
from ada_jax.rl import warmstart

TASK = arith.ArithConfig(levels=(1,), ops=("+",))


@pytest.fixture(scope="module")
def tok():
  return arith.load_tokenizer()


def _tiny(tok):
  return model_lib.ModelConfig(
    family="llama",
    vocab_size=tok.vocab_size,
    embed_dim=32,
    mlp_dim=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10_000.0,
  )


def test_encode_examples_layout(tok):
  examples = [{"problem": "1+1=", "answer": "2"}, {"problem": "12+34=", "answer": "46"}]
  b = arith.encode_examples(tok, examples)
  ids = lambda s: [tok.token_to_id(c) for c in s]
  boxed, eos, pad, bos = tok.token_to_id(arith.BOXED), tok.eos_ids[0], tok.pad_id, tok.bos_id
  # Lp = 7 ('<bos>12+34='), Lr = 5 ('\boxed{', '4', '6', '}', '<eos>').
  assert b["tokens"].shape == (2, 12) and b["tokens"].dtype == np.int32
  row0 = [pad, pad, bos, *ids("1+1="), boxed, *ids("2}"), eos, pad]
  row1 = [bos, *ids("12+34="), boxed, *ids("46}"), eos]
  np.testing.assert_array_equal(b["tokens"], [row0, row1])
  np.testing.assert_array_equal(b["attention_mask"][0], [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0])
  np.testing.assert_array_equal(b["loss_mask"][0], [0] * 7 + [1, 1, 1, 1, 0])
  np.testing.assert_array_equal(b["loss_mask"][1], [0] * 7 + [1] * 5)
  with pytest.raises(ValueError, match="exceeds prompt_len=4"):
    arith.encode_examples(tok, examples, prompt_len=4)
  with pytest.raises(ValueError, match=r"examples\[0\] has no field 'answer'"):
    arith.encode_examples(tok, [{"problem": "1+1="}])


def test_cross_entropy_counts_only_masked_targets():
  # V = 4, T = 4. Targets at positions 2 and 3 only (the "response").
  tokens = jnp.array([[0, 1, 2, 3]])
  loss_mask = jnp.array([[False, False, True, True]])
  logits = jnp.zeros((1, 4, 4))
  # Position 0 predicts prompt token 1: make it confidently wrong. It must not count.
  logits = logits.at[0, 0, 3].set(50.0)
  # Position 1 predicts target 2 with logit ln 3 over three zeros: p = 3 / 6 = 0.5.
  logits = logits.at[0, 1, 2].set(jnp.log(3.0))
  # Position 2 predicts target 3 uniformly: p = 1/4. Position 3 predicts nothing.
  logits = logits.at[0, 3].set(jnp.array([9.0, -9.0, 4.0, 1.0]))
  loss, m = warmstart.masked_cross_entropy(logits, tokens, loss_mask)
  np.testing.assert_allclose(loss, (np.log(2.0) + np.log(4.0)) / 2, rtol=1e-6)
  assert float(m["targets"]) == 2
  # argmax: position 1 -> 2 (right); position 2 -> ties, argmax 0 (wrong).
  np.testing.assert_allclose(m["token_accuracy"], 0.5)
  assert float(m["sequence_accuracy"]) == 0.0
  # An all-False mask is a zero loss, not a NaN.
  loss0, _ = warmstart.masked_cross_entropy(logits, tokens, jnp.zeros_like(loss_mask))
  assert float(loss0) == 0.0


def test_sft_loss_ignores_prompt_targets(tok):
  """The model loss is the mean NLL of the response tokens only, recomputed by hand from the
  raw logits; the all-token mean (prompt targets included) differs from it."""
  config = _tiny(tok)
  params = model_lib.init_params(config, jax.random.key(0))
  b = arith.encode_examples(tok, arith.examples(TASK, "train", 4, seed=0))
  loss, _ = jax.jit(warmstart.sft_loss, static_argnums=0)(config, params, b)
  positions = model_lib.positions_from_mask(b["attention_mask"])
  logits = jax.jit(model_lib.logits, static_argnums=0)(
    config, params, b["tokens"], positions, b["attention_mask"]
  )
  logp = np.asarray(jax.nn.log_softmax(logits, -1))
  nll = []
  for i, row in enumerate(b["tokens"]):
    for t in range(1, row.shape[0]):
      if b["loss_mask"][i, t]:
        nll.append(-logp[i, t - 1, row[t]])
  assert len(nll) == int(b["loss_mask"].sum())
  np.testing.assert_allclose(loss, np.mean(nll), rtol=1e-5)
  every = b["attention_mask"].copy()
  every[:, 0] = False  # nothing predicts the first token
  all_tokens, _ = warmstart.masked_cross_entropy(logits, b["tokens"], every)
  assert abs(float(all_tokens) - float(loss)) > 1e-3


def test_loss_decreases_and_is_deterministic(tok):
  config = _tiny(tok)
  params = model_lib.init_params(config, jax.random.key(1))
  ws = warmstart.WarmStartConfig(
    steps=40, batch_size=32, learning_rate=1e-2, seed=3, warmup_steps=5, task=TASK
  )
  sft = warmstart.SftStep.make(config, ws)  # built once: the runs below share its compile
  run = lambda c: warmstart.warm_start(config, params, tok, c, progress=False, step=sft)
  new, m = run(ws)
  assert m["loss"].shape == (40,) and m["examples"] == 40 * 32
  assert m["loss"][-5:].mean() < 0.6 * m["loss"][:5].mean()
  assert m["token_accuracy"][-5:].mean() > m["token_accuracy"][:5].mean()
  # The caller's params are untouched (donation works on a copy).
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))
  with metrics_lib.CompileCounter() as compiles:
    again, m2 = run(ws)
  assert compiles.count == 0
  np.testing.assert_array_equal(m["loss"], m2["loss"])
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(again), strict=True):
    np.testing.assert_array_equal(a, b)
  _, m3 = run(dataclasses.replace(ws, seed=4))
  assert not np.array_equal(m["loss"], m3["loss"])

  # Early stop: the run with a target accuracy is the same run, cut at the first check
  # (every 5 steps) whose window mean reaches the target.
  windows = m["sequence_accuracy"].reshape(8, 5).mean(1)
  assert windows[-1] > windows[0]
  # Window accuracies are multiples of 1/160: a margin far below that absorbs rounding.
  target = float(windows[-1]) - 1e-4
  first = int(np.argmax(windows >= target))
  _, m4 = run(dataclasses.replace(ws, target_accuracy=target, check_every=5))
  assert m4["reached_target"] and not m["reached_target"]
  assert m4["steps_run"] == 5 * (first + 1) and m["steps_run"] == 40
  assert set(m4["level_accuracy"]) == {1} and m4["level_accuracy"][1].shape == (first + 1,)
  np.testing.assert_array_equal(m4["loss"], m["loss"][: m4["steps_run"]])
  with pytest.raises(ValueError, match="another model or WarmStartConfig"):
    run(dataclasses.replace(ws, learning_rate=2e-2))  # another optimizer: not this step
  # The line the training loop prints: where it stopped, the accuracy and the target.
  assert m4["accuracy"] == pytest.approx(windows[first])
  stop_line = warmstart.describe(m4, dataclasses.replace(ws, target_accuracy=target))
  assert stop_line.startswith(f"warm start: {5 * (first + 1)} of 40 steps, ")
  assert f"stopped early, accuracy {windows[first]:.2f} >= target {target}" in stop_line
  assert "target" not in warmstart.describe(m, ws) and "40 of 40 steps" in warmstart.describe(m, ws)
  assert "target 0.99 not reached" in warmstart.describe(
    m, dataclasses.replace(ws, target_accuracy=0.99)
  )


@pytest.mark.parametrize(
  ("kwargs", "match"),
  [
    ({"steps": 0}, "WarmStartConfig.steps"),
    ({"learning_rate": 0.0}, "WarmStartConfig.learning_rate"),
    ({"final_lr_fraction": 2.0}, "WarmStartConfig.final_lr_fraction"),
    ({"target_accuracy": 1.5}, "WarmStartConfig.target_accuracy"),
    ({"check_every": 0}, "WarmStartConfig.check_every"),
    ({"target_level": 5}, "WarmStartConfig.target_level"),
  ],
)
def test_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    warmstart.WarmStartConfig(**kwargs)


def test_vocab_too_small(tok):
  config = _tiny(tok).replace(vocab_size=8)
  params = model_lib.init_params(config, jax.random.key(0))
  with pytest.raises(ValueError, match="ModelConfig.vocab_size"):
    ws = warmstart.WarmStartConfig(steps=1, batch_size=2, learning_rate=1e-3, task=TASK)
    warmstart.warm_start(config, params, tok, ws, progress=False)
