"""The golden set of one RL step's sampling (tests/data/golden_step.json): every method,
both schedules, on the Bernoulli simulators (3 seeds) and the tiny model (2 RL steps),
recomputed and compared with what `experiments/record_golden.py` recorded.

Exact: prompt ids, the selected row ids and their order, prompt indices, rewards, every
count (pool sizes, rows requested and selected, rounds, decode steps, tokens, boundaries)
and the selected responses' token hashes. Within 1e-6 (absolute or relative): every other
float (advantages, pass rates, fractions, means, Est's figures, the update's loss,
gradient norm and the like), whose last bits may move with the order of a sum or with
float32 against float64 arithmetic. Keys the golden set lacks (a figure added later) are
not compared; a key it has must still be there.

Re-record (`python experiments/record_golden.py`) only for an intended behaviour change,
named as such in the commit (docs/design.md "One RL step").
"""

import json
import math
import pathlib

import pytest

from ada_jax import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "data" / "golden_step.json").read_text())
TOLERANCE = 1e-6


record_golden = testing.load_experiment("record_golden")


def differences(golden, new, path="") -> list[str]:
  """Where `new` departs from `golden`: ints, strings and bools exactly, floats within
  `TOLERANCE` (absolute or relative), lists element by element, dicts on golden's keys."""
  if isinstance(golden, dict):
    if not isinstance(new, dict):
      return [f"{path}: {type(new).__name__} for a dict"]
    out = []
    for k, v in golden.items():
      if k not in new:
        out.append(f"{path}/{k}: missing")
      else:
        out += differences(v, new[k], f"{path}/{k}")
    return out
  if isinstance(golden, list):
    if not isinstance(new, list) or len(new) != len(golden):
      return [f"{path}: {new!r} for {golden!r}"]
    return [d for i, (g, n) in enumerate(zip(golden, new, strict=True)) for d in differences(
      g, n, f"{path}[{i}]")]  # fmt: skip
  if isinstance(golden, float) and isinstance(new, (int, float)) and not isinstance(new, bool):
    same = (math.isnan(golden) and math.isnan(new)) or math.isclose(
      golden, new, rel_tol=TOLERANCE, abs_tol=TOLERANCE
    )
    return [] if same else [f"{path}: {new!r} for {golden!r}"]
  if type(golden) is not type(new) or golden != new:
    return [f"{path}: {new!r} for {golden!r}"]
  return []


def _assert_same(key: str, new: dict) -> None:
  diffs = differences(GOLDEN["runs"][key], new)
  assert not diffs, (
    f"{key} departs from the golden set recorded at {GOLDEN['git_commit']} in "
    f"{len(diffs)} places, first: " + "; ".join(diffs[:5])
  )


def _keys(prefix: tuple[str, ...]) -> list[str]:
  return sorted(k for k in GOLDEN["runs"] if k.startswith(prefix))


def test_golden_set_covers_every_method_seed_and_schedule():
  from ada_jax.rl import controller, rules, simulate_stream

  methods_all = set(rules.RULES)

  names = simulate_stream.method_rows()
  methods = {c.method for c in names.values()}
  assert methods == methods_all
  for name in names:
    for seed in record_golden.SEEDS:
      for schedule in controller.SCHEDULES:
        assert f"stream_sim/{name}/{schedule}/seed{seed}" in GOLDEN["runs"]
      assert f"bernoulli/{name}/rounds/seed{seed}" in GOLDEN["runs"]
  assert methods_all <= set(record_golden.TINY_SEEDS[0])
  for seed, methods in record_golden.TINY_SEEDS.items():
    for method, schedule in [(m, s) for m in methods for s in controller.SCHEDULES]:
      key = f"tiny/{method}/{schedule}/seed{seed}"
      steps = GOLDEN["runs"][key]["steps"]
      assert len(steps) == record_golden.TINY_STEPS
      assert all(s["rows"] and len(s["response_hashes"]) == len(s["rows"]) for s in steps)
  # The set pins decisions, not only zeros: selected groups with signal, under every
  # method, in the simulator and on the model.
  for prefix in ("stream_sim/", "tiny/"):
    for method in methods_all:
      steps = [
        s
        for k in _keys((prefix,))
        if k.split("/")[1].removeprefix("ada_").startswith(method)
        for s in GOLDEN["runs"][k]["steps"]
      ]
      assert steps and any(any(a != 0 for a in s["advantages"]) for s in steps), (prefix, method)
  assert (ROOT / "tests" / "data" / "golden_step.json").stat().st_size < 1_000_000


@pytest.fixture(scope="module")
def bernoulli_runs():
  return record_golden.record_bernoulli()


@pytest.mark.parametrize("key", _keys(("stream_sim/", "bernoulli/")))
def test_bernoulli_simulator_reproduces_the_golden_set(bernoulli_runs, key):
  _assert_same(key, bernoulli_runs[key])


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
  with record_golden.compile_cache(tmp_path_factory.mktemp("jax_cache")):
    return record_golden.record_tiny()


@pytest.mark.slow
@pytest.mark.parametrize("key", _keys(("tiny/",)))
def test_tiny_model_reproduces_the_golden_set(tiny_runs, key):
  _assert_same(key, tiny_runs[key])


def test_the_comparison_catches_a_changed_selection_or_advantage():
  key = "stream_sim/ada_balance/stream/seed0"
  golden = GOLDEN["runs"][key]
  step = next(s for s in golden["steps"] if any(a != 0 for a in s["advantages"]))
  moved = json.loads(json.dumps(golden))
  i = golden["steps"].index(step)
  moved["steps"][i]["advantages"][0] += 1e-4
  assert differences(golden, moved) == [
    f"/steps[{i}]/advantages[0]: {moved['steps'][i]['advantages'][0]!r} "
    f"for {step['advantages'][0]!r}"
  ]
  swapped = json.loads(json.dumps(golden))
  rows = swapped["steps"][i]["rows"]
  rows[0], rows[1] = rows[1], rows[0]
  assert len(differences(golden, swapped)) == 2
  assert differences(golden, {**golden, "steps": golden["steps"][:-1]})
  assert not differences(golden, {**json.loads(json.dumps(golden)), "added_later": 1})
