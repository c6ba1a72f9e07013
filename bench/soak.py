"""Soak (issue 16, item 6): run a role set for N minutes and report each role's RSS slope per 1,000 versions.

Starts `distrl train` (default: `make demo`'s configuration without its warm start, with a practically
endless `--max_steps`, no evaluation and a small `--dedup_window`, see FLAGS), then every `--interval_s`
seconds samples the resident set size of each role by pid (the driver, and `buffer0`, `learner0`,
`actor0`, ... from the role files `<run_dir>/roles/<name>.json` of distrl/cmd/faults.py; a restarted role is
followed to its new pid) and the policy version (the buffer's STATS `learner_version`, from the address
the buffer logs in `<run_dir>/logs/buffer0.log`). At the end it interrupts the run (SIGINT to the
driver, by pid) and waits for it to exit.

Warm-up: the samples of the first `--warmup` fraction of the time, and those before policy version
`--warmup_versions`, are dropped (whichever ends later): models load, caches and the buffer's de-duplication
window fill, and each role's allocator reaches its steady footprint. The version count is for one-time steps
seen in every soak of this configuration (BENCHMARKS.md, "Soak"): the actor's RSS rises ~4 MB once near version
1,100-2,300 and the learner's near 2,500, when CPython's table of interned strings is first rebuilt. pathlib
interns every path component (a version's `v001234`, ...); the ~13-15 such strings a version that die leave a
used slot behind until a rebuild, which sizes the table for the ~137,000-150,000 live strings: 2**19 slots
(7.3 MB, on the heap) where 2**18 (3.7 MB, mmapped) held them since start-up. Later rebuilds keep that size (the
live count does not grow: RSS is flat after the step). On the rest, each role's RSS (MB) is fitted against
the version by least squares; the slope times 1,000 is the role's growth per 1,000 versions. Prints a table,
then one JSON object on the last line (also written to `--out`, default bench/results/soak.json):
``{"rss_mb_per_1k_versions": {role: slope}, "versions", "minutes", "rss_mb_start", "rss_mb_end", ...}``; the
file also holds every sample (``series``).

    .venv/bin/python -m bench.soak [--minutes 20] [--out bench/results/soak.json] [-- extra train flags]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results_file import merge
from bench.runs import ENV, ROOT, command

FLAGS = ["--model", "tiny", "--task", "arith", "--arith_ops", "+", "--finetune", "full", "--backend", "hf",
         "--engine", "hf", "--torch_threads", "1", "--batch_size", "32", "--group_size", "8",
         "--learner_chunk_size", "256", "--learning_rate", "3e-4", "--max_new_tokens", "5",
         "--number_of_actors", "1", "--max_staleness", "1", "--max_steps", "100000000", "--no_console",
         "--dedup_window", "16384"]  # 64 versions of 256 sample ids: the buffer's bounded id memory is full
# (at most two windows) within the warm-up; the default 2**20 ids fill in ~8,000 versions, which a slow machine
# does not reach in 20 minutes: the buffer would seem to grow.


WARMUP_VERSIONS = 3000
PEAK_WINDOW = 12  # samples per window of the peak fit (one minute at the default --interval_s)


def rss_mb(pid: int) -> float | None:
    """Resident set size of ``pid`` in MB (2**20 bytes), or None when the process is gone."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss / 2**20
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess / AccessDenied: the process is gone
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def role_pids(run_dir: Path) -> dict[str, int]:
    """``{role name: pid}`` from ``<run_dir>/roles/*.json`` (what distrl.cmd.faults.write_role_file wrote)."""
    pids = {}
    for path in sorted((run_dir / "roles").glob("*.json")):
        try:
            pids[path.stem] = int(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError):  # being replaced right now: next sample
            continue
    return pids


def buffer_address(run_dir: Path) -> str | None:
    """The address in the buffer's "buffer serving at ADDRESS" log line, or None before it is logged."""
    log = run_dir / "logs" / "buffer0.log"
    found = re.findall(r"buffer serving at (\S+)", log.read_text(errors="replace")) if log.is_file() else []
    return found[-1] if found else None


def fit_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs (nan with fewer than 2 distinct xs)."""
    n = len(xs)
    mx, my = sum(xs) / max(n, 1), sum(ys) / max(n, 1)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if n >= 2 and sxx > 0 else float("nan")


def sample(proc: subprocess.Popen, run_dir: Path, client) -> dict | None:
    """One sample ``{"t", "version", "rss": {role: MB}}``; None while the buffer does not answer STATS."""
    try:
        version = int(client.stats()["learner_version"])
    except (TimeoutError, RuntimeError, KeyError):
        return None
    pids = {"driver": proc.pid, **role_pids(run_dir)}
    rss = {name: mb for name, pid in pids.items() if (mb := rss_mb(pid)) is not None}
    return {"t": time.time(), "version": version, "rss": rss, "pids": pids}


def soak(flags: list[str], minutes: float, log_dir: Path, interval_s: float) -> tuple[list[dict], Path]:
    """Run `distrl train FLAGS` for `minutes` (from its start), sampling every `interval_s` s; then SIGINT
    the driver and wait for it. Returns (samples, run_dir). Raises RuntimeError if the run ends by itself."""
    from distrl.core.buffer_client import BufferClient

    run_dir = log_dir / "soak"
    out = open(log_dir / "driver.out", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "distrl", "train", *flags, "--log_dir", str(log_dir),
                             "--run_name", "soak"], cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    samples, client, end = [], None, time.time() + 60 * minutes
    try:
        while time.time() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended by itself (exit {proc.returncode}):\n"
                                   f"{(log_dir / 'driver.out').read_text(errors='replace')[-3000:]}")
            if client is None and (address := buffer_address(run_dir)) is not None:
                client = BufferClient(address, "soak", timeout_s=5.0, retries=0)
            if client is not None and (s := sample(proc, run_dir, client)) is not None:
                samples.append(s)
            time.sleep(interval_s)
    finally:
        if client is not None:
            client.close()
        stop(proc)
        out.close()
    return samples, run_dir


def stop(proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    """SIGINT the driver by pid and wait for it; SIGKILL it (by pid) if it has not exited in `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def analyse(samples: list[dict], warmup: float, warmup_versions: int = 0) -> dict:
    """Drop the first `warmup` fraction of the sampled time and the samples before version `warmup_versions`;
    fit each role's RSS against the version.

    ``peak_rss_mb_per_1k_versions``: the same fit over each window of PEAK_WINDOW samples' largest RSS (at
    its mean version), beside the plain fit: a leak raises the peaks too, and they move less than single
    samples when glibc returns free heap to the OS and takes it back (the learner's RSS swings by up to
    ~80 MB while its live heap stays flat, see BENCHMARKS.md).

    Returns {"rss_mb_per_1k_versions", "peak_rss_mb_per_1k_versions", "rss_mb_per_minute", "rss_mb_start",
    "rss_mb_end" (each {role: MB}),
    "versions" (total, at the last sample), "versions_fitted", "minutes_fitted", "samples_fitted"}.
    Raises ValueError with fewer than 3 samples after the warm-up.
    """
    t0, t1 = samples[0]["t"], samples[-1]["t"]
    kept = [s for s in samples if s["t"] >= t0 + warmup * (t1 - t0) and s["version"] >= warmup_versions]
    if len(kept) < 3:
        raise ValueError(f"{len(kept)} samples after the warm-up: run longer (--minutes) or sample more often")
    roles = sorted({r for s in kept for r in s["rss"]}, key=lambda r: (r != "driver", r))
    result = {key: {} for key in ("rss_mb_per_1k_versions", "peak_rss_mb_per_1k_versions", "rss_mb_per_minute",
                                  "rss_mb_start", "rss_mb_end")}
    for role in roles:
        points = [(s["version"], (s["t"] - t0) / 60, s["rss"][role]) for s in kept if role in s["rss"]]
        versions, minutes, rss = zip(*points)
        result["rss_mb_per_1k_versions"][role] = round(1000 * fit_slope(list(versions), list(rss)), 4)
        windows = [points[i:i + PEAK_WINDOW] for i in range(0, len(points), PEAK_WINDOW)]
        peaks = [(sum(p[0] for p in w) / len(w), max(p[2] for p in w)) for w in windows]
        result["peak_rss_mb_per_1k_versions"][role] = round(1000 * fit_slope(*map(list, zip(*peaks))), 4)
        result["rss_mb_per_minute"][role] = round(fit_slope(list(minutes), list(rss)), 4)
        result["rss_mb_start"][role], result["rss_mb_end"][role] = round(rss[0], 1), round(rss[-1], 1)
    restarted = sorted({r for s in kept for r in s["pids"] if s["pids"][r] != kept[0]["pids"].get(r)})
    series = {"columns": ["minute", "version", *roles],  # every sample, warm-up included, for a look at the curve
              "rows": [[round((s["t"] - t0) / 60, 2), s["version"], *(round(s["rss"].get(r, float("nan")), 1)
                                                                     for r in roles)] for s in samples]}
    return {**result, "versions": kept[-1]["version"], "versions_fitted": kept[-1]["version"] - kept[0]["version"],
            "minutes_fitted": round((kept[-1]["t"] - kept[0]["t"]) / 60, 2), "samples_fitted": len(kept),
            "restarted_roles": restarted, "series": series}


def table(result: dict) -> str:
    """The per-role table printed before the JSON line."""
    lines = [f"{'role':<10} {'RSS start MB':>12} {'RSS end MB':>10} {'MB/1k versions':>14} {'peaks':>8} {'MB/min':>8}"]
    for role, slope in result["rss_mb_per_1k_versions"].items():
        lines.append(f"{role:<10} {result['rss_mb_start'][role]:>12.1f} {result['rss_mb_end'][role]:>10.1f} "
                     f"{slope:>14.3f} {result['peak_rss_mb_per_1k_versions'][role]:>8.3f} "
                     f"{result['rss_mb_per_minute'][role]:>8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="run length from the launch (default 20)")
    parser.add_argument("--interval_s", type=float, default=5.0, help="seconds between samples (default 5)")
    parser.add_argument("--warmup", type=float, default=0.25, help="fraction of the sampled time dropped (0.25)")
    parser.add_argument("--warmup_versions", type=int, default=WARMUP_VERSIONS, help="samples before this policy "
                        f"version are dropped too ({WARMUP_VERSIONS}: past the one-time steps, see above)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    parser.add_argument("--log_dir", type=Path, default=None, help="keep the run here (default: a temporary "
                        "directory, deleted at the end)")
    parser.add_argument("train_flags", nargs=argparse.REMAINDER, help="after `--`: more `distrl train` flags, "
                        "appended to the default set (a repeated flag takes the later value)")
    args = parser.parse_args(argv)
    flags = FLAGS + [f for f in args.train_flags if f != "--"]
    with tempfile.TemporaryDirectory(prefix="distrl-soak-") as tmp:
        log_dir = (args.log_dir or Path(tmp)).resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
        samples, _ = soak(flags, args.minutes, log_dir, args.interval_s)
    if not samples:
        raise SystemExit("no sample: the buffer never answered STATS")
    result = {"command": command(flags), "minutes": args.minutes, "interval_s": args.interval_s,
              "warmup": args.warmup, "warmup_versions": args.warmup_versions,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(samples[0]["t"])),
              **analyse(samples, args.warmup, args.warmup_versions)}
    result["versions_per_s"] = round(result["versions_fitted"] / max(60 * result["minutes_fitted"], 1e-9), 2)
    print(table(result))
    merge(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "series"}))


if __name__ == "__main__":
    main()
