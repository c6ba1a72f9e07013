"""Where a rollout actor's start-up goes inside its process (issue 43): imports, engine build, warm-up.

`distrl train`'s start-up marks (bench/startup.py) say that the actor spends ``role_started -> engine_ready ->
engine_warm``; this bench opens those phases. One process per pass does what an actor does before its first
rollout, timing each step: ``import torch`` and CUDA's start, ``import transformers``, the task and the engine
(``make_engine``, what ``--engine ENGINE`` builds), and ``engine.warm_up()``; the engine build and the warm-up also
under cProfile (the top functions by cumulative time). Pass 1 runs on empty compile caches, pass 2 on what pass 1
left (distrl.core.compile_cache under ``--work``), as a warm `distrl train` does.

    python -m bench.startup_profile --model SmolLM2.gguf --work /tmp/sp --out DIR      (GPU)
    python -m bench.startup_profile ... --no_warm_up                  (the engine build alone: nothing compiles)
    python -m bench.startup_profile ... --role learner                (the learner's model load instead)

Prints each pass's timings and profile, then one JSON object on the last line (also ``DIR/startup_profile.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_pass(model: str, engine_kind: str, top: int, role: str = "actor", warm_up: bool = True) -> dict:
    """The steps of a role's start-up in this process: seconds per step, and the profiles' top lines (by
    cumulative and by own time). ``role``: ``actor`` (the engine --engine builds, then its warm-up unless not
    ``warm_up``) or ``learner`` (``distrl.learn.model.load_policy`` as distrl1 loads it: full fine-tune, hf, bf16)."""
    import cProfile
    import io
    import pstats

    times, profiles = {}, {}
    t = time.perf_counter()

    def step(name):
        nonlocal t
        now = time.perf_counter()
        times[name] = round(now - t, 3)
        t = now

    import torch

    step("import_torch")
    if torch.cuda.is_available():
        torch.cuda.init()
    step("cuda_init")
    import transformers  # noqa: F401

    from distrl.rollout.engines import make_engine

    step("import_transformers_and_engines")

    def profiled(name, fn):
        nonlocal t
        prof = cProfile.Profile()
        result = prof.runcall(fn)
        step(name)
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(top)
        stats.sort_stats("tottime").print_stats(top // 2)
        profiles[name] = text.getvalue()
        t = time.perf_counter()  # the printing is not the next step's
        return result

    if role == "learner":
        from distrl.learn.model import load_policy

        profiled("load_policy", lambda: load_policy(model, "bfloat16", finetune="full", backend="hf"))
        return {"times_s": times, "profiles": profiles}
    engine = profiled("make_engine", lambda: make_engine(engine_kind, model=model, seed=1))
    if warm_up:
        profiled("warm_up", engine.warm_up)
    return {"times_s": times, "profiles": profiles}


RAY_VARIANTS = {  # name -> (ray.init keyword arguments beyond distrl's, environment)
    "distrl": ({}, {}),
    "num_cpus=4": ({"num_cpus": 4}, {}),
    "no prestart": ({}, {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}),
}


def ray_pass(init_kwargs: dict) -> dict:
    """``ray.init`` as distrl starts a local cluster (plus `init_kwargs`), then three ``num_cpus=0`` actors created
    and answering, as the buffer, learner and actor roles: seconds for each."""
    from distrl.cmd.trainer import LOCAL_RAY

    t0 = time.perf_counter()
    import ray

    ray.init(**LOCAL_RAY, log_to_driver=False, **init_kwargs)
    t1 = time.perf_counter()

    @ray.remote(num_cpus=0)
    class Role:
        def pid(self):
            return os.getpid()

    roles = [Role.remote() for _ in range(3)]
    ray.get([r.pid.remote() for r in roles])
    t2 = time.perf_counter()
    ray.shutdown()
    return {"import_and_init_s": round(t1 - t0, 2), "three_actors_s": round(t2 - t1, 2)}


def slowest_imports(stderr: str, top: int) -> str:
    """The `top` slowest top-level imports of a ``-X importtime`` log (cumulative microseconds, package)."""
    rows = []
    for line in stderr.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[1].strip().isdigit():
            if not parts[2].startswith("  "):  # nested imports are indented further
                rows.append((int(parts[1]), parts[2].strip()))
    return "\n".join(f"{us:>10} {name}" for us, name in sorted(rows, reverse=True)[:top])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="GGUF file or model directory")
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/startup_profile"))
    parser.add_argument("--out", type=Path, default=Path("startup_profile_out"))
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--ray_runs", type=int, default=0, help="also time ray.init and three actors, per variant "
                        "(RAY_VARIANTS), this many times each, alternating")
    parser.add_argument("--role", default="actor", choices=["actor", "learner"], help="whose start-up: the actor's "
                        "engine (and warm-up) or the learner's model load")
    parser.add_argument("--no_warm_up", action="store_true", help="the actor's engine build only (no compiling)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ray_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ray_child:
        print(json.dumps(ray_pass(RAY_VARIANTS[args.ray_child][0])))
        return
    if args.child:
        print(json.dumps(one_pass(args.model, args.engine, args.top, args.role, not args.no_warm_up)))
        return
    from distrl.core.compile_cache import use_compile_caches
    from distrl.core.gguf import resolve_model

    model = resolve_model(args.model)
    env = {**os.environ, **use_compile_caches(args.work / "caches"), "PYTHONPROFILEIMPORTTIME": "1"}
    args.out.mkdir(parents=True, exist_ok=True)
    passes = []
    for k in range(args.passes):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "bench.startup_profile", "--child", "--model", model,
                               "--engine", args.engine, "--top", str(args.top), "--role", args.role]
                              + ["--no_warm_up"] * args.no_warm_up, cwd=ROOT, env=env,
                              capture_output=True, text=True)
        imports = slowest_imports(proc.stderr, args.top)
        if proc.returncode:
            print(proc.stderr[-4000:])
            raise SystemExit(f"pass {k + 1} exited {proc.returncode}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["process_s"] = round(time.perf_counter() - t0, 2)
        result["profiles"]["imports (python -X importtime, cumulative us, top-level only)"] = imports
        passes.append(result)
        print(f"== pass {k + 1} ({'cold' if k == 0 else 'warm'} caches): {result['times_s']}, process "
              f"{result['process_s']} s")
        for name, text in result["profiles"].items():
            print(f"-- {name}\n{text}")
    ray_runs = {name: [] for name in RAY_VARIANTS}
    for _ in range(args.ray_runs):
        for name, (_, extra) in RAY_VARIANTS.items():
            proc = subprocess.run([sys.executable, "-m", "bench.startup_profile", "--model", "-", "--ray_child", name],
                                  cwd=ROOT, env={**os.environ, **extra}, capture_output=True, text=True)
            ray_runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
                                  else {"error": proc.stderr[-300:]})
            print(f"ray {name}: {ray_runs[name][-1]}", flush=True)
    summary = [{k: v for k, v in p.items() if k != "profiles"} for p in passes]
    out = {"ray": ray_runs, "model": model, "engine": args.engine, "role": args.role, "passes": summary}
    (args.out / "startup_profile.json").write_text(json.dumps({**out, "profiles": [p["profiles"] for p in passes]}))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
