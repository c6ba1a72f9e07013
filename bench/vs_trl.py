"""distrl against TRL's GRPOTrainer on one GPU, completions/s side by side (issue 23 (d), acceptance 4).

Both sides start from the same weights, sample the same prompts at T = 1 with the same group size, batch,
completion budget and learning rate (full fine-tuning, bf16, no KL term), one after another on the GPU.

Workloads (``--workload``):

- ``fixed``: the Qwen2.5-0.5B architecture with random bf16 weights (``--tokenizer``), task ``half_vocab``
  (its reward varies within every group), completions of ``--max_new_tokens``: TRL is held there by
  ``min_new_tokens``; distrl's rows end at their budget too, since a random model over 151,936 ids almost
  never samples EOS (each side's measured mean completion length is printed beside its rate).
- ``variable``: SmolLM2-135M-Instruct (``--model``) on GSM8K (``--dataset``: its train.jsonl), completions of
  at most ``--max_new_tokens``; each completion ends at its EOS, where the model puts it.

Sides:

- ``distrl``: ``distrl train`` as a user runs it on one GPU (its defaults; ``--engine hf --backend hf
  --finetune full --max_staleness 1``: one actor and one learner sharing the GPU, weights by
  ``--weights_transport``, default ``shm``; ``--distrl_flags`` adds more, and given again runs one more
  distrl side per string in the same run, each with its own ratio); the window is ``--versions``
  policy versions after ``--warmup``, timed from the learner's TensorBoard (``learner/policy_version`` wall
  times; tokens from ``learner/completion_tokens``); one more version runs after it, since the learner writes
  its final checkpoint inside the last (TRL's side saves none). Each distrl side also reports ``startup_s`` (launch
  to the first version), ``recompiles_after_warmup`` (``TORCH_LOGS=recompiles`` in its logs, from the window's
  start) and ``graph_captures_after_warmup``.
- ``trl:<variant>``: GRPOTrainer (``gradient_checkpointing=False``: TRL 1.15 turns it on by default, which only
  saves memory these sizes do not need; ``bf16``; ``beta=0``, one generation per step) with
  :data:`TRL_VARIANTS`: ``hf`` (``model.generate``), ``continuous`` (``use_transformers_continuous_batching``:
  transformers' continuous batching), ``static`` (``cache_implementation="static"``), all ``use_vllm=False``;
  and ``vllm``: ``use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3`` (frozen by issue 43;
  its process gets ``RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR MASTER_PORT``, and the fixed workload's
  floor is vLLM's ``min_tokens`` where HF's is ``min_new_tokens``). The window is ``--versions`` optimizer
  steps after ``--warmup``, timed at each step's end after a CUDA synchronize.

``vs_trl`` = distrl's completions/s over the fastest TRL variant that generates with transformers (``hf``,
``continuous``, ``static``: its meaning before the vLLM side existed); ``vs_trl_vllm`` over ``trl:vllm``'s;
``vs_trl_hf`` over ``trl:hf``'s; ``vs_trl_tokens`` as ``vs_trl`` in generated tokens/s. Each side runs in its
own process (killed by pid after ``--hard_s``).

    python -m bench.vs_trl run --workload fixed --tokenizer DIR --out DIR         (CUDA)
    python -m bench.vs_trl run --workload variable --model SmolLM2.gguf --dataset train.jsonl --out DIR
    python -m bench.vs_trl report DIR [DIR ...]       -> bench/results/vs_trl.json (vs_trl[_vllm|_hf]_WORKLOAD)
    python -m bench.vs_trl smoke --out DIR            (CPU: the tiny model, 2 versions, under a minute)

``run`` prints a table, then one JSON object on the last line (also ``DIR/<workload>.json``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.real_workload import phases, recompiles, scalars  # noqa: E402
from distrl.weights import TRANSPORTS  # noqa: E402

TRL_VARIANTS = {"hf": {}, "continuous": {"use_transformers_continuous_batching": True},
                "static": {"cache_implementation": "static"},
                "vllm": {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}}
RATIOS = {"vs_trl": None, "vs_trl_vllm": "trl:vllm", "vs_trl_hf": "trl:hf"}  # key -> TRL side (None: fastest HF)


def trl_env(variant: str) -> dict:
    """The TRL process's extra environment: vLLM colocated in a one-process "distributed" run needs its ranks and
    a rendezvous address (TRL's external_launcher executor)."""
    if not TRL_VARIANTS[variant].get("use_vllm"):
        return {}
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def task_flags(args) -> list[str]:
    """The `distrl train` task flags of the workload (also what :func:`make_task` loads)."""
    if args.workload == "variable":
        return ["--task", "gsm8k", "--dataset", str(Path(args.dataset).resolve())]
    return ["--task", "half_vocab"]


def make_task(args):
    from distrl.rollout.tasks import load_task

    if args.workload == "variable":
        return load_task("gsm8k", str(Path(args.dataset).resolve()), seed=1)
    return load_task("half_vocab", None, seed=1)


def prepare_model(args, work: Path) -> str:
    """The model directory both sides load: SmolLM2 (variable), a random 0.5B (fixed), the tiny model (smoke)."""
    from distrl.core.gguf import resolve_model

    if args.model == "tiny":
        from distrl.core.tiny import build_tiny_model

        return str(build_tiny_model(work / "tiny", seed=0))
    if args.workload == "variable":
        return str(resolve_model(args.model))
    from bench.gpu_pipeline import build_model

    return str(build_model("qwen2.5-0.5b", args.tokenizer, work / "qwen2.5-0.5b-random"))


def distrl_side(args, flags: str, index: int, model_dir: str, work: Path, out: Path) -> dict:
    """`distrl train` (more ``flags``) to ``--warmup + --versions + 1`` versions; completions/s and tokens/s
    over the window of ``--versions`` after ``--warmup`` (the last version is left out: the learner writes
    the final checkpoint inside it, and TRL's side saves none). ``index``: the variant's place in the run."""
    name = "distrl" if index == 0 else f"distrl{index}"
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    ray_tmp = tempfile.mkdtemp(prefix="vt", dir="/tmp")  # short: Ray's socket paths
    cmd = [sys.executable, "-m", "distrl", "train", "--model", model_dir, *task_flags(args),
           "--max_new_tokens", str(args.max_new_tokens), "--batch_size", str(args.batch_size),
           "--group_size", str(args.group_size), "--max_steps", str(args.warmup + args.versions + 1),
           "--engine", "hf", "--backend", "hf", "--finetune", "full", "--max_staleness", "1",
           "--weights_transport", args.weights_transport,
           "--learning_rate", str(args.lr), "--seed", "1", "--checkpoint_every", "0", "--export_final", "off",
           "--no_console", "--log_dir", str(work), "--run_name", name, *shlex.split(flags)]
    started = time.time()
    how = run_process(cmd, out / f"{name}.log", args.hard_s,
                      {"RAY_TMPDIR": ray_tmp, "TORCH_LOGS": os.environ.get("TORCH_LOGS", "recompiles")})
    try:  # Ray's session logs hold the roles' stderr: read before they go
        timed = phases(run_dir, args.warmup, args.versions)  # not the last: it also writes the final checkpoint
        if not timed.get("versions"):
            return {"side": name, "how": how, "command": " ".join(cmd[2:])}
        after, total = recompiles([out / f"{name}.log", run_dir / "logs", Path(ray_tmp)], timed["measured_from_wall"])
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    summary = run_dir / "summary.json"  # its start-up phases (distrl.core.startup)
    startup = json.loads(summary.read_text()).get("startup", {}).get("phases_s") if summary.is_file() else None
    n, wall = timed["versions"], sum(timed["times"])
    steps = set(range(args.warmup + 1, args.warmup + n + 1))
    tokens = sum(v for _, s, v in scalars(run_dir / "tb" / "learner0").get("learner/completion_tokens", [])
                 if s in steps)
    return rates(name, how, n, wall, tokens, args) | {
        "command": " ".join(cmd[2:]), "split_s": timed["split_s"], "version_s_median": timed["version_s_median"],
        "startup_s": round(timed["first_version_wall"] - started, 1), "recompiles_after_warmup": after,
        "recompiles": total, "graph_captures_after_warmup": timed["graph_captures_after_warmup"],
        "startup_phases_s": startup}


def rates(side: str, how: str, steps: int, wall: float, tokens: float, args) -> dict:
    completions = steps * args.batch_size * args.group_size
    return {"side": side, "how": how, "steps": steps, "wall_s": round(wall, 3),
            "completions_per_s": round(completions / wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "mean_completion_tokens": round(tokens / completions, 1)}


def trl_side(args, variant: str, model_dir: str, work: Path, out: Path) -> dict:
    """One TRL variant in its own process (``trl`` mode of this module); its JSON."""
    path = out / f"trl_{variant}.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.vs_trl", "trl", variant, "--model_dir", model_dir, "--work", str(work),
           "--out", str(out), *[f"--{k}={getattr(args, k)}" for k in SHARED if getattr(args, k) is not None]]
    how = run_process(cmd, out / f"trl_{variant}.log", args.hard_s, trl_env(variant))
    result = json.loads(path.read_text()) if path.is_file() else {}
    return {"side": f"trl:{variant}", **result, "how": result.get("how", how)}


def trl_case(args, variant: str) -> None:
    """GRPOTrainer with :data:`TRL_VARIANTS` [variant] over the window; writes ``trl_<variant>.json``."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task, tok = make_task(args), AutoTokenizer.from_pretrained(args.model_dir)
    stream = task.problems(1)
    problems = [next(stream) for _ in range(args.batch_size * (args.warmup + args.versions + 2))]
    ds = Dataset.from_dict({"prompt": [task.prompt(p, tok) for p in problems], "idx": list(range(len(problems)))})
    stamps, lengths, cuda = [], [], torch.cuda.is_available()

    class Window(TrainerCallback):
        def on_step_end(self, *a, **kw):
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.time())

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    def reward(completions, idx, completion_ids, **kw):
        return [task.reward(text, ids, problems[i])[0] for text, ids, i in zip(completions, completion_ids, idx)]

    settings = {"use_vllm": False, **TRL_VARIANTS[variant]}
    floor = "min_tokens" if settings["use_vllm"] else "min_new_tokens"  # vLLM's SamplingParams; HF's generate
    if args.workload == "fixed":
        settings["generation_kwargs"] = {floor: args.max_new_tokens}
    cfg = GRPOConfig(output_dir=str(Path(args.work) / f"trl_{variant}"), per_device_train_batch_size=args.batch_size
                     * args.group_size, gradient_accumulation_steps=1, num_generations=args.group_size,
                     max_steps=args.warmup + args.versions, max_completion_length=args.max_new_tokens,
                     temperature=1.0, top_p=1.0, beta=0.0, learning_rate=args.lr, lr_scheduler_type="constant",
                     gradient_checkpointing=False, bf16=cuda, logging_steps=1, save_strategy="no", report_to="none",
                     model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"}, seed=1,
                     use_cpu=not cuda, dataloader_num_workers=0, **settings)
    trainer = GRPOTrainer(model=args.model_dir, reward_funcs=reward, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Window()])
    trainer.train()
    first, last = args.warmup, args.warmup + args.versions  # stamps[k - 1]: the end of step k
    window = lengths[first:last]
    tokens = sum(window) * args.batch_size * args.group_size * args.versions / max(len(window), 1)
    result = rates(f"trl:{variant}", "finished", args.versions, stamps[last - 1] - stamps[first - 1], tokens, args)
    settings.pop("generation_kwargs", None)
    result["command"] = (f"GRPOConfig(gradient_checkpointing=False, bf16={cuda}, beta=0, "
                         f"loss_type={cfg.loss_type!r}, per_device_train_batch_size={cfg.per_device_train_batch_size}, "
                         f"num_generations={args.group_size}, max_completion_length={args.max_new_tokens}"
                         + "".join(f", {k}={v!r}" for k, v in settings.items())
                         + (f", generation_kwargs={{'{floor}': {args.max_new_tokens}}})" if args.workload == "fixed"
                            else ")"))
    (Path(args.out) / f"trl_{variant}.json").write_text(json.dumps(result, indent=1))


def run_process(cmd: list[str], log: Path, hard_s: float, env: dict) -> str:
    """Run ``cmd`` from the repository root with its output in ``log``; killed (by pid) after ``hard_s``."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
        try:
            return f"exited {proc.wait(timeout=hard_s)}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return "killed at --hard_s"


def summarize(workload: str, sides: list[dict]) -> dict:
    """The first distrl side's (the run's own flags) ratios, completions/s over each :data:`RATIOS` TRL side's:
    ``vs_trl`` over the fastest variant that generates with transformers (``trl_best``; ``vs_trl_tokens`` the
    same in tokens/s), ``vs_trl_vllm`` over ``trl:vllm``, ``vs_trl_hf`` over ``trl:hf`` (None: that side has no
    window); and every side. Each further distrl side (``--distrl_flags`` given again) gets its own ratios."""
    timed = {s["side"]: s for s in sides if s["side"].startswith("trl:") and "completions_per_s" in s}
    hf = [s for name, s in timed.items() if not TRL_VARIANTS.get(name[4:], {}).get("use_vllm")]
    best = max(hf, key=lambda s: s["completions_per_s"], default=None)
    against = {key: best if name is None else timed.get(name) for key, name in RATIOS.items()}

    def ratio(side, other, key):
        ok = side and "completions_per_s" in side and other and other[key]
        return round(side[key] / other[key], 3) if ok else None

    distrl = [s for s in sides if s["side"].startswith("distrl")]
    for side in distrl[1:]:
        side.update({key: ratio(side, other, "completions_per_s") for key, other in against.items()})
    first = distrl[0] if distrl else None
    ratios = {key: ratio(first, other, "completions_per_s") for key, other in against.items()}
    return {"workload": workload, "vs_trl": ratios.pop("vs_trl"), "vs_trl_tokens": ratio(first, best, "tokens_per_s"),
            "trl_best": best["side"] if best else None, **ratios, "sides": sides}


def table(summary: dict) -> str:
    rows = [f"{'side':<12} {'steps':>5} {'wall s':>8} {'compl/s':>8} {'tok/s':>9} {'mean len':>8}  how"]
    for s in summary["sides"]:
        if "completions_per_s" not in s:
            rows.append(f"{s['side']:<12} no window ({s.get('how')})")
            continue
        rows.append(f"{s['side']:<12} {s['steps']:>5} {s['wall_s']:>8.2f} {s['completions_per_s']:>8.2f} "
                    f"{s['tokens_per_s']:>9.1f} {s['mean_completion_tokens']:>8.1f}  {s['how']}"
                    + (f", vs_trl {s['vs_trl']}" if "vs_trl" in s else "")
                    + (f", start-up {s['startup_s']} s, recompiles after warm-up {s['recompiles_after_warmup']}"
                       if "startup_s" in s else ""))
    for i, flags in enumerate(summary.get("distrl_flags", [])):
        rows.append(f"{'distrl' if i == 0 else f'distrl{i}'}: {flags or '(defaults)'}")
    rows.append(f"{summary['workload']}: distrl / fastest TRL ({summary['trl_best']}) = {summary['vs_trl']} "
                f"completions/s, {summary['vs_trl_tokens']} tokens/s; / trl:vllm = {summary.get('vs_trl_vllm')}, "
                f"/ trl:hf = {summary.get('vs_trl_hf')}")
    return "\n".join(rows)


def run(args) -> dict:
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(args, work)
    sides = [distrl_side(args, flags, i, model_dir, work, out) for i, flags in enumerate(args.distrl_flags)]
    sides += [trl_side(args, variant, model_dir, work, out) for variant in args.trl.split(",") if variant]
    summary = summarize(args.workload, sides) | {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                                                 "distrl_flags": args.distrl_flags}
    (out / f"{args.workload}.json").write_text(json.dumps(summary, indent=1))
    print(table(summary))
    print(json.dumps(summary))
    return summary


def report(dirs: list[str], note: str, path: Path = ROOT / "bench" / "results" / "vs_trl.json") -> dict:
    """Adds the runs in ``dirs`` to bench/results/vs_trl.json, keeping every key it holds: each run's summary
    (with ``note``) under ``runs`` (a run already there, same workload and date, is not added again), each ratio
    of :data:`RATIOS` to ``<ratio>_<workload>_runs``, and ``<ratio>_<workload>`` = the smallest of these runs'
    (a ratio none of them measured keeps its value)."""
    out = json.loads(path.read_text()) if path.is_file() else {}
    seen = {(r.get("workload"), r.get("date")) for r in out.get("runs", [])}
    runs = [json.loads(p.read_text()) | {"note": note} for d in dirs for p in sorted(Path(d).glob("*.json"))
            if p.stem in ("fixed", "variable")]
    runs = [r for r in runs if (r["workload"], r.get("date")) not in seen]
    out["runs"] = out.get("runs", []) + runs
    for workload in ("fixed", "variable"):
        for key in RATIOS:
            ratios = [r.get(key) for r in runs if r["workload"] == workload and r.get(key) is not None]
            out[f"{key}_{workload}_runs"] = out.get(f"{key}_{workload}_runs", []) + ratios
            if ratios:
                out[f"{key}_{workload}"] = min(ratios)
            out.setdefault(f"{key}_{workload}", None)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k.startswith("vs_trl")}))
    return out


def smoke(args) -> int:
    """CPU: the tiny model, ``fixed``, 4 prompts x 2 completions of 5 tokens, 1 + 2 versions a side, TRL
    ``hf`` only where triton imports (TRL 1.15's GRPOTrainer computes its logprobs with a triton kernel; the
    CPU stack has no triton); exit code 1 unless each side that ran timed its window."""
    args.model, args.workload, args.warmup, args.versions = "tiny", "fixed", 1, 2
    args.trl = "hf" if importlib.util.find_spec("triton") else ""
    args.batch_size, args.group_size, args.max_new_tokens = 4, 2, 5
    args.distrl_flags = [(flags + " --torch_threads 1").strip() for flags in args.distrl_flags]
    args.work = tempfile.mkdtemp(prefix="vs_trl_")
    try:
        summary = run(args)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0 if all("completions_per_s" in side for side in summary["sides"]) else 1


SHARED = ("workload", "dataset", "max_new_tokens", "batch_size", "group_size", "lr", "warmup", "versions")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["run", "report", "smoke", "trl"])
    parser.add_argument("names", nargs="*", help="report: run output directories; trl: the variant")
    parser.add_argument("--workload", choices=["fixed", "variable"], default="fixed")
    parser.add_argument("--model", default=None, help="variable: SmolLM2-135M-Instruct (GGUF file or directory)")
    parser.add_argument("--tokenizer", default=None, help="fixed: tokenizer directory of the random 0.5B (Qwen2.5)")
    parser.add_argument("--dataset", default=None, help="variable: GSM8K's train.jsonl")
    parser.add_argument("--trl", default="hf,vllm",
                        help=f"TRL variants, comma-separated: {', '.join(TRL_VARIANTS)}; none: no TRL side")
    parser.add_argument("--weights_transport", default="shm", choices=sorted(TRANSPORTS),
                        help="distrl's (shm: full weights through host shared memory, no file)")
    parser.add_argument("--distrl_flags", action="append", default=None,
                        help="more `distrl train` flags (one string); given again, each string is one more distrl "
                             "side in the same run (the first one's ratio is the run's vs_trl)")
    parser.add_argument("--max_new_tokens", type=int, default=None, help="default: fixed 128, variable 256")
    parser.add_argument("--batch_size", type=int, default=32, help="prompts per version (TRL: per step)")
    parser.add_argument("--group_size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--lr", type=float, default=2e-6, help="learning rate, both sides")
    parser.add_argument("--warmup", type=int, default=3, help="versions (steps) left out at the start")
    parser.add_argument("--versions", type=int, default=15, help="versions (steps) timed")
    parser.add_argument("--hard_s", type=float, default=900.0, help="kill a side after this many seconds")
    parser.add_argument("--out", default="vs_trl_out", help="logs and JSON")
    parser.add_argument("--work", default="/tmp/vs_trl", help="run directories and the built model")
    parser.add_argument("--model_dir", default=None, help=argparse.SUPPRESS)  # trl mode: the prepared model
    parser.add_argument("--note", default="", help="report: a line kept in the JSON (machine, commit, command)")
    args = parser.parse_args(argv)
    args.distrl_flags = args.distrl_flags or [""]
    args.trl = "" if args.trl == "none" else args.trl
    if args.max_new_tokens is None:
        args.max_new_tokens = 256 if args.workload == "variable" else 128
    if args.mode == "run" and args.workload == "variable" and not (args.model and args.dataset):
        parser.error("--workload variable needs --model (SmolLM2) and --dataset (GSM8K train.jsonl)")
    if args.mode == "run" and args.workload == "fixed" and not args.tokenizer and args.model != "tiny":
        parser.error("--workload fixed needs --tokenizer (the Qwen2.5 tokenizer directory)")
    unknown = [v for v in args.trl.split(",") if v and v not in TRL_VARIANTS]
    if unknown:
        parser.error(f"--trl: unknown variant(s) {', '.join(unknown)}; expected {', '.join(TRL_VARIANTS)}")
    if args.mode == "smoke":
        sys.exit(smoke(args))
    if args.mode == "trl":
        trl_case(args, args.names[0])
    elif args.mode == "run":
        run(args)
    else:
        report(args.names, args.note)


if __name__ == "__main__":
    main()
