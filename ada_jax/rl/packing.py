"""A mini-batch's sequences packed into as few training rows as hold them.

`update.make_train_batch` lays each selected response in a row of its own, the prompt
left-padded to the bucket Lp and the response right-padded to the budget Lr: at the
paper's shape every row is 1,024 + 2,048 positions whatever it holds, and the model's
forward and backward pass cost grows with positions, not tokens. `pack` moves each row's
real tokens (one contiguous run: prompt then response) into rows of the same width
Lp + Lr, one sequence after another (first-fit, longest first), each sequence a segment
of its row: `segments` numbers them 1, 2, ... (0 at padding), positions move with their
tokens (from 0 in each sequence), and `layers.causal_attend` keeps every query to its own
segment's keys, so each token's log-prob, the loss (aggregated per sequence id,
`losses.AGGREGATIONS`) and the gradient are the padded batch's up to float32 summation
order (tests/test_packing.py).

The packed row count is static per compile: it is rounded up to `row_counts`' ladder of
multiples of a unit (the micro-batch, so micro-batches stay whole and spread over the
mesh): every count up to 16 units, then 8 per octave (at most 1/8 of the rows padding),
never more than the mini-batch's own rows. So a run compiles the train step at most
`len(row_counts(rows, unit))` times (and the log-prob step of `train.old_logprobs=
'recompute'` as often). Same scheme as MaxText's and tunix's sequence
packing (segment ids, per-segment positions); verl removes the padding instead.
"""

from __future__ import annotations

import numpy as np

from ada_jax.rl.train import TrainBatch


def row_counts(rows: int, unit: int) -> list[int]:
  """The packed row counts a mini-batch of `rows` rows may take: multiples of `unit`,
  every one up to 16 units, then 8 per doubling (steps of 2, 4, ... units: rounding up
  adds at most 1/8), and `rows` itself.

  Raises:
    ValueError: `rows` is not a positive multiple of `unit`.
  """
  if unit < 1 or rows < unit or rows % unit:
    raise ValueError(f"a mini-batch of {rows} rows is not a positive multiple of {unit}")
  counts, m, step = [], 1, 1
  while m * unit < rows:
    counts.append(m * unit)
    if m >= 16 * step:
      step *= 2
    m += step
  return counts + [rows]


def sequence_spans(segments: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Each row's one sequence: (first column `int64[B]`, length `int64[B]`), length 0 for a
  row of padding.

  Raises:
    ValueError: a row's real tokens are not one contiguous run, or a row already holds
      several sequences.
  """
  real = np.asarray(segments) > 0
  if np.asarray(segments).max(initial=0) > 1:
    raise ValueError("pack takes one sequence per row (segments 0 or 1); this batch is packed")
  lengths = real.sum(1)
  first = np.where(lengths > 0, real.argmax(1), 0)
  cols = np.arange(real.shape[1])[None]
  run = (cols >= first[:, None]) & (cols < (first + lengths)[:, None])
  if (bad := np.flatnonzero((run != real).any(1))).size:
    raise ValueError(f"row {bad[0]}'s real tokens are not one contiguous run: it cannot be packed")
  return first, lengths


def _check_loss_mask(batch: TrainBatch, first: np.ndarray, lengths: np.ndarray) -> None:
  """Raises ValueError where packing would change the update: per-row advantages (a
  packed row holds several), a loss token on padding (it would be dropped), or a
  sequence whose first token carries the loss (packed, it would be predicted from the
  sequence before it)."""
  if np.ndim(batch.advantages) != 2:
    raise ValueError(
      f"TrainBatch.advantages has shape {np.shape(batch.advantages)}: pack takes one per "
      "token, [B, L]"
    )
  loss = np.asarray(batch.loss_mask, bool)
  if (bad := np.flatnonzero((loss & (np.asarray(batch.segments) == 0)).any(1))).size:
    raise ValueError(f"row {bad[0]} has loss tokens on padding (segments 0)")
  starts = loss[np.arange(len(first)), first] & (lengths > 0)
  if (bad := np.flatnonzero(starts)).size:
    raise ValueError(
      f"row {bad[0]}'s first token carries the loss: a sequence starts with its prompt"
    )


def pack(batch: TrainBatch, unit: int) -> TrainBatch:
  """Packs a mini-batch laid one sequence a row into fewer rows of the same width.

  Sequences are placed longest first, each into the first row with room (ties in row
  order, so the result is a function of the batch alone: every process packs the same);
  rows of padding are dropped (they carry no loss token); the row count is rounded up
  to `row_counts(rows, unit)`, the added rows padding.

  Args:
    batch: a `TrainBatch` of numpy arrays `[B, L]` from `update.make_train_batch` (one
      contiguous sequence a row, `segments` 0 or 1), without `ref_logprobs` or with.
    unit: the packed row count's granularity (a micro-batch's rows); B a multiple of it.

  Returns:
    A `TrainBatch` of numpy arrays `[S, L]`, S in `row_counts(B, unit)`: the same
    sequences' tokens, positions, loss mask, advantages and old (and reference)
    log-probs, moved together; segment ids 1, 2, ... in each row's column order.

  Raises:
    ValueError: a row's real tokens are not contiguous, B is not a multiple of `unit`,
      advantages per row, a loss token on padding or at a sequence's first token.
  """
  rows, width = batch.tokens.shape
  counts = row_counts(rows, unit)
  first, lengths = sequence_spans(batch.segments)
  _check_loss_mask(batch, first, lengths)
  order = np.argsort(-lengths, kind="stable")
  order = order[lengths[order] > 0]
  free = np.full(rows, width)  # a sequence fits in a row alone, so B rows always suffice
  place = np.zeros((rows, 2), np.int64)  # (packed row, column) of each sequence
  for i in order:
    row = int(np.argmax(free >= lengths[i]))
    place[i] = row, width - free[row]
    free[row] -= lengths[i]
  used = int(np.sum(free < width))
  packed_rows = next(c for c in counts if c >= used)

  fields = ["tokens", "positions", "loss_mask", "advantages", "old_logprobs"]
  if batch.ref_logprobs is not None:
    fields.append("ref_logprobs")
  out = {f: np.zeros((packed_rows, width), np.asarray(getattr(batch, f)).dtype) for f in fields}
  out["segments"] = np.zeros((packed_rows, width), np.int32)
  seen = np.zeros(rows, np.int32)  # sequences placed so far in each packed row
  for i in sorted(order, key=lambda i: tuple(place[i])):
    row, col = place[i]
    src = slice(first[i], first[i] + lengths[i])
    dst = slice(col, col + lengths[i])
    for f in fields:
      out[f][row, dst] = np.asarray(getattr(batch, f))[i, src]
    seen[row] += 1
    out["segments"][row, dst] = seen[row]
  return TrainBatch(**out)
