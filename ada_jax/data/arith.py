"""Procedural arithmetic task and its small tokenizer: the CPU-sized RL job.

docs/design.md "Data": a tiny model must be able to learn it on a laptop, with a difficulty mix
that puts many prompts at small but non-zero pass rates. A problem is `a<op>b=` with
op in {+, -, *}; its level is the digit count of BOTH operands (level 1: 0–9, level d > 1:
10^(d-1) .. 10^d - 1). Subtraction puts the larger operand first, so answers are never
negative. The reference answer is the exact integer; a correct response is `\\boxed{357}`
(then EOS), so rewards go through the same last-box path as the maths sets.

For a real pretrained model's tokenizer the same problems are phrased as a question,
`What is 23 + 58?` (`question_text`, source 'arith_text' of the data group and benchmark
'arith_text'), and rendered through its chat template; the split of a problem does not
depend on its phrasing.

Train and held-out problems never overlap for any seed: a problem is held out iff a hash
of its operand pair falls below `HELDOUT_FRACTION`, a fixed share and not a setting, so a
run's evaluation can never hold out other problems than its training left out. The pair is
unordered for the commutative operators, so `b + a` is held out with `a + b` (twins share a
split). The training split draws with replacement (an epoch of prompts); the held-out split
draws distinct problems (twins count once) and refuses a request for more than it holds.
The supervised warm start (`rl.warmstart`) trains on `encode_examples`' teacher-forcing
arrays, padded to `length_bounds`.

The tokenizer is a real tokenizer.json (character-level WordLevel model from the
`tokenizers` library, with `\\boxed{` as one token, BOS/EOS/PAD/UNK and chat-turn tokens,
a one-line chat template), written deterministically by `write_tokenizer` and shipped in
`ada_jax/data/assets/arith_tokenizer/`, so it loads through the normal `Tokenizer.from_dir`.
Regenerate with `python -m ada_jax.data.arith`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import operator
import pathlib
import string
from collections.abc import Mapping, Sequence

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from ada_jax import bounds
from ada_jax.models.tokenizer import Tokenizer, pad_left

TOKENIZER_DIR = pathlib.Path(__file__).resolve().parent / "assets" / "arith_tokenizer"

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
COMMUTATIVE = ("+", "*")
SPLITS = ("train", "test")
# The held-out share of every level and operator (about one problem in ten).
HELDOUT_FRACTION = 0.1
# Cells (level, operator) of at most this many problems are listed whole, so the held-out
# split's size is exact there and its draws are a permutation (levels 1-3: 55 to 405,450).
_LISTED_PAIRS = 500_000


@dataclasses.dataclass(frozen=True)
class ArithConfig:
  """The problem distribution.

  Attributes:
    levels: digit counts to draw from (1..9).
    level_weights: relative probability of each level; empty means uniform.
    ops: operators to draw from, uniformly (subset of '+', '-', '*').
  """

  levels: tuple[int, ...] = bounds.within("[1, 9]", (1, 2, 3, 4, 5))
  level_weights: tuple[float, ...] = bounds.within("[0, 1e6]", ())
  ops: tuple[str, ...] = ("+", "-", "*")

  def __post_init__(self):
    if not self.levels or not all(1 <= d <= 9 for d in self.levels):
      raise ValueError(f"levels={self.levels}: need one or more digit counts in 1..9")
    for name in ("levels", "ops"):  # a repeat would weigh twice and count its split twice
      if len(set(getattr(self, name))) != len(getattr(self, name)):
        raise ValueError(f"{name}={getattr(self, name)}: each may appear once")
    if self.level_weights and (
      len(self.level_weights) != len(self.levels)
      or min(self.level_weights) < 0
      or sum(self.level_weights) <= 0
    ):
      raise ValueError(
        f"level_weights={self.level_weights}: need {len(self.levels)} "
        "non-negative weights with a positive sum"
      )
    if not self.ops or any(op not in OPS for op in self.ops):
      raise ValueError(f"ops={self.ops}: need one or more of {sorted(OPS)}")


# The CPU toy's RL prompts and held-out set (experiments/calibrate_arith.py): 2- and
# 3-digit additions, equal weights, after `warmstart.RECOMMENDED`. Level 1 is left out
# because it is memorised (100 sums; the tenth held out measures recall of unseen facts,
# not skill) and level 4 because a model warm-started on 1-3 digits never solves it (no
# length generalisation): neither gives RL a signal.
TOY_RL_TASK = ArithConfig(levels=(2, 3), ops=("+",))


def problem_text(a: int, op: str, b: int) -> str:
  """The prompt of a problem, e.g. '12+345='."""
  return f"{a}{op}{b}="


def question_text(a: int, op: str, b: int) -> str:
  """The problem phrased for a real tokenizer and an instruct model, e.g. 'What is 12 + 345?'."""
  return f"What is {a} {op} {b}?"


def canonical(a: int, op: str, b: int) -> tuple[int, str, int]:
  """The problem that `a op b` is one of: commutative operands in ascending order, so that
  `b + a` and `a + b` are one problem for the split and for distinctness."""
  return (min(a, b), op, max(a, b)) if op in COMMUTATIVE else (a, op, b)


def is_heldout(a: int, op: str, b: int) -> bool:
  """Whether a problem belongs to the held-out split: a fixed hash of its canonical text
  (`canonical`) below `HELDOUT_FRACTION`; no seed, no setting."""
  text = problem_text(*canonical(a, op, b))
  h = hashlib.blake2b(text.encode(), digest_size=8).digest()
  return int.from_bytes(h, "big") < HELDOUT_FRACTION * 2**64


def _operand_range(digits: int) -> range:
  return range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


def _operand(rng: np.random.Generator, digits: int) -> int:
  r = _operand_range(digits)
  return int(rng.integers(r.start, r.stop))


def _draw_pair(rng: np.random.Generator, level: int, op: str) -> tuple[int, int]:
  """Two operands of `level` digits, the larger first for '-' (answers never negative)."""
  a, b = _operand(rng, level), _operand(rng, level)
  return (b, a) if op == "-" and b > a else (a, b)


def _cell_pairs(level: int) -> int:
  """Canonical problems of one (level, operator) cell: unordered pairs, or ordered with
  the larger operand first for '-'; N (N + 1) / 2 either way."""
  n = len(_operand_range(level))
  return n * (n + 1) // 2


@functools.lru_cache(maxsize=32)
def _heldout_cell(level: int, op: str) -> tuple[tuple[int, int], ...]:
  """Every held-out canonical problem of a listed cell (`_LISTED_PAIRS`), as (a, b) with
  a <= b for commutative operators and a >= b for '-'."""
  r = _operand_range(level)
  pairs = ((a, b) if op in COMMUTATIVE else (b, a) for a in r for b in r if a <= b)
  return tuple((a, b) for a, b in pairs if is_heldout(a, op, b))


def heldout_size(config: ArithConfig) -> int:
  """Distinct held-out problems of `config` (levels of non-zero weight x operators): exact
  for listed cells (levels 1-3), a lower bound of 0.9 x the expected share beyond."""
  weights = config.level_weights or (1.0,) * len(config.levels)
  total = 0
  for level, w in zip(config.levels, weights, strict=True):
    for op in config.ops if w > 0 else ():
      if _cell_pairs(level) <= _LISTED_PAIRS:
        total += len(_heldout_cell(level, op))
      else:
        total += int(0.9 * HELDOUT_FRACTION * _cell_pairs(level))
  return total


def examples(
  config: ArithConfig, split: str, n: int, *, seed: int, question: bool = False
) -> list[dict[str, str]]:
  """n problems of one split, deterministic for (config, split, seed); a shorter draw is a
  prefix of a longer one.

  The training split draws with replacement: a problem may repeat, each draw its own
  prompt. The held-out split draws distinct problems (`canonical`: twins once): a level
  is drawn by `level_weights` among the levels with problems left, an operator uniformly
  among its cells with problems left, then a problem of that cell not drawn before (a
  commutative one in a random operand order). So an exhausted level's weight passes to the
  others, and level 1 (about 16 held-out problems over three operators) soon runs out.

  Args:
    config: the distribution.
    split: 'train' or 'test' (held out).
    n: number of problems.
    seed: seed of the draw.
    question: phrase each problem as `question_text` ('What is 12 + 345?') instead of the
      bare '12+345='; the draw (operands, order, split) is the same.

  Returns:
    Example dicts with `prompt_id` ('arith/<split>/<seed>/<i>', 'arith_text/...' for
    questions), `problem` ('12+345='), `answer` ('357') and `source` ('arith/L<level>', so
    metrics can be split by level).

  Raises:
    ValueError: unknown split, or more held-out problems asked for than the split holds
      (`heldout_size`).
  """
  if split not in SPLITS:
    raise ValueError(f"split={split!r}; known: {SPLITS}")
  heldout = split == "test"
  if heldout and n > (size := heldout_size(config)):
    raise ValueError(
      f"{n} distinct held-out problems asked for; levels={config.levels} "
      f"(weights {config.level_weights or 'equal'}) with ops={config.ops} hold {size}"
    )
  rng = np.random.default_rng([seed, SPLITS.index(split)])
  weights = np.asarray(config.level_weights or [1.0] * len(config.levels), np.float64)
  # Held out: per cell, the draw order of a listed cell (a permutation, made when the cell
  # is first drawn) and its next index; for a large cell, the problems drawn so far.
  order: dict[tuple[int, str], np.ndarray] = {}
  taken: dict[tuple[int, str], int] = {}
  seen: set[tuple[int, str, int]] = set()

  def left(level: int, op: str) -> bool:
    if _cell_pairs(level) > _LISTED_PAIRS:
      return True
    return taken.get((level, op), 0) < len(_heldout_cell(level, op))

  def draw_heldout(level: int, op: str) -> tuple[int, int]:
    cell = (level, op)
    if _cell_pairs(level) <= _LISTED_PAIRS:
      problems = _heldout_cell(level, op)
      if cell not in order:
        order[cell] = rng.permutation(len(problems))
      a, b = problems[order[cell][taken.get(cell, 0)]]
      taken[cell] = taken.get(cell, 0) + 1
      if op in COMMUTATIVE and rng.integers(2):
        a, b = b, a
      return a, b
    while True:  # rejection: about 1 / HELDOUT_FRACTION draws per new problem
      a, b = _draw_pair(rng, level, op)
      if is_heldout(a, op, b) and (key := canonical(a, op, b)) not in seen:
        seen.add(key)
        return a, b

  out = []
  text, name = (question_text, "arith_text") if question else (problem_text, "arith")
  while len(out) < n:
    if heldout:
      open_ = np.asarray([any(left(lv, op) for op in config.ops) for lv in config.levels])
      w = weights * open_
      level = int(config.levels[rng.choice(len(config.levels), p=w / w.sum())])
      cells = [op for op in config.ops if left(level, op)]
      op = cells[int(rng.integers(len(cells)))]
      a, b = draw_heldout(level, op)
    else:
      level = int(config.levels[rng.choice(len(config.levels), p=weights / weights.sum())])
      op = config.ops[int(rng.integers(len(config.ops)))]
      a, b = _draw_pair(rng, level, op)
      # Rejection keeps the splits disjoint: about 1.1 draws per training problem.
      if is_heldout(a, op, b):
        continue
    out.append(
      {
        "prompt_id": f"{name}/{split}/{seed}/{len(out)}",
        "problem": text(a, op, b),
        "answer": str(OPS[op](a, b)),
        "source": f"arith/L{level}",
      }
    )
  return out


def response_text(answer: str) -> str:
  """The target response of a problem (what a correct model writes before EOS)."""
  return f"\\boxed{{{answer}}}"


def prompt_ids(tok: Tokenizer, problem: str) -> list[int]:
  """Token ids of a problem's prompt: BOS then the bare problem ('<bos>12+345=').

  This is the `raw` prompt style of `ada_jax.data.prompts.build_prompts`: a tiny model trained from
  scratch has no use for the maths sets' instructions, and short prompts keep the CPU job
  fast. The supervised warm start and the RL prompts both use this one format.
  """
  return tok.encode(problem, add_bos=True)


def response_ids(tok: Tokenizer, answer: str) -> list[int]:
  """Token ids of the target response: `\\boxed{answer}` then the first EOS id.

  Raises:
    ValueError: the tokenizer has no EOS id.
  """
  if not tok.eos_ids:
    raise ValueError("tokenizer has no eos_ids: a response must end with EOS")
  return [*tok.encode(response_text(answer)), tok.eos_ids[0]]


# --------------------------------------------------------------------------- warm-start arrays


def length_bounds(task: ArithConfig, tokenizer: Tokenizer) -> tuple[int, int]:
  """Static (Lp, Lr) in tokens that fit every prompt and target response of `task` (the
  warm start's one compile for the whole run)."""
  d = max(task.levels)
  answer_digits = max({"+": d + 1, "-": d, "*": 2 * d}[op] for op in task.ops)
  prompt = len(prompt_ids(tokenizer, problem_text(10**d - 1, "+", 10**d - 1)))
  response = len(response_ids(tokenizer, "9" * answer_digits))
  return prompt, response


def encode_examples(
  tokenizer: Tokenizer,
  examples: Sequence[Mapping[str, str]],
  *,
  prompt_len: int | None = None,
  response_len: int | None = None,
) -> dict[str, np.ndarray]:
  """Teacher-forcing arrays of arithmetic examples, prompt left-padded, response right-padded.

  Args:
    tokenizer: the arithmetic tokenizer (`load_tokenizer()`).
    examples: dicts with `problem` and `answer` (as `examples` returns).
    prompt_len: Lp; None = the longest prompt.
    response_len: Lr; None = the longest response.

  Returns:
    numpy `tokens int32[B, T]`, `attention_mask bool[B, T]` (True at real tokens) and
    `loss_mask bool[B, T]` (True at response tokens, EOS included: the targets), T = Lp + Lr.

  Raises:
    ValueError: no examples, an example without `problem`/`answer`, or a prompt/response
      longer than `prompt_len`/`response_len`.
  """
  if not examples:
    raise ValueError("encode_examples: no examples")
  prompts, responses = [], []
  for i, ex in enumerate(examples):
    for field in ("problem", "answer"):
      if field not in ex:
        raise ValueError(f"examples[{i}] has no field {field!r}")
    prompts.append(prompt_ids(tokenizer, ex["problem"]))
    responses.append(response_ids(tokenizer, ex["answer"]))
  lp = max(map(len, prompts)) if prompt_len is None else prompt_len
  lr = max(map(len, responses)) if response_len is None else response_len
  for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
    if len(p) > lp or len(r) > lr:
      raise ValueError(
        f"examples[{i}] ({examples[i]['problem']!r}): prompt of {len(p)} / response of "
        f"{len(r)} tokens exceeds prompt_len={lp} / response_len={lr}"
      )
  prompt_tokens, prompt_mask = pad_left(prompts, tokenizer.pad_id, length=lp)
  tokens = np.full((len(examples), lp + lr), tokenizer.pad_id, np.int32)
  loss_mask = np.zeros((len(examples), lp + lr), bool)
  tokens[:, :lp] = prompt_tokens
  for i, r in enumerate(responses):
    tokens[i, lp : lp + len(r)] = r
    loss_mask[i, lp : lp + len(r)] = True
  attention = loss_mask.copy()
  attention[:, :lp] = prompt_mask
  return {"tokens": tokens, "attention_mask": attention, "loss_mask": loss_mask}


# --------------------------------------------------------------------------- tokenizer

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
TURN_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *TURN_TOKENS)
BOXED = "\\boxed{"
# Every printable ASCII character plus newline: enough for prompts, answers and
# instructions; anything else maps to <unk>.
CHARS = tuple(string.printable[:95]) + ("\n",)
VOCAB = SPECIAL_TOKENS + (BOXED,) + CHARS

CHAT_TEMPLATE = (
  "{{ bos_token }}{% for message in messages %}"
  "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
  "{{ raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
  "{% endif %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
  "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> tokenizers.Tokenizer:
  """The character-level tokenizer (same object on every call)."""
  tok = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=UNK))
  # One token per character; [\s\S] rather than '.' so that newlines split too.
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()  # WordLevel would otherwise join tokens with spaces
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
  tok.add_tokens([AddedToken(BOXED, normalized=False)])
  return tok


def write_tokenizer(folder: str | pathlib.Path = TOKENIZER_DIR) -> pathlib.Path:
  """Writes tokenizer.json, tokenizer_config.json and generation_config.json to `folder`.

  The files are byte-identical on every call (tests compare them with the shipped copy).

  Returns:
    The folder.
  """
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "tokenizer.json").write_text(build_tokenizer().to_str(pretty=True) + "\n")
  config = {
    "bos_token": BOS,
    "eos_token": EOS,
    "pad_token": PAD,
    "unk_token": UNK,
    "chat_template": CHAT_TEMPLATE,
  }
  (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
  ids = {t: i for i, t in enumerate(VOCAB)}
  generation = {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS]], "pad_token_id": ids[PAD]}
  (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
  return folder


def load_tokenizer() -> Tokenizer:
  """The shipped arithmetic tokenizer, through the normal `Tokenizer.from_dir` path."""
  return Tokenizer.from_dir(TOKENIZER_DIR)


if __name__ == "__main__":
  print(write_tokenizer())
