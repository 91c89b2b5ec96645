"""experiments/accelerator_check.py: `--tiny` runs every part on the CPU in one process and
writes one JSON object whose fields and types are checked here (not its speeds); the
peak table matches device kinds; a failing part is recorded without losing the others."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from ada_jax import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "accelerator_check.py"


@pytest.fixture(scope="module")
def script():
  return testing.load_experiment("accelerator_check")


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
  out = tmp_path_factory.mktemp("check") / "check.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # One CPU device, as on a one-chip machine (the suite's 8 fake devices are for meshes).
  flags = env.get("XLA_FLAGS", "").split()
  env["XLA_FLAGS"] = " ".join(f for f in flags if "xla_force_host_platform_device_count" not in f)
  proc = subprocess.run(
    [sys.executable, str(SCRIPT), "--tiny", f"--out={out}"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert json.loads(proc.stdout) == report  # the same object on stdout and in the file
  return report


def _is_num(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


@pytest.mark.slow
def test_tiny_run_names_its_setting(tiny_report):
  r = tiny_report
  assert r["device"]["platform"] == "cpu" and isinstance(r["device"]["kind"], str)
  assert isinstance(r["jax"], str) and isinstance(r["jaxlib"], str)
  assert isinstance(r["commit"], str) and r["commit"] != "unknown"
  assert r["peaks"]["hbm_bytes_per_s"] is None and "cpu" in r["peaks"]["source"]
  assert r["config"]["tiny"] is True and r["config"]["sizes"]["model"] == "tiny-qwen2"
  assert set(r["parts"]) == {"decode", "train", "rl", "agreement", "memory", "decode_7b", "smollm2"}
  parts = dict(r["parts"])
  real = parts.pop("smollm2")  # the real model is tests/test_gguf.py's: --tiny skips it
  assert real["ok"] is None and real["skipped"].startswith("--tiny: python -m ada_jax.models")
  for name, part in parts.items():
    assert part["ok"] is True, (name, part.get("error"), part.get("traceback"))


@pytest.mark.slow
def test_tiny_decode_rows(tiny_report):
  sizes = tiny_report["config"]["sizes"]
  ties = []
  for part, slots in (("decode", sizes["decode_slots"]), ("decode_7b", [4])):
    d = tiny_report["parts"][part]
    cfg = d["model_config"]
    ties.append(cfg["tie_embeddings"])
    assert [row["slots"] for row in d["by_slots"]] == slots
    for row in d["by_slots"]:
      assert row["ok"] and row["all_rows_at_budget"] is True
      assert row["sampler"]["max_new_tokens"] == sizes["new_tokens"]
      assert row["decode_steps_timed"] == 2 * sizes["segment_steps"]
      assert _is_num(row["step_s"]) and row["step_s"] > 0 and row["tokens_per_s"] > 0
      # KV bytes are the model's arithmetic: 2 x layers x S x kv heads x head dim x
      # live length x 2 bytes (bf16), the live length averaged over the timed steps.
      per_token = 2 * cfg["num_layers"] * cfg["num_kv_heads"] * cfg["head_dim"] * 2
      first = sizes["segment_steps"]  # the timed steps start after the first segment
      live = sizes["prompt_len"] + first + (row["decode_steps_timed"] + 1) / 2
      assert row["live_len_mean"] == live
      assert row["kv_bytes_per_step"] == pytest.approx(per_token * row["slots"] * live)
      assert row["hbm_bytes_per_step"] == row["weight_bytes_per_step"] + row["kv_bytes_per_step"]
      assert row["kv_bytes_per_step_block_reads"] >= row["kv_bytes_per_step"]
      # Every weight once; of an untied input embedding only the S rows looked up.
      table = cfg["vocab_size"] * cfg["embed_dim"] * 2
      rows_read = row["slots"] * cfg["embed_dim"] * 2
      untied = d["param_bytes"] - table + rows_read
      assert row["weight_bytes_per_step"] == (d["param_bytes"] if cfg["tie_embeddings"] else untied)
      assert row["mbu"] is None  # no peak bandwidth for a CPU
      assert row["compiles_first_segment"] >= 1 and row["compiles_timed"] == 0
  assert sorted(ties) == [False, True]  # both embedding cases are measured


@pytest.mark.slow
def test_tiny_train_rl_agreement(tiny_report):
  p = tiny_report["parts"]
  t = p["train"]
  assert t["train_config"]["remat"] is True and t["flop_factor"] == 8
  assert t["flops_per_step"] == 8 * t["params"] * t["rows"] * t["seq_len"]
  assert t["tokens_per_s"] > 0 and t["mfu"] is None
  assert t["compiles_first_step"] >= 1 and t["compiles_later_steps"] == 0
  for schedule in ("rounds", "stream"):
    rl = p["rl"][schedule]
    assert rl["ok"] and rl["run_config"]["ada"]["schedule"] == schedule
    assert [s["step"] for s in rl["steps"]] == [1, 2]
    assert rl["compiles_step_1"] >= 1
    # Only the train step at a packed row count no earlier step took compiles later.
    assert rl["compiles_after_step_1"] == rl["new_packed_row_counts_after_step_1"]
    assert all("positions" in s for s in rl["steps"])
    for key in ("time_sample_s", "time_grade_wait_s", "time_train_s"):  # each step measures all
      assert _is_num(rl["after_step_1_mean_s"][key]) and rl["after_step_1_mean_s"][key] > 0
  a = p["agreement"]
  assert a["tokens_compared"] == a["rows"] * a["sampler"]["max_new_tokens"]
  assert 0 <= a["gap_mean"] <= a["gap_p99"] <= a["gap_max"]
  # float32 masters (the trainer casts them where it uses them), the sampler their bf16 copy.
  assert a["dtypes"] == {"params": "float32", "compute": "bfloat16", "logits": "float32"}
  goals = tiny_report["goals"]
  assert goals["recompiles_after_step_1==0"] == {"value": [0, 0], "met": True}
  assert goals["bf16_gap_mean<=1e-3"]["value"] == a["gap_mean"]
  assert goals["train_mfu>=0.35"] == {"value": None, "met": None}


@pytest.mark.slow
def test_tiny_memory_beside_the_plan(tiny_report):
  programs = tiny_report["parts"]["memory"]["programs"]
  names = [m["program"] for m in programs]
  assert len(names) == 5 and sum(n.startswith("decode") for n in names) == 4
  assert any(n.startswith("train step") for n in names)
  for m in programs:
    xla = m["xla"]
    assert xla["peak"] == xla["argument"] + xla["temp"] + xla["output"] - xla["alias"] > 0
    assert m["measured_peak_bytes"] is None and "memory_stats() is None on cpu" in m["reason"]
  rows = tiny_report["parts"]["decode"]["by_slots"] + [tiny_report["parts"]["train"]]
  assert all(row["compiles_for_memory_analysis"] == 0 for row in rows)


@pytest.mark.parametrize(
  "kind, bandwidth, flops",
  [
    ("NVIDIA H200", 4.8e12, 989e12),
    ("NVIDIA H100 80GB HBM3", 3.352e12, 989e12),
    ("NVIDIA H100 PCIe", 2.0e12, 756e12),
    ("NVIDIA A100-SXM4-80GB", 2.0e12, 312e12),
    ("NVIDIA A100-SXM4-40GB", 1.555e12, 312e12),
    ("TPU v4", 1.2e12, 275e12),
    ("TPU v5 lite", 819e9, 197e12),
    ("TPU v5e", 819e9, 197e12),
    ("TPU v5", 2.765e12, 459e12),
    ("TPU v5p", 2.765e12, 459e12),
    ("TPU v6 lite", 1.64e12, 918e12),
    ("cpu", None, None),
  ],
)
def test_peaks_by_device_kind(script, kind, bandwidth, flops):
  peaks = script.peaks_of(kind)
  assert (peaks["hbm_bytes_per_s"], peaks["bf16_flops"]) == (bandwidth, flops)
  assert isinstance(peaks["source"], str) and peaks["source"]


def test_peak_overrides_are_named(script):
  peaks = script.peaks_of("cpu", 1e12, 2e14)
  assert (peaks["hbm_bytes_per_s"], peaks["bf16_flops"]) == (1e12, 2e14)
  assert "--peak_hbm_bytes_per_s" in peaks["source"] and "--peak_bf16_flops" in peaks["source"]


def test_memory_record_on_a_device_with_statistics(script):
  """A GPU/TPU's `memory_stats()`: the peak is the program's only when it rose during it;
  the plan adds what was live before and is not one of the program's arguments."""
  xla = {"argument": 40, "output": 8, "alias": 8, "temp": 60, "peak": 100}
  before = {"bytes_in_use": 50, "peak_bytes_in_use": 70}
  after = {"bytes_in_use": 50, "peak_bytes_in_use": 140, "bytes_limit": 1000}
  rec = script.memory_record("p", before, after, xla, 40, "gpu")
  assert rec["measured_peak_bytes"] == 140 and rec["reason"] is None
  assert rec["predicted_peak_bytes"] == 50 - 40 + 100
  assert rec["measured_over_predicted"] == pytest.approx(140 / 110)
  assert rec["bytes_limit"] == 1000 and rec["xla"] == xla
  earlier = script.memory_record("p", before, dict(after, peak_bytes_in_use=70), xla, 40, "gpu")
  assert earlier["measured_peak_bytes"] is None and "earlier program" in earlier["reason"]
  assert earlier["predicted_peak_bytes"] == 110 and earlier["measured_over_predicted"] is None
  unplanned = script.memory_record("p", before, after, None, 40, "tpu")
  assert unplanned["predicted_peak_bytes"] is None and unplanned["measured_peak_bytes"] == 140
  cpu = script.memory_record("p", None, None, xla, 40, "cpu")
  assert cpu["measured_peak_bytes"] is None and cpu["reason"].endswith("is None on cpu")


def test_a_failing_part_is_recorded(script):
  def fails():
    raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

  out = script.guarded(fails)
  assert out["ok"] is False and out["error"].startswith("RuntimeError: RESOURCE_EXHAUSTED")
  assert "fails" in out["traceback"] and out["part_wall_s"] > 0
  assert script.guarded(lambda: {"x": 1}) == {
    "x": 1,
    "ok": True,
    "part_wall_s": pytest.approx(0, abs=1),
  }


@pytest.mark.parametrize(
  "argv, message",
  [(["--parts=decode,nope"], "--parts: unknown ['nope']"), (["--decode_7b_slots=-1"], ">= 0")],
)
def test_bad_flags_exit_2_naming_them(script, argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    script.parse_args(argv)
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_one_failing_part_keeps_the_others(script, monkeypatch, tmp_path):
  def oom(check):
    raise RuntimeError("RESOURCE_EXHAUSTED: train step")

  monkeypatch.setattr(script, "part_train", oom)
  monkeypatch.setattr(script, "part_agreement", lambda check: {"gap_mean": 5e-4})
  out = tmp_path / "r.json"
  report = script.main(["--tiny", "--parts=train,agreement", f"--out={out}"])
  assert json.loads(out.read_text()) == json.loads(json.dumps(report))
  assert report["parts"]["train"]["ok"] is False
  assert "RESOURCE_EXHAUSTED" in report["parts"]["train"]["error"]
  assert report["parts"]["agreement"]["ok"] is True
  assert report["goals"]["bf16_gap_mean<=1e-3"] == {"value": 5e-4, "met": True}
  assert report["goals"]["train_mfu>=0.35"]["met"] is None
