"""Per-step metrics: one JSONL line, TensorBoard scalars and a tqdm bar; curves as PNG.

Only the primary process (process 0) writes. On resume, lines of steps after the restored
checkpoint (written before a crash, about to be recomputed) and a torn last line are moved
to `metrics.orphaned.jsonl` rather than deleted, so the main file has one line per step and
nothing written is lost; the TensorBoard writer starts with a `purge_step`, so TensorBoard
hides those steps' events of the earlier event file and every curve has one point per step.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from ada_jax.config import ConfigError


def _scalar(value: Any) -> float | int | None:
  if isinstance(value, (bool, np.bool_)):
    return int(value)
  if isinstance(value, (int, np.integer)):
    return int(value)
  try:
    value = float(value)
  except (TypeError, ValueError):
    return None
  return value if math.isfinite(value) else None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
  """Metrics lines of a run (`[]` if the file does not exist); a line that is not a JSON
  object (a torn last line, after a kill mid-append) is left out with a warning naming it."""
  records, unreadable = _read_lines(path)
  for lineno, _ in unreadable:
    logging.warning("%s:%d: not a JSON object (a torn write?), left out", path, lineno)
  return records


def _read_lines(path: str | os.PathLike) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
  """(records, [(line number, text)] of the lines that are not JSON objects)."""
  path = pathlib.Path(path)
  if not path.exists():
    return [], []
  records, unreadable = [], []
  text = path.read_bytes().decode("utf-8", errors="replace")
  for lineno, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      record = None
    if isinstance(record, dict):
      records.append(record)
    else:
      unreadable.append((lineno, line))
  return records, unreadable


class MetricsWriter:
  """Writes each step's metrics to `workdir/metrics.jsonl`, TensorBoard and the console.

  Args:
    workdir: run directory (created if needed).
    total_steps: length of the progress bar (RL steps).
    start_step: the step the run resumes after (0 for a fresh run); lines with a larger
      `step` are moved to `metrics.orphaned.jsonl`, and TensorBoard events of steps after
      it (after 0 included, for a run restarted at step 0) are purged.
    primary: False on processes other than 0: nothing is written.
    show: keys shown in the progress bar's postfix.
  """

  def __init__(
    self,
    workdir: str | os.PathLike,
    *,
    total_steps: int,
    start_step: int = 0,
    primary: bool = True,
    show: Sequence[str] = ("pass_rate", "reward_mean", "samples_drawn", "loss"),
  ):
    self.primary = primary
    self.show = tuple(show)
    self.path = pathlib.Path(workdir) / "metrics.jsonl"
    self._bar = self._tb = None
    if not primary:
      return
    try:
      self._set_aside_stale(start_step)
    except OSError as e:  # the file is a folder, on a read-only mount, ...: one line
      self.path.with_suffix(".tmp").unlink(missing_ok=True)
      raise ConfigError(
        f"{self.path}: cannot be written ({e.strerror or e}); the run's metrics go there"
      ) from None
    from tqdm.auto import tqdm

    # A session START at step s hides the events at steps >= s of earlier event files
    # (TensorBoard's purge of orphaned steps): those steps are about to be written again.
    # Step 0 holds only the held-out scores before RL, which a run restarted at step 0
    # writes again too. The suffix keeps a restart within the same second from replacing
    # the earlier file (named by the second) and sorts the files in the order started.
    self._tb = EventFileWriter(
      str(self.path.parent / "tensorboard"), filename_suffix=f".{time.time_ns()}"
    )
    purge = start_step + 1 if start_step else 0
    start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
    self._tb.add_event(event_pb2.Event(wall_time=time.time(), step=purge, session_log=start))
    self._bar = tqdm(
      total=total_steps, initial=start_step, desc="RL steps", unit="step", dynamic_ncols=True
    )

  def _set_aside_stale(self, start_step: int) -> None:
    """Moves the lines of steps after `start_step` (a resume repeats them) and torn lines to
    metrics.orphaned.jsonl, and checks that the file can be appended to."""
    self.path.parent.mkdir(parents=True, exist_ok=True)
    lines, unreadable = _read_lines(self.path)
    stale = [line for line in lines if line.get("step", 0) > start_step]
    # A line that is not JSON (the torn tail of an append cut by a kill) is set aside too,
    # as its text: the file then ends with a whole line again.
    stale += [{"unreadable_line": n, "text": text} for n, text in unreadable]
    for n, _ in unreadable:
      logging.warning("%s:%d: torn line moved to metrics.orphaned.jsonl", self.path, n)
    if stale:
      with open(self.path.with_name("metrics.orphaned.jsonl"), "a") as f:
        f.writelines(json.dumps(line) + "\n" for line in stale)
    # Rewritten whole also when its last line lacks its newline, or the next append would
    # be glued to it.
    if stale or (lines and not self.path.read_bytes().endswith(b"\n")):
      tmp = self.path.with_suffix(".tmp")
      tmp.write_text(
        "".join(json.dumps(line) + "\n" for line in lines if line.get("step", 0) <= start_step)
      )
      os.replace(tmp, self.path)
    with open(self.path, "a"):  # every step appends: a file that cannot take it fails now
      pass

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """Records one step. A list (e.g. per-round counts) is one JSONL field, and one
    TensorBoard scalar per entry (`<name>/1`, `<name>/2`, ...); NaN/inf become null.
    Returns the scalar metrics written."""
    scalars = {k: v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}
    if not self.primary:
      return scalars
    record: dict[str, Any] = {"step": step}
    for k, v in metrics.items():
      v = v.tolist() if isinstance(v, np.ndarray) else v
      record[k] = (
        [_scalar(x) for x in v]
        if isinstance(v, (list, tuple))
        else v
        if isinstance(v, str)
        else _scalar(v)
      )
    # TensorBoard first: a step with its JSONL line has its events on disk too.
    self.add_scalars(
      step,
      {
        **scalars,
        **{
          f"{k}/{i}": x
          for k, v in record.items()
          if isinstance(v, list)
          for i, x in enumerate(v, 1)
        },
      },
    )
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    self._bar.update(step - self._bar.n)
    self._bar.set_postfix({k: f"{scalars[k]:.3g}" for k in self.show if k in scalars})
    return scalars

  def add_scalars(self, step: int, metrics: Mapping[str, Any]) -> None:
    """TensorBoard scalars only (e.g. held-out scores before and after RL, which have no
    line of their own in `metrics.jsonl`; `summary.json` holds them). Flushed at once, so
    a killed run's event file holds every step it finished. Tags are the metric names
    with characters TensorBoard does not take replaced (`eval/arith/avg@4` ->
    `eval/arith/avg_at_4`)."""
    if not self.primary:
      return
    values = [
      summary_pb2.Summary.Value(tag=tensorboard_tag(k), simple_value=v)
      for k, v in ((k, _scalar(v)) for k, v in metrics.items())
      if v is not None
    ]
    summary = summary_pb2.Summary(value=values)
    self._tb.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
    self._tb.flush()  # blocks until every event added so far is on disk

  def log_text(self, message: str) -> None:
    """A line on the console that does not break the progress bar."""
    if self.primary:
      console(message)

  def close(self) -> None:
    if self.primary:
      self._tb.close()
      self._bar.close()


class CompileCounter:
  """Counts XLA backend compilations while open (`with CompileCounter() as c: ...;
  c.count`); the listener is registered on entry and removed on exit, so nothing is
  counted outside the block and nothing stays registered after it."""

  _EVENT = "/jax/core/compile/backend_compile_duration"

  def __init__(self):
    self.count = 0

  def _listen(self, event: str, duration: float, **kwargs) -> None:
    if event == self._EVENT:
      self.count += 1

  def __enter__(self) -> CompileCounter:
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._listen)


def tensorboard_tag(name: str) -> str:
  """The TensorBoard tag of metric `name` (TensorBoard takes letters, digits, `_.-/`)."""
  return re.sub(r"[^\w.\-/]", "_", name.replace("@", "_at_"))


def console(message: str) -> None:
  """A status line on stderr (beside the progress bars, without breaking them), from the
  primary process only."""
  import jax
  from tqdm.auto import tqdm

  if jax.process_index() == 0:
    tqdm.write(message, file=sys.stderr)


def plot_curves(
  runs: Mapping[str, Iterable[Mapping[str, Any]]],
  keys: Sequence[str],
  path: str | os.PathLike,
  *,
  x: str = "step",
  title: str = "",
  units: Mapping[str, str] | None = None,
  smooth: int = 1,
) -> None:
  """One panel per metric key, one line per run; saved as PNG.

  Args:
    runs: run label -> metric lines (as read by `read_jsonl`).
    keys: metric keys to plot (y axes).
    path: output PNG.
    x: the x-axis key (e.g. 'step' or 'samples_drawn_total').
    units: optional key -> unit label for the axes.
    smooth: moving-average window (steps).
  """
  # The object-oriented API: no pyplot state, and the caller's backend (e.g. a notebook's
  # inline one) is left alone.
  from matplotlib.figure import Figure
  from matplotlib.ticker import MaxNLocator

  units = dict(units or {})
  fig = Figure(figsize=(5 * len(keys), 3.8))
  axes = fig.subplots(1, len(keys), squeeze=False)
  for ax, key in zip(axes[0], keys, strict=True):
    for label, lines in runs.items():
      pts = [(line[x], line[key]) for line in lines if line.get(key) is not None and x in line]
      if not pts:
        continue
      xs, ys = map(np.asarray, zip(*pts, strict=True))
      if smooth > 1 and len(ys) >= smooth:
        ys = np.convolve(ys, np.ones(smooth) / smooth, mode="valid")
        xs = xs[smooth - 1 :]
      ax.plot(xs, ys, label=label)
    if x == "step":
      ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(x + (f" ({units[x]})" if x in units else ""))
    ax.set_ylabel(key + (f" ({units[key]})" if key in units else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def git_commit(path: str | os.PathLike | None = None) -> str:
  """The commit of the checkout holding `path` (default: this package), suffixed '+dirty'
  when tracked files differ from it, or 'unknown' outside a git checkout; for experiment
  results that must name the code that made them."""
  import subprocess

  cwd = pathlib.Path(path or __file__).resolve()
  cwd = cwd if cwd.is_dir() else cwd.parent
  git = lambda *args: subprocess.run(
    ["git", *args], cwd=cwd, capture_output=True, text=True, check=False
  )
  head = git("rev-parse", "HEAD")
  if head.returncode:
    return "unknown"
  dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
  return head.stdout.strip() + ("+dirty" if dirty else "")
