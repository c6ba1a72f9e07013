"""Many actors on one buffer (issue 21): 64 simulated actors PUT to one `distrl buffer` while a learner GETs.

    .venv/bin/python bench/many_actors.py                 # 10 s warm-up + 60 s steady state
    .venv/bin/python bench/many_actors.py --seconds 3 --warmup_s 1   # a smoke run (the CI test)

- Buffer: its own process, started as `distrl buffer` starts (``python -m distrl buffer``) with the default
  durability (``--fsync batch``: a group's ACK follows the fsync of its group commit) and ``--batch_size
  64 --group_size 8 --max_staleness 2``; it writes real segments to a temporary run directory (deleted).
- Actors: ``--actors`` (64) DEALER sockets, one client each (sender ``actorNN``), hosted by
  ``--actor_procs`` (2) processes, each driving its share from one thread with a ``zmq.Poller``. An actor
  asks CREDIT for twice its credits (``2 * batch_size // actors`` = 2, as ``distrl.rollout.actor`` asks
  ``batch_size // actors``), PUTs what it was granted in one message (as ``BufferClient.put_many``), waits
  for the ACK and asks again. Its CREDIT carries ``wait_s`` (``--credit_wait_s``, 0.05 s: the real
  actor's pause): the buffer holds it while nothing can be granted. ``--credit_wait_s 0 --idle_s 0.05``
  is the actor that polls instead (for a buffer without ``wait_s``). Bodies: Arrow IPC streams of the
  real completion schema (8 completions x 256 completion + 128 prompt tokens, logprobs, rewards, texts,
  weight stamps), built ahead of time per actor; before a send only the fixed-width ids and the policy
  version (the grant's learner version) are written into their bytes.
- Learner: the real :class:`distrl.core.buffer_client.BufferClient` GETs version v, then v + 1, ..., as
  ``distrl.learn.learner.Learner.run`` does, so the rule releases the next 64 credits. GET ms: the round trip
  of the request that got the batch (body decoded) less the time the buffer held it waiting for groups.
- The rule (AReaL's): granted - refunded <= (learner_version + max_staleness + 1) * batch_size. A monitor
  asks STATS every 0.1 s and counts the groups accepted beyond it (groups_put - refunded - bound > 0);
  the buffer's own ``credit_violations`` counter is read too, and the learner counts rows handed out
  with staleness > max_staleness.

Reported for the steady window: groups/s the buffer accepted (STATS ``groups_put``), groups/s the learner
took, GET p50/p99, violations, CPU per group of each buffer thread. The last line is one JSON object,
also written to bench/results/many_actors.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.buffer import free_port, thread_cpu  # noqa: E402
from bench.results_file import merge  # noqa: E402
from bench.sim_actors import Body, actor_host, go, group_template  # noqa: E402
from distrl.core.buffer_client import BufferClient  # noqa: E402


def learner(address: str, max_staleness: int, poll_s: float) -> dict:
    """GET version v, then v + 1, ... from the go line until its deadline (:func:`go`), with the real client
    as ``distrl.learn.learner.Learner.run`` does (``get(version)``, no ``on_wait``: the buffer holds the GET until
    the batch can be made); returns ``(monotonic end, GET ms, ms the buffer held it)`` per GET, versions,
    rows and rows too stale. GET ms is the round trip less the time held: what the buffer and the
    sockets took under the load."""
    gets, version, rows, stale = [], 0, 0, 0
    with BufferClient(address, "learner0", timeout_s=30.0) as client:
        deadline = go()
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            table = client.get(version, poll_s=poll_s, timeout_s=60.0)
            end = time.monotonic()
            held = getattr(client, "last_get_held_s", 0.0)  # 0: a client from before held GETs
            gets.append((end, (end - t0 - held) * 1e3, held * 1e3))
            versions = table.column("policy_version").to_numpy()
            stale += int(((version - versions) > max_staleness).sum())
            rows += table.num_rows
            version += 1  # the learner's optimizer step makes the next version
    return {"gets": gets, "versions": version, "rows": rows, "stale_rows": stale}


def child(role: str, a: argparse.Namespace, *extra: str) -> subprocess.Popen:
    """Start this script as an actor host or the learner (``role``); it says ready once set up."""
    args = [sys.executable, __file__, "--_role", role, "--_address", a._address, "--idle_s", str(a.idle_s),
            "--credit_wait_s", str(a.credit_wait_s),
            "--completion_len", str(a.completion_len), "--prompt_len", str(a.prompt_len), *extra]
    return subprocess.Popen(args, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


PROFILED = """import cProfile, runpy, sys, time
prof = cProfile.Profile(time.thread_time)  # CPU time of the serving thread: the machine is shared
sys.argv[0] = "distrl"
prof.enable()
try:
    runpy.run_module("distrl", run_name="__main__")
except SystemExit:
    pass
prof.disable()
prof.dump_stats({out!r})
"""


def start_buffer(a: argparse.Namespace, run_dir: str) -> subprocess.Popen:
    """`distrl buffer` in its own process, default storage options; returns once it serves."""
    launch = ["-c", PROFILED.format(out=a.profile)] if a.profile else ["-m", "distrl"]
    proc = subprocess.Popen([sys.executable, *launch, "buffer", "--address", a._address,
                             "--run_dir", run_dir, "--batch_size", str(a.batch_size), "--group_size", str(GROUP_SIZE),
                             "--max_staleness", str(a.max_staleness), "--fsync", a.fsync],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    while "serving at" not in (line := proc.stdout.readline()):
        lines.append(line)
        if not line:
            raise RuntimeError(f"distrl buffer did not start: {''.join(lines[-20:])}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # its log must not fill the pipe
    return proc


def monitor(address: str, deadline: float, a: argparse.Namespace) -> list[dict]:
    """STATS every 0.1 s until ``deadline``: time, groups_put, learner_version, the groups accepted beyond
    the credit rule at that instant, and the buffer's own ``credit_violations`` where it counts them."""
    samples = []
    with BufferClient(address, "monitor", timeout_s=30.0) as client:
        while (now := time.monotonic()) < deadline:
            s = client.stats()
            bound = (s["learner_version"] + a.max_staleness + 1) * a.batch_size
            samples.append({"t": now, "groups_put": s["groups_put"], "learner_version": s["learner_version"],
                            "beyond": max(0, s["groups_put"] - s["credits_refunded"] - bound),
                            "credits_beyond": max(0, s["credits_granted"] - s["credits_refunded"] - bound),
                            "buffer_counter": s.get("credit_violations"), "duplicates": s["duplicates"],
                            "evicted_stale": s.get("evicted_stale", 0)})
            time.sleep(max(0.0, min(0.1, deadline - time.monotonic())))
    return samples




def at(samples: list[dict], t: float) -> dict:
    """The first STATS sample taken at or after monotonic ``t`` (the last one if none)."""
    return next((s for s in samples if s["t"] >= t), samples[-1])


def run(a: argparse.Namespace) -> dict:
    """Start the buffer, the actor hosts and the learner; measure; return the results (see the docstring)."""
    run_dir = tempfile.mkdtemp(prefix="many_actors_")
    procs: list[subprocess.Popen] = []
    try:
        buffer = start_buffer(a, run_dir)
        procs.append(buffer)
        want = 2 * max(1, a.batch_size // a.actors)  # twice an actor's credits (batch_size // actors)
        hosts = [child("actors", a, "--_ids", ",".join(map(str, ids)), "--_want", str(want))
                 for ids in np.array_split(np.arange(a.actors), a.actor_procs)]
        learn = child("learner", a, "--max_staleness", str(a.max_staleness), "--poll_s", str(a.poll_s))
        procs += [*hosts, learn]
        for p in [*hosts, learn]:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a bench process did not start")
        start = time.monotonic()
        deadline = start + a.warmup_s + a.seconds
        for p in [*hosts, learn]:
            p.stdin.write(f"{deadline!r}\n")
            p.stdin.flush()
        cpu0, t0 = None, start + a.warmup_s
        samples = monitor(a._address, t0, a)
        cpu0 = thread_cpu(buffer.pid)
        others0 = [sum(thread_cpu(p.pid).values()) for p in [*hosts, learn]]
        samples += monitor(a._address, deadline, a)
        cpu1 = thread_cpu(buffer.pid)
        others = [sum(thread_cpu(p.pid).values()) - c for p, c in zip([*hosts, learn], others0)]
        outs = [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1]) for p in [*hosts, learn]]
        with BufferClient(a._address, "bench", timeout_s=10.0) as client:
            final = client.stats()
            client.shutdown()
        buffer.wait(timeout=60)
        segment_bytes = sum(f.stat().st_size for f in (Path(run_dir) / "segments").glob("*.arrow"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    outs[-1]["cpu_s"], outs[0]["cpu_s"] = others[-1], sum(others[:-1])
    return summarize(a, samples, outs[:-1], outs[-1], final, t0, deadline, cpu, segment_bytes, want)


def summarize(a: argparse.Namespace, samples: list[dict], hosts: list[dict], learned: dict, final: dict,
              t0: float, t1: float, cpu: dict[str, float], segment_bytes: int, want: int) -> dict:
    """The results of one run: steady-window rates and latencies, violations over the whole run."""
    first, last = at(samples, t0), samples[-1]
    window = last["t"] - first["t"]
    groups = last["groups_put"] - first["groups_put"]
    window_gets = [(m, h) for end, m, h in learned["gets"] if t0 <= end <= t1]
    ms = np.array([m for m, _ in window_gets] or [float("nan")])
    held = np.array([h for _, h in window_gets] or [float("nan")])
    versions = len(window_gets)
    actors = {k: sum(h[k] for h in hosts) for k in ("granted", "put", "refused", "credit_requests")}
    body = Body(group_template(0, 1, GROUP_SIZE, a.completion_len, a.prompt_len), 1, GROUP_SIZE).bytes
    counter = final.get("credit_violations")
    buffer_cpu_s = sum(cpu.values())
    return {
        "groups_per_s": round(groups / window, 1),
        "credit_violations": max(max(s["beyond"] for s in samples), int(counter or 0)),
        "get_p50_ms": round(float(np.percentile(ms, 50)), 2), "get_p99_ms": round(float(np.percentile(ms, 99)), 2),
        "consumed_groups_per_s": round(versions * a.batch_size / (t1 - t0), 1),
        "versions_per_s": round(versions / (t1 - t0), 1), "gets_in_window": versions,
        "credits_beyond_rule": max(s["credits_beyond"] for s in samples),
        "buffer_credit_violations_counter": counter,
        "get_held_ms_p50": round(float(np.percentile(held, 50)), 2), "gets_held": int((held > 0).sum()),
        "stale_rows_served": learned["stale_rows"],
        "duplicates": final["duplicates"], "evicted_stale": final.get("evicted_stale", 0),
        "bytes_per_group": len(body), "mb_per_s": round(groups / window * len(body) / 1e6, 1),
        "buffer_cpu_s_per_s": round(buffer_cpu_s / window, 3),
        "actor_hosts_cpu_s_per_s": round(hosts[0]["cpu_s"] / window, 3),
        "learner_cpu_s_per_s": round(learned["cpu_s"] / window, 3),
        "buffer_cpu_us_per_group": round(buffer_cpu_s / max(groups, 1) * 1e6, 1),
        "buffer_cpu_us_per_group_by_thread": {k: round(v / max(groups, 1) * 1e6, 1) for k, v in cpu.items()},
        "segment_bytes": segment_bytes, "groups_put_total": final["groups_put"],
        "actor_puts": actors["put"], "actor_credit_requests": actors["credit_requests"],
        "actor_refused_credits": actors["refused"],
        "put_ack_ms_p50": round(float(np.median([h["ack_ms_p50"] for h in hosts])), 2),
        "put_ack_ms_p99": round(max(h["ack_ms_p99"] for h in hosts), 2),
        "window_s": round(window, 2), "warmup_s": a.warmup_s,
        "actors": a.actors, "actor_procs": a.actor_procs, "want_per_credit": want, "batch_size": a.batch_size,
        "group_size": GROUP_SIZE, "completion_len": a.completion_len, "prompt_len": a.prompt_len,
        "max_staleness": a.max_staleness, "idle_s": a.idle_s, "credit_wait_s": a.credit_wait_s,
        "fsync": a.fsync + (" (the default)" if a.fsync == "batch" else ""),
        "machine": f"{os.cpu_count()} cores", "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


GROUP_SIZE = 8


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="steady-state window, after the warm-up")
    p.add_argument("--warmup_s", type=float, default=10.0)
    p.add_argument("--actors", type=int, default=64)
    p.add_argument("--actor_procs", type=int, default=2, help="processes hosting the actors' sockets")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--max_staleness", type=int, default=2)
    p.add_argument("--completion_len", type=int, default=256)
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--credit_wait_s", type=float, default=0.05,
                   help="CREDIT's wait_s: the buffer may hold it this long while nothing can be granted")
    p.add_argument("--idle_s", type=float, default=0.0, help="an actor's pause after a grant of 0")
    p.add_argument("--poll_s", type=float, default=0.02, help="the learner's pause after a WAIT (BufferClient.get)")
    p.add_argument("--fsync", default="batch", choices=("always", "batch", "never"),
                   help="the buffer's --fsync (batch is its default; the others only to see what fsync costs)")
    p.add_argument("--profile", default="", help="write a cProfile (CPU time) of the buffer's main thread here")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "many_actors.json"), help="'' writes none")
    p.add_argument("--_role", choices=("actors", "learner"), help=argparse.SUPPRESS)
    p.add_argument("--_address", help=argparse.SUPPRESS)
    p.add_argument("--_ids", help=argparse.SUPPRESS)
    p.add_argument("--_want", type=int, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> dict:
    a = parse()
    if a._role == "actors":
        ids = [int(i) for i in a._ids.split(",")]
        out = actor_host(a._address, ids, a._want, a.credit_wait_s, a.idle_s, GROUP_SIZE, a.completion_len,
                         a.prompt_len)
    elif a._role == "learner":
        out = learner(a._address, a.max_staleness, a.poll_s)
    else:

        a._address = f"tcp://127.0.0.1:{free_port()}"
        out = run(a)
        for key in ("groups_per_s", "consumed_groups_per_s", "credit_violations", "get_p50_ms", "get_p99_ms",
                    "mb_per_s", "buffer_cpu_us_per_group"):
            print(f"{key:>26}: {out[key]}")
        if a.out:
            merge(a.out, out, indent=2)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
