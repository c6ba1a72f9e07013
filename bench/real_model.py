"""A real pretrained model learns on one GPU: SmolLM2-135M-Instruct on `arith`, distrl against TRL (issue 19).

The task: ``a + b`` and ``a - b`` with integers in [0, 99], the plain prompt ``What is {question}? Answer
with just the number.`` through SmolLM2's chat template, reward 1 when the completion's final answer
(``distrl.rollout.answers``) equals the result. Held-out greedy accuracy on 256 fixed problems
(``ArithTask.heldout(256, seed 0)``, never trained on), 24 new tokens.

Cases (``--cases``, run at the same time as subprocesses on the one GPU, each with its own log):

- ``distrl<i>``: ``distrl train`` (one actor and one learner sharing the GPU, full fine-tuning, HF engine,
  ``--max_staleness 1``, weights by ``--weights_transport``, default ``shm``) with seed i; actor 0 evaluates
  every ``--eval_every`` versions (``eval.jsonl``).
- ``trl``: TRL's GRPOTrainer with the same model, prompts, reward, group size, batch, learning rate and
  completion length (``beta 0``, HF generate); a callback evaluates with the same engine code and problems.
- ``unsloth``, ``qlora``, ``hflora``: ``distrl train --finetune lora`` with ``--backend unsloth`` (16-bit
  LoRA), ``--backend unsloth --load_in_4bit`` (QLoRA) and ``--backend hf`` (LoRA through peft).
- ``vllm``, ``vllm_lora``: ``distrl1`` and ``hflora`` with ``--engine vllm --gpu_memory_utilization 0.2``
  (vLLM for CUDA, issue 22).

Clocks: a case's training time excludes its start-up (before the version-0 evaluation) and every
evaluation; a case is stopped (SIGINT to ``distrl train``) once its training time passes ``--minutes``.
Each case writes ``<case>.json`` with its curve ``[[train_s, version, accuracy], ...]``; ``report``
combines the cases of one or more ``run`` directories into ``bench/results/real_model.json``
(``accuracy_before``, ``accuracy_after``, ``heldout_gain``, ``train_wall_s``, ``trl_accuracy_after``,
``vs_trl_time_to_accuracy``: the smallest of ``vs_trl_time_to_accuracy_runs``, where run k is the k-th ``distrl1``
against the k-th ``trl`` case and ``report`` names a case met again ``case#2``; ``unsloth_lora_gain``,
``qlora_gain``, ``qlora_peak_mem_gib``, per case detail) and the plot ``docs/real_model.png``.

Usage (GPU): ``python -m bench.real_model run --model SmolLM2.gguf --out DIR --cases distrl1,distrl2,trl``;
``python -m bench.real_model report DIR [DIR ...]``. On CPU, a smoke run: ``--minutes 0.5 --eval_size 8``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.results_file import merge
from distrl.weights import TRANSPORTS

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = "What is {question}? Answer with just the number."
TASK_FLAGS = ["--task", "arith", "--arith_ops", "+-", "--arith_max_operand", "99", "--prompt_template", TEMPLATE]
LORA = {"unsloth": ["--backend", "unsloth"], "qlora": ["--backend", "unsloth", "--load_in_4bit"],
        "hflora": ["--backend", "hf"]}


def train_seconds(lines: list[dict]) -> list[tuple[float, int, float]]:
    """``(training seconds, version, accuracy)`` per eval.jsonl line: wall time after the version-0
    evaluation, less every evaluation's own time (``wall_s`` is stamped after each evaluation)."""
    lines = sorted(lines, key=lambda line: line["version"])
    if not lines:
        return []
    start, evals, curve = lines[0]["wall_s"] - lines[0]["eval_s"], 0.0, []
    for line in lines:
        evals += line["eval_s"]
        curve.append((round(line["wall_s"] - evals - start, 2), line["version"], line["accuracy"]))
    return curve


def distrl_command(args, case: str, work: Path) -> list[str]:
    """The `distrl train` command line of a distrl case (distrl<seed>, unsloth, qlora, hflora)."""
    lora = case in LORA or case == "vllm_lora"
    seed = case[len("distrl"):] if case.startswith("distrl") else "1"
    engine = ["vllm", "--gpu_memory_utilization", "0.2"] if case.startswith("vllm") else ["hf"]
    cmd = [sys.executable, "-m", "distrl", "train", "--model", args.model, *TASK_FLAGS,
           "--max_new_tokens", str(args.max_new_tokens), "--batch_size", str(args.batch_size),
           "--group_size", str(args.group_size), "--engine", *engine, "--max_staleness", "1",
           "--eval_every", str(args.eval_every), "--eval_size", str(args.eval_size), "--max_steps", "100000",
           "--checkpoint_every", "0", "--export_final", "off", "--no_console", "--seed", seed,
           "--log_dir", str(work), "--run_name", case]
    if lora:
        return cmd + ["--finetune", "lora", "--lora_rank", "16", "--learning_rate", str(args.lora_lr),
                      *LORA.get(case, ["--backend", "hf"])]
    return cmd + ["--finetune", "full", "--backend", "hf", "--learning_rate", str(args.lr),
                  "--weights_transport", args.weights_transport]


def read_eval(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def peak_memory_gib(tb_dir: Path) -> float | None:
    """The largest ``learner/peak_memory_gib`` the learner logged (None without a GPU)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for run in tb_dir.glob("learner*"):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        if "learner/peak_memory_gib" in acc.Tags()["scalars"]:
            values += [e.value for e in acc.Scalars("learner/peak_memory_gib")]
    return round(max(values), 3) if values else None


def stop_when_done(proc: subprocess.Popen, eval_path: Path, minutes: float, hard_s: float) -> str:
    """Wait until `proc` ends, its training time passes `minutes` (then SIGINT, by pid) or `hard_s` pass."""
    t0 = time.time()
    while proc.poll() is None:
        curve = train_seconds(read_eval(eval_path))
        if (curve and curve[-1][0] >= 60 * minutes) or time.time() - t0 > hard_s:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
            return "stopped at the time cap" if curve and curve[-1][0] >= 60 * minutes else "stopped at --hard_s"
        time.sleep(2)
    return f"exited {proc.returncode}"


def run_distrl(args, case: str, out: Path) -> dict:
    """One distrl case to the time cap; its curve and peak learner memory."""
    work = Path(args.work)
    log = open(out / f"{case}.log", "w")
    env = {**os.environ, "RAY_TMPDIR": str(work / f"ray_{case}"), "PYTHONUNBUFFERED": "1"}
    Path(env["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    command = distrl_command(args, case, work)
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    how = stop_when_done(proc, work / case / "eval.jsonl", args.minutes, args.hard_s)
    lines = read_eval(work / case / "eval.jsonl")
    return {"case": case, "how": how, "curve": train_seconds(lines),
            "command": " ".join(command[2:]),
            "peak_memory_gib": peak_memory_gib(work / case / "tb"), "wall_s": lines[-1]["wall_s"] if lines else None}


def arith_task(seed: int, eval_size: int):
    """The cases' task and held-out problems: the ones `distrl train --seed seed --eval_size n` uses."""
    from distrl.rollout.tasks import load_task

    task = load_task("arith", None, seed=seed, arith_ops=("+", "-"), arith_max_operand=99)
    task.set_prompt(TEMPLATE)
    return task, task.heldout(eval_size, seed)


def run_trl(args, out: Path) -> dict:
    """TRL's GRPOTrainer on distrl1's problems (seed 1), evaluated every --eval_every steps by the engine
    code and held-out problems distrl's actor 0 uses; stopped once its training time passes --minutes."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from distrl.core.gguf import resolve_model
    from distrl.rollout.engines.hf import HFEngine
    from distrl.rollout.evaluation import evaluate_engine

    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    task, heldout = arith_task(1, args.eval_size)
    stream = task.problems(1)
    problems = [next(stream) for _ in range(args.batch_size * 3000)]
    ds = Dataset.from_dict({"prompt": [task.prompt(p, tok) for p in problems], "idx": list(range(len(problems)))})
    curve, clock = [], {"t0": 0.0, "evals": 0.0, "engine": None, "started": time.time()}

    def evaluate(model, step: int) -> None:
        t = time.time()
        if clock["engine"] is None:
            clock["engine"] = HFEngine.sharing(model, tok, seed=0)
        clock["engine"].version = step
        training, _ = model.training, model.eval()  # train mode would recompute layers (gradient checkpointing)
        try:
            report = evaluate_engine(clock["engine"], task, heldout, max_new_tokens=args.max_new_tokens, seed=0)
        finally:
            model.train(training)
        curve.append((round(t - clock["t0"] - clock["evals"], 2), step, report.metrics["accuracy"]))
        clock["evals"] += time.time() - t

    class Eval(TrainerCallback):
        def on_train_begin(self, a, state, control, model=None, **kw):
            clock["t0"] = time.time()
            evaluate(model, 0)

        def on_step_end(self, a, state, control, model=None, **kw):
            if state.global_step % args.eval_every == 0:
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                evaluate(model, state.global_step)
                control.should_training_stop = (curve[-1][0] >= 60 * args.minutes
                                                 or time.time() - clock["started"] > args.hard_s)

    def reward(completions, idx, completion_ids, **kw):
        return [task.reward(text, ids, problems[i])[0] for text, ids, i in zip(completions, completion_ids, idx)]

    cuda = torch.cuda.is_available()
    cfg = GRPOConfig(output_dir=str(Path(args.work) / "trl"), gradient_accumulation_steps=1,
                     per_device_train_batch_size=args.batch_size * args.group_size,
                     num_generations=args.group_size, max_steps=3000,
                     max_completion_length=args.max_new_tokens, temperature=1.0, beta=0.0, learning_rate=args.lr,
                     lr_scheduler_type="constant", bf16=cuda, logging_steps=10, save_strategy="no", report_to="none",
                     gradient_checkpointing=False,  # TRL 1.15's default is True: slower, memory 135M does not need
                     use_vllm=False, model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"}, seed=1,
                     use_cpu=not cuda, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Eval()])
    trainer.train()
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None
    how = "stopped at the time cap" if curve[-1][0] >= 60 * args.minutes else "stopped at --hard_s"
    return {"case": "trl", "how": how, "curve": curve, "peak_memory_gib": peak,
            "command": f"trl.GRPOTrainer, GRPOConfig(learning_rate={args.lr}, lr_scheduler_type='constant', beta=0, "
                       f"per_device_train_batch_size={args.batch_size * args.group_size}, num_generations="
                       f"{args.group_size}, max_completion_length={args.max_new_tokens}, use_vllm=False, "
                       "gradient_checkpointing=False, bf16)"}


def run_case(args, case: str, out: Path) -> dict:
    result = run_trl(args, out) if case == "trl" else run_distrl(args, case, out)
    (out / f"{case}.json").write_text(json.dumps(result, indent=1))
    return result


def time_to(curve: list, target: float) -> float | None:
    """Training seconds of the first evaluation at or above `target` (None: never)."""
    return next((t for t, _, acc in curve if acc >= target), None)


def time_to_accuracy(results: dict[str, dict]) -> dict:
    """distrl against TRL, run by run: the k-th ``distrl1`` case (``distrl1``, ``distrl1#2``, ...: seed 1, TRL's
    problems and held-out set) against the k-th ``trl`` case; the target is their common starting accuracy
    + 0.10 (the same model on the same problems). ``vs_trl_time_to_accuracy`` is the smallest run's ratio."""
    base = lambda c: c.split("#")[0]  # noqa: E731 - a case's name without the run suffix of `report`
    distrl = [r["curve"] for c, r in results.items() if base(c) == "distrl1" and r["curve"]]
    trl = [r["curve"] for c, r in results.items() if base(c) == "trl" and r["curve"]]
    if not distrl or not trl:
        return {}
    target = round(trl[0][0][2] + 0.10, 4)
    times = [time_to(c, target) for c in distrl]
    trl_times = [time_to(c, target) for c in trl]
    ratios = [round(t / d, 3) if t and d else None for d, t in zip(times, trl_times)]
    known = [r for r in ratios if r is not None]
    return {"trl_accuracy_after": [c[-1][2] for c in trl], "target_accuracy": target,
            "distrl_time_to_target_s": times, "trl_time_to_target_s": trl_times,
            "trl_cap_s": [c[-1][0] for c in trl], "vs_trl_time_to_accuracy_runs": ratios,
            "vs_trl_time_to_accuracy": min(known) if known else None}


def summarize(results: dict[str, dict]) -> dict:
    """The JSON of bench/results/real_model.json from the cases' results (see the module docstring)."""
    runs = {c: r for c, r in results.items() if c.startswith("distrl") and r["curve"]}
    gain = {c: r["curve"][-1][2] - r["curve"][0][2] for c, r in results.items() if r["curve"]}
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
    out = {"accuracy_before": mean([r["curve"][0][2] for r in runs.values()]),
           "accuracy_after": mean([r["curve"][-1][2] for r in runs.values()]),
           "heldout_gain": mean([gain[c] for c in runs]),
           "train_wall_s": mean([r["curve"][-1][0] for r in runs.values()])}
    out.update(time_to_accuracy(results))
    for key, case in (("unsloth_lora_gain", "unsloth"), ("qlora_gain", "qlora"), ("hf_lora_gain", "hflora"),
                      ("vllm_gain", "vllm"), ("vllm_lora_gain", "vllm_lora")):
        if case in gain:
            out[key] = round(gain[case], 4)
    if "qlora" in results:
        out["qlora_peak_mem_gib"] = results["qlora"]["peak_memory_gib"]
    out["cases"] = {c: {"gain": round(gain.get(c, float("nan")), 4), "versions": r["curve"][-1][1] if r["curve"] else 0,
                        "train_s": r["curve"][-1][0] if r["curve"] else None, "peak_memory_gib": r["peak_memory_gib"],
                        "how": r["how"], "curve": r["curve"], "command": r["command"]} for c, r in results.items()}
    return out


def table(summary: dict) -> str:
    rows = [f"{'case':<9} {'before':>7} {'after':>7} {'gain':>7} {'versions':>8} {'train_s':>8} {'v/min':>6} "
            f"{'peak GiB':>8}"]
    for case, c in summary["cases"].items():
        curve = c["curve"]
        if not curve:
            rows.append(f"{case:<9} no evaluation ({c['how']})")
            continue
        per_min = 60 * curve[-1][1] / curve[-1][0] if curve[-1][0] else float("nan")
        rows.append(f"{case:<9} {curve[0][2]:>7.3f} {curve[-1][2]:>7.3f} {c['gain']:>+7.3f} {curve[-1][1]:>8} "
                    f"{curve[-1][0]:>8.0f} {per_min:>6.1f} {c['peak_memory_gib'] or float('nan'):>8.2f}")
    keys = ("target_accuracy", "distrl_time_to_target_s", "trl_time_to_target_s", "vs_trl_time_to_accuracy_runs")
    rows += [f"{k}: {summary[k]}" for k in keys if k in summary]
    return "\n".join(rows)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for case, c in summary["cases"].items():
        if c["curve"]:
            ax.plot([t / 60 for t, _, _ in c["curve"]], [a for _, _, a in c["curve"]], marker=".", label=case)
    if "target_accuracy" in summary:
        ax.axhline(summary["target_accuracy"], color="grey", linestyle=":", label="target (base + 0.10)")
    ax.set_xlabel("training minutes (start-up and evaluations left out)")
    ax.set_ylabel("held-out greedy accuracy (256 problems)")
    ax.set_title("SmolLM2-135M-Instruct, arith +/- (operands <= 99), one H200")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args) -> None:
    """Every case of --cases at the same time (each its own process), then the table and the JSON line."""
    from distrl.core.gguf import resolve_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.model = resolve_model(args.model)  # once, before the cases share its cache
    forward = sys.argv[2:]
    procs = {case: subprocess.Popen([sys.executable, "-m", "bench.real_model", "case", case, *forward], cwd=ROOT,
                                    stdout=open(out / f"{case}.case.log", "w"), stderr=subprocess.STDOUT)
             for case in args.cases.split(",")}
    for proc in procs.values():
        proc.wait()
    results = {c: json.loads((out / f"{c}.json").read_text()) for c in procs if (out / f"{c}.json").is_file()}
    summary = summarize(results)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(table(summary))
    print(json.dumps({k: v for k, v in summary.items() if k != "cases"}))


def report(args) -> None:
    """Combine the cases of run directories into bench/results/real_model.json and docs/real_model.png."""
    results = {}
    for directory in args.dirs:
        for path in sorted(Path(directory).glob("*.json")):
            if path.name != "summary.json":  # a case met again (a second run) is `case#2`, `case#3`, ...
                name = next(n for k in range(1, 99) if (n := path.stem + (f"#{k}" if k > 1 else "")) not in results)
                results[name] = json.loads(path.read_text())
    summary = summarize(results)
    summary["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    merge(ROOT / "bench" / "results" / "real_model.json", summary)
    plot(summary, ROOT / "docs" / "real_model.png")
    print(table(summary))
    print(json.dumps({k: v for k, v in summary.items() if k != "cases"}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["run", "case", "report"])
    parser.add_argument("names", nargs="*", help="case: the case's name; report: run directories")
    parser.add_argument("--model", default=None, help="GGUF file or model directory (SmolLM2-135M-Instruct)")
    parser.add_argument("--cases", default="distrl1,distrl2,trl", help="comma-separated cases (module docstring)")
    parser.add_argument("--out", default="real_model_out", help="directory of the cases' logs and JSON")
    parser.add_argument("--work", default="/tmp/real_model", help="run directories")
    parser.add_argument("--minutes", type=float, default=8.0, help="training minutes per case (the time cap)")
    parser.add_argument("--hard_s", type=float, default=900.0, help="stop a case after this many seconds regardless")
    parser.add_argument("--weights_transport", default="shm", choices=sorted(TRANSPORTS),
                        help="the full fine-tuning cases' (LoRA cases: fs)")
    parser.add_argument("--lr", type=float, default=2e-5, help="learning rate, full fine-tuning (distrl and TRL)")
    parser.add_argument("--lora_lr", type=float, default=2e-4, help="learning rate of the LoRA cases")
    parser.add_argument("--batch_size", type=int, default=32, help="prompts per policy version")
    parser.add_argument("--group_size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=24, help="completion length")
    parser.add_argument("--eval_every", type=int, default=5, help="versions (TRL: steps) between evaluations")
    parser.add_argument("--eval_size", type=int, default=256, help="held-out problems")
    args = parser.parse_args(argv)
    if args.mode == "case":
        out = Path(args.out)
        run_case(args, args.names[0], out)
    elif args.mode == "run":
        run(args)
    else:
        args.dirs = args.names
        report(args)


if __name__ == "__main__":
    main()
