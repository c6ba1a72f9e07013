"""Variable-length generation on one GPU with the HF engine's sampler (issue 23, parts (b) and (c)).

The Qwen2.5-0.5B architecture with random bf16 weights (a random model's EOS timing means nothing, so
each row's length is forced: no stop token, the row's budget ends it), 64-token random prompts, sampled at
T = 1 by :class:`distrl.rollout.engines.hf.continuous.ContinuousSampler` as the engine builds it on CUDA (decode
step compiled and captured in one CUDA graph, a look at ``done`` every 8 steps):

- ``continuous``: ``--rows`` rows whose lengths are drawn from a seeded lognormal (median ``--median``,
  sigma ``--sigma``, capped at ``--cap``), decoded in ``--slots`` slots, once with the slots refilled as
  rows end (continuous batching) and once in static batches of ``--slots`` rows in order, each run to its
  longest row. measured = static seconds / continuous seconds; ideal = (sum over the static batches of the
  longest row x the batch's rows) / the total tokens, i.e. the decode steps x rows the static batch spends
  over those that carry a token; continuous_vs_ideal = measured / ideal.
- ``decode``: fixed length (``--new_tokens``, 256, after ``--prompt_tokens``, 64) at each batch of ``--batches``,
  tok/s = batch x new tokens / wall
  seconds (after a warm-up call of the same shapes), and over the decode steps alone (``decode_steps_*``: the
  call's wall time less that of a 1-token call of the same rows, timed alternately: the prefill, which neither
  limit counts and which is a third of the call at 1024 rows of 512-token prompts; tok/s = batch x the steps
  one call runs more than the other / the difference), against the memory-bound limit
  (:func:`roofline_tok_s`: each step reads every weight once and each row's K/V at its mean context) and
  against the limit that counts compute too (:func:`compute_roofline_tok_s`: at 1024 rows the weight
  products are bound by the GPU's FLOPs, not by its memory); at the largest batch once more without the decode
  kernels of :mod:`distrl.rollout.engines.hf.kernels` (``without_kernels``, ``kernels_speedup``; ``--no-reference``
  skips it) and with FlashAttention's varlen kernel instead of their split-K Triton attention (the default
  since 2026-12-03: ``flash_attention``, ``triton_over_flash``; ``--no-flash-attention`` skips it); and the
  admission of the largest batch's rows (``prefill``) with the sampler's causal SDPA prefill against the masked
  one, alternated (``causal_speedup``).
``--model`` decodes a real model's weights (e.g. SmolLM2) instead, its rows run to their budgets as well.

- ``compile``: the step compiled with symbolic sizes (the default) against compiled per shape, side by side:
  first-call seconds, a new state's first call, ms a step (:func:`case_compile`).

    python -m bench.variable_length --out DIR [--cases continuous,decode]   (CUDA)
    python -m bench.variable_length --smoke --out DIR                     (a tiny model on CPU: the logic)

Prints a table, then one JSON object on the last line (also ``DIR/variable_length.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy bandwidth of one H200 (device notes)
PEAK_FLOPS = 790e12  # bf16 dense matmul, measured on an H200 of this workplace (bench/gpu_pipeline.py)
PROMPT = 64
INTERVAL = 8  # tokens between the sampler's looks at its rows (the HF engine's INFLIGHT_INTERVAL)


def draw_lengths(n: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    """n completion lengths (tokens) from lognormal(log(median), sigma), rounded, clipped to [1, cap]."""
    import random

    rng = random.Random(seed)
    return [min(cap, max(1, round(math.exp(rng.gauss(math.log(median), sigma))))) for _ in range(n)]


def ideal_ratio(lengths: list[int], batch: int) -> float:
    """Static batching's row-steps over the tokens they carry: sum over the batches of ``batch`` rows (in
    order; the last may be smaller) of longest row x rows, divided by sum(lengths)."""
    chunks = [lengths[i: i + batch] for i in range(0, len(lengths), batch)]
    return sum(max(c) * len(c) for c in chunks) / sum(lengths)


def roofline_tok_s(weight_bytes: int, cfg, batch: int, prompt: int, new: int) -> tuple[float, str]:
    """Memory-bound decode limit in tok/s: each step reads every weight once and each row's K/V cache at the
    mean context (prompt + new / 2 tokens), at 4.3 TB/s. Returns (tok/s, the formula with its numbers)."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2  # K and V, bf16 bytes
    mean_ctx = prompt + new / 2
    step_s = (weight_bytes + batch * mean_ctx * kv_per_token) / HBM_BYTES_PER_S
    formula = (f"({weight_bytes / 1e9:.3f} GB weights + {batch} rows x {mean_ctx:.0f} tokens x "
               f"{kv_per_token} B KV) / 4.3 TB/s = {1e3 * step_s:.3f} ms a step")
    return batch / step_s, formula


def compute_roofline_tok_s(params: int, cfg, batch: int, prompt: int, new: int) -> tuple[float, str]:
    """Decode limit in tok/s counting compute too: a step takes at least max(matmul FLOPs / 790 TFLOP/s,
    weight bytes / 4.3 TB/s) for the weight products (2 x ``params`` FLOPs a row: every weight, the tied
    head included, multiplies each row once) plus max(attention FLOPs, K/V bytes at the mean context) for
    attention (4 x layers x heads x head_dim x context FLOPs a row). At batch 1024 the weight products are
    bound by compute, not by memory. Returns (tok/s, the formula with its numbers)."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    mean_ctx = prompt + new / 2
    kv_bytes = batch * mean_ctx * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2
    attn_flops = batch * 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * mean_ctx
    gemm_s = max(2 * params * batch / PEAK_FLOPS, 2 * params / HBM_BYTES_PER_S)  # bf16 weights
    attn_s = max(attn_flops / PEAK_FLOPS, kv_bytes / HBM_BYTES_PER_S)
    formula = (f"max({2 * params * batch / 1e12:.3f} TFLOP, {2 * params / 1e9:.3f} GB) + max({attn_flops / 1e12:.4f} "
               f"TFLOP, {kv_bytes / 1e9:.3f} GB KV) at 790 TFLOP/s, 4.3 TB/s = {1e3 * gemm_s:.3f} + "
               f"{1e3 * attn_s:.3f} ms a step")
    return batch / (gemm_s + attn_s), formula


def make_sampler(model, cuda: bool, dynamic: bool = True, kernels: bool | None = None, attention: str = "triton",
                 prefill: str = "causal"):
    """The sampler the HF engine builds on CUDA, with no stop token (every row runs to its budget);
    ``dynamic=False``: its step compiled per shape instead (the ``compile`` case's reference); ``kernels=False``:
    without the decode kernels of distrl.rollout.engines.hf.kernels (the ``decode`` case's reference); ``prefill``: its
    prefill attention (``masked``: the ``prefill`` reference)."""
    import torch

    from distrl.rollout.engines.hf.continuous import ContinuousSampler

    dev = model.device
    return ContinuousSampler(lambda: model, pad_id=0, stop_ids=torch.empty(0, dtype=torch.long, device=dev),
                             generator=torch.Generator(dev).manual_seed(0), cuda_graphs=cuda, interval=INTERVAL,
                             compile_step=cuda, compile_dynamic=dynamic, kernels=kernels, decode_attention=attention,
                             prefill_attention=prefill)


def timed_run(sampler, rows, budget, slots: int, static: bool) -> tuple[float, int]:
    """(wall seconds, tokens generated) of one ``run`` to the end, synchronized around."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    tokens = sum(len(f.tokens) for done in sampler.run(rows, budget, 1.0, slots=slots, static=static) for f in done)
    sync()
    return time.perf_counter() - t0, tokens


def random_rows(n: int, vocab: int, seed: int, prompt: int = PROMPT) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab - 1, (n, prompt), generator=g).tolist()


def case_continuous(model, args, cuda: bool) -> dict:
    lengths = draw_lengths(args.rows, args.median, args.sigma, args.cap, seed=args.seed)
    rows = random_rows(args.rows, model.config.vocab_size, seed=1)
    sampler = make_sampler(model, cuda)
    # warm-up on the same shapes (slots x positions x columns): one row of the longest budget, the others ending
    # 16 tokens apart in halves (the last half at 8, a quarter at 24, ...), so the tail's step runs every bucket
    # (distrl.rollout.engines.hf.slots.buckets) before the timed runs
    levels = args.slots.bit_length()
    warm = [max(lengths)] + [8 + 16 * (levels - (i + 1).bit_length()) for i in range(1, args.slots)]
    timed_run(sampler, rows[: args.slots], warm, args.slots, static=False)
    captures = sampler.captures
    static_s, static_tokens = timed_run(sampler, rows, lengths, args.slots, static=True)
    print(f"static: {static_s:.3f} s", flush=True)
    cont_s, cont_tokens = timed_run(sampler, rows, lengths, args.slots, static=False)
    print(f"continuous: {cont_s:.3f} s", flush=True)
    if not static_tokens == cont_tokens == sum(lengths):
        raise AssertionError(f"tokens: static {static_tokens}, continuous {cont_tokens}, drawn {sum(lengths)}")
    ideal = ideal_ratio(lengths, args.slots)
    measured = static_s / cont_s
    return dict(rows=args.rows, slots=args.slots, tokens=sum(lengths), length_median=sorted(lengths)[len(lengths) // 2],
                length_mean=round(sum(lengths) / len(lengths), 1), length_max=max(lengths),
                static_s=round(static_s, 3), continuous_s=round(cont_s, 3),
                static_tok_s=round(static_tokens / static_s), continuous_tok_s=round(cont_tokens / cont_s),
                continuous_vs_static=round(measured, 3), continuous_ideal_ratio=round(ideal, 3),
                continuous_vs_ideal=round(measured / ideal, 3), graph_captures_after_warmup=sampler.captures - captures)


def decode_times(model, batch: int, new: int, repeats: int, cuda: bool, kernels: bool | None = None,
                 attention: str = "triton", prompt: int = PROMPT) -> tuple[list[float], list[float]]:
    """Wall seconds of ``repeats`` calls of ``batch`` rows x ``new`` tokens (after a warm-up call: compile, capture),
    and of ``repeats`` calls of the same rows x 1 token (the prefill, the first pick and :func:`call_steps` (1) decode
    steps), alternated."""
    import torch

    rows = random_rows(batch, model.config.vocab_size, seed=2, prompt=prompt)
    sampler = make_sampler(model, cuda, kernels=kernels, attention=attention)
    timed_run(sampler, rows, [new] * batch, batch, static=False)  # compile + capture
    times, prefill = [], []
    for _ in range(repeats):
        times.append(timed_run(sampler, rows, [new] * batch, batch, static=False)[0])
        prefill.append(timed_run(sampler, rows, [1] * batch, batch, static=False)[0])
    del sampler
    if cuda:
        torch.cuda.empty_cache()
    return times, prefill


def prefill_times(model, batch: int, prompt: int, repeats: int) -> dict[str, list[float]]:
    """Wall seconds of one admission of ``batch`` rows of ``prompt`` tokens (the prefill, the first pick, the slot
    writes) with each of the sampler's prefill attentions (``causal``: SDPA; ``masked``: the (k, 1, Q, Q) mask),
    alternated, after one untimed round; no graph, no compile (an admission runs eagerly in a run too)."""
    import torch

    from distrl.rollout.engines.hf.continuous import PREFILL_ATTENTION
    from distrl.rollout.engines.hf.decode import PAD_MULTIPLE, grouped_attention_mode, round_up

    dev = model.device
    rows = random_rows(batch, model.config.vocab_size, seed=2, prompt=prompt)
    samplers = {a: make_sampler(model, cuda=False, prefill=a) for a in PREFILL_ATTENTION}  # no graph, no compile
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {a: [] for a in samplers}
    with torch.inference_mode(), grouped_attention_mode(model):
        for i in range(repeats + 1):
            for a, sampler in samplers.items():
                st = sampler._prepare(model, batch, round_up(prompt, PAD_MULTIPLE) + PAD_MULTIPLE, PAD_MULTIPLE)
                sync()
                t0 = time.perf_counter()
                sampler._admit(model, st, list(range(batch)), rows, [1] * batch)
                sync()
                if i:
                    times[a].append(round(time.perf_counter() - t0, 4))
    del samplers
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return times


def call_steps(new: int, interval: int = INTERVAL) -> int:
    """Decode steps a call of ``new`` tokens a row runs (its first token comes from the prefill; the host looks at
    the rows every ``interval`` tokens): 511 for 512, 7 for 1."""
    return -(-new // interval) * interval - 1


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def decode_steps(tok_s: float | None, limit: float, both: float) -> dict:
    """The ``decode_steps_*`` fields of a batch: tok/s of its decode steps alone, against both limits."""
    if tok_s is None:
        return dict(decode_steps_tok_s=None, decode_steps_roofline_fraction=None,
                    decode_steps_compute_roofline_fraction=None)
    return dict(decode_steps_tok_s=round(tok_s), decode_steps_roofline_fraction=round(tok_s / limit, 3),
                decode_steps_compute_roofline_fraction=round(tok_s / both, 3))


def case_decode(model, args, cuda: bool) -> dict:
    """tok/s at each batch against both limits, over the whole call and over its decode steps alone (the call's
    wall time less a 1-token call's: the prefill, which neither limit counts); at the largest batch, also without
    the decode kernels and with FlashAttention (side by side)."""
    params = sum(p.numel() for p in model.parameters())  # a tied head counted once
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    new = args.new_tokens
    res = {}
    for batch in args.batches:
        times, prefill = decode_times(model, batch, new, args.repeats, cuda, prompt=args.prompt_tokens)
        tok_s = batch * new / median(times)
        decode_s = median(times) - median(prefill)  # the steps one call runs more than the 1-token call
        steps = call_steps(new) - call_steps(1)
        steps_tok_s = batch * steps / decode_s if decode_s > 0 and steps > 0 else None  # None: noise won
        limit, formula = roofline_tok_s(weight_bytes, model.config, batch, args.prompt_tokens, new)
        both, both_formula = compute_roofline_tok_s(params, model.config, batch, args.prompt_tokens, new)
        res[f"b{batch}"] = dict(tok_s=round(tok_s), times_s=[round(t, 3) for t in times], roofline_tok_s=round(limit),
                                roofline_fraction=round(tok_s / limit, 3), formula=formula,
                                compute_roofline_tok_s=round(both), compute_roofline_fraction=round(tok_s / both, 3),
                                compute_formula=both_formula, step_ms=round(1e3 * median(times) / new, 3),
                                prefill_s=[round(t, 3) for t in prefill], **decode_steps(steps_tok_s, limit, both))
        print(f"decode b{batch}: {res[f'b{batch}']}", flush=True)
    top = max(args.batches)
    admit = prefill_times(model, top, args.prompt_tokens, args.repeats)
    res[f"b{top}"]["prefill"] = dict(causal_s=admit["causal"], masked_s=admit["masked"],
                                     causal_speedup=round(median(admit["masked"]) / median(admit["causal"]), 3))
    print(f"prefill b{top}: {res[f'b{top}']['prefill']}", flush=True)
    if cuda and args.reference:  # the same step without the decode kernels (masked attention, pick in torch)
        times = decode_times(model, top, new, args.repeats, cuda, kernels=False, prompt=args.prompt_tokens)[0]
        tok_s = top * new / median(times)
        res[f"b{top}"]["without_kernels"] = dict(tok_s=round(tok_s), times_s=[round(t, 3) for t in times],
                                                 step_ms=round(1e3 * median(times) / new, 3))
        res[f"b{top}"]["kernels_speedup"] = round(res[f"b{top}"]["tok_s"] / tok_s, 3)
    if cuda and args.flash_attention:  # the kernels with FlashAttention's varlen kernel instead of the Triton one
        times = decode_times(model, top, new, args.repeats, cuda, attention="flash", prompt=args.prompt_tokens)[0]
        tok_s = top * new / median(times)
        res[f"b{top}"]["flash_attention"] = dict(tok_s=round(tok_s), times_s=[round(t, 3) for t in times],
                                                 step_ms=round(1e3 * median(times) / new, 3))
        res[f"b{top}"]["triton_over_flash"] = round(res[f"b{top}"]["tok_s"] / tok_s, 3)
    return res


def replay_ms(graph, times: int = 50) -> float:
    """Milliseconds a replay of a captured step takes (``times`` replays timed by CUDA events)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(times):
        graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / times, 3)


def case_profile(model, args, cuda: bool) -> dict:
    """Where a decode step's time goes at the largest batch: the captured step replayed alone (greedy and
    sampled; ms a step, no prefill, no host), and the kernels of the same step run without its graph (the
    profiler's table, top 25 by device time, saved to ``DIR/profile_b<batch>.txt``)."""
    import torch

    from distrl.rollout.engines.hf.decode import grouped_attention_mode

    batch, new = max(args.batches), args.new_tokens
    rows = random_rows(batch, model.config.vocab_size, seed=2)
    sampler = make_sampler(model, cuda, attention=args.attention)
    res = {"attention": args.attention}
    for temperature, name in ((0.0, "greedy"), (1.0, "sampled")):
        for _ in sampler.run(rows, [new] * batch, temperature, slots=batch):  # compile + capture, state filled
            pass
        st = sampler._states[batch]
        if batch in st.graphs:  # not on CPU (--smoke): nothing captured
            res[f"step_ms_{name}"] = replay_ms(st.graphs[batch])
    st = sampler._states[batch]
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.inference_mode(), grouped_attention_mode(model), torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            sampler._decode_fn(model, st, st.index[:batch])
        if cuda:
            torch.cuda.synchronize()
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=90)
    (args.out / f"profile_b{batch}.txt").write_text(table)
    print(table, flush=True)
    res["batch"], res["table"] = batch, f"profile_b{batch}.txt"
    return res


def case_compile(model, args, cuda: bool) -> dict:
    """The decode step compiled with symbolic sizes (the default) against compiled per shape, side by side:
    seconds of a first call of B rows (compile + capture), then of a call of B/4 rows and longer budgets (a new
    state: compiled again per shape, only captured with symbolic sizes), and ms a step of B rows (the captured
    graph replayed 50 times)."""
    import torch

    batch = max(args.batches)
    rows = random_rows(batch, model.config.vocab_size, seed=3)
    res = {}
    for name, dynamic in (("dynamic", True), ("static", False)):
        torch._dynamo.reset()
        sampler = make_sampler(model, cuda, dynamic)
        first = timed_run(sampler, rows, [32] * batch, batch, static=False)[0]
        other = timed_run(sampler, rows[: batch // 4], [96] * (batch // 4), batch // 4, static=False)[0]
        st = sampler._states[batch]
        step_ms = replay_ms(st.graphs[batch]) if cuda else None
        res[name] = dict(first_call_s=round(first, 2), new_state_call_s=round(other, 2), step_ms=step_ms)
        print(f"compile {name}: {res[name]}", flush=True)
        del sampler, st
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        res["step_ms_dynamic_over_static"] = round(res["dynamic"]["step_ms"] / res["static"]["step_ms"], 3)
    res["batch"] = batch
    return res


def load_model(path: str, cuda: bool):
    """``--model``: its weights (a GGUF file dequantized by :func:`distrl.core.gguf.resolve_model`), bf16 on CUDA."""
    import torch
    from transformers import AutoModelForCausalLM

    from distrl.core.gguf import resolve_model

    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    return AutoModelForCausalLM.from_pretrained(str(resolve_model(path)), dtype=dtype).to(device).eval()


def summary(res: dict) -> dict:
    cont, dec = res.get("continuous", {}), res.get("decode", {})
    top = max((int(k[1:]) for k in dec), default=None)
    return {k: cont.get(k) for k in ("continuous_vs_static", "continuous_ideal_ratio", "continuous_vs_ideal")} | {
        "decode_tok_s": {k: v.get("tok_s") for k, v in dec.items()},
        "decode_roofline_fraction": {k: v.get("roofline_fraction") for k, v in dec.items()},
        "decode_compute_roofline_fraction": {k: v.get("compute_roofline_fraction") for k, v in dec.items()},
        **({f"decode_roofline_fraction_b{top}": dec[f"b{top}"].get("roofline_fraction"),
            f"decode_compute_roofline_fraction_b{top}": dec[f"b{top}"].get("compute_roofline_fraction"),
            f"decode_steps_roofline_fraction_b{top}": dec[f"b{top}"].get("decode_steps_roofline_fraction")}
           if top else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory of variable_length.json")
    p.add_argument("--cases", default="continuous,decode",
                   help="continuous, decode, profile, compile (comma-separated)")
    p.add_argument("--rows", type=int, default=2048, help="continuous: rows (completions)")
    p.add_argument("--slots", type=int, default=256, help="continuous: rows decoded at once (the static batch)")
    p.add_argument("--median", type=float, default=150.0, help="continuous: median completion length, tokens")
    p.add_argument("--sigma", type=float, default=0.8, help="continuous: lognormal sigma of the lengths")
    p.add_argument("--cap", type=int, default=1024, help="continuous: longest completion, tokens")
    p.add_argument("--seed", type=int, default=0, help="continuous: seed of the lengths")
    p.add_argument("--batches", default="256,1024", help="decode: batch sizes")
    p.add_argument("--new_tokens", type=int, default=256, help="decode: new tokens a row")
    p.add_argument("--prompt_tokens", type=int, default=PROMPT,
                   help="decode: prompt tokens a row (the mean context is this + new_tokens / 2)")
    p.add_argument("--repeats", type=int, default=3, help="decode: timed calls a batch (median)")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="decode: skip the largest batch's run without the decode kernels (one more compile)")
    p.add_argument("--attention", default="triton", choices=["flash", "triton"],
                   help="profile: the decode kernels' attention (distrl.rollout.engines.hf.kernels.slot_attention)")
    p.add_argument("--no-flash-attention", dest="flash_attention", action="store_false",
                   help="decode: skip the largest batch's run with FlashAttention's varlen kernel (one more compile)")
    p.add_argument("--model", default=None,
                   help="a causal LM (directory or GGUF file, e.g. SmolLM2) instead of the random 0.5B; its rows "
                        "still run to their budgets (no stop token)")
    p.add_argument("--smoke", action="store_true", help="a tiny model on CPU, small sizes: checks the logic")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    import torch

    from bench.gpu_generate import QWEN25_05B, SMOKE, build_model

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        p.error("needs CUDA (or --smoke)")
    if args.smoke:
        args.rows, args.slots, args.median, args.cap = 24, 8, 6, 24
        args.batches, args.new_tokens, args.repeats = [4], 16, 1
    model = load_model(args.model, cuda) if args.model else build_model(SMOKE if args.smoke else QWEN25_05B,
                                                                         "cuda" if cuda else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "gpu": torch.cuda.get_device_name() if cuda else "cpu (--smoke)", "errors": {}}
    for name, fn in (("continuous", case_continuous), ("decode", case_decode), ("profile", case_profile),
                     ("compile", case_compile)):
        if name in args.cases.split(","):
            try:
                res[name] = fn(model, args, cuda)
            except Exception as exc:  # reported; the other case's numbers stand
                res["errors"][name] = f"{type(exc).__name__}: {exc}"[-1500:]
            res["summary"] = summary(res)
            (args.out / "variable_length.json").write_text(json.dumps(res, indent=1))
    for name in ("continuous", "decode", "profile", "compile"):
        print(f"{name}: {json.dumps(res.get(name))}")
    print(json.dumps(res["summary"] | {"errors": res["errors"]}))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
