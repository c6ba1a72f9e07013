"""The replay buffer: rollout actors PUT groups, learners GET top-k batches under a staleness bound.

Modules (under ``distrl.buffer``):

- :mod:`.selection`: pure rules (top-k inside a group, the order across groups).
- :mod:`.store`: the pure core (held groups, eviction, selection, credits, bounds), no sockets;
  :mod:`.intake`: its PUT side, owned by the store (validation, de-duplication, seqs, persist before commit).
- :mod:`.segments`: the on-disk segment log (Arrow IPC stream), the consumption log, ``lineage``.
- :mod:`.recovery`: rebuilding memory from the logs (``--resume``, offline replay).
- :mod:`.server`: the ZeroMQ ROUTER server around the store, on a :mod:`.endpoint`; its replies
  (:mod:`.handlers`), its ledger of senders' credits and liveness (:mod:`.clients`) and its group
  commit (:mod:`.commit`); :mod:`.assemble`: ``build_buffer``, the one builder of a server; :mod:`.launch`:
  `distrl buffer`.
- :mod:`.config`: the buffer's config section (torch-free, no pyarrow or zmq either).

The client every role speaks (:class:`distrl.core.buffer_client.BufferClient`) and the CURVE keys
(:mod:`distrl.core.security`) are in the foundation. The protocol is in docs/protocol.md, operations in
docs/buffer.md. This package never imports torch, ``distrl.rollout`` or ``distrl.learn``.
"""

import importlib

# name -> module of this package; imported on first use (PEP 562), so that `distrl.buffer.config` (the flags of
# `distrl buffer`) parses without importing pyarrow or zmq
_EXPORTS = {"ConsumptionLog": "segments", "SegmentLog": "segments", "lineage": "segments",
            "read_consumed": "segments", "read_groups": "segments", "read_segments": "segments",
            "topk_rows": "selection", "BufferServer": "server", "build_buffer": "assemble",
            "BufferFull": "store", "GroupStore": "store"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
