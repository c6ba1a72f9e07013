"""Buffer benchmark on loopback (issue 3): ingest against raw ZeroMQ and Ray, GET latency at 1M completions.

    .venv/bin/python bench/buffer.py            # about a minute on 2 cores; --quick for a smoke run

1. Ingest. The same pre-encoded PUT messages (JSON header + Arrow IPC body of ``--groups_per_put``
   groups) go from one DEALER, ``--window`` requests in flight, to (a) a raw ZeroMQ ROUTER in another
   process that only answers a tiny ACK, and (b) `distrl buffer` (``--fsync batch``: validated,
   de-duplicated, cut to top-k, written to the segment log and fsynced before the ACK). Ratio = buffer
   MB/s / raw MB/s. Each round sends ``--round_groups`` new groups to every server (a sustained stream,
   many windows long: a burst of one window would time the last commit's fsync more than the stream),
   then as many again one group a PUT; after each round a learner takes batches of 256 groups from
   each buffer until fewer are held, so that, as in a run, groups leave and their memory is reused.
   Three more raw servers show what keeping the bytes costs by itself: (c) one that holds every
   received message, (d) one that also appends each body to a file (flushed to the OS, no fsync), and
   (e) one that receives each body (``recv_into``) into a 1 GiB ring written before serving. (c) and (d)
   write memory new to the process for every byte kept, which on a VM whose host backs guest memory
   lazily is much slower than the reused buffers of (a) and (e) (see the memory probe, 4.). The buffer
   writes ``--prefault_bytes`` of heap before serving for that reason (docs/buffer.md, "Ingest").
2. Ray baseline: the same rows as Python objects (``Table.to_pylist()``, made before timing), sent to a
   Ray actor through the object store, the same number in flight. Ratio = buffer MB/s / Ray MB/s, both
   counted in Arrow bytes of the rows.
3. GET latency. The buffer is filled to 1M completions (``--fill_rows``); then a learner client times
   ``--gets`` GETs of a 256-group top-k batch (one new version each, fifo), round trip with the Arrow body
   decoded, and reports p50/p99.
4. Memory probe, before the servers start: GB/s of writing 256 MiB blocks of memory new to the bench
   process (kept), then blocks mapped right after those were freed.
5. The same buffer with ``--prefault_bytes 0``, side by side with the others (what the prefaulted
   heap gives in this run).
6. The same buffer with ``--replica`` (issue 41): every commit also written and fsynced by a replica of the log
   (``python -m distrl.buffer.replica``, another process on loopback) before its ACKs; side by side with (b)
   in every round, ``ingest_replicated_vs_unreplicated`` is the median of the rounds' ratios.

It prints a table, then one JSON object on its last line, also written to bench/results/buffer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_file import merge  # noqa: E402
from distrl.core import wire  # noqa: E402
from distrl.core.buffer_client import BufferClient  # noqa: E402
from distrl.core.rows import COMPLETION_SCHEMA  # noqa: E402


def stamp_columns(rows: int) -> dict:
    """The weight stamp columns of ``rows`` completions of one call at one version, as an actor writes them
    (distrl.weights.attest): one version, a 44-character XXH3-128 digest, one canary logprob."""
    return {"served_versions": pa.array([[3]] * rows, pa.list_(pa.int64())),
            "weights_digests": pa.array([["xxh3_128:" + "5e" * 16]] * rows, pa.list_(pa.string())),
            "canary_logprobs": pa.array([[-3.912345]] * rows, pa.list_(pa.float64()))}


def make_groups(n_groups: int, group_size: int, completion_len: int, prompt_len: int, tag: str) -> list[pa.Table]:
    """``n_groups`` valid groups with random rewards, built column-wise (fast) and sliced per group."""
    rng = np.random.default_rng(0)
    rows = n_groups * group_size
    def lists(length, values):  # (rows, length) -> list<...> column
        offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * length)
        return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1)))
    group_ids = np.repeat(np.arange(n_groups), group_size)
    rewards = rng.integers(0, 2, rows).astype(np.float32)
    cols = {
        "sample_id": pa.array([f"{tag}{g}/{i}" for g in range(n_groups) for i in range(group_size)]),
        "group_id": pa.array([f"{tag}{g}" for g in group_ids]), "prompt_id": pa.array([f"p{g}" for g in group_ids]),
        "actor_id": pa.array(np.zeros(rows, np.int32)), "policy_version": pa.array(np.zeros(rows, np.int64)),
        "last_policy_version": pa.array(np.zeros(rows, np.int64)),
        "prompt_ids": lists(prompt_len, rng.integers(0, 150_000, rows * prompt_len, dtype=np.int32)),
        "completion_ids": lists(completion_len, rng.integers(0, 150_000, rows * completion_len, dtype=np.int32)),
        "behavior_logprobs": lists(completion_len, -rng.random(rows * completion_len, dtype=np.float32)),
        "temperature": pa.array(np.ones(rows, np.float32)), "reward": pa.array(rewards),
        "reward_components": pa.array([[("correct", float(r))] for r in rewards], pa.map_(pa.string(), pa.float32())),
        "advantage": pa.array(rewards - rewards.mean(), pa.float32()), "finish_reason": pa.array(["stop"] * rows),
        "prompt_text": pa.array(["What is 1+1?"] * rows), "completion_text": pa.array(["The answer is 2."] * rows),
        "gen_start_time": pa.array(np.full(rows, time.time())), "gen_seconds": pa.array(np.full(rows, 0.5)),
        **stamp_columns(rows),
    }
    table = pa.Table.from_pydict({**dict.fromkeys(COMPLETION_SCHEMA.names, [None] * rows), **cols},
                              schema=COMPLETION_SCHEMA).combine_chunks()
    return [table.slice(g * group_size, group_size) for g in range(n_groups)]


def encode_puts(groups: list[pa.Table], per_put: int = 1) -> tuple[list[list[bytes]], int]:
    """(the PUT messages, ``per_put`` whole groups each, and their total body bytes)."""
    bodies = [pa.concat_tables(groups[i:i + per_put]).combine_chunks() for i in range(0, len(groups), per_put)]
    frames = [wire.encode(wire.MsgType.PUT, "bench", i + 1, body=b) for i, b in enumerate(bodies)]
    return frames, sum(len(f[1]) for f in frames)


RAW_MODES = ("plain", "hold", "hold_write", "ring")
RING_BYTES = 1 << 30


def raw_server(port: int, mode: str = "plain", log_path: str | None = None) -> None:
    """A ROUTER that answers every message with a tiny ACK (the baselines' server process). ``hold``
    keeps every received message; ``hold_write`` also appends its body to ``log_path`` (flushed);
    ``ring`` receives each body (``recv_into``) into a ring of RING_BYTES touched before serving."""
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    ack = wire.encode(wire.MsgType.ACK, "raw", 0, seq_no=0, duplicate=False)
    if mode == "ring":
        ring_server(sock, ack)
    held, out = [], open(log_path, "wb") if mode == "hold_write" else None
    while True:
        msg = sock.recv_multipart(copy=mode == "plain")
        if mode != "plain":
            held.append(msg)
            if out is not None:
                out.write(msg[-1].buffer)
                out.flush()
        sock.send_multipart([msg[0], *ack])


RING_SLACK = 16 << 20  # the ring wraps when less than this is left; a larger body is an error


def ring_server(sock: zmq.Socket, ack: list[bytes]) -> None:
    """:func:`raw_server`'s ``ring`` mode: each body is copied by ZeroMQ (``recv_into``) into memory
    written before serving and reused (64-byte aligned, wrapping when less than RING_SLACK is left).
    Raises RuntimeError on a message that is not (identity, header, body) or a body over RING_SLACK."""
    ring = memoryview(np.ones(RING_BYTES, np.uint8))
    identity, header, pos = bytearray(256), bytearray(64 << 10), 0
    while True:
        n = sock.recv_into(identity)
        sock.recv_into(header)
        if pos > RING_BYTES - RING_SLACK:
            pos = 0
        size = sock.recv_into(ring[pos:pos + RING_SLACK])
        if size > RING_SLACK or sock.rcvmore or n > len(identity):
            raise RuntimeError(f"ring server: unexpected message (body {size} bytes, more frames {sock.rcvmore})")
        pos += (size + 63) & ~63
        sock.send_multipart([bytes(identity[:n]), *ack])


def memory_probe(blocks: int = 2, block: int = 256 * 2**20) -> dict[str, float]:
    """GB/s of filling ``blocks`` new blocks of memory (kept, so each is new to the process), then of
    filling blocks of the same size right after freeing those (each block is its own mapping: the second
    rate is of pages the kernel just got back, which on a lazily backed VM are still backed)."""
    def fill() -> tuple[np.ndarray, float]:
        t0 = time.perf_counter()
        a = np.ones(block, np.uint8)
        return a, block / (time.perf_counter() - t0) / 1e9
    kept, fresh = zip(*(fill() for _ in range(blocks)))
    del kept
    recycled = [fill()[1] for _ in range(blocks)]
    return {"fresh_memory_gb_s": float(np.median(fresh)), "recycled_memory_gb_s": float(np.median(recycled))}


def pump(address: str, messages: list[list[bytes]], window: int) -> float:
    """Send every message with ``window`` in flight, wait for every reply; returns seconds."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    t0, sent, got = time.perf_counter(), 0, 0
    while got < len(messages):
        while sent < len(messages) and sent - got < window:
            sock.send_multipart(messages[sent], copy=False)
            sent += 1
        reply = sock.recv_multipart()
        if reply[0].startswith(b'{"type":"ERROR"'):
            raise RuntimeError(f"server refused a PUT: {reply[0][:300]!r}")
        got += 1
    elapsed = time.perf_counter() - t0
    sock.close()
    ctx.term()
    return elapsed


def ray_ingest(groups: list[pa.Table], window: int) -> float:
    """Seconds to send the groups' rows as Python objects to a Ray actor, ``window`` calls in flight."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=512 * 2**20)
    try:
        @ray.remote
        class Sink:
            def __init__(self):
                self.rows = []

            def put(self, rows):
                self.rows.extend(rows)
                return len(self.rows)

        sink = Sink.remote()
        ray.get(sink.put.remote([]))  # the actor is up before timing
        payloads = [g.to_pylist() for g in groups]
        t0, pending = time.perf_counter(), []
        for rows in payloads:
            pending.append(sink.put.remote(rows))
            if len(pending) >= window:
                ray.get(pending.pop(0))
        ray.get(pending)
        return time.perf_counter() - t0
    finally:
        ray.shutdown()


def start(args: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if "--raw-server" not in args:
        while "serving at" not in (line := proc.stdout.readline()):
            assert line, "distrl buffer did not start"
    else:
        time.sleep(0.5)
    return proc


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of a process's threads, by role: ``main`` (the serving loop),
    ``zmq_io`` (ZeroMQ's I/O threads) and ``other`` (the buffer's commit thread, TensorBoard's writer);
    empty where /proc is not there."""
    out = {"main": 0.0, "zmq_io": 0.0, "other": 0.0}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # a thread that just ended
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        role = "main" if int(tid) == pid else "zmq_io" if name.startswith("ZMQbg/IO") else "other"
        out[role] += (int(rest[11]) + int(rest[12])) / tick  # utime, stime
    return out


def pump_profiled(address: str, messages: list[list[bytes]], window: int, pid: int) -> tuple[float, dict]:
    """:func:`pump`, and the server's CPU microseconds per message by thread role (:func:`thread_cpu`)."""
    before = thread_cpu(pid)
    seconds = pump(address, messages, window)
    after = thread_cpu(pid)
    return seconds, {k: (after[k] - before[k]) / len(messages) * 1e6 for k in before}


def drain(address: str, version: int) -> int:
    """A learner takes batches of 256 groups (versions ``version``, ``version + 1``, ...) until fewer are
    held, so that the groups leave memory as in a run; returns the next version."""
    with BufferClient(address, "drain", timeout_s=60.0) as c:
        while c.stats()["groups"] >= 256:
            c.get(version, timeout_s=30)
            version += 1
    return version


def get_latencies(address: str, gets: int, first_version: int) -> np.ndarray:
    """Milliseconds per GET (one new version each, from ``first_version``), round trip with the body
    decoded."""
    with BufferClient(address, "learner0", timeout_s=60.0) as c:
        out = []
        for v in range(first_version, first_version + gets):
            t0 = time.perf_counter()
            batch = c.get(v, timeout_s=30)
            out.append((time.perf_counter() - t0) * 1e3)
            assert batch.num_rows == 256 * 4
        c.shutdown()
    return np.array(out)


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--window", type=int, default=256, help="PUTs in flight (one client, standing for many actors)")
    p.add_argument("--groups_per_put", type=int, default=8, help="groups per PUT message (an actor's generate call)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved raw/buffer rounds (medians are reported)")
    p.add_argument("--round_groups", type=int, default=3200,
                   help="groups a round sends to each server with --groups_per_put a PUT, and as many one a PUT")
    p.add_argument("--fill_rows", type=int, default=1_000_000, help="completions sent before timing GETs")
    p.add_argument("--gets", type=int, default=200)
    p.add_argument("--no_ray", action="store_true", help="skip the Ray baseline (a machine without Ray)")
    p.add_argument("--raw-server", type=int, help=argparse.SUPPRESS)
    p.add_argument("--raw-mode", choices=RAW_MODES, default="plain", help=argparse.SUPPRESS)
    p.add_argument("--raw-log", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.raw_server:
        raw_server(a.raw_server, a.raw_mode, a.raw_log)
        return {}
    if a.quick:
        a.fill_rows, a.gets, a.rounds, a.round_groups = 60_000, 10, 1, 400
    n, k = 16, 4
    results = run_all(a, n, k)
    report(results, n)
    return results


def buffer_process(port: int, run_dir: str, n: int, k: int, fsync: str, *extra: str) -> subprocess.Popen:
    return start([sys.executable, "-m", "distrl", "buffer", "--address", f"tcp://127.0.0.1:{port}", "--run_dir",
                  run_dir, "--batch_size", "256", "--group_size", str(n), "--topk", str(k), "--max_staleness",
                  "1000000", "--fsync", fsync, "--max_rows", "4000000", "--max_bytes", str(16 * 2**30), *extra])


def run_all(a, n: int, k: int) -> dict:
    """Every measurement of the module docstring; returns seconds, bytes and latencies."""
    probe = memory_probe()  # before the servers take memory
    ports = [free_port() for _ in range(9)]
    tmp = tempfile.mkdtemp(prefix="distrl-bench-")
    raw_args = [sys.executable, __file__, "--raw-server"]
    procs = [start([*raw_args, str(ports[0])]),
             buffer_process(ports[1], f"{tmp}/batch", n, k, "batch"),
             buffer_process(ports[2], f"{tmp}/never", n, k, "never"),
             start([*raw_args, str(ports[3]), "--raw-mode", "hold"]),
             start([*raw_args, str(ports[4]), "--raw-mode", "hold_write", "--raw-log", f"{tmp}/raw.log"]),
             start([*raw_args, str(ports[5]), "--raw-mode", "ring"]),
             buffer_process(ports[6], f"{tmp}/cold", n, k, "batch", "--prefault_bytes", "0"),
             start([sys.executable, "-m", "distrl.buffer.replica", f"{tmp}/replica", "--address",
                    f"tcp://127.0.0.1:{ports[8]}"]),  # the replica of the next buffer's log (issue 41)
             buffer_process(ports[7], f"{tmp}/replicated", n, k, "batch", "--replica", f"tcp://127.0.0.1:{ports[8]}")]
    raw, buf, nosync, hold, hold_write, ring, cold, replicated = (f"tcp://127.0.0.1:{p}" for p in ports[:8])
    versions = dict.fromkeys((buf, nosync, cold, replicated), 0)  # each buffer's next learner version
    r = {"window": a.window, "rounds": a.rounds, "n": n, "k": k, "per_put": a.groups_per_put, "raw": [], "buffer": [],
         "never": [], "raw_hold": [], "raw_hold_write": [], "raw_ring": [], "cold": [], "raw_single": [],
         "buffer_single": [], "cpu_raw": [], "replicated": [],
         "cpu_buffer": [], **probe}
    pids = {"raw": procs[0].pid, "buffer": procs[1].pid}
    try:
        # warm up (first Arrow calls import lazily): not timed
        for address in (raw, buf, nosync, hold, hold_write, ring, cold, replicated):
            pump(address, encode_puts(make_groups(8, n, 16, 16, f"warm{address}"))[0], 4)
        for i in range(a.rounds):  # interleaved, so that load from other processes hits every path alike
            groups = make_groups(2 * a.round_groups, n, completion_len=256, prompt_len=128, tag=f"r{i}-")
            msgs, nbytes = encode_puts(groups[:a.round_groups], a.groups_per_put)
            single, single_bytes = encode_puts(groups[a.round_groups:], 1)
            del groups
            for key, address in (("raw", raw), ("buffer", buf), ("never", nosync), ("raw_hold", hold),
                                 ("raw_hold_write", hold_write), ("raw_ring", ring), ("cold", cold),
                                 ("replicated", replicated)):
                r[key].append(nbytes / pump(address, msgs, a.window))
            for key, address in (("raw_single", raw), ("buffer_single", buf)):
                r[key].append(single_bytes / pump(address, single, a.window))
            r["big_rows"], r["big_bytes"] = a.round_groups * n, nbytes
            del msgs, single
            for address in versions:  # learners consume between rounds: memory is reused, as in a run
                versions[address] = drain(address, versions[address])
        r["prof_groups"] = 500 if a.quick else 4000
        prof = make_groups(r["prof_groups"], n, completion_len=256, prompt_len=128, tag="prof")
        prof_msgs = encode_puts(prof, a.groups_per_put)[0]  # long enough for the 10 ms CPU clock ticks
        for key, address in (("raw", raw), ("buffer", buf)):
            r[f"cpu_{key}"].append(pump_profiled(address, prof_msgs, a.window, pids[key])[1])
        del prof, prof_msgs
        versions[buf] = drain(buf, versions[buf])
        with BufferClient(buf, "bench") as c:
            held = c.stats()["rows"]
        small = make_groups(max(256, (a.fill_rows - held) // n), n, completion_len=16, prompt_len=16, tag="small")
        small_msgs, r["small_bytes"] = encode_puts(small, a.groups_per_put)
        r["raw_small"] = r["small_bytes"] / pump(raw, small_msgs, a.window)
        r["buffer_small"] = r["small_bytes"] / pump(buf, small_msgs, a.window)
        with BufferClient(buf, "bench") as c:
            r["put_rows"], r["held_rows"] = c.stats()["groups_put"] * n, c.stats()["rows"]
        lat = get_latencies(buf, min(a.gets, r["held_rows"] // n // 256), versions[buf])
        r["get_p50_ms"], r["get_p99_ms"] = float(np.percentile(lat, 50)), float(np.percentile(lat, 99))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    ray_groups = make_groups(400, n, completion_len=256, prompt_len=128, tag="ray")
    r["ray"] = None if a.no_ray else encode_puts(ray_groups, 1)[1] / ray_ingest(ray_groups, a.window)
    return r


def report(r: dict, n: int) -> None:
    """Print the table and the JSON line; write bench/results/buffer.json."""
    med = {key: float(np.median(r[key])) for key in ("raw", "buffer", "never", "raw_hold", "raw_hold_write",
                                                     "raw_ring", "cold", "raw_single", "buffer_single",
                                                     "replicated")}
    ratio = float(np.median(np.array(r["buffer"]) / np.array(r["raw"])))
    ratio_single = float(np.median(np.array(r["buffer_single"]) / np.array(r["raw_single"])))
    ratio_cold = float(np.median(np.array(r["cold"]) / np.array(r["raw"])))
    ratio_replicated = float(np.median(np.array(r["replicated"]) / np.array(r["buffer"])))  # same round, side by side
    row_bytes = r["big_bytes"] / r["big_rows"]
    per = r["per_put"]
    lines = [(f"raw ZeroMQ, {per} groups a message", med["raw"], 1.0),
             (f"buffer --fsync batch, {per} groups a PUT", med["buffer"], ratio),
             (f"buffer --fsync never, {per} groups a PUT", med["never"], med["never"] / med["raw"]),
             ("buffer --fsync batch --prefault_bytes 0", med["cold"], ratio_cold),
             ("buffer --fsync batch --replica (loopback)", med["replicated"], med["replicated"] / med["raw"]),
             ("raw ZeroMQ holding every message", med["raw_hold"], med["raw_hold"] / med["raw"]),
             ("raw ZeroMQ holding + appending to a file", med["raw_hold_write"], med["raw_hold_write"] / med["raw"]),
             ("raw ZeroMQ into a pre-touched 1 GiB ring", med["raw_ring"], med["raw_ring"] / med["raw"]),
             ("raw ZeroMQ, 1 group a message", med["raw_single"], 1.0),
             ("buffer --fsync batch, 1 group a PUT", med["buffer_single"], ratio_single),
             ("Ray actor, rows as Python objects", r["ray"], r["ray"] / med["raw_single"] if r["ray"] else None)]
    print(f"\ningest on loopback: one client with {r['window']} PUTs in flight; groups of {n} completions of 256 "
          f"tokens ({row_bytes / 1e3:.1f} kB a row); median of {r['rounds']} interleaved rounds of "
          f"{r['big_rows'] // n:,} groups ({r['big_bytes'] / 1e6:.0f} MB) a path")
    print(f"{'path':40s} {'MB/s':>9s} {'rows/s':>10s} {'vs raw':>7s}")
    for name, mbs, vs in lines:
        if mbs is None:
            print(f"{name:40s} {'not run':>9s}")
            continue
        print(f"{name:40s} {mbs / 1e6:9.1f} {mbs / row_bytes:10.0f} {vs:7.2f}")
    print(f"{'raw ZeroMQ, 16-token groups':40s} {r['raw_small'] / 1e6:9.1f}")
    print(f"{'buffer, 16-token groups (the 1M fill)':40s} {r['buffer_small'] / 1e6:9.1f} {'':10s} "
          f"{r['buffer_small'] / r['raw_small']:7.2f}")
    cpu = {key: {role: float(np.median([c[role] for c in r[f"cpu_{key}"]])) for role in r[f"cpu_{key}"][0]}
           for key in ("raw", "buffer") if r[f"cpu_{key}"] and r[f"cpu_{key}"][0]}
    if cpu:
        print(f"\nserver CPU per {per}-group message, microseconds (user + system, medians): "
              + "; ".join(f"{key}: " + ", ".join(f"{role} {us:.0f}" for role, us in c.items())
                          for key, c in cpu.items()))
        print(f"(one extra pass of {r['prof_groups']} groups to each server, its time not counted above)")
    print(f"\nbuffer --fsync batch vs raw ZeroMQ holding + appending to a file (the same bytes kept and logged): "
          f"{med['buffer'] / med['raw_hold_write']:.2f}")
    print(f"buffer with a replica of its log vs without (median of the rounds' ratios): {ratio_replicated:.2f}")
    print(f"memory probe: filling memory new to this process {r['fresh_memory_gb_s']:.2f} GB/s, memory just freed "
          f"{r['recycled_memory_gb_s']:.2f} GB/s (a retaining server pays the first rate for every byte it keeps)")
    print(f"\nGET of 256 groups, top-{r['k']} ({256 * r['k']} rows), fifo, from a buffer sent {r['put_rows']:,} "
          f"completions (holding {r['held_rows']:,}): p50 {r['get_p50_ms']:.2f} ms, p99 {r['get_p99_ms']:.2f} ms")
    out = {"ingest_vs_raw_zmq": round(ratio, 3), "get_p50_ms": round(r["get_p50_ms"], 3),
           "get_p99_ms": round(r["get_p99_ms"], 3), "ingest_mb_s": round(med["buffer"] / 1e6, 1),
           "ray_baseline_ratio": round(med["buffer"] / r["ray"], 2) if r["ray"] else None,
           "ingest_rows_s": round(med["buffer"] / row_bytes),
           "groups_per_put": per, "raw_zmq_mb_s": round(med["raw"] / 1e6, 1),
           "ingest_vs_raw_zmq_one_group_per_put": round(ratio_single, 3),
           "ingest_mb_s_one_group_per_put": round(med["buffer_single"] / 1e6, 1),
           "ingest_mb_s_fsync_never": round(med["never"] / 1e6, 1),
           "raw_zmq_holding_mb_s": round(med["raw_hold"] / 1e6, 1),
           "raw_zmq_holding_writing_mb_s": round(med["raw_hold_write"] / 1e6, 1),
           "raw_zmq_ring_mb_s": round(med["raw_ring"] / 1e6, 1),
           "ingest_mb_s_no_prefault": round(med["cold"] / 1e6, 1),
           "ingest_vs_raw_zmq_no_prefault": round(ratio_cold, 3),
           "ingest_vs_raw_zmq_holding_writing": round(med["buffer"] / med["raw_hold_write"], 3),
           "fresh_memory_gb_s": round(r["fresh_memory_gb_s"], 2),
           "recycled_memory_gb_s": round(r["recycled_memory_gb_s"], 2),
           "ingest_vs_raw_zmq_16_token_groups": round(r["buffer_small"] / r["raw_small"], 3),
           "completions_held_at_get": r["held_rows"], "window": r["window"],
           "server_cpu_us_per_put": {key: {role: round(us) for role, us in c.items()} for key, c in cpu.items()},
           "ingest_mb_s_replicated": round(med["replicated"] / 1e6, 1),
           "ingest_replicated_vs_unreplicated": round(ratio_replicated, 3),
           "machine": f"{os.cpu_count()} cores"}
    merge(ROOT / "bench" / "results" / "buffer.json", out, indent=2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
