"""The embedded default model (`--model tiny`): a tiny Qwen2 with a character tokenizer, built in code.

No download: the tokenizer is a character-level `tokenizers` model over the characters that the
built-in `arith` task and the `calculator` environment's calls use (52 tokens), and the model is a Qwen2
architecture with random weights (hidden 128, 4 heads of size 32 — vLLM on CPU needs a head size of at least
32 — 2 layers). Both are saved with `save_pretrained`, so vLLM, transformers and Unsloth load the directory
like any hub model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

# Special tokens first; then the characters of arithmetic prompts and answers, and a few letters; last `<` and `>`
# (ids 50 and 51), so that the model can write the `calculator` environment's `<calc>EXPR</calc>` calls.
SPECIALS = ["<pad>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*/=() .,?abcdefghijklmnopqrstuvwxyz<>")
TINY_ARCH = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096)  # GSM8K/MATH-500 prompts fit


def _core_tokenizer():
    """The character-level `tokenizers.Tokenizer`: a byte-level BPE without merges (space is the byte-level symbol
    `Ġ`), because transformers 5 loads any `qwen2` model's tokenizer as a byte-level BPE from its vocabulary: built
    this way, the tokenizer encodes the same in vLLM, transformers and Unsloth. No post-processor: no token is
    added to an encoded text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = [c if c != " " else "\u0120" for c in CHARS]  # 'Ġ' is the byte-level form of a space
    vocab = {tok: i for i, tok in enumerate(SPECIALS + symbols)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return core


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast`: one token per character, eos `<eos>`, pad `<pad>`."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_core_tokenizer(), eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=TINY_ARCH["max_position_embeddings"])


def prompt_encoder():
    """The tiny tokenizer as a prompt-length check uses one (:class:`distrl.core.prompt_encoder.PromptEncoder`,
    no transformers import): the same ids as :func:`build_tokenizer`'s, and no chat template."""
    from distrl.core.prompt_encoder import PromptEncoder

    return PromptEncoder(_core_tokenizer())


def build_tiny_model(directory: str | Path, seed: int = 0, tokenizer: str | Path | None = None) -> Path:
    """Write the tiny model and its tokenizer to `directory` (idempotent: an existing build is reused).

    Args:
        directory: where to save (config.json, model.safetensors, tokenizer files).
        seed: the random weights depend only on it (and on the vocabulary size).
        tokenizer: a tokenizer directory or hub id to use instead of the character tokenizer, e.g.
            the Qwen2.5 tokenizer: the model's vocabulary then has its size (151,669 for Qwen2.5).
    Returns the directory.
    """
    directory = Path(directory)
    if _built(directory):
        return directory
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    tokenizer = build_tokenizer() if tokenizer is None else AutoTokenizer.from_pretrained(str(tokenizer))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = Qwen2Config(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
                         torch_dtype="float32", **TINY_ARCH)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "distrl_tiny.json").write_text(json.dumps({"seed": seed, **TINY_ARCH}))
    return _move_into_place(tmp, directory)


def tiny_model(directory: str | Path, seed: int = 0) -> Path:
    """``build_tiny_model(directory, seed)`` with the character tokenizer, copied from distrl's cache.

    The build imports transformers' model classes (about 2 s of CPU); the copy does not. The cached build lives under
    ``<distrl cache>/tiny/`` (distrl.core.probe.cache_dir), keyed by the seed, this file and the torch and
    transformers versions, so a changed architecture, tokenizer or library never reuses an old build; where the
    cache cannot be written the model is built in ``directory`` directly. Returns ``directory``.
    """
    from importlib.metadata import version

    from distrl.core.probe import cache_dir

    directory = Path(directory)
    if _built(directory):
        return directory
    key = hashlib.sha256(Path(__file__).read_bytes())
    key.update(f"{version('torch')} {version('transformers')}".encode())
    try:
        cached = build_tiny_model(cache_dir() / "tiny" / f"seed{seed}-{key.hexdigest()[:16]}", seed=seed)
    except OSError:
        return build_tiny_model(directory, seed=seed)
    tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    shutil.copytree(cached, tmp)
    return _move_into_place(tmp, directory)


def _built(directory: Path) -> bool:
    return (directory / "config.json").exists() and (directory / "tokenizer.json").exists()


def _move_into_place(tmp: Path, directory: Path) -> Path:
    """Rename the finished `tmp` to `directory`; where another process put one there first, keep theirs."""
    try:
        tmp.rename(directory)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def main(argv: list[str] | None = None) -> None:
    """`python -m distrl.core.tiny OUT [--tokenizer DIR] [--seed N]`: save a tiny random Qwen2 model."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m distrl.core.tiny", description=main.__doc__)
    parser.add_argument("out", help="directory to write")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the character tokenizer)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out, args.seed, args.tokenizer))


if __name__ == "__main__":
    main()
