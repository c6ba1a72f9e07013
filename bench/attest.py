"""Weight attestation overhead (issue 21, acceptance 3): `make demo`'s run with and without attestation.

Runs `make demo`'s `distrl train` configuration (DEMO below: tiny model, arith, HF engine, full fine-tuning,
batch 32 x 8, --max_staleness 1, eval every 10 versions) side by side, attestation on (the default) and off
(`--no_attest_weights`), in alternating order (`--pairs` of each), so load from other processes on the machine
falls on both. The supervised warm start runs once (a first run with --max_steps 1) and every compared run
starts from its result (`--model <that run>/warm_start`), so the runs differ only in attestation.

Per run, two measures of a version's cost (versions after the first 10; the first `--skip`):

- wall: the median interval between consecutive versions of the learner (TensorBoard wall times of
  ``learner/policy_version``). On a shared machine other processes' load moves it by tens of percent
  between identical runs, so it is reported, not trusted alone;
- CPU: the CPU seconds (user + system, from ``/proc/<pid>/stat``, sampled every 0.5 s) that the learner,
  the actor and the buffer processes (pids from ``<run_dir>/roles/``) spent between versions 10 and the
  last, divided by the versions: what attestation adds is work, and work shows in CPU time whatever else
  runs on the machine.

Attestation's own cost is also read from the learner's ``learner/attest_s`` (its canary forward and the
check of each batch) and the actor's ``actor/canary_s`` (its engine's canary forward per loaded version),
medians. Prints a table, then one JSON object on the last line (also written to `--out`, default
bench/results/attest.json): ``{"version_s_on", "version_s_off", "ratio", "cpu_s_per_version_on",
"cpu_s_per_version_off", "cpu_ratio", "attest_s_per_version", "attest_pct_of_version", ...}``.

    .venv/bin/python -m bench.attest [--max_steps 100] [--pairs 2] [--out bench/results/attest.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results_file import merge
from bench.runs import ENV, ROOT, command, train

DEMO = ["--task", "arith", "--arith_ops", "+", "--finetune", "full", "--backend", "hf", "--engine", "hf",
        "--torch_threads", "1", "--batch_size", "32", "--group_size", "8", "--learner_chunk_size", "256",
        "--max_new_tokens", "5", "--learning_rate", "4e-4", "--lr_schedule", "cosine", "--lr_warmup_steps", "10",
        "--number_of_actors", "1", "--max_staleness", "1", "--eval_every", "10", "--eval_size", "512", "--no_console"]
WARM_START = ["--warm_start_steps", "800", "--warm_start_until_accuracy", "0.25", "--warm_start_lr", "1e-3",
              "--warm_start_batch_size", "128"]


def series(run_dir: Path, role: str, tag: str) -> list[tuple[float, int, float]]:
    """[(wall time, step, value)] of one TensorBoard scalar of ``run_dir/tb/role``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb" / role), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (None when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def train_sampled(flags: list[str], log_dir: Path, interval_s: float = 0.5) -> tuple[Path, float, list]:
    """Run `distrl train FLAGS` like bench.runs.train, sampling every role's CPU seconds meanwhile.
    Returns (run_dir, wall seconds, [(unix time, {role: cpu seconds})]). Raises RuntimeError if it fails."""
    run_dir = log_dir.resolve() / flags[flags.index("--run_name") + 1]
    start, samples = time.time(), []
    with open(log_dir / f"{run_dir.name}.out", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "distrl", "train", *flags, "--log_dir", str(log_dir)],
                                cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(interval_s)
            pids = {f.stem: json.loads(f.read_text())["pid"] for f in (run_dir / "roles").glob("*.json")}
            cpu = {role: c for role, pid in pids.items() if (c := cpu_seconds(pid)) is not None}
            samples.append((time.time(), cpu))
    if proc.returncode != 0:
        raise RuntimeError(f"{command(flags)} failed: see {out.name}")
    return run_dir, time.time() - start, samples


def measure(run_dir: Path, samples: list, skip: int = 10) -> dict:
    """Median version time (s) and CPU seconds per version (learner, actor, buffer) after the first ``skip``
    versions, and attestation's own medians (s)."""
    walls = sorted((step, wall) for wall, step, _ in series(run_dir, "learner0", "learner/policy_version"))
    gaps = [b[1] - a[1] for a, b in zip(walls, walls[1:]) if a[0] >= skip]
    attest = [v for _, step, v in series(run_dir, "learner0", "learner/attest_s") if step > skip]
    canary = [v for _, step, v in series(run_dir, "actor0", "actor/canary_s") if step > skip]
    (v0, t0), (v1, t1) = next(w for w in walls if w[0] >= skip), walls[-2]  # the last version ends the run

    def at(t: float) -> dict:  # the sample nearest to unix time t
        return min(samples, key=lambda s: abs(s[0] - t))[1]

    first, last = at(t0), at(t1)
    cpu = {role: (last[role] - first[role]) / (v1 - v0) for role in ("learner0", "actor0", "buffer0")
           if role in first and role in last}
    return {"version_s": statistics.median(gaps), "versions": len(walls), "cpu_s_per_version": sum(cpu.values()),
            "cpu_s_per_version_by_role": cpu, "learner_attest_s": statistics.median(attest) if attest else 0.0,
            "actor_canary_s": statistics.median(canary) if canary else 0.0}


def run_pairs(base: list[str], pairs: int, log_dir: Path) -> dict[str, list[dict]]:
    """``pairs`` runs of ``base`` with attestation and as many without, alternating which goes first."""
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for i in range(pairs):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
            flags = base + ([] if mode == "on" else ["--no_attest_weights"]) + ["--run_name", f"{mode}{i}"]
            run_dir, wall, samples = train_sampled(flags, log_dir)
            r = {**measure(run_dir, samples), "wall_s": wall, "command": command(flags)}
            runs[mode].append(r)
            print(f"{mode:3s} run {i}: version {r['version_s']:.3f} s (median), CPU {r['cpu_s_per_version']:.4f} s "
                  f"a version, learner attest {r['learner_attest_s'] * 1e3:.2f} ms, actor canary "
                  f"{r['actor_canary_s'] * 1e3:.2f} ms, wall {wall:.0f} s", flush=True)
    return runs


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Medians over runs of each mode, the on/off ratios, attestation's own cost; prints the table."""
    med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in ("version_s", "cpu_s_per_version")}
           for m in runs}
    on, off = med["on"], med["off"]
    cost = statistics.median(r["learner_attest_s"] + r["actor_canary_s"] for r in runs["on"])
    each = {(m, k): ", ".join(f"{r[k]:.4f}" for r in runs[m]) for m in runs for k in ("version_s", "cpu_s_per_version")}
    print("\n| attestation | version s, wall (median) | each run | CPU s a version (median) | each run |\n"
          "|---|---|---|---|---|")
    for m in ("on", "off"):
        print(f"| {m} | {med[m]['version_s']:.4f} | {each[m, 'version_s']} | {med[m]['cpu_s_per_version']:.4f} | "
              f"{each[m, 'cpu_s_per_version']} |")
    ratio, cpu_ratio = on["version_s"] / off["version_s"], on["cpu_s_per_version"] / off["cpu_s_per_version"]
    print(f"ratio on/off: wall {ratio:.3f} ({(ratio - 1) * 100:+.1f} %), CPU {cpu_ratio:.3f} "
          f"({(cpu_ratio - 1) * 100:+.1f} %); attestation's own cost {cost * 1e3:.2f} ms a version = "
          f"{cost / off['version_s'] * 100:.2f} % of the version time")
    return {"version_s_on": on["version_s"], "version_s_off": off["version_s"], "ratio": ratio,
            "cpu_s_per_version_on": on["cpu_s_per_version"], "cpu_s_per_version_off": off["cpu_s_per_version"],
            "cpu_ratio": cpu_ratio, "attest_s_per_version": cost,
            "attest_pct_of_version": cost / off["version_s"] * 100}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=100, help="versions per compared run (the demo: 300)")
    parser.add_argument("--pairs", type=int, default=2, help="runs with and without attestation, alternating")
    parser.add_argument("--warm_start", default=None, help="a warm start directory to reuse (default: make one)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "attest.json"))
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="distrl-attest-"))
    warm_flags = ["--model", "tiny", *DEMO, *WARM_START, "--max_steps", "1", "--run_name", "warm"]
    warm = Path(args.warm_start) if args.warm_start else train(warm_flags, log_dir)[0] / "warm_start"
    runs = run_pairs(["--model", str(warm), *DEMO, "--max_steps", str(args.max_steps)], args.pairs, log_dir)
    result = {**summarize(runs), "max_steps": args.max_steps, "pairs": args.pairs,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "warm_start_command": command(warm_flags),
              "runs": runs}
    merge(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


if __name__ == "__main__":
    main()
