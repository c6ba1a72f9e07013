"""HF engine fast path against transformers' ``generate`` on one GPU (issue 7, generation part).

The Qwen2.5-0.5B architecture with random weights in bf16 (its config is written below: nothing is
downloaded), a batch of 256 random prompts of 64 tokens, 256 new tokens each, sampled at T = 1 with
EOS ignored (every row runs its full length), timed in the same process after warm-up:

    generate_static  model.generate(..., cache_implementation="static"): transformers compiles the
                     decode step itself (torch.compile, mode="reduce-overhead")
    fast             distrl.rollout.engines.hf.static.StaticSampler as the HF engine runs it on CUDA: static
                     cache, decode step run through torch.compile and captured in one CUDA graph,
                     fp32 head, sampling and per-token logprobs inside the graph
    fast_graph       the same without torch.compile (the graph replays unfused eager kernels)
    fast_eager       the same code without the graph (launch-bound; shows what the graph buys)

tok/s = batch * new tokens / wall seconds of one call (median of the timed calls). Checks, reported and
not asserted: the graph's greedy tokens against the eager ones, and each variant's sampled logprobs
(16 rows) against a teacher-forced fp32 recomputation (the learner's way). Torch profiler summaries
(top CUDA kernels) of one batch of each variant go to OUT/profile_{fast,graph,eager}.md.

    python bench/gpu_generate.py --out DIR [--deadline_s 270]

Needs CUDA; imports only torch, transformers and distrl.rollout.engines. Prints a table, then one JSON object
on the last line (also written to OUT/gpu_generate.json after every phase, so a cut run keeps what it
measured).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from distrl.rollout.engines.hf.static import StaticSampler  # noqa: E402

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu",
                  use_sliding_window=False, bos_token_id=151643, eos_token_id=151643)
BATCH, PROMPT, NEW = 256, 64, 256
SMOKE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, vocab_size=1000, tie_word_embeddings=True, max_position_embeddings=512,
             bos_token_id=999, eos_token_id=999)  # --smoke: the script's logic on CPU, nothing timed that matters


def build_model(config: dict, device: str):
    """Qwen2ForCausalLM of ``config`` with random weights, eval mode: bf16 on CUDA, fp32 on CPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**config))
    model = model.to(torch.bfloat16 if device == "cuda" else torch.float32).eval()
    model.generation_config.eos_token_id = None  # run every row to max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> list[float]:
    """Wall seconds of each of ``repeats`` calls of fn (synchronized before and after)."""
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def sampler(model, graphs: bool, compile_step: bool = False) -> StaticSampler:
    """A StaticSampler that never stops early (no stop ids): fixed-length rows, as the timing needs."""
    dev = model.device
    return StaticSampler(lambda: model, pad_id=0, stop_ids=torch.empty(0, dtype=torch.long, device=dev),
                         generator=torch.Generator(dev).manual_seed(0), cuda_graphs=graphs and dev.type == "cuda",
                         compile_step=compile_step)


def profile_table(prof, top: int = 15) -> tuple[str, list[dict]]:
    """A markdown table of the ``top`` CUDA kernels by time, and the rows as dicts."""
    from torch.autograd import DeviceType

    events = []
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue  # kernels only: an op's self CUDA time repeats its kernels' time
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            events.append((t, e.count, e.key))
    total = sum(t for t, _, _ in events) or 1.0
    events.sort(reverse=True)
    rows = [dict(name=k[:100], calls=c, self_cuda_ms=round(t / 1e3, 3), share=round(t / total, 4))
            for t, c, k in events[:top]]
    lines = [f"total CUDA kernel time: {total / 1e3:.1f} ms", "", "| kernel | calls | CUDA ms | share |",
             "|---|---:|---:|---:|"]
    lines += [f"| `{r['name']}` | {r['calls']} | {r['self_cuda_ms']:.2f} | {100 * r['share']:.1f}% |" for r in rows]
    return "\n".join(lines) + "\n", rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON and profiles")
    parser.add_argument("--deadline_s", type=float, default=270.0,
                        help="optional phases are skipped once this many seconds have passed")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU: checks the script, times nothing")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs CUDA (or --smoke)")
    dev = "cpu" if args.smoke else "cuda"
    B, P, N = (8, 16, 16) if args.smoke else (BATCH, PROMPT, NEW)
    vocab = (SMOKE if args.smoke else QWEN25_05B)["vocab_size"] - 1
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    import transformers

    res: dict = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu (--smoke)", torch=torch.__version__,
                     transformers=transformers.__version__, batch=B, prompt=P, new_tokens=N, temperature=1.0,
                     dtype="bfloat16" if dev == "cuda" else "float32", errors={})

    def save():
        res["elapsed_s"] = round(time.perf_counter() - start, 1)
        (args.out / "gpu_generate.json").write_text(json.dumps(res, indent=1))

    def phase(name, fn, optional=True):
        if optional and time.perf_counter() - start > args.deadline_s:
            res["errors"][name] = "skipped: deadline"
            save()
            return
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # a failed phase is reported; the others still run
            res["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
            traceback.print_exc()
        print(f"[{name}] {time.perf_counter() - t0:.1f} s", flush=True)
        save()

    model = build_model(SMOKE if args.smoke else QWEN25_05B, dev)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab - 1, (B, P), generator=g)  # (B, P), no special tokens
    rows, budget, tokens = prompts.tolist(), [N] * B, B * N

    def teacher_gap(sub, toks, lps) -> dict:
        """Fast-path logprobs (k, T) against a teacher-forced fp32 recomputation (the learner's way)."""
        full = torch.cat([torch.tensor(sub, device=dev), toks], dim=1)  # (k, P + T)
        with torch.inference_mode():
            h = model.model(input_ids=full).last_hidden_state[:, P - 1:-1]  # (k, T, hidden)
            logp = torch.log_softmax(F.linear(h.float(), model.lm_head.weight.float()), dim=-1)
            ref = logp.gather(-1, toks[..., None]).squeeze(-1)
        gap = (lps - ref).abs()
        return dict(max_abs=float(gap.max()), mean_abs=float(gap.mean()), ref_mean=float(ref.mean()))

    def run_variant(name: str, s: StaticSampler, repeats: int):
        t0 = time.perf_counter()
        s.sample(rows, budget, 1.0)  # warm-up: captures the graph (and compiles the step)
        warm = time.perf_counter() - t0
        times = timed(lambda: s.sample(rows, budget, 1.0), repeats)
        toks, lps, lengths, _ = s.sample(rows, budget, 1.0)
        res[name] = dict(tok_s=round(tokens / statistics.median(times)), times_s=[round(t, 4) for t in times],
                         step_ms=round(1e3 * statistics.median(times) / N, 3), warmup_s=round(warm, 1),
                         captures=s.captures, lengths_all_full=bool((lengths == N).all()),
                         logprob_gap_vs_teacher_forced=teacher_gap(rows[:16], toks[:16], lps[:16]))

    samplers = {}

    def fast():  # the engine's default on CUDA: graph + compiled step
        samplers["fast"] = sampler(model, graphs=True, compile_step=not args.smoke)
        run_variant("fast", samplers["fast"], 3)

    def fast_graph():
        run_variant("fast_graph", sampler(model, graphs=True), 3)

    def checks():
        sub, new = rows[:16], min(64, N)
        k = len(sub)
        tg, lg, _, _ = sampler(model, graphs=True).sample(sub, [new] * k, 0.0)
        te, le, _, _ = sampler(model, graphs=False).sample(sub, [new] * k, 0.0)
        res["check_greedy_graph_vs_eager"] = dict(tokens_equal=float((tg == te).float().mean()),
                                                   logprob_max_abs_diff=float((lg - le).abs().max()))

    def profile():
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof_ctx

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
        cases = [("profile_fast", samplers.get("fast"), budget, "graph + compiled step (the default)"),
                 ("profile_graph", sampler(model, graphs=True), [min(64, N)] * B, "graph only"),
                 ("profile_eager", sampler(model, graphs=False), [8] * B, "eager (no graph)")]
        for name, s, bud, what in cases:
            if s is None:
                continue
            s.sample(rows, bud, 1.0)  # capture (and compile) outside the profile
            with prof_ctx(activities=acts) as prof:
                s.sample(rows, bud, 1.0)
                sync()
            text, top = profile_table(prof, top=20)
            (args.out / f"{name}.md").write_text(f"fast path, {what}, batch {B} x {max(bud)} new tokens\n\n" + text)
            res[name + "_top"] = top[:6]

    def eager():
        s = sampler(model, graphs=False)
        s.sample(rows, [8] * B, 1.0)
        times = timed(lambda: s.sample(rows, budget, 1.0), 1)
        res["fast_eager"] = dict(tok_s=round(tokens / times[0]), times_s=[round(t, 4) for t in times])

    def generate():
        ids = prompts.to(dev)
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=True, temperature=1.0,
                      top_k=0, top_p=1.0, cache_implementation="static", pad_token_id=0)

        def call():
            with torch.inference_mode():
                return model.generate(ids, **kwargs)

        t0 = time.perf_counter()
        out = call()  # warm-up: transformers compiles the decode step here
        warm = time.perf_counter() - t0
        times = timed(call, 3)
        res["generate_static"] = dict(tok_s=round(tokens / statistics.median(times)),
                                      times_s=[round(t, 4) for t in times],
                                      warmup_s=round(warm, 1), out_len=int(out.shape[1] - P),
                                      step_ms=round(1e3 * statistics.median(times) / N, 3))

    phase("fast", fast, optional=False)
    phase("generate_static", generate, optional=False)
    phase("profile", profile)
    phase("checks", checks)
    phase("fast_graph", fast_graph)
    phase("fast_eager", eager)

    base = res.get("generate_static", {}).get("tok_s")
    if base:
        for k in ("fast", "fast_graph", "fast_eager"):
            if k in res:
                res[k]["vs_generate"] = round(res[k]["tok_s"] / base, 2)
    res["ratio_fast_vs_generate"] = res.get("fast", {}).get("vs_generate")
    save()
    print(f"\n{'variant':<16}{'tok/s':>10}{'ms/step':>10}{'x generate':>12}")
    for k in ("generate_static", "fast", "fast_graph", "fast_eager"):
        if k in res:
            r = res[k]
            ms = r.get("step_ms", round(1e3 * statistics.median(r["times_s"]) / N, 3))
            print(f"{k:<16}{r['tok_s']:>10}{ms:>10}{r.get('vs_generate', 1.0):>12}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
