"""Tests of ada_jax.select_prompts: rules, the stub-policy selection with known per-prompt pass
rates, resume and determinism through the results cache, and the CLI end to end on a briefly
warm-started tiny arithmetic model whose selected set then trains with
configs/tiny_arith_balance.py through the user-JSONL data path."""

import json
import pathlib
import sys

import jax
import numpy as np
import pytest
from absl import flags

from ada_jax import select_prompts as select_cli
from ada_jax import selection as select_prompts
from ada_jax.data import prompts
from ada_jax.eval import benchmarks
from ada_jax.selection import FilterRule, SelectConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # The config files import `configs.common`.
  sys.path.insert(0, str(ROOT))

# --------------------------------------------------------------------------- rules


def test_parse_rules_and_bad_rules_are_named():
  hard, easy = select_prompts.parse_rules("hard:0.125:1, easy:0.3125")
  assert hard == FilterRule("hard", 0.125, 1) and easy == FilterRule("easy", 0.3125, 1)
  assert select_prompts.parse_rules(["a:0.5:0"]) == (FilterRule("a", 0.5, 0),)
  with pytest.raises(ValueError, match=r"rule 'x:1\.5'.*max_pass_rate"):
    select_prompts.parse_rules("x:1.5")
  with pytest.raises(ValueError, match=r"rule 'x'.*name:max_pass_rate"):
    select_prompts.parse_rules("x")
  with pytest.raises(ValueError, match=r"rule 'x:0\.5:-1'.*min_correct"):
    select_prompts.parse_rules("x:0.5:-1")
  with pytest.raises(ValueError, match="duplicate"):
    select_prompts.parse_rules("a:0.5,a:0.2")
  with pytest.raises(ValueError, match="rule name 'pass_rates'"):
    FilterRule("pass_rates", 0.5)
  with pytest.raises(ValueError, match="rule name 'a/b'"):
    FilterRule("a/b", 0.5)
  with pytest.raises(ValueError, match=r"rule 'a': min_correct=5 > k=4"):
    SelectConfig.of(rules="a:1.0:5", k=4)
  with pytest.raises(ValueError, match=r"eval\.k=0"):
    SelectConfig.of(rules=(), k=0)


def test_rule_thresholds_are_inclusive():
  easy = FilterRule("easy", 0.3125, 1)  # 5/16
  assert [c for c in range(17) if easy.keeps(c, 16)] == [1, 2, 3, 4, 5]
  assert [c for c in range(9) if FilterRule("hard", 0.125).keeps(c, 8)] == [1]
  assert [c for c in range(5) if FilterRule("hard", 0.125).keeps(c, 4)] == []
  assert [c for c in range(5) if FilterRule("all", 1.0, 0).keeps(c, 4)] == [0, 1, 2, 3, 4]


# --------------------------------------------------------------------------- stub policy

K = 16
COUNTS = [0, 1, 2, 3, 5, 6, 8, 16, 1, 4, 15, 0]  # correct responses of 16, per prompt


def _prompt_set(n: int) -> prompts.PromptSet:
  return prompts.PromptSet(
    prompt_ids=tuple(f"p{i}" for i in range(n)),
    problems=tuple(f"{i}+0=" for i in range(n)),
    answers=tuple(str(i) for i in range(n)),
    sources=("stub",) * n,
    tokens=tuple(np.asarray([i + 1, 7], np.int32) for i in range(n)),  # token 0 = prompt i+1
    num_dropped=0,
  )


def _exact(texts, references):
  return np.asarray(
    [t == f"\\boxed{{{r}}}" for t, r in zip(texts, references, strict=True)], np.float32
  )


def _known_counts_policy(calls: list):
  """Exactly COUNTS[i] correct rows for prompt i, at positions drawn from the key."""

  def policy(prompt_tokens, row_prompt, rng):
    calls.append(len(prompt_tokens))
    gen = np.random.default_rng(np.asarray(jax.random.key_data(rng)))
    texts = ["wrong"] * len(row_prompt)
    for local, tokens in enumerate(prompt_tokens):
      i = int(tokens[0]) - 1
      rows = np.flatnonzero(row_prompt == local)
      for r in gen.permutation(rows)[: COUNTS[i]]:
        texts[r] = f"\\boxed{{{i}}}"
    return texts, np.full(len(row_prompt), 3, np.int32)

  return policy


def test_stub_policy_with_known_pass_rates_yields_exactly_the_expected_sets(tmp_path):
  config = SelectConfig.of(k=K, problems_per_batch=5, verifier={"judge": "exact"})
  assert [r.name for r in config.rules] == ["hard", "easy"]  # The paper's two sets.
  ps = _prompt_set(len(COUNTS))
  calls = []
  rows = select_prompts.pass_rates(
    _known_counts_policy(calls), _exact, ps, config, jax.random.key(0)
  )
  assert calls == [5, 5, 2]  # Batches of 5 prompts, 16 rows each.
  assert [r["pass_count"] for r in rows] == COUNTS
  assert [r["pass_rate"] for r in rows] == [c / K for c in COUNTS]
  assert rows[1] == {
    "prompt_id": "p1",
    "problem": "1+0=",
    "answer": "1",
    "source": "stub",
    "num_samples": K,
    "pass_count": 1,
    "pass_rate": 0.0625,
    "mean_response_tokens": 3.0,
  }

  summary = select_prompts.write_outputs(rows, config, tmp_path, {"model": "stub"})
  # hard: pass rate <= 2/16 with >= 1 correct; easy: <= 5/16 with >= 1 correct.
  expected = {"hard": ["p1", "p2", "p8"], "easy": ["p1", "p2", "p3", "p4", "p8", "p9"]}
  for name, ids in expected.items():
    kept = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    assert [r["prompt_id"] for r in kept] == ids
    assert all(set(r) >= {"problem", "answer", "pass_count", "pass_rate"} for r in kept)
    assert summary["sets"][name]["prompts"] == len(ids)
  lines = (tmp_path / "pass_rates.jsonl").read_text().splitlines()
  assert [json.loads(line)["pass_count"] for line in lines] == COUNTS
  assert summary["histogram"] == np.bincount(COUNTS, minlength=K + 1).tolist()
  assert summary["num_prompts"] == 12 and summary["model"] == "stub"
  assert summary["mean_pass_rate"] == pytest.approx(np.mean(COUNTS) / K)
  assert json.loads((tmp_path / "summary.json").read_text())["sets"] == summary["sets"]
  table = (tmp_path / "pass_rates.md").read_text()
  assert "| 1 | 0.0625 | 2 | 16.7 | 33.3 |" in table  # p1 and p8; cumulative 4/12
  assert "| hard | pass rate <= 0.125, >= 1 correct | 3 | 25.0 |" in table
  assert (tmp_path / "pass_rates.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _random_policy(calls: list):
  """Each row correct with probability (i mod 5) / 4, drawn from the key."""

  def policy(prompt_tokens, row_prompt, rng):
    calls.append(len(prompt_tokens))
    gen = np.random.default_rng(np.asarray(jax.random.key_data(rng)))
    p = np.asarray([(int(prompt_tokens[j][0]) - 1) % 5 / 4 for j in row_prompt])
    right = gen.random(len(row_prompt)) < p
    texts = [
      f"\\boxed{{{int(prompt_tokens[j][0]) - 1}}}" if ok else "x"
      for j, ok in zip(row_prompt, right, strict=True)
    ]
    if len(calls) == fail_at[0]:
      raise KeyboardInterrupt("simulated interruption")
    return texts, np.ones(len(row_prompt), np.int32)

  fail_at = [None]
  policy.fail_at = fail_at
  return policy


def test_resumes_from_the_cache_and_is_deterministic_for_a_seed(tmp_path):
  config = SelectConfig.of(k=8, problems_per_batch=4, verifier={"judge": "exact"})
  ps = _prompt_set(10)
  cache = benchmarks.ResultCache(tmp_path / "cache.jsonl")
  calls = []
  policy = _random_policy(calls)
  policy.fail_at[0] = 2
  kw = dict(cache=cache, model_tag="stub")
  with pytest.raises(KeyboardInterrupt):
    select_prompts.pass_rates(policy, _exact, ps, config, jax.random.key(5), **kw)
  assert len((tmp_path / "cache.jsonl").read_text().splitlines()) == 4  # the first batch

  calls.clear()
  policy.fail_at[0] = None
  reloaded = benchmarks.ResultCache(tmp_path / "cache.jsonl")
  resumed = select_prompts.pass_rates(
    policy, _exact, ps, config, jax.random.key(5), cache=reloaded, model_tag="stub"
  )
  assert calls == [4, 2]  # only the unfinished batches
  fresh = select_prompts.pass_rates(policy, _exact, ps, config, jax.random.key(5))
  assert resumed == fresh
  assert 0 < sum(r["pass_count"] for r in fresh) < 80
  other_seed = select_prompts.pass_rates(policy, _exact, ps, config, jax.random.key(6))
  assert [r["pass_count"] for r in other_seed] != [r["pass_count"] for r in fresh]

  calls.clear()  # A different batch layout changes the keys: the cache is not reused.
  bigger = SelectConfig.of(k=8, problems_per_batch=5, verifier={"judge": "exact"})
  select_prompts.pass_rates(
    policy, _exact, ps, bigger, jax.random.key(5), cache=reloaded, model_tag="stub"
  )
  assert calls == [5, 5]


# --------------------------------------------------------------------------- end to end


def _cli(argv):
  fv = flags.FlagValues()
  argv = ["select_prompts", *argv]
  select_cli.define_flags(fv, sys_argv=argv)
  fv(argv)
  return select_cli.main([], fv)


@pytest.mark.slow
def test_cli_on_tiny_arith_and_the_selected_set_trains(tmp_path, monkeypatch):
  """configs/tiny_arith_balance.py with a short warm start: select with K=8, rerun (all
  cached, no second warm start), then RL-train from the same base params on a selected set
  loaded through `data.source='jsonl'`."""
  from ada_jax import loop
  from ada_jax.rl import warmstart
  from ada_jax.rollout import sampler
  from configs import tiny_arith_balance

  work = tmp_path / "select_work"
  argv = [
    f"--config={ROOT / 'configs' / 'tiny_arith_balance.py'}",
    f"--workdir={work}",
    "--k=8",
    "--problems_per_batch=16",
    "--rules=hard:0.125:1,easy:0.3125:1,mixed:0.875:1",
    "--config.data.arith_prompts=48",
    "--config.data.arith.levels=(1, 2)",
    "--config.warmstart.steps=100",
    "--config.warmstart.task.levels=(1, 2)",
    "--config.warmstart.task.level_weights=(1.0, 3.0)",
  ]
  summary = _cli(argv)
  out = work / "select"
  assert summary["num_prompts"] == 48 and summary["k"] == 8
  rows = [json.loads(line) for line in (out / "pass_rates.jsonl").read_text().splitlines()]
  assert [r["prompt_id"] for r in rows] == [f"arith/train/0/{i}" for i in range(48)]
  counts = [r["pass_count"] for r in rows]
  assert summary["histogram"] == np.bincount(counts, minlength=9).tolist()
  assert 0 < sum(counts) < 48 * 8  # The warm start taught something, not everything.
  for name, rule in (("hard", (1, 1)), ("easy", (1, 2)), ("mixed", (1, 7))):
    kept = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
    assert [r["prompt_id"] for r in kept] == [
      r["prompt_id"] for r in rows if rule[0] <= r["pass_count"] <= rule[1]
    ]
  mixed = summary["sets"]["mixed"]["prompts"]
  assert mixed >= 8, summary["histogram"]
  base = pathlib.Path(summary["init_from"])
  assert (base / "params").is_dir() and base.parent == out

  def fail(*args, **kwargs):
    raise AssertionError("rerun must reuse the cache and the saved base params")

  with monkeypatch.context() as m:
    m.setattr(warmstart, "warm_start", fail)
    m.setattr(sampler.Sampler, "generate", fail)
    again = _cli(argv)
  assert again["histogram"] == summary["histogram"] and again["sets"] == summary["sets"]

  # Training on the selected set: the user-JSONL data path, from the same base params.
  c = tiny_arith_balance.get_config()
  c.data.source = "jsonl"
  c.data.jsonl_paths = (str(out / "mixed.jsonl"),)
  c.data.prompt_style = "raw"  # The arithmetic task's bare prompts, as selection saw them.
  c.data.data_dir = str(tmp_path / "tfds")
  # User JSONL sets are decontaminated against MATH500 (inputs.load_prompts' default): an
  # empty copy of it keeps this test offline.
  manual = tmp_path / "manual"
  manual.mkdir()
  (manual / "math500_test.jsonl").write_text("")
  c.data.manual_dir = str(manual)
  c.warmstart = None  # The base params come from the selection run instead.
  c.ckpt.init_from = summary["init_from"]
  c.rl.steps = 2
  c.rl.batch_prompts = 8
  c.eval.benchmarks = ()
  result = loop.run(c, str(tmp_path / "train_work"))
  assert result["steps_done"] == 2 and result["source"].startswith("init_from:")
  metrics = [
    json.loads(line)
    for line in (tmp_path / "train_work" / "metrics.jsonl").read_text().splitlines()
  ]
  assert len(metrics) == 2 and 0.0 < metrics[0]["pass_rate"] < 1.0


def test_cli_model_from_hf_folder_or_checkpoint_gives_the_same_rows(tmp_path):
  """--hf_dir and --checkpoint (architecture from model.preset + overrides) load the same
  random tiny model; --limit, --k and --seed are honoured; the sets are empty but written."""
  import dataclasses

  from ada_jax import checkpoint
  from ada_jax.data import arith
  from ada_jax.models import decoder as model_lib
  from ada_jax.models import sharding, weights
  from ada_jax.rl import train

  tok = arith.load_tokenizer()
  mc = model_lib.ModelConfig(
    family="llama", vocab_size=tok.vocab_size, embed_dim=32, mlp_dim=64, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=16,
  )  # fmt: skip
  params = model_lib.init_params(mc, jax.random.key(3))
  folder = tmp_path / "hf"
  weights.save_hf(mc, params, folder)
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    (folder / name).write_text((arith.TOKENIZER_DIR / name).read_text())
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  manager = checkpoint.make_manager(tmp_path / "work" / "checkpoints")
  state = train.init_train_state(mc, train.TrainConfig(), params, mesh)
  checkpoint.save(manager, 3, checkpoint.RunState(train=state, rng=jax.random.key(0)))
  checkpoint.close(manager)
  arch = {f.name: getattr(mc, f.name) for f in dataclasses.fields(mc)}
  arch = {k: v for k, v in arch.items() if k not in ("dtype", "param_dtype")}
  config = tmp_path / "cfg.py"
  config.write_text(
    "from configs import tiny_arith_pos\n\ndef get_config():\n"
    "  c = tiny_arith_pos.get_config()\n"
    f"  c.model.overrides.update({arch!r})\n"
    "  c.sampler.max_new_tokens = 32\n  c.data.arith_prompts = 64\n  return c\n"
  )
  flags_ = [f"--config={config}", f"--workdir={tmp_path / 'work'}", "--k=2", "--limit=12"]
  from_hf = _cli([*flags_, f"--hf_dir={folder}", "--seed=4"])
  from_ckpt = _cli([*flags_, "--checkpoint=3", "--seed=4"])
  assert from_hf["model"].startswith("weights:") and from_hf["init_from"] == ""
  assert from_ckpt["init_from"] == str(tmp_path / "work" / "checkpoints" / "3")
  assert from_hf["num_prompts"] == 12 and from_hf["k"] == 2 and from_hf["settings"]["seed"] == 4
  assert from_hf["settings"]["sampler"]["max_new_tokens"] == 32
  lengths = [r["mean_response_tokens"] for r in from_hf["rows"]]
  assert lengths == [r["mean_response_tokens"] for r in from_ckpt["rows"]]
  assert len(set(lengths)) > 1  # random responses, identical from both loads
  for name in ("hard", "easy"):
    assert (tmp_path / "work" / "select" / f"{name}.jsonl").exists()
