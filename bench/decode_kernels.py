"""The decode kernels' launch settings, swept on one GPU (issue 23, acceptance 3): each setting's time beside the
default's, measured in the same run.

- ``attention``: :func:`distrl.rollout.engines.hf.kernels.launch_decode_attention` on the 0.5B architecture's decode
  shapes (``--slots`` slots, 14 query and 2 K/V heads of 64, bf16), every slot at context C for each C of
  ``--contexts`` (the slots' buffer holds C rounded up to 64 positions), over the settings ``--block_n`` x
  ``--warps`` x ``--stages`` x ``--programs_per_sm``, and FlashAttention's varlen kernel (``slot_attention``'s
  ``flash``) beside them. Bytes = slots x 2 heads x C x 64 x 2 (K and V) x 2 bytes; TB/s = bytes / time.
- ``pick``: :func:`distrl.rollout.engines.hf.kernels.launch_sample_rows` on (``--slots``, 151,936) fp32 logits at T = 1,
  over ``--pick_block`` x ``--pick_warps``; G entries/s.

Times: CUDA events around ``--reps`` calls after 3 warm-up calls, the median of 5 such windows. Every setting's
output is checked against the default's (attention: max |difference| < 2e-2; pick: the same tokens).

    python -m bench.decode_kernels --out DIR        (CUDA)

Prints a table, then one JSON object on the last line (also ``DIR/decode_kernels.json``): per case and context,
the default's time, the fastest setting and ``best_over_default`` (the default's time / the fastest's).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEADS, KV_HEADS, HEAD_DIM, VOCAB = 14, 2, 64, 151_936  # Qwen2.5-0.5B


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def time_us(fn, reps: int) -> float:
    """Median over 5 windows of ``reps`` calls (CUDA events), microseconds a call."""
    import torch

    for _ in range(3):
        fn()
    windows = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        windows.append(1e3 * start.elapsed_time(end) / reps)
    return statistics.median(windows)


def attention_inputs(slots: int, context: int):
    import torch

    length = -(-context // 64) * 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(slots, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(2, slots, length, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # (n, Hkv, L, D) views of (n, L, Hkv, D), as SlotLayer
    lengths = torch.full((slots,), context, dtype=torch.int32, device="cuda")
    return q, k, v, lengths


def case_attention(args) -> dict:
    import torch

    res = {}
    for context in args.contexts:
        res[f"c{context}"] = attention_context(args, context)
        torch.cuda.empty_cache()
    return res


def attention_context(args, context: int) -> dict:
    """Every setting at one context, beside the default and FlashAttention."""
    import torch

    from distrl.rollout.engines.hf import kernels as hk

    scale = HEAD_DIM ** -0.5
    q, k, v, lengths = attention_inputs(args.slots, context)
    gb = args.slots * KV_HEADS * context * HEAD_DIM * 2 * 2 / 1e9
    ref = torch.empty_like(q)
    hk.launch_decode_attention(q, k, v, lengths, scale, ref)
    default_us = time_us(partial(hk.launch_decode_attention, q, k, v, lengths, scale, ref), args.reps)
    flash_us = time_us(partial(hk.slot_attention, q[:, :, None], k, v, lengths, scale, impl="flash"), args.reps)
    rows = []
    for block_n, warps, stages, pps in itertools.product(args.block_n, args.warps, args.stages, args.programs_per_sm):
        out = torch.empty_like(q)
        settings = dict(block_n=block_n, warps=warps, stages=stages or None, programs_per_sm=pps)
        call = partial(hk.launch_decode_attention, q, k, v, lengths, scale, out, **settings)
        try:
            call()
            err = (out.float() - ref.float()).abs().max().item()
            us = time_us(call, args.reps)
        except Exception as e:  # a setting triton cannot build (e.g. shared memory): reported, not fatal
            rows.append(dict(settings, error=f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        rows.append(dict(settings, us=round(us, 2), tb_s=round(gb / us * 1e3, 3),
                         over_default=round(default_us / us, 3), max_err=round(err, 4), ok=err < 2e-2))
    good = [r for r in rows if r.get("ok")]
    best = min(good, key=lambda r: r["us"]) if good else None
    print(f"attention c{context}: default {default_us:.1f} us ({gb / default_us * 1e3:.2f} TB/s), flash "
          f"{flash_us:.1f} us, best {best}", flush=True)
    return dict(gb=round(gb, 4), default_us=round(default_us, 2), default_tb_s=round(gb / default_us * 1e3, 3),
                flash_us=round(flash_us, 2), best=best, best_over_default=best and round(default_us / best["us"], 3),
                settings=rows)


def case_pick(args) -> dict:
    import torch

    from distrl.rollout.engines.hf import kernels as hk

    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(args.slots, VOCAB, device="cuda", generator=g) * 3
    temperature = torch.ones((), device="cuda")
    seed = torch.tensor([7], device="cuda")
    tok0, logp0 = torch.empty(args.slots, dtype=torch.long, device="cuda"), torch.empty(args.slots, device="cuda")
    hk.launch_sample_rows(logits, temperature, seed, tok0, logp0)
    default_us = time_us(partial(hk.launch_sample_rows, logits, temperature, seed, tok0, logp0), args.reps)
    entries = args.slots * VOCAB / 1e9
    rows = []
    for block, warps in itertools.product(args.pick_block, args.pick_warps):
        tok, logp = torch.empty_like(tok0), torch.empty_like(logp0)
        try:
            call = partial(hk.launch_sample_rows, logits, temperature, seed, tok, logp, block=block, warps=warps)
            call()
            us = time_us(call, args.reps)
        except Exception as e:
            rows.append(dict(block=block, warps=warps, error=f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        # another block draws other noise per column (the Philox counter is the lane's), so tokens may differ:
        # check the logprob of each pick against the row's log-softmax instead
        want = torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0]
        rows.append(dict(block=block, warps=warps, us=round(us, 2), g_entries_s=round(entries / us * 1e6, 1),
                         over_default=round(default_us / us, 3),
                         ok=bool((logp - want).abs().max().item() < 1e-3)))
    good = [r for r in rows if r.get("ok")]
    best = min(good, key=lambda r: r["us"]) if good else None
    print(f"pick: default {default_us:.1f} us, best {best}", flush=True)
    return dict(default_us=round(default_us, 2), best=best,
                best_over_default=best and round(default_us / best["us"], 3), settings=rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory of decode_kernels.json")
    p.add_argument("--cases", default="attention,pick", help="attention, pick")
    p.add_argument("--slots", type=int, default=1024, help="rows decoded at once")
    p.add_argument("--contexts", type=ints, default=ints("192,512,1024"), help="attention: positions each slot reads")
    p.add_argument("--block_n", type=ints, default=ints("32,64,128"), help="attention: positions a block reads")
    p.add_argument("--warps", type=ints, default=ints("2,4,8"), help="attention: warps of the split kernel")
    p.add_argument("--stages", type=ints, default=ints("1,2,3,4"), help="attention: pipeline stages (0: triton's)")
    p.add_argument("--programs_per_sm", type=ints, default=ints("2"),
                   help="attention: split target (splits only below slots x 2 heads = this x the SMs)")
    p.add_argument("--pick_block", type=ints, default=ints("256,512,1024,2048"), help="pick: lanes of a program")
    p.add_argument("--pick_warps", type=ints, default=ints("2,4,8,16"), help="pick: warps of a program")
    p.add_argument("--reps", type=int, default=20, help="calls a timed window")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        p.error("needs CUDA")
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"gpu": torch.cuda.get_device_name(), "slots": args.slots}
    cases = [c for c in args.cases.split(",") if c]
    for case in cases:
        if case not in ("attention", "pick"):
            p.error(f"--cases: unknown case {case!r} (attention, pick)")
    if "attention" in cases:
        res["attention"] = case_attention(args)
    if "pick" in cases:
        res["pick"] = case_pick(args)
    line = json.dumps(res)
    (args.out / "decode_kernels.json").write_text(json.dumps(res, indent=1))
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
