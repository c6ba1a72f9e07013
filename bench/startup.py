"""Where `distrl train`'s start-up goes, phase by phase, cold and warm (issue 43).

Each case is ``ENGINE:cold`` or ``ENGINE:warm`` (or ``ENGINE-cold``; ENGINE ``hf`` or ``vllm``): bench/real_model.py's
``distrl1`` command (``vllm``: its ``vllm`` case, ``--engine vllm --gpu_memory_utilization 0.2``) on SmolLM2 and
arith, run to ``--max_steps`` versions (default 2). The compile caches are distrl's (distrl.core.compile_cache:
inductor, Triton, vLLM and its startup plan), its cache directory pointed at one directory per engine under ``--work``
(``DISTRL_CACHE_DIR``, and the three variables under it): ``cold`` empties it first, ``warm`` reuses what the runs
before it left (run a ``cold`` case of the engine first). The phases are the run's summary.json ``startup``
(distrl.core.startup: each mark in seconds from the launch, and the phases between them); ``startup_s`` = launch to
the first policy version.

    python -m bench.startup run --model SmolLM2.gguf --cases hf:cold,hf:warm,vllm:cold,vllm:warm --out DIR
    python -m bench.startup report DIR [DIR ...] --note "machine, commit"    -> bench/results/startup.json

``run`` prints a table, then one JSON object on the last line (also ``DIR/startup.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.real_model import distrl_command  # noqa: E402
from bench.vs_trl import run_process  # noqa: E402
from distrl.core.compile_cache import CACHE_VARIABLES  # noqa: E402


def case(args, name: str, out: Path, work: Path) -> dict:
    """One ``ENGINE:cold|warm`` run; its start-up marks and phases, the command and how it ended."""
    engine, state = name.replace("-", ":").split(":")
    cache = work / f"cache_{engine}"
    if state == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    env = {"DISTRL_CACHE_DIR": str(cache), **{k: str(cache / "compile" / sub) for k, sub in CACHE_VARIABLES.items()}}
    run = f"{engine}_{state}"
    shutil.rmtree(work / run, ignore_errors=True)
    cmd = distrl_command(args, "vllm" if engine == "vllm" else "distrl1", work)
    cmd[cmd.index("--max_steps") + 1] = str(args.max_steps)
    cmd[cmd.index("--run_name") + 1] = run
    ray_tmp = tempfile.mkdtemp(prefix="su", dir="/tmp")  # short: Ray's socket paths
    started = time.time()
    try:
        how = run_process(cmd, out / f"{run}.log", args.hard_s, {**env, "RAY_TMPDIR": ray_tmp})
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    summary_path = work / run / "summary.json"
    startup = json.loads(summary_path.read_text()).get("startup", {}) if summary_path.is_file() else {}
    phases = startup.get("phases_s", {})
    return {"case": name, "how": how, "wall_s": round(time.time() - started, 1),
            "startup_s": phases.get("launch_to_first_version"), "phases_s": phases,
            "marks_s": startup.get("marks_s", {}), "command": " ".join(cmd[2:]),
            "cache": env}


def table(results: list[dict]) -> str:
    names = [n for r in results for n in r["phases_s"]]
    names = list(dict.fromkeys(names))
    rows = [f"{'phase':<26}" + "".join(f"{r['case']:>11}" for r in results)]
    for n in names:
        rows.append(f"{n:<26}" + "".join(f"{r['phases_s'].get(n, float('nan')):>11.1f}" for r in results))
    rows.append(f"{'how':<26}" + "".join(f"{r['how'][:10]:>11}" for r in results))
    return "\n".join(rows)


def run(args) -> dict:
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.cases.split(","):
        results.append(case(args, name, out, work))
        (out / "startup.json").write_text(json.dumps({"cases": results}, indent=1))  # kept if a later one is lost
    summary = {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "model": args.model,
               "max_steps": args.max_steps, "cases": results}
    (out / "startup.json").write_text(json.dumps(summary, indent=1))
    print(table(results))
    print(json.dumps(summary))
    return summary


def report(dirs: list[str], note: str, path: Path = ROOT / "bench" / "results" / "startup.json") -> dict:
    """Adds the runs in ``dirs`` (each ``DIR/startup.json``, with ``note``) to ``runs`` of bench/results/startup.json,
    keeping every key; ``startup_s_<case>`` (e.g. ``startup_s_hf_warm``) = the newest run's, ``_runs`` its history."""
    out = json.loads(path.read_text()) if path.is_file() else {}
    for d in dirs:
        run_summary = json.loads((Path(d) / "startup.json").read_text()) | {"note": note}
        out.setdefault("runs", []).append(run_summary)
        for c in run_summary["cases"]:
            key = "startup_s_" + c["case"].replace(":", "_").replace("-", "_")
            out[key] = c["startup_s"]
            out.setdefault(key + "_runs", []).append(c["startup_s"])
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["run", "report"])
    parser.add_argument("dirs", nargs="*", help="report: run output directories")
    parser.add_argument("--model", default=None, help="SmolLM2-135M-Instruct (GGUF file or directory)")
    parser.add_argument("--cases", default="hf:cold,hf:warm,vllm:cold,vllm:warm")
    parser.add_argument("--max_steps", type=int, default=2, help="versions each run makes")
    parser.add_argument("--hard_s", type=float, default=400.0, help="kill a run after this many seconds")
    parser.add_argument("--out", default="startup_out")
    parser.add_argument("--work", default="/tmp/startup")
    parser.add_argument("--note", default="")
    # bench/real_model.py's distrl1 settings (its distrl_command reads them)
    parser.add_argument("--weights_transport", default="shm")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--lora_lr", type=float, default=2e-4)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=24)
    parser.add_argument("--eval_every", type=int, default=5)
    parser.add_argument("--eval_size", type=int, default=256)
    args = parser.parse_args(argv)
    if args.mode == "run":
        if not args.model:
            parser.error("run needs --model")
        run(args)
    else:
        report(args.dirs, args.note)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
