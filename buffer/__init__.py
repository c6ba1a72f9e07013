"""The replay buffer: rollout actors PUT groups, learners GET top-k batches under a staleness bound.

- :mod:`buffer.store`: the pure core (groups, eviction, selection, credits), no sockets.
- :mod:`buffer.segments`: the on-disk segment log (Arrow IPC stream) and the consumption log.
- :mod:`buffer.server`: the ZeroMQ ROUTER server around the store; :func:`run_buffer`.
- :mod:`buffer.client`: :class:`BufferClient` (DEALER, Lazy-Pirate retries).

This package never imports torch, ``rollout`` or ``learn``.
"""

from buffer.client import BufferClient
from buffer.segments import ConsumptionLog, SegmentLog, read_consumed, read_segments
from buffer.server import BufferServer, run_buffer
from buffer.store import GroupStore, topk_rows

__all__ = ["BufferClient", "BufferServer", "ConsumptionLog", "GroupStore", "SegmentLog", "read_consumed",
           "read_segments", "run_buffer", "topk_rows"]
