"""Metrics writer: one JSONL line per step, resume moves stale lines aside, PNG curves."""

import json

import numpy as np

from ada_jax import metrics


def test_jsonl_tensorboard_and_resume(tmp_path):
  w = metrics.MetricsWriter(tmp_path, total_steps=5)
  for step in range(1, 5):
    w.write(step, {"loss": np.float32(step), "per_round": [8, 4], "nan": float("nan"),
                   "method": "pos"})
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
  runs = {"pos": [{"step": s, "pass_rate": s / 10} for s in range(1, 11)],
          "grpo": [{"step": s, "pass_rate": s / 20} for s in range(1, 11)]}
  metrics.plot_curves(runs, ["pass_rate"], tmp_path / "c.png", smooth=3,
                      units={"pass_rate": "fraction"})
  assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
