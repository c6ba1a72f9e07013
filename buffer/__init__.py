"""The replay buffer: rollout actors PUT groups, learners GET top-k batches under a staleness bound.

- :mod:`buffer.selection`: pure rules (top-k inside a group, the order across groups).
- :mod:`buffer.store`: the pure core (held groups, eviction, selection, credits, bounds), no sockets;
  :mod:`buffer.intake`: its PUT side (validation, de-duplication, seqs, persist before commit).
- :mod:`buffer.segments`: the on-disk segment log (Arrow IPC stream), the consumption log, ``lineage``.
- :mod:`buffer.recovery`: rebuilding memory from the logs (``--resume``, offline replay).
- :mod:`buffer.server`: the ZeroMQ ROUTER server around the store, on a :mod:`buffer.endpoint`; its replies
  (:mod:`buffer.handlers`), its ledger of senders' credits and liveness (:mod:`buffer.clients`) and its group
  commit (:mod:`buffer.commit`);
  :mod:`buffer.assemble`: ``build_buffer``, the one builder of a server; :mod:`buffer.launch`: `distrl buffer`.
- :mod:`buffer.config`: the buffer's config section (torch-free, no pyarrow or zmq either).

The client every role speaks (:class:`distrl.core.buffer_client.BufferClient`) and the CURVE keys
(:mod:`distrl.core.security`) are in the foundation. The protocol is in docs/protocol.md, operations in
docs/buffer.md. This package never imports torch, ``rollout`` or ``learn``.
"""

import importlib

# name -> module; imported on first use (PEP 562), so that `buffer.config` (the flags of `distrl buffer`)
# parses without importing pyarrow or zmq
_EXPORTS = {"ConsumptionLog": "buffer.segments", "SegmentLog": "buffer.segments",
            "lineage": "buffer.segments", "read_consumed": "buffer.segments", "read_groups": "buffer.segments",
            "read_segments": "buffer.segments", "topk_rows": "buffer.selection", "BufferServer": "buffer.server",
            "build_buffer": "buffer.assemble",
            "BufferFull": "buffer.store", "GroupStore": "buffer.store"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'buffer' has no attribute {name!r}")
