"""The options both actors and learners read: the model, sampling shape, seed, the weight transport.

Part of the foundation: no torch, no role. Each role owns the rest of its options in its own package
(``distrl/rollout/config.py``, ``distrl/learn/config.py``, ``distrl/buffer/config.py``); ``distrl/cmd/config.py``
composes them into each command's config and holds the rules that join two sections. Every field is declared once,
here or in one role's section, with its unit and default.

A section checks only its own fields (``check``, which never changes the config) and computes its own
derived values once at construction (``resolve``); the composed config calls both for every section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union


@dataclass
class BatchOptions:
    """The shape of a version's batch: read by actors (credits, sampling), learners and the buffer."""

    batch_size: int = 4
    """Groups consumed per policy version, across all learners."""
    group_size: int = 4
    """Completions sampled per prompt (n); a group is those n completions, and every PUT to the buffer
    holds exactly n rows."""

    def check(self) -> None:
        """Raise ValueError naming the first bad batch option."""
        for name in ("batch_size", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")


AUTO_CEILING = 4  # `--max_staleness auto`'s ceiling when none is given


@dataclass(frozen=True)
class StalenessBound:
    """A parsed ``--max_staleness``: a fixed bound, or ``auto[:CEILING]`` (a learner-side controller moves the
    bound between 0 and ``ceiling``, distrl/learn/staleness.py, docs/offpolicy.md).

    ``ceiling``: the largest bound the run may use, in versions (the fixed value itself, or auto's ceiling): what
    weight publishers and attestors keep versions for. ``initial``: the bound at version 0 (the fixed value, 0 for
    ``auto``). ``auto``: whether the learner announces a moving bound to the buffer.
    """

    ceiling: int
    auto: bool = False

    @property
    def initial(self) -> int:
        return 0 if self.auto else self.ceiling

    @classmethod
    def parse(cls, value: int | str) -> "StalenessBound":
        """``3``, ``"3"``, ``"auto"`` or ``"auto:6"`` -> a bound. Raises ValueError naming --max_staleness
        on anything else (a negative number, ``auto:`` without an integer, ``auto:-1``)."""
        text = str(value).strip()
        auto = text == "auto" or text.startswith("auto:")
        number = (text[len("auto:"):] if text != "auto" else str(AUTO_CEILING)) if auto else text
        if isinstance(value, bool) or not number.isdigit():
            raise ValueError(f"--max_staleness must be an integer >= 0, `auto` or `auto:CEILING` (CEILING an "
                             f"integer >= 0), got {value!r}")
        return cls(int(number), auto)

    def __str__(self) -> str:
        return f"auto:{self.ceiling}" if self.auto else str(self.ceiling)


@dataclass
class StalenessOptions:
    """The staleness bound: the buffer enforces it, learner rank 0 keeps that many weight versions more."""

    max_staleness: Union[int, str] = 1
    """Largest `learner_version - policy_version` of a completion used to train; 0 is on-policy. `auto` or
    `auto:CEILING` (default ceiling 4): the learners move the bound between 0 and CEILING from the off-policy
    signals they measure (--staleness_kl_max and the flags beside it; docs/offpolicy.md) and announce it to the
    buffer with each version."""

    def check(self) -> None:
        """Raise ValueError naming --max_staleness when it is not an integer >= 0, `auto` or `auto:CEILING`."""
        StalenessBound.parse(self.max_staleness)

    @property
    def bound(self) -> StalenessBound:
        """The parsed bound (:class:`StalenessBound`); raises ValueError on a bad --max_staleness."""
        return StalenessBound.parse(self.max_staleness)


@dataclass
class SharedOptions:
    """What actors and learners both read: the model, how completions are sampled, the weight transport."""

    model: str = "tiny"
    """Hub id or local directory of a causal LM; `tiny` builds the embedded tiny Qwen2 model in code."""
    tokenizer: Optional[str] = None
    """Tokenizer hub id or directory (unset: the model's own)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype for engine and learner (`auto`: float32 on CPU, bfloat16 on GPU)."""
    seed: int = 0
    """Seed for prompts, sampling and initialization."""
    torch_threads: Optional[int] = None
    """CPU threads of torch (`torch.set_num_threads`) in the warm start, each learner and each actor (the
    HF engine; vLLM binds its own). Unset: torch's default, one per core. On a small, busy CPU 1 is much
    faster: two threads that wait for each other at every operation stall whenever one is descheduled."""
    learner: Literal["pg", "grpo", "dr_grpo"] = "grpo"
    """Loss: `pg` (REINFORCE with a baseline), `grpo` (group-std-normalized advantages, clipped ratio) or
    `dr_grpo` (Dr.GRPO: clipped ratio, advantages not std-normalized, no length normalization). It also
    names the actors' group advantage estimator (`distrl.core.advantages`)."""
    temperature: float = 1.0
    """Sampling temperature; the learner divides its logits by the same value."""
    max_new_tokens: int = 256
    """Longest completion in tokens; longer ones stop with finish_reason `length`."""
    max_model_len: Optional[int] = None
    """Longest prompt + completion the engine accepts, in tokens (unset: the model's own limit)."""
    truncation: Literal["keep", "zero", "mask"] = "keep"
    """Completions cut at --max_new_tokens without an end of sequence (finish_reason `length`): `keep`
    scores them as they are; `zero` gives them reward 0 (before the group's advantages); `mask` keeps
    their reward in the group's advantages but gives their tokens no loss (DAPO's overlong filtering, Yu
    et al. 2025, arXiv:2503.14476). Every completion's reward components carry `truncated` 0/1."""
    finetune: Literal["lora", "full"] = "lora"
    """`lora` trains an adapter and publishes it (format `lora`); `full` trains every weight and publishes
    the whole model (format `full`). Actors read it too: a vLLM engine serves LoRA requests only for `lora`
    (vLLM's LoRA layers rename the weights that a full-weight reload would replace)."""
    lora_rank: int = 16
    """LoRA rank r (default 16). Any rank up to 512 works with `--engine vllm`: its engine loads adapters up
    to the next rank vLLM accepts (1, 8, 16, 32, 64, 128, 256, 320, 512; 48 gets 64)."""
    number_of_actors: Optional[int] = None
    """Rollout actors (each one generation engine); 0 is allowed with --learner_generates
    (unset: 1, or the first number of --gpu_split)."""
    weights_transport: Optional[Literal["fs", "zmq", "nccl", "shm"]] = None
    """How actors get each version's weights: `fs` reads the learner's weight directory (a shared
    filesystem), `zmq` downloads it from the learner's weight endpoint (no shared filesystem), `nccl`
    broadcasts full weights from learner rank 0's device to every actor's (gloo on CPU; needs
    --finetune full), `shm` copies full weights through host shared memory (/dev/shm) to actors on the
    learner's host, no file written (needs --finetune full). Unset: `distrl train` picks `shm` for
    --finetune full when every actor runs on learner 0's node, the driver's, and /dev/shm there has room,
    `zmq` when learner 0 and the actors run on Ray nodes that share no filesystem, else `fs`; the separate
    launchers take `fs` (docs/weights.md, docs/multinode.md)."""
    weights_broadcast_port: int = 5558
    """TCP port on learner rank 0's host where the `nccl` transport's group meets (`distrl train` picks a
    free one)."""
    attest_weights: bool = True
    """Weight attestation (distrl/weights/attest.py, docs/weights.md): every completion records the versions,
    payload digests and canary logprob of the weights that generated it, and the learners quarantine groups
    whose stamp does not match their own canary for that version. Costs one 32-token forward per version on
    each actor and learner. `--no_attest_weights` turns it off."""
    buffer_curve_server_key: Optional[str] = None
    """CURVE: the buffer's public key file, when the buffer runs with --curve_secret_key (docs/buffer.md);
    actors and learners then encrypt and authenticate their buffer connection."""
    buffer_curve_client_key: Optional[str] = None
    """CURVE: this client's secret key file (its public key must be in the buffer's --curve_client_keys)."""

    def check(self) -> None:
        """Raise ValueError naming the first bad shared option."""
        for name in ("max_new_tokens", "max_model_len", "lora_rank", "torch_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.learner not in ("pg", "grpo", "dr_grpo"):
            raise ValueError(f"--learner must be pg, grpo or dr_grpo, got {self.learner!r}")
        if self.truncation not in ("keep", "zero", "mask"):
            raise ValueError(f"--truncation must be one of keep, zero, mask, got {self.truncation!r}")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if (self.buffer_curve_server_key is None) != (self.buffer_curve_client_key is None):
            raise ValueError("--buffer_curve_server_key and --buffer_curve_client_key go together")

    @property
    def advantage_estimator(self) -> str:
        """The group advantage estimator of `distrl.core.advantages` that the actors use for this --learner."""
        return self.learner
