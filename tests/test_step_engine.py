"""The controller on the slot pool (`rollout.engine.SlotEngine` under `rl.controller.run_step`): the
tokens are the seeds' own, `stream`'s decisions do not depend on the grader's speed,
exited prompts' rows are cancelled, every method runs through it, and a fixed-quota step
is the same under both schedules."""

import contextlib
import threading
import time

import jax
import numpy as np
import pytest

from ada_jax import distributed, step
from ada_jax.data.prompts import PromptSet
from ada_jax.models import decoder as model_lib
from ada_jax.rl import controller
from ada_jax.rl.rules import AdaConfig, DapoConfig, EstConfig, SeqConfig
from ada_jax.rollout import engine as rollout_engine
from ada_jax.rollout import sampler as sampler_lib

STOPS = tuple(range(3, 512, 16))  # ~6% of the vocabulary: lengths vary row to row
BUDGET = 8


class _Tokens:
  """Decodes a response to its token ids as text (the grader below reads them back)."""

  def decode_many(self, rows):
    return [" ".join(str(int(t)) for t in r) for r in rows]


def _reward(text: str) -> float:
  return float(int(text.split()[0]) % 3 == 0) if text else 0.0


class _Grader:
  """`SharedGrader`'s interface; `delay` makes each batch's grades arrive late, from a
  thread, by a different random time per batch."""

  def __init__(self, delay: float = 0.0, reward=_reward, seed: int = 0):
    self.delay, self.reward, self.rng = delay, reward, np.random.default_rng(seed)
    self.batches = []

  def submit(self, texts, answers):
    assert len(texts) == len(answers)
    box = {"done": threading.Event()}
    wait = self.delay * self.rng.random()

    def grade():
      time.sleep(wait)
      box["rewards"] = np.asarray([self.reward(t) for t in texts], np.float32)
      box["done"].set()

    threading.Thread(target=grade).start()
    self.batches.append(len(texts))
    return box

  def collect(self, box):
    box["done"].wait()
    return box["rewards"]


def _prompt_set(num: int) -> PromptSet:
  rng = np.random.default_rng(0)
  tokens = tuple(
    rng.integers(5, 500, size=int(rng.integers(2, 9))).astype(np.int32) for _ in range(num)
  )
  names = tuple(f"p{i}" for i in range(num))
  return PromptSet(names, names, tuple("0" for _ in names), ("test",) * num, tokens, 0)


@pytest.fixture(scope="module")
def tiny():
  config = model_lib.preset("tiny-llama")
  params = model_lib.init_params(config, jax.random.key(0))
  smp = sampler_lib.Sampler(
    config, max_new_tokens=BUDGET, stop_ids=STOPS, chunk_rows=8, prompts_per_chunk=2,
    prompt_buckets=(8,), segment_steps=2, queue_rows=8,
  )  # fmt: skip
  return config, params, smp


def _step(tiny, config, prompts, key, grader, schedule):
  """(result, est state, engine) of one step of `config` under `schedule`."""
  _, params, smp = tiny
  engine = rollout_engine.SlotEngine(smp, params, _Tokens(), grader, prompts, key, prompt_len=8)
  result, est = controller.run_step(
    config,
    prompts.ids,
    engine,
    np.random.default_rng(0),
    more_prompts=prompts.more_prompts,
    schedule=schedule,
  )
  engine.finish()
  return result, est, engine


def _run(tiny, config: AdaConfig, grader=None, batch=6, seed=0, num=24, guard=None):
  """One stream step; under `guard()` (the `no_implicit_transfers` fixture) if given."""
  ps = _prompt_set(num)
  prompts = step.StepPrompts(ps, iter(np.arange(num).reshape(-1, batch)), batch)
  key = jax.random.key(seed)
  with guard() if guard else contextlib.nullcontext():
    result, _, engine = _step(tiny, config, prompts, key, grader or _Grader(), "stream")
  return result, engine, prompts


def test_fixed_quota_rows_are_the_tokens_generate_draws(tiny):
  # GRPO: row ids 0..B·n-1, prompt-major, so the stream's rows are `generate`'s rows.
  _, params, smp = tiny
  result, drive, prompts = _run(tiny, AdaConfig(method="grpo", n=4))
  out = drive.responses()
  key = jax.random.fold_in(jax.random.key(0), 0)  # the pool's key: round 0's
  ref, _ = smp.generate(params, prompts.tokens, np.repeat(np.arange(6), 4), key)
  for k in ("tokens", "logprobs", "lengths"):
    np.testing.assert_array_equal(out[k], ref[k], err_msg=k)
  assert sorted(result.handles) == list(range(24))
  np.testing.assert_array_equal(result.rewards, [_reward(t) for t in _Tokens().decode_many(
    [ref["tokens"][h][: ref["lengths"][h]] for h in result.handles])])  # fmt: skip
  c = drive.counters
  assert c.responses == 24 and c.tokens == ref["lengths"].sum() and c.tokens_cancelled == 0
  assert 0 < c.decode_steps and c.slot_steps == 8 * c.decode_steps


@pytest.mark.parametrize("method,chance", [("pos", 0.0), ("balance", 0.0), ("balance", 0.4)])
def test_decisions_do_not_depend_on_the_graders_speed(tiny, method, chance):
  # chance > 0: the exit-chance rule stops prompts at boundaries, from graded rows only.
  config = AdaConfig(
    method=method, n=4, seq=SeqConfig(samples_per_round=4, max_rounds=3, min_exit_chance=chance)
  )
  fast, fast_drive, _ = _run(tiny, config, _Grader(0.0))
  slow, slow_drive, _ = _run(tiny, config, _Grader(0.03, seed=1))
  assert fast.handles == slow.handles
  np.testing.assert_array_equal(fast.advantages, slow.advantages)
  assert fast.stats.pool_size.tolist() == slow.stats.pool_size.tolist()
  assert fast_drive.counters.decode_steps == slow_drive.counters.decode_steps
  assert fast.stats.stopped == slow.stats.stopped and (bool(fast.stats.stopped) == (chance > 0))
  for k in ("tokens", "lengths"):
    np.testing.assert_array_equal(fast_drive.responses()[k], slow_drive.responses()[k])


def test_graded_rows_are_the_seeds_tokens_whatever_was_cancelled(tiny, no_implicit_transfers):
  # Every prompt exits on its first M graded rows (all rewards 1; M, a round's worth, is
  # the pool a prompt exits on under `stream`): rows of exited prompts are cancelled
  # mid-decode, and no other row's tokens change.
  _, params, smp = tiny
  config = AdaConfig(method="pos", n=2, seq=SeqConfig(samples_per_round=4, max_rounds=2))
  grader = _Grader(reward=lambda t: 1.0)
  result, drive, prompts = _run(tiny, config, grader, guard=no_implicit_transfers)
  out = drive.responses()
  graded = out["lengths"] > 0
  assert drive.counters.tokens_cancelled > 0 and (~graded).any()
  # The step's decode cost in tokens: finished responses' tokens and the cancelled ones.
  c = drive.counters
  assert c.metrics()["tokens_decoded"] == out["lengths"].sum() + c.tokens_cancelled
  key = jax.random.fold_in(jax.random.key(0), 0)
  row_prompt = [drive.row_prompt[r] for r in range(len(drive.row_prompt))]
  ref, _ = smp.generate(params, prompts.tokens, row_prompt, key)
  np.testing.assert_array_equal(out["tokens"][graded], ref["tokens"][graded])
  np.testing.assert_array_equal(out["lengths"][graded], ref["lengths"][graded])
  # Each prompt's pool holds M..R·M rows, all positive: advantages 0, pools from the front.
  assert all(4 <= s <= 8 for s in result.stats.pool_size)


def test_dapo_extra_prompts_join_the_queue(tiny):
  # Groups are uniform unless a row's first token is a multiple of 3 and another's is not:
  # DAPO asks for more prompts while the step runs; they come from the iterator.
  config = AdaConfig(method="dapo", n=4, dapo=DapoConfig(max_extra_passes=2))
  result, drive, prompts = _run(tiny, config)
  assert len(prompts.indices) > 6, "no extra prompt was queued"
  assert len(result.prompt_ids) == len(prompts.indices)
  assert set(result.prompt_index.tolist()) <= set(range(len(prompts.indices)))


def test_est_quota_is_its_budget(tiny):
  config = AdaConfig(method="est", est=EstConfig(budget_per_prompt=3.0))
  result, drive, _ = _run(tiny, config)
  assert result.stats.rows_requested == 18 == len(result.handles) == drive.counters.responses


@pytest.mark.parametrize(
  "config",
  [AdaConfig(method="grpo", n=4), AdaConfig(method="est", est=EstConfig(budget_per_prompt=3.0))],
  ids=["grpo", "est"],
)
def test_fixed_quotas_give_the_rounds_step_exactly(tiny, config, no_implicit_transfers):
  # One pass of fixed quotas: `stream` only overlaps grading, so the step is `rounds`' own.
  ps = _prompt_set(6)
  steps = {}
  for schedule in ("rounds", "stream"):
    prompts = step.StepPrompts(ps, iter([np.arange(6)]), 6)
    key = jax.random.key(3)
    with no_implicit_transfers():
      result, est, drive = _step(tiny, config, prompts, key, _Grader(), schedule)
    out = drive.responses()
    steps[schedule] = (result, est, out["tokens"][np.asarray(result.handles)], drive.counters)
  (a, est_a, tok_a, ca), (b, est_b, tok_b, cb) = steps["rounds"], steps["stream"]
  np.testing.assert_array_equal(a.prompt_index, b.prompt_index)
  np.testing.assert_array_equal(a.rewards, b.rewards)
  np.testing.assert_array_equal(a.advantages, b.advantages)
  np.testing.assert_array_equal(tok_a, tok_b)
  assert ca.tokens == cb.tokens and ca.decode_steps == cb.decode_steps
  if est_a is not None:
    assert distributed.fingerprint(est_a) == distributed.fingerprint(est_b)


def test_step_metrics_are_one_type_that_the_agreement_compares_by_field():
  """The multi-host agreement compares the agreed fields themselves (a renamed counter is
  a TypeError where the step builds its metrics, not a silent None), and the flat row
  holds every field, the rule's statistics and the update's figures."""
  counters = rollout_engine.RolloutCounters(responses=4, tokens=20, decode_steps=7)
  base = dict(
    reward_mean=0.5, pass_rate=0.5, first_round_pass_rate=0.25, samples_drawn=8,
    active_prompts_per_round=[2, 1], zero_signal_frac=0.5, **counters.metrics(),
  )  # fmt: skip
  m = step.StepMetrics(**base, ada={"ada/rounds": 2.0}, train={"loss": 0.1})
  agreed = [f.name for f in step.dataclasses.fields(m) if f.metadata.get("agreed")]
  assert agreed == [
    "reward_mean", "pass_rate", "first_round_pass_rate", "samples_drawn",
    "active_prompts_per_round", "zero_signal_frac", "response_len_mean", "rows_computed",
    "decode_steps", "tokens_cancelled",
  ]  # fmt: skip
  assert m.agreed() == [0.5, 0.5, 0.25, 8, [2, 1], 0.5, 5.0, 0, 7, 0]
  row = m.as_dict()
  assert row["decode_steps"] == 7 and row["ada/rounds"] == 2.0 and row["loss"] == 0.1
  assert "ada" not in row and "train" not in row and row["tokens_decoded"] == 20
  renamed = {**base, "decode_step_count": base.pop("decode_steps")}
  with pytest.raises(TypeError, match="decode_step_count"):
    step.StepMetrics(**renamed)
  with pytest.raises(TypeError, match="decode_steps"):  # an agreed field cannot be left out
    step.StepMetrics(**base)
