"""Prompt construction and a seeded, resumable prompt iterator.

docs/design.md "Data". Prompts follow the authors' released code (docs/design.md "Algorithm"):
system "Please
reason step by step, and put your final answer within \\boxed{}." and the problem followed
by " Let's think step by step and output the final answer within \\boxed{}.", through the
tokenizer's chat template; base models without one get a plain template, the arithmetic
task the bare problem. A `PromptFrame` changes the chat styles' instruction and puts worked
examples before the problem as earlier turns (a small instruct model boxes its answer far
more often after one example); its defaults keep the prompts above. Prompts longer than
`max_prompt_tokens` are dropped and counted.
Examples come from `ada_jax.data.sets` (or `ada_jax.data.arith`): dicts with `prompt_id`, `problem`,
`answer` and optionally `source`; an example with chat `messages` (a verl-format set,
`data.verl`) is rendered from them as given, through the chat template.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from absl import logging

from ada_jax import bounds
from ada_jax.data.arith import ArithConfig
from ada_jax.models.tokenizer import Tokenizer

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
USER_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."


@dataclasses.dataclass(frozen=True)
class PromptFrame:
  """What a prompt says around its problem (the `frame` of the `data` and `eval` groups).

  Attributes:
    system: the system message of style 'chat' ('' = `SYSTEM_PROMPT`; 'chat_no_system'
      refuses one).
    suffix: the text after each problem ('' = none): `USER_SUFFIX` by default.
    examples: worked examples as alternating question / answer strings, placed before
      the problem as earlier user / assistant turns (the chat styles; each question gets
      `suffix`) or as earlier `Question: ... Answer: ...` blocks ('plain'). Style 'raw'
      refuses them.

  Raises:
    ValueError: an odd number of `examples`.
  """

  system: str = ""
  suffix: str = USER_SUFFIX
  examples: tuple[str, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "examples", tuple(self.examples))  # hashable, from a list too
    if len(self.examples) % 2:
      raise ValueError(
        f"frame.examples holds {len(self.examples)} strings: need question / answer pairs"
      )

  def user(self, problem: str) -> str:
    """A problem as a user turn: the problem, then the suffix."""
    return f"{problem} {self.suffix}" if self.suffix else problem

  def pairs(self) -> list[tuple[str, str]]:
    """The worked examples as (question, answer) pairs."""
    return list(zip(self.examples[::2], self.examples[1::2], strict=True))


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Training prompts (the run config's `data` group; read by `inputs.load_prompts`).

  Attributes:
    source: 'arith' (procedural task, bare `12+3=` prompts), 'arith_text' (the same
      problems as questions, `What is 12 + 3?`, in `prompt_style`), a `data.sets.SETS`
      name (e.g. 'gsm8k', 'math_train'), 'jsonl' (the user's files in `jsonl_paths`), or
      'verl' (the verl-format set `verl_set`, `data.verl`).
    split: split of a `SETS` source.
    manual_dir: folder with the maths JSONL files (offline TFDS preparation).
    data_dir: TFDS data directory; '' = TFDS's default.
    jsonl_paths: the user's JSONL files (source 'jsonl').
    verl_set: source 'verl': a Hub data set id (offline: `<manual_dir>/<name>`), or a
      local Parquet / JSONL file or folder of them (`data.verl.resolve`).
    problem_field, answer_field: field names in those files.
    answer_format: 'plain', 'boxed' or 'gsm8k' (how the answer field holds the answer).
    exclude_math500: drop MATH500 problems from the user's files (needs
      math500_test.jsonl in `manual_dir`, or network).
    prompt_style: a `PROMPT_STYLES` name ('chat', 'chat_no_system', 'plain', 'raw').
    frame: the instruction and worked examples around each problem (`PromptFrame`; the
      default adds nothing). The held-out evaluation has its own (`eval.frame`).
    max_prompt_tokens: longer prompts are dropped and counted.
    arith: the arithmetic task's problem distribution (sources 'arith', 'arith_text').
    arith_prompts: number of arithmetic training prompts drawn (an epoch).
  """

  source: str = "arith"
  split: str = "train"
  manual_dir: str = ""
  data_dir: str = ""
  jsonl_paths: tuple[str, ...] = ()
  verl_set: str = ""
  problem_field: str = "problem"
  answer_field: str = "answer"
  answer_format: str = "plain"
  exclude_math500: bool = True
  prompt_style: str = "chat"
  frame: PromptFrame = PromptFrame()
  max_prompt_tokens: int = bounds.within("[1, TOKENS]", 1024)
  arith: ArithConfig = ArithConfig()
  arith_prompts: int = bounds.within("[1, 10**8]", 20_000)


# --------------------------------------------------------------------------- prompts


def _turns(problem: str, frame: PromptFrame) -> list[dict[str, str]]:
  turns = []
  for question, answer in frame.pairs():
    turns += [{"role": "user", "content": frame.user(question)}]
    turns += [{"role": "assistant", "content": answer}]
  return [*turns, {"role": "user", "content": frame.user(problem)}]


def _chat(problem: str, tok: Tokenizer, frame: PromptFrame) -> tuple[str, bool]:
  system = {"role": "system", "content": frame.system or SYSTEM_PROMPT}
  messages = [system, *_turns(problem, frame)]
  return tok.apply_chat_template(messages, add_generation_prompt=True), False


def _chat_no_system(problem: str, tok: Tokenizer, frame: PromptFrame) -> tuple[str, bool]:
  messages = _turns(problem, frame)
  return tok.apply_chat_template(messages, add_generation_prompt=True), False


def _plain(problem: str, tok: Tokenizer, frame: PromptFrame) -> tuple[str, bool]:
  def block(question: str) -> str:
    middle = f"{frame.suffix}\n" if frame.suffix else ""
    return f"Question: {question}\n{middle}Answer:"

  shots = "".join(f"{block(q)} {a}\n\n" for q, a in frame.pairs())
  return shots + block(problem), True


def _raw(problem: str, tok: Tokenizer, frame: PromptFrame) -> tuple[str, bool]:
  return problem, True


# style -> (problem, tokenizer, frame) -> (prompt text, whether to prepend BOS). Chat
# templates write their own BOS; the others get the tokenizer's (if it has one).
PROMPT_STYLES: dict[str, Callable[[str, Tokenizer, PromptFrame], tuple[str, bool]]] = {
  "chat": _chat,
  "chat_no_system": _chat_no_system,
  "plain": _plain,
  "raw": _raw,
}


def check_frame(style: str, frame: PromptFrame) -> None:
  """Raises ValueError naming the `frame` field that `style` cannot place."""
  if style == "raw" and frame != PromptFrame():
    raise ValueError(
      "frame: style 'raw' is the bare problem; it takes no system, suffix or examples"
    )
  if style == "chat_no_system" and frame.system:
    raise ValueError("frame.system: style 'chat_no_system' has no system message; use 'chat'")
  if style == "plain" and frame.system:
    raise ValueError("frame.system: style 'plain' has no system message; use 'chat'")


@dataclasses.dataclass(frozen=True)
class PromptSet:
  """Tokenized prompts of a data set (only those within the length limit).

  Attributes:
    prompt_ids, problems, answers, sources: N strings each.
    tokens: N int32 arrays of prompt ids (variable length).
    num_dropped: prompts removed for exceeding `max_prompt_tokens`.
  """

  prompt_ids: tuple[str, ...]
  problems: tuple[str, ...]
  answers: tuple[str, ...]
  sources: tuple[str, ...]
  tokens: tuple[np.ndarray, ...]
  num_dropped: int

  def __len__(self) -> int:
    return len(self.prompt_ids)

  @property
  def max_length(self) -> int:
    return max((len(t) for t in self.tokens), default=0)


def build_prompts(
  examples: Iterable[Mapping[str, str]],
  tokenizer: Tokenizer,
  *,
  style: str = "chat",
  max_prompt_tokens: int = 1024,
  frame: PromptFrame = PromptFrame(),
) -> PromptSet:
  """Renders and tokenizes prompts; drops (and counts) those over `max_prompt_tokens`.

  Args:
    examples: dicts with at least `prompt_id`, `problem`, `answer` (and optional `source`,
      and `messages`: chat messages rendered as given instead of `style`'s prompt).
    tokenizer: the model's tokenizer.
    style: key of `PROMPT_STYLES`: 'chat' (system + suffix through the chat template,
      docs/design.md "Algorithm"), 'chat_no_system', 'plain' (base models), 'raw' (the problem as
      is).
    max_prompt_tokens: longest prompt kept (docs/design.md "Algorithm": 1024).
    frame: instruction and worked examples around each problem (`PromptFrame`).

  Returns:
    The `PromptSet`, in input order.

  Raises:
    ValueError: unknown style, a frame the style cannot place (`check_frame`), or an
      example without a required field.
  """
  if style not in PROMPT_STYLES:
    raise ValueError(f"style={style!r}; known: {sorted(PROMPT_STYLES)}")
  check_frame(style, frame)
  render = PROMPT_STYLES[style]
  examples = list(examples)
  texts, bos = [], []
  for i, ex in enumerate(examples):
    for key in ("prompt_id", "problem", "answer"):
      if key not in ex:
        raise ValueError(f"examples[{i}] has no field {key!r}")
    if ex.get("messages"):
      # verl renders a row's own messages through the chat template (no BOS of ours).
      text, add_bos = (
        tokenizer.apply_chat_template(ex["messages"], add_generation_prompt=True),
        False,
      )
    else:
      text, add_bos = render(ex["problem"], tokenizer, frame)
    texts.append(text)
    bos.append(add_bos)
  # One batched call per BOS setting keeps the Rust tokenizer's parallelism.
  encoded: list[list[int]] = [[] for _ in texts]
  for flag in (False, True):
    rows = [i for i, b in enumerate(bos) if b == flag]
    for i, ids in zip(
      rows, tokenizer.encode_many([texts[i] for i in rows], add_bos=flag), strict=True
    ):
      encoded[i] = ids
  keep = [i for i, ids in enumerate(encoded) if len(ids) <= max_prompt_tokens]
  dropped = len(examples) - len(keep)
  if dropped:
    logging.info(
      "build_prompts: dropped %d of %d prompts over %d tokens",
      dropped,
      len(examples),
      max_prompt_tokens,
    )
  return PromptSet(
    prompt_ids=tuple(examples[i]["prompt_id"] for i in keep),
    problems=tuple(examples[i]["problem"] for i in keep),
    answers=tuple(examples[i]["answer"] for i in keep),
    sources=tuple(examples[i].get("source", "") for i in keep),
    tokens=tuple(np.asarray(encoded[i], dtype=np.int32) for i in keep),
    num_dropped=dropped,
  )


# --------------------------------------------------------------------------- iterator


class PromptIterator:
  """Seeded, resumable order over N prompts: batches of B indices, epoch after epoch.

  Epoch e visits the prompts in the permutation `np.random.default_rng([seed, e])` (or in
  order when `shuffle=False`); with `drop_remainder` the last N mod B prompts of an epoch
  are skipped so that a batch never holds a prompt twice, otherwise batches run on into the
  next epoch. The order depends only on (seed, N, B, shuffle), so every process of a
  multi-host run draws the same batches (docs/design.md "Distribution"), and `state()` — three ints
  — is
  all a checkpoint needs (docs/design.md "Run state").
  """

  def __init__(
    self,
    num_prompts: int,
    batch_size: int,
    *,
    seed: int,
    shuffle: bool = True,
    drop_remainder: bool = True,
  ):
    if num_prompts <= 0 or batch_size <= 0:
      raise ValueError(f"num_prompts={num_prompts} and batch_size={batch_size} must be > 0")
    if drop_remainder and batch_size > num_prompts:
      raise ValueError(
        f"batch_size={batch_size} > num_prompts={num_prompts} with "
        "drop_remainder=True: no full batch exists"
      )
    self.num_prompts = int(num_prompts)
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.shuffle = shuffle
    self.drop_remainder = drop_remainder
    self.epoch = 0
    self.position = 0
    self._order_epoch = -1
    self._order = np.empty(0, np.int64)

  def _epoch_order(self, epoch: int) -> np.ndarray:
    if epoch != self._order_epoch:
      if self.shuffle:
        self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)
      else:
        self._order = np.arange(self.num_prompts)
      self._order_epoch = epoch
    return self._order

  def __iter__(self) -> PromptIterator:
    return self

  def __next__(self) -> np.ndarray:
    """The next int64[B] prompt indices."""
    out = []
    need = self.batch_size
    while need:
      take = self._epoch_order(self.epoch)[self.position : self.position + need]
      out.append(take)
      need -= len(take)
      self.position += len(take)
      # Advance eagerly so that a state saved between batches is canonical.
      left = self.num_prompts - self.position
      if left == 0 or (self.drop_remainder and left < self.batch_size):
        self.epoch, self.position = self.epoch + 1, 0
    return np.concatenate(out).astype(np.int64)

  def state(self) -> dict[str, np.ndarray]:
    """The checkpointable state: int64 scalars `seed`, `epoch`, `position`, `num_prompts`."""
    return {
      k: np.asarray(getattr(self, k), np.int64)
      for k in ("seed", "epoch", "position", "num_prompts")
    }

  def restore(self, state: Mapping[str, Any]) -> None:
    """Continues from `state()` of an iterator over the same prompts.

    Raises:
      ValueError: the state belongs to a different prompt count or is out of range.
    """
    n = int(state["num_prompts"])
    if n != self.num_prompts:
      raise ValueError(
        f"state is for {n} prompts, this iterator has {self.num_prompts}: the "
        "prompt set changed since the checkpoint"
      )
    position = int(state["position"])
    if not 0 <= position < n or int(state["epoch"]) < 0:
      raise ValueError(f"bad iterator state {dict(state)}")
    self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), position
    self._order_epoch = -1
