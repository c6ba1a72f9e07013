"""The learner's micro-batches, built from the Arrow columns of a completion table (no Python rows).

A shard arrives as a ``pa.Table`` of ``distrl.core.rows.COMPLETION_SCHEMA``. Its token lists are read as
Arrow list columns: per-row lengths (``list_value_length``) and the flattened values (``list_flatten``)
become numpy arrays, and one scatter per column lays every row's tokens into the padded (b, L-1) layout
the loss reads; ``torch.from_numpy`` then wraps the arrays without a copy. No per-row Python object or
tensor is made. :func:`pack` lays the same sequences end to end in rows of ``--learner_pack_tokens``
with one scatter as well (only its first-fit placement loops, over sequence lengths).

The tensors are the same, element for element, as building them row by row: the batch's numbers
(losses, logprobs, gradients) do not depend on how it was assembled.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

__all__ = ["MicroBatch", "collate", "list_column", "list_lengths", "loss_mask", "loss_tokens", "micro_batches", "pack",
           "widest_first"]


@dataclass
class MicroBatch:
    """Right-padded tensors of b completions; position t predicts token t+1 of prompt+completion.

    input_ids, attention_mask, targets, mask, behavior_logprobs: (b, L-1); advantages: (b,).
    Packed (:func:`pack`): the model instead runs on ``packed_ids`` and ``packed_positions`` (R, P):
    the b sequences laid end to end in R rows of at most ``--learner_pack_tokens`` tokens, positions
    restarting at 0 at each sequence, so attention stays inside each sequence; ``packed_index`` (n,)
    gives, for each completion position ``mask > 0`` of the padded layout (row-major), its flat index
    into the (R * P) packed positions. The loss still reads the padded (b, L-1) tensors.
    ``completion_index`` (n,): the flat (row-major) indices of the positions ``mask > 0``, computed from
    ``mask`` when the micro-batch is made (on the host), so that selecting them on the device needs no
    sync (a boolean mask index would wait for the GPU to learn n).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor
    packed_ids: Optional[torch.Tensor] = None
    packed_positions: Optional[torch.Tensor] = None
    packed_index: Optional[torch.Tensor] = None
    completion_index: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.completion_index is None:
            self.completion_index = (self.mask.reshape(-1) > 0).nonzero().reshape(-1)

    def to(self, device: torch.device) -> "MicroBatch":
        """The same micro-batch on ``device`` (the model's); to a GPU through pinned memory without
        waiting (the copy is queued behind the work already launched)."""
        cuda = torch.device(device).type == "cuda"

        def move(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None:
                return None
            return t.pin_memory().to(device, non_blocking=True) if cuda and t.device.type == "cpu" else t.to(device)

        return MicroBatch(*(move(getattr(self, f.name)) for f in fields(self)))


def list_lengths(table: pa.Table, name: str) -> np.ndarray:
    """(b,) int64: the length of each row's list in column ``name`` of ``table``."""
    return pc.list_value_length(table.column(name)).to_numpy().astype(np.int64)


def list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column of ``table`` as (lengths (b,) int64, flattened values (N,)), N = lengths.sum()."""
    return list_lengths(table, name), pc.list_flatten(table.column(name)).to_numpy()


def loss_mask(table: pa.Table, c_len: np.ndarray | None = None) -> np.ndarray:
    """(N,) float32, flattened like ``completion_ids``: 1 for a token the model generated (in the loss), 0 for an
    environment's observation token. A row whose ``loss_mask`` is null (single-turn rows, logs written before
    turns) is all ones. ``c_len`` (b,): the rows' completion lengths (read when None). Raises ValueError when a
    row's mask and completion differ in length."""
    c_len = list_lengths(table, "completion_ids") if c_len is None else c_len
    out = np.ones(int(c_len.sum()), dtype=np.float32)
    if "loss_mask" not in table.column_names or table.column("loss_mask").null_count == table.num_rows:
        return out
    column = table.column("loss_mask")
    m_len = pc.list_value_length(column).fill_null(-1).to_numpy().astype(np.int64)  # -1: null (all ones)
    given = m_len >= 0
    if not np.array_equal(m_len[given], c_len[given]):
        raise ValueError("a row's loss_mask must have one value per completion token")
    out[np.repeat(given, c_len)] = pc.list_flatten(column).to_numpy()
    return out


def loss_tokens(table: pa.Table) -> np.ndarray:
    """(b,) int64: each row's completion tokens in the loss (:func:`loss_mask`'s ones): its generated tokens."""
    c_len = list_lengths(table, "completion_ids")
    mask = loss_mask(table, c_len)
    return np.bincount(np.repeat(np.arange(len(c_len)), c_len), weights=mask, minlength=len(c_len)).astype(np.int64)


def _cells(lengths: np.ndarray, first: np.ndarray | int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each flattened list value: value j of row i sits at (i, first[i] + j); (N,) each."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths  # (b,) flat index of each row's first value
    return rows, np.arange(len(rows)) - starts[rows] + (np.repeat(first, lengths) if np.ndim(first) else first)


def micro_batches(table: pa.Table, chunk_size: Optional[int], chunk_tokens: int) -> list[tuple[int, int]]:
    """The micro-batches of ``table`` as (start, stop) row ranges, in order, covering every row once.

    ``chunk_size`` given: ranges of that many rows (the last may be shorter). Else by token budget: a row
    joins the current range while (rows + 1) x the range's widest row stays <= ``chunk_tokens``, the width
    of a row being its prompt + completion tokens minus one (the padded width :func:`collate` gives it); a
    row wider than the budget forms a range alone. Raises ValueError if the size or budget is < 1.
    """
    if (chunk_size is not None and chunk_size < 1) or chunk_tokens < 1:
        raise ValueError(f"chunk_size and chunk_tokens must be >= 1, got {chunk_size} and {chunk_tokens}")
    b = table.num_rows
    if chunk_size is not None:
        return [(start, min(start + chunk_size, b)) for start in range(0, b, chunk_size)]
    widths = (list_lengths(table, "prompt_ids") + list_lengths(table, "completion_ids") - 1).tolist()
    ranges, start, widest = [], 0, 0
    for i, width in enumerate(widths):
        widest = max(widest, width)
        if i > start and (i - start + 1) * widest > chunk_tokens:
            ranges.append((start, i))
            start, widest = i, width
    return ranges + [(start, b)] if b else ranges


def widest_first(table: pa.Table) -> np.ndarray:
    """(b,) int64: the rows of ``table`` ordered by padded width (prompt + completion tokens - 1), widest first,
    ties in table order. Taken in this order, :func:`micro_batches` by token budget puts rows of similar width
    together, so a micro-batch pads little: on a batch of completions of varied lengths, unsorted micro-batches
    each pad to about the batch's widest row."""
    widths = list_lengths(table, "prompt_ids") + list_lengths(table, "completion_ids")
    return np.argsort(-widths, kind="stable")


def collate(table: pa.Table, pad_id: int, advantages: Optional[np.ndarray] = None) -> MicroBatch:
    """A MicroBatch of the b completions of ``table`` (at least the columns ``prompt_ids``,
    ``completion_ids``, ``behavior_logprobs`` and ``advantage`` of distrl.core.rows.COMPLETION_SCHEMA; with
    ``loss_mask``, an episode's observation tokens get mask 0: :func:`loss_mask`).

    ``advantages`` (b,), one per row, replaces the rows' own ``advantage`` (a learner-state baseline);
    rounded to float32. Raises ValueError on an empty table, a row without prompt tokens, or a row whose
    ``behavior_logprobs`` and ``completion_ids`` differ in length.
    """
    p_len, prompt = list_column(table, "prompt_ids")
    c_len, completion = list_column(table, "completion_ids")
    b_len, behavior = list_column(table, "behavior_logprobs")
    if table.num_rows == 0 or p_len.min() < 1 or not np.array_equal(b_len, c_len):
        raise ValueError("collate needs rows with >= 1 prompt token and one behavior logprob per completion token")
    b, n = table.num_rows, p_len + c_len - 1  # n: (b,) input positions of each sequence
    width = int(n.max())
    seq = np.zeros((b, width + 1), dtype=np.int64)  # (b, L): prompt + completion, right-padded
    seq[_cells(p_len)] = prompt
    c_rows, c_cols = _cells(c_len, p_len)  # completion token j of row i sits at column p_i + j
    seq[c_rows, c_cols] = completion
    valid = np.arange(width) < n[:, None]  # (b, L-1)
    mask = np.zeros((b, width), dtype=np.float32)
    mask[c_rows, c_cols - 1] = loss_mask(table, c_len)  # completion token j is predicted at position p - 1 + j;
    # an observation token (an environment's, loss_mask 0) is not: out of the loss, the head never runs on it
    behavior_lp = np.zeros((b, width), dtype=np.float32)
    behavior_lp[c_rows, c_cols - 1] = behavior
    adv = table.column("advantage").to_numpy() if advantages is None else advantages
    return MicroBatch(torch.from_numpy(np.where(valid, seq[:, :-1], pad_id)), torch.from_numpy(valid.astype(np.int64)),
                      torch.from_numpy(np.where(valid, seq[:, 1:], -100)), torch.from_numpy(mask),
                      torch.from_numpy(behavior_lp), torch.from_numpy(np.array(adv, dtype=np.float32)))


def _first_fit(lengths: np.ndarray, pack_tokens: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """First-fit decreasing: (row (b,), offset in its row (b,), fill of each row) of sequences of
    ``lengths`` placed longest first (ties in index order) into the first row with room."""
    row, offset, fill = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64), []
    for i in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[i])
        j = next((j for j, f in enumerate(fill) if f + n <= pack_tokens), len(fill))
        if j == len(fill):
            fill.append(0)
        row[i], offset[i] = j, fill[j]
        fill[j] += n
    return row, offset, fill


def pack(mb: MicroBatch, pad_id: int, pack_tokens: int) -> MicroBatch:
    """``mb`` with its sequences packed into rows of at most ``pack_tokens`` tokens (no padding waste).

    First-fit decreasing: each sequence (its ``attention_mask`` length) goes into the first row with
    room, longest first; one longer than ``pack_tokens`` gets a row of its own. Rows are right-padded
    to the fullest row's length; the padding is a segment of its own (positions from 0) that no
    completion position reads. transformers (>= 5) turns position ids that restart at 0 into a
    block-diagonal causal mask when no attention mask is given (``masking_utils``,
    ``find_packed_sequence_indices``), for the sdpa and eager attention of Qwen2/Llama-like models.
    ``mb`` must be on the CPU. Raises ValueError for ``pack_tokens < 1``.
    """
    if pack_tokens < 1:
        raise ValueError(f"--learner_pack_tokens must be >= 1 to pack, got {pack_tokens}")
    valid = mb.attention_mask.numpy() > 0  # (b, L-1)
    row, offset, fill = _first_fit(valid.sum(1), pack_tokens)
    width = max(fill)
    start = row * width + offset  # (b,) flat packed index of each sequence's token 0
    seq, pos = np.nonzero(valid)  # every input token, row-major
    ids = np.full(len(fill) * width, pad_id, dtype=np.int64)
    ids[start[seq] + pos] = mb.input_ids.numpy()[seq, pos]
    positions = (np.arange(width) - np.array(fill)[:, None]).reshape(-1)  # the padding: its own segment
    positions[start[seq] + pos] = pos
    cseq, cpos = np.divmod(mb.completion_index.numpy(), mb.mask.shape[1])  # row-major
    return MicroBatch(mb.input_ids, mb.attention_mask, mb.targets, mb.mask, mb.behavior_logprobs, mb.advantages,
                      torch.from_numpy(ids.reshape(len(fill), width)),
                      torch.from_numpy(positions.reshape(len(fill), width)),
                      torch.from_numpy(start[cseq] + cpos), mb.completion_index)
