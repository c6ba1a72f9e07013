"""One learner rank under torchrun against a real buffer (used by test_two_learners.py).

    python -m torch.distributed.run --standalone --nproc_per_node N tests/integration/torchrun_learner.py \
        --buffer tcp://127.0.0.1:PORT --model DIR --out DIR --steps K [--aggregation MODE]

Each rank joins the group with distrl.learn.learner.init_distributed_from_env(), trains K versions with
Learner.run() (GET its shard, all-reduce, step; rank 0 publishes through a DirectoryPublisher), then
writes its trainable parameters before and after to OUT/params0-rank<r>.pt and OUT/params-rank<r>.pt,
the all-reduced gradients of the first version (before clipping) to OUT/grads-rank<r>.pt and its history
to OUT/history-rank<r>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--buffer", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--aggregation", default="sequence-mean-token-mean")
    args = parser.parse_args()

    import torch

    import distrl.learn.learner
    from distrl.cmd.assemble import learner_sections
    from distrl.cmd.config import TrainConfig
    from distrl.learn.learner import Learner, init_distributed_from_env
    from distrl.weights import DirectoryPublisher

    first_grads: list = []

    def recording_all_reduce(params, world_size):  # records what the group's step will use
        all_reduce_grads(params, world_size)
        if not first_grads:
            first_grads.extend(p.grad.detach().clone() for p in params)

    learner_module = distrl.learn.learner
    all_reduce_grads, learner_module.all_reduce_grads = learner_module.all_reduce_grads, recording_all_reduce

    rank, world, _ = init_distributed_from_env()
    out = Path(args.out)
    cfg = TrainConfig(model=args.model, backend="hf", number_of_learners=world, batch_size=4, group_size=4,
                      max_steps=args.steps, max_staleness=args.steps, learning_rate=1e-2, learner="grpo",
                      loss_aggregation=args.aggregation, off_policy="decoupled", kl_coef=0.05, max_grad_norm=0.5,
                      learner_chunk_size=3, max_new_tokens=8, dtype="float32")
    publisher = DirectoryPublisher(out / "weights", keep=2) if rank == 0 else None
    learner = Learner(*learner_sections(cfg), rank, world, args.buffer, args.model, publisher)
    torch.save([p.detach().cpu().clone() for p in learner.params], out / f"params0-rank{rank}.pt")
    result = learner.run()
    learner.close()
    if publisher is not None:
        publisher.close()
    torch.save([p.detach().cpu() for p in learner.params], out / f"params-rank{rank}.pt")
    torch.save([g.cpu() for g in first_grads], out / f"grads-rank{rank}.pt")
    history = [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in result["history"]]
    (out / f"history-rank{rank}.json").write_text(json.dumps({"version": result["version"], "history": history}))
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
