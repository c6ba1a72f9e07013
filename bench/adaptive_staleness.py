"""Adaptive staleness: `--max_staleness auto:4` against the fixed bounds 0 and 4 (docs/offpolicy.md).

bench/staleness.py's task and settings (the embedded tiny model, `half_vocab`, batch 8 x group 8, 16 new tokens,
`--learner_chunk_size 1` so the actor can run ahead of the learner; read its docstring), 30 versions, each bound
with three seeds, on this machine's CPU. Per run: the final reward (the mean batch reward of the last 5 versions),
versions per second of training (`versions / train_wall_s` of summary.json: start-up left out), and for `auto` the
bound in force at each version (TensorBoard `learner/max_staleness`) and whether every consumed completion was
within the bound in force when its batch was selected (consumed.jsonl's `max_staleness` column).

Keys of bench/results/adaptive_staleness.json: ``auto_vs_0_speed`` (auto's mean versions/s over bound 0's),
``auto_vs_ceiling_speed`` (over fixed 4's; target >= 0.9), ``auto_reward_gap`` (auto's 3-seed mean final reward
minus bound 0's; target |gap| <= 0.02), ``runs`` (how many runs), ``per_run`` (each run), and for the divergence
setting whether each bound fell below its version-0 reward and stayed there (every one of the last 5 versions below
it), and ``auto_avoids_divergence`` (fixed 4 did in every seed, auto in none). The divergence setting: full
fine-tuning, plain policy gradient (`--learner pg`: no ratio clipping), no gradient clipping, no off-policy
correction, learning rate 1e-2, and bench/rewards/even_target.py's reward (a collapsed policy scores its floor and
gets no signal back), so stale gradients that overshoot collapse the policy for good while on-policy ones do not.

    .venv/bin/python -m bench.adaptive_staleness                  # the recorded experiment
    .venv/bin/python -m bench.adaptive_staleness --seeds 0 --max_steps 12 --no_divergence --out /tmp/a.json
    .venv/bin/python -m bench.adaptive_staleness --seeds          # the divergence setting alone (bounds 4, auto:4, 0;
                                                                  # seeds 0-2; ~6.5 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import tempfile
import time
from pathlib import Path

from bench.results_file import merge
from bench.runs import ROOT, command, mean, scalars, summary, train
from bench.staleness import FLAGS

BOUNDS = ("0", "4", "auto:4")
LAST = 5  # final reward: mean batch reward of the last LAST versions


def flags_for(bound: str, seed: int, max_steps: int, learning_rate: str, off_policy: str, threads: int,
              name: str) -> list[str]:
    """bench/staleness.py's FLAGS with this run's bound, seed, learning rate and correction."""
    base = list(FLAGS)
    base[base.index("--seed") + 1] = str(seed)
    base[base.index("--learning_rate") + 1] = learning_rate
    return base + ["--max_staleness", bound, "--off_policy", off_policy, "--max_steps", str(max_steps),
                   "--torch_threads", str(threads), "--run_name", name]


def within_bound(run_dir: Path) -> bool:
    """Every consumed completion's staleness <= the bound in force when its batch was selected."""
    from distrl.buffer.segments import read_consumed

    records = read_consumed(run_dir)
    return bool(records) and all(r["learner_version"] - v <= r["max_staleness"]
                                 for r in records for v in r["policy_versions"])


def run_one(bound: str, seed: int, args, log_dir: Path, setting: str, learning_rate: str, off_policy: str,
            extra: tuple[str, ...] = ()) -> dict:
    """One run: its command, final reward, versions/s and curves."""
    name = f"{setting}-{bound.replace(':', '')}-s{seed}"
    flags = flags_for(bound, seed, args.max_steps, learning_rate, off_policy, args.torch_threads, name) + list(extra)
    run_dir, wall = train(flags, log_dir)
    s = summary(run_dir)
    rewards = [v for _, v in sorted(scalars(run_dir, "learner/reward_mean").items())]
    bounds = [int(v) for _, v in sorted(scalars(run_dir, "learner/max_staleness").items())]
    staleness = [int(v) for _, v in sorted(scalars(run_dir, "learner/staleness_max").items())]
    out = {"setting": setting, "bound": bound, "seed": seed, "command": command(flags), "wall_s": round(wall, 1),
           "versions": s["versions"], "versions_per_s": s["versions"] / s["train_wall_s"],
           "reward_v0": rewards[0], "final_reward": mean(rewards[-LAST:]),
           "stayed_below_v0": all(r < rewards[0] for r in rewards[-LAST:]),
           "staleness_mean": s["staleness_mean"], "within_bound": within_bound(run_dir),
           "rewards": [round(r, 4) for r in rewards], "bounds": bounds, "staleness_max": staleness}
    print(json.dumps({k: v for k, v in out.items() if k not in ("rewards", "bounds", "staleness_max", "command")}),
          flush=True)
    return out


def by_bound(runs: list[dict], setting: str, bound: str, key: str) -> list:
    return [r[key] for r in runs if r["setting"] == setting and r["bound"] == bound]


def results(runs: list[dict], seeds: list[int], divergence: dict | None) -> dict:
    """The results file's keys (module docstring) from the runs; the main comparison's only when it ran (`--seeds`
    given none: the divergence setting alone, and the file keeps its main keys)."""
    out = {"runs": len(runs)}
    if seeds:
        speed = {b: mean(by_bound(runs, "main", b, "versions_per_s")) for b in BOUNDS}
        final = {b: mean(by_bound(runs, "main", b, "final_reward")) for b in BOUNDS}
        out.update(auto_vs_0_speed=speed["auto:4"] / speed["0"], auto_vs_ceiling_speed=speed["auto:4"] / speed["4"],
                   auto_reward_gap=final["auto:4"] - final["0"], seeds=seeds,
                   auto_within_bound=all(by_bound(runs, "main", "auto:4", "within_bound")))
        for b in BOUNDS:
            key = b.replace(":", "")
            out[f"final_reward_{key}_by_seed"] = [round(v, 4) for v in by_bound(runs, "main", b, "final_reward")]
            out[f"versions_per_s_{key}_by_seed"] = [round(v, 3) for v in by_bound(runs, "main", b, "versions_per_s")]
    if divergence is not None:
        out["divergence_setting"] = divergence
        for b in ("4", "auto:4", "0"):
            stayed = by_bound(runs, "divergence", b, "stayed_below_v0")
            if stayed:
                out[f"divergence_{b.replace(':', '')}_stayed_below_v0"] = stayed
                out[f"divergence_{b.replace(':', '')}_final_by_seed"] = [
                    round(v, 4) for v in by_bound(runs, "divergence", b, "final_reward")]
        fixed, auto = (by_bound(runs, "divergence", b, "stayed_below_v0") for b in ("4", "auto:4"))
        if fixed and auto:  # the acceptance's point: fixed 4 diverges in every seed, auto in none
            out["auto_avoids_divergence"] = all(fixed) and not any(auto)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.adaptive_staleness", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2],
                        help="seeds of the main comparison (none: only the divergence setting runs)")
    parser.add_argument("--max_steps", type=int, default=30)
    parser.add_argument("--torch_threads", type=int, default=1)
    parser.add_argument("--divergence_lr", default="1e-2", help="learning rate of the divergence setting")
    parser.add_argument("--divergence_flags", type=shlex.split,
                        default=["--finetune", "full", "--learner", "pg", "--max_grad_norm", "0"],
                        help="more flags of the divergence setting, one string (its correction is --off_policy none)")
    parser.add_argument("--divergence_reward", default="bench/rewards/even_target.py:reward",
                        help="--reward of the divergence setting (a reward whose collapsed policies score low)")
    parser.add_argument("--divergence_seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--divergence_bounds", nargs="+", default=["4", "auto:4", "0"])
    parser.add_argument("--no_divergence", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "adaptive_staleness.json")
    args = parser.parse_args(argv)
    runs: list[dict] = []
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="distrl-adaptive-") as log_dir:
        for seed in args.seeds:  # seeds outermost: a change of machine load falls on every bound alike
            for bound in BOUNDS:
                runs.append(run_one(bound, seed, args, Path(log_dir), "main", FLAGS[FLAGS.index("--learning_rate") + 1],
                                    "decoupled"))
        divergence = None
        if not args.no_divergence:
            flags = args.divergence_flags + (["--reward", args.divergence_reward] if args.divergence_reward else [])
            divergence = {"learning_rate": args.divergence_lr, "off_policy": "none", "seeds": args.divergence_seeds,
                          "flags": flags}
            for seed in args.divergence_seeds:
                for bound in args.divergence_bounds:
                    runs.append(run_one(bound, seed, args, Path(log_dir), "divergence", args.divergence_lr, "none",
                                        tuple(flags)))
    out = results(runs, args.seeds, divergence)
    kept = []  # the divergence setting alone (no --seeds): the file's main-comparison runs stay in per_run
    if not args.seeds and args.out.is_file():
        kept = [r for r in json.loads(args.out.read_text()).get("per_run", []) if r.get("setting") == "main"]
    out.update(machine=f"{os.cpu_count()}-core CPU VM ({platform.processor() or platform.machine()})",
               total_s=round(time.time() - start), per_run=kept + runs)
    merge(args.out, out, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "per_run"}))


if __name__ == "__main__":
    main()
