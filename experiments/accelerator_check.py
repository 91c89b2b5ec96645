"""What the code achieves on the accelerator at hand: one process, one JSON object.

  python experiments/accelerator_check.py            # GPU or TPU; target < 8 min on an H200
  python experiments/accelerator_check.py --decode_7b_slots=256 --out=RESULT.json
  python experiments/accelerator_check.py --tiny --out=/tmp/check.json   # CPU, tiny sizes

Parts (`--parts`, comma-separated; each catches its own failure and records it, so one
failing part never loses the others' figures; the JSON is rewritten after every part):

* `decode`: the slot-pool sampler (`Sampler.from_spec`, `SlotDriver`) on a
  Qwen2.5-Math-1.5B-shaped model with random weights (float32 masters, decoded from
  their bf16 copy), S in {64, 256, 1024} slots, S/8 prompts of 512 tokens with 8 rows
  each, forced lengths (the stop id is outside the vocabulary, so every row runs to the
  budget). The first segment compiles and fills the
  slots; the middle segments are timed. Per S: decode tokens/s, step time, the step's HBM
  bytes (weights read + the live KV cache read, computed from the model's shapes:
  2 × layers × S × kv_heads × head_dim × live length × itemsize) and MBU = bytes per step
  ÷ step time ÷ the device's peak HBM bandwidth.
* `train`: the same model's train step (`train.make_train_step`) on rows of 1,024 prompt +
  2,048 response tokens with the Qwen config's micro-batch and remat: tokens/s and MFU =
  (6 + 2 with remat) × params × tokens ÷ step time ÷ peak bf16 FLOP/s.
* `rl`: one short run of `configs/tiny_arith_pos.py` (no warm start, no evaluation) under
  `ada.schedule` rounds and stream, through `loop.run`: seconds per step split into
  sample, grade-wait and train, and the XLA compiles of every step after the first.
* `agreement`: one sampled batch of the decode model: mean and max |sampler log-prob −
  trainer log-prob| (`losses.token_logprobs` on the sampled tokens), both in bf16 with
  fp32 logits.
* `memory`: per program (each decode pool, the train step), the device's peak bytes in
  use (`device.memory_stats()`; null on CPU, which has none) beside XLA's compiled
  memory analysis of the same program (the plan's prediction, as `memory_plan.py`).
* `decode_7b`: the decode roofline of the Qwen2.5-Math-7B shape at `--decode_7b_slots`
  slots (only when that is > 0).
* `smollm2`: a real pretrained model, SmolLM2-135M-Instruct, through `loop.run` on
  `configs/smollm2_arith_pos.py` in the paper runs' precision (bf16 compute, float32
  masters), no evaluation: seconds per step, decode tokens/s and the sampler–trainer
  log-prob gap (`old_logprob_gap`) per step. It needs the converted model folder
  (`--smollm2_dir`, default the config's; `python -m ada_jax.models.from_gguf`) and is
  recorded as skipped, with the reason, where that folder is absent (`--tiny` skips it:
  the tests cover that model in tests/test_gguf.py). The device machine cannot be handed
  the model: the GGUF is 94 MiB, over the 64 MiB the device tool carries.

Peaks (`ada_jax.plan.targets.CHIPS`, the plans' table): vendor datasheet figures per chip, dense
bf16, matched on `device.device_kind`; `--peak_hbm_bytes_per_s` / `--peak_bf16_flops` override them.
Output: `--out`, by default `experiments/results/accelerator_check_<device kind>.json`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import gc
import importlib
import importlib.metadata
import json
import math
import pathlib
import platform
import re
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's ada_jax and configs, whatever is installed

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ada_jax import config as config_lib  # noqa: E402
from ada_jax import loop, platforms  # noqa: E402
from ada_jax import metrics as metrics_lib  # noqa: E402
from ada_jax.models import decoder as model_lib  # noqa: E402
from ada_jax.models import sharding as sharding_lib  # noqa: E402
from ada_jax.models import weights  # noqa: E402
from ada_jax.plan import programs  # noqa: E402
from ada_jax.rl import losses, train  # noqa: E402
from ada_jax.rollout import sampler as sampler_lib  # noqa: E402
from ada_jax.rollout.spec import SamplerSpec  # noqa: E402

sys.path.insert(0, str(ROOT / "experiments"))
from accelerator_peaks import device_memory, memory_record, peaks_of, xla_memory  # noqa: E402

PARTS = ("decode", "train", "rl", "agreement", "memory", "decode_7b", "smollm2")


@dataclasses.dataclass(frozen=True)
class Sizes:
  """What each part runs (`FULL` on an accelerator, `TINY` on a CPU)."""

  model: str  # decode, train and agreement model (a `model_lib.PRESETS` name)
  decode_slots: tuple[int, ...]  # S values of the decode roofline
  prompt_len: int  # decode prompt tokens (all real, one bucket)
  segment_steps: int  # decode steps per segment; the budget Lr is 4 segments
  rows_per_prompt: int  # rows sharing one prefilled prompt (the paper's M = 8)
  train_rows: int  # rows of the timed train step (one mini-batch)
  train_prompt_len: int
  train_response_len: int
  train_steps: int  # timed train steps after the compiling one
  agreement_slots: int  # S of the sampler whose batch is compared (one of decode_slots)
  rl_steps: int  # RL steps per schedule (step 1 compiles)
  rl_batch_prompts: int = 0  # 0 = the tiny config's
  rl_chunk_rows: int = 0  # 0 = the tiny config's
  smollm2_steps: int = 3  # RL steps of the real model (step 1 compiles)
  big_model: str = "qwen2.5-math-7b"

  @property
  def new_tokens(self) -> int:
    """The decode budget Lr; every row runs to it."""
    return 4 * self.segment_steps

  def sampler_spec(self, slots: int) -> SamplerSpec:
    """The decode pool's sampler group at S slots: one prompt bucket, Q = S queued rows."""
    return SamplerSpec(
      max_new_tokens=self.new_tokens,
      chunk_rows=slots,
      prompt_buckets=(self.prompt_len,),
      segment_steps=self.segment_steps,
      queue_rows=slots,
    )

  def prompts_for(self, slots: int) -> int:
    """Prompts the decode pool holds at S slots (`rows_per_prompt` rows each)."""
    return max(1, slots // self.rows_per_prompt)


FULL = Sizes(
  model="qwen2.5-math-1.5b",
  decode_slots=(64, 256, 1024),
  prompt_len=512,
  segment_steps=64,
  rows_per_prompt=8,
  train_rows=8,
  train_prompt_len=1024,
  train_response_len=2048,
  train_steps=3,
  agreement_slots=64,
  rl_steps=3,
)
TINY = dataclasses.replace(
  FULL,
  model="tiny-qwen2",
  decode_slots=(4, 8, 16),
  prompt_len=32,
  segment_steps=4,
  rows_per_prompt=2,
  train_rows=4,
  train_prompt_len=32,
  train_response_len=32,
  train_steps=2,
  agreement_slots=4,
  rl_steps=2,
  rl_batch_prompts=8,
  rl_chunk_rows=32,
  big_model="tiny-llama",
)


class Check:
  """The run: sizes, peaks, and what parts share (params, samplers, memory records)."""

  def __init__(self, args):
    self.args, self.sizes = args, TINY if args.tiny else FULL
    if args.decode_slots:
      self.sizes = dataclasses.replace(self.sizes, decode_slots=args.decode_slots)
    self.device = jax.devices()[0]
    self.peaks = peaks_of(self.device.device_kind, args.peak_hbm_bytes_per_s, args.peak_bf16_flops)
    self._params: dict[str, tuple] = {}
    self._samplers: dict[tuple, sampler_lib.Sampler] = {}
    self.memory: list[dict] = []
    self.rng = np.random.default_rng(0)

  def model(self, name: str) -> tuple[model_lib.ModelConfig, dict]:
    """A preset computing in bf16 (float32 master params, as a run keeps them) and its
    random params on the first device (made once)."""
    if name not in self._params:
      cfg = weights.ModelSpec(preset=name, dtype="bfloat16").model_config()
      params = jax.jit(functools.partial(model_lib.init_params, cfg))(jax.random.key(0))
      self._params = {name: (cfg, jax.block_until_ready(params))}  # one model held at a time
      gc.collect()
    return self._params[name]

  def sampler(self, cfg, slots: int) -> sampler_lib.Sampler:
    """The decode sampler of `cfg` at S slots (one per shape, so parts share compiles)."""
    key = (cfg, slots)
    if key not in self._samplers:
      # A stop id outside the vocabulary is never drawn: every row runs to the budget.
      spec = dataclasses.replace(
        self.sizes.sampler_spec(slots), prompts_per_chunk=self.sizes.prompts_for(slots)
      )
      self._samplers[key] = sampler_lib.Sampler.from_spec(
        cfg, spec, stop_ids=(cfg.vocab_size,), rows_per_prompt=self.sizes.rows_per_prompt
      )
    return self._samplers[key]

  def random_prompts(self, cfg, n: int) -> list[list[int]]:
    return self.rng.integers(1, cfg.vocab_size, (n, self.sizes.prompt_len)).tolist()

  def record_memory(self, program: str, before: dict | None, predicted: dict | None, live_args):
    """Adds `program`'s line to the memory table (`accelerator_peaks.memory_record`)."""
    after = device_memory()
    self.memory.append(
      memory_record(program, before, after, predicted, live_args, self.device.platform)
    )


def capture_segment(smp: sampler_lib.Sampler, prompt_len: int) -> dict:
  """Arms a one-shot hook that lowers the sampler's segment program with the arguments of
  its next call; returns the dict that will hold the `Lowered` (or the error). The segment
  program is `Sampler.programs(...).run`; the hook swaps the bucket's `SlotPrograms` for
  one whose `run` sees its arguments first, and the lowering reuses the program the call
  compiles."""
  box: dict = {}
  try:
    programs = smp.programs(prompt_len)
    segment = programs.run
  except (AttributeError, TypeError) as e:
    return {"error": f"the sampler's segment program is out of reach: {e!r}"}

  def spy(*args):
    if "lowered" not in box:
      box["lowered"] = segment.lower(*args)
    return segment(*args)

  smp._fns[prompt_len] = dataclasses.replace(programs, run=spy)
  return box


def decode_at(check: Check, cfg, params, slots: int, memory: bool) -> dict:
  """One decode roofline row: S slots, every row forced to the budget of 4 segments; the
  first compiles and fills the slots, the last ends every row, the middle two are timed."""
  z = check.sizes
  smp = check.sampler(cfg, slots)
  params = smp.rollout_params(params)  # what a run decodes from: the bf16 copy of the masters
  n_prompts = check.sizes.prompts_for(slots)
  prompts, row_prompt = check.random_prompts(cfg, n_prompts), np.arange(slots) % n_prompts
  box = capture_segment(smp, z.prompt_len) if memory else {}
  before = device_memory()
  segments = []  # (seconds, counters before, counters after, compiles)
  start = time.perf_counter()
  pool = smp.pool(params, jax.random.key(slots), z.prompt_len)
  pool.admit(prompts, row_prompt, collections.deque(range(slots)), {})
  prefill_s = time.perf_counter() - start
  while pool.busy:
    with metrics_lib.CompileCounter() as compiles:
      c0, t0 = pool.counters(), time.perf_counter()
      pool.run()
      segments.append((time.perf_counter() - t0, c0, pool.counters()))
    segments[-1] += (compiles.count,)
  lengths = [n for _, _, _, n in pool.collect()]
  timed = segments[1:-1]
  delta = lambda k: sum(c1[k] - c0[k] for _, c0, c1, _ in timed)
  seconds, steps = sum(t[0] for t in timed), delta("steps")
  # Decode step j (j tokens drawn before it) attends over the prompt and j + 1 response
  # columns; the timed steps are j = first ... first + steps - 1.
  live_len = z.prompt_len + timed[0][1]["steps"] + (steps + 1) / 2
  per_column = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
  per_column *= jnp.dtype(cfg.compute_dtype).itemsize
  weights_read = weight_bytes_per_step(cfg, params, slots)
  kv_bytes = per_column * slots * live_len
  step_s, bw = seconds / steps, check.peaks["hbm_bytes_per_s"]
  row = {
    "slots": slots,
    "sampler": {**dataclasses.asdict(check.sizes.sampler_spec(slots)), "stop_ids": smp.stop_ids},
    "prompts": n_prompts,
    "all_rows_at_budget": len(lengths) == slots and set(lengths) == {z.new_tokens},
    "compile_and_fill_s": prefill_s + segments[0][0],
    "decode_steps_timed": steps,
    "step_s": step_s,
    "tokens_per_s": delta("tokens") / seconds,
    "live_len_mean": live_len,
    "weight_bytes_per_step": weights_read,
    "kv_bytes_per_step": kv_bytes,
    "hbm_bytes_per_step": weights_read + kv_bytes,
    # What the block-wise attention reads (whole blocks up to the longest live row).
    "kv_bytes_per_step_block_reads": per_column * delta("kv_read") / steps,
    "mbu": (weights_read + kv_bytes) / step_s / bw if bw else None,
    "compiles_first_segment": segments[0][3],
    "compiles_timed": sum(t[3] for t in timed),
  }
  row |= expected_decode(smp, params, pool.state, step_s, bw)
  if memory:
    predicted = None
    try:
      with metrics_lib.CompileCounter() as extra:  # the program the call compiled: none
        predicted = xla_memory(box["lowered"].compile())
      row["compiles_for_memory_analysis"] = extra.count
    except Exception as e:  # noqa: BLE001 -- the decode figures stand without it
      row["memory_analysis_error"] = box.get("error") or f"{type(e).__name__}: {e}"
    check.record_memory(
      f"decode {cfg.num_layers}L S={slots}", before, predicted, param_bytes(params)
    )
  del pool
  return row


def expected_decode(smp, params, state, measured_step_s: float, bw: float | None) -> dict:
  """On a TPU, the compiler's expectation beside the measurement: the HBM bytes XLA:TPU's
  cost analysis gives one step of this pool's decode loop, every slot reading its whole
  cache (`plan.programs.decode_step_program`, the plan's roofline), over the chip's peak bandwidth,
  against the measured step (whose rows read their live columns only, so it can beat
  it). Elsewhere nothing: XLA:GPU and XLA:CPU give the plan no cost analysis."""
  if not platforms.of(jax.devices()[0].platform).cost_analysis or not bw:
    return {"expected": "not derived: only XLA:TPU's cost analysis is the plan's"}
  abstract = lambda t: jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), t
  )
  try:
    bytes_per_step = programs.decode_step_program(
      smp, abstract(params), abstract(state)
    ).bytes_accessed
  except Exception as e:  # noqa: BLE001 -- the measured figures stand without it
    return {"expected": f"not derived: {type(e).__name__}: {e}"}
  expected_s = bytes_per_step / bw
  return {
    "expected_hbm_bytes_per_step_worst_case": bytes_per_step,
    "expected_step_s_worst_case": expected_s,
    "measured_over_expected_step": measured_step_s / expected_s,
  }


def param_bytes(params) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(params))


def param_count(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


def weight_bytes_per_step(cfg, params, slots: int) -> int:
  """Parameter bytes one decode step reads: every weight once; of an untied input
  embedding only the S looked-up rows (the output table is read whole either way)."""
  total = param_bytes(params)
  if not cfg.tie_embeddings:
    table = params["embed"]
    total -= table.nbytes - slots * cfg.embed_dim * table.dtype.itemsize
  return int(total)


def run_decode(check: Check, model: str, slots_list, memory: bool) -> dict:
  cfg, params = check.model(model)
  rows = [guarded(decode_at, check, cfg, params, s, memory) for s in slots_list]
  for s, r in zip(slots_list, rows, strict=True):
    r.setdefault("slots", s)
  return {
    "model": model,
    "model_config": dataclasses.asdict(cfg),
    "params": param_count(params),
    # Of the compute-dtype copy the decode reads (the float32 masters are twice that).
    "param_bytes": param_count(params) * jnp.dtype(cfg.compute_dtype).itemsize,
    "peak_hbm_bytes_per_s": check.peaks["hbm_bytes_per_s"],
    "by_slots": rows,
  }


def part_train(check: Check) -> dict:
  """The train step of the decode model on one mini-batch; tokens/s and MFU."""
  z = check.sizes
  cfg, params = check.model(z.model)
  qwen = config_lib.parse(experiment_config("qwen_math15b_pos"))
  train_cfg = dataclasses.replace(qwen.train, num_minibatches=1)
  mesh = sharding_lib.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  rows, length = z.train_rows, z.train_prompt_len + z.train_response_len
  train.check_batch_layout(rows, train_cfg, mesh)
  tokens = check.rng.integers(1, cfg.vocab_size, (rows, length)).astype(np.int32)
  response = np.repeat(np.arange(length)[None, :] >= z.train_prompt_len, rows, 0)
  batch = train.TrainBatch(
    tokens=tokens,
    positions=np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
    segments=np.ones((rows, length), np.int32),
    loss_mask=response,
    advantages=np.repeat(check.rng.standard_normal((rows, 1)), length, 1).astype(np.float32),
    # Near the random model's own log-probs (uniform over V), so ratios sit near 1.
    old_logprobs=np.where(response, -math.log(cfg.vocab_size), 0.0).astype(np.float32),
  )
  state = train.init_train_state(cfg, train_cfg, params, mesh)
  batch = sharding_lib.place_batch(batch, mesh, "mini-batch")
  step_fn = train.make_train_step(cfg, train_cfg, mesh)
  before = device_memory()
  with metrics_lib.CompileCounter() as first:
    start = time.perf_counter()
    state, m = step_fn(state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - start
  times = []
  with metrics_lib.CompileCounter() as later:
    for _ in range(z.train_steps):
      start = time.perf_counter()
      state, m = step_fn(state, batch)
      jax.block_until_ready(m)
      times.append(time.perf_counter() - start)
  step_s = float(np.median(times))
  n = param_count(params)
  factor = 8 if train_cfg.remat else 6
  flops = check.peaks["bf16_flops"]
  out = {
    "model": z.model,
    "params": n,
    "rows": rows,
    "seq_len": length,
    "prompt_len": z.train_prompt_len,
    "response_len": z.train_response_len,
    "train_config": dataclasses.asdict(train_cfg),
    "first_step_s": compile_s,
    "step_s": step_s,
    "step_s_all": times,
    "tokens_per_s": rows * length / step_s,
    "flops_per_step": factor * n * rows * length,
    "flop_factor": factor,
    "mfu": factor * n * rows * length / step_s / flops if flops else None,
    "peak_bf16_flops": flops,
    "loss": float(m["loss"]),
    "compiles_first_step": first.count,
    "compiles_later_steps": later.count,
  }
  if "memory" in check.args.parts:
    with metrics_lib.CompileCounter() as extra:
      predicted = xla_memory(step_fn.lower(state, batch).compile())
    out["compiles_for_memory_analysis"] = extra.count
    check.record_memory(f"train step {rows}x{length}", before, predicted, predicted["argument"])
  del state, batch
  gc.collect()
  return out


def experiment_config(name: str):
  """`configs/<name>.py`'s ConfigDict."""
  return importlib.import_module(f"configs.{name}").get_config()


def part_rl(check: Check) -> dict:
  """Short runs of the tiny arithmetic config under both schedules, via `loop.run`."""
  z, out = check.sizes, {}
  for schedule in ("rounds", "stream"):
    c = experiment_config("tiny_arith_pos")
    c.rl.steps = z.rl_steps
    c.warmstart = None  # random policy: the step's cost, not its learning, is measured
    c.eval.benchmarks = ()
    c.ckpt.every_steps = 0
    c.ada.schedule = schedule
    if z.rl_batch_prompts:
      c.rl.batch_prompts = z.rl_batch_prompts
    if z.rl_chunk_rows:
      c.sampler.chunk_rows = z.rl_chunk_rows
    out[schedule] = guarded(rl_run, c)
  return out


def part_smollm2(check: Check) -> dict:
  """A few RL steps of the real SmolLM2-135M-Instruct in bf16 compute (float32 masters)."""
  model_dir = pathlib.Path(check.args.smollm2_dir).expanduser() if check.args.smollm2_dir else None
  if model_dir is None or not (model_dir / "config.json").is_file():
    why = "--tiny" if model_dir is None else f"no converted model at {model_dir}"
    return {"ok": None, "skipped": f"{why}: python -m ada_jax.models.from_gguf makes it"}
  c = experiment_config("smollm2_arith_pos")
  c.model.hf_dir = str(model_dir)
  c.model.dtype = "bfloat16"  # compute; model.param_dtype stays float32
  c.rl.steps = check.sizes.smollm2_steps
  c.eval.benchmarks = ()
  c.ckpt.every_steps = 0
  return rl_run(c, extra=("tokens_decoded", "tokens_per_s", "old_logprob_gap", "pass_rate"))


def rl_run(c, extra: tuple[str, ...] = ()) -> dict:
  with tempfile.TemporaryDirectory(prefix="accelerator_check_rl_") as workdir:
    start = time.perf_counter()
    loop.run(c, workdir)
    wall = time.perf_counter() - start
    lines = metrics_lib.read_jsonl(pathlib.Path(workdir) / "metrics.jsonl")
  keys = ("time_sample_s", "time_grade_wait_s", "time_train_s", "compiles", "samples_drawn")
  extra = (*extra, "positions")
  steps = [{k: line.get(k) for k in ("step", *keys, *extra)} for line in lines]
  later = steps[1:]
  mean = lambda k: float(np.mean([s[k] for s in later])) if later else None
  # The train step compiles once per packed row count (`packing.row_counts`; one update
  # a step here, so a step's `positions` names its count): a later step's first count
  # is a compile the design allows, any other is a recompile.
  seen, new_counts = set(), []
  for line in lines:
    new_counts.append(int(line.get("positions") not in seen))
    seen.add(line.get("positions"))
  return {
    "run_config": config_lib.as_dict(config_lib.parse(c)),
    "wall_s": wall,
    "steps": steps,
    "compiles_step_1": steps[0]["compiles"] if steps else None,
    "compiles_after_step_1": sum(s["compiles"] for s in later) if later else None,
    "new_packed_row_counts_after_step_1": sum(new_counts[1:]) if later else None,
    "after_step_1_mean_s": {k: mean(k) for k in keys[:3]},
  }


def part_agreement(check: Check) -> dict:
  """|sampler log-prob − trainer log-prob| over one sampled batch, both in bf16."""
  z = check.sizes
  cfg, params = check.model(z.model)
  slots = z.agreement_slots
  smp = check.sampler(cfg, slots)
  prompts = check.random_prompts(cfg, check.sizes.prompts_for(slots))
  row_prompt = np.arange(slots) % len(prompts)
  out, _ = smp.generate(params, prompts, row_prompt, jax.random.key(7))
  seq = np.concatenate([np.asarray(prompts)[row_prompt], out["tokens"]], 1).astype(np.int32)
  attention = np.concatenate([np.ones((slots, z.prompt_len), bool), out["mask"]], 1)
  positions = np.maximum(np.cumsum(attention, 1) - 1, 0).astype(np.int32)
  temperature = smp.rule.logprob_temperature
  # 32 positions of fp32 logits at a time: 64 rows x 32 x 152k x 4 B = 1.2 GB per block.
  # params are an argument, not a closure: closed over, XLA takes them as 6 GB of constants.
  fn = jax.jit(
    lambda w, t, p, m: losses.token_logprobs(
      cfg, w, t, p, m, temperature=temperature, block_size=32
    )[0]
  )
  trainer = np.asarray(fn(params, seq, positions, attention))[:, z.prompt_len :]
  gap = np.abs(trainer - out["logprobs"])[out["mask"]]
  return {
    "model": z.model,
    "rows": slots,
    "sampler": {**dataclasses.asdict(check.sizes.sampler_spec(slots)), "stop_ids": smp.stop_ids},
    "tokens_compared": int(gap.size),
    "temperature": temperature,
    "gap_mean": float(gap.mean()),
    "gap_max": float(gap.max()),
    "gap_p99": float(np.quantile(gap, 0.99)),
    "sampler_logprob_mean": float(out["logprobs"][out["mask"]].mean()),
    "dtypes": {"params": cfg.param_dtype, "compute": cfg.dtype, "logits": "float32"},
  }


def guarded(fn, *args) -> dict:
  """fn(*args) with its failure recorded instead of raised (one part never loses another's)."""
  start = time.perf_counter()
  try:
    out = dict(fn(*args))
    out.setdefault("ok", True)
  except Exception as e:  # noqa: BLE001 -- every failure is data here
    out = {
      "ok": False,
      "error": f"{type(e).__name__}: {e}"[:2000],
      "traceback": traceback.format_exc()[-4000:],
    }
  out["part_wall_s"] = time.perf_counter() - start
  gc.collect()
  return out


def goals(report: dict) -> dict:
  """The issue's goals, reported (not gated): None where the figure is missing."""
  parts = report["parts"]
  mbu = next(
    (r.get("mbu") for r in parts.get("decode", {}).get("by_slots", []) if r.get("slots") == 256),
    None,
  )
  rl = parts.get("rl", {})
  compiles = [
    None
    if rl[s].get("compiles_after_step_1") is None
    else rl[s]["compiles_after_step_1"] - rl[s]["new_packed_row_counts_after_step_1"]
    for s in ("rounds", "stream")
    if s in rl
  ]
  gap = parts.get("agreement", {}).get("gap_mean")
  mfu = parts.get("train", {}).get("mfu")
  check = lambda v, ok: None if v is None else bool(ok(v))
  return {
    "decode_mbu_at_256_slots>=0.5": {"value": mbu, "met": check(mbu, lambda v: v >= 0.5)},
    "train_mfu>=0.35": {"value": mfu, "met": check(mfu, lambda v: v >= 0.35)},
    "recompiles_after_step_1==0": {
      "value": compiles,
      "met": None if not compiles or None in compiles else all(c == 0 for c in compiles),
    },
    "bf16_gap_mean<=1e-3": {"value": gap, "met": check(gap, lambda v: v <= 1e-3)},
  }


def default_out(kind: str, tiny: bool) -> pathlib.Path:
  slug = re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "unknown"
  return (
    ROOT / "experiments" / "results" / f"accelerator_check_{slug}{'_tiny' if tiny else ''}.json"
  )


def write(report: dict, path: pathlib.Path) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(report, indent=1, default=_jsonable) + "\n")
  tmp.replace(path)  # a kill mid-write leaves the previous complete file


def _jsonable(x):
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return str(x)


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tiny", action="store_true", help="tiny sizes: every part on a CPU in minutes")
  p.add_argument("--parts", default=",".join(PARTS), help=f"of {PARTS}")
  p.add_argument(
    "--decode_slots",
    default="",
    help="S values of the decode part, comma-separated (default: 64,256,1024; --tiny 4,8,16)",
  )
  p.add_argument(
    "--decode_7b_slots",
    type=int,
    default=None,
    help="S of the 7B decode row; 0 = skip (default: 0, or 4 with --tiny)",
  )
  p.add_argument(
    "--out", default="", help="JSON path; default results/accelerator_check_<kind>.json"
  )
  p.add_argument(
    "--smollm2_dir",
    default=None,
    help="converted SmolLM2-135M-Instruct folder of the smollm2 part (default: the config's; "
    "--tiny: none, the part is skipped)",
  )
  p.add_argument("--peak_hbm_bytes_per_s", type=float, default=0.0, help="override the table")
  p.add_argument("--peak_bf16_flops", type=float, default=0.0, help="override the table")
  args = p.parse_args(argv)
  args.parts = tuple(s.strip() for s in args.parts.split(",") if s.strip())
  unknown = sorted(set(args.parts) - set(PARTS))
  if unknown:
    p.error(f"--parts: unknown {unknown}; choose from {PARTS}")
  try:
    args.decode_slots = tuple(int(x) for x in args.decode_slots.split(",") if x.strip())
  except ValueError:
    p.error(f"--decode_slots: comma-separated integers, got {args.decode_slots!r}")
  if any(x <= 0 for x in args.decode_slots):
    p.error(f"--decode_slots must be positive, got {args.decode_slots}")
  if args.decode_7b_slots is None:
    args.decode_7b_slots = 4 if args.tiny else 0
  if args.smollm2_dir is None and not args.tiny:
    args.smollm2_dir = importlib.import_module("configs.smollm2_arith_pos").HF_DIR
  if args.decode_7b_slots < 0:
    p.error(f"--decode_7b_slots must be >= 0, got {args.decode_7b_slots}")
  return args


def main(argv=None) -> dict:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  start = time.perf_counter()
  check = Check(args)
  d = check.device
  out = pathlib.Path(args.out) if args.out else default_out(d.device_kind, args.tiny)
  report = {
    "script": "experiments/accelerator_check.py",
    "argv": sys.argv[1:] if argv is None else list(argv),
    "commit": metrics_lib.git_commit(ROOT),
    "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "device": {
      "platform": d.platform,
      "kind": d.device_kind,
      "local_devices": jax.local_device_count(),
      "used": 1,
    },
    "jax": jax.__version__,
    "jaxlib": importlib.metadata.version("jaxlib"),
    "python": platform.python_version(),
    "peaks": check.peaks,
    "config": {
      **vars(args),
      "sizes": {**dataclasses.asdict(check.sizes), "new_tokens": check.sizes.new_tokens},
    },
    "parts": {},
  }
  memory = "memory" in args.parts
  z = check.sizes
  runs = {
    "decode": lambda: run_decode(check, z.model, z.decode_slots, memory),
    "train": lambda: part_train(check),
    "rl": lambda: part_rl(check),
    "agreement": lambda: part_agreement(check),
    "decode_7b": lambda: run_decode(check, z.big_model, (args.decode_7b_slots,), memory),
    "smollm2": lambda: part_smollm2(check),
  }
  for name in PARTS:
    if name not in args.parts or name == "memory":
      continue
    if name == "decode_7b" and not args.decode_7b_slots:
      continue
    print(f"accelerator_check: {name} ...", file=sys.stderr, flush=True)
    report["parts"][name] = guarded(runs[name])
    if memory:  # last in the JSON, after the parts whose programs it lists
      report["parts"].pop("memory", None)
      report["parts"]["memory"] = {"ok": True, "programs": check.memory}
    report["wall_s"] = time.perf_counter() - start
    write(report, out)
  if memory and "memory" not in report["parts"]:
    report["parts"]["memory"] = {"ok": False, "error": "no program ran (add decode or train)"}
  report["goals"] = goals(report)
  report["wall_s"] = time.perf_counter() - start
  write(report, out)
  print(json.dumps(report, indent=1, default=_jsonable))
  print(f"accelerator_check: wrote {out}", file=sys.stderr)
  return report


if __name__ == "__main__":
  main()
