"""distrl.core.gguf without a GGUF: which --model values it touches, and the eos/pad it picks from a chat template.

The Qwen2.5 tokenizer (../shared/data) has SmolLM2's chat markup (``<|im_start|>`` ... ``<|im_end|>``); setting
its eos to ``<|im_start|>`` reproduces what SmolLM2's GGUF metadata says. The dequantization itself is
tests/integration/test_real_model.py.
"""

from __future__ import annotations

import pytest

from distrl.core.gguf import cache_root, gguf_file, pad_token, resolve_model, turn_end_token
from tests.helpers import shared_data


def test_only_gguf_files_are_resolved(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert gguf_file(str(tmp_path / "m.gguf")) == (tmp_path / "m.gguf").resolve()
    assert gguf_file(str(tmp_path)) == (tmp_path / "m.gguf").resolve()  # a directory holding one GGUF
    (tmp_path / "config.json").write_text("{}")
    assert gguf_file(str(tmp_path)) is None  # a model directory stays one
    for value in ("tiny", "Qwen/Qwen2.5-0.5B-Instruct", str(tmp_path / "missing.gguf")):
        assert gguf_file(value) is None and resolve_model(value) == value  # preflight reports what is wrong


def test_cache_root_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DISTRL_GGUF_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("DISTRL_GGUF_CACHE")
    assert cache_root().parts[-3:] == (".cache", "distrl", "gguf")


@pytest.fixture(scope="module")
def chatml():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(shared_data() / "tokenizers" / "qwen2.5")
    tokenizer.eos_token = tokenizer.bos_token = "<|im_start|>"  # as SmolLM2's GGUF says
    tokenizer.pad_token = None  # which has none
    return tokenizer


def test_eos_is_the_turn_end_of_the_chat_template(chatml):
    assert turn_end_token(chatml) == "<|im_end|>"


def test_pad_is_neither_eos_nor_bos(chatml):
    assert pad_token(chatml, "<|im_end|>") == "<|endoftext|>"
    chatml.pad_token = "<|im_start|>"  # the bos: not a pad either
    assert pad_token(chatml, "<|im_end|>") == "<|endoftext|>"
