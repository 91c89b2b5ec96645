"""Shared defaults of every experiment: the paper's / released code's hyper-parameters.

Experiment files call `get_config()` here and change what differs. Groups: seed, model,
tokenizer, data, sampler, ada, rl, loss, optim, train, ckpt, warmstart, eval, mesh; each
group's fields are documented and checked by the dataclass that `ada_jax.config.RunConfig`
names for it.
"""

import pathlib
from collections.abc import Mapping

import ml_collections

# A `shared` folder beside the checkout (the repository's parent folder) holding `data/`
# (the maths JSONL files, see ada_jax/data/sources.py) and `tokenizers/`: configs read it when it
# is there, so that a run needs no network and no extra flag.
SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"


def shared_path(*parts: str) -> str:
  """`SHARED/<parts>` if it exists, else '' (the field's default: download)."""
  path = SHARED.joinpath(*parts)
  return str(path) if path.exists() else ""


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # root seed: params init, rollouts, data order, controller

  c.model = ml_collections.ConfigDict()
  c.model.preset = ""  # a model.PRESETS name (random weights unless hf_dir/checkpoint)
  c.model.hf_dir = ""  # Hugging Face folder or Hub id: architecture + weights
  c.model.dtype = "bfloat16"  # compute (matmuls, KV cache, rollout copy); logits/softmax fp32
  c.model.param_dtype = "float32"  # train state: master weights and AdamW moments (verl's)
  c.model.overrides = ml_collections.ConfigDict()  # ModelConfig fields replacing the preset's

  c.tokenizer = ml_collections.ConfigDict()
  c.tokenizer.dir = ""  # folder with tokenizer.json; '' = the arithmetic tokenizer
  c.tokenizer.eos_ids = ()  # stop ids overriding the folder's (e.g. Llama 3: 128001, 128009)

  c.data = ml_collections.ConfigDict()
  c.data.source = "math_train"  # 'arith', a data.SETS name, 'jsonl' or 'verl'
  c.data.split = "train"  # split of a data.SETS source
  # Folder with the maths JSONL files; '' = download. Default: shared/data beside the checkout.
  c.data.manual_dir = shared_path("data")
  c.data.data_dir = ""  # TFDS data dir; '' = TFDS default
  c.data.jsonl_paths = ()  # the user's JSONL prompt files (source 'jsonl')
  c.data.verl_set = ""  # source 'verl': Hub data set id, or a Parquet/JSONL file or folder
  c.data.problem_field = "problem"  # field of the problem text in those files
  c.data.answer_field = "answer"  # field of the reference answer
  c.data.answer_format = "plain"  # 'plain', 'boxed' or 'gsm8k'
  c.data.exclude_math500 = True  # drop MATH500 problems from the user's files
  c.data.prompt_style = "chat"  # 'chat', 'chat_no_system', 'plain', 'raw'
  c.data.max_prompt_tokens = 1024  # longer prompts are dropped (paper: 1024)

  c.sampler = ml_collections.ConfigDict()
  c.sampler.temperature = 1.0  # rollout temperature (paper: 1.0)
  c.sampler.top_k = 0  # 0 = off
  c.sampler.top_p = 1.0  # 1.0 = off (paper)
  c.sampler.max_new_tokens = 2048  # response budget, tokens (paper: 2048)
  c.sampler.chunk_rows = 256  # S: slots of the rollout pool (rows decoding at once)
  c.sampler.prompts_per_chunk = 0  # prompts prefilled per S rows; 0 = S // rows per prompt
  c.sampler.prompt_buckets = (128, 256, 512, 1024)  # padded prompt lengths (one compile each)
  c.sampler.segment_steps = 0  # decode steps between decisions; 0 = budget (stream: budget/32)
  c.sampler.queue_rows = 0  # Q: rows queued per device call; 0 = 4 × chunk_rows
  c.sampler.attention_block = 0  # decode attention block (cache columns); 0 = derived

  c.ada = ml_collections.ConfigDict()
  c.ada.method = "balance"  # grpo | dapo | pos | balance | est
  c.ada.schedule = "rounds"  # 'rounds' (released barriers) | 'stream' (exits as rows finish)
  c.ada.n = 4  # final group size per prompt (paper: 4)
  c.ada.std_normalize = False  # divide advantages by the std (released Reinforce-Ada: off)
  c.ada.baseline = "global"  # 'global': mean over the whole pool (Reinforce-Ada); 'local'
  c.ada.inverse_p_weight = "none"  # 'none' (released) or f'(p̄): '1/p', '1/sqrt_p' (1/√p̄), α
  c.ada.seq = ml_collections.ConfigDict()  # Reinforce-Ada-Seq's own, pos and balance (SeqConfig)
  c.ada.seq.samples_per_round = 8  # M: responses per active prompt per round (paper: 8)
  c.ada.seq.max_rounds = 4  # R: rounds at most (paper: 4)
  c.ada.seq.k_pos = None  # positives needed to exit; None = floor(n/2) (balance) / 1 (pos)
  c.ada.seq.k_neg = None  # negatives needed to exit; None = n - floor(n/2) (balance)
  c.ada.seq.min_exit_chance = 0.0  # beyond the paper: stop when P(exit in budget) < this
  c.ada.seq.batch_order = "exit"  # groups in exit order (released), or 'prompt' order
  c.ada.dapo = ml_collections.ConfigDict()  # DAPO's own (DapoConfig)
  c.ada.dapo.max_extra_passes = 4  # extra generation passes after the first, at most
  c.ada.est = ml_collections.ConfigDict()  # Reinforce-Ada-Est's own (EstConfig)
  c.ada.est.budget_per_prompt = 8.0  # K: est draws round(K·B) samples (released: 8)
  c.ada.est.weight = "1/p"  # allocation f'(p̂): '1/p' (α=0, released), '1/sqrt_p' (α=0.5), α
  c.ada.est.estimator = "ema"  # p̂ from 'ema' counts (released), the learned 'head', 'head+ema'
  c.ada.est.split = "released"  # 1 each, rest ∝ w (released); 'clipped' [4, 32] (paper)

  c.rl = ml_collections.ConfigDict()
  c.rl.steps = 300  # RL steps
  c.rl.batch_prompts = 512  # B: prompts per RL step (paper: 512)
  c.rl.verifier = ml_collections.ConfigDict()  # the training reward (VerifierConfig)
  c.rl.verifier.judge = "math"  # 'math' (ours), 'exact', 'released' (the authors')
  c.rl.verifier.num_workers = 0  # reward worker processes; 0 = all cores
  c.rl.verifier.timeout_s = 5.0  # hard per-response timeout, seconds

  c.loss = ml_collections.ConfigDict()
  c.loss.clip_low = 0.2  # ratio clip 1 - clip_low
  c.loss.clip_high = 0.28  # ratio clip 1 + clip_high (clip-higher)
  c.loss.dual_clip = 10.0  # dual clip c for negative advantages
  c.loss.aggregation = "token-mean"  # over all valid tokens of the global mini-batch
  c.loss.entropy_coeff = 0.0  # entropy bonus weight
  c.loss.kl_coeff = 0.0  # k3 KL to the initial policy; 0 = off (paper)

  c.optim = ml_collections.ConfigDict()
  c.optim.learning_rate = 1e-6  # AdamW peak lr (paper: 1e-6)
  c.optim.warmup_steps = 10  # RL steps of linear warm-up, then constant
  c.optim.weight_decay = 0.0  # decoupled weight decay
  c.optim.grad_clip = 1.0  # global gradient-norm clip

  c.train = ml_collections.ConfigDict()
  # Prompts per mini-batch (verl's ppo_mini_batch_size, released: 128): mini-batches of
  # 128 × ada.n rows, so updates per step = training rows / that (Est 8, Seq 4); 0 = one.
  c.train.mini_batch_prompts = 128
  c.train.micro_batch_size = 0  # rows per gradient-accumulation step; 0 = whole mini-batch
  c.train.remat = False  # rematerialise each block in the backward pass
  c.train.old_logprobs = "sampler"  # PPO old log-probs: the sampler's, or 'recompute' (released)
  c.train.offload_state = False  # train state in host memory while sampling (plan decides)

  c.ckpt = ml_collections.ConfigDict()
  c.ckpt.every_steps = 10  # checkpoint period, RL steps (also at the end and on SIGTERM)
  c.ckpt.keep = 3  # checkpoints kept
  c.ckpt.async_save = False  # write in a background thread
  c.ckpt.init_from = ""  # another run's checkpoint folder to take params from
  c.ckpt.export_hf = True  # write the final policy as a HF folder workdir/hf_final

  c.warmstart = None  # supervised warm start (arith only): a WarmStartConfig group

  c.eval = ml_collections.ConfigDict()
  c.eval.benchmarks = ()  # evaluated before RL, every eval.every_steps, and at the end
  c.eval.k = 32  # Avg@k samples per problem (paper: 32)
  c.eval.sampler = ml_collections.ConfigDict()  # how they are drawn (a SamplerSpec, as `sampler`)
  c.eval.sampler.max_new_tokens = 4096  # eval response budget (paper: 4096)
  c.eval.every_steps = 0  # 0 = only before and after RL
  c.eval.manual_dir = shared_path("data")  # as data.manual_dir, for the eval sets

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # data-parallel axis; -1 = all remaining devices
  c.mesh.fsdp = 1  # parameter-sharded data-parallel axis
  c.mesh.tensor = 1  # tensor-parallel axis (heads, MLP)
  return c


def on_host(
  c: ml_collections.ConfigDict, host: str, hosts: Mapping[str, Mapping[str, int]]
) -> ml_collections.ConfigDict:
  """Applies a GPU host's settings (in place): `--config=configs/<name>.py:<host>`.

  Args:
    c: the experiment's config.
    host: '' (the config as written, sized for its TPU slice) or a key of `hosts`.
    hosts: per host, `chunk_rows` (rollout slots) and `eval_chunk_rows` (evaluation
      slots), from XLA:GPU's plan of that host. Prompts per prefill launch are the slots
      over `ada.n` (grpo's rows per prompt, the fewest of pos, balance and grpo), so that
      one entry fits the three alike.

  Raises:
    ValueError: `host` is not a key of `hosts` (the known ones named).
  """
  if not host:
    return c
  if host not in hosts:
    raise ValueError(f"no GPU host settings named {host!r} in this config (known: {sorted(hosts)})")
  settings = hosts[host]
  c.sampler.chunk_rows = settings["chunk_rows"]
  c.sampler.prompts_per_chunk = settings["chunk_rows"] // c.ada.n
  c.eval.sampler.chunk_rows = settings["eval_chunk_rows"]
  return c


def released_baseline(
  c: ml_collections.ConfigDict, method: str = "grpo"
) -> ml_collections.ConfigDict:
  """Turns a Reinforce-Ada config into the authors' GRPO / DAPO baseline (in place).

  The released GRPO and DAPO scripts run verl's defaults where the Reinforce-Ada script
  sets its own; each line below names its source. `--config.ada.std_normalize=False` on
  the result gives the Dr.GRPO-style baseline (no std division).
  """
  c.ada.method = method
  c.ada.std_normalize = True  # verl default norm_adv_by_std_in_grpo=True: torch.std + 1e-6
  c.loss.dual_clip = 3.0  # verl default clip_ratio_c=3.0 (Reinforce-Ada script: 10)
  c.optim.weight_decay = 0.01  # verl default actor optim weight_decay=0.01 (Ada script: 0)
  c.optim.warmup_steps = 0  # verl default lr_warmup_steps_ratio=0 (Ada script: 10 steps)
  return c
