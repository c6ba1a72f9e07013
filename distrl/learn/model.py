"""Policy loading for the learner: LoRA or full fine-tuning, through Unsloth or transformers + peft.

- ``backend="unsloth"``: Unsloth's ``FastLanguageModel`` (on a machine without a GPU its CPU fallback,
  which is transformers + peft underneath), imported only after a crash-safe probe of its import chain on
  this host (:func:`settle_backend`, :mod:`distrl.core.probe`).
- ``backend="hf"``: ``AutoModelForCausalLM`` + peft's ``get_peft_model``.
- ``backend="auto"``: ``unsloth`` where the probe finds it usable, else ``hf`` (one warning says why).
- ``finetune="lora"``: a fresh LoRA adapter (B = 0, so version 0 equals the base model) on
  ``target_modules`` (default: every attention and MLP projection, so vLLM can serve the adapter as a
  ``LoRARequest``). ``load_in_4bit`` loads the frozen base in 4 bits (QLoRA; Unsloth + bitsandbytes on
  an NVIDIA GPU only).
- ``finetune="full"``: every weight trains; the reference policy of a KL term is then a frozen copy
  (:func:`frozen_reference`), while with LoRA it is the same model with the adapter disabled
  (:func:`reference_context`).

Published payloads (written by :mod:`distrl.weights`' publishers with ``save_pretrained``): format ``lora``
is the PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``); format ``full`` is
the whole model (``config.json`` + ``model*.safetensors``), which an engine loads as full weights.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
from pathlib import Path
from typing import Optional, Sequence

import torch

from distrl.core.dtypes import resolve_dtype
from distrl.core.probe import backend_stacks, load, probe

log = logging.getLogger("distrl.learner")

BACKENDS = ("auto", "unsloth", "hf")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_policy(model: str, dtype: str, lora_rank: int = 16, lora_alpha: int = 32, max_seq_length: int = 2048,
                seed: int = 0, *, finetune: str = "lora", backend: str = "auto",
                target_modules: Optional[Sequence[str]] = None, load_in_4bit: bool = False):
    """Load the policy to train.

    Returns a PEFT model (``finetune="lora"``) or a plain causal LM whose parameters all require grad
    (``"full"``). Raises ValueError on an unknown ``finetune``/``backend`` or on 4-bit without LoRA and
    Unsloth, RuntimeError for ``load_in_4bit`` on a machine without CUDA, and for an Unsloth that its probe
    finds unusable here (:func:`settle_backend`).
    """
    if finetune not in ("lora", "full") or backend not in BACKENDS:
        raise ValueError(f"finetune must be lora|full and backend one of {'|'.join(BACKENDS)}, got {finetune!r}, "
                         f"{backend!r}")
    if load_in_4bit and (finetune != "lora" or backend == "hf"):
        raise ValueError("--load_in_4bit (QLoRA) needs --finetune lora and --backend unsloth")
    targets = list(target_modules or LORA_TARGETS)
    torch_dtype = resolve_dtype(dtype)
    torch.manual_seed(seed)
    if settle_backend(backend, load_in_4bit) == "unsloth":
        return _load_unsloth(load("unsloth"), model, torch_dtype, finetune, lora_rank, lora_alpha, targets,
                             load_in_4bit, max_seq_length, seed)
    return _load_hf(model, torch_dtype, finetune, lora_rank, lora_alpha, targets)


def settle_backend(backend: str, load_in_4bit: bool = False) -> str:
    """The learner's model code for ``backend``: ``hf`` as is; ``unsloth`` or ``auto`` after a crash-safe probe of
    Unsloth's import chain on this host (:func:`distrl.core.probe.probe`: a child process, cached per environment
    and host; the commands probe before any role starts, so here it is normally the cached answer).

    ``auto`` without 4-bit falls back to ``hf`` with a warning naming why. Raises RuntimeError, with the probe's
    reason, when an explicit ``unsloth`` or 4-bit QLoRA (which needs it) is unusable here: importing it in this
    process could kill it (SIGILL, no except catches that); for 4-bit on a machine without CUDA, whatever the
    probe would say."""
    if backend == "hf":
        return "hf"
    if load_in_4bit and not torch.cuda.is_available():  # before the probe: no GPU is the first thing to fix
        raise RuntimeError("--load_in_4bit needs an NVIDIA GPU (4-bit QLoRA runs bitsandbytes kernels through "
                           "Unsloth); this machine has no CUDA device: drop --load_in_4bit to train LoRA in "
                           "--dtype float32/bfloat16")
    failed = next((p for p in map(probe, backend_stacks(load_in_4bit)) if not p.ok), None)
    if failed is None:
        return "unsloth"
    if backend == "unsloth" or load_in_4bit:
        raise RuntimeError(f"{failed.line()}: use --backend hf (transformers + peft)"
                           + (", without --load_in_4bit" if load_in_4bit else ""))
    log.warning("%s; using --backend hf", failed.line())
    return "hf"


def _load_unsloth(fast, model, torch_dtype, finetune, lora_rank, lora_alpha, targets, load_in_4bit,
                  max_seq_length, seed):
    base, _ = fast.from_pretrained(model, max_seq_length=max_seq_length, dtype=torch_dtype,
                                   load_in_4bit=load_in_4bit, full_finetuning=finetune == "full")
    if finetune == "full":
        for p in base.parameters():
            p.requires_grad_(True)
        return base
    return fast.get_peft_model(base, r=lora_rank, lora_alpha=lora_alpha, target_modules=targets, lora_dropout=0.0,
                               bias="none", use_gradient_checkpointing=False, random_state=seed)


def _load_hf(model, torch_dtype, finetune, lora_rank, lora_alpha, targets):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype, attn_implementation="sdpa")
    if torch.cuda.is_available():  # the current device: cuda:LOCAL_RANK after init_distributed_from_env
        base = base.to(torch.device("cuda", torch.cuda.current_device()))
    if finetune == "full":
        for p in base.parameters():
            p.requires_grad_(True)
        return base
    from peft import LoraConfig, get_peft_model

    return get_peft_model(base, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=targets,
                                           lora_dropout=0.0, bias="none"))


def is_peft(model) -> bool:
    """True for a PEFT-wrapped model (LoRA)."""
    return hasattr(model, "get_base_model") and hasattr(model, "disable_adapter")


def body_and_head(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The transformer body (returns hidden states) and the LM head of a causal LM, PEFT-wrapped or not."""
    base = model.get_base_model() if is_peft(model) else model
    return base.model, base.lm_head


def reference_context(model):
    """Context in which ``model``'s body and head compute the reference policy (LoRA: adapter disabled).

    For a full fine-tuned model there is no such context: use :func:`frozen_reference` instead
    (ValueError here).
    """
    if not is_peft(model):
        raise ValueError("a fully fine-tuned model has no adapter to disable: keep a frozen_reference copy")
    return model.disable_adapter()


def frozen_reference(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A frozen deep copy of a fully fine-tuned model, as (body, head) for the KL reference."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return body_and_head(ref)


def export_final(model, directory: str | Path, model_dir: str, tokenizer: Optional[str] = None,
                 merged: bool = True) -> Path:
    """Write the final policy under ``directory`` (``<run_dir>/final``) and return it.

    - ``adapter/`` (LoRA only): the PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``),
      for ``PeftModel.from_pretrained(base, ...)``.
    - ``merged/`` (when ``merged``, or always with full fine-tuning): the whole model in HF format,
      LoRA merged into the base weights (W + B A alpha/r), plus the tokenizer of ``tokenizer`` or
      ``model_dir``, so ``AutoModelForCausalLM.from_pretrained(merged)`` loads it.

    Merging a LoRA model changes ``model`` in place (``merge_and_unload``): call it last. The files are
    written to ``<directory>.tmp``, then replace ``directory`` (a resumed run's export supersedes the
    earlier one), so ``directory`` holds one complete export.
    """
    import shutil

    from transformers import AutoTokenizer

    final, tmp = Path(directory), Path(f"{directory}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    lora = is_peft(model)
    if lora:
        model.save_pretrained(str(tmp / "adapter"))
    if merged or not lora:
        full = model.merge_and_unload() if lora else model
        full.save_pretrained(str(tmp / "merged"))
        AutoTokenizer.from_pretrained(tokenizer or model_dir).save_pretrained(str(tmp / "merged"))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def compile_layers(model, packed: bool, kl: bool = False, backend: str = "inductor") -> None:
    """``torch.compile`` each decoder layer of ``model`` (dynamic shapes), then compile now every variant of the
    layers' inputs a learner micro-batch can bring, so that no batch recompiles mid-run (--learner_compile; a
    learner step that compiles the layers takes several seconds).

    Dynamic shapes still guard on what changes the traced code: a batch of one row (sizes 0 and 1 are
    specialized); with ``packed`` rows, whether transformers passes the layers a mask (rows of two or more
    sequences) or None (each row one sequence); and the mode: with gradients (training), without (the weight
    check's canary forward) and, for a LoRA model with a KL term (``kl``), without gradients and with the
    adapter disabled (the reference's forward). The warm-up runs a forward (and in training a backward) of
    8 tokens for each: rows 2 and 1 (``packed``: each with one sequence a row and with two, position ids
    restarting, as `distrl.learn.batch.pack` lays them), in each mode. Padded micro-batches run without a mask
    (`Learner._logprobs`), so they bring no more variants. A micro-batch one token wide would still compile once.
    Dynamo's limit of compiled variants per function is raised to 64 (a LoRA model doubles them: layer 0's
    input needs no gradient, the others' do). Gradients are left as None. ``backend``: torch.compile's (tests
    use ``eager``).
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    body, _ = body_and_head(model)
    for layer in body.layers:
        layer.compile(dynamic=True, backend=backend)
    device = next(body.parameters()).device

    @contextlib.contextmanager
    def in_reference():
        with torch.no_grad(), reference_context(model):
            yield

    modes = [contextlib.nullcontext, torch.no_grad] + ([in_reference] if kl and is_peft(model) else [])
    for mode, rows in itertools.product(modes, (2, 1)):
        for split in (False, True) if packed else (False,):  # split: two sequences in each packed row
            ids = torch.zeros(rows, 8, dtype=torch.long, device=device)
            positions = torch.arange(8, device=device).repeat(rows, 1)
            positions[:, 4:] -= 4 * split
            kwargs = {"position_ids": positions} if packed else {}
            with mode():
                hidden = body(input_ids=ids, use_cache=False, **kwargs).last_hidden_state
                if torch.is_grad_enabled():
                    hidden.float().sum().backward()
    for p in body.parameters():
        p.grad = None
