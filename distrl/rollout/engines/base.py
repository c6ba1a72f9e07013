"""The engine interface: sample groups of completions with behavior logprobs, load weights by version.

An engine serves one policy version at a time. ``generate`` samples ``n`` completions per prompt and
returns, per completion, its token ids and the per-token *behavior* logprobs: natural-log
probabilities of the sampled tokens under ``softmax(logits / temperature)`` (vLLM's
``processed_logprobs``), the numbers the learner reproduces by dividing its fp32 logits by the same
temperature. ``load_weights`` switches to a newer version between generate calls, so every completion
of one call comes from one version.

Backends: :mod:`.vllm` (one module: vLLM's offline ``LLM``) and :mod:`.hf` (a subpackage: transformers, for
machines without vLLM, with its own samplers and CUDA kernels); :mod:`.merge` (weights on disk, a LoRA adapter
merged into base weights) serves both. :func:`distrl.rollout.engines.make_engine` picks one from ``--engine``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

ENGINES = ("vllm", "hf")
FORMATS = ("lora", "full")


@dataclass
class Completion:
    """One sampled completion: ``token_ids`` (T,), ``logprobs`` (T,) in nats, after temperature.

    ``token_ids`` include the stop token when ``finish_reason`` is ``"stop"``; ``"length"`` means the
    completion hit ``max_new_tokens`` (or the engine's ``max_model_len``). ``versions``: the engine's
    ``version`` when its first and its last token were sampled (they differ only when an in-flight
    update loaded a version while it ran); None: the version served for the whole call.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    versions: tuple[int, int] | None = None


@dataclass
class PromptResult:
    """The ``prompt_ids`` (P,) of one prompt as the engine tokenized it, and its ``n`` completions."""

    prompt_ids: list[int]
    completions: list[Completion]


def encode_prompt(tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """The token ids an engine generates from for `prompt`: a text is encoded with `tokenizer`'s default
    special tokens (as vLLM and transformers encode a text prompt); a token id list is used as it is."""
    return tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)


class Engine(ABC):
    """Generates with the policy version it serves; ``version`` is 0 (the initial weights) at start.

    Attributes:
        tokenizer: the tokenizer prompts are encoded with (a transformers tokenizer).
        version: the policy version served.
        max_model_len: prompt + completion limit in tokens (None: unknown).
    """

    tokenizer = None
    version: int = 0
    max_model_len: int | None = None  # prompt + completion limit in tokens, when the engine knows it
    device = None  # torch.device the weights live on (the collective transport receives onto it)

    supports_inflight = False  # generate(..., between_steps=...) can switch versions mid-generation

    def generate(self, prompts: list[str], n: int, temperature: float, max_new_tokens: int,
                 between_steps=None, seed: int | None = None) -> list[PromptResult]:
        """Sample ``n`` completions for each prompt with the version served.

        Args:
            prompts: P prompts, each a string (encoded by :func:`encode_prompt`: special tokens added
                as the tokenizer does by default) or the token id list to generate from.
            n: completions per prompt (a group).
            temperature: > 0 samples from ``softmax(logits / temperature)``; 0 is greedy (argmax), and
                its logprobs are then those of ``softmax(logits)``.
            max_new_tokens: most tokens per completion.
            between_steps: see the engine (in-flight updates; HF engine only).
            seed: completion j of prompt i is sampled with seed ``seed + i * n + j`` (vLLM) or the call
                with ``seed`` (HF), so no two completions share a seed and
                a resumed actor draws the same completions as the run it continues; None: the
                engine's own random stream.
        Returns:
            P results in prompt order, each with n completions (:meth:`generate_groups`, gathered).
        """
        results: list[PromptResult | None] = [None] * len(prompts)
        for finished in self.generate_groups(prompts, n, temperature, max_new_tokens, between_steps, seed):
            for i, result in finished:
                results[i] = result
        return results

    @abstractmethod
    def generate_groups(self, prompts: list[str], n: int, temperature: float, max_new_tokens: int,
                        between_steps=None, seed: int | None = None) -> Iterator[list[tuple[int, PromptResult]]]:
        """As :meth:`generate`, but yields each group as soon as its last completion ends: lists of
        ``(prompt index, result)`` (the groups that ended together), every prompt exactly once, in the
        order they end. The caller may score and PUT a group while the others are still generating.
        Errors (a prompt too long, a bad temperature) are raised at the first ``next``."""

    @abstractmethod
    def load_weights(self, version: int, fmt: str, path: str | Path) -> None:
        """Serve policy ``version`` from the next ``generate`` on.

        Args:
            version: the new version; must be greater than the one served.
            fmt: ``lora`` (a PEFT adapter directory) or ``full`` (a ``save_pretrained`` model
                directory with safetensors weights of the same architecture).
            path: the payload directory (already digest-checked by the weight transport).
        Raises:
            ValueError: an unknown format, or a version not newer than the one served.
        """

    def graph_captures(self) -> int:
        """Decode-step CUDA graphs captured so far (a new shape, or a load that changed the modules): a run
        whose shapes are warm captures none more. 0 for an engine that captures none."""
        return 0

    def canary_logprob(self) -> float:
        """The served weights' mean logprob (nats/token, temperature 1) of the canary sequence
        (:func:`distrl.weights.attest.canary_ids` of the model's ``config.vocab_size``): what the actor stamps
        on its completions and the learner checks (distrl.weights.attest). One forward of 32 tokens."""
        raise NotImplementedError(f"{type(self).__name__} computes no canary: run with --no_attest_weights")

    def load_tensors(self, version: int, named: list) -> None:
        """Serve full weights given as (name, tensor) pairs (the collective transport's payload).

        This default writes them to a temporary safetensors directory and loads it as ``full``;
        an engine that can copy tensors in place overrides it.
        """
        import tempfile

        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="distrl-tensors-") as tmp:
            save_file({n: t.detach().cpu().contiguous() for n, t in named}, str(Path(tmp) / "model.safetensors"),
                      metadata={"format": "pt"})
            self.load_weights(version, "full", tmp)

    def load_lora(self, version: int, path: str | Path) -> None:
        """Serve the LoRA adapter at ``path`` as ``version`` (``load_weights(version, "lora", path)``)."""
        self.load_weights(version, "lora", path)

    def warm_up(self, rows: int | None = None) -> None:  # noqa: B027 (a no-op by default: compiles nothing lazily)
        """Compile and capture now what the first generate call would, so that the first rollouts do not wait for
        it (``distrl train`` starts the actors while the learners load). ``rows``: the most completions a later
        call asks for at once (prompts x n), which an engine may size its buffers for. Changes no weights and no
        version."""

    def close(self) -> None:  # noqa: B027 (a no-op by default: an engine without scratch files need not override it)
        """Release what the engine holds (scratch files, the model); the engine is unusable after."""

    def _check_load(self, version: int, fmt: str) -> None:
        """Raise ValueError for a format outside FORMATS or a version not newer than the one served."""
        if fmt not in FORMATS:
            raise ValueError(f"unknown weights format {fmt!r}; engines load {FORMATS}")
        if version <= self.version:
            raise ValueError(f"policy version {version} is not newer than the served version {self.version}")

