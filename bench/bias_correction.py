"""Sampling-bias correction: a slow, long-answer slice, trained with and without ``--bias_correction reweight``.

The setting: the demo's tiny model (a supervised warm start on arith, then async GRPO, HF engine, CPU) on arith
with ``+ *`` and operands <= 20, scored by ``tests/data/slow_slice_reward.py``: a completion of a ``*`` problem
(the slice: the long answers, up to 3 digits against 2 for ``+``, and the hard ones) is scored after a
``DISTRL_SLOW_SLICE_S`` sleep, so its groups finish late: ``--async_scoring 64`` lets each actor decode on while
they are scored, 4 actors and ``--max_staleness 1`` let the learner move on without them, and the buffer evicts the
late ones as stale (without ``--async_scoring`` a slow reward held up the whole actor instead, and the slice was
barely late: ``--set async_scoring=0``). Each seed runs once per arm (``--arms``, default ``none,reweight``;
``ARMS``: ``--bias_correction none`` or ``reweight``, the buffer's ``--bias_slack 3`` (``--slack K``), or
``--max_staleness 4`` for every group); the slice's held-out accuracy is the final evaluation's
``by_group["op=*"]`` (greedy, ``--eval_size`` held-out problems, about half of them ``*``). Also recorded per
run: the monitor's gaps (``bias_len_gap``, ``bias_difficulty_gap``, ``bias_untrained_share``) and the overall
accuracy.

With ``--setting tool`` the slice is slow in its tool instead of its reward (``TOOL_SETTINGS``: ``--env
tests/data/slow_tool_env.py:SlowCalculator``, whose answers to a ``*`` problem's calls come ``--slow_s`` late,
after a warm start on its demonstrated episodes): a waiting episode lets the actor's others go on and end first.

    nice .venv/bin/python -m bench.bias_correction                  # 3 seeds x 2 (~25 min on 2 cores)
    python -m bench.bias_correction --set batch_size=32 --set number_of_actors=1 --parallel 6   # on 16 cores
    .venv/bin/python -m bench.bias_correction --seeds 0 --max_steps 20 --out /tmp/bc.json

Writes ``bench/results/bias_correction.json`` (merged, bench/results_file.py): ``slice_acc_<arm>`` (means over
seeds), for each arm but ``none`` its gain over ``none`` (``slice_acc_gain`` for reweight, ``slice_acc_gain_<arm>``
otherwise), ``<arm>_ge_none`` (the mean at least none's), ``seeds_<arm>_ge_none`` (seeds where it holds) and
``runs`` (every run); the last stdout line is the same object as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.results_file import merge
from bench.runs import ROOT, command, train

REWARD = str(ROOT / "tests" / "data" / "slow_slice_reward.py") + ":reward"
SLICE = "op=*"  # eval.jsonl by_group key of the slice (arith group_keys: op)


# The run's `distrl train` settings (the demo's, with the slow slice); `--set KEY=VALUE` overrides one.
SETTINGS = {"model": "tiny", "task": "arith", "arith_ops": "+*", "arith_max_operand": "20",
            "reward": REWARD, "reward_timeout_s": "None",
            "warm_start_steps": "600", "warm_start_until_accuracy": "0.4", "warm_start_lr": "1e-3",
            "warm_start_batch_size": "128", "finetune": "full", "backend": "hf", "engine": "hf",
            "torch_threads": "1", "batch_size": "8", "group_size": "8", "learner_chunk_size": "256",
            "max_new_tokens": "5", "lr_schedule": "cosine", "lr_warmup_steps": "10", "number_of_actors": "4",
            "max_staleness": "1", "async_scoring": "64"}


# `--setting tool`: the slice is slow in its tool instead (tests/data/slow_tool_env.py: the calculator, whose
# answers to a `*` problem's calls come DISTRL_SLOW_TOOL_S late), so its episodes end late while the actor's other
# episodes go on decoding; the warm start teaches the call format on the environment's demonstrations.
TOOL_SETTINGS = {**{k: v for k, v in SETTINGS.items() if k not in ("reward", "reward_timeout_s", "async_scoring",
                                                                    "warm_start_until_accuracy")},
                 "arith_max_operand": "99",
                 "env": str(ROOT / "tests" / "data" / "slow_tool_env.py") + ":SlowCalculator",
                 "env_max_turns": "3", "warm_start_steps": "72", "warm_start_batch_size": "64",
                 "max_new_tokens": "18", "temperature": "0.7", "batch_size": "32", "number_of_actors": "2"}
SLOW_ENV = {"reward": "DISTRL_SLOW_SLICE_S", "tool": "DISTRL_SLOW_TOOL_S"}


# The arms: what each run adds to the setting. `slack`: the buffer's --bias_slack (late groups of under-trained
# cells stay eligible 3 more versions) instead of the learner's reweighting; `bound4`, its control: the same
# largest staleness (1 + 3) for every group.
ARMS = {"none": {"bias_correction": "none"}, "reweight": {"bias_correction": "reweight"},
        "slack": {"bias_correction": "none", "bias_slack": "3"},
        "bound4": {"bias_correction": "none", "max_staleness": "4"}}


def flags(seed: int, arm: str, max_steps: int, eval_size: int, learning_rate: str,
          overrides: dict[str, str] | None = None, base: dict[str, str] = SETTINGS,
          arms: dict[str, dict[str, str]] = ARMS) -> list[str]:
    """The `distrl train` flags of one run of `arm` (ARMS): `base` (SETTINGS or TOOL_SETTINGS) with `overrides`,
    then the run's own."""
    settings = {**base, **(overrides or {}), "max_steps": str(max_steps), "learning_rate": learning_rate,
                "eval_every": str(max_steps), "eval_size": str(eval_size), "seed": str(seed),
                **arms[arm], "run_name": f"bias-{arm}-s{seed}"}
    return [part for key, value in settings.items() for part in (f"--{key}", value)]


def run_one(f: list[str], log_dir: Path) -> dict:
    """One run of flags `f`; its slice and overall held-out accuracy (first and final evaluation) and the monitor's
    gaps."""
    seed, arm = int(f[f.index("--seed") + 1]), f[f.index("--run_name") + 1].split("-")[1]
    run_dir, wall = train(f, log_dir)
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines() if line.strip()]
    first, last = evals[0], evals[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"seed": seed, "correction": arm, "command": command(f), "wall_s": round(wall, 1),
            "slice_acc": last["by_group"][SLICE]["accuracy"], "slice_acc_before": first["by_group"][SLICE]["accuracy"],
            "accuracy": last["accuracy"], "accuracy_before": first["accuracy"],
            **{k: summary.get(k) for k in ("bias_len_gap", "bias_difficulty_gap", "bias_lag_mean",
                                           "bias_untrained_share")}}


def compare(results: list[dict], arms: list[str], seeds: list[int]) -> dict:
    """Each arm's mean slice accuracy over `seeds` (``slice_acc_<arm>``) and, for each arm but `none`, its gain
    over `none` (``slice_acc_gain``, ``reweight_ge_none``, ``seeds_reweight_ge_none`` for `reweight`;
    ``slice_acc_gain_<arm>``, ``<arm>_ge_none``, ``seeds_<arm>_ge_none`` for the others)."""
    by = {a: {r["seed"]: r["slice_acc"] for r in results if r["correction"] == a} for a in arms}
    values = {f"slice_acc_{a}": statistics.fmean(by[a].values()) for a in arms}
    for a in (a for a in arms if a != "none" and "none" in arms):
        gain = values[f"slice_acc_{a}"] - values["slice_acc_none"]
        values[{"reweight": "slice_acc_gain"}.get(a, f"slice_acc_gain_{a}")] = gain
        values[f"{a}_ge_none"] = gain >= 0
        values[f"seeds_{a}_ge_none"] = sum(by[a][s] >= by["none"][s] for s in seeds)
    return values


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--eval_size", type=int, default=256)
    parser.add_argument("--learning_rate", default="2e-4", help="the RL learning rate (cosine-decayed)")
    parser.add_argument("--slow_s", type=float, default=0.3,
                        help="seconds per slice completion's reward (DISTRL_SLOW_SLICE_S) or tool answer "
                             "(DISTRL_SLOW_TOOL_S)")
    parser.add_argument("--setting", choices=sorted(SLOW_ENV), default="reward",
                        help="where the slice is slow: its reward (the actor waits) or its tool (--env; it does not)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one of the setting's flags (a `distrl train` flag without its dashes), "
                             "e.g. batch_size=32")
    parser.add_argument("--arms", default="none,reweight", help="comma-separated, of: " + ", ".join(ARMS))
    parser.add_argument("--slack", type=int, default=3, help="the slack arm's --bias_slack")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (each is its own `distrl train`)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "bias_correction.json"))
    args = parser.parse_args(argv)
    overrides = dict(item.split("=", 1) for item in args.set)
    arms = args.arms.split(",")
    table = {**ARMS, "slack": {**ARMS["slack"], "bias_slack": str(args.slack)}}
    if unknown := [a for a in arms if a not in ARMS]:
        parser.error(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    base, slow_env = (TOOL_SETTINGS if args.setting == "tool" else SETTINGS), SLOW_ENV[args.setting]
    os.environ[slow_env] = str(args.slow_s)  # bench.runs.ENV is read at import: set both
    from bench import runs
    runs.ENV[slow_env] = str(args.slow_s)
    runs_flags = [flags(seed, correction, args.max_steps, args.eval_size, args.learning_rate, overrides, base, table)
                  for seed in args.seeds for correction in arms]
    with tempfile.TemporaryDirectory(prefix="bias_correction_") as tmp, \
            ThreadPoolExecutor(max_workers=args.parallel) as pool:
        results = []
        for result in pool.map(lambda f: run_one(f, Path(tmp)), runs_flags):
            results.append(result)
            print(json.dumps(result), flush=True)
    values = {**compare(results, arms, args.seeds), "seeds": len(args.seeds), "slow_s": args.slow_s,
              "max_steps": args.max_steps,
              "learning_rate": args.learning_rate, "setting": args.setting, "settings": {**base, **overrides},
              "eval_size": args.eval_size, "runs": results}
    merge(args.out, values)
    print(json.dumps(values), flush=True)
    return values


if __name__ == "__main__":
    main()
