"""`distrl buffer`: the replay buffer alone, as a plain process (multi-host runs, `distrl learn|rollout`).

It binds ``--address`` (loopback by default), writes ``<run_dir>/buffer.json`` (the bound address, its
pid and the resolved config) and serves until a SHUTDOWN request, SIGTERM or SIGINT, then closes its
logs cleanly. ``--resume <run_dir>`` restarts a stopped or killed buffer where it was.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
from pathlib import Path

from distrl.buffer.assemble import build_buffer
from distrl.buffer.config import BufferEndpoint, SelectionOptions, StorageOptions, TopkOptions
from distrl.core.heap import steady_heap
from distrl.core.join import write_join_file
from distrl.core.logs import LOG_FORMAT
from distrl.core.run_options import BatchOptions, StalenessOptions

log = logging.getLogger("distrl.buffer")


def run(batch: BatchOptions, staleness: StalenessOptions, keep: TopkOptions, selection: SelectionOptions,
        storage: StorageOptions, endpoint: BufferEndpoint) -> dict:
    """Serve the buffer of these sections (`distrl buffer`'s, distrl.cmd.launch.run_buffer) until asked to stop;
    returns its final counters."""
    run_dir = Path(endpoint.run_dir).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, force=True,
                        handlers=[logging.StreamHandler(), logging.FileHandler(run_dir / "logs" / "buffer.log")])
    steady_heap()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    sections = (batch, staleness, keep, selection, storage)
    server = build_buffer(*sections, run_dir, endpoint=endpoint, resume=endpoint.resume is not None,
                          resume_version=endpoint.resume_version, replica=endpoint.replica)
    try:
        options = {k: v for s in (endpoint, *sections) for k, v in dataclasses.asdict(s).items()}
        info = {"address": server.address, "pid": os.getpid(), "config": options}
        (run_dir / "buffer.json").write_text(json.dumps(info, indent=2))
        shape = ("batch_size", "group_size", "max_staleness")  # the rest an actor gives itself (docs/multinode.md)
        write_join_file(run_dir, {"run_dir": str(run_dir), "first_id": 0, "config": {
            "buffer_address": server.address, **{name: options[name] for name in shape}}})
        print(f"distrl buffer: serving at {server.address} (run directory {run_dir})", flush=True)
        server.serve(stop)
        stats = server.handlers.stats()
    finally:
        server.close()
    log.info("buffer stopped: %d groups put, %d held, %d duplicates dropped", stats["groups_put"],
             stats["groups"], stats["duplicates"])
    return stats
