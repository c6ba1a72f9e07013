"""Weight broadcast latency: time from publish to every actor serving the new policy version.

For the Qwen2.5-0.5B architecture (random weights; the embedded character tokenizer, so nothing is
downloaded), a LoRA r=16 adapter on every projection and the full weights, through each transport
(`fs`: shared directory, `zmq`: download from the learner's endpoint), with A actor processes each
running a real engine (vLLM on CPU, the HF engine where vLLM is absent):

    learner: save payload -> digest -> rename -> announce        (publish_s)
    actor:   announcement -> fetch (+ digest check) -> load -> 1-token generate with the new version
    latency = last actor serving - publish start                 (to_all_serving_s)

`nccl` (full weights only) broadcasts from the learner's device to each actor's device in one
collective (gloo on CPU); on GPUs each actor then needs its own GPU (the learner keeps GPU 0).

    python bench/weights.py [--device cpu|cuda] [--engine vllm|hf] [--actors 2] [--versions 3]

Prints a table, then one JSON object on the last line; also merged into bench/results/weights.json
under the key of the device ("cpu" or "cuda").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=2048, tie_word_embeddings=True,
                  rope_theta=1000000.0, rms_norm_eps=1e-6)


TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=64, max_position_embeddings=512, tie_word_embeddings=True)


def build_model(out: Path, dtype: str, arch: dict) -> Path:
    """Save a random-init Qwen2-architecture model (`arch`) with the character tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from distrl.core.tiny import build_tokenizer

    if (out / "config.json").exists():
        return out
    tok = build_tokenizer()
    config = Qwen2Config(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                         **arch)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def actor_main(args) -> None:
    """One actor process: serve each announced version, report when it serves it."""
    import zmq

    from distrl.rollout.engines import cpu_engine_env, make_engine
    from distrl.weights import LoadOptions, WeightSubscriber, transport

    if args.device == "cpu":
        os.environ.update(cpu_engine_env(args.idx))
    engine = make_engine(args.engine, args.model, dtype=args.dtype, max_lora_rank=16, max_model_len=256,
                         seed=args.idx)
    engine.generate(["1+1="], 1, 1.0, 1)
    sub = WeightSubscriber(args.pub, args.endpoint, f"actor{args.idx}")
    if args.transport == "nccl":
        from distrl.weights.nccl import BroadcastReceiver

        device = "cuda" if args.device == "cuda" else "cpu"
        receiver = BroadcastReceiver(args.broadcast, 1 + args.idx, args.actors, device)
    else:
        options = LoadOptions(args.endpoint, Path(args.work) / f"cache{args.idx}")
        fetcher = transport(args.transport).loader(options, sub)  # FsFetcher or ZmqFetcher: .fetch(ann)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(args.report)
    push.send_json({"ready": args.idx})
    while True:
        ann = sub.poll()
        if ann.version > engine.version:
            if ann.format == "stop":
                break
            t0 = time.time()
            if args.transport == "nccl":
                version, named = receiver.receive(ann, lambda v: sub.wait_for(v, timeout_s=60))
                t1 = time.time()
                engine.load_tensors(version, named)
            else:
                path = fetcher.fetch(ann)
                t1 = time.time()
                engine.load_weights(ann.version, ann.format, path)
            engine.generate(["1+1="], 1, 1.0, 1)  # vLLM loads a LoRA lazily, at its first request
            push.send_json({"idx": args.idx, "version": engine.version, "served_at": time.time(),
                            "fetch_s": t1 - t0, "load_s": time.time() - t1})
        time.sleep(0.002)
    push.close()


class Learner:
    """The learner side: a model whose weights change each version, a publisher and a transport."""

    def __init__(self, model_dir: Path, work: Path, dtype: str, device: str):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from distrl.weights import PayloadDirectory, WeightPublisher

        self.torch = torch
        load = lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)  # noqa: E731
        self.full = load()  # full fine-tuning: every weight changes
        self.lora = get_peft_model(load(), LoraConfig(r=16, lora_alpha=32, init_lora_weights=False, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        self.publisher = WeightPublisher()
        shutil.rmtree(work / "weights", ignore_errors=True)  # versions restart at 1
        self.transport = PayloadDirectory(work / "weights", keep=3)
        self.version = 0
        self.broadcast_port = _free_port()

    def start_broadcast(self, actors: int) -> str:
        """Create the collective group (blocks until every actor joined); return its address."""
        from distrl.weights.nccl import BroadcastSender

        self.sender = BroadcastSender("127.0.0.1", self.broadcast_port, actors, self.full.device)
        return self.sender.address

    def publish(self, fmt: str, transport: str = "fs") -> tuple[float, float, int]:
        """Change the weights, save and announce the next version; return (start time, publish s, bytes)."""
        model = self.lora if fmt == "lora" else self.full
        with self.torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(1e-3)
        self.version += 1
        t0 = time.time()
        if transport == "nccl":
            ann = self.sender.publish(self.version, list(model.named_parameters()))
        else:
            ann = self.transport.publish(self.version, fmt, lambda d: model.save_pretrained(str(d)))
        self.publisher.announce(ann)
        return t0, time.time() - t0, ann.nbytes

    def stop(self) -> None:
        from distrl.weights import announcement

        self.version += 1
        self.publisher.announce(announcement(self.version, "stop", "", ""))


def run_case(args, learner: Learner, transport: str, fmt_list: list[str], work: Path) -> dict:
    import zmq

    pull = zmq.Context.instance().socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    procs = [subprocess.Popen([sys.executable, __file__, "--role", "actor", "--idx", str(i), "--model", args.model,
                               "--engine", args.engine, "--device", args.device, "--dtype", args.dtype,
                               "--transport", transport, "--pub", learner.publisher.pub_address,
                               "--endpoint", learner.publisher.latest_address,
                               "--report", f"tcp://127.0.0.1:{port}", "--work", str(work), "--actors", str(args.actors),
                               "--broadcast", f"127.0.0.1:{learner.broadcast_port}"],
                              env={**os.environ, **_actor_devices(args, transport, i)})
             for i in range(args.actors)]
    if transport == "nccl":
        learner.start_broadcast(args.actors)
    for _ in procs:
        assert pull.poll(600_000), "actor did not start"
        pull.recv_json()
    time.sleep(0.5)  # subscribers connected
    results = {}
    for fmt in fmt_list:
        rows = []
        for _ in range(args.versions):
            t0, publish_s, nbytes = learner.publish(fmt, transport)
            reports = []
            while len(reports) < args.actors:
                assert pull.poll(600_000), f"no actor served version {learner.version}"
                r = pull.recv_json()
                if r.get("version") == learner.version:
                    reports.append(r)
            rows.append({"publish_s": publish_s, "to_all_serving_s": max(r["served_at"] for r in reports) - t0,
                         "to_first_serving_s": min(r["served_at"] for r in reports) - t0,
                         "fetch_s": max(r["fetch_s"] for r in reports), "load_s": max(r["load_s"] for r in reports),
                         "mb": nbytes / 2**20})
        results[fmt] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    learner.stop()
    for p in procs:
        p.wait(timeout=120)
    pull.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="driver", choices=["driver", "actor"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--engine", default=None, choices=["vllm", "hf"], help="default: vllm on CPU, hf on cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--versions", type=int, default=3, help="versions per case (median reported)")
    parser.add_argument("--transports", default="fs,zmq")
    parser.add_argument("--formats", default="lora,full")
    parser.add_argument("--work", default="/tmp/distrl-bench-weights")
    parser.add_argument("--arch", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "tiny"],
                        help="tiny: a smoke test of the script itself")
    for name in ("idx", "model", "transport", "pub", "endpoint", "report", "broadcast"):
        parser.add_argument(f"--{name}", default=None)
    args = parser.parse_args()
    args.engine = args.engine or ("vllm" if args.device == "cpu" else "hf")
    if args.role == "actor":
        args.idx = int(args.idx)
        return actor_main(args)

    work = Path(args.work) / args.arch
    work.mkdir(parents=True, exist_ok=True)
    args.model = str(build_model(work / "model", args.dtype, QWEN25_05B if args.arch == "qwen2.5-0.5b" else TINY))
    learner = Learner(Path(args.model), work, args.dtype, args.device)
    formats = args.formats.split(",")
    table = {t: run_case(args, learner, t, [f for f in formats if t != "nccl" or f == "full"], work)
             for t in args.transports.split(",")}
    print(f"\n{'transport':<10}{'format':<7}{'MB':>9}{'publish s':>11}{'first s':>9}{'all s':>9}"
          f"{'fetch s':>9}{'load s':>9}")
    figures = {}
    for t, per_fmt in table.items():
        for fmt, r in per_fmt.items():
            print(f"{t:<10}{fmt:<7}{r['mb']:>9.1f}{r['publish_s']:>11.3f}{r['to_first_serving_s']:>9.3f}"
                  f"{r['to_all_serving_s']:>9.3f}{r['fetch_s']:>9.3f}{r['load_s']:>9.3f}")
            figures[f"{fmt}_{t}_s"] = round(r["to_all_serving_s"], 4)
            figures[f"{fmt}_{t}_mb"] = round(r["mb"], 2)
    for fmt in args.formats.split(","):
        if f"{fmt}_fs_s" in figures and f"{fmt}_zmq_s" in figures:
            figures[f"{fmt}_zmq_vs_fs"] = round(figures[f"{fmt}_zmq_s"] / figures[f"{fmt}_fs_s"], 3)
    figures.update(arch=args.arch, device=args.device, engine=args.engine, actors=args.actors, dtype=args.dtype,
                   machine=platform.node() + (" " + _gpu_name() if args.device == "cuda" else f" {os.cpu_count()} cpu"),
                   date=time.strftime("%Y-%m-%d"))
    out = ROOT / "bench" / "results" / "weights.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    saved = json.loads(out.read_text()) if out.exists() else {}
    saved[args.device if args.arch == "qwen2.5-0.5b" else f"{args.device}-{args.arch}"] = figures
    out.write_text(json.dumps(saved, indent=2))
    print(json.dumps(figures))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _actor_devices(args, transport: str, idx: int) -> dict[str, str]:
    """GPU of actor `idx`: with nccl each actor needs its own GPU (1 + idx); otherwise they share GPU 0."""
    if args.device != "cuda":
        return {}
    return {"CUDA_VISIBLE_DEVICES": str(1 + idx if transport == "nccl" else 0)}


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    main()
