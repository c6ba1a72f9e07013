"""`make demo-tools`: tools matter. The tiny model learns two-digit multiplication with the `calculator`.

The task is the built-in ``arith`` restricted to ``a*b`` with a, b in [0, 99] (``--arith_ops '*'
--arith_max_operand 99``): a 2-layer model of 0.53M parameters cannot multiply two-digit numbers in its head,
but it can learn to write ``<calc>37*45</calc>`` and copy the calculator's answer. Two arms, each an ordinary
``distrl train`` run one after the other, with the same seed, warm-start budget, RL versions and flags:

- **tool** (``--env calculator``): the supervised warm start (``--warm_start_steps``) teaches the call format on
  demonstrated episodes (``distrl/rollout/envs/demonstrations.py``: the call, the calculator's reply as an
  observation that gets no loss, the answer), then async GRPO on whole episodes through the environment;
- **no tool**: the same warm start steps on direct answers (``37*45=`` -> ``1665``), then the same GRPO.

Both: ``--warm_start_steps 72`` (lr 1e-3, 64 problems a step; a fixed budget, no
``--warm_start_until_accuracy``: on these demonstrations the tool arm's greedy accuracy climbs from ~5 % at 65
steps to ~65 % at 80, and 72 leave room above for RL), then 60 versions of 32 prompts x 8 samples at
temperature 0.7 (at 1.0 the warm-started model's samples are mostly malformed calls: ~5 % reward against ~35 %),
lr 4e-4 with a cosine decay, one HF-engine actor and one full fine-tuning learner, ``--max_staleness 1``.

Held-out accuracy is the greedy accuracy on ``--eval_size`` problems never trained on (``--eval_every``: actor
0 evaluates, with ``--env`` as whole episodes through the calculator). ``accuracy_before`` is version 0's
(after the warm start), ``accuracy_after`` the final version's. Per run:

- ``tool_gain_heldout``: the tool arm's after - before (what RL earned with the tool; with ``--repeats`` the
  smallest of the runs, each in ``tool_gain_heldout_runs``);
- ``tool_minus_notool``: the tool arm's final accuracy - the no-tool arm's (the same);
- ``tool_wall_s``, ``notool_wall_s``: each arm's ``distrl train`` wall seconds (tiny model build, warm start,
  start-up, training and evaluations).

Writes ``<log_dir>/report.md`` (accuracy by version of both arms, per run) and ``<log_dir>/accuracy.png``,
prints the gains, and as its last line one JSON object, merged into ``bench/results/demo_tools.json``
(``bench/results_file.py``: every key at top level, ``<key>_runs`` its history; ``runs``: how many runs the
file holds).

Usage: ``python -m bench.demo_tools [--repeats 3] [--seed 0] [--log_dir runs/demo_tools]`` (``make demo-tools``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

from bench.results_file import merge
from bench.runs import ROOT, command, train

RESULT = ROOT / "bench" / "results" / "demo_tools.json"
TASK = ["--model", "tiny", "--task", "arith", "--arith_ops", "*", "--arith_max_operand", "99"]
# The warm start's budget is fixed (no --warm_start_until_accuracy): both arms get exactly these steps.
WARM_START = ["--warm_start_lr", "1e-3", "--warm_start_batch_size", "64"]
RL = ["--finetune", "full", "--backend", "hf", "--engine", "hf", "--torch_threads", "1",
      "--batch_size", "32", "--group_size", "8", "--learner_chunk_size", "256",
      "--learning_rate", "4e-4", "--lr_schedule", "cosine", "--lr_warmup_steps", "10", "--temperature", "0.7",
      "--number_of_actors", "1", "--max_staleness", "1", "--eval_every", "10", "--eval_size", "256", "--no_console"]
# --max_new_tokens per model turn: `<calc>99*99</calc>` is 17 tokens; a direct answer at most 4 digits and EOS.
ARMS = {"tool": ["--env", "calculator", "--env_max_turns", "3", "--max_new_tokens", "18"],
        "notool": ["--max_new_tokens", "5"]}


def arm_flags(arm: str, seed: int, warm_start_steps: int, max_steps: int, run_name: str) -> list[str]:
    """The ``distrl train`` flags of one arm (``tool`` or ``notool``)."""
    return [*TASK, "--warm_start_steps", str(warm_start_steps), *WARM_START, *RL, "--max_steps", str(max_steps),
            "--seed", str(seed), *ARMS[arm], "--run_name", run_name]


def run_arm(arm: str, seed: int, warm_start_steps: int, max_steps: int, log_dir: Path, tag: str) -> dict:
    """Run one arm; its held-out accuracy by version, before/after, wall seconds and command."""
    flags = arm_flags(arm, seed, warm_start_steps, max_steps, f"{tag}-{arm}")
    run_dir, wall_s = train(flags, log_dir, timeout_s=1800)
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if line.strip()]
    curve = sorted((e["version"], e["accuracy"]) for e in evals)
    return {"run_dir": str(run_dir), "command": command(flags), "wall_s": round(wall_s, 1), "curve": curve,
            "accuracy_before": curve[0][1], "accuracy_after": curve[-1][1]}


def one_run(seed: int, warm_start_steps: int, max_steps: int, log_dir: Path, tag: str) -> dict:
    """Both arms, tool first; the run's numbers (see the module docstring) and each arm's detail."""
    tool = run_arm("tool", seed, warm_start_steps, max_steps, log_dir, tag)
    notool = run_arm("notool", seed, warm_start_steps, max_steps, log_dir, tag)
    return {"seed": seed, "tool_gain_heldout": tool["accuracy_after"] - tool["accuracy_before"],
            "tool_minus_notool": tool["accuracy_after"] - notool["accuracy_after"],
            "tool_accuracy_before": tool["accuracy_before"], "tool_accuracy_after": tool["accuracy_after"],
            "notool_accuracy_before": notool["accuracy_before"], "notool_accuracy_after": notool["accuracy_after"],
            "tool_wall_s": tool["wall_s"], "notool_wall_s": notool["wall_s"], "tool": tool, "notool": notool}


def plot(runs: list[dict], path: Path) -> Path:
    """Held-out accuracy by policy version, both arms of every run, to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, run in enumerate(runs, 1):
        for arm, style in (("tool", "-"), ("notool", "--")):
            versions, accuracy = zip(*run[arm]["curve"])
            ax.plot(versions, accuracy, style, color=f"C{k - 1}", label=f"run {k} {arm.replace('notool', 'no tool')}")
    ax.set_xlabel("policy version")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("two-digit multiplication, tiny model: with and without the calculator")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(runs: list[dict], path: Path, png: Path) -> Path:
    """``report.md``: per run, the gains, wall times and accuracy by version of both arms."""
    lines = ["# make demo-tools", "", f"![accuracy]({png.name})", ""]
    for k, run in enumerate(runs, 1):
        lines += [f"## run {k} (seed {run['seed']})", "",
                  f"- tool: held-out accuracy {run['tool_accuracy_before']:.3f} -> {run['tool_accuracy_after']:.3f} "
                  f"(gain {run['tool_gain_heldout']:+.3f}), {run['tool_wall_s']:.0f} s",
                  f"- no tool: {run['notool_accuracy_before']:.3f} -> {run['notool_accuracy_after']:.3f}, "
                  f"{run['notool_wall_s']:.0f} s",
                  f"- tool minus no tool (final): {run['tool_minus_notool']:+.3f}", "",
                  "| version | tool | no tool |", "|---|---|---|"]
        notool = dict(run["notool"]["curve"])
        for version, accuracy in run["tool"]["curve"]:
            other = notool.get(version)
            lines.append(f"| {version} | {accuracy:.3f} | {'-' if other is None else f'{other:.3f}'} |")
        lines += ["", f"commands: `{run['tool']['command']}`; `{run['notool']['command']}`", ""]
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.demo_tools", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs of both arms, one after another (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="--seed of every run (default 0)")
    parser.add_argument("--warm_start_steps", type=int, default=72, help="warm-start steps of both arms (72)")
    parser.add_argument("--max_steps", type=int, default=60, help="RL policy versions of both arms (60)")
    parser.add_argument("--log_dir", default="runs/demo_tools", help="where the runs and the report go")
    parser.add_argument("--no_save", action="store_true", help="do not merge into bench/results/demo_tools.json")
    args = parser.parse_args(argv)
    log_dir = Path(args.log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    runs = []
    for k in range(args.repeats):
        runs.append(one_run(args.seed, args.warm_start_steps, args.max_steps, log_dir, f"{stamp}-{k + 1}"))
        run = runs[-1]
        print(f"run {k + 1}: tool {run['tool_accuracy_before']:.3f} -> {run['tool_accuracy_after']:.3f} "
              f"(held-out gain {run['tool_gain_heldout']:+.3f}, {run['tool_wall_s']:.0f} s); no tool "
              f"{run['notool_accuracy_before']:.3f} -> {run['notool_accuracy_after']:.3f} "
              f"({run['notool_wall_s']:.0f} s); tool minus no tool {run['tool_minus_notool']:+.3f}", flush=True)
    png = plot(runs, log_dir / "accuracy.png")
    md = report(runs, log_dir / "report.md", png)
    keys = ["tool_gain_heldout", "tool_minus_notool", "tool_accuracy_before", "tool_accuracy_after",
            "notool_accuracy_before", "notool_accuracy_after", "tool_wall_s", "notool_wall_s"]
    out = {key: min(run[key] for run in runs) if key in keys[:2] else runs[-1][key] for key in keys}
    out.update({f"{key}_runs": [run[key] for run in runs] for key in keys})
    out.update(seed=args.seed, warm_start_steps=args.warm_start_steps, max_steps=args.max_steps,
               date=stamp, machine=f"{platform.machine()}, {os.cpu_count()} cores, {platform.node()}",
               report=str(md), plot=str(png), commands=[runs[0]["tool"]["command"], runs[0]["notool"]["command"]])
    if not args.no_save:
        old = json.loads(RESULT.read_text()) if RESULT.is_file() else {}
        out["runs"] = len(old.get("tool_gain_heldout_runs", [])) + len(runs)
        merge(RESULT, out)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
