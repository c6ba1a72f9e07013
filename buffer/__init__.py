"""The replay buffer: rollout actors PUT groups, learners GET top-k batches under a staleness bound.

- :mod:`buffer.selection`: pure rules (top-k inside a group, the order across groups).
- :mod:`buffer.store`: the pure core (held groups, eviction, selection, credits, bounds), no sockets.
- :mod:`buffer.segments`: the on-disk segment log (Arrow IPC stream), the consumption log, ``lineage``.
- :mod:`buffer.recovery`: rebuilding memory from the logs (``--resume``, offline replay).
- :mod:`buffer.server`: the ZeroMQ ROUTER server around the store; :mod:`buffer.launch`: `distrl buffer`.
- :mod:`buffer.client`: :class:`BufferClient` (DEALER, Lazy-Pirate retries, backpressure).
- :mod:`buffer.security`: CURVE keys and authentication.

The protocol is in docs/protocol.md, operations in docs/buffer.md. This package never imports torch,
``rollout`` or ``learn``.
"""

from buffer.client import BufferClient, BufferFullError, BufferRefused, ReplayExhausted
from buffer.segments import ConsumptionLog, SegmentLog, lineage, read_consumed, read_groups, read_segments
from buffer.selection import topk_rows
from buffer.server import BufferServer
from buffer.store import BufferFull, GroupStore

__all__ = ["BufferClient", "BufferFull", "BufferFullError", "BufferRefused", "BufferServer", "ConsumptionLog",
           "GroupStore", "ReplayExhausted", "SegmentLog", "lineage", "read_consumed", "read_groups",
           "read_segments", "topk_rows"]
