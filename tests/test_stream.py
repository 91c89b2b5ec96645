"""The controller under the stream schedule: the exit rule shared with `rounds`, the boundary
contract (decisions on rows finished by the previous boundary), and the step it returns."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ada_jax.rl import advantages as adv_lib
from ada_jax.rl import controller, rules
from ada_jax.rl import simulate as sim
from ada_jax.rl.controller import Controller
from ada_jax.rl.rules import RULES, AdaConfig, DapoConfig, EstConfig, SeqConfig, pool_meets_exit
from ada_jax.testing import rounds_step

SEQ = [
  AdaConfig(method="pos"),
  AdaConfig(method="balance"),
  AdaConfig(method="balance", seq=SeqConfig(min_exit_chance=0.3)),
  AdaConfig(
    method="balance", n=4, seq=SeqConfig(samples_per_round=2, max_rounds=4, k_pos=2, k_neg=2)
  ),
  AdaConfig(method="pos", n=4, seq=SeqConfig(samples_per_round=4, max_rounds=3, k_pos=2)),
]


def _rule(rewards, cfg, min_pool=None):
  r = np.asarray(rewards)
  k_pos, k_neg = rules.thresholds(cfg)
  pos = int(np.sum(r > 0.5))
  return r.size >= (min_pool or cfg.n) and pos >= k_pos and r.size - pos >= k_neg


def test_exit_rule_by_hand_and_bad_method():
  pos, bal = AdaConfig(method="pos"), AdaConfig(method="balance")
  assert not pool_meets_exit([1.0, 1.0, 1.0], pos)  # Fewer than n = 4 responses.
  assert pool_meets_exit([0.0, 0.0, 0.0, 1.0], pos)
  assert not pool_meets_exit([0.0, 0.0, 0.0, 1.0], bal)
  assert pool_meets_exit([1.0, 0.0, 1.0, 0.0], bal)
  assert not pool_meets_exit([1.0, 0.0, 1.0, 0.0], bal, min_pool=8)
  with pytest.raises(ValueError, match="method='grpo'"):
    pool_meets_exit([1.0], AdaConfig(method="grpo"))


@settings(max_examples=40, deadline=None)
@given(
  cfg=st.sampled_from(SEQ),
  rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6),
  seed=st.integers(0, 1000),
)
def test_rounds_retires_exactly_the_prompts_that_meet_the_exit_rule(cfg, rates, seed):
  """`rounds` (the controller's `drive_rounds`) samples a prompt again after a round iff
  its pool does not meet `pool_meets_exit` (and, with `min_exit_chance`, the exit-chance
  rule did not stop it): one rule for both schedules."""
  result, rounds = sim.trace_step(cfg, rates, seed=seed)
  stopped = set(result.stats.stopped)
  assert not stopped or cfg.seq.min_exit_chance
  pools = [[] for _ in rates]
  for j, table in enumerate(rounds):
    for i, row in enumerate(table):
      drawn = row[~np.isnan(row)].tolist()
      if j > 0 and (drawn or i not in stopped):
        assert bool(drawn) == (not pool_meets_exit(pools[i], cfg)), (i, j, pools[i])
      pools[i] += drawn
  for i, pool in enumerate(pools):  # Never exited: drew all R·M, or was stopped.
    cap = cfg.seq.samples_per_round * cfg.seq.max_rounds
    assert pool_meets_exit(pool, cfg) or len(pool) == cap or i in stopped


def _run(cfg, rates, seed, finish_prob=0.4, shuffle=False, **kw):
  """Drives the controller under `stream` with a fake engine: each live row finishes in a segment
  with probability `finish_prob`; the k-th row of prompt p has a fixed reward."""
  rng, order_rng = np.random.default_rng(seed), np.random.default_rng(seed + 2)
  table = np.random.default_rng(seed + 1).random((256, 256))
  rates = list(rates)

  def more(k):
    rates.extend(np.random.default_rng([seed, len(rates)]).random(k).tolist())
    return [f"x{len(rates) - k + i}" for i in range(k)]

  rule = RULES[cfg.method]
  plan = rule.plan(cfg, [f"p{i}" for i in range(len(rates))], rule.init_state(cfg), None)
  if "quotas" in kw:
    plan = dataclasses.replace(plan, quotas=np.asarray(kw.pop("quotas")))
  ctl = Controller(cfg, len(rates), more_prompts=more, plan=plan, **kw, schedule="stream")
  reward, issued, live, cancelled = {}, {}, [], set()
  log = []

  def enqueue(rows, prompts):
    for row, p in zip(rows.tolist(), prompts.tolist(), strict=True):
      k = issued[p] = issued.get(p, 0) + 1
      reward[row] = float(table[p, k - 1] < rates[p])
      live.append(row)

  enqueue(*ctl.start())
  while not ctl.done:
    finished = [r for r in live if rng.random() < finish_prob]
    live[:] = [r for r in live if r not in set(finished)]
    if shuffle:
      finished = order_rng.permutation(finished).tolist()
    awaiting = ctl.awaiting_grades.tolist()
    d = ctl.boundary(finished, [reward[r] for r in awaiting])
    log.append((d.exited.tolist(), d.cancel.tolist(), d.enqueue.tolist()))
    cancelled |= set(d.cancel.tolist())
    live[:] = [r for r in live if r not in cancelled]
    enqueue(d.enqueue, d.enqueue_prompt)
  return ctl, ctl.result(np.random.default_rng(0)), log, issued


@settings(max_examples=40, deadline=None)
@given(
  cfg=st.sampled_from(SEQ),
  rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8),
  seed=st.integers(0, 10_000),
  window=st.sampled_from([None, 1, 3, 16]),
)
def test_stream_seq_step_keeps_the_rules(cfg, rates, seed, window):
  ctl, res, _, issued = _run(cfg, rates, seed, window=window)
  cap = cfg.seq.samples_per_round * cfg.seq.max_rounds
  b = len(rates)
  for p in range(b):
    pool = np.asarray([ctl.graded[p][r] for r in sorted(ctl.graded[p])], np.float32)
    assert issued[p] <= cap and pool.size <= cap
    # Exited on the rule (then >= n responses), drew all R·M, or was stopped by the
    # exit-chance rule (once a round's worth was graded).
    assert pool.size >= cfg.n and (_rule(pool, cfg) or issued[p] == cap or p in ctl.state.stopped)
    # Half-then-fill selection and the global baseline, on the pool in row-id order.
    sel = adv_lib.select_group(pool, cfg.n)
    kept = res.prompt_index == p
    np.testing.assert_array_equal(res.rewards[kept], pool[sel])
    np.testing.assert_allclose(res.advantages[kept], pool[sel] - pool.mean(), atol=1e-6)
  assert res.stats.rows_selected == cfg.n * b
  assert res.stats.signal_fraction == pytest.approx(
    np.mean([len(set(ctl.graded[p].values())) > 1 for p in range(b)])
  )


@settings(max_examples=25, deadline=None)
@given(
  cfg=st.sampled_from(SEQ + [AdaConfig(method="dapo", dapo=DapoConfig(prompts_per_pass=2))]),
  rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6),
  seed=st.integers(0, 10_000),
)
def test_decisions_do_not_depend_on_the_order_rows_are_reported(cfg, rates, seed):
  """The step is a function of which rows finished in which segment and their rewards:
  the order within a segment (e.g. which host reported first) changes nothing."""
  a = _run(cfg, rates, seed)
  b = _run(cfg, rates, seed, shuffle=True)
  assert a[2] == b[2]
  np.testing.assert_array_equal(a[1].advantages, b[1].advantages)
  assert a[1].handles == b[1].handles


def test_exit_waits_for_grades_of_the_previous_segment():
  cfg = AdaConfig(method="pos", n=4, seq=SeqConfig(samples_per_round=4, max_rounds=2))
  ctl = Controller(cfg, 1, schedule="stream")
  rows, prompts = ctl.start()
  assert rows.tolist() == [0, 1, 2, 3] and prompts.tolist() == [0] * 4
  d = ctl.boundary([0, 1, 2, 3], [])  # All finished, none graded yet: no decision.
  assert d.exited.size == 0 and d.enqueue.size == 0 and d.cancel.size == 0
  assert ctl.awaiting_grades.tolist() == [0, 1, 2, 3]
  with pytest.raises(ValueError, match="3 given for 4"):
    ctl.boundary([], [1.0, 0.0, 0.0])
  d = ctl.boundary([], [0.0, 0.0, 0.0, 1.0])
  assert d.exited.tolist() == [0] and ctl.done


def test_retired_prompt_rows_are_cancelled_and_late_finishers_join_its_pool():
  cfg = AdaConfig(method="pos", n=4, seq=SeqConfig(samples_per_round=8, max_rounds=2))
  ctl = Controller(cfg, 2, window=8, min_pool=4, schedule="stream")
  ctl.start()  # Rows 0-7: prompt 0; 8-15: prompt 1.
  ctl.boundary([0, 1, 2, 3, 8], [])
  d = ctl.boundary([4, 9], [1.0, 0.0, 0.0, 0.0, 0.0])
  # Prompt 0: 4 graded with a positive: exits; its rows 5-7 are cancelled; row 4, finished
  # before the decision, is graded next and joins the pool. Prompt 1 tops its window up.
  assert d.exited.tolist() == [0] and d.cancel.tolist() == [5, 6, 7]
  assert d.enqueue.tolist() == [16] and d.enqueue_prompt.tolist() == [1]
  with pytest.raises(ValueError, match="row 5 is not queued or in flight"):
    ctl.boundary([5], [0.0, 0.0])
  assert ctl.rows_cancelled == 3


def test_under_stream_a_prompt_exits_on_a_rounds_worth_of_responses():
  """The default pool to exit on is M (a round's worth), so pos keeps the signal of
  `rounds`: four graded with a positive wait for the other four of the window."""
  cfg = AdaConfig(method="pos", n=4, seq=SeqConfig(samples_per_round=8, max_rounds=2))
  ctl = Controller(cfg, 1, schedule="stream")
  assert ctl.min_pool == 8 and Controller(cfg, 1, schedule="rounds").min_pool == 4
  ctl.start()
  ctl.boundary([0, 1, 2, 3], [])
  d = ctl.boundary([4, 5, 6, 7], [1.0, 0.0, 0.0, 0.0])
  assert d.exited.size == 0 and d.cancel.size == 0
  d = ctl.boundary([], [1.0, 1.0, 0.0, 0.0])
  assert d.exited.tolist() == [0] and ctl.done


@pytest.mark.parametrize("order,expected", [("exit", [1, 1, 0, 0]), ("prompt", [0, 0, 1, 1])])
def test_stream_lays_seq_groups_out_in_exit_order(order, expected):
  """Prompt 1 meets the rule at the second boundary; prompt 0 draws its R·M = 2 rows
  without a positive (never exits): under 'exit' its group goes last, as `rounds` does."""
  cfg = AdaConfig(
    method="pos", n=2, seq=SeqConfig(samples_per_round=2, max_rounds=1, batch_order=order)
  )
  ctl = Controller(cfg, 2, schedule="stream")
  assert ctl.start()[0].tolist() == [0, 1, 2, 3]
  ctl.boundary([0, 1, 2, 3], [])
  d = ctl.boundary([], [0.0, 0.0, 1.0, 0.0])
  assert sorted(d.exited.tolist()) == [0, 1] and ctl.done
  assert ctl.state.exit_boundary == {1: 2}
  res = ctl.result(np.random.default_rng(0))
  assert res.prompt_index.tolist() == expected


@pytest.mark.parametrize("method", ["grpo", "est"])
def test_fixed_quota_methods_give_run_steps_result(method):
  """GRPO and Est through the stream engine: the same pools, selection and advantages as
  `rounds` when the k-th response of each prompt has the same reward."""
  cfg = AdaConfig(method=method, n=4, est=EstConfig(budget_per_prompt=4.0))
  rates = [0.0, 0.3, 0.6, 1.0, 0.5]
  quotas = np.array([4, 6, 2, 4, 4])
  table = np.random.default_rng(1).random((256, 256))  # `_run`'s rewards for seed 0.
  ctl, res, _, issued = _run(cfg, rates, 0, quotas=quotas)
  want = quotas if method == "est" else np.full(5, 4)
  assert [issued[p] for p in range(5)] == want.tolist() and ctl.rows_cancelled == 0
  # Rounds, with rows drawn in the same per-prompt order.
  count = [0] * 5

  def draw(rows):
    out = []
    for p in rows.tolist():
      out.append(float(table[p, count[p]] < rates[p]))
      count[p] += 1
    return np.asarray(out, np.float32), [None] * rows.size

  if method == "est":  # Est's quotas come from its statistics: every row is kept.
    assert res.stats.rows_selected == quotas.sum()
    for p in range(5):
      pool = np.asarray([ctl.graded[p][r] for r in sorted(ctl.graded[p])], np.float32)
      np.testing.assert_array_equal(pool, table[p, : quotas[p]] < rates[p])
      np.testing.assert_array_equal(res.rewards[res.prompt_index == p], pool)
    return
  ref, _ = rounds_step(cfg, [f"p{i}" for i in range(5)], draw, np.random.default_rng(0))
  np.testing.assert_array_equal(res.prompt_index, ref.prompt_index)
  np.testing.assert_array_equal(res.rewards, ref.rewards)
  np.testing.assert_array_equal(res.advantages, ref.advantages)
  assert res.stats.signal_fraction == ref.stats.signal_fraction


@settings(max_examples=25, deadline=None)
@given(rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6), seed=st.integers(0, 999))
def test_dapo_stream_keeps_at_most_b_mixed_groups_within_the_cap(rates, seed):
  cfg = AdaConfig(method="dapo", n=4, dapo=DapoConfig(max_extra_passes=2, prompts_per_pass=3))
  ctl, res, _, issued = _run(cfg, rates, seed)
  b = len(rates)
  assert len(ctl.active) - b <= 6  # dapo.max_extra_passes * dapo.prompts_per_pass.
  groups = np.unique(res.prompt_index)
  assert groups.size <= b and res.stats.zero_signal_fraction == (0.0 if groups.size else 1.0)
  for p in groups.tolist():
    assert len(set(res.rewards[res.prompt_index == p].tolist())) == 2
  assert all(q == 4 for q in issued.values())


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(num_prompts=0), "num_prompts"),
    (dict(window=0), "window"),
    (dict(min_pool=3), "min_pool"),
    (dict(min_pool=33), "min_pool"),
  ],
)
def test_bad_controller_arguments_are_named(kwargs, match):
  args = dict(num_prompts=2) | kwargs
  with pytest.raises(ValueError, match=match):
    Controller(AdaConfig(method="pos"), args.pop("num_prompts"), **args, schedule="stream")


def test_grpo_quotas_are_checked():
  with pytest.raises(ValueError, match="quotas"):
    plan = rules.Plan(quotas=np.array([4, 0]))
    Controller(AdaConfig(method="est"), 2, plan=plan, schedule="stream")
  with pytest.raises(RuntimeError, match="start"):
    Controller(AdaConfig(method="grpo"), 2, schedule="stream").boundary([], [])


def test_an_engine_that_never_finishes_a_row_fails_instead_of_hanging():
  class Lost(controller.DrawEngine):
    def decode(self, *, to_end):
      self.queued = []  # drops the rows without reporting them
      return []

  with pytest.raises(RuntimeError, match="nothing to decode or grade"):
    controller.run_step(
      AdaConfig(method="grpo"), ["a"], Lost(lambda p: p * 0.0), np.random.default_rng(0),
      schedule="stream",
    )  # fmt: skip
