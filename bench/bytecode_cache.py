"""Start-up with and without distrl's bytecode cache, side by side (distrl.core.compile_cache.use_bytecode_cache).

The case it is for: an install without bytecode (uv's default, ``pip --no-compile``) where writing it is forbidden
(``PYTHONDONTWRITEBYTECODE=1``, common in container images), as on the lent GPU machine's image. Here: a copy of
this environment's torch without its ``__pycache__`` put first on ``PYTHONPATH``, ``PYTHONDONTWRITEBYTECODE=1``,
and a short ``distrl train`` of the tiny model, alternately

- ``without``: the cache kept out (a ``PYTHONPYCACHEPREFIX`` of ours that is never written: every process compiles
  every module it imports from source, as such an install does without distrl's cache);
- ``with``: distrl's default, its cache under a fresh ``DISTRL_CACHE_DIR`` (the first ``with`` run fills it: cold).

Each run's launch-to-first-version and start-up phases come from its summary.json. Prints them, the ratio of the
medians (without / with, warm runs), then one JSON object on the last line (also ``bench/results/bytecode_cache.json``).

    .venv/bin/python -m bench.bytecode_cache --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.results_file import merge

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--model", "tiny", "--task", "arith", "--engine", "hf", "--backend", "hf", "--max_steps", "2",
         "--batch_size", "4", "--group_size", "2", "--max_new_tokens", "8", "--no_console"]
PHASES = ("imports", "ray_start", "learner_model_load", "actor_engine_init", "launch_to_first_version")


def torch_without_bytecode(work: Path) -> Path:
    """A site directory holding a copy of this environment's torch with every ``__pycache__`` removed."""
    site = work / "site"
    shutil.copytree(Path(torch.__file__).parent, site / "torch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return site


def one_run(work: Path, site: Path, name: str, cached: bool) -> dict:
    """One ``distrl train`` (FLAGS) in that environment; its start-up phases (seconds)."""
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1",
           "DISTRL_CACHE_DIR": str(work / "cache")}
    env.pop("PYTHONPYCACHEPREFIX", None)
    if not cached:
        env["PYTHONPYCACHEPREFIX"] = str(work / "never_written")  # a user's prefix wins: the cache stays out
    proc = subprocess.run([sys.executable, "-m", "distrl", "train", *FLAGS, "--log_dir", str(work / "runs"),
                           "--run_name", name], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    phases = json.loads((work / "runs" / name / "summary.json").read_text())["startup"]["phases_s"]
    return {"run": name, "bytecode_cache": cached, **{k: phases.get(k) for k in PHASES}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="warm runs of each side (plus the cold `with` run)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bytecode_cache.json")
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bytecode_cache_") as tmp:
        work = Path(tmp)
        site = torch_without_bytecode(work)
        runs = [one_run(work, site, "with_cold", True)]
        for k in range(args.runs):
            runs += [one_run(work, site, f"without_{k + 1}", False), one_run(work, site, f"with_{k + 1}", True)]
    for r in runs:
        print(json.dumps(r))
    warm = [r["launch_to_first_version"] for r in runs if r["bytecode_cache"] and r["run"] != "with_cold"]
    without = [r["launch_to_first_version"] for r in runs if not r["bytecode_cache"]]
    ratio = round(statistics.median(without) / statistics.median(warm), 3)
    print(f"launch to first version: without the cache {without}, with it (warm) {warm}, cold "
          f"{runs[0]['launch_to_first_version']}: {ratio}x")
    result = {"bytecode_cache_startup_ratio": ratio, "runs": runs,
              "command": f"python -m bench.bytecode_cache --runs {args.runs}", "flags": " ".join(FLAGS),
              "note": args.note}
    merge(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


if __name__ == "__main__":
    main()
