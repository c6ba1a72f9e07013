"""vLLM for CUDA beside the HF engine on one GPU (issue 22). Cases, run in this order:

    equal     tests/integration/test_vllm_gpu.py on SmolLM2: LoRA and full-weight updates served by
              ``VLLMEngine`` give a fresh engine's greedy tokens; behavior vs learner logprobs; the
              seconds from a saved update to its first served token (LoRA: save + load + first token;
              full: checkpoint directory, or tensors copied in place)
    decode    the Qwen2.5-0.5B architecture, random bf16 weights, 64-token random prompts, 256 new
              tokens each at T = 1 with EOS ignored, batch 256 and 1024: vLLM (``LLM.generate``, the
              engine's settings: processed logprobs, one logprob per token) against the HF engine's fast
              path (``StaticSampler``, CUDA graph + compiled step), tok/s = batch x 256 / wall seconds
              (median of the timed calls after one warm-up); the memory-bound limit per step is
              (weight bytes + KV bytes read per step) / 4.3 TB/s, printed with its formula
    launchers ``distrl buffer`` + ``distrl learn`` + ``distrl rollout --engine vllm|hf`` on GPU 0 (the
              learner and the actor share it), full fine-tuning, half_vocab, completions/s over the
              timed versions; the learner's publish and the actor's load seconds (TensorBoard)
    trl       TRL GRPOTrainer on the same GPU, same model/batch/group/lengths (bench.gpu_pipeline.case_trl)

    python -m bench.gpu_vllm --model SMOLLM2 --tokenizer QWEN_TOKENIZER_DIR --out DIR [--cases ...]

Prints a table, then one JSON object on the last line (also ``OUT/gpu_vllm.json`` after every case, so a
call cut at its limit keeps what was measured). Keys: greedy_equal_lora, greedy_equal_full,
decode_tok_s_b256, decode_tok_s_b1024, vs_trl, weight_latency_lora_s, weight_latency_full_s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HBM_BYTES_PER_S = 4.3e12  # measured copy bandwidth of one H200 (device notes), the roofline's denominator


def case_equal(args, out: Path) -> dict:
    result = out / "equal.json"
    env = {**os.environ, "DISTRL_GPU_MODEL": args.model, "DISTRL_GPU_RESULT": str(result)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/integration/test_vllm_gpu.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=args.case_timeout_s)
    (out / "equal.log").write_text(proc.stdout + proc.stderr)
    print(proc.stdout[-3000:], flush=True)
    data = json.loads(result.read_text()) if result.exists() else {}
    return {**data, "test_passed": proc.returncode == 0}


def roofline_tok_s(weight_bytes: int, cfg, batch: int, prompt: int, new: int) -> tuple[float, str]:
    """Memory-bound decode limit in tok/s: each step reads every weight once and each row's KV cache (at the
    mean context, prompt + new / 2 tokens). Returns (tok/s, the formula with its numbers)."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2  # K and V, bf16 bytes
    mean_ctx = prompt + new / 2
    step_s = (weight_bytes + batch * mean_ctx * kv_per_token) / HBM_BYTES_PER_S
    formula = (f"({weight_bytes / 1e9:.3f} GB weights + {batch} rows x {mean_ctx:.0f} tokens x "
               f"{kv_per_token} B KV) / 4.3 TB/s = {1e3 * step_s:.3f} ms a step")
    return batch / step_s, formula


def case_decode(args, out: Path) -> dict:
    import torch
    from vllm import LLM, SamplingParams

    from bench.gpu_generate import QWEN25_05B, build_model, sampler
    from bench.gpu_pipeline import build_model as save_model

    model_dir = save_model("qwen2.5-0.5b", args.tokenizer, Path(args.work) / "qwen0.5b")
    prompt, new = 64, 256
    res: dict = {}
    hf = build_model(QWEN25_05B, "cuda")
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())  # tied head counted once
    llm = LLM(model=str(model_dir), dtype="bfloat16", gpu_memory_utilization=0.5, seed=0,
              max_num_seqs=max(args.batches), logprobs_mode="processed_logprobs", max_model_len=1024)
    for batch in args.batches:
        g = torch.Generator().manual_seed(1)
        rows = torch.randint(0, QWEN25_05B["vocab_size"] - 2, (batch, prompt), generator=g).tolist()
        params = SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True, logprobs=0, seed=0)
        reqs = [{"prompt_token_ids": r} for r in rows]
        llm.generate(reqs, params, use_tqdm=False)  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = llm.generate(reqs, params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        limit, formula = roofline_tok_s(weight_bytes, hf.config, batch, prompt, new)
        res[f"vllm_b{batch}"] = dict(tok_s=round(batch * new / statistics.median(times)),
                                     times_s=[round(t, 3) for t in times])
        res[f"roofline_b{batch}"] = dict(tok_s=round(limit), formula=formula,
                                         vllm_fraction=round(batch * new / statistics.median(times) / limit, 3))
        print(f"vllm b{batch}: {res[f'vllm_b{batch}']} roofline {formula}", flush=True)
    del llm
    for batch in args.batches:
        g = torch.Generator().manual_seed(1)
        rows = torch.randint(0, QWEN25_05B["vocab_size"] - 2, (batch, prompt), generator=g).tolist()
        s = sampler(hf, graphs=True, compile_step=True)
        try:
            s.sample(rows, [new] * batch, 1.0)
            times = []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                s.sample(rows, [new] * batch, 1.0)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            res[f"hf_b{batch}"] = dict(tok_s=round(batch * new / statistics.median(times)),
                                       times_s=[round(t, 3) for t in times])
        except Exception as exc:  # e.g. out of memory at 1024 rows: reported, vLLM's numbers stand
            res[f"hf_b{batch}"] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
        print(f"hf b{batch}: {res[f'hf_b{batch}']}", flush=True)
        del s
        torch.cuda.empty_cache()
    return res


def _launcher_args(args, engine: str) -> SimpleNamespace:
    return SimpleNamespace(batch_size=args.batch_size, group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                           versions=args.versions, weights_transport=args.weights_transport, pack_tokens=8192,
                           chunk=None, head_chunk=4096, async_compile=False, async_timeout_s=args.case_timeout_s,
                           gpus=1, warmup_versions=2, engine=engine)


def case_launchers(args, out: Path) -> dict:
    from bench.gpu_pipeline import build_model as save_model
    from bench.gpu_pipeline import run_launchers, scalar_events

    model_dir = save_model("qwen2.5-0.5b", args.tokenizer, Path(args.work) / "qwen0.5b")
    res = {}
    for engine in args.engines:
        work = Path(args.work) / f"launchers_{engine}"
        try:
            r = run_launchers(_launcher_args(args, engine), model_dir, work, args.max_staleness)
        except Exception as exc:
            res[engine] = {"error": f"{type(exc).__name__}: {exc}"[-1500:]}
            print(f"launchers {engine}: {res[engine]}", flush=True)
            continue
        tb = work / f"async_s{args.max_staleness}" / "tb"
        pub = [v for _, _, v in scalar_events(tb / "learner0", "learner/weight_publish_s")][2:]
        load = [v for _, _, v in scalar_events(tb / "actor0", "actor/weight_load_s")][2:]
        r["weight_publish_s_median"] = statistics.median(pub) if pub else None
        r["weight_load_s_median"] = statistics.median(load) if load else None
        res[engine] = r
        print(f"launchers {engine}: {r}", flush=True)
    return res


def case_trl(args, out: Path) -> dict:
    from bench.gpu_pipeline import build_model as save_model
    from bench.gpu_pipeline import case_trl as trl

    model_dir = save_model("qwen2.5-0.5b", args.tokenizer, Path(args.work) / "qwen0.5b")
    return trl(_launcher_args(args, "hf"), model_dir, out)


def summary(res: dict) -> dict:
    eq, dec, lau, trl = (res.get(k, {}) for k in ("equal", "decode", "launchers", "trl"))
    vllm_run = lau.get("vllm", {})
    trl_cps = trl.get("completions_per_s")
    full = None
    if vllm_run.get("weight_publish_s_median") is not None and vllm_run.get("weight_load_s_median") is not None:
        full = vllm_run["weight_publish_s_median"] + vllm_run["weight_load_s_median"]
    return {"greedy_equal_lora": eq.get("greedy_equal_lora"), "greedy_equal_full": eq.get("greedy_equal_full"),
            "greedy_equal_full_tensors": eq.get("greedy_equal_full_tensors"),
            "logprob_abs_diff_mean": eq.get("logprob_abs_diff_mean"),
            "decode_tok_s_b256": dec.get("vllm_b256", {}).get("tok_s"),
            "decode_tok_s_b1024": dec.get("vllm_b1024", {}).get("tok_s"),
            "hf_decode_tok_s_b256": dec.get("hf_b256", {}).get("tok_s"),
            "hf_decode_tok_s_b1024": dec.get("hf_b1024", {}).get("tok_s"),
            "vs_trl": (vllm_run.get("completions_per_s") / trl_cps
                       if vllm_run.get("completions_per_s") and trl_cps else None),
            "hf_vs_trl": (lau.get("hf", {}).get("completions_per_s") / trl_cps
                          if lau.get("hf", {}).get("completions_per_s") and trl_cps else None),
            "weight_latency_lora_s": eq.get("weight_latency_lora_s"),
            "weight_latency_full_s": full,
            "weight_latency_full_in_place_s": eq.get("weight_latency_full_tensors_s")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="SmolLM2-135M-Instruct (.gguf or HF directory) for `equal`")
    p.add_argument("--tokenizer", required=True, help="the Qwen2.5 tokenizer directory for the 0.5B architecture")
    p.add_argument("--cases", default="equal,decode,launchers,trl")
    p.add_argument("--engines", default="vllm,hf", help="launchers: engines, in order")
    p.add_argument("--batches", default="256,1024")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--versions", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--max_staleness", type=int, default=1)
    p.add_argument("--weights_transport", default="fs", choices=["fs", "zmq", "nccl"])
    p.add_argument("--case_timeout_s", type=int, default=420)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_vllm_out"))
    p.add_argument("--work", default="/tmp/gpu_vllm")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.engines = args.engines.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = {"equal": case_equal, "decode": case_decode, "launchers": case_launchers, "trl": case_trl}
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "errors": {}}
    for name in args.cases.split(","):
        t0 = time.perf_counter()
        try:
            res[name] = cases[name](args, out)
        except Exception as exc:
            res["errors"][name] = f"{type(exc).__name__}: {exc}"[-1500:]
            traceback.print_exc()
        res.setdefault("case_s", {})[name] = round(time.perf_counter() - t0, 1)
        res["summary"] = summary(res)
        (out / "gpu_vllm.json").write_text(json.dumps(res, indent=1, default=str))
        print(f"[{name}] {res['case_s'][name]} s", flush=True)
    print("\n| key | value |\n|---|---|")
    for k, v in res["summary"].items():
        print(f"| {k} | {v} |")
    print(json.dumps(res["summary"], default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
