"""A tiny TensorBoard writer that needs no torch (the buffer may not import it).

Writes the same event files as ``torch.utils.tensorboard.SummaryWriter``: scalars, histograms and
text, every event carrying its wall time and a step (in distrl: the policy version). Events are
queued and written by tensorboard's background thread; ``flush()`` forces them to disk.

    m = Metrics("runs/x/tb/buffer0")
    m.scalars({"buffer/rows": 12, "buffer/groups": 3}, step=version)
    m.histogram("buffer/staleness", [0, 1, 1], step=version)
    m.close()

``Metrics(None)`` makes every call a no-op, so roles can log unconditionally.
"""

from __future__ import annotations

import os
import time
from typing import Iterable, Mapping

import numpy as np


class Metrics:
    """TensorBoard event writer for one role. Args: logdir (created if missing), or None for no-op.

    Methods may be called from several threads (tensorboard's writer queues events).
    """

    def __init__(self, logdir: str | os.PathLike | None, flush_secs: float = 10.0) -> None:
        self.logdir = None if logdir is None else str(logdir)
        self._writer = None
        if self.logdir is not None:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            os.makedirs(self.logdir, exist_ok=True)
            self._writer = EventFileWriter(self.logdir, max_queue_size=100, flush_secs=flush_secs)

    def _add(self, value, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._writer.add_event(Event(wall_time=time.time(), step=int(step), summary=Summary(value=[value])))

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Log one number under ``tag`` at ``step``."""
        if self._writer is None:
            return
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._add(Summary.Value(tag=tag, simple_value=float(value)), step)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Log several scalars at the same step (tags as given, e.g. ``buffer/rows``)."""
        for tag, value in values.items():
            self.scalar(tag, value, step)

    def histogram(self, tag: str, values: Iterable[float], step: int, bins: int = 30) -> None:
        """Log the distribution of ``values`` at ``step``; nothing is written for an empty list.

        Integer values spanning at most 64 get one bucket per integer; others ``bins`` equal buckets.
        Raises ValueError on NaN or infinite values.
        """
        if self._writer is None:
            return
        from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

        arr = np.asarray(list(values), dtype=np.float64)
        if arr.size == 0:
            return
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"histogram {tag!r} has non-finite values")
        lo, hi = float(arr.min()), float(arr.max())
        if np.all(arr == np.round(arr)) and hi - lo <= 64:
            edges = np.arange(lo - 0.5, hi + 1.0, 1.0)
        else:
            edges = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1)
        counts, edges = np.histogram(arr, bins=edges)
        proto = HistogramProto(min=lo, max=hi, num=float(arr.size), sum=float(arr.sum()),
                               sum_squares=float(np.dot(arr, arr)),
                               bucket_limit=edges[1:].tolist(), bucket=counts.astype(np.float64).tolist())
        self._add(Summary.Value(tag=tag, histo=proto), step)

    def text(self, tag: str, text: str, step: int) -> None:
        """Log a string (shown in TensorBoard's Text tab; markdown is rendered)."""
        if self._writer is None:
            return
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode("utf-8")],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        self._add(Summary.Value(tag=tag, metadata=metadata, tensor=tensor), step)

    def flush(self) -> None:
        """Write queued events to disk."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "Metrics":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
