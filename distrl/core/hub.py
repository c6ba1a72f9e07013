"""Where a model or tokenizer comes from, checked without loading or downloading it (preflight).

`--model` and `--tokenizer` take a local directory or a Hugging Face hub id. A value that looks like a
path (it starts with ``/``, ``./``, ``../`` or ``~``, has more than one ``/``, or exists) is a local
directory and must exist and hold what transformers needs; anything else is a hub id, checked only
for its form, and, when ``HF_HUB_OFFLINE=1`` (nothing can be downloaded), for being in the local cache.
``tiny`` (the embedded model, `distrl.core.tiny`) always passes. Every failure is a
:class:`distrl.core.errors.PreflightError` naming the flag; the role preflights (`distrl/rollout/preflight.py`,
`distrl/learn/preflight.py`) call these.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from distrl.core.errors import PreflightError

HUB_EXAMPLE = "Qwen/Qwen2.5-0.5B-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def looks_like_path(value: str) -> bool:
    """Whether ``value`` names a local path rather than a hub id (``owner/name`` has one ``/`` at most)."""
    return value.startswith(("/", "./", "../", "~")) or value.count("/") > 1 or Path(value).expanduser().exists()


def offline() -> bool:
    """Whether the hub may not be asked (``HF_HUB_OFFLINE`` set to 1/true/yes/on)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _valid_hub_id(value: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def _cached(repo_id: str, filenames: tuple[str, ...]) -> bool:
    """Whether any of ``filenames`` of hub repo ``repo_id`` is in the local cache (never downloads)."""
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in filenames)


def _check_model_config(path: Path) -> None:
    """``path`` (a model's config.json) holds one JSON object, as transformers reads it; else PreflightError."""
    try:
        ok = isinstance(json.loads(path.read_text()), dict)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise PreflightError("--model", f"{path}: not a JSON object ({exc})",
                             "restore the file save_pretrained wrote (or re-download the model)") from None
    if not ok:
        raise PreflightError("--model", f"{path}: not a JSON object",
                             "restore the file save_pretrained wrote (or re-download the model)")


def _check_weight_files(directory: Path) -> None:
    """Each ``*.safetensors`` of ``directory`` has a whole header that covers the file (safetensors reads only the
    header); a truncated or damaged one raises PreflightError naming it (a traceback in the role before)."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(path), "np"):
                pass
        except (SafetensorError, OSError) as exc:
            reason = str(exc).removeprefix("Error while deserializing header: ")
            raise PreflightError("--model", f"{path}: damaged safetensors file ({reason})",
                                 "download the model again, or restore the file save_pretrained wrote") from None


def check_model(value: str) -> None:
    """`--model`: ``tiny``; a directory with ``config.json`` or a ``.gguf`` file (or a ``.gguf`` file
    itself); or a hub id (in the local cache when offline). Raises PreflightError naming --model."""
    if value == "tiny":
        return
    if looks_like_path(value):
        path = Path(value).expanduser()
        if not path.exists():
            raise PreflightError("--model", f"{value}: no such directory",
                                 f"give an existing model directory (with config.json), a hub id such as "
                                 f"{HUB_EXAMPLE}, or tiny")
        if path.is_file() and path.suffix != ".gguf":
            raise PreflightError("--model", f"{value}: a file, not a model directory",
                                 "give the directory that holds config.json and the weights (or a .gguf file)")
        if path.is_dir() and not (path / "config.json").is_file() and not any(path.glob("*.gguf")):
            raise PreflightError("--model", f"{value}: no config.json (or .gguf) in this directory",
                                 "give the directory that save_pretrained wrote (config.json + weights)")
        if path.is_dir() and (path / "config.json").is_file():
            _check_model_config(path / "config.json")
            _check_weight_files(path)
        return
    if not _valid_hub_id(value):
        raise PreflightError("--model", f"{value}: neither a local directory nor a hub id",
                             f"give an existing directory (./path or /path) or a hub id such as {HUB_EXAMPLE}")
    if offline() and not _cached(value, ("config.json",)):
        raise PreflightError("--model", f"{value}: not in the local hub cache, and HF_HUB_OFFLINE=1",
                             "download it once where the network is reachable, unset HF_HUB_OFFLINE, or give a "
                             "local directory")


def check_tokenizer(value: str | None) -> None:
    """`--tokenizer` (None: the model's own, nothing to check): a directory with tokenizer files or a hub id
    (in the local cache when offline). Raises PreflightError naming --tokenizer."""
    if value is None:
        return
    if looks_like_path(value):
        path = Path(value).expanduser()
        if not path.is_dir():
            raise PreflightError("--tokenizer", f"{value}: no such directory",
                                 "give an existing tokenizer directory, a hub id, or leave --tokenizer unset "
                                 "(the model's own)")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise PreflightError("--tokenizer", f"{value}: no tokenizer files in this directory",
                                 f"give a directory with one of {', '.join(TOKENIZER_FILES)} (save_pretrained "
                                 "of a tokenizer writes them)")
        return
    if not _valid_hub_id(value):
        raise PreflightError("--tokenizer", f"{value}: neither a local directory nor a hub id",
                             "give an existing directory (./path or /path) or a hub id")
    if offline() and not _cached(value, TOKENIZER_FILES):
        raise PreflightError("--tokenizer", f"{value}: not in the local hub cache, and HF_HUB_OFFLINE=1",
                             "download it once where the network is reachable, unset HF_HUB_OFFLINE, or give a "
                             "local directory")


def model_vocab_size(model: str) -> int | None:
    """The model's embedding rows (config ``vocab_size``) read from local files only; None when that
    needs the network or the model has no config.json (a GGUF)."""
    if model == "tiny":
        from distrl.core.tiny import CHARS, SPECIALS

        return len(SPECIALS) + len(CHARS)
    from transformers import AutoConfig

    try:
        return getattr(AutoConfig.from_pretrained(model, local_files_only=True), "vocab_size", None)
    except (OSError, ValueError):
        return None


def check_vocab_fits(model: str, tokenizer: str | None) -> None:
    """`--tokenizer` given: its vocabulary (``len(tokenizer)``, added tokens included) must not be larger
    than the model's ``vocab_size``, else its ids index past the embeddings. Checked from local files
    only (skipped when either would need a download). Raises PreflightError naming --tokenizer."""
    if tokenizer is None:
        return
    vocab = model_vocab_size(model)
    if vocab is None:
        return
    from transformers import AutoTokenizer

    try:
        size = len(AutoTokenizer.from_pretrained(tokenizer, local_files_only=True))
    except (OSError, ValueError):
        return
    if size > vocab:
        raise PreflightError("--tokenizer", f"{tokenizer} has {size} tokens but the model embeds only {vocab}",
                             "leave --tokenizer unset (the model's own) or give the tokenizer the model was "
                             "trained with")
