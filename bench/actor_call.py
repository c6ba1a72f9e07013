"""Where a rollout actor's generate call goes: the variable workload of ``bench.vs_trl`` (issue 23, acceptance 4).

SmolLM2-135M-Instruct on GSM8K, ``--prompts`` x ``--group_size`` completions of at most ``--max_new_tokens`` at
T = 1, through the HF engine as the rollout actor builds it (continuous batching, compiled step in CUDA graphs,
the decode kernels), the prompts templated as the actor's. After a warm-up call, ``--calls`` calls alternate:

- ``bare``: ``generate_groups`` with each group only collected;
- ``scored``: each hand-back's completions scored by the task's reward as the actor does before its PUT
  (``Task.rewards``: math_verify in :data:`distrl.rollout.reward_workers.DEFAULT_WORKERS` child processes, in
  parallel): scoring time that no queued decode step hides shows up as the difference;
- ``scored_one_worker``: the same with one math_verify process (every check one after another, as before
  ``--reward_workers``);
- ``scored_no_lookahead``: ``scored`` with the sampler's look-ahead off (``ContinuousSampler(lookahead=False)``:
  each interval's rows read, and their groups scored, before the next interval's steps are queued).

For one more call the sampler's decode steps are counted by slot count (bucket), each bucket's captured step
replayed alone (``replay_ms``: GPU time a step, no host), and the admission (prefill) timed synchronized: the
call's GPU time is then prefill + sum of steps x replay ms, and ``host_s`` = bare call - GPU time, the time the
GPU waited for the host. ``--profile``: the kernels and host ops of a bare call (torch.profiler), top 30 by
self CPU time, saved to ``DIR/actor_call_profile.txt``.

    python -m bench.actor_call --model SmolLM2.gguf --dataset train.jsonl --out DIR   (CUDA)
    python -m bench.actor_call --smoke --out DIR                                     (CPU: the tiny model)

Prints one JSON object on the last line (also ``DIR/actor_call.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from distrl.rollout.reward_workers import DEFAULT_WORKERS  # noqa: E402

# kind -> (reward workers scoring each hand-back, 0: none; the sampler's look-ahead)
KINDS = {"bare": (0, True), "scored": (DEFAULT_WORKERS, True), "scored_one_worker": (1, True),
         "scored_no_lookahead": (DEFAULT_WORKERS, False)}


def setup(args):
    """(engine, {workers: task}, problems, prompt id lists) as the actor has them."""
    from distrl.core.gguf import resolve_model
    from distrl.rollout.engines.hf import HFEngine
    from distrl.rollout.prompt_fit import prompt_ids
    from distrl.rollout.tasks import load_task

    if args.smoke:
        from distrl.core.tiny import build_tiny_model

        model = str(build_tiny_model(args.out / "tiny", seed=0))
        scorers = {w: load_task("arith", None, seed=1) for w in (1, DEFAULT_WORKERS)}
    else:
        model = str(resolve_model(args.model))
        scorers = {w: load_task("gsm8k", str(Path(args.dataset).resolve()), seed=1, verify_workers=w)
                   for w in (1, DEFAULT_WORKERS)}
    task = scorers[1]
    engine = HFEngine(model, seed=1)
    engine.warm_up()
    stream = task.problems(seed=1)
    problems = [next(stream) for _ in range(args.prompts * (args.calls + 2))]
    ids = [prompt_ids(task, p, engine.tokenizer)[1] for p in problems]
    return engine, scorers, problems, ids


def call(engine, scorers, problems, ids, args, workers: int) -> tuple[float, int]:
    """(wall seconds, completion tokens) of one generate_groups call, each hand-back's completions scored by
    ``scorers[workers]`` (a task whose reward runs that many processes; 0: not scored)."""
    import torch

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0, tokens = time.perf_counter(), 0
    for finished in engine.generate_groups(ids, args.group_size, 1.0, args.max_new_tokens, seed=7):
        items = [(c.text, c.token_ids, problems[p]) for p, result in finished for c in result.completions]
        tokens += sum(len(ids) for _, ids, _ in items)
        if workers:
            scorers[workers].rewards(items)
    sync()
    return time.perf_counter() - t0, tokens


def gpu_split(engine, problems, ids, args) -> dict:
    """One call with its steps counted by bucket and its admissions synchronized; each bucket's step replayed."""
    import torch

    from bench.variable_length import replay_ms

    sampler, steps, admit_s = engine._continuous, Counter(), []
    step, admit = sampler._step, sampler._admit

    def counted(model, st, n):
        steps[n] += 1
        step(model, st, n)

    def timed(*a, **k):
        torch.cuda.synchronize() if engine.device.type == "cuda" else None
        t0 = time.perf_counter()
        admit(*a, **k)
        torch.cuda.synchronize() if engine.device.type == "cuda" else None
        admit_s.append(time.perf_counter() - t0)

    sampler._step, sampler._admit = counted, timed
    try:
        wall, tokens = call(engine, {}, problems, ids, args, workers=0)
    finally:
        sampler._step, sampler._admit = step, admit
    st = sampler._states[max(sampler._states)]
    replay = {n: replay_ms(st.graphs[n]) for n in steps if n in st.graphs}
    gpu = sum(admit_s) + sum(steps[n] * replay.get(n, 0.0) for n in steps) / 1e3
    return {"call_s": round(wall, 4), "tokens": tokens, "steps_by_bucket": dict(steps), "replay_ms": replay,
            "prefill_s": round(sum(admit_s), 4), "gpu_s": round(gpu, 4), "host_s": round(wall - gpu, 4)}


def profile(engine, problems, ids, args) -> None:
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        call(engine, {}, problems, ids, args, workers=0)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=80)
    (args.out / "actor_call_profile.txt").write_text(table)
    print(table, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="SmolLM2-135M-Instruct (GGUF file or directory)")
    p.add_argument("--dataset", help="GSM8K's train.jsonl")
    p.add_argument("--out", type=Path, required=True, help="directory of actor_call.json")
    p.add_argument("--prompts", type=int, default=32, help="prompts a call (the bench's --batch_size)")
    p.add_argument("--group_size", type=int, default=8, help="completions a prompt")
    p.add_argument("--max_new_tokens", type=int, default=256, help="longest completion")
    p.add_argument("--calls", type=int, default=3, help="timed calls of each kind (alternated)")
    p.add_argument("--profile", action="store_true", help="profile one more bare call")
    p.add_argument("--smoke", action="store_true", help="the tiny model on CPU, 2 prompts x 2 of 8 tokens")
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.group_size, args.max_new_tokens, args.calls = 2, 2, 8, 1
    elif not (args.model and args.dataset):
        p.error("--model and --dataset are needed (or --smoke)")
    args.out.mkdir(parents=True, exist_ok=True)
    engine, scorers, problems, ids = setup(args)
    chunk = lambda i: (problems[i * args.prompts:(i + 1) * args.prompts], ids[i * args.prompts:(i + 1) * args.prompts])  # noqa: E731
    for w in scorers:  # warm-up: this state's graphs, math_verify's children
        call(engine, scorers, *chunk(0), args, workers=w)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for i in range(args.calls):
        for kind, (workers, lookahead) in KINDS.items():
            if engine._continuous is not None:
                engine._continuous.lookahead = lookahead
            times[kind].append(round(call(engine, scorers, *chunk(1 + i), args, workers)[0], 4))
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": str(engine.device),
           "reward_workers": DEFAULT_WORKERS,
           "rows": args.prompts * args.group_size, "max_new_tokens": args.max_new_tokens, "calls_s": times,
           **{f"{kind}_s_median": statistics.median(times[kind]) for kind in KINDS}}
    if engine._continuous is not None:
        engine._continuous.lookahead = True  # the default
        res["split"] = gpu_split(engine, *chunk(args.calls + 1), args)
    if args.profile:
        profile(engine, *chunk(args.calls + 1), args)
    (args.out / "actor_call.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
