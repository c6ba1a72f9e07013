"""The learner group: process-group setup (Ray or torchrun) and the collectives of one version.

Every learner rank runs the same sequence of collectives per version, in the same order:

1. ``all_reduce_sum`` of a few batch totals (completion tokens, completions, reward sum, completions with
   a non-zero advantage), so every rank uses the same loss normalizers and makes the same skip decision;
2. ``all_reduce_grads`` (SUM): each rank's loss is already its share of the version's global loss
   (``distrl.learn.losses``: every normalizer is global), so the SUM of the ranks' gradients is the gradient of
   one learner on the union batch; an AVG would be off by the factor L;
3. nothing else: gradient clipping and the AdamW step then run on identical gradients and identical
   optimizer states, so every rank holds identical weights after each step (the all-reduce result is
   the same bytes on every rank with gloo and NCCL). ``broadcast_params`` at start-up makes the initial
   weights identical too, whatever each rank's initialization did.

With one learner (or no process group) every function here is a no-op.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

log = logging.getLogger("distrl.learner")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
BUCKET_NUMEL = 32 * 2**20  # elements per all-reduce message (128 MiB in fp32)


def backend_name() -> str:
    """``nccl`` when CUDA is available, else ``gloo`` (CPU)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed_from_env(timeout_s: float = 600.0) -> tuple[int, int, int]:
    """Join the learner group from torchrun's environment; returns ``(rank, world_size, local_rank)``.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (set by ``torchrun``). With
    WORLD_SIZE 1 or no torchrun variables at all, no process group is created and ``(0, 1, 0)`` is
    returned. With several ranks the group uses NCCL on GPU (each rank on ``cuda:LOCAL_RANK``) and gloo
    on CPU; an existing group is reused.

    Raises RuntimeError when only some of the variables are set (name the missing ones: start the
    ranks with ``torchrun --nproc_per_node N``), or ValueError when they are not integers.
    """
    present = [v for v in TORCHRUN_VARS if v in os.environ]
    if not present:
        return 0, 1, 0
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if missing and world > 1:
        raise RuntimeError(f"torchrun environment incomplete: {', '.join(missing)} not set; start the learners "
                           f"with `torchrun --nproc_per_node N ...`")
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if world == 1:
        return 0, 1, 0
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend_name(), init_method="env://", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    log.info("learner group: rank %d of %d (local rank %d, %s)", rank, world, local_rank, dist.get_backend())
    return rank, world, local_rank


def active(world_size: int) -> bool:
    """True when collectives must run: more than one rank and an initialized process group.

    Raises RuntimeError if ``world_size > 1`` but no process group exists (a rank would otherwise train
    alone and silently diverge from the others).
    """
    if world_size <= 1:
        return False
    if not dist.is_initialized():
        raise RuntimeError(f"world_size {world_size} but torch.distributed is not initialized: call "
                           f"init_distributed_from_env() (torchrun) or init_process_group first")
    return True


def all_reduce_sum(values: Sequence[float], world_size: int) -> list[float]:
    """SUM of a few float64 numbers over the ranks (float64 keeps token counts exact)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if active(world_size):
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
    return t.cpu().tolist()


def _buckets(params: list[torch.nn.Parameter], numel: int):
    """Consecutive groups of same-dtype, same-device parameters of at most ``numel`` elements."""
    bucket, size = [], 0
    for p in params:
        if bucket and (size + p.numel() > numel or p.dtype != bucket[0].dtype or p.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += p.numel()
    if bucket:
        yield bucket


def all_reduce_grads(params: Iterable[torch.nn.Parameter], world_size: int, bucket_numel: int = BUCKET_NUMEL) -> None:
    """SUM every parameter's gradient over the ranks, in flattened buckets (a missing grad counts as 0)."""
    params = list(params)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not active(world_size):
        return
    for bucket in _buckets(params, bucket_numel):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat)
        offset = 0
        for p in bucket:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n


@torch.no_grad()
def broadcast_params(params: Iterable[torch.nn.Parameter], world_size: int, src: int = 0) -> None:
    """Copy rank ``src``'s parameters to every rank (start-up, so all ranks begin identical)."""
    if not active(world_size):
        return
    for p in params:
        dist.broadcast(p.data, src=src)
