"""GPU pipeline benchmark (issue 7): every case in one run, a table last, then one JSON line.

Cases (each in its own try/except, so one failure still reports the rest; partial results are
written to ``--out`` after every case):

- ``mfu``: learner tokens/s and MFU of one optimizer step (full fine-tuning, bf16, sdpa, fp32 chunked
  head in TF32) on a random-init Qwen2.5 architecture, padded against packed micro-batches, with and
  without gradient checkpointing, compiled layers, the Cut Cross-Entropy or halfmm head (``--mfu_variants``;
  ``defaults``: the learner as `distrl train` runs it), or on a given model (``--model``: a directory or GGUF);
  a torch profiler summary of one step of ``--profile_variant`` (``profile_learner.txt``); on a GPU
  (case ``headcheck``), a check of the CCE and halfmm heads against the chunked fp32 one (logprobs,
  gradients, one timing each).
  FLOPs are model FLOPs (recomputation not counted): ``6 * N_body`` per input token (N_body = the
  decoder layers' matmul weights), ``6 * V * H`` per completion token (the head runs on completion
  positions only), and causal attention ``6 * L * d_attn * layers`` per token of a sequence of L
  tokens (half of the full L x L products, each sequence on its own). MFU = FLOPs / time / 790e12
  (the bf16 matmul rate measured on an H200 of this workplace).
- ``async``: the separate launchers (``distrl buffer``; ``distrl rollout --engine hf`` on GPU 0;
  ``distrl learn`` on GPU 1 through CUDA_VISIBLE_DEVICES) to ``--versions`` policy versions with
  ``--max_staleness 2`` and with ``--max_staleness 0``, all else equal (task ``half_vocab``: its
  reward, the fraction of even token ids, varies within every group, so no version is skipped for
  lack of signal, as it would be with a random model on a task it never solves). Wall time is taken between
  the learner's versions 1 and N-1 (TensorBoard wall times; the start-up and the final checkpoint
  are left out); learner idle = GET waits / wall in that window (``learner/idle_fraction_version``);
  actor idle = 1 - generate time / wall in that window (``actor/generate_s``).
- ``colocated``: one GPU: ``distrl buffer`` and ``distrl learn --learner_generates --number_of_actors 0``
  (the learner samples its own groups with the HF fast path over its own model while its GET waits,
  no weight transport), ``--max_staleness 0``; completions/s over the same window as ``async``. This
  is the like-for-like comparison with TRL (one GPU each).
- ``generate``: the HF engine fast path against plain ``generate``: read from
  ``bench/results/gpu_generate.json`` (``bench/gpu_generate.py``, another case's script) when it is there.
- ``trl``: TRL's GRPOTrainer on GPU 0 with the same model, group size, prompts, completion length
  (``min_new_tokens = max_new_tokens``), batch and number of optimizer steps; completions/s between
  steps 1 and N-1, against distrl's colocated run (one GPU each) over the same window; the async
  run's two GPUs against it is reported too.

Usage (GPU): ``python -m bench.gpu_pipeline --tokenizer DIR --out DIR``; on CPU with tiny sizes:
``python -m bench.gpu_pipeline --tiny --tokenizer ../shared/data/tokenizers/qwen2.5``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench.results_file import merge

ROOT = Path(__file__).resolve().parents[1]
PEAK_FLOPS = 790e12  # bf16 dense matmul, measured on an H200 of this workplace (KINDS.md)

ARCHS = {  # random-init Qwen2.5 architectures (the weights' values do not change the speed)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=151936, tie_word_embeddings=True),
}


def build_model(arch: str, tokenizer: str, out: Path) -> Path:
    """Save a random-init Qwen2 of ``arch`` (bf16 on GPU) with ``tokenizer`` into ``out``."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    cfg = Qwen2Config(**ARCHS[arch], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                      bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def model_flops(cfg, seq_lens: list[int], completion_tokens: int, finetune: str = "full") -> float:
    """Model FLOPs of one forward+backward (docstring of the module); full fine-tuning only."""
    if finetune != "full":
        raise ValueError("only --finetune full is counted here")
    h, layers, inter = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    head_dim = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim
    n_body = layers * (h * h + 2 * h * kv + h * h + 3 * h * inter)  # q, k, v, o, gate, up, down
    tokens = sum(seq_lens)
    attention = sum(6 * L * L * h * layers for L in seq_lens)  # causal: half of 12 * L^2 * d per layer
    return 6 * n_body * tokens + 6 * cfg.vocab_size * h * completion_tokens + attention


def synthetic_rows(n: int, group: int, prompt_len: int, completion_lens: list[int], vocab: int, seed: int = 0):
    """``n`` completion rows (``n / group`` groups) of distrl.core.rows.COMPLETION_SCHEMA with random ids."""
    from distrl.core.rows import table_from_rows

    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        c = completion_lens[i % len(completion_lens)]
        rows.append({"sample_id": f"s{i}", "group_id": f"g{i // group}", "prompt_id": f"p{i // group}",
                     "actor_id": 0, "policy_version": 0, "last_policy_version": 0,
                     "prompt_ids": [rnd.randrange(100, vocab - 1000) for _ in range(prompt_len)],
                     "completion_ids": [rnd.randrange(100, vocab - 1000) for _ in range(c)],
                     "behavior_logprobs": [-12.0] * c, "temperature": 1.0, "reward": float(i % 2),
                     "reward_components": {"correct": float(i % 2)}, "advantage": 1.0 if i % 2 else -1.0,
                     "finish_reason": "length", "prompt_text": "", "completion_text": "",
                     "gen_start_time": time.time(), "gen_seconds": 0.0})
    return table_from_rows(rows)


def case_mfu(args, model_dir: Path, out: Path) -> dict:
    """Learner step time, tokens/s and MFU: padded, packed, packed + checkpointing, packed + compiled layers."""
    import torch

    cuda = torch.cuda.is_available()
    n, group, prompt_len = args.mfu_completions, 8, args.prompt_len
    rnd = random.Random(1)
    shortest = args.max_new_tokens // 4 if args.min_new_tokens is None else args.min_new_tokens
    lens = [rnd.randint(shortest, args.max_new_tokens) for _ in range(n)]  # varied lengths
    table = synthetic_rows(n, group, prompt_len, lens, vocab_size(model_dir))
    seq_lens = [prompt_len + c - 1 for c in lens]
    results = {}
    for name in args.mfu_variants.split(","):
        pack_tokens, ckpt, compiled, head = variant_settings(name, args.pack_tokens)
        try:
            results[name] = learner_variant(args, model_dir, out, table, seq_lens, lens, name, pack_tokens, ckpt,
                                            compiled, head, n // group, group)
        except Exception as exc:  # one variant failing leaves the others
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[-2000:], "mfu": 0.0}
        print(f"mfu {name}: {results[name]}", flush=True)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    best = max(results, key=lambda k: results[k]["mfu"])
    return {"arch": args.arch, "completions": n, "prompt_len": prompt_len, "completion_lens": [min(lens), max(lens)],
            "input_tokens": sum(seq_lens), "pack_tokens": args.pack_tokens, "learner_chunk_size": args.chunk,
            "variants": results, "best": best, "mfu": results[best]["mfu"]}


def vocab_size(model_dir) -> int:
    """The vocabulary size in ``model_dir``'s config.json (token ids of the synthetic rows stay below it)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("text_config", config)["vocab_size"]


def variant_settings(name: str, pack_tokens: int) -> tuple[int, bool, bool, str]:
    """(pack tokens, checkpointing, compiled, head) of a variant name: ``padded`` or ``packed`` or
    ``pack<N>`` (rows of N tokens) or ``defaults`` (the learner as `distrl train` runs it: micro-batches by
    --learner_chunk_tokens, not --chunk, and the ``auto`` head), then any of ``+ckpt``, ``+compile``, ``+pack``
    (packed rows of --pack_tokens), ``+unsorted`` (micro-batches by token budget in table order, as
    before `distrl.learn.batch.widest_first`; see :func:`learner_variant`) and one of ``+cce``, ``+halfmm``
    (``--learner_head``; else the chunked head, ``auto`` for ``defaults``). Raises ValueError on an unknown name
    or option, or both heads."""
    base, *opts = name.split("+")
    if base in ("padded", "defaults"):
        pack = pack_tokens if "pack" in opts else 0
    elif base == "packed":
        pack = pack_tokens
    elif base.startswith("pack") and base[4:].isdigit():
        pack = int(base[4:])
    else:
        raise ValueError(f"unknown learner variant {name!r}")
    unknown = set(opts) - {"ckpt", "compile", "cce", "halfmm", "pack", "unsorted"}
    if unknown:
        raise ValueError(f"unknown options {sorted(unknown)} in learner variant {name!r}")
    heads = [o for o in ("cce", "halfmm") if o in opts]
    if len(heads) > 1:
        raise ValueError(f"learner variant {name!r} names two heads ({' and '.join(heads)}): pick one")
    return pack, "ckpt" in opts, "compile" in opts, heads[0] if heads else ("auto" if base == "defaults" else "chunked")


def head_check(model_dir: Path, n: int = 8192) -> dict:
    """Cut Cross-Entropy and halfmm against the chunked fp32 head on the model's (bf16) head weight:
    logprobs and gradients, for hidden states of two scales (flat and peaked distributions). Keys per
    scale: ``logp_max_abs_diff``, ``grad_hidden_rel``, ``grad_weight_rel`` (cce; skipped when
    ``cut_cross_entropy`` is not installed), the same with a ``halfmm_`` prefix, and ``<impl>_ms``: one
    forward + backward of the ``n`` positions after a warm-up call (a single timing, not a benchmark)."""
    import torch
    from transformers import AutoModelForCausalLM

    from distrl.learn.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda()
    weight = model.get_output_embeddings().weight.detach()
    torch.backends.cuda.matmul.allow_tf32 = True
    gen = torch.Generator("cuda").manual_seed(0)
    try:
        import cut_cross_entropy  # noqa: F401
        impls, out = ("chunked", "cce", "halfmm"), {}
    except ImportError:
        impls, out = ("chunked", "halfmm"), {"cce": "cut_cross_entropy is not installed: not checked"}
    for scale in (1.0, 30.0):
        hidden = (torch.randn(1, n, weight.shape[1], device="cuda", generator=gen) * scale).bfloat16()
        targets = torch.randint(0, weight.shape[0], (1, n), device="cuda", generator=gen)
        upstream = torch.randn(1, n, device="cuda", generator=gen)
        res, ms = {}, {}
        for impl in impls:
            for _ in range(2):  # the first call warms up (Triton compilation, cuBLAS heuristics)
                h = hidden.clone().requires_grad_(True)
                w = weight.clone().requires_grad_(True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                logp = token_logprobs(h, w, targets, 1.0, chunk_tokens=4096, impl=impl)
                (logp * upstream).sum().backward()
                torch.cuda.synchronize()
                ms[f"{impl}_ms"] = (time.perf_counter() - t0) * 1e3
            res[impl] = (logp.detach().float(), h.grad.float(), w.grad.float())
        lc, hc, wc = res["chunked"]
        rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
        row = {"logp_mean": float(lc.mean()), **ms}
        for impl, prefix in (("cce", ""), ("halfmm", "halfmm_")):
            if impl in res:
                lx, hx, wx = res[impl]
                row.update({f"{prefix}logp_max_abs_diff": float((lc - lx).abs().max()),
                            f"{prefix}grad_hidden_rel": rel(hx, hc), f"{prefix}grad_weight_rel": rel(wx, wc)})
        out[f"scale{scale:g}"] = row
    del model
    torch.cuda.empty_cache()
    return out


def learner_variant(args, model_dir, out, table, seq_lens, lens, name, pack_tokens, ckpt, compiled, head, groups,
                    group):
    """Median step time of one learner configuration on ``table``; profiles ``--profile_variant``."""
    import torch

    from distrl.cmd.assemble import learner_sections
    from distrl.cmd.config import TrainConfig
    from distrl.learn.learner import Learner

    cuda = torch.cuda.is_available()
    # defaults: micro-batches by --learner_chunk_tokens and the head's chunk as distrl train's; else the bench's
    sizes = {} if name.startswith("defaults") else dict(learner_chunk_size=args.chunk,
                                                          learner_head_chunk_tokens=args.head_chunk)
    cfg = TrainConfig(model=str(model_dir), backend="hf", finetune="full", dtype="bfloat16" if cuda else "float32",
                      learning_rate=1e-6, learner_pack_tokens=pack_tokens, gradient_checkpointing=ckpt,
                      learner_compile=compiled, learner_head=head, max_new_tokens=args.max_new_tokens,
                      batch_size=groups, group_size=group, **sizes)
    lrn = Learner(*learner_sections(cfg), 0, 1, "tcp://127.0.0.1:9", str(model_dir))
    flops = model_flops(lrn.model.config, seq_lens, sum(lens))
    if "+unsorted" in name:  # the learner before widest-first micro-batches: rows in table order
        import numpy as np

        import distrl.learn.learner

        distrl.learn.learner.widest_first = lambda t: np.arange(t.num_rows)
    try:
        return timed_variant(args, lrn, table, name, flops, seq_lens, out)
    finally:
        import distrl.learn.batch
        import distrl.learn.learner

        distrl.learn.learner.widest_first = distrl.learn.batch.widest_first


def timed_variant(args, lrn, table, name, flops, seq_lens, out) -> dict:
    """Median of ``--repeat`` steps after ``--warmup``; peak memory, host syncs; profiles ``--profile_variant``."""
    import torch

    cuda = torch.cuda.is_available()
    for _ in range(args.warmup):
        lrn.train_step(table)
    times = []
    for _ in range(args.repeat):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        lrn.train_step(table)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = sorted(times)[len(times) // 2]
    mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    syncs = host_syncs(lrn, table) if cuda else None
    if name == args.profile_variant:
        profile_step(lrn, table, out / "profile_learner.txt", cuda)
    return {"step_s": step, "times_s": times, "tokens_per_s": sum(seq_lens) / step,
            "mfu": flops / step / PEAK_FLOPS, "tflops": flops / step / 1e12, "peak_mem_gib": mem,
            "host_syncs_per_step": syncs}


def host_syncs(lrn, table) -> int:
    """Host-device synchronizations during one learner step (``torch.cuda.set_sync_debug_mode``): each
    makes the host wait for the GPU, which then idles while the host prepares the next work."""
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            lrn.train_step(table)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def profile_step(lrn, table, path: Path, cuda: bool) -> None:
    """torch.profiler table (top 25 ops by device time) of one learner step, written to ``path``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        lrn.train_step(table)
        if cuda:
            torch.cuda.synchronize()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scalar_events(tb_dir: Path, tag: str) -> list:
    """[(step, wall_time, value)] of one TensorBoard scalar."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    ea.Reload()
    if tag not in ea.Tags()["scalars"]:
        return []
    return [(e.step, e.wall_time, e.value) for e in ea.Scalars(tag)]


def run_launchers(args, model_dir: Path, work: Path, staleness: int, colocated: bool = False) -> dict:
    """distrl buffer + rollout (GPU 0) + learn (GPU 1) to --versions versions; window metrics. With
    ``colocated``: no actor; ``distrl learn --learner_generates --number_of_actors 0`` on GPU 0 alone."""
    run_name = f"colocated_s{staleness}" if colocated else f"async_s{staleness}"
    port_b, port_pub, port_ep = free_port(), free_port(), free_port()
    buf, pub, ep = (f"tcp://127.0.0.1:{p}" for p in (port_b, port_pub, port_ep))
    common = ["--batch_size", str(args.batch_size), "--group_size", str(args.group_size),
              "--max_staleness", str(staleness)]
    role = ["--model", str(model_dir), "--task", "half_vocab", "--max_new_tokens", str(args.max_new_tokens),
            "--log_dir", str(work), "--run_name", run_name, *common[:4],
            "--weights_transport", "fs" if colocated else args.weights_transport,
            "--finetune", getattr(args, "finetune", "full")]  # what learn and rollout share
    learn_only = ["--max_steps", str(args.versions), "--backend", "hf", "--learning_rate",
                  "1e-6", "--checkpoint_every", "0", "--export_final", "off", *common[4:]]
    if args.weights_transport == "nccl" and not colocated:
        role += ["--weights_broadcast_port", str(free_port())]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false",
           # packed batches vary in shape: without it 19 of the learner's 96 GB were reserved but unusable
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
    gpus = ["0", "1"] if args.gpus >= 2 and not colocated else ["0", "0"]
    extra = ["--learner_generates", "--number_of_actors", "0"] if colocated else []
    logs = work / f"{run_name}.logs"
    shutil.rmtree(work / run_name, ignore_errors=True)  # a fresh run each time
    logs.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "distrl"]
    procs = {
        "buffer": subprocess.Popen(cli + ["buffer", "--run_dir", str(work / run_name / "buffer"), "--address", buf,
                                          *common], cwd=ROOT, env=env, stdout=open(logs / "buffer.out", "w"),
                                   stderr=subprocess.STDOUT),
    }
    time.sleep(2)
    if procs["buffer"].poll() is not None:
        raise RuntimeError(f"distrl buffer exited: {(logs / 'buffer.out').read_text()[-1000:]}")
    procs["learner"] = subprocess.Popen(
        cli + ["learn", *role, *learn_only, "--buffer_address", buf, "--weights_pub_bind", pub,
               "--weights_endpoint_bind", ep,
               "--learner_pack_tokens", str(args.pack_tokens),
               *(["--learner_chunk_size", str(args.chunk)] if args.chunk else []),
               "--learner_head_chunk_tokens", str(args.head_chunk),
               *(["--learner_compile", "True"] if args.async_compile and not colocated else []), *extra],
        cwd=ROOT, env={**env, "CUDA_VISIBLE_DEVICES": gpus[1]}, stdout=open(logs / "learner.out", "w"),
        stderr=subprocess.STDOUT)
    if not colocated:
        procs["actor"] = subprocess.Popen(
            cli + ["rollout", *role, "--engine", getattr(args, "engine", "hf"), "--buffer_address", buf,
                   "--weights_pub", pub, "--weights_endpoint", ep,
                   # vLLM takes its share of the GPU at start; the learner shares the GPU when gpus == 1 (H200,
                   # 2026-12-02: the 0.5B learner took 96 GB beside vLLM's 0.3 = 42 GB and ran out; 0.2 = 28 GB
                   # holds this bench's KV cache many times over)
                   *(["--gpu_memory_utilization", "0.2"] if getattr(args, "engine", "hf") == "vllm" else [])],
            cwd=ROOT, env={**env, "CUDA_VISIBLE_DEVICES": gpus[0]}, stdout=open(logs / "actor.out", "w"),
            stderr=subprocess.STDOUT)
    try:
        code = procs["learner"].wait(timeout=args.async_timeout_s)
    except subprocess.TimeoutExpired:
        code = None
        spy = shutil.which("py-spy")
        for name, proc in procs.items():  # where each role is stuck, for the error report
            if spy and proc.poll() is None:
                dump = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=60)
                (logs / f"{name}.stack").write_text(dump.stdout + dump.stderr)
    for name in ("actor", "buffer", "learner"):
        if name in procs and procs[name].poll() is None:
            procs[name].terminate()
            try:
                procs[name].wait(timeout=20)
            except subprocess.TimeoutExpired:
                procs[name].kill()
    if code != 0:
        tail = (logs / "learner.out").read_text()[-2000:]
        if not colocated:
            tail += "\n--- actor ---\n" + (logs / "actor.out").read_text()[-2000:]
        for stack in sorted(logs.glob("*.stack")):
            tail += f"\n--- {stack.name} ---\n" + stack.read_text()[-4000:]
        raise RuntimeError(f"learner exited with {code} (staleness {staleness}):\n{tail}")
    tb = work / run_name / "tb"
    versions = {s: (w, v) for s, w, v in scalar_events(tb / "learner0", "learner/idle_fraction_version")}
    first, last = args.warmup_versions, args.versions - 1  # the first versions compile and warm caches
    if last - first < 2:
        raise ValueError(f"--versions {args.versions} leaves {last - first} timed versions after "
                         f"--warmup_versions {args.warmup_versions}: need at least 2")
    wall = versions[last][0] - versions[first][0]
    busy_wall = sum((versions[v][0] - versions[v - 1][0]) for v in range(first + 1, last + 1))
    idle = sum(versions[v][1] * (versions[v][0] - versions[v - 1][0]) for v in range(first + 1, last + 1))
    t0, t1 = versions[first][0], versions[last][0]
    actor_tb = tb / ("learner0gen" if colocated else "actor0")
    gen = [(w, v) for _, w, v in scalar_events(actor_tb, "actor/generate_s")]
    gen_in = sum(min(v, w - t0) for w, v in gen if t0 < w <= t1)  # generate time inside the window
    step_s = [v for _, _, v in scalar_events(tb / "learner0", "learner/tokens_per_s")]
    toks = [v for _, _, v in scalar_events(actor_tb, "actor/tokens_per_s")]
    return {"wall_s": wall, "versions_timed": last - first, "s_per_version": wall / (last - first),
            "version_s": [round(versions[v][0] - versions[v - 1][0], 3) for v in sorted(versions) if v - 1 in versions],
            # robust to the seconds a torch.compile recompile (a new shape) adds to a version now and then
            "s_per_version_median": statistics.median(versions[v][0] - versions[v - 1][0]
                                                      for v in range(first + 1, last + 1)),
            "learner_idle": idle / busy_wall, "actor_idle": 1.0 - gen_in / wall,
            "completions_per_s": (last - first) * args.batch_size * args.group_size / wall,
            "actor_tokens_per_s": sum(toks) / max(len(toks), 1),
            "learner_tokens_per_s": sum(step_s) / max(len(step_s), 1)}


def case_async(args, model_dir: Path, out: Path) -> dict:
    work = Path(args.work) / "async"
    # max_staleness 2 first: compile caches it fills can only help the staleness-0 run after it
    asy = run_launchers(args, model_dir, work, 2)
    print(f"async staleness 2: {asy}", flush=True)
    sync = run_launchers(args, model_dir, work, 0)
    print(f"async staleness 0: {sync}", flush=True)
    return {"staleness0": sync, "staleness2": asy, "speedup": sync["wall_s"] / asy["wall_s"],
            "speedup_median": sync["s_per_version_median"] / asy["s_per_version_median"],
            "learner_idle": asy["learner_idle"], "actor_idle": asy["actor_idle"],
            "settings": {"batch_size": args.batch_size, "group_size": args.group_size,
                         "weights_transport": args.weights_transport, "learner_compile": args.async_compile,
                         "max_new_tokens": args.max_new_tokens, "versions": args.versions, "gpus": args.gpus}}


def case_headcheck(args, model_dir: Path, out: Path) -> dict:
    """The Cut Cross-Entropy and halfmm heads against the chunked fp32 head (CUDA only)."""
    res = head_check(model_dir)
    print(f"head check (cce, halfmm vs chunked fp32): {res}", flush=True)
    return res


def case_colocated(args, model_dir: Path, out: Path) -> dict:
    """One GPU: the learner generates its own rollouts (``--learner_generates``, the HF fast path over the
    learner's model, no weight transport), on-policy (``--max_staleness 0``): distrl's one-GPU setting,
    compared with TRL's GRPOTrainer on one GPU."""
    res = run_launchers(args, model_dir, Path(args.work) / "colocated", 0, colocated=True)
    print(f"colocated: {res}", flush=True)
    return {**res, "gpus": 1}


def case_generate(args, model_dir: Path, out: Path) -> dict:
    path = Path(args.generate_result)
    if not path.exists():
        raise FileNotFoundError(f"{path} is not there: run bench/gpu_generate.py (the fast-path benchmark) first")
    data = json.loads(path.read_text())
    ratio = data.get("ratio_fast_vs_generate", data.get("fast_generate_vs_plain"))
    return {"source": str(path), "ratio": ratio, "result": data}


def case_trl(args, model_dir: Path, out: Path) -> dict:
    """TRL GRPOTrainer, one GPU, same model/group/batch/lengths/steps; completions/s between steps 1 and N-1."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from distrl.rollout.tasks import load_task

    task = load_task("half_vocab", None, seed=0)
    problems = task.problems(0)
    prompts = [next(problems) for _ in range(args.batch_size * args.versions * 2)]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [task.prompt(p, tok) for p in prompts]  # the same prompt text distrl's actors send
    ds = Dataset.from_dict({"prompt": texts})
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *a, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            stamps.append(time.time())

    n = args.batch_size * args.group_size
    cuda = torch.cuda.is_available()
    cfg = GRPOConfig(output_dir=str(Path(args.work) / "trl"), per_device_train_batch_size=n,
                     gradient_accumulation_steps=1, num_generations=args.group_size, max_steps=args.versions,
                     max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                     generation_kwargs={"min_new_tokens": args.max_new_tokens}, beta=0.0, learning_rate=1e-6,
                     gradient_checkpointing=False,  # TRL 1.15's default is True: slower, memory these sizes do not need
                     bf16=cuda, logging_steps=1, save_strategy="no", report_to="none", use_vllm=False,
                     model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"}, seed=0,
                     use_cpu=not cuda, dataloader_num_workers=0)

    def reward(completions, completion_ids=None, **kw):  # distrl's half_vocab: fraction of even token ids
        return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]

    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Stamp()])
    t0 = time.time()
    trainer.train()
    total = time.time() - t0
    first, last = args.warmup_versions, args.versions - 1  # the same window as the distrl runs
    wall = stamps[last - 1] - stamps[first - 1]
    return {"wall_s": wall, "total_s": total, "steps_timed": last - first, "s_per_step": wall / (last - first),
            "completions_per_s": (last - first) * n / wall, "gpus": 1}


def table(results: dict) -> str:
    rows = [("case", "result", "target", "met")]
    m = results.get("learner_mfu")
    if isinstance(m, dict) and "variants" in m:
        for name, v in m["variants"].items():
            if "error" in v:
                rows.append((f"learner {name}", "FAILED: " + v["error"][:70], ">= 40% MFU", "no"))
                continue
            rows.append((f"learner {name}", f"{v['tokens_per_s']:.0f} tok/s, MFU {v['mfu']:.1%}, "
                         f"{v['peak_mem_gib']:.1f} GiB, {v.get('host_syncs_per_step')} syncs", ">= 40% MFU",
                         "yes" if v["mfu"] >= 0.4 else "no"))
    a = results.get("async")
    if isinstance(a, dict) and "speedup" in a:
        rows.append(("async s2 vs s0", f"{a['speedup']:.2f}x ({a['staleness0']['s_per_version']:.2f} -> "
                     f"{a['staleness2']['s_per_version']:.2f} s/version)", ">= 1.8x",
                     "yes" if a["speedup"] >= 1.8 else "no"))
        if "speedup_median" in a:
            rows.append(("async s2 vs s0, median version", f"{a['speedup_median']:.2f}x "
                         f"({a['staleness0']['s_per_version_median']:.2f} -> "
                         f"{a['staleness2']['s_per_version_median']:.2f} s/version)", ">= 1.8x",
                         "yes" if a["speedup_median"] >= 1.8 else "no"))
        rows.append(("learner idle (s2)", f"{a['learner_idle']:.1%} (s0: {a['staleness0']['learner_idle']:.1%})",
                     "< 10%", "yes" if a["learner_idle"] < 0.1 else "no"))
        rows.append(("actor idle (s2)", f"{a['actor_idle']:.1%} (s0: {a['staleness0']['actor_idle']:.1%})", "-", "-"))
    t = results.get("trl")
    if isinstance(t, dict) and "completions_per_s" in t and isinstance(a, dict) and "staleness2" in a:
        d = a["staleness2"]["completions_per_s"]
        rows.append(("distrl async 2 GPUs vs TRL 1 GPU", f"{d:.1f} vs {t['completions_per_s']:.1f} compl/s = "
                     f"{d / t['completions_per_s']:.2f}x", "-", "-"))
    h = results.get("head_check")
    if isinstance(h, dict) and "error" not in h:
        for scale, v in h.items():
            for impl, prefix in (("cce", ""), ("halfmm", "halfmm_")):
                if isinstance(v, dict) and f"{prefix}logp_max_abs_diff" in v:
                    rows.append((f"{impl} vs chunked head, {scale}",
                                 f"logp max diff {v[prefix + 'logp_max_abs_diff']:.2g}, grad rel "
                                 f"{v[prefix + 'grad_hidden_rel']:.2g} / {v[prefix + 'grad_weight_rel']:.2g}, "
                                 f"{v.get(impl + '_ms', 0):.1f} ms (chunked {v.get('chunked_ms', 0):.1f})", "-", "-"))
    c = results.get("colocated")
    if isinstance(c, dict) and "completions_per_s" in c:
        rows.append(("distrl 1 GPU (--learner_generates)", f"{c['completions_per_s']:.1f} compl/s, "
                     f"{c['s_per_version']:.2f} s/version", "-", "-"))
    if isinstance(t, dict) and "completions_per_s" in t and isinstance(c, dict) and "completions_per_s" in c:
        d = c["completions_per_s"]
        rows.append(("distrl 1 GPU vs TRL 1 GPU", f"{d:.1f} vs {t['completions_per_s']:.1f} compl/s = "
                     f"{d / t['completions_per_s']:.2f}x", ">= 3x", "yes" if d / t["completions_per_s"] >= 3 else "no"))
    g = results.get("generate")
    if isinstance(g, dict) and "result" in g:
        ok = isinstance(g.get("ratio"), (int, float)) and g["ratio"] >= 2
        rows.append(("fast generate vs plain", f"{g.get('ratio')}x (from {Path(g['source']).name})", ">= 2x",
                     "yes" if ok else "no"))
    for k, v in results.items():
        if isinstance(v, dict) and "error" in v:
            rows.append((k, "FAILED: " + v["error"].splitlines()[-1][:80], "", "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU smoke test")
    p.add_argument("--tokenizer", default=str(ROOT.parent / "shared" / "data" / "tokenizers" / "qwen2.5"))
    p.add_argument("--arch", default=None, help="model architecture (default qwen2.5-0.5b; tiny with --tiny)")
    p.add_argument("--model", default=None, help="a model directory or GGUF file used instead of a random --arch "
                   "(e.g. SmolLM2-135M-Instruct, to time its learner step)")
    p.add_argument("--cases", default="mfu,async,trl,generate")
    p.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    p.add_argument("--work", default="/tmp/gpu_pipeline")
    p.add_argument("--gpus", type=int, default=None)
    p.add_argument("--versions", type=int, default=None)
    p.add_argument("--batch_size", type=int, default=None, help="groups per version")
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=None)
    p.add_argument("--prompt_len", type=int, default=64, help="prompt tokens of the learner case's rows")
    p.add_argument("--min_new_tokens", type=int, default=None, help="mfu case: completion lengths are uniform in "
                   "[this, --max_new_tokens] (default a quarter of --max_new_tokens; equal to it: fixed lengths)")
    p.add_argument("--mfu_completions", type=int, default=None)
    p.add_argument("--pack_tokens", type=int, default=None)
    p.add_argument("--chunk", type=int, default=None, help="--learner_chunk_size")
    p.add_argument("--head_chunk", type=int, default=None, help="--learner_head_chunk_tokens")
    p.add_argument("--mfu_variants", default="padded,packed,packed+ckpt,packed+compile,packed+compile+cce",
                   help="learner variants of the mfu case: padded|packed|pack<N>, then +ckpt, +compile, and "
                   "+cce or +halfmm (--learner_head)")
    p.add_argument("--profile_variant", default="packed+compile+cce", help="the mfu variant profiled")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--async_timeout_s", type=int, default=240)
    p.add_argument("--warmup_versions", type=int, default=1,
                   help="async, colocated and trl cases: versions (steps) before the timed window (compiling)")
    p.add_argument("--weights_transport", default="fs", choices=["fs", "zmq", "nccl"],
                   help="async case: how the actor gets each version (nccl: GPU-to-GPU broadcast, full weights)")
    p.add_argument("--async_compile", action="store_true", help="async case: the learner runs --learner_compile")
    p.add_argument("--generate_result", default=str(ROOT / "bench" / "results" / "gpu_generate.json"),
                   help="bench/gpu_generate.py's JSON (the fast-path case reads it; it runs on its own)")
    p.add_argument("--reuse", default=None, help="a gpu_pipeline.json whose case results are kept; only --cases "
                   "run again (e.g. to add the generate case, or redo one that failed)")
    args = p.parse_args(argv)
    big = not args.tiny
    defaults = dict(arch="qwen2.5-0.5b" if big else "tiny", versions=5 if big else 4, batch_size=32 if big else 2,
                    max_new_tokens=256 if big else 16, mfu_completions=256 if big else 16,
                    pack_tokens=2048 if big else 256, chunk=64 if big else 8, head_chunk=8192 if big else 256)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.tiny:
        args.warmup, args.repeat = 1, 1
    import torch

    if args.gpus is None:
        args.gpus = torch.cuda.device_count()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    machine = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
               if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores), torch {torch.__version__}")
    results: dict = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                     "machine": machine, "args": vars(args)}
    if args.reuse:
        results = json.loads(Path(args.reuse).read_text())
        results = results.get("details", results)  # gpu_pipeline.json or gpu_pipeline.partial.json
        machine = results["machine"]
    needs_model = any(c in ("mfu", "async", "trl", "colocated", "headcheck") for c in args.cases.split(","))
    model_dir = None
    if needs_model and args.model:
        from distrl.core.gguf import resolve_model

        model_dir = Path(resolve_model(args.model))
    elif needs_model:
        model_dir = build_model(args.arch, args.tokenizer, Path(args.work) / f"model-{args.arch}")
    cases = {"mfu": ("learner_mfu", case_mfu), "async": ("async", case_async), "trl": ("trl", case_trl),
             "colocated": ("colocated", case_colocated), "headcheck": ("head_check", case_headcheck),
             "generate": ("generate", case_generate)}
    for name in args.cases.split(","):
        key, fn = cases[name]
        t0 = time.time()
        try:
            results[key] = fn(args, model_dir, out)
        except Exception as exc:  # one failed case must not hide the others
            traceback.print_exc()
            results[key] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
        results[key]["case_s"] = time.time() - t0
        (out / "gpu_pipeline.partial.json").write_text(json.dumps(results, indent=1, default=str))
    a, t, m, g, c = (results.get(k, {}) for k in ("async", "trl", "learner_mfu", "generate", "colocated"))
    trl_rate = t.get("completions_per_s")
    summary = {
        "async_speedup": a.get("speedup"), "learner_idle": a.get("learner_idle"), "actor_idle": a.get("actor_idle"),
        "learner_mfu": m.get("mfu"),
        "fast_generate_vs_plain": g.get("ratio"),
        # like for like: distrl on one GPU (colocated) against TRL on one GPU
        "vs_trl": c["completions_per_s"] / trl_rate if trl_rate and "completions_per_s" in c else None,
        "vs_trl_async_2gpu_vs_trl_1gpu": (a["staleness2"]["completions_per_s"] / trl_rate
                                          if trl_rate and "staleness2" in a else None),
        "date": results["date"], "machine": machine, "details": results,
    }
    merge(out / "gpu_pipeline.json", summary)
    print(table(results))
    print(json.dumps({k: v for k, v in summary.items() if k != "details"}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
