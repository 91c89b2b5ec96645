"""experiments/smollm2_learning.py without training: its report reads fabricated workdirs
(metrics.jsonl, eval reports, summary.json, sessions.json) into the JSON and PNG; finished
runs are skipped; a run's progress lines and wall time come from a stand-in job; workdir
names, overrides and the shared before-RL cache."""

import json
import pathlib
import sys

import pytest

from ada_jax import testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "smollm2_learning.py"
AVG, BOXED = "eval/arith_text/avg@4", "eval/arith_text/boxed_rate"


@pytest.fixture(scope="module")
def script():
  return testing.load_experiment("smollm2_learning")


def _line(step, **kw):
  return {
    "step": step,
    "first_round_pass_rate": 0.25 * step,
    "ada/first_round_all_correct": 0,
    "ada/first_round_all_wrong": 2,
    "samples_drawn": 16,
    "zero_signal_frac": 0.5,
    "tokens_trained": 300,
    "time_sample_s": 60.0,
    "time_grade_wait_s": 1.0,
    "time_train_s": 59.0,
    **kw,
  }


def _eval_report(workdir, step, avg, boxed, suffix="", correct=None):
  path = workdir / "eval" / f"step_{step}{suffix}.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  results = {"arith_text": {"avg@4": avg, "boxed_rate": boxed, "num_problems": 4}}
  correct = correct or [round(4 * avg)] * 4
  problems = [
    {"prompt_id": f"q{i}", "correct": c, "boxed": 4, "k": 4} for i, c in enumerate(correct)
  ]
  report = {
    "results": {**results, "average": results["arith_text"]},
    "problems": {"arith_text": problems},
  }
  path.write_text(json.dumps(report))


def _fabricate(workdir, steps_done, *, finished, tokens=None, pass_rate=None, after=0.5):
  """A run of `steps_done` steps, evaluated at 0, 2 and (finished) the end."""
  workdir.mkdir(parents=True)
  lines = []
  for s in range(1, steps_done + 1):
    extra = {"tokens_decoded": tokens[s - 1]} if tokens else {"response_len_mean": 10.0}
    if pass_rate is not None:
      extra["first_round_pass_rate"] = pass_rate(s)
    lines.append(_line(s, **extra))
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
  _eval_report(workdir, 0, 0.25, 0.7)
  _eval_report(workdir, 2, 0.0, 0.1)  # replaced by the re-evaluation below
  _eval_report(workdir, 2, 0.5, 0.8, suffix=".2")
  (workdir / "sessions.json").write_text(json.dumps([{"wall_s": 3600.0}, {"wall_s": 1800.0}]))
  if finished:
    _eval_report(workdir, steps_done, after, 0.9)
    summary = {"steps_done": steps_done, "after_rl": {AVG: after, BOXED: 0.9}}
    (workdir / "summary.json").write_text(json.dumps(summary))


def test_report_reads_runs_and_computes_the_endpoints(script, tmp_path):
  root, out = tmp_path / "root", tmp_path / "out" / "learning"
  learning = root / "learning"
  for seed in (0, 1):
    # pos leads GRPO-matched by 0.1 + 0.01 * seed at every step; held out 0.75 vs 0.5.
    _fabricate(
      learning / f"ada_pos_seed{seed}",
      4,
      finished=True,
      tokens=[100, 200, 300, 400],
      pass_rate=lambda s, seed=seed: 0.2 + 0.1 + 0.01 * seed,
      after=0.75,
    )
    _fabricate(learning / f"grpo_matched_seed{seed}", 4, finished=True, pass_rate=lambda s: 0.2)
  _fabricate(learning / "ada_balance_seed0", 3, finished=False)  # killed after step 3
  args = ["--report", f"--root={root}", f"--model_dir={tmp_path / 'model'}", f"--out={out}"]
  script.main([*args, "--steps=4", "--eval_every=2", "--seeds", "0", "1"])
  report = json.loads(out.with_suffix(".json").read_text())
  assert out.with_suffix(".png").stat().st_size > 0
  assert report["steps"] == 4 and report["git_commit"] and report["reference"] == "GRPO-matched"
  assert list(report["arms"]) == ["GRPO-matched", "Ada-pos", "Ada-balance"]
  pos = report["arms"]["Ada-pos"]["runs"][0]
  assert pos["status"] == "finished" and pos["steps_done"] == 4 and pos["seed"] == 0
  # Held-out points against steps and decode tokens (.2 wins at step 2), per-problem counts.
  assert [(p["step"], p["decode_tokens"], p["avg"]) for p in pos["heldout"]] == [
    (0, 0.0, 0.25),
    (2, 300.0, 0.5),
    (4, 1000.0, 0.75),
  ]
  assert pos["heldout"][2]["problems"] == {f"q{i}": 3 for i in range(4)}
  t = pos["train"]
  assert t["decode_tokens"] == [100, 300, 600, 1000] and t["wall_s"] == [120, 240, 360, 480]
  assert t["first_round_all_wrong"] == [2] * 4 and t["tokens_trained"] == [300] * 4
  assert pos["hours"] == 1.5 and pos["sessions"] == 2 and pos["step_s_median"] == 120.0
  assert pos["config"]["ada"]["method"] == "pos" and pos["config"]["rl"]["steps"] == 4
  assert "--config=configs/smollm2_arith_pos.py" in pos["command"]
  grpo = report["arms"]["GRPO-matched"]["runs"][0]
  assert grpo["config"]["ada"]["method"] == "grpo"
  # Decode tokens of a run logged before `tokens_decoded`: samples x mean length.
  assert grpo["train"]["decode_tokens"] == [160.0, 320.0, 480.0, 640.0]
  balance = report["arms"]["Ada-balance"]["runs"]
  assert balance[0]["status"] == "partial" and balance[1]["status"] == "not started"
  # The endpoints: (a) zero-signal and all-wrong shares (B = 4 prompts).
  ends = report["endpoints"]["Ada-pos"]
  assert ends["zero_signal_fraction"]["mean"] == pytest.approx(0.5)
  assert ends["first_round_all_wrong_share"]["mean"] == pytest.approx(0.5)
  # (b) the paired per-step difference: 0.1 + 0.01 * seed, flat.
  d = ends["pass_rate_vs_reference"]
  assert d["difference"]["mean"] == pytest.approx(0.105)
  assert d["slope"]["mean"] == pytest.approx(0.0, abs=1e-9)
  # (c) held out at the last step: 0.75 - 0.5 on every problem and seed.
  h = ends["heldout_vs_reference_step4"]
  assert h["mean"] == pytest.approx(0.25) and h["low"] == pytest.approx(0.25)
  assert h["per_seed"]["0"]["difference"] == pytest.approx(0.25)
  assert "heldout_vs_reference_at_ada_balance_tokens" not in ends  # not continued
  assert report["endpoints"]["GRPO-matched"]["heldout_avg"]["4"]["arm"] == pytest.approx(0.5)


def test_sweep_report_names_runs_by_learning_rate(script, tmp_path):
  root, out = tmp_path / "root", tmp_path / "sweep"
  _fabricate(root / "lr_sweep" / "grpo_matched_learning_rate3e_06_seed0", 2, finished=True)
  args = ["--sweep", "--report", f"--root={root}", f"--model_dir={tmp_path}", f"--out={out}"]
  script.main([*args, "--lrs", "1e-6", "3e-6", "--steps=2", "--eval_every=0", "--seeds=0"])
  report = json.loads(out.with_suffix(".json").read_text())
  assert list(report["arms"]) == ["GRPO-matched lr=1e-06", "GRPO-matched lr=3e-06"]
  low, high = (report["arms"][k]["runs"][0] for k in report["arms"])
  assert low["status"] == "not started" and high["status"] == "finished"
  assert high["config"]["optim"]["learning_rate"] == 3e-6
  assert high["config"]["ada"]["method"] == "grpo"


def test_equal_compute_continues_the_reference_to_balances_tokens(script, tmp_path, monkeypatch):
  balance = tmp_path / "balance"
  _fabricate(balance, 4, finished=True, tokens=[300, 300, 300, 300, 300][:4])
  record = script.read_run(balance, 4)
  assert script.equal_compute_target(record, 4) == 1200.0
  assert script.equal_compute_target(record, 5) is None  # not there yet
  ref = tmp_path / "ref"
  _fabricate(ref, 4, finished=True, tokens=[100] * 4)
  calls = []

  def fake_run(workdir, config, overrides, steps):
    calls.append((overrides["rl.steps"], overrides["eval.every_steps"]))
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    with open(workdir / "metrics.jsonl", "a") as f:
      for s in range(lines[-1]["step"] + 1, steps + 1):
        f.write(json.dumps(_line(s, tokens_decoded=100)) + "\n")

  monkeypatch.setattr(script, "run", fake_run)
  spec = {"workdir": ref, "config": "configs/smollm2_arith_grpo_matched.py", "overrides": {}}
  # 400 decoded by step 4 at 100 per step: 8 more steps reach 1,200.
  assert script.continue_to_equal_compute(spec, 1200.0, 4) == 12
  assert calls == [(12, 0)]
  assert script.equal_compute_step(ref) == 12


def test_a_report_outlives_its_workdirs(script, tmp_path, monkeypatch):
  """Runs whose workdirs are gone (another machine) are read back from the report they
  were committed in, never run again; their equal-compute target still comes from them;
  a reference continued without its checkpoints is made again first."""
  root, out = tmp_path / "root", tmp_path / "out" / "learning"
  learning = root / "learning"
  _fabricate(learning / "ada_balance_seed0", 4, finished=True, tokens=[300] * 4)
  _fabricate(learning / "grpo_matched_seed0", 4, finished=True, tokens=[100] * 4)
  _fabricate(learning / "ada_pos_seed1", 2, finished=False)
  args = [f"--root={root}", f"--model_dir={tmp_path / 'model'}", f"--out={out}", "--steps=4"]
  script.main(["--report", *args, "--eval_every=2", "--seeds", "0", "1"])
  first = json.loads(out.with_suffix(".json").read_text())
  for name in ("ada_balance_seed0", "grpo_matched_seed0", "ada_pos_seed1"):
    for f in (learning / name).iterdir():
      if f.is_file():
        f.unlink()  # the workdirs' files are gone, the report stays
    for f in (learning / name / "eval").iterdir():
      f.unlink()
  _fabricate(learning / "ada_pos_seed0", 4, finished=True)  # a new run beside them
  calls = []

  def fake_run(workdir, config, overrides, steps):
    calls.append((workdir.name, overrides["rl.steps"]))
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "metrics.jsonl", "a") as f:
      done = len(script.metrics_lib.read_jsonl(workdir / "metrics.jsonl"))
      for s in range(done + 1, steps + 1):
        f.write(json.dumps(_line(s, tokens_decoded=100)) + "\n")

  monkeypatch.setattr(script, "run", fake_run)
  monkeypatch.setattr(script, "ensure_model", lambda *a: None)
  script.main([*args, "--eval_every=2", "--seeds", "0", "--arms", "GRPO-matched", "Ada-balance"])
  # Nothing finished ran again; the reference was made again (4 steps), then continued to
  # balance's 1,200 tokens (8 more at 100 a step).
  assert calls == [("grpo_matched_seed0", 4), ("grpo_matched_seed0", 12)]
  script.main(["--report", *args, "--eval_every=2", "--seeds", "0", "1"])
  report = json.loads(out.with_suffix(".json").read_text())
  balance = report["arms"]["Ada-balance"]["runs"][0]
  old = first["arms"]["Ada-balance"]["runs"][0]
  assert balance["read_from"] == f"the report of runs at {first['git_commit']}"
  assert {k: v for k, v in balance.items() if k != "read_from"} == old
  assert report["arms"]["Ada-pos"]["runs"][1]["status"] == "partial"  # kept as it was
  assert first["arms"]["Ada-pos"]["runs"][1]["status"] == "partial"
  assert "read_from" not in report["arms"]["Ada-pos"]["runs"][0]  # read from its workdir
  grpo = report["arms"]["GRPO-matched"]["runs"][0]
  assert "read_from" not in grpo and grpo["equal_compute_step"] == 12
  # Read back again, a record keeps naming the report its figures were measured for.
  assert (
    script.previous_runs(out.with_suffix(".json"))["Ada-balance", 0]["read_from"]
    == (balance["read_from"])
  )
  # Another machine's model folder is the same run; another learning rate is not, and its
  # records are left out of the arm rather than pooled with it.
  elsewhere = [a.replace("/model", "/other_model") for a in args]
  script.main(["--report", *elsewhere, "--eval_every=2", "--seeds", "0", "1"])
  moved = json.loads(out.with_suffix(".json").read_text())
  assert moved["arms"]["Ada-balance"]["runs"][0]["read_from"] == balance["read_from"]
  script.main(
    ["--report", *args, "--eval_every=2", "--seeds", "1", "--set", "optim.learning_rate=3e-6"]
  )
  other = json.loads(out.with_suffix(".json").read_text())
  assert [r["seed"] for r in other["arms"]["Ada-balance"]["runs"]] == [1]
  assert other["arms"]["Ada-balance"]["runs"][0]["status"] == "not started"
  # A report cut short is refused, not read as none and overwritten.
  out.with_suffix(".json").write_text(out.with_suffix(".json").read_text()[:100])
  with pytest.raises(SystemExit, match="not a report this script wrote"):
    script.main(["--report", *args, "--eval_every=2", "--seeds", "0"])


def test_names_overrides_and_skipping(script, tmp_path):
  sets = script.parse_sets(["optim.learning_rate=3e-6", "ada.method=balance", "x.y=[1, 2]"])
  assert sets == {"optim.learning_rate": 3e-6, "ada.method": "balance", "x.y": [1, 2]}
  with pytest.raises(SystemExit, match="group.field=value"):
    script.parse_sets(["optim.learning_rate"])
  assert script.run_name("GRPO-matched", 1, {}) == "grpo_matched_seed1"
  assert script.run_name("GRPO (authors')", 1, {}) == "grpo_authors_seed1"
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
  a, b = tmp_path / "learning" / "grpo_matched_seed0", tmp_path / "lr_sweep" / "ada_pos_seed0"
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


def _sweep_row(avgs, boxed=0.8, status="finished"):
  heldout = [{"step": s, "avg": a, "boxed_rate": boxed} for s, a in zip((0, 16), avgs, strict=True)]
  return {"runs": [{"status": status, "heldout": heldout}]}


def test_choose_rate_applies_the_rule_fixed_before_the_sweep(script):
  lr = lambda x: f"GRPO-matched lr={x:g}"
  # The smallest rate within TIE of the best wins; a broken format or unfinished run is out.
  chosen = script.choose_rate(
    {
      lr(3e-6): _sweep_row((0.11, 0.150)),
      lr(1e-5): _sweep_row((0.11, 0.195)),
      lr(3e-5): _sweep_row((0.11, 0.200)),
      lr(1e-4): _sweep_row((0.11, 0.400), boxed=0.3),
      lr(3e-4): _sweep_row((0.11, 0.500), status="partial"),
    }
  )
  assert chosen["learning_rate"] == 1e-5 and chosen["heldout_avg"] == 0.195
  # Just outside the tie, the larger rate wins.
  rows = {lr(1e-5): _sweep_row((0.11, 0.189)), lr(3e-5): _sweep_row((0.11, 0.2))}
  assert script.choose_rate(rows)["learning_rate"] == 3e-5
  # Nothing learned (best not TIE above the base) or nothing qualifies: no rate.
  flat = script.choose_rate({lr(1e-5): _sweep_row((0.11, 0.115))})
  assert flat["learning_rate"] is None and "base" in flat["why"]
  assert script.choose_rate({lr(1e-5): _sweep_row((0.11, 0.3), boxed=0.1)})["learning_rate"] is None
