"""Chaos bench (issue 41): SIGKILL random roles of a two-node `distrl train`, resume as the docs say, and check from
the run's own logs that nothing acknowledged was lost and nothing trained twice.

The cluster is tests/integration/test_multinode.py's: a head node at 127.0.0.1 and node 2 at 127.0.0.2 in a private
mount namespace (tmpfs over its Ray temp dir and the log directory: node 2's run directory is its own disk). The run:
the tiny model on `--task arith`, `--engine hf --backend hf`, 2 rollout actors, the buffer pinned to node 2
(`--buffer_resources '{"node2": 1}'`, so the driver keeps a replica of its log), the learner and the actors on the
driver's node, `--max_actor_restarts` raised (FLAGS). After the run has made `--progress_versions` new versions
since it (re)started or since the last kill, the bench waits a random time (`--gap_s`, seeded) and SIGKILLs one
target, the kinds drawn from shuffled rounds of `--mix` (seeded):

- ``actor``: a rollout actor's process (its pid from roles/actor<i>.json, checked to be a child of this cluster's
  head raylet); Ray restarts it and the run goes on (docs/faults.md);
- ``learner``: learner 0's process; the run ends (exit 1) and the bench runs `distrl train --resume RUN`;
- ``buffer``: buffer0's process on node 2 (the child of node 2's raylet named ray::BufferRole); the run ends and
  is resumed, the buffer on node 2 again, with its own log;
- ``node``: node 2 itself (its raylet, then every process of its mount namespace: test_multinode's _lose_node); the
  run ends, the bench starts a fresh node 2 (empty disk) and resumes: the buffer fetches the replica's log.

Before each resume, and at the end, the group ids held by both copies of the log (the driver's replica and, when
node 2 survived, node 2's own log, read through /proc/<pid>/root) are recorded: a superset of the groups
acknowledged so far, all of which must be in the final log. After `--minutes` (or `--max_kills` kills) the bench
lets the run make progress once more, interrupts it (SIGINT to the driver: the buffer shuts down cleanly) and
reports (bench/chaos_report.py). Prints the numbers, then one JSON object on the last line, also written to
`--out` (default bench/results/chaos.json: the newest run's keys, every earlier key kept, ``runs`` the history).

    .venv/bin/python -m bench.chaos [--minutes 25] [--seed 0] [--max_kills N] [--replay_ratio 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.chaos_report import KINDS, chaos_report, passed, read_jsonl
from bench.results_file import merge
from bench.runs import ROOT, command
from distrl.buffer.segments import read_consumed, read_groups
from tests.integration.test_buffer_node_loss import _start_node2
from tests.integration.test_multinode import ENV, Cluster, _cluster_pids, _cmdline, _lose_node

BIG_STEPS = "100000000"
RESTARTS = 100000  # --max_actor_restarts for the bench: every actor kill is restarted
FLAGS = ["--model", "tiny", "--task", "arith", "--engine", "hf", "--backend", "hf", "--number_of_actors", "2",
         "--buffer_resources", '{"node2": 1}', "--batch_size", "4", "--group_size", "2", "--max_new_tokens", "8",
         "--torch_threads", "1", "--no_console", "--checkpoint_every", "2", "--max_actor_restarts", str(RESTARTS),
         "--max_steps", BIG_STEPS]
EXIT_WAIT_S = 300  # a run that does not end this long after its learner, buffer or node died is stuck
PROGRESS_WAIT_S = 400  # no new version this long: recorded as a stall, and the next kill comes anyway


class Bench:
    """One chaos run: the cluster, the driver process of the current segment, the event log."""

    def __init__(self, args, base: Path):
        self.args, self.base = args, base
        self.rng = random.Random(args.seed)
        self.cluster = Cluster(base)
        self.run_dir = self.cluster.log_dir / "chaos"
        self.events_path = base / "events.jsonl"
        self.proc: subprocess.Popen | None = None
        self.segment = 0
        self.bag: list[str] = []

    # ---- events and the driver ---------------------------------------------------------------------------
    def event(self, what: str, **fields) -> None:
        line = {"event": what, "t": round(time.time() - self.t0, 1), "segment": self.segment, **fields}
        with open(self.events_path, "a") as f:
            f.write(json.dumps(line) + "\n")
        if what != "acked":
            print(f"chaos: {json.dumps(line)}", file=sys.stderr, flush=True)

    def start(self, args: list[str]) -> None:
        self.segment += 1
        out = open(self.base / f"segment-{self.segment:02d}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "distrl", "train", *args], cwd=ROOT, env=ENV,
                                     stdout=out, stderr=subprocess.STDOUT, text=True)
        out.close()

    def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def end_segment(self, why: str, timeout_s: float = EXIT_WAIT_S) -> int:
        """Wait for the driver to exit (SIGINT, then SIGKILL if stuck); record its code and the acked ids."""
        rc = self.wait_exit(timeout_s)
        if rc is None:
            self.event("stuck", why=why)
            self.proc.send_signal(signal.SIGINT)
            rc = self.wait_exit(120)
            if rc is None:
                self.proc.kill()
                rc = self.proc.wait()
        summary = json.loads((self.run_dir / "summary.json").read_text()) if (self.run_dir / "summary.json").is_file() \
            else {}
        self.event("segment_end", why=why, rc=rc, error=(summary.get("error") or "")[:300],
                   buffer=summary.get("buffer"))
        self.event("acked", ids=sorted(self.both_logs()))
        return rc

    # ---- the cluster's processes -------------------------------------------------------------------------
    def raylet(self, temp: Path) -> int | None:
        pids = [p for p in _cluster_pids([str(temp)]) if _cmdline(p).split(" ")[0].endswith("/raylet")]
        return pids[0] if pids else None

    def children(self, parent: int | None, title: str) -> list[int]:
        if parent is None:
            return []
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent \
                        and _cmdline(int(proc.name)).startswith(title):
                    found.append(int(proc.name))
            except (OSError, ValueError, IndexError):
                continue
        return found

    def node2_root(self) -> Path | None:
        """Node 2's filesystem as its processes see it (their mount namespace), or None when node 2 is gone."""
        raylet = self.raylet(self.cluster.temp2)
        return None if raylet is None else Path(f"/proc/{raylet}/root")

    def both_logs(self) -> set[str]:
        """Group ids in the driver's replica and, if node 2 is up, in node 2's own log too (the acked ones are in
        both: an ACK waits for the two copies)."""
        ids = {group.column("group_id")[0].as_py() for _, group in read_groups(self.run_dir)}
        root = self.node2_root()
        local = None if root is None else root / str(self.run_dir).lstrip("/")
        if local is not None and (local / "segments").is_dir():
            ids &= {group.column("group_id")[0].as_py() for _, group in read_groups(local)}
        return ids

    def version(self) -> int:
        try:
            return max([r["learner_version"] for r in read_consumed(self.run_dir)] or [-1])
        except (ValueError, OSError):
            return -1

    # ---- kills -------------------------------------------------------------------------------------------
    def next_kind(self) -> str:
        if not self.bag:
            self.bag = [kind for kind, n in self.args.mix.items() for _ in range(n)]
            self.rng.shuffle(self.bag)
        return self.bag.pop()

    def target(self, kind: str) -> tuple[int | None, str]:
        """The pid to SIGKILL for ``kind`` (the raylet's for ``node``) and the role's name."""
        if kind == "node":
            return self.raylet(self.cluster.temp2), "node2"
        if kind == "buffer":
            pids = self.children(self.raylet(self.cluster.temp2), "ray::BufferRole")
            return (pids[0] if pids else None), "buffer0"
        name = f"actor{self.rng.randrange(2)}" if kind == "actor" else "learner0"
        title = "ray::RolloutRole" if kind == "actor" else "ray::LearnerRole"
        mine = self.children(self.raylet(self.cluster.temp1), title)
        try:
            pid = json.loads((self.run_dir / "roles" / f"{name}.json").read_text())["pid"]
        except (OSError, ValueError, KeyError):
            pid = None
        return (pid if pid in mine else None), name

    def kill(self, kind: str) -> bool:
        pid, name = self.target(kind)
        if pid is None:
            self.event("kill_skipped", kind=kind, role=name)
            self.bag.append(kind)  # drawn again next time: the mix stays as asked
            return False
        self.event("kill", kind=kind, role=name, pid=pid, version=self.version())
        if kind == "node":
            _lose_node(pid)
        else:
            os.kill(pid, signal.SIGKILL)
        return True

    # ---- the loop ----------------------------------------------------------------------------------------
    def wait_progress(self, since: int) -> bool:
        """Until the run made --progress_versions versions past ``since``; False if the driver exited."""
        deadline = time.time() + PROGRESS_WAIT_S
        while self.proc.poll() is None:
            if self.version() >= since + self.args.progress_versions:
                return True
            if time.time() > deadline:
                self.event("stall", version=self.version(), since=since)
                return True
            time.sleep(1.0)
        return False

    def resume(self, why: str) -> None:
        if why == "node":
            _start_node2(self.cluster)
        self.event("resume", after=why, version=self.version())
        self.start(["--resume", str(self.run_dir), "--max_steps", BIG_STEPS])

    def chaos(self) -> None:
        deadline, kills = time.time() + 60 * self.args.minutes, 0
        while time.time() < deadline and (self.args.max_kills is None or kills < self.args.max_kills):
            if not self.wait_progress(self.version()):
                rc = self.end_segment("exited by itself")
                if rc == 2:
                    raise RuntimeError(f"the resume was refused (exit 2): {self.base}/segment-{self.segment:02d}.log")
                self.resume("exit")
                continue
            time.sleep(self.rng.uniform(*self.args.gap_s))
            if self.proc.poll() is not None:
                continue
            kind = self.next_kind()
            if not self.kill(kind):
                continue
            kills += 1
            if kind != "actor":
                self.end_segment(kind)
                self.resume(kind)

    def run(self) -> dict:
        self.t0 = time.time()
        flags = [*FLAGS, "--replay_ratio", str(self.args.replay_ratio), "--ray_address", self.cluster.address,
                 "--log_dir", str(self.cluster.log_dir), "--run_name", "chaos"]
        self.cluster.start()
        self.event("start", command=command(flags))
        self.start(flags)
        self.chaos()
        while self.proc.poll() is None and not self.wait_progress(self.version()):
            pass  # one last stretch of progress (a resume just started), then an interrupt
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        self.end_segment("end (SIGINT)", timeout_s=180)
        report = chaos_report(self.run_dir, read_jsonl(self.events_path), self.args.replay_ratio, max_staleness=1)
        report.update(command=command(flags), minutes_run=round((time.time() - self.t0) / 60, 1),
                      seed=self.args.seed, max_actor_restarts=RESTARTS, mix=self.args.mix,
                      replay_ratio=self.args.replay_ratio, events=str(self.events_path))
        return report

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.cluster.stop()


def save(report: dict, out: Path) -> None:
    """Write ``report``'s keys over ``out``'s (earlier keys kept, each number's ``<key>_runs`` extended:
    :func:`bench.results_file.merge`) and append it to ``runs``."""
    old = json.loads(out.read_text()) if out.is_file() else {}
    runs = old.get("runs", []) + [{**report, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}]
    merge(out, {**report, "runs": runs}, indent=2)


def parse_mix(text: str) -> dict[str, int]:
    mix = {k: int(v) for k, v in (part.split("=") for part in text.split(","))}
    if set(mix) - set(KINDS) or min(mix.values()) < 0:
        raise argparse.ArgumentTypeError(f"--mix: kinds of {KINDS} with counts >= 0, got {text!r}")
    return mix


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_kills", type=int, default=None)
    p.add_argument("--mix", type=parse_mix, default=parse_mix("actor=2,learner=1,buffer=1,node=1"),
                   help="kinds per shuffled round")
    p.add_argument("--gap_s", type=float, nargs=2, default=(3.0, 20.0), help="random wait before a kill")
    p.add_argument("--progress_versions", type=int, default=4, help="new versions before the next kill")
    p.add_argument("--replay_ratio", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "chaos.json")
    p.add_argument("--work_dir", type=Path, default=None, help="kept (default: a new temp dir)")
    args = p.parse_args(argv)
    base = args.work_dir or Path(tempfile.mkdtemp(prefix="chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, base)
    try:
        report = bench.run()
    finally:
        bench.close()
    for key in ("kills", "kills_total", "resumes", "versions_reached", "acked", "acked_lost", "trained_twice",
                "versions_backwards", "versions_repeated", "groups_logged", "groups_logged_twice", "trained",
                "quarantined", "selections_kept", "selections_rolled_back", "held_derived", "held_reported",
                "evicted_stale_derived", "evicted_stale_reported", "stalls", "stuck_segments", "kills_skipped",
                "minutes_run"):
        print(f"{key:>24}: {report[key]}")
    report["passed"] = passed(report)
    save(report, args.out)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
