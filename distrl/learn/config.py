"""The learner's config section: the loss, off-policy correction, optimizer, model and checkpoints.

Torch-free, owned by the learner. ``distrl/cmd/config.py`` composes it with the foundation's sections
(``distrl/core/run_options.py``) into `distrl learn`'s and `distrl train`'s configs and holds the rules that
join two sections (e.g. `--pg_baseline running_mean` needs `--learner pg`). ``check`` raises ValueError
naming the first bad flag and never changes the config; ``resolve`` computes derived values at construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from distrl.learn.staleness import StalenessBand

OFF_POLICY = ("none", "tis", "decoupled")
IS_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class OffPolicyConfig:
    """How the learner corrects for data sampled by an older policy (distrl/learn/offpolicy.py's docstring; it lives
    here, torch-free, so that its checks are the flags' checks too).

    Attributes:
        method: ``none``, ``tis`` or ``decoupled``.
        cap: C, the truncation of the importance weight (dimensionless, >= 1; default 2.0).
        level: ``token`` or ``sequence`` (``sequence`` only with ``tis``).
        mask_low, mask_high: band on the token ratio rho = pi_prox / mu; tokens outside get weight 0.
    """

    method: Literal["none", "tis", "decoupled"] = "none"
    cap: float = 2.0
    level: Literal["token", "sequence"] = "token"
    mask_low: Optional[float] = None
    mask_high: Optional[float] = None

    def __post_init__(self) -> None:
        """Raise ValueError naming the flag (--off_policy, --is_*) of the first bad field."""
        if self.method not in OFF_POLICY:
            raise ValueError(f"--off_policy (the correction method) must be one of {OFF_POLICY}, got {self.method!r}")
        if self.level not in IS_LEVELS:
            raise ValueError(f"--is_level must be one of {IS_LEVELS}, got {self.level!r}")
        if self.level == "sequence" and self.method != "tis":
            raise ValueError(f"sequence-level importance weights: --is_level sequence needs --off_policy tis, got "
                             f"--off_policy {self.method}")
        if not self.cap >= 1.0:
            raise ValueError(f"--is_cap must be >= 1 (the importance-weight cap), got {self.cap}")
        if self.mask_low is not None and self.mask_low < 0:
            raise ValueError(f"--is_mask_low must be >= 0, got {self.mask_low}")
        if self.mask_high is not None and not self.mask_high > (self.mask_low or 0.0):
            raise ValueError(f"--is_mask_high must be > --is_mask_low and > 0, got [{self.mask_low}, {self.mask_high}]")


def aggregation_in_effect(learner: str, given: Optional[str]) -> str:
    """The loss aggregation in effect: --loss_aggregation when given, else the --learner's default
    (sequence-mean-token-sum-norm for dr_grpo, token-mean otherwise)."""
    if given is not None:
        return given
    return "sequence-mean-token-sum-norm" if learner == "dr_grpo" else "token-mean"


@dataclass
class LearnOptions:
    """What learners read: their count, the loss and its correction, the optimizer, model and checkpoints."""

    number_of_learners: Optional[int] = None
    """Learners; more than one form a torch.distributed group that averages gradients
    (unset: 1, or the second number of --gpu_split)."""
    max_steps: int = 10
    """Policy versions to produce (one optimizer step of the learner group each)."""
    learning_rate: float = 1e-5
    """AdamW learning rate."""
    learner_chunk_tokens: int = 32768
    """Token budget of a forward/backward micro-batch (gradient accumulation; equals the full-batch step): rows,
    taken widest first (so rows of similar length share a micro-batch and little is padding), join a
    micro-batch while rows x the longest row's length (prompt + completion, the padded width) stays within it;
    a row longer than the budget is a micro-batch alone. 32768 puts SmolLM2's 32 x 8
    completions of ~65 tokens in one micro-batch (8 micro-batches of 8 were bound by kernel launches: 3.7 s
    a version against 0.4 s, docs/real_workload.md). Lower it if activations overflow the device's memory.
    Ignored when --learner_chunk_size is given."""
    learner_chunk_size: Optional[int] = None
    """Completions per forward/backward micro-batch, a fixed count that wins over --learner_chunk_tokens when
    given (unset: micro-batches by --learner_chunk_tokens)."""
    learner_pack_tokens: int = 0
    """Sequence packing: lay each micro-batch's sequences end to end in rows of at most this many tokens
    (position ids restart per sequence, attention stays inside it), so no compute goes to padding;
    0 pads every sequence to the micro-batch's longest. Needs transformers' attention (`--backend hf`
    on a GPU). Same loss and gradients as padded rows."""
    learner_head_chunk_tokens: int = 1024
    """Completion tokens per chunk of the chunked or halfmm LM head (`distrl/learn/logprobs.py`): fp32 logits exist
    for this many tokens at a time (about tokens * vocab * 4 bytes, 0.6 GB for 1024 x 151k; 6 bytes instead
    of 4 in halfmm's backward)."""
    learner_head: Literal["auto", "chunked", "cce", "halfmm"] = "auto"
    """How the learner's LM head computes logprobs (`distrl/learn/logprobs.py`): `chunked` (fp32 logits in chunks of
    --learner_head_chunk_tokens, a hand-written backward), `cce` (Cut Cross-Entropy's Triton kernels: no
    logits buffer, bf16 inputs with fp32 accumulation; needs CUDA, a bf16/fp16 head, --temperature 1 and the
    `cut_cross_entropy` package), `halfmm` (the chunked algorithm with bf16/fp16 matmuls writing fp32 logits:
    same logprobs, gradients rounded to bf16; needs a bf16/fp16 head; fast on CUDA only) or `auto` (halfmm for a
    bf16/fp16 head on CUDA, else chunked; the learner logs which)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory: 19 against 42 GiB, and 22 %
    more time, on the 0.5B benchmark of BENCHMARKS.md)."""
    learner_compile: Optional[bool] = None
    """`torch.compile` each decoder layer of the learner's model (dynamic shapes; fuses the norms,
    activations and rotary embeddings: 1.5x the learner step of SmolLM2, 1.3x the 0.5B's, on an H200,
    BENCHMARKS.md eighth round). The learner compiles at start every variant of the layers' inputs a
    micro-batch can bring (one row or more; packed rows with or without a mask; with and without gradients:
    `distrl.learn.model.compile_layers`), so no batch recompiles mid-run; that takes about a minute while the actors
    start, the first time: the compiled code is kept in `~/.cache/distrl/compile/` and later runs of the same
    model and flags load it (docs/gpu.md, "Compile caches"). Unset: on for a CUDA learner with --backend hf (Unsloth
    compiles its own), unless --learner_generates (its generator would recompile the layers with a KV cache);
    True or False forces it (True is refused with --learner_generates; True on a CPU learner compiles C++ kernels,
    which needs a C compiler)."""
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
    learner's weights at consumption, behavior weight truncated at --is_cap). See distrl/learn/offpolicy.py."""
    bias_correction: Literal["none", "reweight"] = "none"
    """Correction for the sampling bias of asynchrony (slow, long, hard groups evicted or left untrained):
    `none`, or `reweight` (each trained group's loss weighted by generated share / trained share of its
    (length, difficulty) cell, clipped to [0.2, 5], mean 1 over the batch; Shimodaira 2000). See
    distrl/learn/reweight.py and the buffer's monitor, distrl/buffer/bias.py."""
    is_cap: float = 2.0
    """C, >= 1: importance weights pi/mu are truncated at C by `tis` and `decoupled`."""
    is_level: Literal["token", "sequence"] = "token"
    """`tis` only: one weight per token, or one per completion (the product of its token ratios)."""
    is_mask_low: Optional[float] = None
    """Tokens whose ratio pi/mu is below this get no loss (any --off_policy; default: no lower bound)."""
    is_mask_high: Optional[float] = None
    """Tokens whose ratio pi/mu is above this get no loss (any --off_policy; default: no upper bound)."""
    staleness_kl_max: float = 0.02
    """`--max_staleness auto`: the band's limit on k3 KL(behavior || learner), nats/token (TRPO's trust region;
    distrl/learn/staleness.py, docs/offpolicy.md). Above it the bound halves at once."""
    staleness_spread_max: float = 0.2
    """`--max_staleness auto`: the band's limit on the mean |log pi/mu| (the importance ratios' spread), nats."""
    staleness_clip_max: float = 0.2
    """`--max_staleness auto`: the band's limit on the clip fraction (tokens whose clipped term wins)."""
    staleness_patience: int = 3
    """`--max_staleness auto`: consecutive versions with every signal in band before the bound rises by 1."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global L2 norm before each step; 0 turns clipping off."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning rate after the warm-up, by policy version: constant, or cosine / linear decay to 0 at --max_steps."""
    lr_warmup_steps: int = 0
    """Versions of linear warm-up from --learning_rate / lr_warmup_steps to --learning_rate."""
    lora_alpha: int = 32
    """LoRA alpha (scale = alpha / r)."""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj")
    """Module names that get a LoRA adapter (every attention and MLP projection)."""
    backend: Literal["auto", "unsloth", "hf"] = "auto"
    """Learner model code: `unsloth` (FastLanguageModel; its CPU fallback without a GPU), `hf` (transformers +
    peft), or `auto`: unsloth where importing it works on the learner's node, else hf with one line saying why.
    Unsloth's import is first tried in a child process (it can kill a process, e.g. by SIGILL on a CPU without
    AVX-512); an explicit `unsloth` that fails there stops the run (exit 2). The run's config.json keeps the
    backend it settled on."""
    load_in_4bit: bool = False
    """QLoRA: load the base weights in 4 bits (Unsloth + bitsandbytes; needs an NVIDIA GPU and --finetune lora)."""
    checkpoint_every: int = 10
    """Policy versions between learner checkpoints (`<run_dir>/ckpt/vNNNNNN/`; the last version is always
    saved); 0 saves only the last."""
    export_final: Literal["merged", "adapter", "off"] = "merged"
    """What learner rank 0 writes at the end into `<run_dir>/final/`: `merged` = `merged/` (full weights in
    HF format + tokenizer, loads with `AutoModelForCausalLM.from_pretrained`) and, with LoRA, `adapter/`;
    `adapter` = only `adapter/` (LoRA only: skips the full copy of a large model; also what --load_in_4bit
    gets); `off` = nothing."""
    learner_generates: bool = False
    """The learner also generates: while its GET waits for data it samples groups with its own model (the
    HF engine on the learner's model object, no weight copy, at the learner's current version) and PUTs
    them as actor `learner<rank>` (actor_id -1-rank; distrl/rollout/learner_generates.py: LearnerGenerator). Allows
    --number_of_actors 0."""
    attest_tolerance: Optional[float] = None
    """Largest |engine - learner| canary logprob, nats/token, for a group's weight stamp to match (unset:
    1e-4 for float32 on CPU, 0.15 for bf16 or CUDA; derived in distrl/weights/attest.py)."""
    attest_max_bad_versions: int = 3
    """Stop the run with an error when groups were quarantined (their actor served other weights than its
    stamp claims) at this many consecutive policy versions; 0: never stop, only quarantine."""

    def resolve(self) -> None:
        """--lora_target_modules as a tuple (a config.json holds a list)."""
        self.lora_target_modules = tuple(self.lora_target_modules)

    def compiles_layers(self) -> bool:
        """Whether a CUDA learner compiles its decoder layers: --learner_compile, or, unset, --backend hf without
        --learner_generates."""
        if self.learner_compile is not None:
            return self.learner_compile
        return self.backend == "hf" and not self.learner_generates

    def check(self) -> None:
        """Raise ValueError naming the first bad learner option."""
        for name in ("number_of_learners", "max_steps", "learner_chunk_size", "learner_chunk_tokens",
                     "learner_head_chunk_tokens",
                     "loss_norm_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.learner_pack_tokens < 0:
            raise ValueError(f"--learner_pack_tokens must be >= 0 (0: no packing), got {self.learner_pack_tokens}")
        if self.learner_compile and self.learner_generates:
            raise ValueError("--learner_compile with --learner_generates: the generator would run the learner's "
                             "compiled layers with a KV cache and recompile them mid-run; pass one of the two")
        if self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.attest_max_bad_versions < 0 or not (self.attest_tolerance is None or self.attest_tolerance > 0):
            raise ValueError(f"--attest_max_bad_versions must be >= 0 and --attest_tolerance > 0, got "
                             f"{self.attest_max_bad_versions} and {self.attest_tolerance}")
        if not self.learning_rate > 0:
            raise ValueError(f"--learning_rate must be > 0, got {self.learning_rate}")
        self.check_loss()
        if not self.max_grad_norm >= 0:
            raise ValueError(f"--max_grad_norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"--lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if self.export_final not in ("merged", "adapter", "off"):
            raise ValueError(f"--export_final must be one of merged, adapter, off, got {self.export_final!r}")
        # with --finetune (the shared section): distrl/cmd/config.py's learner_options_agree

    def check_loss(self) -> None:
        """The loss and off-policy options; raises ValueError naming the flag."""
        for name in ("clip_eps", "clip_eps_low"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 1:
                raise ValueError(f"--{name} must be in (0, 1), got {value}")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            raise ValueError(f"--clip_eps_high must be > 0, got {self.clip_eps_high}")
        if not 0 <= self.baseline_decay < 1:
            raise ValueError(f"--baseline_decay must be in [0, 1), got {self.baseline_decay}")
        if not self.kl_coef >= 0:
            raise ValueError(f"--kl_coef must be >= 0, got {self.kl_coef}")
        self.off_policy_config()  # the correction's own checks (--off_policy, --is_*)
        self.staleness_band()  # --staleness_*
        if self.bias_correction not in ("none", "reweight"):
            raise ValueError(f"--bias_correction must be none or reweight, got {self.bias_correction!r}")

    def staleness_band(self) -> StalenessBand:
        """The adaptive staleness bound's band (distrl/learn/staleness.py); raises ValueError naming the flag."""
        return StalenessBand(self.staleness_kl_max, self.staleness_spread_max, self.staleness_clip_max,
                             self.staleness_patience)

    def off_policy_config(self) -> OffPolicyConfig:
        """The off-policy correction these flags give (distrl/learn/offpolicy.py); raises ValueError naming the flag."""
        return OffPolicyConfig(self.off_policy, self.is_cap, self.is_level, self.is_mask_low, self.is_mask_high)


@dataclass
class WarmStartOptions:
    """`distrl train`'s supervised warm start before the roles start (`distrl/learn/sft.py`)."""

    warm_start_steps: int = 0
    """`distrl train`: supervised warm start before the roles start: AdamW steps of full fine-tuning of
    the base model on the task's gold answers (prompt -> answer + EOS, loss on answer tokens only;
    `distrl/learn/sft.py`). The result is saved to `<run_dir>/warm_start/` and is every role's base model
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

    def check(self) -> None:
        """Raise ValueError naming the first bad warm-start option."""
        if self.warm_start_steps < 0:
            raise ValueError(f"--warm_start_steps must be >= 0 (0: no warm start), got {self.warm_start_steps}")
        if not self.warm_start_lr > 0:
            raise ValueError(f"--warm_start_lr must be > 0, got {self.warm_start_lr}")
        if self.warm_start_until_accuracy is not None and not 0 < self.warm_start_until_accuracy <= 1:
            raise ValueError(f"--warm_start_until_accuracy must be in (0, 1], got {self.warm_start_until_accuracy}")
        if self.warm_start_batch_size < 1:
            raise ValueError(f"--warm_start_batch_size must be >= 1, got {self.warm_start_batch_size}")
