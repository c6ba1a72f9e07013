"""Typed run configuration: every option once, with its unit and default.

`distrl train --help` prints these docstrings. Flags are snake_case, as in the seed's
`train_distributed.py` (`--number_of_actors`). Nothing here imports torch or vLLM, so a bad flag
fails in a fraction of a second with a message naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from tyro.conf import Positional

TASKS = ("arith", "gsm8k", "math500", "half_vocab")
GiB, MiB = 2**30, 2**20



def check_reward_spec(spec: str) -> tuple[str, str]:
    """Split --reward `module:function` or `path/file.py:function` into (module or file, function name).

    Checks the form, that a file exists, or that a module can be found (without running it).
    Raises ValueError naming --reward otherwise.
    """
    import importlib.util

    module, sep, func = spec.rpartition(":")
    if not sep or not module or not func.isidentifier():
        raise ValueError(f"--reward must be module:function or path/to/file.py:function, got {spec!r}")
    if module.endswith(".py"):
        if not Path(module).expanduser().is_file():
            raise ValueError(f"--reward {spec}: no such file {module}")
        return module, func
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:  # a parent package that does not import
        raise ValueError(f"--reward {spec}: cannot find module {module} ({exc})") from exc
    if found is None:
        raise ValueError(f"--reward {spec}: no module named {module!r} (is it on PYTHONPATH? or give a "
                         f"path/to/file.py:{func})")
    return module, func


def template_is_file(value: str) -> bool:
    """Whether --prompt_template names an existing file (a long template text is not a path)."""
    try:
        return Path(value).expanduser().is_file()
    except OSError:  # e.g. a name too long for the filesystem
        return False


def read_prompt_template(value: str) -> str:
    """The --prompt_template text: the file's contents when ``value`` names a file, else ``value`` itself.

    Raises ValueError naming the flag when the text has no ``{question}``.
    """
    is_file = template_is_file(value)
    text = Path(value).expanduser().read_text() if is_file else value
    if "{question}" not in text:
        where = f"file {value}" if is_file else f"{value!r} (not a file either)"
        raise ValueError(f"--prompt_template must contain {{question}} where the problem goes; {where} has none")
    return text

@dataclass
class SelectionOptions:
    """How the buffer picks training data; shared by `distrl train`, `distrl buffer` and `distrl replay`."""

    topk_by: Literal["reward", "abs_advantage"] = "reward"
    """Which completions of a group `--topk` keeps: the k largest `reward` or the k largest `|advantage|`
    (ties go to the earlier completion)."""
    order: Literal["fifo", "freshest", "variance"] = "fifo"
    """Which fresh groups a version's batch takes first: `fifo` (oldest PUT first), `freshest` (newest
    policy version first, then newest PUT) or `variance` (largest reward variance first, then oldest)."""
    filter_zero_variance: bool = False
    """Drop groups whose rewards are all equal (no GRPO signal) on arrival. They stay in the segment log,
    are counted as evictions `zero_variance`, give their credit back, and WAIT replies say how many."""
    max_filtered_groups: int = 2000
    """With --filter_zero_variance: after this many groups in a row were dropped (any group that varies
    resets the count) the run stops with an error (exit 1): a reward that scores every completion the
    same can never train. 0: never stop. 2000 stops such a run within a minute on the tiny model (the
    2-core VM makes 50-200 groups/s: 10-40 s) yet spares a sparse reward: if 1% of groups vary, 2000
    flat ones in a row have odds 0.99^2000 ~ 2e-9."""
    replay_ratio: int = 1
    """Times a group may be handed out, each time to a later version and within `--max_staleness`
    (1: each group trains once; more reuses data, off-policy)."""

    def validate_selection(self) -> None:
        """Raise ValueError naming the first bad selection option."""
        if self.topk_by not in ("reward", "abs_advantage"):
            raise ValueError(f"--topk_by must be reward or abs_advantage, got {self.topk_by!r}")
        if self.order not in ("fifo", "freshest", "variance"):
            raise ValueError(f"--order must be fifo, freshest or variance, got {self.order!r}")
        if self.replay_ratio < 1:
            raise ValueError(f"--replay_ratio must be >= 1, got {self.replay_ratio}")
        if self.max_filtered_groups < 0:
            raise ValueError(f"--max_filtered_groups must be >= 0 (0: no limit), got {self.max_filtered_groups}")


@dataclass
class StorageOptions:
    """The buffer's memory bounds, frame limit and on-disk segment log; shared by `train` and `buffer`."""

    fsync: Literal["always", "batch", "never"] = "batch"
    """When the logs reach the disk. Every write is flushed to the OS before its reply (a killed buffer
    loses nothing). `always`: fsync each group and each consumption record before replying. `batch`:
    the commit thread writes every group accepted since its last commit and fsyncs the segment log
    once, before any of their ACKs (an ACK still means on disk), and the consumption log within a second.
    `never`: leave it to the OS (a power loss may lose acknowledged groups)."""
    max_rows: int = 1_000_000
    """Completions the buffer holds in memory (whole groups; top-k is cut when a batch is taken); when
    full, credits stop and PUTs are refused."""
    max_bytes: int = 4 * GiB
    """Arrow bytes the buffer holds in memory (same effect as --max_rows when reached)."""
    max_msg_bytes: int = 256 * MiB
    """Largest message accepted, in bytes (ZMQ_MAXMSGSIZE): a peer that sends more is disconnected."""
    prefault_bytes: int = 512 * MiB
    """Heap the buffer writes once at start (at most --max_bytes and half the memory the process may use;
    0: none) so that received groups land in memory already written and freed groups' memory is reused
    (glibc; docs/buffer.md, "Ingest")."""
    dedup_window: int = 1 << 20
    """Sample ids the buffer remembers (at least the last this many accepted, about twice at most) to
    drop re-sent PUTs as duplicates: bounded memory in a long run. A client's retries end within
    minutes (30 s x 6 sends by default); a PUT re-sent after more newer completions is accepted again."""
    segment_max_bytes: int = 256 * MiB
    """A segment file is closed and a new one started once it reaches this size, in bytes."""
    retention_bytes: Optional[int] = None
    """Delete the oldest closed segments beyond this total size, in bytes (unset: keep all). Only
    segments whose groups have all left memory are deleted."""
    retention_s: Optional[float] = None
    """Delete closed segments older than this, in seconds (unset: keep all); same rule as above."""

    def validate_storage(self) -> None:
        """Raise ValueError naming the first bad storage option."""
        if self.fsync not in ("always", "batch", "never"):
            raise ValueError(f"--fsync must be always, batch or never, got {self.fsync!r}")
        for name in ("max_rows", "max_bytes", "max_msg_bytes", "dedup_window", "segment_max_bytes",
                     "retention_bytes", "retention_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name} must be > 0, got {value}")
        if self.prefault_bytes < 0:
            raise ValueError(f"--prefault_bytes must be >= 0, got {self.prefault_bytes}")


def buffer_options(cfg) -> dict:
    """The SelectionOptions and StorageOptions fields of ``cfg`` as keyword arguments of BufferServer."""
    names = [f.name for cls in (SelectionOptions, StorageOptions) if isinstance(cfg, cls)
             for f in dataclasses.fields(cls)]
    return {name: getattr(cfg, name) for name in names}


@dataclass
class _RunOptions:
    """The run's own options; TrainConfig lists them before the buffer's."""

    config: Optional[str] = None
    """YAML (.yaml/.yml) or TOML (.toml) file whose keys are flag names, e.g. max_steps; flags given on
    the command line override it; an unknown key is an error (docs/placement.md)."""
    run_name: str = ""
    """Name of the run; its directory is `<log_dir>/<run_name>/` and must not exist yet
    (unset: `distrl-<date>-<time>`)."""
    log_dir: str = "runs"
    """Parent directory of run directories (config, segments/, weights/, tb/<role><index>/)."""
    model: str = "tiny"
    """Hub id or local directory of a causal LM; `tiny` builds the embedded tiny Qwen2 model in code."""
    tokenizer: Optional[str] = None
    """Tokenizer hub id or directory (unset: the model's own)."""
    dataset: Optional[str] = None
    """Hub id (e.g. `openai/gsm8k`) or a local .jsonl/.parquet file; unused by the built-in tasks."""
    task: Optional[Literal["arith", "gsm8k", "math500", "half_vocab"]] = None
    """Task (prompt template + reward): arith, gsm8k, math500, half_vocab. Default: inferred from the
    dataset's fields or name, `arith` when no dataset is given."""
    reward: Optional[str] = None
    """Your own reward instead of the task's: `module:function` (importable) or `path/to/file.py:function`.
    Called as `function(completion_text: str, problem: rollout.tasks.Problem) -> float | (float, dict[str,
    float])` (reward, named components); the task still gives prompts and gold answers (`problem.gold`).
    Each actor imports it and calls it once on its first problem at start: a missing module or function,
    an exception or a wrong return type stops the run there. See docs/users.md."""
    reward_timeout_s: Optional[float] = 10.0
    """Seconds one call of the --reward function may take: it runs in a child process of each actor
    (JSON lines, nothing pickled), killed and restarted past the limit, and that completion scores 0 with
    component `timeout` 1. `None` calls it in the actor's own process, unbounded."""
    prompt_template: Optional[str] = None
    """The prompt text, with `{question}` where the problem goes (every `{question}` is replaced; other
    braces are kept, so `\\boxed{}` needs no escaping), or a file holding it. With a chat template it is
    the user turn (after the task's system prompt); without, the whole prompt. Unset: the task's own."""
    chat_template: Literal["auto", "on", "off"] = "auto"
    """`auto`: wrap the prompt in the tokenizer's chat template when it has one; `on`: always (an error at
    actor start if the tokenizer has none); `off`: plain text, never the chat template."""
    truncation: Literal["keep", "zero", "mask"] = "keep"
    """Completions cut at --max_new_tokens without an end of sequence (finish_reason `length`): `keep`
    scores them as they are; `zero` gives them reward 0 (before the group's advantages); `mask` keeps
    their reward in the group's advantages but gives their tokens no loss (DAPO's overlong filtering, Yu
    et al. 2025, arXiv:2503.14476). Every completion's reward components carry `truncated` 0/1."""
    log_samples: int = 2
    """Completions (prompt, completion, reward) actor 0 logs per policy version to TensorBoard's Text tab
    (`actor/samples`); 0 logs none."""
    export_final: Literal["merged", "adapter", "off"] = "merged"
    """What learner rank 0 writes at the end into `<run_dir>/final/`: `merged` = `merged/` (full weights in
    HF format + tokenizer, loads with `AutoModelForCausalLM.from_pretrained`) and, with LoRA, `adapter/`;
    `adapter` = only `adapter/` (LoRA only: skips the full copy of a large model; also what --load_in_4bit
    gets); `off` = nothing."""
    arith_ops: str = "+-"
    """`arith` task only: the operators its problems draw from, any of `+ - *` written together (e.g. `+`
    for two-number addition only, as `make demo` uses)."""
    arith_max_operand: int = 99
    """`arith` task only: operands are integers in [0, arith_max_operand]."""
    warm_start_steps: int = 0
    """`distrl train`: supervised warm start before the roles start: AdamW steps of full fine-tuning of
    the base model on the task's gold answers (prompt -> answer + EOS, loss on answer tokens only;
    `learn/sft.py`). The result is saved to `<run_dir>/warm_start/` and is every role's base model
    (policy version 0). 0: none."""
    warm_start_lr: float = 1e-3
    """`distrl train`: learning rate of the warm start (AdamW, constant)."""
    warm_start_batch_size: int = 128
    """`distrl train`: problems per warm-start step."""
    warm_start_until_accuracy: Optional[float] = None
    """`distrl train`: stop the warm start before --warm_start_steps once its greedy accuracy reaches this
    fraction (exact match of answer + EOS under teacher forcing, mean of the last 5 batches of problems
    not trained on yet), so RL starts from a known accuracy with room above it. Unset: always
    --warm_start_steps."""
    torch_threads: Optional[int] = None
    """CPU threads of torch (`torch.set_num_threads`) in the warm start, each learner and each actor (the
    HF engine; vLLM binds its own). Unset: torch's default, one per core. On a small, busy CPU 1 is much
    faster: two threads that wait for each other at every operation stall whenever one is descheduled."""
    console: bool = True
    """`distrl train`: a live view on stderr (policy version, reward, staleness, tokens/s, buffer fill),
    refreshed twice a second from the buffer's STATS and the learners' TensorBoard events; role logs go to
    `<run_dir>/logs/<role>.log` only. With `--no_console`, and whenever stderr is not a terminal, a plain
    progress line instead, at most one per 10 s."""
    number_of_actors: Optional[int] = None
    """Rollout actors (each one generation engine); 0 is allowed with --learner_generates
    (unset: 1, or the first number of --gpu_split)."""
    number_of_learners: Optional[int] = None
    """Learners; more than one form a torch.distributed group that averages gradients
    (unset: 1, or the second number of --gpu_split)."""
    batch_size: int = 4
    """Groups consumed per policy version, across all learners."""
    group_size: int = 4
    """Completions sampled per prompt (n); a group is those n completions."""
    topk: Optional[int] = None
    """Completions kept per group for training, the k best by reward (unset: all n)."""
    learner: Literal["pg", "grpo", "dr_grpo"] = "grpo"
    """Loss: `pg` (REINFORCE with a baseline), `grpo` (group-std-normalized advantages, clipped ratio) or
    `dr_grpo` (Dr.GRPO: clipped ratio, advantages not std-normalized, no length normalization). It also
    names the actors' group advantage estimator (`distrl.advantages`)."""
    learner_chunk_size: int = 8
    """Completions per forward/backward micro-batch (gradient accumulation; equals the full-batch step)."""
    learner_pack_tokens: int = 0
    """Sequence packing: lay each micro-batch's sequences end to end in rows of at most this many tokens
    (position ids restart per sequence, attention stays inside it), so no compute goes to padding;
    0 pads every sequence to the micro-batch's longest. Needs transformers' attention (`--backend hf`
    on a GPU). Same loss and gradients as padded rows."""
    learner_head_chunk_tokens: int = 1024
    """Completion tokens per chunk of the chunked or halfmm LM head (`learn/logprobs.py`): fp32 logits exist
    for this many tokens at a time (about tokens * vocab * 4 bytes, 0.6 GB for 1024 x 151k; 6 bytes instead
    of 4 in halfmm's backward)."""
    learner_head: Literal["auto", "chunked", "cce", "halfmm"] = "auto"
    """How the learner's LM head computes logprobs (`learn/logprobs.py`): `chunked` (fp32 logits in chunks of
    --learner_head_chunk_tokens, a hand-written backward), `cce` (Cut Cross-Entropy's Triton kernels: no
    logits buffer, bf16 inputs with fp32 accumulation; needs CUDA, a bf16/fp16 head, --temperature 1 and the
    `cut_cross_entropy` package), `halfmm` (the chunked algorithm with bf16/fp16 matmuls writing fp32 logits:
    same logprobs, gradients rounded to bf16; needs a bf16/fp16 head; fast on CUDA only) or `auto` (halfmm for a
    bf16/fp16 head on CUDA, else chunked; the learner logs which)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory: 19 against 42 GiB, and 22 %
    more time, on the 0.5B benchmark of BENCHMARKS.md)."""
    learner_compile: bool = False
    """`torch.compile` each decoder layer of the learner's model (dynamic shapes; fuses the norms,
    activations and rotary embeddings; the first steps pay the compilation, and new batch shapes may
    recompile). CUDA only: ignored on CPU."""
    max_staleness: int = 1
    """Largest `learner_version - policy_version` of a completion used to train; 0 is on-policy."""
    max_steps: int = 10
    """Policy versions to produce (one optimizer step of the learner group each)."""
    learning_rate: float = 1e-5
    """AdamW learning rate."""
    clip_eps: float = 0.2
    """GRPO/PPO ratio clip: the importance ratio is clipped to [1 - clip_eps, 1 + clip_eps]."""
    clip_eps_low: Optional[float] = None
    """Lower GRPO clip, in (0, 1): the ratio's floor is 1 - clip_eps_low (unset: --clip_eps)."""
    clip_eps_high: Optional[float] = None
    """Upper GRPO clip (DAPO's clip-higher), > 0: the ratio's ceiling is 1 + clip_eps_high (unset: --clip_eps)."""
    loss_aggregation: Optional[Literal["token-mean", "sequence-mean-token-mean",
                                       "sequence-mean-token-sum-norm"]] = None
    """How per-token losses become the version's loss, over the whole batch of all learners: `token-mean`
    (token sum / tokens), `sequence-mean-token-mean` (mean over completions of each one's token mean),
    `sequence-mean-token-sum-norm` (mean over completions of token sum / --loss_norm_tokens).
    Default: sequence-mean-token-sum-norm for dr_grpo, token-mean otherwise."""
    loss_norm_tokens: Optional[int] = None
    """Tokens: the constant divisor of sequence-mean-token-sum-norm (unset: --max_new_tokens)."""
    pg_baseline: Literal["group", "running_mean"] = "group"
    """`pg` only, the baseline subtracted from each reward: `group` (group mean, computed by the actor)
    or `running_mean` (a moving average of the version's mean reward, kept by the learners)."""
    baseline_decay: float = 0.9
    """Running-mean baseline decay per version, in [0, 1): b <- decay * b + (1 - decay) * batch mean reward."""
    kl_coef: float = 0.0
    """Weight of the per-token KL(policy || reference) loss term; 0 turns it off (no reference forward).
    The reference is the model with its LoRA adapter disabled, or a frozen copy with --finetune full."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman 2020), d = log(ref/pi): k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d."""
    off_policy: Literal["none", "tis", "decoupled"] = "none"
    """Correction for data sampled by an older policy mu: `none` (GRPO's ratio is against mu), `tis`
    (truncated importance sampling: weight min(pi/mu, --is_cap)), `decoupled` (AReaL: ratio against the
    learner's weights at consumption, behavior weight truncated at --is_cap). See learn/offpolicy.py."""
    is_cap: float = 2.0
    """C, >= 1: importance weights pi/mu are truncated at C by `tis` and `decoupled`."""
    is_level: Literal["token", "sequence"] = "token"
    """`tis` only: one weight per token, or one per completion (the product of its token ratios)."""
    is_mask_low: Optional[float] = None
    """Tokens whose ratio pi/mu is below this get no loss (any --off_policy; default: no lower bound)."""
    is_mask_high: Optional[float] = None
    """Tokens whose ratio pi/mu is above this get no loss (any --off_policy; default: no upper bound)."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global L2 norm before each step; 0 turns clipping off."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning rate after the warm-up, by policy version: constant, or cosine / linear decay to 0 at --max_steps."""
    lr_warmup_steps: int = 0
    """Versions of linear warm-up from --learning_rate / lr_warmup_steps to --learning_rate."""
    lora_rank: int = 16
    """LoRA rank r (default 16). Any rank up to 512 works with `--engine vllm`: its engine loads adapters up
    to the next rank vLLM accepts (1, 8, 16, 32, 64, 128, 256, 320, 512; 48 gets 64)."""
    lora_alpha: int = 32
    """LoRA alpha (scale = alpha / r)."""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj")
    """Module names that get a LoRA adapter (every attention and MLP projection)."""
    finetune: Literal["lora", "full"] = "lora"
    """`lora` trains an adapter and publishes it (format `lora`); `full` trains every weight and publishes
    the whole model (format `full`)."""
    backend: Literal["unsloth", "hf"] = "unsloth"
    """Learner model code: `unsloth` (FastLanguageModel; its CPU fallback without a GPU) or `hf`
    (transformers + peft)."""
    load_in_4bit: bool = False
    """QLoRA: load the base weights in 4 bits (Unsloth + bitsandbytes; needs an NVIDIA GPU and --finetune lora)."""
    temperature: float = 1.0
    """Sampling temperature; the learner divides its logits by the same value."""
    max_new_tokens: int = 256
    """Longest completion in tokens; longer ones stop with finish_reason `length`."""
    max_model_len: Optional[int] = None
    """Longest prompt + completion the engine accepts, in tokens (unset: the model's own limit)."""
    long_prompts: Literal["skip", "truncate", "error"] = "skip"
    """Prompts longer, as templated (chat template included), than --max_model_len minus --max_new_tokens
    tokens: `skip` never generates for them and counts them (TensorBoard `rollout/long_prompts_skipped`,
    summary `long_prompts_skipped`); `truncate` keeps their last tokens (the question's end and the
    assistant header the model answers after); `error` refuses the run at start, naming how many
    (rollout/prompt_fit.py)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype for engine and learner (`auto`: float32 on CPU, bfloat16 on GPU)."""
    seed: int = 0
    """Seed for prompts, sampling and initialization."""
    weights_transport: Literal["fs", "zmq", "nccl"] = "fs"
    """How actors get each version's weights: `fs` reads the learner's weight directory (a shared
    filesystem), `zmq` downloads it from the learner's weight endpoint (no shared filesystem), `nccl`
    broadcasts full weights from learner rank 0's device to every actor's (gloo on CPU; needs
    --finetune full)."""
    weights_broadcast_port: int = 5558
    """TCP port on learner rank 0's host where the `nccl` transport's group meets (`distrl train` picks a
    free one)."""
    engine: Literal["vllm", "hf"] = "vllm"
    """Rollout generation engine: `vllm` (vLLM's offline LLM, in-process) or `hf` (transformers with a KV
    cache, for machines without vLLM, or models vLLM-CPU cannot run, e.g. attention head size < 32)."""
    buffer_curve_server_key: Optional[str] = None
    """CURVE: the buffer's public key file, when the buffer runs with --curve_secret_key (docs/buffer.md);
    actors and learners then encrypt and authenticate their buffer connection."""
    buffer_curve_client_key: Optional[str] = None
    """CURVE: this client's secret key file (its public key must be in the buffer's --curve_client_keys)."""
    inflight_update: Literal["off", "finish", "abort"] = "off"
    """A version announced while an actor generates: `off` loads it after the call; `finish` loads it
    between decode steps and the running completions go on with it (both versions are recorded);
    `abort` drops the call and generates again with it. `finish` and `abort` need --engine hf."""
    merge_lora: bool = False
    """Actors load each LoRA version merged into the base weights (W + B A alpha/r) and reloaded as full
    weights, instead of as an adapter: for engines without LoRA support."""
    resume: Optional[str] = None
    """Continue the run in this directory: its config.json gives every option except --max_steps; the
    learners restart from the newest checkpoint in ckpt/, the buffer from its segment log (unconsumed
    groups are served again), each actor after the prompts it already used."""
    checkpoint_every: int = 10
    """Policy versions between learner checkpoints (`<run_dir>/ckpt/vNNNNNN/`; the last version is always
    saved); 0 saves only the last."""
    eval_every: Optional[int] = None
    """Policy versions between evaluations on a held-out set (unset or 0: no evaluation). Actor 0 evaluates
    with its own engine at version 0, at every multiple of N it serves, and at the final version; it
    writes `eval/<metric>` to tb/actor0 (step = version) and one line per evaluation to
    `<run_dir>/eval.jsonl`. The held-out problems are never trained on. Actor 0 generates no training
    data while it evaluates, and an evaluation counts against --heartbeat_timeout_s (docs/eval.md)."""
    eval_size: int = 64
    """Held-out problems (with --eval_every): a seeded set of expressions for arith, a seeded choice of
    dataset rows otherwise; every actor leaves them out of its training stream."""
    eval_num_samples: int = 1
    """Completions per held-out problem at each evaluation (pass@k and maj@k for k up to it)."""
    eval_temperature: float = 0.0
    """Sampling temperature of evaluations; 0 is greedy (then --eval_num_samples must be 1)."""
    heartbeat_timeout_s: float = 300.0
    """`distrl train`: seconds an actor or learner may go without a request to the buffer (or the buffer
    without answering the driver) before it counts as stuck: a stuck actor is restarted, a stuck learner
    or buffer ends the run with an error naming it (docs/faults.md); 0 turns the watchdog off."""
    max_actor_restarts: int = 3
    """`distrl train`: times Ray restarts each rollout actor after its process dies or is found stuck
    (it rejoins with the latest weights, after the prompts its logged groups used)."""
    ray_address: Optional[str] = None
    """`distrl train`: address of an existing Ray cluster to join (`ray.init(address=...)`, e.g.
    `auto` or `10.0.0.1:6379`); unset: start a local one (or use the one this process already started)."""
    gpus_per_actor: Optional[float] = None
    """`distrl train`: GPUs each rollout actor reserves in Ray (fractions share a GPU, e.g. 0.5). Unset:
    1 when the cluster has a GPU per role, 1/ceil(roles/GPUs) when it has fewer, 0 when it has none."""
    gpus_per_learner: Optional[float] = None
    """`distrl train`: GPUs each learner reserves in Ray; unset: as --gpus_per_actor."""
    gpu_split: Optional[str] = None
    """`distrl train`: `A:L` splits a GPU machine into A actors and L learners with one GPU each (e.g.
    `3:1`); sets --number_of_actors/--number_of_learners/--gpus_per_*, which may be given only if equal."""
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD"] = "PACK"
    """`distrl train`: Ray placement-group strategy of the GPU roles: PACK (as few nodes as possible),
    STRICT_PACK (one node) or SPREAD (across nodes)."""
    placement_timeout_s: float = 60.0
    """`distrl train`: seconds to wait for Ray to reserve the roles' GPUs; then the run fails, saying what
    was asked and what the cluster has."""
    learner_generates: bool = False
    """The learner also generates: while its GET waits for data it samples groups with its own model (the
    HF engine on the learner's model object, no weight copy, at the learner's current version) and PUTs
    them as actor `learner<rank>` (actor_id -1-rank). Allows --number_of_actors 0."""
    host: str = "127.0.0.1"
    """Address the buffer and weight endpoints bind to (loopback unless you need other hosts)."""



@dataclass
class TrainConfig(StorageOptions, SelectionOptions, _RunOptions):
    """Asynchronous RL fine-tuning: rollout actors -> replay buffer -> learners -> weights by version."""

    def __post_init__(self) -> None:
        if not self.run_name:
            self.run_name = time.strftime("distrl-%Y%m%d-%H%M%S")
        self.resolve_split()
        self.validate()

    def resolve_split(self) -> None:
        """Apply --gpu_split A:L and the default role counts; raise ValueError on a conflicting flag."""
        if self.gpu_split is not None:
            parts = self.gpu_split.split(":")
            if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
                raise ValueError(f"--gpu_split must be A:L (actors:learners, e.g. 3:1), got {self.gpu_split!r}")
            split = {"number_of_actors": int(parts[0]), "number_of_learners": int(parts[1]),
                     "gpus_per_actor": 1.0, "gpus_per_learner": 1.0}
            for name, value in split.items():
                if getattr(self, name) is not None and getattr(self, name) != value:
                    raise ValueError(f"--gpu_split {self.gpu_split} means --{name} {value:g}, but --{name} "
                                     f"{getattr(self, name):g} was given: drop one of them")
                setattr(self, name, value)
        if self.number_of_actors is None:
            self.number_of_actors = 1
        if self.number_of_learners is None:
            self.number_of_learners = 1

    def validate(self) -> None:
        """Raise ValueError naming the first bad option."""
        self.validate_selection()
        self.validate_storage()
        if self.number_of_actors < (0 if self.learner_generates else 1):
            raise ValueError(f"--number_of_actors must be >= 1 (>= 0 with --learner_generates), "
                             f"got {self.number_of_actors}")
        if self.number_of_actors == 0 and self.weights_transport == "nccl":
            raise ValueError("--weights_transport nccl needs at least one actor (--number_of_actors 0)")
        for name in ("gpus_per_actor", "gpus_per_learner"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= 1 or float(value).is_integer()):
                raise ValueError(f"--{name} must be a fraction in [0, 1] or a whole number, got {value}")
        if not self.placement_timeout_s > 0:
            raise ValueError(f"--placement_timeout_s must be > 0, got {self.placement_timeout_s}")
        positive = ("number_of_learners", "batch_size", "group_size", "learner_chunk_size", "learner_head_chunk_tokens",
                    "max_steps", "lora_rank", "max_new_tokens", "max_model_len")
        for name in positive:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint_every must be >= 0, got {self.checkpoint_every}")
        self.validate_eval()
        if not self.heartbeat_timeout_s >= 0:
            raise ValueError(f"--heartbeat_timeout_s must be >= 0 (0: no watchdog), got {self.heartbeat_timeout_s}")
        if self.max_actor_restarts < 0:
            raise ValueError(f"--max_actor_restarts must be >= 0, got {self.max_actor_restarts}")
        if self.learner_pack_tokens < 0:
            raise ValueError(f"--learner_pack_tokens must be >= 0 (0: no packing), got {self.learner_pack_tokens}")
        if self.max_staleness < 0:
            raise ValueError(f"--max_staleness must be >= 0, got {self.max_staleness}")
        if self.topk is not None and not 1 <= self.topk <= self.group_size:
            raise ValueError(f"--topk must be in [1, --group_size={self.group_size}], got {self.topk}")
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.batch_size % self.number_of_learners:
            raise ValueError(f"--batch_size {self.batch_size} must be a multiple of "
                             f"--number_of_learners {self.number_of_learners} (each learner takes a shard)")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if not self.learning_rate > 0:
            raise ValueError(f"--learning_rate must be > 0, got {self.learning_rate}")
        if os.sep in self.run_name or self.run_name in ("", ".", ".."):
            raise ValueError(f"--run_name must be a plain name, got {self.run_name!r}")
        self.validate_learner()
        self.validate_user_options()
        self.validate_warm_start()

    def validate_eval(self) -> None:
        """The --eval_* options; raises ValueError naming the flag."""
        if self.eval_every is not None and self.eval_every < 0:
            raise ValueError(f"--eval_every must be >= 0 (0 or unset: no evaluation), got {self.eval_every}")
        for name in ("eval_size", "eval_num_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_temperature < 0:
            raise ValueError(f"--eval_temperature must be >= 0, got {self.eval_temperature}")
        if self.eval_temperature == 0 and self.eval_num_samples > 1:
            raise ValueError(f"--eval_num_samples {self.eval_num_samples} with --eval_temperature 0 samples the "
                             "same greedy completion each time: give --eval_temperature > 0")

    def validate_learner(self) -> None:
        """The learner's options (loss, correction, optimizer, model); raises ValueError naming the flag."""
        self.lora_target_modules = tuple(self.lora_target_modules)  # from JSON it is a list
        if self.learner not in ("pg", "grpo", "dr_grpo"):
            raise ValueError(f"--learner must be pg, grpo or dr_grpo, got {self.learner!r}")
        for name in ("clip_eps", "clip_eps_low"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 1:
                raise ValueError(f"--{name} must be in (0, 1), got {value}")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            raise ValueError(f"--clip_eps_high must be > 0, got {self.clip_eps_high}")
        if self.loss_norm_tokens is not None and self.loss_norm_tokens < 1:
            raise ValueError(f"--loss_norm_tokens must be >= 1, got {self.loss_norm_tokens}")
        if self.pg_baseline == "running_mean" and self.learner != "pg":
            raise ValueError(f"--pg_baseline running_mean needs --learner pg, got --learner {self.learner}")
        if not 0 <= self.baseline_decay < 1:
            raise ValueError(f"--baseline_decay must be in [0, 1), got {self.baseline_decay}")
        if not self.kl_coef >= 0:
            raise ValueError(f"--kl_coef must be >= 0, got {self.kl_coef}")
        if not self.is_cap >= 1:
            raise ValueError(f"--is_cap must be >= 1, got {self.is_cap}")
        if self.is_level == "sequence" and self.off_policy != "tis":
            raise ValueError(f"--is_level sequence needs --off_policy tis, got --off_policy {self.off_policy}")
        if self.is_mask_low is not None and self.is_mask_low < 0:
            raise ValueError(f"--is_mask_low must be >= 0, got {self.is_mask_low}")
        if self.is_mask_high is not None and not self.is_mask_high > (self.is_mask_low or 0.0):
            raise ValueError(f"--is_mask_high must be > --is_mask_low and > 0, got {self.is_mask_high}")
        if not self.max_grad_norm >= 0:
            raise ValueError(f"--max_grad_norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"--lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if (self.buffer_curve_server_key is None) != (self.buffer_curve_client_key is None):
            raise ValueError("--buffer_curve_server_key and --buffer_curve_client_key go together")
        if self.inflight_update != "off" and self.engine != "hf":
            raise ValueError(f"--inflight_update {self.inflight_update} needs --engine hf (vLLM's offline "
                             "engine generates in one call)")
        if self.weights_transport == "nccl" and self.finetune != "full":
            raise ValueError("--weights_transport nccl broadcasts full weights: it needs --finetune full "
                             "(LoRA adapters are small: use fs or zmq)")
        if self.finetune == "lora" and not self.lora_target_modules:
            raise ValueError("--lora_target_modules must name at least one module with --finetune lora")
        if self.load_in_4bit and (self.finetune != "lora" or self.backend != "unsloth"):
            raise ValueError(f"--load_in_4bit is QLoRA through Unsloth: it needs --finetune lora and --backend "
                             f"unsloth, got --finetune {self.finetune} --backend {self.backend}")


    def validate_warm_start(self) -> None:
        """The --warm_start_* and --arith_* options; raises ValueError naming the flag."""
        if not self.arith_ops or set(self.arith_ops) - set("+-*"):
            raise ValueError(f"--arith_ops must be made of + - * (e.g. '+' or '+-'), got {self.arith_ops!r}")
        if self.arith_max_operand < 1:
            raise ValueError(f"--arith_max_operand must be >= 1, got {self.arith_max_operand}")
        if self.warm_start_steps < 0:
            raise ValueError(f"--warm_start_steps must be >= 0 (0: no warm start), got {self.warm_start_steps}")
        if not self.warm_start_lr > 0:
            raise ValueError(f"--warm_start_lr must be > 0, got {self.warm_start_lr}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"--torch_threads must be >= 1, got {self.torch_threads}")
        if self.warm_start_until_accuracy is not None and not 0 < self.warm_start_until_accuracy <= 1:
            raise ValueError(f"--warm_start_until_accuracy must be in (0, 1], got {self.warm_start_until_accuracy}")
        if self.warm_start_batch_size < 1:
            raise ValueError(f"--warm_start_batch_size must be >= 1, got {self.warm_start_batch_size}")

    def validate_user_options(self) -> None:
        """--reward, --prompt_template, --truncation, --log_samples, --export_final; raises ValueError
        naming the flag. Checks what needs no import of the reward module (the actors import and call it)."""
        if self.reward is not None:
            module, func = check_reward_spec(self.reward)
            if module.endswith(".py"):  # absolute, so actors started elsewhere (Ray workers) find it
                self.reward = f"{Path(module).expanduser().resolve()}:{func}"
        if self.reward_timeout_s is not None and not self.reward_timeout_s > 0:
            raise ValueError(f"--reward_timeout_s must be > 0 or None, got {self.reward_timeout_s}")
        if self.prompt_template is not None:
            read_prompt_template(self.prompt_template)
            if template_is_file(self.prompt_template):
                self.prompt_template = str(Path(self.prompt_template).expanduser().resolve())
        for name, allowed in (("chat_template", ("auto", "on", "off")), ("truncation", ("keep", "zero", "mask")),
                              ("long_prompts", ("skip", "truncate", "error")),
                              ("export_final", ("merged", "adapter", "off"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.log_samples < 0:
            raise ValueError(f"--log_samples must be >= 0, got {self.log_samples}")
        if self.export_final == "adapter" and self.finetune != "lora":
            raise ValueError("--export_final adapter needs --finetune lora (full fine-tuning has no adapter: "
                             "use merged or off)")

    @property
    def aggregation(self) -> str:
        """The loss aggregation in effect (--loss_aggregation, or the --learner's default)."""
        if self.loss_aggregation is not None:
            return self.loss_aggregation
        return "sequence-mean-token-sum-norm" if self.learner == "dr_grpo" else "token-mean"

    @property
    def advantage_estimator(self) -> str:
        """The group advantage estimator of `distrl.advantages` that the actors use for this --learner."""
        return self.learner

    @property
    def k(self) -> int:
        """Completions kept per group."""
        return self.topk or self.group_size

    @property
    def run_dir(self) -> Path:
        return Path(self.log_dir).resolve() / self.run_name

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        return cls(**json.loads(text))


DEFAULT_BUFFER_ADDRESS = "tcp://127.0.0.1:5555"
DEFAULT_WEIGHTS_PUB = "tcp://127.0.0.1:5556"
DEFAULT_WEIGHTS_ENDPOINT = "tcp://127.0.0.1:5557"


@dataclass
class LearnConfig(TrainConfig):
    """One learner rank as a plain process (`distrl learn`), wired to the buffer by ZMQ address only.

    Several ranks run under `torchrun --nproc_per_node N -m distrl.cli learn ...` (rank and world size
    come from torchrun's environment; `--number_of_learners` must equal N). Rank 0 binds the weight
    endpoints. Writes weights/, tb/learner<rank>/ and logs/ under `<log_dir>/<run_name>/`.
    """

    buffer_address: str = DEFAULT_BUFFER_ADDRESS
    """Address of the buffer (`distrl buffer --address`)."""
    weights_pub_bind: str = DEFAULT_WEIGHTS_PUB
    """Where rank 0 announces versions (ZMQ PUB); actors connect to it with `--weights_pub`."""
    weights_endpoint_bind: str = DEFAULT_WEIGHTS_ENDPOINT
    """Where rank 0 answers LATEST and FETCH (ZMQ ROUTER); actors connect with `--weights_endpoint`."""


@dataclass
class RolloutConfig(TrainConfig):
    """One rollout actor as a plain process (`distrl rollout`), wired by ZMQ addresses only.

    Writes its weight cache, tb/actor<id>/ and logs/ under `<log_dir>/<run_name>/`.
    """

    actor_id: int = 0
    """This actor's index (its seed offset, log and TensorBoard names)."""
    buffer_address: str = DEFAULT_BUFFER_ADDRESS
    """Address of the buffer (`distrl buffer --address`)."""
    weights_pub: str = DEFAULT_WEIGHTS_PUB
    """The learner's announcement socket (`distrl learn --weights_pub_bind`)."""
    weights_endpoint: str = DEFAULT_WEIGHTS_ENDPOINT
    """The learner's LATEST/FETCH endpoint (`distrl learn --weights_endpoint_bind`)."""

    def validate(self) -> None:
        super().validate()
        if self.actor_id < 0:
            raise ValueError(f"--actor_id must be >= 0, got {self.actor_id}")


@dataclass
class _BufferEndpoint:
    config: Optional[str] = None
    """YAML (.yaml/.yml) or TOML (.toml) file whose keys are flag names; command-line flags override it."""
    address: str = DEFAULT_BUFFER_ADDRESS
    """Where the buffer binds (ZMQ endpoint; port 0 picks a free one). Loopback by default: bind another
    interface only with --curve_secret_key, or on a network you trust."""
    run_dir: Optional[str] = None
    """Run directory: segments/, consumed.jsonl, buffer.json (address, pid, config) and tb/buffer0/."""
    resume: Optional[str] = None
    """Resume a stopped or killed buffer from this run directory: rebuild held groups, seen sample ids and
    the last selection from its segments and consumption log, then keep writing there."""
    resume_version: Optional[int] = None
    """With --resume, when the learner restarts from an older checkpoint (`distrl learn --resume`): the
    checkpoint's version; selections made after it are rolled back and their groups served again
    (docs/faults.md). Unset: keep every selection."""
    batch_size: int = 4
    """Groups consumed per policy version, across all learners."""
    group_size: int = 4
    """Completions per group (n); every PUT must have exactly this many rows."""
    topk: Optional[int] = None
    """Completions kept per group for training, by --topk_by (unset: all n)."""
    max_staleness: int = 1
    """Largest `learner_version - policy_version` handed out; 0 is on-policy."""
    curve_secret_key: Optional[str] = None
    """Turn on CURVE encryption and authentication: the server's secret key file (`<name>.key_secret`,
    written by `zmq.auth.create_certificates`, see docs/buffer.md)."""
    curve_client_keys: Optional[str] = None
    """With --curve_secret_key: directory of the public key files (`*.key`) of the clients let in."""
    tb_dir: Optional[str] = None
    """TensorBoard directory (unset: `<run_dir>/tb/buffer0`)."""


@dataclass
class BufferConfig(StorageOptions, SelectionOptions, _BufferEndpoint):
    """The replay buffer alone as a plain process (`distrl buffer`), for `distrl learn|rollout` and
    multi-host runs. It serves until SHUTDOWN, SIGTERM or SIGINT; `--resume` restarts it where it was."""

    def __post_init__(self) -> None:
        if self.resume_version is not None and (self.resume is None or self.resume_version < 0):
            raise ValueError(f"--resume_version needs --resume and must be >= 0, got {self.resume_version}")
        if self.resume is not None:
            if self.run_dir is not None and Path(self.run_dir).resolve() != Path(self.resume).resolve():
                raise ValueError(f"--run_dir {self.run_dir} differs from --resume {self.resume}: give one")
            if not Path(self.resume).is_dir():
                raise ValueError(f"--resume {self.resume}: no such run directory")
            self.run_dir = self.resume
        if self.run_dir is None:
            raise ValueError("give --run_dir (a new buffer) or --resume <run_dir> (restart one)")
        self.validate_selection()
        self.validate_storage()
        for name in ("batch_size", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"--max_staleness must be >= 0, got {self.max_staleness}")
        if self.topk is not None and not 1 <= self.topk <= self.group_size:
            raise ValueError(f"--topk must be in [1, --group_size={self.group_size}], got {self.topk}")
        if (self.curve_secret_key is None) != (self.curve_client_keys is None):
            raise ValueError("--curve_secret_key and --curve_client_keys go together (server key, allowed clients)")
        for name in ("curve_secret_key", "curve_client_keys"):
            if getattr(self, name) is not None and not Path(getattr(self, name)).exists():
                raise ValueError(f"--{name} {getattr(self, name)}: no such file or directory")

    @property
    def k(self) -> int:
        """Completions kept per group."""
        return self.topk or self.group_size


@dataclass
class _ReplaySource:
    source: Positional[str]
    """Run directory of a finished or running job (its `segments/`), or a segments directory itself."""
    run_name: str = ""
    """Name of the replay run; its directory is `<log_dir>/<run_name>/` (unset: `replay-<date>-<time>`)."""
    log_dir: str = "runs"
    """Parent directory of the replay run directory (config.json, consumed.jsonl, weights/, tb/)."""
    model: Optional[str] = None
    """Hub id or directory of the weights to train from (unset: those the source run started from: its
    `warm_start/` after --warm_start_steps, its built `model/` when it was `tiny`, else its --model)."""
    train_config: Optional[str] = None
    """A TrainConfig JSON file for every other learner option (unset: the source's config.json)."""
    max_steps: Optional[int] = None
    """Policy versions to train (default, and at most: as many as the log can feed under these rules)."""
    batch_size: Optional[int] = None
    """Groups per version (unset: the source run's)."""
    topk: Optional[int] = None
    """Completions kept per group (unset: the source run's)."""
    max_staleness: Optional[int] = None
    """Largest staleness handed out, under --staleness_model (unset: the source run's)."""
    staleness_model: Literal["recorded", "restamp"] = "recorded"
    """`recorded`: staleness = replay version - the policy version that generated the completion, and a
    group is eligible once the replay reaches that version (the source run's timeline). `restamp`: a group
    counts as generated by the version that first trains on it (staleness 0), and its reuses by later
    versions count from there; served rows carry that version."""
    learner: Optional[Literal["pg", "grpo"]] = None
    """Loss (unset: the source run's)."""
    learning_rate: Optional[float] = None
    """AdamW learning rate (unset: the source run's)."""
    seed: Optional[int] = None
    """Seed of the learner's initialization (unset: the source run's)."""


@dataclass
class ReplayConfig(SelectionOptions, _ReplaySource):
    """Train a learner offline from a saved segment log (`distrl replay <run_dir>`): no actors, no Ray.

    The log is loaded into a buffer in replay mode (each group handed out up to --replay_ratio times,
    staleness per --staleness_model) and the ordinary learner trains against it in this process.
    Writes `<log_dir>/<run_name>/` with config.json, replay.json, consumed.jsonl, weights/ and
    tb/{learner0,buffer0}/ (learner/staleness_* and buffer/staleness show the replayed staleness).
    """

    def __post_init__(self) -> None:
        if not self.run_name:
            self.run_name = time.strftime("replay-%Y%m%d-%H%M%S")
        if os.sep in self.run_name or self.run_name in (".", ".."):
            raise ValueError(f"--run_name must be a plain name, got {self.run_name!r}")
        if not Path(self.source).is_dir():
            raise ValueError(f"replay source {self.source}: no such directory")
        self.validate_selection()
        for name in ("max_steps", "batch_size", "topk"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"--max_staleness must be >= 0, got {self.max_staleness}")
        if self.train_config is not None and not Path(self.train_config).is_file():
            raise ValueError(f"--train_config {self.train_config}: no such file")

    @property
    def out_dir(self) -> Path:
        return Path(self.log_dir).resolve() / self.run_name


@dataclass
class EvalConfig:
    """Evaluate a model, or a policy version a run published, on a dataset (`distrl eval`).

    Samples --num_samples completions per problem, scores them with the task's reward, prints pass@1
    (accuracy), pass@k, maj@k and mean length, overall and per group (MATH-500: subject, level), and
    writes them with every sample to --output (docs/eval.md).
    """

    model: str
    """Hub id or local directory of the base causal LM; `tiny` builds the embedded tiny model (--seed)."""
    adapter: Optional[str] = None
    """A policy version directory a run published (`<run_dir>/weights/vNNNNNN`): a LoRA adapter (it holds
    adapter_config.json) or full weights, loaded into the engine over --model (unset: --model alone)."""
    dataset: Optional[str] = None
    """Local .jsonl/.json/.parquet file or hub id (unset: the built-in task's held-out problems)."""
    task: Optional[Literal["arith", "gsm8k", "math500", "half_vocab"]] = None
    """Task (prompt template + reward); default inferred from the dataset, `arith` without one."""
    split: Optional[str] = None
    """Dataset split (unset: `test` for MATH-500's hub id, else `train`, which is what a local file holds)."""
    arith_ops: str = "+-"
    """`arith` only: the operators of its problems, as `distrl train --arith_ops` (use the run's own)."""
    arith_max_operand: int = 99
    """`arith` only: operands are integers in [0, arith_max_operand], as `distrl train --arith_max_operand`."""
    prompt_template: Optional[str] = None
    """The prompt with `{question}`, or a file holding it, as `distrl train --prompt_template` (unset: the task's)."""
    chat_template: Literal["auto", "on", "off"] = "auto"
    """Whether the tokenizer's chat template wraps the prompt, as `distrl train --chat_template`."""
    tokenizer: Optional[str] = None
    """Tokenizer hub id or directory (unset: the model's own)."""
    num_samples: int = 1
    """Completions sampled per problem (n): pass@k and maj@k are reported for k = 1, 2, 4, ... and n."""
    temperature: Optional[float] = None
    """Sampling temperature; 0 is greedy (unset: 0 with --num_samples 1, else 1.0)."""
    max_new_tokens: int = 512
    """Longest completion in tokens."""
    limit: Optional[int] = None
    """Evaluate the first N dataset rows, in file order (unset: all); built-in tasks: N held-out problems
    (unset: 100)."""
    ks: Optional[tuple[int, ...]] = None
    """The k of pass@k and maj@k, each in [1, --num_samples] (unset: powers of two below n, and n)."""
    engine: Literal["vllm", "hf"] = "vllm"
    """Generation engine: `vllm` or `hf` (transformers; for models vLLM-CPU cannot run)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype (`auto`: float32 on CPU, bfloat16 on GPU)."""
    max_model_len: Optional[int] = None
    """Longest prompt + completion in tokens (unset: the model's own limit)."""
    seed: int = 0
    """Sampling seed (and the held-out choice of built-in tasks)."""
    output: Optional[str] = None
    """Write the report as JSON here: metrics, by_group, settings and every problem's samples (text,
    extracted answer, correct, reward, length). Unset: print only."""

    def __post_init__(self) -> None:
        for name in ("num_samples", "max_new_tokens", "limit", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.sampling_temperature == 0 and self.num_samples > 1:
            raise ValueError(f"--num_samples {self.num_samples} with --temperature 0 samples the same greedy "
                             "completion each time: give --temperature > 0")
        if not self.arith_ops or set(self.arith_ops) - set("+-*"):
            raise ValueError(f"--arith_ops must be made of + - * (e.g. '+' or '+-'), got {self.arith_ops!r}")
        if self.arith_max_operand < 1:
            raise ValueError(f"--arith_max_operand must be >= 1, got {self.arith_max_operand}")
        if self.ks is not None and any(not 1 <= k <= self.num_samples for k in self.ks):
            raise ValueError(f"--ks must each be in [1, --num_samples={self.num_samples}], got {list(self.ks)}")
        if self.adapter is not None and not Path(self.adapter).is_dir():
            raise ValueError(f"--adapter {self.adapter}: no such directory (expected <run_dir>/weights/vNNNNNN)")
        # --dataset, --model, --tokenizer: checked at preflight (distrl/preflight.py), before any engine

    @property
    def sampling_temperature(self) -> float:
        """--temperature, or its default: 0 (greedy) with --num_samples 1, else 1.0."""
        if self.temperature is not None:
            return self.temperature
        return 0.0 if self.num_samples == 1 else 1.0
