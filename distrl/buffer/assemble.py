"""Building the buffer: one builder for every launcher (`distrl train`'s Ray role, `distrl buffer`, `distrl replay`).

:func:`build_buffer` makes the buffer's parts from its config sections (its own, distrl/buffer/config.py, and the
foundation's batch and staleness sections) and run directory -- the store
(:class:`distrl.buffer.store.GroupStore`, rebuilt from the logs on resume or replay), the endpoint
(:class:`distrl.buffer.endpoint.Endpoint`), the segment and consumption logs and the metrics writer -- and
hands them to :class:`distrl.buffer.server.BufferServer`, whose ``close`` closes them all (logs flushed,
socket closed). If building fails midway, what was opened is closed before the error propagates.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import pyarrow as pa

from distrl.buffer.config import BufferEndpoint, SelectionOptions, StorageOptions, TopkOptions
from distrl.buffer.endpoint import Endpoint
from distrl.buffer.lock import RunDirLock
from distrl.buffer.memory import prefault_heap
from distrl.buffer.mirrored import MirroredConsumptionLog, MirroredSegmentLog, catch_up, fetch
from distrl.buffer.recovery import restore_store
from distrl.buffer.replica import Mirror
from distrl.buffer.segments import ConsumptionLog, SegmentLog, segment_paths
from distrl.buffer.server import BufferServer
from distrl.buffer.store import GroupStore
from distrl.core.metrics import Metrics
from distrl.core.run_options import BatchOptions, StalenessOptions

log = logging.getLogger(__name__)


def make_store(batch: BatchOptions, staleness: StalenessOptions, keep: TopkOptions, selection: SelectionOptions,
               storage: StorageOptions, restamp: bool = False, bounded: bool = True) -> GroupStore:
    """The GroupStore of these sections (batch shape, staleness, top-k, selection and memory options);
    ``bounded`` False: no memory bound (offline replay holds the whole log it replays). With
    ``--max_staleness auto`` the store starts at the bound's initial value (0) and the learners announce it."""
    bound = staleness.bound
    store = GroupStore(batch.batch_size, bound.initial, keep.topk or batch.group_size, batch.group_size,
                       selection.topk_by, selection.order, selection.filter_zero_variance, selection.replay_ratio,
                       storage.max_rows if bounded else None, storage.max_bytes if bounded else None, restamp,
                       storage.dedup_window, selection.max_filtered_groups, selection.bias_slack)
    store.bound_moves = bound.auto
    return store


def build_buffer(batch: BatchOptions, staleness: StalenessOptions, keep: TopkOptions, selection: SelectionOptions,
                 storage: StorageOptions, run_dir: str | os.PathLike, *, endpoint: BufferEndpoint | None = None,
                 address: str | None = None, tb_dir: str | os.PathLike | None = None, resume: bool = False,
                 resume_version: int | None = None, replay_from: str | os.PathLike | None = None,
                 restamp: bool = False, poll_ms: int = 50, role: str = "distrl buffer",
                 replica: str | None = None) -> BufferServer:
    """A BufferServer bound and ready to ``serve``, writing its logs under ``run_dir``.

    Args:
        batch, staleness: the foundation's sections it reads (batch and group size, --max_staleness).
        keep, selection, storage: the buffer's own sections (distrl/buffer/config.py).
        endpoint: `distrl buffer`'s own section (its address, CURVE server keys, TensorBoard directory); None:
            loopback, no CURVE (`distrl train`'s and `distrl replay`'s buffer, which pass ``address``).
        run_dir: the run directory: ``segments/`` and ``consumed.jsonl`` are written there.
        address: where to bind (default ``endpoint.address``); port 0 picks a free one.
        tb_dir: TensorBoard directory (default ``endpoint.tb_dir``, else ``<run_dir>/tb/buffer0``).
        resume: rebuild memory from ``run_dir``'s logs (:mod:`distrl.buffer.recovery`); ``resume_version``: the
            version the learners resume from (their checkpoint), later selections are rolled back.
        replay_from: offline replay of the log in this directory (no PUT, no memory bound); ``restamp``:
            its staleness model.
        poll_ms: the serving loop's poll timeout in milliseconds (how fast ``stop`` is noticed).
        role: who holds the run directory's lock (:mod:`distrl.buffer.lock`), as a refused second buffer names it.
        replica: the address of a replica of the log (:mod:`distrl.buffer.replica`): every segment and consumption
            record is in it before its ACK or BATCH; a resume without a log here fetches the replica's first.
    Raises FileExistsError if a fresh buffer's run directory already holds segments, RunDirLocked (a
    FileExistsError) if another process serves a buffer there, FileNotFoundError if ``resume`` finds no
    segment log, BindError if the address cannot be bound, ValueError on bad options or a corrupt log.
    """
    replay = replay_from is not None
    if not resume and not replay and segment_paths(run_dir):
        raise FileExistsError(f"{run_dir} already holds a segment log: resume it (--resume {run_dir}) "
                              f"or give a new run directory")
    store = make_store(batch, staleness, keep, selection, storage, restamp, bounded=not replay)
    endpoint = endpoint or BufferEndpoint(run_dir=str(run_dir))
    if not replay:  # before the ZeroMQ context starts its I/O thread
        prefault_heap(min(storage.prefault_bytes, storage.max_bytes))
    pa.array([0]).to_numpy()  # pyarrow imports pandas at its first to_numpy (0.2 s): not at the first PUT
    with contextlib.ExitStack() as opened:  # closes what was opened if a later step fails
        lock = RunDirLock(run_dir, role)  # one buffer per run directory; raises RunDirLocked (naming the holder)
        opened.callback(lock.release)
        mirrors = _mirrors(replica, run_dir, resume, opened)
        bound = Endpoint(address or endpoint.address, storage.max_msg_bytes, endpoint.curve_secret_key,
                         endpoint.curve_client_keys)
        opened.callback(bound.close)
        rolled_back = 0
        if resume or replay:
            source = replay_from if replay else run_dir
            restored = restore_store(store, source, use_consumed=not replay,
                                     until_version=None if replay else resume_version)
            log.info("buffer %s %s: %s", "replaying" if replay else "resumed from", source, restored)
            rolled_back = restored["rolled_back"]
        segments, consumed = _open_logs(storage, batch.group_size, run_dir, store, replay, mirrors, rolled_back,
                                        opened)
        metrics = Metrics(tb_dir or endpoint.tb_dir or Path(run_dir) / "tb" / "buffer0")
        opened.callback(metrics.close)
        server = BufferServer(store, bound, consumed, segments, metrics, poll_ms,
                              credit_timeout_s=selection.credit_timeout_s)
        server.lock = lock
        opened.pop_all()
    return server


def _mirrors(replica: str | None, run_dir, resume: bool, opened: contextlib.ExitStack) -> tuple | None:
    """With a ``replica`` address: two Mirrors to it (the commit thread's, the serving loop's), after fetching
    the replica's log into ``run_dir`` when a resume finds none here (this node lost it). Raises
    FileNotFoundError when a resume finds no log here (nor in the replica): never an empty start."""
    mirrors = None
    if replica is not None:
        mirrors = (Mirror(replica), Mirror(replica))
        for mirror in mirrors:
            opened.callback(mirror.close)
        if resume and not segment_paths(run_dir):
            fetch(mirrors[0], run_dir)
    if resume and not segment_paths(run_dir):  # an empty start would drop every acknowledged group
        where = f" nor in the replica at {replica}" if replica else ""
        raise FileNotFoundError(f"{run_dir}: no segment log to resume from here{where} (segments/segment-*.arrow): "
                                f"give the run directory where the buffer ran")
    return mirrors


def _open_logs(storage: StorageOptions, group_size: int, run_dir, store: GroupStore, replay: bool,
               mirrors: tuple | None, rolled_back: int, opened: contextlib.ExitStack) -> tuple:
    """The segment log (None under replay) and the consumption log, mirrored to the replica when ``mirrors``
    (which first gets what it lacks of the log here: :func:`distrl.buffer.mirrored.catch_up`)."""
    segments = None
    if mirrors is not None:
        sent = catch_up(mirrors[0], run_dir, rewritten=rolled_back > 0)
        log.info("buffer: replicating the log to %s (%d bytes caught up)", mirrors[0].address, sent)
    if not replay:
        options = (storage.fsync, storage.segment_max_bytes, store.groups_put, storage.retention_bytes,
                   storage.retention_s, group_size)
        segments = (SegmentLog(run_dir, *options) if mirrors is None
                    else MirroredSegmentLog(mirrors[0], run_dir, *options))
        opened.callback(segments.close)
    consumed = (ConsumptionLog(run_dir, storage.fsync) if mirrors is None
                else MirroredConsumptionLog(mirrors[1], run_dir, storage.fsync))
    opened.callback(consumed.close)
    return segments, consumed
