"""Full weights as flat buffers, one per dtype: the layout and checksum that the ``nccl`` and ``shm``
transports share.

A :class:`Layout` says where each named tensor lives in the buffers (the announcement's ``manifest``), so
a receiver rebuilds ``(name, view)`` pairs without any per-tensor message. :func:`checksum` is the
announcement's ``digest`` for these transports: the sum of the payload's 16-bit words (8-bit for 1-byte
dtypes), accumulated in int64 on the tensors' device; it is the same over the flat buffers as over the
tensors they were made of, so a sender computes it on its parameters and a receiver on what it received.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHECKSUM_CHUNK = 1 << 24  # words summed at once: CUDA widens an int16 sum's input to int64 first (8 bytes a word)


def checksum(tensors: list[torch.Tensor], chunk: int = CHECKSUM_CHUNK) -> str:
    """``sum64:<n>``: the sum of every tensor's bytes read as int16 words (uint8 for 1-byte dtypes), in int64.

    One device synchronization. Each tensor is summed in pieces of ``chunk`` words: an integer ``sum`` on CUDA
    widens its whole input to int64 first, so one piece costs at most ``8 * chunk`` bytes of temporary memory
    (a 135M-parameter bf16 payload summed at once asked for 1 GiB, and an actor near the GPU's limit failed
    with out-of-memory). Integer sums are exact, so the digest does not depend on ``chunk``. Tensors may be
    non-contiguous (they are made contiguous first).
    """
    sums = [piece.sum() for t in tensors
            for piece in t.detach().contiguous().reshape(-1)
            .view(torch.int16 if t.element_size() % 2 == 0 else torch.uint8).split(chunk)]
    return f"sum64:{int(torch.stack(sums).sum()) if sums else 0}"


@dataclass(frozen=True)
class Layout:
    """Where each named tensor lives in the flat buffers: (name, dtype, shape, buffer index, offset)."""

    entries: tuple

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]]) -> "Layout":
        offsets: dict[str, int] = {}
        dtypes: list[str] = []
        entries = []
        for name, t in named:
            dt = str(t.dtype).removeprefix("torch.")
            if dt not in dtypes:
                dtypes.append(dt)
            entries.append((name, dt, tuple(t.shape), dtypes.index(dt), offsets.get(dt, 0)))
            offsets[dt] = offsets.get(dt, 0) + t.numel()
        return cls(tuple(entries))

    def sizes(self) -> list[tuple[str, int]]:
        """(dtype, numel) of each flat buffer, in index order."""
        out: dict[int, tuple[str, int]] = {}
        for _, dt, shape, idx, off in self.entries:
            n = off + int(torch.Size(shape).numel())
            out[idx] = (dt, max(n, out.get(idx, (dt, 0))[1]))
        return [out[i] for i in sorted(out)]

    def nbytes(self) -> int:
        """Bytes of all flat buffers together."""
        return sum(n * getattr(torch, dt).itemsize for dt, n in self.sizes())

    def views(self, buffers: list[torch.Tensor]):
        """Yield (name, tensor view into `buffers`)."""
        for name, _, shape, idx, off in self.entries:
            n = int(torch.Size(shape).numel())
            yield name, buffers[idx][off:off + n].view(shape)
