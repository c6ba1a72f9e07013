"""Two learners on CPU (gloo) under torchrun, against a real BufferServer over ZMQ.

After K versions both ranks hold bit-identical parameters. The group's update equals one learner's on
the union batch (the same groups, served to a single rank): the all-reduced gradient of the first version
(same starting weights) matches to float rounding, since every loss normalizer is global and gradients are
SUM-all-reduced (distrl.learn.distributed). After K AdamW steps the update theta_K - theta_0 matches as a whole
(relative L2 difference) and element-wise for all but a few elements whose gradient is at rounding
level: AdamW's g / (sqrt(v) + 1e-8) turns a 1e-10 difference of such a gradient into a step of up to
lr * |g| / (|g| + 1e-8), so those elements carry no information about correctness.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from distrl.core.buffer_client import BufferClient
from tests.helpers import make_group, new_buffer

ROOT = Path(__file__).resolve().parents[2]
STEPS, BATCH = 3, 4


@contextlib.contextmanager
def buffer_with_groups(run_dir: Path):
    """A real BufferServer (thread) holding STEPS * BATCH groups of policy version 0."""
    server = new_buffer(run_dir, batch_size=BATCH, max_staleness=STEPS, topk=4)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    g = torch.Generator().manual_seed(0)
    with BufferClient(server.address, "test", timeout_s=5.0) as client:
        for i in range(STEPS * BATCH):
            rewards = torch.rand(4, generator=g).tolist()
            client.put(make_group(f"g{i}", rewards=rewards, completion_len=2 + i % 4, prompt_len=2 + i % 3))
    try:
        yield server.address
    finally:
        stop.set()
        thread.join(timeout=10)
        server.close()


def torchrun(nproc: int, address: str, model: Path, out: Path) -> None:
    out.mkdir(parents=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "tests" / "integration" / "torchrun_learner.py"), "--buffer", address, "--model", str(model),
           "--out", str(out), "--steps", str(STEPS)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_two_learners_equal_one_on_the_union_batch(tmp_path):
    from distrl.core.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", seed=0)
    with buffer_with_groups(tmp_path / "run2") as address:
        torchrun(2, address, model, tmp_path / "two")
    with buffer_with_groups(tmp_path / "run1") as address:
        torchrun(1, address, model, tmp_path / "one")

    two, one = tmp_path / "two", tmp_path / "one"
    rank0, rank1, single = (torch.load(p) for p in (two / "params-rank0.pt", two / "params-rank1.pt",
                                                      one / "params-rank0.pt"))
    init0, init1, init_single = (torch.load(p) for p in (two / "params0-rank0.pt", two / "params0-rank1.pt",
                                                           one / "params0-rank0.pt"))
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(init0, init1, init_single))
    g0, g1, g_single = (torch.load(p) for p in (two / "grads-rank0.pt", two / "grads-rank1.pt", one / "grads-rank0.pt"))
    assert len(rank0) == len(rank1) == len(single) == len(g0) == len(g_single) > 0
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1)), "ranks diverged"
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    grad_scale = max(g.abs().max().item() for g in g_single)
    grad_diff = max((a - b).abs().max().item() for a, b in zip(g0, g_single))
    diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(rank0, single)])
    update = torch.cat([(b - i).flatten() for b, i in zip(single, init_single)])  # theta_K - theta_0, one learner
    relative = diffs.norm().item() / update.norm().item()
    print(f"\nfirst-version gradient: max |two - one| {grad_diff:.2e} (max |g| {grad_scale:.2e}); update after "
          f"{STEPS} versions: |two - one| / |update| = {relative:.2e} (L2), element-wise 99.9th percentile "
          f"{diffs.quantile(0.999).item():.2e}, max {diffs.max().item():.2e} over {diffs.numel()} elements; "
          f"ranks bit-identical")
    assert grad_scale > 0 and grad_diff < 1e-6 * grad_scale
    assert relative < 1e-3 and diffs.quantile(0.999).item() < 2e-5
    assert max(p.abs().max().item() for p in single[1::2]) > 0  # LoRA B matrices left zero: steps happened

    h2 = [json.loads((tmp_path / "two" / f"history-rank{r}.json").read_text()) for r in (0, 1)]
    h1 = json.loads((tmp_path / "one" / "history-rank0.json").read_text())
    assert h2[0]["version"] == h2[1]["version"] == h1["version"] == STEPS
    for a, b, c in zip(h2[0]["history"], h2[1]["history"], h1["history"]):
        # the version's global loss and reward are the same on both ranks and equal the single learner's
        assert a["learner/loss"] == b["learner/loss"] == pytest.approx(c["learner/loss"], abs=1e-6)
        assert a["learner/reward_mean"] == pytest.approx(c["learner/reward_mean"], abs=1e-9)
        assert a["learner/grad_norm"] == pytest.approx(c["learner/grad_norm"], rel=1e-4)
    assert sorted(p.name for p in (tmp_path / "two" / "weights").iterdir()) == ["v000002", "v000003"]
