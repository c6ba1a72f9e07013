"""Fixtures shared by the test tiers: built once per pytest session (each build takes seconds of CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import shared_data


@pytest.fixture(scope="session")
def qwen_tiny(tmp_path_factory) -> Path:
    """A tiny random Qwen2 (head size 32, seed 0) with the real Qwen2.5 tokenizer (151,669 tokens).

    Session-scoped: tests read it (or copy it into their run directory) and never write into it."""
    from distrl.core.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "qwen-tiny", seed=0,
                            tokenizer=shared_data() / "tokenizers" / "qwen2.5")

