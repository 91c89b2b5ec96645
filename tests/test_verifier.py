"""Tests for ada_jax.verifier: the hard-timeout pool (hostile inputs, killed and crashed
workers) and the real answer formats of ../shared/data scored through it.
"""

import json
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_rewards import EQUIVALENCE

from ada_jax.rewards import verifier
from ada_jax.rewards.references import reference_answer

TIMEOUT_S = 2.0


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split()[2] != "Z"  # A zombie has exited.
  except FileNotFoundError:
    return False


@pytest.fixture(scope="module")
def pool():
  p = verifier.Verifier(verifier.VerifierConfig(num_workers=2, timeout_s=TIMEOUT_S))
  yield p
  pids = p.worker_pids
  p.close()
  assert not any(_alive(pid) for pid in pids), "reward workers left running"


# ------------------------------------------------------------------------- config


@pytest.mark.parametrize(
  "kwargs, field",
  [
    ({"judge": "llm"}, "judge"),
    ({"num_workers": -1}, "num_workers"),
    ({"timeout_s": 0.0}, "timeout_s"),
    ({"soft_timeout_frac": 1.5}, "soft_timeout_frac"),
    ({"start_method": "fork"}, "start_method"),
  ],
)
def test_config_rejects_bad_values(kwargs, field):
  with pytest.raises(ValueError, match=field):
    verifier.VerifierConfig(**kwargs)


# ------------------------------------------------------------------------------- pool


def test_score_matches_in_process_reward(pool):
  responses = [r for r, _, _ in EQUIVALENCE]
  references = [g for _, g, _ in EQUIVALENCE]
  out = pool.score(responses, references)
  assert out.dtype == np.float32 and out.shape == (len(EQUIVALENCE),)
  np.testing.assert_array_equal(out, [e for _, _, e in EQUIVALENCE])
  stats = pool.last_stats
  assert stats.items == len(EQUIVALENCE)
  assert stats.correct == sum(e for _, _, e in EQUIVALENCE)
  assert stats.no_box == 2  # No box at all, and an unclosed last box.
  assert pool.score([], []).shape == (0,)


def test_prose_boxes_count_as_errors(pool):
  responses = ["\\boxed{the answer is 5}", "\\boxed{\\text{no solution}}", "\\boxed{5}", "5"]
  np.testing.assert_array_equal(pool.score(responses, ["5"] * 4), [0, 0, 1, 0])
  stats = pool.last_stats
  assert (stats.errors, stats.correct, stats.no_box) == (2, 1, 1)


def test_ungradable_references_count_as_errors(pool):
  """An empty or prose reference scores 0 and is counted with the grader's other give-ups."""
  refs = ["", "see the worked solution above", "5", "?"]
  np.testing.assert_array_equal(pool.score(["\\boxed{5}"] * 4, refs), [0, 0, 1, 0])
  stats = pool.last_stats
  assert (stats.errors, stats.correct, stats.items) == (3, 1, 4)
  exact = verifier.Verifier(verifier.VerifierConfig(judge="exact", num_workers=1))
  with exact:
    np.testing.assert_array_equal(exact.score(["\\boxed{5}"] * 2, [" ", "5"]), [0, 1])
    assert exact.last_stats.errors == 1


def test_score_rejects_bad_input(pool):
  with pytest.raises(ValueError, match="2 responses but 1 references"):
    pool.score(["a", "b"], ["1"])
  with pytest.raises(ValueError, match=r"references\[1\] is int"):
    pool.score(["a", "b"], ["1", 2])
  np.testing.assert_array_equal(pool.score([b"\\boxed{7}"], ["7"]), [1.0])


HOSTILE = {
  "power_tower": "\\boxed{9^{9^{9^{9^{9}}}}}",
  "huge_power": "so \\boxed{10^{10^{10}}}",
  "nested_braces_in_box": "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
  "nested_braces_open": "{" * 10_000 + "\\boxed{" + "{" * 10_000,
  "one_megabyte_text": "step. " * 175_000 + "\\boxed{2}",
  "one_megabyte_boxes": "\\frac{1}{2}\\boxed{" * 55_000,
  "one_megabyte_answer": "\\boxed{" + "1+" * 500_000 + "1}",
  "lone_surrogates": "\\boxed{\ud800\udfff\ud800} \udcff",
  "invalid_utf8": b"\\boxed{\xff\xfe\x80\xc3}".decode("utf-8", errors="surrogateescape"),
  "invalid_utf8_bytes": b"\\boxed{\xff\xfe\x80\xc3(}",
  "empty": "",
  "frac_bomb_nested": "\\boxed{" + "\\frac{1}{" * 90 + "2" + "}" * 90 + "}",
  "frac_bomb_flat": "\\boxed{" + "\\frac" * 190 + "{1}{2}}",
  "frac_bomb_long": "\\boxed{" + "\\frac{\\frac{1}{2}}{" * 10_000 + "}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_response_scores_zero_in_time(pool, name):
  t0 = time.monotonic()
  out = pool.score([HOSTILE[name]], ["1"])
  elapsed = time.monotonic() - t0
  assert out.tolist() == [0.0]
  assert elapsed <= TIMEOUT_S + 1.0, f"{name}: {elapsed:.2f} s"
  # The pool is still usable afterwards.
  np.testing.assert_array_equal(pool.score(["\\boxed{1}", "\\boxed{3}"], ["1", "2"]), [1, 0])


def test_hostile_batch_returns_with_the_good_items_scored(pool):
  names = sorted(HOSTILE)
  responses = [HOSTILE[n] for n in names] + ["\\boxed{\\frac{1}{2}}"] * 4
  t0 = time.monotonic()
  out = pool.score(responses, ["1"] * len(names) + ["0.5"] * 4)
  # Two workers: at most ~half the slow items in sequence on each, each within the timeout.
  assert time.monotonic() - t0 < len(names) * (TIMEOUT_S + 1.0) / 2
  np.testing.assert_array_equal(out, [0.0] * len(names) + [1.0] * 4)
  assert pool.last_stats.timeouts >= 2  # The power tower and 10^{10^{10}} at least.


def test_hostile_responses_reach_math_verify_without_length_guard():
  # The answer-length guard off: 1 MB and 10,000-brace answers are parsed, and the timers
  # (or a crash) must still end them.
  config = verifier.VerifierConfig(num_workers=2, timeout_s=1.0, max_answer_chars=10**7)
  names = sorted(HOSTILE)
  with verifier.Verifier(config) as p:
    t0 = time.monotonic()
    out = p.score([HOSTILE[n] for n in names] + ["\\boxed{1}"], ["1"] * (len(names) + 1))
    elapsed = time.monotonic() - t0
    np.testing.assert_array_equal(out, [0.0] * len(names) + [1.0])
    assert elapsed < len(names) * (config.timeout_s + 1.0) / 2
    assert p.last_stats.timeouts + p.last_stats.errors >= 4
    print(f"no guard: {elapsed:.1f} s, {p.last_stats}")
    np.testing.assert_array_equal(p.score(["\\boxed{2}"], ["2"]), [1.0])


def test_hung_item_is_killed_and_worker_replaced():
  # No soft timer: only the parent's hard deadline can end the power tower.
  config = verifier.VerifierConfig(num_workers=1, timeout_s=1.0, soft_timeout_frac=None)
  with verifier.Verifier(config) as p:
    (old_pid,) = p.worker_pids
    t0 = time.monotonic()
    out = p.score([HOSTILE["power_tower"]], ["1"])
    assert time.monotonic() - t0 <= config.timeout_s + 1.0
    assert out.tolist() == [0.0]
    assert p.last_stats.timeouts == 1 and p.last_stats.restarts == 1
    assert p.worker_pids != [old_pid] and not _alive(old_pid)
    # Both items of a batch are scored when the first one hangs: the batch goes on.
    out = p.score([HOSTILE["power_tower"], "\\boxed{4}"], ["1", "4"])
    np.testing.assert_array_equal(out, [0.0, 1.0])
    assert p.stats.timeouts == 2 and p.stats.restarts == 2
    pids = p.worker_pids
  assert not any(_alive(pid) for pid in pids)


def test_crashed_worker_scores_zero_and_is_replaced():
  config = verifier.VerifierConfig(num_workers=1, timeout_s=30.0, soft_timeout_frac=None)
  with verifier.Verifier(config) as p:
    # A worker that dies while idle is replaced; no item is lost.
    os.kill(p.worker_pids[0], 9)
    time.sleep(0.2)
    np.testing.assert_array_equal(p.score(["\\boxed{5}"], ["5"]), [1.0])
    assert p.last_stats.restarts == 1 and p.last_stats.errors == 0
    # A worker that dies mid-item (segfault, OOM kill) scores that item 0.
    busy_pid = p.worker_pids[0]
    killer = threading.Timer(0.5, os.kill, (busy_pid, 9))
    killer.start()
    t0 = time.monotonic()
    out = p.score([HOSTILE["power_tower"], "\\boxed{6}"], ["1", "6"])
    killer.join()
    assert time.monotonic() - t0 < 10.0  # Well before the 30 s timeout.
    np.testing.assert_array_equal(out, [0.0, 1.0])
    assert p.last_stats.errors == 1 and p.last_stats.restarts == 1
    assert p.stats.restarts == 2
  with pytest.raises(RuntimeError, match="closed"):
    p.score(["\\boxed{1}"], ["1"])


# ---------------------------------------------------------------- submit / collect


def test_submit_returns_at_once_and_collect_waits_only_for_its_ids():
  config = verifier.VerifierConfig(num_workers=2, timeout_s=1.5, soft_timeout_frac=None)
  with verifier.Verifier(config) as p:
    t0 = time.monotonic()
    ids = p.submit([HOSTILE["power_tower"], "\\boxed{4}", "no box", "\\boxed{5}"], ["1", "4"] * 2)
    assert time.monotonic() - t0 < 0.2  # Queued, not graded.
    assert ids.dtype == np.int64 and ids.tolist() == list(range(ids[0], ids[0] + 4))
    # The later items are collected while the hung one still holds its worker.
    np.testing.assert_array_equal(p.collect(ids[[3, 1, 2]]), [0.0, 1.0, 0.0])
    assert time.monotonic() - t0 < config.timeout_s
    assert p.last_stats.no_box == 1 and p.last_stats.items == 3
    assert p.done(ids[:1]).tolist() == [False]
    with pytest.raises(TimeoutError, match="1 of 1 items"):
      p.collect(ids[:1], timeout=0.1)
    # Still open after a timed-out collect; the hard deadline then ends the item.
    np.testing.assert_array_equal(p.collect(ids[:1]), [0.0])
    assert time.monotonic() - t0 <= config.timeout_s + 1.0
    assert p.last_stats.timeouts == 1 and p.last_stats.restarts == 1
    with pytest.raises(ValueError, match=f"item {ids[0]} is not open"):
      p.collect(ids[:1])


def test_collect_and_discard_reject_or_ignore_ids_that_are_not_open(pool):
  ids = pool.submit(["\\boxed{1}", "\\boxed{2}"], ["1", "1"])
  with pytest.raises(ValueError, match="repeated"):
    pool.collect([ids[0], ids[0]])
  with pytest.raises(ValueError, match=f"item {ids[-1] + 1} is not open"):
    pool.done([ids[-1] + 1])
  # Bad input queues nothing: the next ids follow on.
  with pytest.raises(ValueError, match=r"responses\[0\] is int"):
    pool.submit([3], ["3"])
  np.testing.assert_array_equal(pool.collect(ids), [1.0, 0.0])
  assert pool.submit(["x"], ["x"]).tolist() == [ids[-1] + 1]
  pool.discard([ids[-1] + 1, ids[0]])  # Not open (collected) ids are ignored.
  # `score` is submit + collect: it takes ids from the same counter.
  pool.score(["\\boxed{1}"] * 3, ["1"] * 3)
  assert pool.submit(["x"], ["x"]).tolist() == [ids[-1] + 5]


def test_discarded_items_are_not_graded_and_leave_nothing_behind():
  config = verifier.VerifierConfig(num_workers=1, timeout_s=1.0, soft_timeout_frac=None)
  with verifier.Verifier(config) as p:
    ids = p.submit([HOSTILE["power_tower"]] + ["\\boxed{2}"] * 5, ["1"] + ["2"] * 5)
    time.sleep(0.2)  # The hung item is in flight, the rest queued.
    p.discard(ids[:5])  # One in flight, four queued: the queued ones never reach a worker.
    with pytest.raises(ValueError, match="not open"):
      p.collect(ids[:1])
    np.testing.assert_array_equal(p.collect(ids[5:]), [1.0])
    assert p.last_stats.items == 1 and p.last_stats.timeouts == 0
    # The in-flight item's result (a timeout) is dropped, not handed to a later collect.
    later = p.submit(["\\boxed{3}"], ["3"])
    np.testing.assert_array_equal(p.collect(later), [1.0])
    assert p.stats.items == 2 and p.stats.timeouts == 0 and p.stats.restarts == 1
    d = p._dispatcher
    assert not d.results and not d.open and not d.discarded and not d.todo


def test_threads_submit_and_collect_at_once(pool):
  """The grading thread and the decode loop of a streaming step may share the pool."""
  out, errors = {}, []

  def work(k):
    try:
      answers = [str(k * 100 + i) for i in range(20)]
      ids = pool.submit([f"\\boxed{{{a}}}" for a in answers], answers[:10] + ["x"] * 10)
      out[k] = pool.collect(ids).tolist()
    except Exception as e:  # noqa: BLE001 — reported below.
      errors.append(e)

  threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert not errors and out == {k: [1.0] * 10 + [0.0] * 10 for k in range(4)}


def test_close_wakes_a_waiting_collect_and_stops_everything():
  config = verifier.VerifierConfig(num_workers=1, timeout_s=30.0, soft_timeout_frac=None)
  p = verifier.Verifier(config)
  ids = p.submit([HOSTILE["power_tower"]], ["1"])
  errors = []

  def wait():
    try:
      p.collect(ids)
    except RuntimeError as e:
      errors.append(str(e))

  waiter = threading.Thread(target=wait)
  waiter.start()
  time.sleep(0.3)
  pids, thread = p.worker_pids, p._dispatcher.thread
  t0 = time.monotonic()
  p.close()
  waiter.join(5.0)
  assert time.monotonic() - t0 < 5.0 and errors == ["Verifier is closed"]
  assert not thread.is_alive() and not any(_alive(pid) for pid in pids)
  with pytest.raises(RuntimeError, match="closed"):
    p.submit(["\\boxed{1}"], ["1"])
  p.close()  # Idempotent.


@settings(
  max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
  batches=st.lists(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.booleans()), max_size=6),
    min_size=1,
    max_size=4,
  ),
  order_seed=st.integers(0, 2**16),
)
def test_interleaved_submits_collect_each_item_its_own_reward(pool, batches, order_seed):
  """Any interleaving of submits and collects of any subsets, in any order, gives each id
  the reward of its own (response, reference), as `score` of that item alone would."""
  rng = np.random.default_rng(order_seed)
  expected, open_ids = {}, []
  for batch in batches:
    responses = [f"\\boxed{{{a}}}" if boxed else str(a) for a, _, boxed in batch]
    ids = pool.submit(responses, [str(b) for _, b, _ in batch])
    expected |= {
      int(i): float(boxed and a == b) for i, (a, b, boxed) in zip(ids, batch, strict=True)
    }
    open_ids += ids.tolist()
    take = [i for i in open_ids if rng.random() < 0.5]
    rng.shuffle(take)
    np.testing.assert_array_equal(pool.collect(take), [expected[i] for i in take])
    open_ids = [i for i in open_ids if i not in take]
  np.testing.assert_array_equal(pool.collect(open_ids), [expected[i] for i in open_ids])


# ------------------------------------------------------------------------- real data

# The bar for MATH500 is >= 499/500 correct and <= 3/498 other answers accepted;
# the other sets get the same rates.
DATASETS = [
  pytest.param("math500", "math500_test.jsonl", id="math500"),
  pytest.param("aime24", "aime24_test.jsonl", id="aime24"),
  pytest.param("amc23", "amc23_test.jsonl", id="amc23"),
  pytest.param("gsm8k", "gsm8k_test.jsonl", id="gsm8k"),
  pytest.param("minerva_math", "minerva_math_test.jsonl", id="minerva"),  # ~15 s: symbolic.
  pytest.param("olympiadbench", "olympiadbench_test.jsonl", id="olympiadbench"),  # ~11 s.
]


def _surface_variant(answer: str) -> str:
  """The same answer written differently: `\\dfrac`, no `\\left`/`\\right`, "1,234.0"."""
  if answer.isdigit():
    return f"{int(answer):,}.0"
  return answer.replace("\\frac", "\\dfrac").replace("\\left", "").replace("\\right", "")


@pytest.mark.parametrize("source, filename", DATASETS)
def test_real_reference_answers(pool, shared_dir, source, filename):
  with open(shared_dir / "data" / filename) as f:
    rows = [json.loads(line) for line in f]
  refs = [reference_answer(source, row) for row in rows]
  n = len(refs)
  good = pool.score([f"Reasoning...\nThe final answer is $\\boxed{{{a}}}$." for a in refs], refs)
  # Each problem against the next problem's answer, when that answer is a different string.
  pairs = [(i, (i + 1) % n) for i in range(n) if refs[i] != refs[(i + 1) % n]]
  cross = pool.score([f"So \\boxed{{{refs[j]}}}." for _, j in pairs], [refs[i] for i, _ in pairs])
  # Rewritten answers exercise the normalisation and math-verify, not string identity.
  changed = [i for i, a in enumerate(refs) if _surface_variant(a) != a]
  variants = pool.score(
    [f"\\boxed{{{_surface_variant(refs[i])}}}" for i in changed], [refs[i] for i in changed]
  )
  print(
    f"{source}: correct {int(good.sum())}/{n}, rewritten {int(variants.sum())}/{len(changed)}, "
    f"other answer scored 1: {int(cross.sum())}/{len(pairs)}"
  )
  assert good.sum() >= n - max(1, n // 500)
  assert variants.sum() >= len(changed) - max(1, len(changed) // 100)
  assert cross.sum() <= max(3, 3 * len(pairs) // 498)
  if source == "math500":  # Every own answer, and at most one other problem's answer.
    assert n == 500 and len(pairs) == 498
    assert good.sum() == 500 and cross.sum() <= 1
