"""distrl against a second peer (verl, SkyRL or AReaL) side by side on one GPU (issue 43).

First, ``resolve``: whether a peer installs against the GPU machine's stack (python 3.12, torch 2.11.0+cu130 of
the image, vLLM 0.26.0 staged by bench/gpu_vllm_stage.sh). Each peer is a ``pip install --dry-run
--ignore-installed --report`` for linux x86_64 / cp312 binaries (the platform tags bench/gpu_vllm_stage.sh
downloads with) of ``PEER torch==2.11.0 vllm==0.26.0``. torch is the image's and is not staged: a stub
``torch-2.11.0+cu130`` wheel with no requirements (:func:`torch_stub`) stands in for it, so the resolver checks
the peers' pins against torch 2.11 without resolving torch's own CUDA wheels (one of which, nvidia-nccl-cu13
2.28.9, the registry does not serve). Each attempt's command, exit code and either the conflict (pip's
ERROR lines) or the resolved set (names, versions, download sizes) go to ``bench/results/vs_peer.json``
``peer_install_conflicts`` / ``peer_install_resolved`` (``bench.results_file.merge``: every key kept).

    python -m bench.vs_peer resolve [--peers verl,verl[vllm],areal,skyrl]

Then ``run`` (GPU; verl 0.9.1 resolves, staged by ``bench/gpu_vllm_stage.sh pack-peer`` from
``bench/gpu_peer_wheels.txt`` into /tmp/peer_site, beside distrl's /tmp/site): verl's GRPO colocated on one GPU
(``verl.trainer.main_ppo``: FSDP actor, vLLM rollout ``gpu_memory_utilization`` 0.3 as TRL's vLLM side, one
process group on the one GPU; verl's fully-async mode needs separate rollout and training GPUs), with distrl's
model, prompts (distrl's ``Task.prompt`` messages: system + user turn through the same chat template), reward
(:mod:`bench.vs_peer_reward`: distrl's ``Task.reward``), group, batch (one optimizer step per batch:
``ppo_mini_batch_size`` = batch), completion length and learning rate, no KL term, no entropy bonus:

- ``variable``: SmolLM2 on GSM8K, completions/s over ``--versions`` steps after ``--warmup`` (each step's
  ``timing_s/step`` from verl's console logger), against distrl's side of ``bench.vs_trl run --workload variable
  --trl none`` (same flags): ``vs_peer_variable`` = distrl's completions/s over verl's.
- ``arith``: SmolLM2 on arith, time to base + 0.10 from the launch: verl saves its actor as a Hugging Face
  model every ``--eval_every`` steps (``save_contents=['hf_model']``); each checkpoint is evaluated afterwards by
  distrl's evaluation (``evaluate_engine``, HF engine, the same held-out problems as bench/real_model.py). verl's
  launch clock: the bench stamps each ``step:N`` line of verl's output as it arrives (through Ray's log
  forwarding: ~1 s of jitter), less every ``timing_s/save_checkpoint`` before it (its evaluation cost, as
  distrl's evaluations are left out); start-up = step 1's stamp less its ``timing_s/step``. distrl's side is
  ``bench.real_model run --clock launch --cases distrl1`` (its caches warm: a cold run first).
  ``vs_peer_time_to_accuracy_from_launch`` = verl's launch seconds to the target over distrl's.

    python -m bench.vs_peer run --workload variable|arith --model SmolLM2.gguf --dataset train.jsonl --out DIR
    python -m bench.vs_peer run ... --distrl_from DIR   (verl's side only; distrl's from an earlier run's DIR)
    python -m bench.vs_peer report DIR [DIR ...]   -> bench/results/vs_peer.json (peer, vs_peer_variable,
                                                      vs_peer_time_to_accuracy_from_launch, each with its _runs)
    python -m bench.vs_peer plan --workload arith --model DIR   (CPU: writes the parquet files, prints verl's command)

verl is CUDA-only: ``plan`` is what runs on CPU (data, reward and command, each override checked against
verl's generated config where verl is importable).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "vs_peer.json"
# peer -> the requirement tried (issue 43 names these versions)
PEERS = {"verl": "verl==0.9.1", "verl[vllm]": "verl[vllm]==0.9.1", "skyrl": "skyrl==0.4.0",
         "areal": "areal==1.0.4"}
STACK = ["torch==2.11.0", "vllm==0.26.0"]
PLATFORMS = ([f"manylinux_2_{n}_x86_64" for n in (5, 17, 24, 26, 27, 28, 31, 34, 35)]
             + ["manylinux2014_x86_64", "manylinux1_x86_64", "any"])


def torch_stub(directory: Path) -> Path:
    """A wheel ``torch-2.11.0+cu130`` with no requirements: the GPU image's torch, as far as a resolver sees it
    (``torch==2.11.0`` matches its local version, which sorts above the registry's 2.11.0)."""
    name, version = "torch", "2.11.0+cu130"
    info = f"{name}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: bench.vs_peer\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n",
             "torch_image_stub.py": "# the GPU image's torch 2.11.0+cu130 stands here in a dry-run\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()]
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for arc, text in files.items():
            zf.writestr(arc, text)
    return path


def dry_run_command(requirement: str, report: Path, target: Path, stub_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--report", str(report),
           "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + ["--find-links", str(stub_dir), "--target", str(target), requirement, *STACK]


def resolve_one(peer: str, requirement: str, work: Path, stub_dir: Path, timeout_s: float) -> dict:
    """One dry-run: ``{"command", "returncode", "seconds"}`` plus ``conflict`` (pip's ERROR lines and the
    'The conflict is caused by' block) or ``resolved`` (name, version, size of each wheel, total MiB)."""
    report = work / f"{peer}.report.json"
    cmd = dry_run_command(requirement, report, work / f"target_{peer}", stub_dir)
    shown = " ".join(["pip", *cmd[3:]]).replace(str(stub_dir), "<torch stub dir>").replace(str(work), "<tmp>")
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = None, f"timed out after {timeout_s:.0f} s\n{e.stdout or ''}{e.stderr or ''}"
    out = {"requirement": requirement, "command": shown, "returncode": rc, "seconds": round(time.time() - t0, 1)}
    if rc == 0 and report.is_file():
        items = json.loads(report.read_text()).get("install", [])
        wheels = [{"name": i["metadata"]["name"], "version": i["metadata"]["version"],
                   "url": i.get("download_info", {}).get("url", "").rsplit("/", 1)[-1]} for i in items]
        out["resolved"] = sorted(wheels, key=lambda w: w["name"].lower())
        return out
    keep, block = [], False
    for line in text.splitlines():
        if line.startswith("The conflict is caused by"):
            block = True
        if block or line.startswith("ERROR"):
            keep.append(line.rstrip())
        if block and line.startswith("To fix this"):
            block = False
    out["conflict"] = "\n".join(line for line in keep if line.strip()) or text[-3000:]
    return out


def resolve(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="vs_peer_"))
    stub_dir = work / "stub"
    stub_dir.mkdir()
    torch_stub(stub_dir)
    attempts = {}
    for peer in args.peers.split(","):
        attempts[peer] = resolve_one(peer, PEERS.get(peer, peer), work, stub_dir, args.timeout_s)
        a = attempts[peer]
        print(f"== {peer}: exit {a['returncode']} in {a['seconds']} s\n{a['command']}\n"
              + (a.get("conflict") or f"resolved {len(a['resolved'])} packages"), flush=True)
    conflicts = {p: a for p, a in attempts.items() if "resolved" not in a}
    resolved = {p: a for p, a in attempts.items() if "resolved" in a}
    from bench.results_file import merge

    values = {"peer_install_date": time.strftime("%Y-%m-%d", time.gmtime()),
              "peer_install_stack": "python 3.12 (cp312, manylinux x86_64), torch 2.11.0+cu130 (the image's; a stub "
                                    "wheel without requirements in the dry-run), vllm 0.26.0",
              "peer_install_conflicts": conflicts, "peer_install_resolved": resolved}
    if not args.no_write:
        merge(args.results, values)
    return values


PEER = {"name": "verl", "version": "0.9.1", "mode": "GRPO, colocated (FSDP actor + vLLM rollout on one GPU)"}


def make_task(workload: str, dataset: str | None):
    """The task of the workload, as bench/real_model.py (arith) and bench/vs_trl.py (variable) load it."""
    if workload == "arith":
        from bench.real_model import TEMPLATE, arith_task

        return arith_task(1, 8)[0], {"name": "arith", "template": TEMPLATE}
    from distrl.rollout.tasks import load_task

    return load_task("gsm8k", str(Path(dataset).resolve()), seed=1), {"name": "gsm8k",
                                                                        "dataset": str(Path(dataset).resolve())}


def write_data(args, work: Path, model_dir: str) -> tuple[Path, int]:
    """verl's train.parquet (and a one-row val.parquet it requires): the problems TRL's side takes (stream seed 1),
    each as its chat messages, with its problem (JSON) for the reward; returns (directory, longest prompt)."""
    import dataclasses

    import pandas as pd
    from transformers import AutoTokenizer

    task, spec = make_task(args.workload, args.dataset)
    tok = AutoTokenizer.from_pretrained(model_dir)
    stream = task.problems(1)
    steps = args.warmup + args.versions + 2 if args.workload == "variable" else args.max_steps
    rows, longest = [], 0
    for i in range(args.batch_size * steps):
        p = next(stream)
        user = p.question if task.template is None else task.template.replace("{question}", p.question)
        messages = [{"role": "system", "content": task.system_prompt}, {"role": "user", "content": user}]
        assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == task.prompt(p, tok)
        longest = max(longest, len(tok(task.prompt(p, tok), add_special_tokens=False)["input_ids"]))
        rows.append({"data_source": f"distrl_{spec['name']}", "prompt": messages, "ability": spec["name"],
                     "reward_model": {"style": "rule", "ground_truth": ""},
                     "extra_info": {"index": i, "task": json.dumps(spec),
                                    "problem": json.dumps(dataclasses.asdict(p))}})
    out = work / "data"
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(out / "train.parquet")
    pd.DataFrame(rows[:1]).to_parquet(out / "val.parquet")
    return out, longest


def verl_overrides(args, model_dir: str, data: Path, prompt_len: int, work: Path) -> list[str]:
    """verl 0.9.1's Hydra overrides (keys of verl/trainer/config/_generated_ppo_trainer.yaml)."""
    steps = args.warmup + args.versions if args.workload == "variable" else args.max_steps
    rows = args.batch_size * args.group_size
    micro = min(rows, 64)  # rows per forward/backward: 256 x 448 tokens of fp32 logits (49k vocab) filled an H100
    save = args.eval_every if args.workload == "arith" else -1
    return [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'val.parquet'}",
        f"data.train_batch_size={args.batch_size}", f"data.max_prompt_length={prompt_len}",
        f"data.max_response_length={args.max_new_tokens}", "data.truncation=error", "data.shuffle=False",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        # verl's FSDP actor defaults to flash_attention_2, a package the GPU machine does not have
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"actor_rollout_ref.actor.optim.lr={args.lr}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}", "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.actor.checkpoint.save_contents=['hf_model']",
        "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.n={args.group_size}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "actor_rollout_ref.rollout.temperature=1.0",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"reward.custom_reward_function.path={ROOT / 'bench' / 'vs_peer_reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.logger=['console']", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.val_before_train=False", "trainer.test_freq=-1", f"trainer.save_freq={save}",
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=1000", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={work / 'ckpt'}", "trainer.project_name=vs_peer",
        # the v1 trainer imports TransferQueue (verl's `verl-core` extra, not staged); v0 is verl's PPO loop
        "trainer.use_v1=False",
        f"trainer.experiment_name={args.workload}", "data.seed=1",
    ]


def check_overrides(overrides: list[str], config: str | Path | None = None) -> list[str]:
    """The overrides whose key verl's generated config (``config``, default the installed verl's) lacks: Hydra
    would refuse them; [] without verl."""
    import importlib.util

    import yaml

    if config is None:
        spec = importlib.util.find_spec("verl")
        if spec is None:
            return []
        config = Path(spec.origin).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    cfg = yaml.safe_load(Path(config).read_text())
    missing = []
    for item in overrides:
        node, parts = cfg, item.split("=", 1)[0].lstrip("+").split(".")
        for part in parts[:-1] if item.startswith("+") else parts:  # `+key`: a new key under an existing one
            if not isinstance(node, dict) or part not in node:
                missing.append(item)
                break
            node = node[part]
    return missing


STEP_LINE = __import__("re").compile(r"step:(\d+) - (.*)")


def parse_step(line: str) -> tuple[int, dict] | None:
    """verl's console logger line ``step:N - key:value - key:value ...`` (Ray may prefix it)."""
    m = STEP_LINE.search(line)
    if not m:
        return None
    metrics = {}
    for part in m.group(2).split(" - "):
        key, _, value = part.rpartition(":")
        try:
            metrics[key.strip()] = float(value)
        except ValueError:
            continue
    return int(m.group(1)), metrics


def run_verl(args, model_dir: str, work: Path, out: Path) -> dict:
    """verl's side: its stdout stamped line by line; ``steps``: [[step, stamp from launch, metrics]]."""
    data, longest = write_data(args, work, model_dir)
    overrides = verl_overrides(args, model_dir, data, max(64, -(-longest // 64) * 64), work)
    bad = check_overrides(overrides)
    if bad:
        raise SystemExit(f"verl's config has no key for: {bad}")
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
    steps, log = [], open(out / f"verl_{args.workload}.log", "w")
    # verl patches TRL's value-head model when TRL imports; the TRL staged for bench/vs_trl.py no longer has it.
    # A sitecustomize first on verl's path (its Ray workers' too) marks TRL absent in verl's processes only.
    hide = work / "hide_trl"
    hide.mkdir(parents=True, exist_ok=True)
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['trl'] = None  # bench/vs_peer.py\n")
    path = [p for p in (str(hide), args.peer_site, str(ROOT), os.environ.get("PYTHONPATH")) if p]  # verl's first
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0", "PYTHONPATH": ":".join(path),
           "VLLM_CACHE_ROOT": str(work / "cache" / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(work / "cache" / "inductor"),
           "TRITON_CACHE_DIR": str(work / "cache" / "triton")}
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        log.write(line)
        parsed = parse_step(line)
        if parsed:
            steps.append([parsed[0], round(time.time() - started, 2), parsed[1]])
        if time.time() - started > args.hard_s:
            proc.kill()
            break
    rc = proc.wait()
    return {"side": "verl", "returncode": rc, "command": " ".join(["python -m verl.trainer.main_ppo", *overrides]),
            "steps": steps, "ckpt": str(work / "ckpt")}


def verl_rate(side: dict, args) -> dict:
    """Completions/s over the window (steps warmup+1 .. warmup+versions), from ``timing_s/step``."""
    window = [m for step, _, m in side["steps"] if args.warmup < step <= args.warmup + args.versions]
    wall = sum(m.get("timing_s/step", 0.0) for m in window)
    if not window or not wall:
        return {}
    n = len(window) * args.batch_size * args.group_size
    mean_len = sum(m.get("response_length/mean", 0.0) for m in window) / len(window)
    return {"steps_timed": len(window), "wall_s": round(wall, 3), "completions_per_s": round(n / wall, 2),
            "mean_completion_tokens": round(mean_len, 1)}


def verl_curve(side: dict, args) -> dict:
    """verl's launch clock (module docstring) and, per saved step, distrl's evaluation of that checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.real_model import arith_task
    from distrl.rollout.engines.hf import HFEngine
    from distrl.rollout.evaluation import evaluate_engine

    saved, clock = 0.0, {}
    for step, stamp, m in side["steps"]:
        saved += m.get("timing_s/save_checkpoint", 0.0)
        clock[step] = round(stamp - saved, 2)
    if 1 not in clock:
        return {"launch_curve": []}
    first = dict((s, m) for s, _, m in side["steps"])[1]
    startup = round(clock[1] - first.get("timing_s/step", 0.0), 2)
    task, heldout = arith_task(1, args.eval_size)
    dev, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    points = [(0, args.model_dir)] + [(s, Path(side["ckpt"]) / f"global_step_{s}" / "actor" / "huggingface")
                                      for s in sorted(clock) if s % args.eval_every == 0]
    curve = []
    for step, path in points:
        if not Path(path, "config.json").is_file():
            continue
        tok = AutoTokenizer.from_pretrained(args.model_dir)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
        engine = HFEngine.sharing(model, tok, seed=0)
        engine.version = step
        acc = evaluate_engine(engine, task, heldout, max_new_tokens=args.max_new_tokens, seed=0).metrics["accuracy"]
        curve.append((startup if step == 0 else clock[step], step, acc))
        del model, engine
    return {"launch_curve": curve, "startup_s": startup, "first_version_s": clock[1]}


def distrl_variable(args, out: Path) -> dict:
    """distrl's side of the variable workload: bench.vs_trl's, with the same flags, no TRL side (or, with
    ``--distrl_from DIR``, the side an earlier run of this bench on the same machine wrote there)."""
    if args.distrl_from:
        path = Path(args.distrl_from) / "vs_trl" / "variable.json"
        return json.loads(path.read_text())["sides"][0]
    cmd = [sys.executable, "-m", "bench.vs_trl", "run", "--workload", "variable", "--trl", "none", "--model",
           args.model, "--dataset", args.dataset, "--out", str(out / "vs_trl"), "--work", str(Path(args.work) / "vt"),
           "--batch_size", str(args.batch_size), "--group_size", str(args.group_size), "--max_new_tokens",
           str(args.max_new_tokens), "--lr", str(args.lr), "--warmup", str(args.warmup), "--versions",
           str(args.versions), "--hard_s", str(args.hard_s)]
    subprocess.run(cmd, cwd=ROOT, check=False)
    path = out / "vs_trl" / "variable.json"
    return json.loads(path.read_text())["sides"][0] if path.is_file() else {}


def distrl_arith(args, out: Path) -> dict:
    """distrl's side on arith: bench.real_model's ``--clock launch`` distrl1 case (cold run first), or the one an
    earlier run wrote under ``--distrl_from DIR``."""
    if args.distrl_from:
        return json.loads((Path(args.distrl_from) / "real_model" / "distrl1.json").read_text())
    cmd = [sys.executable, "-m", "bench.real_model", "run", "--clock", "launch", "--cases", "distrl1", "--model",
           args.model, "--out", str(out / "real_model"), "--work", str(Path(args.work) / "rm"), "--minutes",
           str(args.minutes), "--max_steps", str(args.distrl_max_steps), "--eval_every", str(args.eval_every),
           "--eval_size", str(args.eval_size), "--batch_size", str(args.batch_size), "--group_size",
           str(args.group_size), "--max_new_tokens", str(args.max_new_tokens), "--lr", str(args.lr),
           "--hard_s", str(args.hard_s)]
    subprocess.run(cmd, cwd=ROOT, check=False)
    path = out / "real_model" / "distrl1.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def run(args) -> dict:
    from bench.real_model import time_to
    from distrl.core.gguf import resolve_model

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    args.model_dir = str(resolve_model(args.model))
    summary = {"workload": args.workload, "peer": PEER, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    if args.workload == "variable":
        distrl = distrl_variable(args, out)
        verl = run_verl(args, args.model_dir, work / "verl", out)
        rate = verl_rate(verl, args)
        ratio = (round(distrl["completions_per_s"] / rate["completions_per_s"], 3)
                 if distrl.get("completions_per_s") and rate.get("completions_per_s") else None)
        summary |= {"distrl": distrl, "verl": verl | rate, "vs_peer_variable": ratio}
    else:
        distrl = distrl_arith(args, out)
        verl = run_verl(args, args.model_dir, work / "verl", out)
        verl |= verl_curve(verl, args)
        ours, theirs = distrl.get("launch_curve") or [], verl.get("launch_curve") or []
        base = (theirs or ours or [(0, 0, None)])[0][2]
        target = round(base + 0.10, 4) if base is not None else None
        d, v = (time_to(ours, target), time_to(theirs, target)) if target is not None else (None, None)
        summary |= {"distrl": distrl, "verl": verl, "target_accuracy": target, "distrl_time_to_target_s": d,
                    "verl_time_to_target_s": v,
                    "vs_peer_time_to_accuracy_from_launch": round(v / d, 3) if v and d else None}
    (out / f"{args.workload}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("distrl", "verl")}))
    return summary


def report(dirs: list[str], note: str, path: Path = RESULTS) -> dict:
    """Each run's ratio into bench/results/vs_peer.json (merge: keys kept; the smallest run's ratio; each run's
    detail appended to the earlier rounds')."""
    from bench.results_file import merge

    runs = [json.loads(p.read_text()) for d in dirs for p in sorted(Path(d).glob("*.json"))
            if p.stem in ("variable", "arith")]
    values = {"peer": PEER, "vs_peer_note": note}
    for key, workload in (("vs_peer_variable", "variable"), ("vs_peer_time_to_accuracy_from_launch", "arith")):
        ratios = [r.get(key) for r in runs if r["workload"] == workload]
        known = [r for r in ratios if r is not None]
        if ratios:
            values |= {key: min(known) if known else None, f"{key}_runs": ratios}
    keep = ("returncode", "steps_timed", "wall_s", "completions_per_s", "mean_completion_tokens", "startup_s",
            "first_version_s")
    earlier = json.loads(path.read_text()).get("vs_peer_runs_detail", []) if path.is_file() else []
    values["vs_peer_runs_detail"] = earlier + [{**{k: v for k, v in r.items() if k not in ("distrl", "verl")},
                                      "verl": {k: r["verl"][k] for k in keep if k in r.get("verl", {})},
                                      "distrl_completions_per_s": r.get("distrl", {}).get("completions_per_s")}
                                     for r in runs]
    out = merge(path, values)
    print(json.dumps({k: v for k, v in out.items() if k.startswith("vs_peer") or k == "peer"}))
    return out


def plan(args) -> None:
    """CPU: the parquet files and verl's command (checked against verl's config where verl imports)."""
    from distrl.core.gguf import resolve_model

    work = Path(args.work)
    if args.model == "tiny":
        from distrl.core.tiny import build_tiny_model

        args.model = str(build_tiny_model(work / "tiny", seed=0))
    model_dir = str(resolve_model(args.model))
    data, longest = write_data(args, work, model_dir)
    overrides = verl_overrides(args, model_dir, data, max(64, -(-longest // 64) * 64), work)
    print(json.dumps({"data": str(data), "longest_prompt": longest, "unknown_keys": check_overrides(overrides),
                      "command": ["python", "-m", "verl.trainer.main_ppo", *overrides]}, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["resolve", "run", "report", "plan"])
    parser.add_argument("names", nargs="*", help="report: run output directories")
    parser.add_argument("--workload", choices=["variable", "arith"], default="arith")
    parser.add_argument("--model", default=None, help="SmolLM2-135M-Instruct (GGUF file or directory); plan: tiny")
    parser.add_argument("--dataset", default=None, help="variable: GSM8K's train.jsonl")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=None, help="default: variable 256, arith 24")
    parser.add_argument("--lr", type=float, default=None, help="default: variable 2e-6 (vs_trl), arith 2e-5")
    parser.add_argument("--warmup", type=int, default=3, help="variable: steps left out")
    parser.add_argument("--versions", type=int, default=15, help="variable: steps timed")
    parser.add_argument("--max_steps", type=int, default=60, help="arith: verl's steps")
    parser.add_argument("--distrl_max_steps", type=int, default=60, help="arith: distrl's --max_steps")
    parser.add_argument("--minutes", type=float, default=2.5, help="arith: distrl's cap (launch clock)")
    parser.add_argument("--eval_every", type=int, default=5, help="arith: steps between checkpoints/evaluations")
    parser.add_argument("--eval_size", type=int, default=256)
    parser.add_argument("--hard_s", type=float, default=900.0)
    parser.add_argument("--out", default="vs_peer_out")
    parser.add_argument("--work", default="/tmp/vs_peer")
    parser.add_argument("--note", default="", help="report: a line kept in the JSON")
    parser.add_argument("--distrl_from", default=None,
                        help="run: take distrl's side from an earlier run's --out DIR (same machine) instead of "
                             "running it again")
    parser.add_argument("--peer_site", default=None, help="run: verl's wheels (put first on verl's PYTHONPATH only)")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated: " + ", ".join(PEERS))
    parser.add_argument("--timeout_s", type=float, default=900.0, help="one dry-run's limit")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--no_write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = 256 if args.workload == "variable" else 24
    if args.lr is None:
        args.lr = 2e-6 if args.workload == "variable" else 2e-5
    if args.mode == "resolve":
        resolve(args)
    elif args.mode == "plan":
        plan(args)
    elif args.mode == "run":
        run(args)
    else:
        report(args.names, args.note)


if __name__ == "__main__":
    main()
