"""A real model with a tool: SmolLM2-135M-Instruct and the ``calculator`` environment against the same model and
budget without it (issue 44, acceptance 4).

The task: ``arith`` multiplication of operands in [0, ``--max_operand``] (default 999: products of up to six
digits, which a 135M model does not compute in its head), the plain prompt of ``bench/real_model.py``
(``What is {question}? Answer with just the number.``) through SmolLM2's chat template. Two arms, each
``distrl train`` (one actor and one learner on the GPU, full fine-tuning, HF engine, ``--max_staleness 1``), one
after another on the GPU, with the same seed, warm-start steps, learning rate, batch, group and training minutes:

- ``tool``: ``--env calculator``: the model writes ``<calc>EXPR</calc>``, the environment answers with the value
  (a tool turn of the chat template), the model then answers; the supervised warm start
  (``--warm_start_steps``) trains on whole demonstrated episodes (``distrl.rollout.envs.demonstrations``: loss on
  the model's turns only), so it learns the call format.
- ``notool``: no environment; the same warm start trains on the direct answers (gold after the prompt).

Held-out greedy accuracy (actor 0's evaluator, ``--eval_size`` fixed problems never trained on; with ``--env``
each is a whole episode through the environment) every ``--eval_every`` versions; an arm is stopped (SIGINT)
once its training time passes ``--minutes`` (the clock of ``bench/real_model.py``: wall time after the version-0
evaluation, less every evaluation). ``tool_gain`` = the tool arm's last held-out accuracy minus the no-tool arm's
(equal to the difference of their held-out gains over any common base, so over the base model's as well);
``turns_mean`` = the tool arm's mean turns per episode (TensorBoard ``actor/turns_mean``, mean over versions);
``episodes_per_s`` = the tool arm's training episodes (completions) per second of its training window
(``learner/policy_version`` wall times and groups x group size). Each arm's version-0 accuracy (after the warm
start) and last accuracy are kept.

    python -m bench.multiturn run --model SmolLM2.gguf --out DIR [--seed S]     (one run: both arms)
    python -m bench.multiturn report DIR [DIR ...]    -> bench/results/multiturn.json (tool_gain: the latest run;
                                                         tool_gain_runs: every run)
    python -m bench.multiturn run --model tiny --max_operand 99 --minutes 0.3 --warm_start_steps 20 --eval_size 8
                                                         (CPU smoke)

``run`` prints a table, then one JSON object on the last line (also ``DIR/multiturn.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.real_model import TEMPLATE, read_eval, stop_when_done, train_seconds
from bench.results_file import merge

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"tool": ["--env", "calculator"], "notool": []}


def command(args, arm: str, work: Path) -> list[str]:
    """The arm's ``distrl train`` command line."""
    return [sys.executable, "-m", "distrl", "train", "--model", args.model, "--task", "arith", "--arith_ops", "*",
            "--arith_max_operand", str(args.max_operand), "--prompt_template", TEMPLATE, *ARMS[arm],
            "--warm_start_steps", str(args.warm_start_steps), "--warm_start_lr", str(args.warm_start_lr),
            "--warm_start_batch_size", str(args.warm_start_batch_size),
            "--max_new_tokens", str(args.max_new_tokens), "--batch_size", str(args.batch_size),
            "--group_size", str(args.group_size), "--engine", "hf", "--backend", "hf", "--finetune", "full",
            "--learning_rate", str(args.lr), "--max_staleness", "1", "--eval_every", str(args.eval_every),
            "--eval_size", str(args.eval_size), "--max_steps", str(args.max_steps), "--checkpoint_every", "0",
            "--export_final", "off", "--no_console", "--seed", str(args.seed), *args.extra.split(),
            "--log_dir", str(work), "--run_name", arm]


def scalar_mean(tb_dir: Path, tag: str) -> list[tuple[float, float]]:
    """``(wall_time, value)`` of every event of ``tag`` in the run's TensorBoard directories."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = []
    for run in sorted(p for p in tb_dir.iterdir() if p.is_dir()) if tb_dir.is_dir() else []:
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            events += [(e.wall_time, e.value) for e in acc.Scalars(tag)]
    return sorted(events)


def episodes_per_s(run_dir: Path, group_size: int, batch_size: int) -> float | None:
    """Completions trained per second between the first and the last published version (TensorBoard)."""
    versions = scalar_mean(run_dir / "tb", "learner/policy_version")
    if len(versions) < 2:
        return None
    (t0, v0), (t1, v1) = versions[0], versions[-1]
    return round((v1 - v0) * batch_size * group_size / (t1 - t0), 2) if t1 > t0 else None


def run_arm(args, arm: str, out: Path) -> dict:
    """One arm to the time cap: its held-out curve, turns and episodes per second."""
    work = Path(args.work)
    run_dir, eval_path = work / arm, work / arm / "eval.jsonl"
    env = {**os.environ, "RAY_TMPDIR": str(work / f"ray_{arm}"), "PYTHONUNBUFFERED": "1"}
    Path(env["RAY_TMPDIR"]).mkdir(parents=True, exist_ok=True)
    cmd = command(args, arm, work)

    def done() -> str | None:
        curve = train_seconds(read_eval(eval_path))
        return "stopped at the time cap" if curve and curve[-1][0] >= 60 * args.minutes else None

    t0 = time.time()
    with open(out / f"{arm}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        how = stop_when_done(proc, done, args.hard_s)
    curve = train_seconds(read_eval(eval_path))
    turns = [v for _, v in scalar_mean(run_dir / "tb", "actor/turns_mean")]
    return {"arm": arm, "how": how, "command": " ".join(cmd[2:]), "wall_s": round(time.time() - t0, 1),
            "curve": curve, "accuracy_v0": curve[0][2] if curve else None,
            "accuracy_last": curve[-1][2] if curve else None, "versions": curve[-1][1] if curve else None,
            "train_s": curve[-1][0] if curve else None,
            "turns_mean": round(sum(turns) / len(turns), 3) if turns else None,
            "episodes_per_s": episodes_per_s(run_dir, args.group_size, args.batch_size)}


def summarize(arms: dict[str, dict], args) -> dict:
    tool, notool = arms["tool"], arms["notool"]
    gain = (round(tool["accuracy_last"] - notool["accuracy_last"], 4)
            if tool["accuracy_last"] is not None and notool["accuracy_last"] is not None else None)
    return {"tool_gain": gain, "turns_mean": tool["turns_mean"], "episodes_per_s": tool["episodes_per_s"],
            "tool_accuracy_last": tool["accuracy_last"], "notool_accuracy_last": notool["accuracy_last"],
            "tool_accuracy_v0": tool["accuracy_v0"], "notool_accuracy_v0": notool["accuracy_v0"],
            "seed": args.seed, "minutes": args.minutes, "max_operand": args.max_operand, "arms": arms}


def table(s: dict) -> str:
    rows = ["| arm | version-0 acc (after warm start) | last acc | versions | train s | turns | episodes/s |",
            "|---|---|---|---|---|---|---|"]
    for name, a in s["arms"].items():
        rows.append(f"| {name} | {a['accuracy_v0']} | {a['accuracy_last']} | {a['versions']} | {a['train_s']} | "
                    f"{a['turns_mean']} | {a['episodes_per_s']} |")
    return "\n".join(rows) + f"\n\ntool_gain = {s['tool_gain']}"


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = {arm: run_arm(args, arm, out) for arm in ("tool", "notool")}
    summary = summarize(arms, args)
    (out / "multiturn.json").write_text(json.dumps(summary, indent=1))
    print(table(summary))
    print(json.dumps({k: v for k, v in summary.items() if k != "arms"}))


def report(args) -> None:
    """Every run directory's multiturn.json into bench/results/multiturn.json: top-level keys from the last
    run, ``*_runs`` with every run's value."""
    runs = [json.loads((Path(d) / "multiturn.json").read_text()) for d in args.names]
    if not runs:
        raise SystemExit("report: name the run directories")
    latest = {k: v for k, v in runs[-1].items() if k != "arms"}
    for key in ("tool_gain", "turns_mean", "episodes_per_s"):
        latest[f"{key}_runs"] = [r[key] for r in runs]
    latest["runs"] = runs
    if args.note:
        latest["note"] = args.note
    merge(ROOT / "bench" / "results" / "multiturn.json", latest)
    print(json.dumps({k: v for k, v in latest.items() if k != "runs"}))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["run", "report"])
    p.add_argument("names", nargs="*", help="report: run directories")
    p.add_argument("--model", default="tiny", help="GGUF file or model directory (SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="multiturn_out")
    p.add_argument("--work", default="/tmp/multiturn", help="run directories")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max_operand", type=int, default=999, help="operands of '*' in [0, N]")
    p.add_argument("--minutes", type=float, default=3.0, help="training minutes per arm (the time cap)")
    p.add_argument("--hard_s", type=float, default=600.0, help="stop an arm after this many seconds regardless")
    p.add_argument("--warm_start_steps", type=int, default=200)
    p.add_argument("--warm_start_lr", type=float, default=1e-4)
    p.add_argument("--warm_start_batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-5, help="RL learning rate (full fine-tuning)")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=24, help="per turn")
    p.add_argument("--eval_every", type=int, default=10)
    p.add_argument("--eval_size", type=int, default=256)
    p.add_argument("--max_steps", type=int, default=100000)
    p.add_argument("--extra", default="", help="more distrl train flags, both arms (space-separated)")
    p.add_argument("--note", default=None, help="report: the note kept in the results file")
    args = p.parse_args(argv)
    run(args) if args.mode == "run" else report(args)


if __name__ == "__main__":
    main()
