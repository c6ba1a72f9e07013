"""The learner's CPU time for one ``train_step`` on a fixed demo batch, this tree against another commit.

Issue 18, acceptance 3: building the batch from the Arrow columns must not cost the learner CPU time.
Each tree runs in a worker subprocess of the same python with ``PYTHONPATH`` set to that tree (the module
paths differ between commits: ``distrl.wire`` then, ``distrl.core.wire`` now), ``--torch_threads`` threads
(default 1). Both build the same ``Learner`` on the tiny model and the same deterministic batch, the demo's
shape (``make demo``: ``--task arith`` prompts like ``37+45=``, ``--max_new_tokens 5``, 32 groups x 8,
``--learner_chunk_size 256``, full fine-tuning, fp32), as a COMPLETION_SCHEMA table, and run ``train_step``
on it again and again. The driver alternates the two workers step by step (old, new, old, new, ...), so a
change in the machine's load hits both alike; a step's cost is the worker's process CPU time
(``time.process_time``: every thread of the process, user + system) across the call, after ``--warmup``
steps each. It prints both trees' medians and the ratio new/old, then one JSON line, also written to
``bench/results/train_step_cpu.json``. It also times the batch assembly alone (the shard's totals and its
micro-batch tensors: ``prepare`` + ``collate``; at 944c626 after ``to_pylist``). The workers also report
their losses and a hash of the parameters after the last step: ``identical`` says whether the two trees
computed the same numbers bit for bit.

    git archive 944c626 | (mkdir -p /tmp/wt944 && tar -x -C /tmp/wt944)
    .venv/bin/python bench/train_step_cpu.py --old_tree /tmp/wt944 --reps 15
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUPS, GROUP_SIZE, MAX_NEW_TOKENS = 32, 8, 5
BUILDS = 20  # batch assemblies per "build" measurement
TAG = "@@"  # prefix of the worker's protocol lines on stdout (libraries may print other lines)


def demo_rows(seed: int = 0) -> list[dict]:
    """32 groups x 8 completion rows of COMPLETION_SCHEMA in the demo's shape: prompts of 4..6 characters
    ("a+b="), completions of 1..5 tokens (5: finish_reason ``length``), random ids of the tiny model's
    character vocabulary, behavior logprobs in [-3, 0), 0/1 rewards and their group-normalized advantages."""
    rnd = random.Random(seed)
    rows = []
    for g in range(GROUPS):
        prompt = [rnd.randint(4, 40) for _ in range(rnd.randint(4, 6))]
        rewards = [float(rnd.random() < 0.4) for _ in range(GROUP_SIZE)]
        mean = sum(rewards) / GROUP_SIZE
        std = (sum((r - mean) ** 2 for r in rewards) / GROUP_SIZE) ** 0.5
        for i, reward in enumerate(rewards):
            n = rnd.randint(1, MAX_NEW_TOKENS)
            rows.append({
                "sample_id": f"g{g}-{i}", "group_id": f"g{g}", "prompt_id": f"p{g}", "actor_id": 0,
                "policy_version": 0, "last_policy_version": 0, "prompt_ids": prompt,
                "completion_ids": [rnd.randint(4, 40) for _ in range(n)],
                "behavior_logprobs": [-3 * rnd.random() for _ in range(n)], "temperature": 1.0,
                "reward": reward, "reward_components": {"correct": reward},
                "advantage": (reward - mean) / (std + 1e-6),
                "finish_reason": "length" if n == MAX_NEW_TOKENS else "stop",
                "prompt_text": "", "completion_text": "", "gen_start_time": 0.0, "gen_seconds": 0.0,
            })
    return rows


def worker(args: argparse.Namespace) -> None:
    """Serve steps on stdin: ``step`` -> one train_step and its CPU seconds; ``done`` -> the numbers."""
    import hashlib
    import importlib.util

    # only PYTHONPATH's tree: not the editable install's finder (it imports /work/main's packages whatever
    # PYTHONPATH says), not bench/ (its buffer.py shadows the top-level buffer package of 944c626)
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    import torch

    torch.set_num_threads(args.torch_threads)
    try:  # this tree's module paths
        from distrl.cmd.assemble import learner_sections
        from distrl.cmd.config import TrainConfig
        from distrl.core.rows import table_from_rows
        from distrl.learn import learner as learner_module
    except ImportError:  # 944c626: other module paths, the roles at the top level
        from learn import learner as learner_module

        from distrl.config import TrainConfig
        from distrl.wire import table_from_rows

    cfg = TrainConfig(model=args.model, task="arith", backend="hf", dtype="float32", finetune="full",
                      learning_rate=4e-4, batch_size=GROUPS, group_size=GROUP_SIZE, learner_chunk_size=256,
                      max_new_tokens=MAX_NEW_TOKENS, max_steps=10_000, torch_threads=args.torch_threads)
    learner = learner_module.Learner(*learner_sections(cfg), 0, 1, "tcp://127.0.0.1:9",  # never contacted
                                     args.model)
    table = table_from_rows(demo_rows())
    batch_module = learner_module.__name__.rsplit(".", 1)[0] + ".batch"
    if importlib.util.find_spec(batch_module) is None:  # 944c626: Python rows, then one tensor per row
        def build():
            rows = table.to_pylist()
            learner_module.collate(rows, learner.pad_id, learner.prepare(rows)[1])
    else:
        collate = importlib.import_module(batch_module).collate

        def build():
            collate(table, learner.pad_id, learner.prepare(table)[1])
    print(TAG, json.dumps({"ready": learner_module.__file__}), flush=True)
    losses = []
    for line in sys.stdin:
        if line.strip() not in ("step", "build"):
            break
        t0 = time.process_time()
        if line.strip() == "build":
            for _ in range(BUILDS):
                build()
            print(TAG, json.dumps({"cpu_s": (time.process_time() - t0) / BUILDS}), flush=True)
            continue
        stats = learner.train_step(table)
        cpu_s = time.process_time() - t0
        losses.append(stats["learner/loss"])
        print(TAG, json.dumps({"cpu_s": cpu_s}), flush=True)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in learner.params)).hexdigest()
    print(TAG, json.dumps({"losses": losses, "params_sha256": digest}), flush=True)


class Worker:
    """A worker subprocess running ``tree``'s code."""

    def __init__(self, tree: Path, args: argparse.Namespace):
        env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "OMP_NUM_THREADS": str(args.torch_threads), "MKL_NUM_THREADS": str(args.torch_threads)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model,
               "--torch_threads", str(args.torch_threads)]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="train_step_cpu-", suffix=".log")  # its stderr
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        self.tree, self.cpu_s = tree, []
        ready = self.read()["ready"]
        if not ready.startswith(str(tree)):
            raise RuntimeError(f"the worker for {tree} imported {ready}")

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
        self.log.seek(0)
        raise RuntimeError(f"the worker for {self.tree} exited with {self.proc.wait()}: {self.log.read()[-3000:]}")

    def step(self, what: str = "step") -> float:
        self.proc.stdin.write(f"{what}\n")
        self.proc.stdin.flush()
        return self.read()["cpu_s"]

    def finish(self) -> dict:
        self.proc.stdin.write("done\n")
        self.proc.stdin.flush()
        out = self.read()
        self.proc.wait(timeout=60)
        return out


def git_commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old_tree", default="/tmp/wt944", help="a checkout of the commit to compare with")
    ap.add_argument("--old_commit", default="944c626", help="its commit, for the record")
    ap.add_argument("--reps", type=int, default=15, help="measured steps per tree")
    ap.add_argument("--warmup", type=int, default=3, help="steps per tree before measuring")
    ap.add_argument("--torch_threads", type=int, default=1)
    ap.add_argument("--model", default="", help="the tiny model's directory (default: built under /tmp)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_step_cpu.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from distrl.core.tiny import build_tiny_model

    args.model = args.model or str(build_tiny_model(Path("/tmp/distrl_bench_tiny"), seed=0))
    load_before = os.getloadavg()
    old, new = Worker(Path(args.old_tree).resolve(), args), Worker(ROOT, args)
    for i in range(args.warmup + args.reps):
        for w in (old, new) if i % 2 == 0 else (new, old):  # alternate which tree goes first
            cpu_s = w.step()
            if i >= args.warmup:
                w.cpu_s.append(cpu_s)
    builds = {id(old): [], id(new): []}
    for i in range(args.reps):
        for w in (old, new) if i % 2 == 0 else (new, old):
            builds[id(w)].append(w.step("build"))
    old_build, new_build = statistics.median(builds[id(old)]), statistics.median(builds[id(new)])
    old_end, new_end = old.finish(), new.finish()
    old_med, new_med = statistics.median(old.cpu_s), statistics.median(new.cpu_s)
    result = {
        "bench": "train_step_cpu", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "old_commit": args.old_commit, "new_commit": git_commit(ROOT), "torch_threads": args.torch_threads,
        "reps": args.reps, "warmup": args.warmup, "batch": f"{GROUPS} groups x {GROUP_SIZE}, chunk 256",
        "old_cpu_s_median": round(old_med, 4), "new_cpu_s_median": round(new_med, 4),
        "old_cpu_s_min": round(min(old.cpu_s), 4), "new_cpu_s_min": round(min(new.cpu_s), 4),
        "ratio_new_over_old": round(new_med / old_med, 4),
        "old_build_cpu_s_median": round(old_build, 5), "new_build_cpu_s_median": round(new_build, 5),
        "build_ratio_new_over_old": round(new_build / old_build, 4),
        "identical": old_end == new_end, "params_sha256": new_end["params_sha256"][:16],
        "old_cpu_s": [round(x, 4) for x in old.cpu_s], "new_cpu_s": [round(x, 4) for x in new.cpu_s],
    }
    print(f"train_step CPU s (median of {args.reps}): {args.old_commit} {old_med:.4f}, this tree "
          f"{new_med:.4f}; ratio new/old {new_med / old_med:.3f}; losses and parameters identical: "
          f"{result['identical']}")
    print(f"batch assembly alone (prepare + collate, {BUILDS} per sample) CPU s: {args.old_commit} {old_build:.5f}, "
          f"this tree {new_build:.5f}; ratio {new_build / old_build:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
