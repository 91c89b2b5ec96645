"""Verifiable maths rewards: last-box extraction, math-verify equivalence, a hard-timeout pool.

Reward semantics (DESIGN.md §2 "Reward", as in the authors' verl fork of Reinforce-Ada,
arXiv 2510.04996): take the LAST `\\boxed{...}` (or `\\fbox{...}`) of a response with real
brace matching, compare it with the reference answer by math-verify (symbolic equivalence;
gold parsed as LaTeX, prediction as LaTeX or a plain expression) and return 1.0 or 0.0.
No box, an error or a timeout scores 0.

Symbolic maths on model output can run for hours inside C code (sympy evaluates
`9^{9^{9^{9^{9}}}}` as a big-integer power; one multiplication of such numbers never looks at
Python signals), exhaust memory or crash the parser. So the batched scorer
`RewardPool.score` runs judges in worker processes: each item gets a soft in-worker timer
and a HARD deadline after which the parent SIGKILLs the worker, scores the item 0, starts a
replacement and goes on with the batch. `math_reward` is the same judge in-process, for
trusted input and tests.
"""

import ast
import dataclasses
import decimal
import functools
import logging
import math
import multiprocessing as mp
import os
import re
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import connection as mp_connection

import numpy as np

# --------------------------------------------------------------------------- extraction

_BOX_CMD = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# Escaped pairs (`\{`, `\}`, `\\`) are consumed whole so that they never count as braces.
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
# A final answer is short; longer box contents are treated as no answer (cheap DoS guard).
# The longest reference in the shared maths sets is under 300 characters.
MAX_ANSWER_CHARS = 1000


def last_boxed(response: str) -> str | None:
  """The contents of the last `\\boxed{...}` / `\\fbox{...}` of `response`.

  Braces are matched (nesting, escaped `\\{` `\\}` ignored); `\\boxed 5` (no braces) takes
  the run of non-space characters up to whitespace or `$`. An unclosed last box returns None
  (the response was cut off before its answer); earlier boxes are not used then.

  Args:
    response: model output text.

  Returns:
    The box contents, stripped, or None when there is no (complete, non-empty) box.
  """
  last = deque(_BOX_CMD.finditer(response), maxlen=1)  # Linear scan, keeps the last match.
  if not last:
    return None
  pos = last[0].end()
  n = len(response)
  start = pos
  while pos < n and response[pos].isspace():
    pos += 1
  if pos >= n:
    return None
  if response[pos] == "{":
    depth = 0
    for tok in _BRACE_TOKEN.finditer(response, pos):
      t = tok.group()
      if t == "{":
        depth += 1
      elif t == "}":
        depth -= 1
        if depth == 0:
          inner = response[pos + 1 : tok.start()].strip()
          return inner or None
    return None
  if pos == start or response[pos] == "$":  # `\boxed$` or `\boxedx`: no argument.
    return None
  end = pos
  while end < n and not response[end].isspace() and response[end] != "$":
    end += 1
  return response[pos:end] or None


# A plain (GSM8K-style) number: optional currency sign, thousands separators, decimals,
# then optional unit words ("18 dollars", "12 km"). Single letters are not units: "2 n".
_PLAIN_NUMBER = re.compile(
  r"(?:\\\$|\$)?\s*(?P<num>[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+)"
  r"(?:\s*(?:[A-Za-z]{2,}\.?|\\%|%)(?:\s+[A-Za-z]{2,}\.?)*)?"
)


def normalize_answer(answer: str) -> str:
  """Canonical form of a plain numeric answer; other answers come back stripped.

  "1,000" → "1000", "\\$18.00" → "18", "27.0" → "27", "18 dollars" → "18", "50%" → "50\\%".
  Thousands separators are recognised only in groups of three digits, so "1,3,5" (a list)
  is left alone. Applied to prediction and reference alike before math-verify.

  Args:
    answer: a box content or reference answer (LaTeX).

  Returns:
    The normalised string.
  """
  s = answer.strip()
  m = _PLAIN_NUMBER.fullmatch(s)
  if m is None:
    return s
  value = decimal.Decimal(m.group("num").replace(",", ""))
  num = "0" if value == 0 else format(value.normalize(), "f")
  return num + ("\\%" if s.endswith("%") else "")


# --------------------------------------------------------------------------- equivalence


def _in_main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


@functools.lru_cache(maxsize=8192)
def _parse_gold_cached(reference: str):
  # Only the no-timeout parse is cached (workers); a reference is shared by all responses
  # drawn for its prompt, so this saves one LaTeX parse per response.
  return _parse_gold(reference, None)


def _parse_gold(reference: str, timeout: int | None):
  import math_verify  # Imported lazily: sympy + antlr cost ~0.5 s and belong in workers.

  return math_verify.parse(
    "\\boxed{" + reference + "}",
    [math_verify.LatexExtractionConfig()],
    parsing_timeout=timeout,
    raise_on_error=True,
  )


def is_equivalent(prediction: str, reference: str, mv_timeout_s: int | None = None) -> bool:
  """Whether a boxed prediction equals the reference answer, by math-verify.

  Args:
    prediction: box contents from the response (LaTeX or a plain expression).
    reference: the reference final answer (LaTeX).
    mv_timeout_s: math-verify's own signal-based timeout per parse/compare (whole seconds;
      main thread only) or None for none (workers, where the pool enforces time).

  Returns:
    True when equal (identical normalised strings, or math-verify's `verify`).

  Raises:
    Whatever math-verify raises on unparseable input (callers score that 0).
  """
  import math_verify

  pred, ref = normalize_answer(prediction), normalize_answer(reference)
  if pred == ref:
    return True
  gold = _parse_gold_cached(ref) if mv_timeout_s is None else _parse_gold(ref, mv_timeout_s)
  target = math_verify.parse(
    "\\boxed{" + pred + "}",
    [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()],
    parsing_timeout=mv_timeout_s,
    raise_on_error=True,
  )
  if not gold or not target:
    return False
  return bool(math_verify.verify(gold, target, timeout_seconds=mv_timeout_s, raise_on_error=True))


# Judge outcome codes (worker → parent).
OK, NO_BOX, ERROR, TIMEOUT = "ok", "no_box", "error", "timeout"


def _judge_math(
  response: str, reference: str, mv_timeout_s: int | None, max_chars: int
) -> tuple[float, str]:
  pred = last_boxed(response)
  if pred is None or len(pred) > max_chars:
    return 0.0, NO_BOX
  return float(is_equivalent(pred, reference, mv_timeout_s)), OK


def _judge_exact(
  response: str, reference: str, mv_timeout_s: int | None, max_chars: int
) -> tuple[float, str]:
  del mv_timeout_s  # String comparison cannot hang.
  pred = last_boxed(response)
  if pred is None or len(pred) > max_chars:
    return 0.0, NO_BOX
  return float(normalize_answer(pred) == normalize_answer(reference)), OK


# Reward functions by config name:
#   (response, reference, mv_timeout_s, max_answer_chars) -> (reward, outcome).
# `exact` (normalised string match) suits the procedural arithmetic task.
JUDGES: dict[str, Callable[[str, str, int | None, int], tuple[float, str]]] = {
  "math": _judge_math,
  "exact": _judge_exact,
}


def math_reward(response: str, reference: str, timeout_s: float = 5) -> float:
  """Reward of one response, in-process: 1.0 when its last box equals the reference.

  In-process there is no hard timeout: math-verify's signal timer (main thread only) stops
  slow Python-level work, but C-level hangs (huge integer powers) are not interruptible.
  Score untrusted model output through `RewardPool.score`.

  Args:
    response: model output text.
    reference: reference final answer (LaTeX), e.g. from `reference_answer`.
    timeout_s: math-verify's per-call timeout, rounded up to whole seconds (not applied off
      the main thread, where signals cannot be used).

  Returns:
    1.0 or 0.0 (no box, not equal, or any error).
  """
  from math_verify.errors import TimeoutException  # A BaseException.

  # signal.alarm takes whole seconds; signals only work on the main thread.
  mv_timeout = max(1, math.ceil(timeout_s)) if _in_main_thread() else None
  try:
    return _judge_math(response, reference, mv_timeout, MAX_ANSWER_CHARS)[0]
  except (Exception, TimeoutException):  # Any failure of the verifier is a wrong answer.
    return 0.0


# --------------------------------------------------------------------------- references

_TRAILING_ZEROS = re.compile(r"^(-?\d+)\.0+$")


def _answer_field(field: str) -> Callable[[Mapping], str]:
  def get(row: Mapping) -> str:
    value = row[field]
    if isinstance(value, float):  # AMC23 stores 27.0 for 27.
      value = repr(value)
    return _TRAILING_ZEROS.sub(r"\1", str(value).strip())

  return get


def _last_box_of(field: str) -> Callable[[Mapping], str]:
  def get(row: Mapping) -> str:
    answer = last_boxed(row[field])
    if answer is None:
      raise ValueError(f"field {field!r} has no complete \\boxed{{}} answer")
    return answer

  return get


def _gsm8k_answer(row: Mapping) -> str:
  text = row["answer"]
  if "####" not in text:
    raise ValueError("field 'answer' has no '####' final-answer marker")
  return text.rsplit("####", 1)[1].strip().replace(",", "")


def _olympiad_answer(row: Mapping) -> str:
  answers = row["final_answer"]
  if isinstance(answers, str):  # Some exports render the list as a string.
    answers = ast.literal_eval(answers) if answers.lstrip().startswith("[") else [answers]
  # Entries are LaTeX in `$...$`; several answers become one comma-separated list.
  parts = [a.replace("$", "").strip() for a in answers]
  return ", ".join(p for p in parts if p)


# Reference final answer per data source (keys are the JSONL file stems, README of
# ../shared/data). `math` is MATH's full test split (training prompts outside MATH500).
REFERENCE_ANSWER_FNS: dict[str, Callable[[Mapping], str]] = {
  "gsm8k": _gsm8k_answer,
  "math": _last_box_of("solution"),
  "math500": _answer_field("answer"),
  "minerva_math": _last_box_of("solution"),
  "olympiadbench": _olympiad_answer,
  "aime24": _answer_field("answer"),
  "amc23": _answer_field("answer"),
}


def reference_answer(source: str, row: Mapping) -> str:
  """The reference final answer (LaTeX) of one JSONL row of a maths data set.

  MATH500, AIME24, AMC23: `answer` (AMC's float 27.0 → "27"); MATH (full test split) and
  Minerva Math: last `\\boxed{}` of `solution`; OlympiadBench: `final_answer` (a list,
  `$` removed, joined by ", "); GSM8K: text after `####` without thousands separators.

  Args:
    source: one of `REFERENCE_ANSWER_FNS` ("gsm8k", "math", "math500", "minerva_math",
      "olympiadbench", "aime24", "amc23").
    row: the decoded JSON object of one line.

  Returns:
    The reference answer string.

  Raises:
    ValueError: unknown source, or a missing / malformed answer field (named).
  """
  try:
    fn = REFERENCE_ANSWER_FNS[source]
  except KeyError:
    raise ValueError(f"unknown source {source!r}; known: {sorted(REFERENCE_ANSWER_FNS)}") from None
  try:
    answer = fn(row)
  except KeyError as e:
    raise ValueError(f"{source}: row has no field {e.args[0]!r}") from None
  except (ValueError, SyntaxError, TypeError, AttributeError) as e:
    raise ValueError(f"{source}: bad reference answer: {e}") from None
  if not answer:
    raise ValueError(f"{source}: empty reference answer")
  return answer


# --------------------------------------------------------------------------- worker pool


class _SoftTimeout(BaseException):
  """Raised by the worker's SIGALRM handler; a BaseException so `except Exception` in
  sympy / math-verify cannot swallow it."""


def _on_alarm(signum, frame):
  raise _SoftTimeout()


def _die_with_parent() -> None:
  # Linux: a worker stuck in C code must not outlive the pool if the trainer is killed.
  try:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def _worker_main(conn, config: "VerifierConfig"):
  """Worker loop: receive (task_id, response, reference), send (task_id, reward, outcome).

  The soft timer (SIGALRM) ends Python-level work; the parent's hard deadline covers the rest.
  """
  _die_with_parent()
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle.
  logging.getLogger("math_verify").setLevel(logging.ERROR)  # Timeouts are ours, not theirs.
  judge = functools.partial(JUDGES[config.judge], max_chars=config.max_answer_chars)
  judge("\\boxed{1}", "2", None)  # Imports and warms sympy/antlr before the first deadline.
  soft_timeout_s = config.timeout_s * (config.soft_timeout_frac or 0.0)  # 0: timer off.
  if config.max_memory_mb:
    import resource

    limit = config.max_memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  signal.signal(signal.SIGALRM, _on_alarm)
  conn.send(("ready", os.getpid()))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):
      return
    if msg is None:
      return
    task_id, response, reference = msg
    try:
      try:
        signal.setitimer(signal.ITIMER_REAL, soft_timeout_s)
        reward, outcome = judge(response, reference, None)
      finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    except _SoftTimeout:  # The timer is one-shot, so it fires at most once per item.
      reward, outcome = 0.0, TIMEOUT
    except Exception:  # noqa: BLE001 — RecursionError, MemoryError, parser errors...
      reward, outcome = 0.0, ERROR
    conn.send((task_id, reward, outcome))


@dataclasses.dataclass(frozen=True)
class VerifierConfig:
  """Reward pool settings.

  Attributes:
    judge: reward function name in `JUDGES` ("math" or "exact").
    num_workers: worker processes; 0 means every core this process may use.
    timeout_s: hard per-item limit in seconds, from dispatch to result; the worker is killed
      and replaced when it passes, and the item scores 0.
    soft_timeout_frac: the in-worker timer fires at this fraction of `timeout_s`, so that
      slow Python-level sympy work ends without killing the worker; None: no soft timer.
    start_method: "forkserver" (default) or "spawn"; never "fork" — the trainer process holds
      JAX/XLA threads and forking it is unsafe.
    startup_timeout_s: limit for a worker to import math-verify and report ready.
    max_memory_mb: address-space limit per worker (MiB), None for none; a hostile answer such
      as 10^{10^{10}} then fails with MemoryError instead of taking the host's memory.
    max_answer_chars: longer box contents score 0 without being parsed.
  """

  judge: str = "math"
  num_workers: int = 0
  timeout_s: float = 5.0
  soft_timeout_frac: float | None = 0.8
  start_method: str = "forkserver"
  startup_timeout_s: float = 120.0
  max_memory_mb: int | None = 4096
  max_answer_chars: int = MAX_ANSWER_CHARS

  def __post_init__(self):
    if self.judge not in JUDGES:
      raise ValueError(f"judge={self.judge!r} not in {sorted(JUDGES)}")
    if self.num_workers < 0:
      raise ValueError(f"num_workers={self.num_workers} must be >= 0")
    if not self.timeout_s > 0:
      raise ValueError(f"timeout_s={self.timeout_s} must be > 0")
    if self.soft_timeout_frac is not None and not 0 < self.soft_timeout_frac <= 1:
      raise ValueError(f"soft_timeout_frac={self.soft_timeout_frac} must be in (0, 1]")
    if self.start_method not in ("forkserver", "spawn"):
      raise ValueError(f"start_method={self.start_method!r} must be 'forkserver' or 'spawn'")


@dataclasses.dataclass
class VerifyStats:
  """Counts for metrics (per batch in `RewardPool.last_stats`, cumulative in `.stats`).

  Attributes:
    items: responses scored.
    correct: responses scored 1.
    no_box: responses without a complete final box (scored 0 without math-verify).
    timeouts: items stopped by the soft timer or the hard deadline (scored 0).
    errors: items whose judge raised or whose worker died (scored 0).
    restarts: workers killed or lost and replaced.
  """

  items: int = 0
  correct: int = 0
  no_box: int = 0
  timeouts: int = 0
  errors: int = 0
  restarts: int = 0

  def add(self, other: "VerifyStats") -> None:
    for f in dataclasses.fields(self):
      setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclasses.dataclass(eq=False)
class _Slot:
  """One worker process and what it is doing (task None = idle once ready)."""

  process: mp.process.BaseProcess
  conn: mp_connection.Connection
  ready: bool = False
  task: int | None = None  # Task id in flight; results with another id are stale.
  index: int = -1  # Batch index of the item in flight.
  deadline: float = 0.0  # time.monotonic() limit for startup or for the item in flight.


def _kill(slot: _Slot) -> None:
  slot.process.kill()
  slot.process.join(5.0)
  slot.conn.close()


def _shutdown(slots: list[_Slot]) -> None:
  # Idle workers exit on a None message; busy or starting ones may be stuck in C code.
  for slot in slots:
    try:
      if slot.ready and slot.task is None:
        slot.conn.send(None)
        continue
    except OSError:
      pass
    slot.process.kill()
  deadline = time.monotonic() + 2.0
  for slot in slots:
    slot.process.join(max(0.0, deadline - time.monotonic()))
    if slot.process.is_alive():
      slot.process.kill()
      slot.process.join(5.0)
    slot.conn.close()
  slots.clear()


class RewardPool:
  """Persistent pool of verifier processes with a hard per-item timeout.

  Create once per run (workers import sympy once) and call `score` every RL step; use as a
  context manager or call `close()`. Not thread-safe: one `score` at a time.

  Example:
    with RewardPool(VerifierConfig(num_workers=8)) as pool:
      rewards = pool.score(responses, references)  # float32[N]
      metrics = dataclasses.asdict(pool.last_stats)
  """

  def __init__(self, config: VerifierConfig = VerifierConfig()):
    self.config = config
    try:
      cores = len(os.sched_getaffinity(0))
    except AttributeError:
      cores = os.cpu_count() or 1
    self.num_workers = config.num_workers or cores
    self._ctx = mp.get_context(config.start_method)
    if config.start_method == "forkserver":
      # Forked from a server that already imported these, a replacement worker starts in
      # milliseconds (no effect if this process started the forkserver before).
      self._ctx.set_forkserver_preload(["numpy", "math_verify", "ada_jax.rewards"])
    self._slots: list[_Slot] = []
    self._next_task = 0
    self.stats = VerifyStats()
    self.last_stats = VerifyStats()
    self._finalizer = weakref.finalize(self, _shutdown, self._slots)
    for _ in range(self.num_workers):
      self._slots.append(self._start())
    try:
      while not all(s.ready for s in self._slots):  # _poll raises past startup_timeout_s.
        self._poll(config.startup_timeout_s, VerifyStats(), None)
    except BaseException:
      self.close()
      raise

  def _start(self) -> _Slot:
    parent, child = self._ctx.Pipe(duplex=True)
    proc = self._ctx.Process(
      target=_worker_main, args=(child, self.config), daemon=True, name="ada_jax-reward"
    )
    proc.start()
    child.close()  # Only the worker holds this end now, so its death reads as EOF here.
    return _Slot(proc, parent, deadline=time.monotonic() + self.config.startup_timeout_s)

  def _replace(self, slot: _Slot, stats: VerifyStats) -> None:
    _kill(slot)
    self._slots[self._slots.index(slot)] = self._start()
    stats.restarts += 1

  @property
  def worker_pids(self) -> list[int]:
    """Process ids of the current workers (changes when one is replaced)."""
    return [s.process.pid for s in self._slots]

  def close(self) -> None:
    """Stops every worker (graceful, then SIGKILL); idempotent."""
    self._finalizer()

  def __enter__(self) -> "RewardPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def score(self, responses: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """Rewards of a batch of responses, in parallel, each under a hard timeout.

    A hung item (past `timeout_s`) is scored 0 and its worker killed and replaced; a worker
    that dies mid-item scores that item 0 and is replaced; the batch always returns.
    Responses with no box marker are scored 0 here, without a round trip.

    Args:
      responses: N model outputs (str; bytes are decoded as UTF-8 with replacement).
      references: N reference answers (LaTeX), `references[i]` for `responses[i]`.

    Returns:
      rewards: float32[N] of 0.0 / 1.0. Counts are in `last_stats` (this batch) and `stats`.

    Raises:
      ValueError: lengths differ, or an item is not a string (index named).
      RuntimeError: the pool is closed.
    """
    if not self._finalizer.alive:
      raise RuntimeError("RewardPool is closed")
    if len(responses) != len(references):
      raise ValueError(f"{len(responses)} responses but {len(references)} references")
    batch = VerifyStats(items=len(responses))
    rewards = np.zeros(len(responses), np.float32)
    todo: deque[tuple[int, str, str]] = deque()
    for i, (resp, ref) in enumerate(zip(responses, references, strict=True)):
      resp, ref = _as_text(resp, "responses", i), _as_text(ref, "references", i)
      if "\\boxed" in resp or "\\fbox" in resp:
        todo.append((i, resp, ref))
      else:
        batch.no_box += 1
    try:
      while todo or any(s.task is not None for s in self._slots):
        self._dispatch(todo, batch)
        waits = [s.deadline for s in self._slots if s.task is not None or not s.ready]
        self._poll(min(waits) - time.monotonic() if waits else 0.05, batch, rewards)
      batch.correct = int(rewards.sum())
    except BaseException:
      # Interrupted mid-batch: results in flight would be stale for the next batch.
      for slot in list(self._slots):
        if slot.task is not None:
          self._replace(slot, batch)
      raise
    finally:
      self.last_stats = batch
      self.stats.add(batch)
    return rewards

  def _dispatch(self, todo: deque, stats: VerifyStats) -> None:
    for slot in list(self._slots):
      if not todo:
        return
      if not slot.ready or slot.task is not None:
        continue
      index, resp, ref = todo.popleft()
      try:
        slot.conn.send((self._next_task, resp, ref))
      except OSError:  # Died while idle: nothing lost, requeue and replace.
        todo.appendleft((index, resp, ref))
        self._replace(slot, stats)
        continue
      slot.task, slot.index = self._next_task, index
      slot.deadline = time.monotonic() + self.config.timeout_s
      self._next_task += 1

  def _poll(self, timeout: float, stats: VerifyStats, rewards: np.ndarray | None) -> None:
    """Waits for results/readiness up to `timeout` s, then enforces deadlines."""
    conns = {s.conn: s for s in self._slots}
    for conn in mp_connection.wait(list(conns), timeout=max(0.0, timeout)):
      slot = conns[conn]
      try:
        msg = conn.recv()
      except (EOFError, OSError):  # The worker died: a crash mid-item, or a broken start.
        if not slot.ready:
          slot.process.join(5.0)
          raise RuntimeError(
            f"reward worker exited during start-up (exit code {slot.process.exitcode})"
          ) from None
        if slot.task is not None:
          stats.errors += 1
        self._replace(slot, stats)
        continue
      if msg[0] == "ready":
        slot.ready = True
      elif msg[0] == slot.task:
        _, reward, outcome = msg
        if rewards is not None:
          rewards[slot.index] = reward
        stats.errors += outcome == ERROR
        stats.timeouts += outcome == TIMEOUT
        stats.no_box += outcome == NO_BOX
        slot.task = None
    now = time.monotonic()
    for slot in list(self._slots):
      if (slot.task is not None or not slot.ready) and now > slot.deadline:
        if slot.task is not None:
          stats.timeouts += 1
        elif not slot.ready:
          raise RuntimeError(
            f"reward worker not ready within startup_timeout_s={self.config.startup_timeout_s}"
          )
        self._replace(slot, stats)


def _as_text(value, field: str, index: int) -> str:
  if isinstance(value, str):
    return value
  if isinstance(value, bytes):
    return value.decode("utf-8", errors="replace")
  raise ValueError(f"{field}[{index}] is {type(value).__name__}, expected str")
