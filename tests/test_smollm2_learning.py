"""experiments/smollm2_learning.py without training: its report reads fabricated workdirs
(metrics.jsonl, eval reports, summary.json, sessions.json) into the JSON and PNG; finished
runs are skipped; a run's progress lines and wall time come from a stand-in job; workdir
names, overrides and the shared before-RL cache."""

import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "smollm2_learning.py"
AVG, BOXED = "eval/arith_text/avg@4", "eval/arith_text/boxed_rate"


@pytest.fixture(scope="module")
def script():
  spec = importlib.util.spec_from_file_location("smollm2_learning", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def _line(step, **kw):
  return {
    "step": step,
    "first_round_pass_rate": 0.25 * step,
    "samples_drawn": 16,
    "zero_signal_frac": 0.5,
    "time_sample_s": 60.0,
    "time_grade_wait_s": 1.0,
    "time_train_s": 59.0,
    **kw,
  }


def _eval_report(workdir, step, avg, boxed, suffix=""):
  path = workdir / "eval" / f"step_{step}{suffix}.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  results = {"arith_text": {"avg@4": avg, "boxed_rate": boxed, "num_problems": 200}}
  path.write_text(json.dumps({"results": {**results, "average": results["arith_text"]}}))


def _fabricate(workdir, steps_done, *, finished, tokens=None):
  """A run of `steps_done` steps, evaluated at 0, 2 and (finished) the end."""
  workdir.mkdir(parents=True)
  lines = []
  for s in range(1, steps_done + 1):
    extra = {"tokens_decoded": tokens[s - 1]} if tokens else {"response_len_mean": 10.0}
    if s == 2:
      extra.update({AVG: 0.4, BOXED: 0.8})
    lines.append(_line(s, **extra))
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
  _eval_report(workdir, 0, 0.3, 0.7)
  _eval_report(workdir, 2, 0.1, 0.1)  # replaced by the re-evaluation below
  _eval_report(workdir, 2, 0.4, 0.8, suffix=".2")
  (workdir / "sessions.json").write_text(json.dumps([{"wall_s": 3600.0}, {"wall_s": 1800.0}]))
  if finished:
    _eval_report(workdir, steps_done, 0.5, 0.9)
    summary = {
      "steps_done": steps_done,
      "before_rl": {AVG: 0.3, BOXED: 0.7},
      "after_rl": {AVG: 0.5, BOXED: 0.9},
    }
    (workdir / "summary.json").write_text(json.dumps(summary))


def test_report_reads_finished_partial_and_absent_runs(script, tmp_path):
  root, out = tmp_path / "root", tmp_path / "out" / "learning"
  learning = root / "learning"
  _fabricate(learning / "ada_pos_seed0", 4, finished=True, tokens=[100, 200, 300, 400])
  _fabricate(learning / "grpo_n4_seed0", 3, finished=False)  # killed after step 3
  args = ["--report", f"--root={root}", f"--model_dir={tmp_path / 'model'}", f"--out={out}"]
  script.main([*args, "--steps=4", "--eval_every=2"])
  report = json.loads(out.with_suffix(".json").read_text())
  assert out.with_suffix(".png").stat().st_size > 0
  assert (
    report["steps"] == 4
    and report["git_commit"]
    and set(report["methods"])
    == {
      "GRPO n=4",
      "Ada-pos",
      "Ada-balance",
    }
  )
  pos = report["methods"]["Ada-pos"]["runs"][0]
  assert pos["status"] == "finished" and pos["steps_done"] == 4 and pos["seed"] == 0
  assert pos["before"] == {"avg": 0.3, "boxed_rate": 0.7}
  assert pos["after"] == {"avg": 0.5, "boxed_rate": 0.9}
  assert pos["gain_points"] == pytest.approx(20.0)
  # Held-out curve against steps and cumulative decode tokens (.2 wins at step 2).
  assert [(p["step"], p["decode_tokens"], p["avg"], p["boxed_rate"]) for p in pos["heldout"]] == [
    (0, 0.0, 0.3, 0.7),
    (2, 300.0, 0.4, 0.8),
    (4, 1000.0, 0.5, 0.9),
  ]
  assert pos["train"]["pass_rate"] == [0.25, 0.5, 0.75, 1.0]
  assert pos["train"]["decode_tokens"] == [100, 300, 600, 1000]
  assert pos["hours"] == 1.5 and pos["sessions"] == 2 and pos["step_s_median"] == 120.0
  # The full parsed config and the command of the run.
  assert pos["config"]["rl"]["steps"] == 4 and pos["config"]["eval"]["every_steps"] == 2
  assert pos["config"]["ada"]["method"] == "pos"
  assert pos["config"]["model"]["hf_dir"] == str(tmp_path / "model")
  assert "--config=configs/smollm2_arith_pos.py" in pos["command"]
  grpo = report["methods"]["GRPO n=4"]["runs"][0]
  assert grpo["status"] == "partial" and grpo["steps_done"] == 3 and grpo["after"] is None
  assert grpo["before"] == {"avg": 0.3, "boxed_rate": 0.7}  # from eval/step_0.json
  # Decode tokens of a run logged before `tokens_decoded`: samples × mean length.
  assert grpo["train"]["decode_tokens"] == [160.0, 320.0, 480.0]
  assert grpo["config"]["ada"]["method"] == "grpo"
  balance = report["methods"]["Ada-balance"]["runs"][0]
  assert balance["status"] == "not started" and balance["heldout"] == []


def test_sweep_report_names_runs_by_learning_rate(script, tmp_path):
  root, out = tmp_path / "root", tmp_path / "sweep"
  _fabricate(root / "lr_sweep" / "ada_pos_learning_rate3e_06_seed0", 2, finished=True)
  args = ["--sweep", "--report", f"--root={root}", f"--model_dir={tmp_path}", f"--out={out}"]
  script.main([*args, "--lrs", "1e-6", "3e-6", "--steps=2"])
  report = json.loads(out.with_suffix(".json").read_text())
  assert list(report["methods"]) == ["Ada-pos lr=1e-06", "Ada-pos lr=3e-06"]
  low, high = (report["methods"][k]["runs"][0] for k in report["methods"])
  assert low["status"] == "not started" and high["status"] == "finished"
  assert high["config"]["optim"]["learning_rate"] == 3e-6
  assert report["eval_every_steps"] == 0  # the sweep evaluates before and after only


def test_names_overrides_and_skipping(script, tmp_path):
  sets = script.parse_sets(["optim.learning_rate=3e-6", "ada.method=balance", "x.y=[1, 2]"])
  assert sets == {"optim.learning_rate": 3e-6, "ada.method": "balance", "x.y": [1, 2]}
  with pytest.raises(SystemExit, match="group.field=value"):
    script.parse_sets(["optim.learning_rate"])
  assert script.run_name("GRPO n=4", 1, {}) == "grpo_n4_seed1"
  assert script.run_name("Ada-pos", 0, {"optim.learning_rate": 3e-6}) == (
    "ada_pos_learning_rate3e_06_seed0"
  )
  assert script.resumable("eval.every_steps") and script.resumable("rl.steps")
  assert not script.resumable("optim.learning_rate")
  workdir = tmp_path / "run"
  _fabricate(workdir, 2, finished=True)
  assert script.finished(workdir, 2) and not script.finished(workdir, 3)  # --steps grew
  assert not script.finished(tmp_path / "absent", 1)
  # A finished run is skipped without starting anything.
  script.run(workdir, "configs/smollm2_arith_pos.py", {}, 2)
  assert not (workdir / "log.txt").exists()


def test_fresh_run_gets_a_siblings_cache(script, tmp_path):
  a, b = tmp_path / "learning" / "grpo_n4_seed0", tmp_path / "lr_sweep" / "ada_pos_seed0"
  (a / "eval").mkdir(parents=True)
  (a / "eval" / "cache.jsonl").write_text('{"key": "k"}')
  script.seed_eval_cache(b, [a, b])
  assert (b / "eval" / "cache.jsonl").read_text() == '{"key": "k"}\n'
  (a / "eval" / "cache.jsonl").write_text("other")
  script.seed_eval_cache(b, [a, b])  # never replaces the run's own
  assert (b / "eval" / "cache.jsonl").read_text() == '{"key": "k"}\n'


def test_run_prints_a_line_per_step_and_keeps_its_wall_time(script, tmp_path, monkeypatch, capsys):
  """A stand-in for `ada_jax.main` appends three metrics lines, then the summary."""
  workdir = tmp_path / "job"
  job = (
    "import json, pathlib, sys, time\n"
    "w = pathlib.Path(sys.argv[1])\n"
    "for s in (1, 2, 3):\n"
    "  time.sleep(0.3)\n"
    "  with open(w / 'metrics.jsonl', 'a') as f:\n"
    f"    f.write(json.dumps({{**{_line(0)!r}, 'step': s, 'tokens_decoded': 10}}) + '\\n')\n"
    "(w / 'summary.json').write_text(json.dumps({'steps_done': 3, 'after_rl': {}}))\n"
  )
  monkeypatch.setattr(script, "command", lambda w, c, o: [sys.executable, "-c", job, str(w)])
  monkeypatch.setattr(script, "POLL_S", 0.1)
  script.run(workdir, "configs/smollm2_arith_pos.py", {}, 3)
  out = capsys.readouterr().out
  steps = [line for line in out.splitlines() if "] step " in line]
  assert [line.split("] step ")[1].split()[0] for line in steps] == ["1/3", "2/3", "3/3"]
  assert "decode tokens 0.0k" in steps[-1]  # 30 tokens
  assert "finished: " in out
  sessions = json.loads((workdir / "sessions.json").read_text())
  assert len(sessions) == 1 and sessions[0]["rc"] == 0 and sessions[0]["wall_s"] >= 0.9
  script.run(workdir, "configs/smollm2_arith_pos.py", {}, 3)  # finished: skipped
  assert "finished already" in capsys.readouterr().out
