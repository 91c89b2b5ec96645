"""Metrics writer: one JSONL line per step, resume moves stale lines aside, PNG curves."""

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ada_jax import metrics


def test_jsonl_tensorboard_and_resume(tmp_path):
  w = metrics.MetricsWriter(tmp_path, total_steps=5)
  for step in range(1, 5):
    w.write(
      step, {"loss": np.float32(step), "per_round": [8, 4], "nan": float("nan"), "method": "pos"}
    )
  w.close()
  lines = metrics.read_jsonl(tmp_path / "metrics.jsonl")
  assert [x["step"] for x in lines] == [1, 2, 3, 4]
  assert lines[0] == {"step": 1, "loss": 1.0, "per_round": [8, 4], "nan": None, "method": "pos"}
  assert list((tmp_path / "tensorboard").iterdir())
  # Resume after checkpoint 2: steps 3-4 will be recomputed, their old lines move aside.
  w = metrics.MetricsWriter(tmp_path, total_steps=5, start_step=2)
  w.write(3, {"loss": 30.0})
  w.close()
  assert [x["loss"] for x in metrics.read_jsonl(tmp_path / "metrics.jsonl")] == [1.0, 2.0, 30.0]
  orphaned = [json.loads(x) for x in (tmp_path / "metrics.orphaned.jsonl").read_text().splitlines()]
  assert [x["step"] for x in orphaned] == [3, 4]


def test_non_primary_writes_nothing(tmp_path):
  w = metrics.MetricsWriter(tmp_path / "run", total_steps=3, primary=False)
  w.write(1, {"loss": 1.0})
  w.close()
  assert not (tmp_path / "run").exists()


def test_plot_curves(tmp_path):
  runs = {
    "pos": [{"step": s, "pass_rate": s / 10} for s in range(1, 11)],
    "grpo": [{"step": s, "pass_rate": s / 20} for s in range(1, 11)],
  }
  metrics.plot_curves(
    runs, ["pass_rate"], tmp_path / "c.png", smooth=3, units={"pass_rate": "fraction"}
  )
  assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def _tensorboard_steps(logdir, tag):
  """Steps of `tag` as TensorBoard shows them (every event file of the folder, with its
  purge of steps a restarted run rewrote)."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
  acc.Reload()
  return [e.step for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def test_tensorboard_after_a_crash_and_resume_has_each_step_once(tmp_path):
  """A run killed after step 4 with its last checkpoint at step 2: the resumed writer
  (start_step=2) rewrites steps 3-5, and TensorBoard shows steps 0-5 once each, the new
  values for 3-4; held-out scalars (`add_scalars`) sit at steps 0 and 5."""
  w = metrics.MetricsWriter(tmp_path, total_steps=5)
  w.add_scalars(0, {"eval/arith/avg@2": 0.25})
  for step in range(1, 5):
    w.write(step, {"loss": float(step)})
  w._tb.close()  # no close(): as a killed process leaves it (each step is flushed)
  w = metrics.MetricsWriter(tmp_path, total_steps=5, start_step=2)
  for step in range(3, 6):
    w.write(step, {"loss": 10.0 * step})
  w.add_scalars(5, {"eval/arith/avg@2": 0.5})
  w.close()
  assert len(list((tmp_path / "tensorboard").iterdir())) == 2  # one event file per run
  assert _tensorboard_steps(tmp_path / "tensorboard", "loss") == [1, 2, 3, 4, 5]
  assert _tensorboard_steps(tmp_path / "tensorboard", "eval/arith/avg_at_2") == [0, 5]
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  acc = EventAccumulator(str(tmp_path / "tensorboard"))
  acc.Reload()
  assert [e.value for e in acc.Scalars("loss")] == [1.0, 2.0, 30.0, 40.0, 50.0]


def test_tensorboard_restart_at_step_0_rewrites_the_held_out_scores_once(tmp_path):
  w = metrics.MetricsWriter(tmp_path, total_steps=3)
  w.add_scalars(0, {"eval/arith/avg@2": 0.25})
  w.write(1, {"loss": 1.0})
  w._tb.close()
  w = metrics.MetricsWriter(tmp_path, total_steps=3, start_step=0)
  w.add_scalars(0, {"eval/arith/avg@2": 0.25})
  w.write(1, {"loss": 2.0})
  w.close()
  assert _tensorboard_steps(tmp_path / "tensorboard", "eval/arith/avg_at_2") == [0]
  assert _tensorboard_steps(tmp_path / "tensorboard", "loss") == [1]


def test_a_list_is_one_jsonl_field_and_a_tensorboard_scalar_per_entry(tmp_path):
  w = metrics.MetricsWriter(tmp_path, total_steps=1)
  w.write(1, {"active_prompts_per_round": [8, 3], "eval/arith/avg@4": 0.5})
  w.close()
  assert metrics.read_jsonl(tmp_path / "metrics.jsonl")[0]["active_prompts_per_round"] == [8, 3]
  assert _tensorboard_steps(tmp_path / "tensorboard", "active_prompts_per_round/2") == [1]
  assert _tensorboard_steps(tmp_path / "tensorboard", "eval/arith/avg_at_4") == [1]


@settings(
  max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.integers(0, 200), start=st.integers(0, 3))
def test_a_torn_last_line_is_set_aside_and_the_run_resumes(tmp_path_factory, cut, start):
  """A kill mid-append leaves a partial last line (any prefix of it, its newline
  included): the reader leaves it out, the writer moves it to metrics.orphaned.jsonl, and
  the next appends are whole lines again."""
  workdir = tmp_path_factory.mktemp("torn")
  w = metrics.MetricsWriter(workdir, total_steps=9)
  for step in (1, 2, 3):
    w.write(step, {"loss": 0.5 * step, "pass_rate": [0.1, 0.2]})
  w.close()
  path = workdir / "metrics.jsonl"
  text = path.read_text()
  last = text.rstrip("\n").rsplit("\n", 1)[1] + "\n"
  torn = last[: min(cut, len(last) - 1)]
  path.write_text(text[: len(text) - len(last)] + torn)
  parsed = [1, 2, 3] if torn == last[:-1] else [1, 2]  # only its newline lost: readable
  assert [m["step"] for m in metrics.read_jsonl(path)] == parsed
  w = metrics.MetricsWriter(workdir, total_steps=9, start_step=start)
  w.write(start + 1, {"loss": 1.0})
  w.close()
  kept = [s for s in parsed if s <= start]
  assert [m["step"] for m in metrics.read_jsonl(path)] == [*kept, start + 1]
  assert path.read_text().endswith("}\n") and path.read_text().count("\n") == len(kept) + 1
  orphaned = metrics.read_jsonl(workdir / "metrics.orphaned.jsonl")
  if torn.strip() and parsed == [1, 2]:
    assert {"unreadable_line": 3, "text": torn} in orphaned


@pytest.mark.parametrize("start", [0, 3])
def test_a_metrics_file_that_cannot_be_written_is_one_line_and_leaves_no_tmp(tmp_path, start):
  """metrics.jsonl a folder (neighbour: with stale lines to set aside, start 3): one
  ConfigError naming it, instead of a traceback and a metrics.tmp left behind."""
  from ada_jax.config import ConfigError

  (tmp_path / "metrics.jsonl").mkdir()
  with pytest.raises(ConfigError, match=r"metrics\.jsonl: cannot be written"):
    metrics.MetricsWriter(tmp_path, total_steps=5, start_step=start)
  assert not (tmp_path / "metrics.tmp").exists()


def test_a_metrics_file_on_a_failing_rewrite_leaves_no_tmp(tmp_path, monkeypatch):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))

  def refuse(src, dst):
    raise OSError(30, "Read-only file system")

  monkeypatch.setattr(os, "replace", refuse)
  from ada_jax.config import ConfigError

  with pytest.raises(ConfigError, match="Read-only file system"):
    metrics.MetricsWriter(tmp_path, total_steps=5, start_step=1)  # steps 2-3 to set aside
  assert not (tmp_path / "metrics.tmp").exists()
  assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
