"""Where a policy version's time goes: SmolLM2 on `arith`, one GPU (issue 23, part (a)).

The workload is the distrl case of ``bench/real_model.py``: SmolLM2-135M-Instruct, full fine-tuning,
``--backend hf --engine hf``, 32 prompts x 8 completions of at most 24 new tokens a version,
``--max_staleness 1``, one actor and one learner sharing the GPU, no evaluation. Cases (``--cases``) run one
after another, each for ``--warmup`` + ``--versions`` versions (``--max_steps``: the run ends by itself):

- ``defaults``: today's defaults (micro-batches of ``--learner_chunk_tokens 32768``: the whole batch in one;
  until issue 23, ``--learner_chunk_size 8``).
- ``chunk256``: ``--learner_chunk_size 256`` (the whole batch in one forward/backward).
- ``pack``: ``chunk256`` with ``--learner_pack_tokens 4096`` (sequence packing; CUDA only).
- ``custom_reward``: the defaults with ``--reward <work>/reward.py:score`` (:data:`REWARD_PY`, the arith
  reward as a user writes it; run in its ``--reward_timeout_s`` child process, as by default; until issue
  23's token budget, ``chunk256`` with it).
- ``learner_generates``: ``chunk256`` with ``--learner_generates --number_of_actors 0``.

Each run's TensorBoard is read back (:func:`phases`): a version's time is the gap between the learner's
consecutive ``learner/policy_version`` events; the split per version (mean over the measured versions) is
the learner's GET wait (``learner/idle_fraction_version`` x the version's time), publish
(``learner/weight_publish_s``), learner step (the rest of the learner's loop: collate, forward/backward,
optimizer step), and the actor's generate (``actor/generate_s``), weight load (``actor/weight_load_s``) and
the rest of the actor's loop (score + PUT + credit waits). Scoring 256 completions is also timed here,
in this process, with the task's reward and with the custom one (:func:`score_cost`).

Usage (GPU): ``python -m bench.real_workload run --model SmolLM2.gguf --out DIR --cases defaults,chunk256``;
``python -m bench.real_workload report DIR [DIR ...]`` writes ``bench/results/real_workload.json``.
``python -m bench.real_workload smoke --out DIR``: the same code path on CPU (the tiny model, 3 versions of the
``custom_reward`` case, 8 prompts x 4 completions, its run directory removed afterwards), under a minute on two
cores; exit 1 when no version was measured (tests/integration/test_real_workload_smoke.py runs it in make test).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.real_model import TASK_FLAGS  # noqa: E402
from bench.results_file import merge  # noqa: E402

REWARD_PY = '''import re
def score(text, problem):  # the arith reward a user writes: 1 when the last integer is the answer
    nums = re.findall(r"-?\\d+", text.replace(",", ""))
    return float(bool(nums) and int(nums[-1]) == int(problem.gold))
'''
CHUNK = ["--learner_chunk_size", "256"]
CASES = {"defaults": [], "chunk256": CHUNK, "pack": CHUNK + ["--learner_pack_tokens", "4096"],
         "custom_reward": ["--reward", "{work}/reward.py:score"],
         "learner_generates": CHUNK + ["--learner_generates", "--number_of_actors", "0"]}


def command(args, case: str, work: Path) -> list[str]:
    """The `distrl train` command line of one case (see the module docstring)."""
    extra = [flag.format(work=work) for flag in CASES[case]]
    return [sys.executable, "-m", "distrl", "train", "--model", args.model, *TASK_FLAGS,
            "--max_new_tokens", str(args.max_new_tokens), "--batch_size", str(args.batch_size),
            "--group_size", str(args.group_size), "--engine", "hf", "--max_staleness", "1",
            "--max_steps", str(args.warmup + args.versions), "--checkpoint_every", "0", "--export_final", "off",
            "--no_console", "--seed", "1", "--finetune", "full", "--backend", "hf", "--learning_rate", "2e-5",
            "--log_dir", str(work), "--run_name", case, *args.extra.split(), *extra]


def scalars(tb_dir: Path) -> dict[str, list[tuple[float, int, float]]]:
    """Every scalar event of one TensorBoard directory: ``tag -> [(wall_time, step, value), ...]``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not tb_dir.is_dir():
        return {}
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1, nearest rank) of `values`; None when empty."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def phases(run_dir: Path, warmup: int, count: int | None = None) -> dict:
    """Version times and the per-version split of one run (seconds; module docstring): the versions after
    `warmup`, the first `count` of them (None: all)."""
    learner = scalars(run_dir / "tb" / "learner0")
    gen = scalars(run_dir / "tb" / "actor0") or scalars(run_dir / "tb" / "learner0gen")
    walls = sorted((step, wall) for wall, step, _ in learner.get("learner/policy_version", []))
    last = warmup + count if count is not None else float("inf")
    pairs = [(step, prev, wall) for (_, prev), (step, wall) in zip(walls, walls[1:]) if warmup < step <= last]
    if not pairs:
        return {"versions": 0}
    gaps, t0, t1, n = {s: w - p for s, p, w in pairs}, pairs[0][1], pairs[-1][2], len(pairs)

    def per_version(events, tag, weight=None) -> float:
        """Sum over the measured versions / n: learner tags by step (x weight[step]), actor tags by wall time."""
        if weight is not None:
            return sum(v * weight[s] for _, s, v in events.get(tag, []) if s in weight) / n
        return sum(v for w, _, v in events.get(tag, []) if t0 < w <= t1) / n

    captures = [(w, v) for w, _, v in gen.get("actor/graph_captures", [])]
    warm = max((v for w, v in captures if w <= t0), default=0.0)
    wait = per_version(learner, "learner/idle_fraction_version", gaps)
    publish = per_version(learner, "learner/weight_publish_s", dict.fromkeys(gaps, 1.0))
    mean = sum(gaps.values()) / n
    actor_steps = [w for w, _, _ in gen.get("actor/generate_s", []) if t0 < w <= t1]
    generate, load = per_version(gen, "actor/generate_s"), per_version(gen, "actor/weight_load_s")
    times = list(gaps.values())
    return {"versions": n, "version_s_median": round(statistics.median(times), 4),
            "version_s_p90": round(pct(times, 0.9), 4), "version_s_mean": round(mean, 4),
            "version_s_min": round(min(times), 4), "version_s_max": round(max(times), 4),
            "split_s": {"get_wait": round(wait, 4), "learner_step": round(mean - wait - publish, 4),
                        "publish": round(publish, 4), "generate": round(generate, 4), "weight_load": round(load, 4),
                        "actor_rest": round(mean - generate - load, 4) if actor_steps else None},
            "actor_steps_per_version": round(len(actor_steps) / n, 3),
            "learner_tokens_per_s": round(statistics.median(
                [v for _, s, v in learner.get("learner/tokens_per_s", []) if s in gaps] or [0.0]), 1),
            "first_version_wall": walls[0][1], "measured_from_wall": t0,
            "graph_captures_after_warmup": int(max(v for _, v in captures) - warm) if captures else None,
            "times": [round(t, 4) for t in times]}


RECOMPILE = re.compile(r"^[VIWEDC](\d{4}) (\d\d:\d\d:\d\d)\.\d+ .*\[__recompiles\] Recompiling function")


def recompiles(paths: list[Path], since: float) -> tuple[int, int]:
    """(recompiles after wall time ``since``, all recompiles) logged by ``TORCH_LOGS=recompiles`` in the files
    under ``paths`` (the case's log and Ray's session logs, where the roles' stderr goes). torch stamps each
    line with local month, day and time to the second; the year is ``since``'s."""
    year, after, total = time.localtime(since).tm_year, 0, 0
    files = [f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()
             and f.suffix in (".log", ".err", ".out")]
    for f in files:
        for line in f.read_text(errors="replace").splitlines():
            m = RECOMPILE.match(line)
            if m:
                total += 1
                after += time.mktime(time.strptime(f"{year}{m[1]} {m[2]}", "%Y%m%d %H:%M:%S")) >= int(since)
    return after, total


def score_cost(work: Path, n: int = 256) -> dict:
    """Seconds to score `n` completions (one version's) with the task's reward and with :data:`REWARD_PY`
    through ``--reward`` (its child process, the default ``--reward_timeout_s``), in this process."""
    from distrl.rollout.rewards import UserReward
    from distrl.rollout.tasks import load_task

    task = load_task("arith", None, seed=1, arith_ops=("+", "-"), arith_max_operand=99)
    stream = task.problems(1)
    problems = [next(stream) for _ in range(n)]
    texts = [f"{p.question} = {p.gold}" if i % 2 else f"The answer is {i}." for i, p in enumerate(problems)]
    out = {}
    user = UserReward(f"{work}/reward.py:score")
    try:
        for name, fn in (("builtin", task.reward), ("custom", user)):
            fn(texts[0], [], problems[0])
            t = time.perf_counter()
            for text, p in zip(texts, problems):
                fn(text, [], p)
            out[f"score_s_{name}"] = round(time.perf_counter() - t, 4)
    finally:
        user.close()
    return out


def run_case(args, case: str, out: Path) -> dict:
    """One case to its --max_steps (killed, by pid, after --hard_s); its log, command and :func:`phases`."""
    work = Path(args.work)
    ray_tmp = tempfile.mkdtemp(prefix="rw", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "PYTHONUNBUFFERED": "1",
           "TORCH_LOGS": os.environ.get("TORCH_LOGS", "recompiles")}  # counted by recompiles()
    cmd = command(args, case, work)
    shutil.rmtree(work / case, ignore_errors=True)  # an earlier run's directory: distrl train refuses it
    t = time.time()
    with open(out / f"{case}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            how = f"exited {proc.wait(timeout=args.hard_s)}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            how = "killed at --hard_s"
    result = {"case": case, "how": how, "wall_s": round(time.time() - t, 1), "command": " ".join(cmd[2:]),
              **phases(work / case, args.warmup)}
    if "measured_from_wall" in result:  # recompiles after the warm-up (issue 23, acceptance 6)
        result["recompiles_after_warmup"], result["recompiles"] = recompiles(
            [out / f"{case}.log", Path(ray_tmp)], result.pop("measured_from_wall"))
    if args.mode == "smoke":  # Ray's session files: nothing to keep from a smoke run
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if result.get("first_version_wall"):  # start-up: launch to the learner's first version
        result["startup_s"] = round(result.pop("first_version_wall") - t, 1)
    name, k = case, 1
    while (out / f"{name}.json").exists():  # a case run again into the same --out: each run is kept
        k += 1
        name = f"{case}.run{k}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(f"{case}: {how} in {result['wall_s']} s, {result['versions']} versions measured, median "
          f"{result.get('version_s_median')} s", flush=True)
    return result


def summarize(results: dict[str, dict], scoring: dict) -> dict:
    """bench/results/real_workload.json: ``version_s_median``/``_p90`` of the ``defaults`` case (the slowest
    of its runs; without one, the fastest case without a custom reward, ``best_case``), the same of
    ``custom_reward`` (``_custom_reward``), each run's median/p90 (``runs``; ``case.runK`` is a case's K-th
    run into one --out), and every case."""
    timed = {c: r for c, r in results.items() if r.get("versions")}
    runs = {c: {k: r[k] for k in ("version_s_median", "version_s_p90")} for c, r in timed.items()}

    def worst(base: str) -> dict:
        mine = [runs[c] for c in runs if c.split(".")[0] == base]
        return max(mine, key=lambda r: r["version_s_median"]) if mine else {}

    plain = {c: r for c, r in runs.items() if c.split(".")[0] != "custom_reward"}
    best = "defaults" if worst("defaults") else min(plain, key=lambda c: plain[c]["version_s_median"], default=None)
    head = worst("defaults") or plain.get(best, {})
    return {"version_s_median": head.get("version_s_median"), "version_s_p90": head.get("version_s_p90"),
            "best_case": best,
            "version_s_median_custom_reward": worst("custom_reward").get("version_s_median"),
            "version_s_p90_custom_reward": worst("custom_reward").get("version_s_p90"),
            "recompiles_after_warmup": max((r.get("recompiles_after_warmup", 0) for r in timed.values()), default=None),
            "graph_captures_after_warmup": max((r.get("graph_captures_after_warmup") or 0 for r in timed.values()),
                                               default=None),
            "runs": runs, **scoring, "cases": results}


def table(summary: dict) -> str:
    keys = ("get_wait", "learner_step", "publish", "generate", "weight_load", "actor_rest")
    rows = [f"{'case':<18} {'n':>3} {'median':>7} {'p90':>7} " + " ".join(f"{k[:11]:>11}" for k in keys)]
    for case, r in summary["cases"].items():
        if not r.get("versions"):
            rows.append(f"{case:<18} no versions ({r['how']})")
            continue
        split = r["split_s"]
        rows.append(f"{case:<18} {r['versions']:>3} {r['version_s_median']:>7.3f} {r['version_s_p90']:>7.3f} "
                    + " ".join(f"{split[k]:>11.3f}" if split[k] is not None else f"{'-':>11}" for k in keys))
    rows.append(f"scoring 256 completions: builtin {summary.get('score_s_builtin')} s, "
                f"custom --reward {summary.get('score_s_custom')} s")
    return "\n".join(rows)


def print_summary(summary: dict) -> None:
    print(table(summary))
    print(json.dumps({k: v for k, v in summary.items() if k != "cases"}
                     | {"cases": {c: {k: v for k, v in r.items() if k in ("version_s_median", "version_s_p90")}
                                  for c, r in summary["cases"].items()}}))


def run(args) -> dict:
    """Every case of --cases, one after another; then the table and the JSON line (also DIR/summary.json)."""
    from distrl.core.gguf import resolve_model

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    (work / "reward.py").write_text(REWARD_PY)
    args.model = str(resolve_model(args.model)) if args.model != "tiny" else "tiny"
    scoring = score_cost(work)
    (out / "scoring.json").write_text(json.dumps(scoring))
    results = {case: run_case(args, case, out) for case in args.cases.split(",")}
    summary = summarize(results, scoring)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary)
    return summary


def report(dirs: list[str], note: str = "") -> None:
    """Combine the cases of run directories into bench/results/real_workload.json."""
    results, scoring = {}, {}
    for directory in dirs:
        for path in sorted(Path(directory).glob("*.json")):
            if path.name == "scoring.json":
                scoring = json.loads(path.read_text())
            elif path.name != "summary.json":
                results[path.stem if path.stem not in results else f"{path.stem}.{directory}"] = \
                    json.loads(path.read_text())
    summary = summarize(results, scoring) | {"date": time.strftime("%Y-%m-%d", time.gmtime()), "note": note}
    merge(ROOT / "bench" / "results" / "real_workload.json", summary)
    print_summary(summary)


def smoke(args) -> int:
    """The ``custom_reward`` case on CPU: the tiny model, 3 versions (none left out), 8 prompts x 4 completions
    of 5 tokens, one torch thread; its run directory (a temporary one) is removed afterwards. Returns the exit
    code: 0 when versions were measured."""
    args.model, args.cases, args.warmup, args.versions = "tiny", "custom_reward", 0, 3
    args.batch_size, args.group_size, args.max_new_tokens = 8, 4, 5
    args.extra = (args.extra + " --torch_threads 1").strip()
    args.work = tempfile.mkdtemp(prefix="real_workload_")
    try:
        summary = run(args)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0 if summary["cases"]["custom_reward"].get("versions") else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["run", "report", "smoke"])
    parser.add_argument("dirs", nargs="*", help="report: run output directories")
    parser.add_argument("--model", default="tiny", help="GGUF file or model directory (SmolLM2-135M-Instruct)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--out", default="real_workload_out", help="directory of the cases' logs and JSON")
    parser.add_argument("--work", default="/tmp/real_workload", help="run directories")
    parser.add_argument("--warmup", type=int, default=5, help="versions left out at the start of each case")
    parser.add_argument("--versions", type=int, default=60, help="versions measured per case")
    parser.add_argument("--hard_s", type=float, default=600.0, help="kill a case after this many seconds")
    parser.add_argument("--batch_size", type=int, default=32, help="prompts per policy version")
    parser.add_argument("--group_size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=24, help="completion length")
    parser.add_argument("--extra", default="", help="more `distrl train` flags for every case (one string)")
    parser.add_argument("--note", default="", help="report: a line kept in the JSON (machine, commit, command)")
    args = parser.parse_args(argv)
    if args.mode == "smoke":
        sys.exit(smoke(args))
    if args.mode == "run":
        run(args)
    else:
        report(args.dirs, args.note)


if __name__ == "__main__":
    main()
