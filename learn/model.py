"""Policy loading for the learner: Unsloth's FastLanguageModel + LoRA, transformers+peft otherwise.

Unsloth is used when it imports (on a machine without a GPU it runs its CPU fallback, which is
transformers+peft underneath). The LoRA targets every linear projection of the attention and MLP
blocks, so vLLM can serve the saved adapter as a `LoRARequest`.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("distrl.learner")

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def resolve_dtype(name: str) -> torch.dtype:
    """`auto` is float32 on CPU and bfloat16 on GPU."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, name)


def load_policy(model: str, dtype: str, lora_rank: int, lora_alpha: int, max_seq_length: int, seed: int):
    """Return a PEFT model with a fresh LoRA adapter (B = 0, so version 0 equals the base model)."""
    torch_dtype = resolve_dtype(dtype)
    try:
        from unsloth import FastLanguageModel
    except ImportError as exc:  # Unsloth missing: the same model through transformers + peft
        log.warning("unsloth unavailable (%s): loading with transformers + peft", exc)
        return _load_peft(model, torch_dtype, lora_rank, lora_alpha, seed)
    base, _ = FastLanguageModel.from_pretrained(model, max_seq_length=max_seq_length, dtype=torch_dtype,
                                                load_in_4bit=False)
    return FastLanguageModel.get_peft_model(base, r=lora_rank, lora_alpha=lora_alpha, target_modules=LORA_TARGETS,
                                            lora_dropout=0.0, bias="none", use_gradient_checkpointing=False,
                                            random_state=seed)


def _load_peft(model: str, torch_dtype: torch.dtype, lora_rank: int, lora_alpha: int, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    return get_peft_model(base, LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=LORA_TARGETS,
                                           lora_dropout=0.0, bias="none"))


def body_and_head(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The transformer body (returns hidden states) and the LM head of a PEFT-wrapped causal LM."""
    base = model.get_base_model()
    return base.model, base.lm_head
