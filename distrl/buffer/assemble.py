"""Building the buffer: one builder for every launcher (`distrl train`'s Ray role, `distrl buffer`, `distrl replay`).

:func:`build_buffer` makes the buffer's parts from its config section and run directory -- the store
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

from distrl.buffer.client_ledger import CREDIT_TIMEOUT_S
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

log = logging.getLogger(__name__)


def make_store(cfg, restamp: bool = False, bounded: bool = True) -> GroupStore:
    """The GroupStore of ``cfg`` (its batch shape, staleness, top-k, selection and memory options);
    ``bounded`` False: no memory bound (offline replay holds the whole log it replays)."""
    return GroupStore(cfg.batch_size, cfg.max_staleness, cfg.k, cfg.group_size, cfg.topk_by, cfg.order,
                      cfg.filter_zero_variance, cfg.replay_ratio, cfg.max_rows if bounded else None,
                      cfg.max_bytes if bounded else None, restamp, cfg.dedup_window, cfg.max_filtered_groups)


def build_buffer(cfg, run_dir: str | os.PathLike, *, address: str | None = None,
                 tb_dir: str | os.PathLike | None = None, resume: bool = False, resume_version: int | None = None,
                 replay_from: str | os.PathLike | None = None, restamp: bool = False,
                 poll_ms: int = 50, role: str = "distrl buffer", replica: str | None = None) -> BufferServer:
    """A BufferServer bound and ready to ``serve``, writing its logs under ``run_dir``.

    Args:
        cfg: the buffer's config section: ``batch_size``, ``max_staleness``, ``group_size``, ``k``, the
            fields of ``distrl.buffer.config.SelectionOptions`` and ``StorageOptions``, and where present
            ``address``, ``tb_dir``, ``curve_secret_key``, ``curve_client_keys`` (`distrl buffer`'s
            ``BufferConfig``, `distrl train`'s ``TrainConfig``).
        run_dir: the run directory: ``segments/`` and ``consumed.jsonl`` are written there.
        address: where to bind (default ``cfg.address``); port 0 picks a free one.
        tb_dir: TensorBoard directory (default ``cfg.tb_dir``, else ``<run_dir>/tb/buffer0``).
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
    segment log, BindError if
    the address cannot be bound, ValueError on bad options or a corrupt log.
    """
    replay = replay_from is not None
    if not resume and not replay and segment_paths(run_dir):
        raise FileExistsError(f"{run_dir} already holds a segment log: resume it (--resume {run_dir}) "
                              f"or give a new run directory")
    store = make_store(cfg, restamp, bounded=not replay)
    if not replay:  # before the ZeroMQ context starts its I/O thread
        prefault_heap(cfg.prefault_bytes if cfg.max_bytes is None else min(cfg.prefault_bytes, cfg.max_bytes))
    pa.array([0]).to_numpy()  # pyarrow imports pandas at its first to_numpy (0.2 s): not at the first PUT
    with contextlib.ExitStack() as opened:  # closes what was opened if a later step fails
        lock = RunDirLock(run_dir, role)  # one buffer per run directory; raises RunDirLocked (naming the holder)
        opened.callback(lock.release)
        mirrors = _mirrors(replica, run_dir, resume, opened)
        endpoint = Endpoint(address or cfg.address, cfg.max_msg_bytes, getattr(cfg, "curve_secret_key", None),
                            getattr(cfg, "curve_client_keys", None))
        opened.callback(endpoint.close)
        rolled_back = 0
        if resume or replay:
            source = replay_from if replay else run_dir
            restored = restore_store(store, source, use_consumed=not replay,
                                     until_version=None if replay else resume_version)
            log.info("buffer %s %s: %s", "replaying" if replay else "resumed from", source, restored)
            rolled_back = restored["rolled_back"]
        segments, consumed = _open_logs(cfg, run_dir, store, replay, mirrors, rolled_back, opened)
        metrics = Metrics(tb_dir or getattr(cfg, "tb_dir", None) or Path(run_dir) / "tb" / "buffer0")
        opened.callback(metrics.close)
        server = BufferServer(store, endpoint, consumed, segments, metrics, poll_ms,
                              credit_timeout_s=getattr(cfg, "credit_timeout_s", CREDIT_TIMEOUT_S))
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


def _open_logs(cfg, run_dir, store: GroupStore, replay: bool, mirrors: tuple | None, rolled_back: int,
               opened: contextlib.ExitStack) -> tuple:
    """The segment log (None under replay) and the consumption log, mirrored to the replica when ``mirrors``
    (which first gets what it lacks of the log here: :func:`distrl.buffer.mirrored.catch_up`)."""
    segments = None
    if mirrors is not None:
        sent = catch_up(mirrors[0], run_dir, rewritten=rolled_back > 0)
        log.info("buffer: replicating the log to %s (%d bytes caught up)", mirrors[0].address, sent)
    if not replay:
        options = (cfg.fsync, cfg.segment_max_bytes, store.groups_put, cfg.retention_bytes, cfg.retention_s,
                   cfg.group_size)
        segments = (SegmentLog(run_dir, *options) if mirrors is None
                    else MirroredSegmentLog(mirrors[0], run_dir, *options))
        opened.callback(segments.close)
    consumed = (ConsumptionLog(run_dir, cfg.fsync) if mirrors is None
                else MirroredConsumptionLog(mirrors[1], run_dir, cfg.fsync))
    opened.callback(consumed.close)
    return segments, consumed
