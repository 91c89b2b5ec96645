"""The evaluation's per-problem results cache (`ResultCache`): what makes an interrupted
evaluation continue where it stopped, and a repeated one read its results back
(`benchmarks.run_benchmark` keys and checks the records)."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence

from absl import logging


class ResultCache:
  """Per-problem results, appended as JSON lines to `path` after every finished batch.

  A line is `{"key", "benchmark", "mode", "prompt_id", "prompt", "rewards", "lengths",
  "boxed"}`:
  `key` hashes the model, the PRNG key and every setting that changes the samples, `prompt`
  the prompt's token ids, so a cache shared by several models, settings or prompt formats
  never mixes them. A torn last line (a kill mid-write) is skipped.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    self.records: dict[tuple[str, str, str, str], dict] = {}
    if self.path.exists():
      # Line by line from bytes: one damaged line (a torn write, a stray non-UTF-8 byte)
      # costs that line, not the file.
      for lineno, line in enumerate(self.path.read_bytes().splitlines(), 1):
        try:
          r = json.loads(line.decode("utf-8"))
          self.records[r["key"], r["benchmark"], r["mode"], r["prompt_id"]] = r
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
          logging.warning("%s:%d: unreadable cache line skipped", self.path, lineno)

  def get(self, key: str, benchmark: str, mode: str, prompt_id: str) -> dict | None:
    return self.records.get((key, benchmark, mode, prompt_id))

  def add(self, records: Sequence[dict]) -> None:
    self.path.parent.mkdir(parents=True, exist_ok=True)
    with open(self.path, "a+b") as f:
      f.seek(0, os.SEEK_END)
      if f.tell():  # After a torn write the file may not end with a newline.
        f.seek(-1, os.SEEK_END)
        torn = f.read(1) != b"\n"
        f.seek(0, os.SEEK_END)
        if torn:
          f.write(b"\n")
      f.write(b"".join(json.dumps(r).encode() + b"\n" for r in records))
      f.flush()
      os.fsync(f.fileno())
    for r in records:
      self.records[r["key"], r["benchmark"], r["mode"], r["prompt_id"]] = r
