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


# Files whose tests share one session-scoped end-to-end run (tests/integration/conftest.py's warm_started_run):
# under pytest-xdist they go to one worker, so the run is made once.
SHARED_RUNS = {"test_demo.py": "warm_started_run", "test_replay.py": "warm_started_run"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """`make test` runs `pytest -n 2 --dist loadgroup` (pytest-xdist): every test goes to the worker of its
    group, one group per file (so a module-scoped run, e.g. test_users_run.py's, is made once, and a file's
    tests that use one fixed port run one after another), files in SHARED_RUNS grouped by the run they share.
    Without xdist the marks do nothing."""
    for item in items:
        if not any(item.iter_markers("xdist_group")):
            name = item.path.name
            item.add_marker(pytest.mark.xdist_group(SHARED_RUNS.get(name, str(item.path.relative_to(config.rootpath)))))
