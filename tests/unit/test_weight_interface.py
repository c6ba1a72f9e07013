"""One weight interface (issue 18): the roles and commands never branch on a transport's name; they ask
distrl.weights' registry, whose transports match the --weights_transport choices."""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from distrl.core.run_options import SharedOptions
from distrl.weights import TRANSPORTS, transport

ROOT = Path(__file__).resolve().parents[2]
SEARCHED = ["distrl/rollout", "distrl/learn", "distrl/buffer", "distrl/cmd"]  # all that uses weights but distrl/weights
NAME = r"""["'](?:fs|zmq|nccl)["']"""
BRANCHES = {
    "startswith nccl": re.compile(r"""startswith\(\s*["']nccl"""),
    "an nccl:// location": re.compile(r"""["']nccl://"""),
    "weights_transport compared": re.compile(r"weights_transport\s*(?:==|!=|\bin\b|\bnot\s+in\b)"),
    "a transport name compared": re.compile(rf"(?:==|!=)\s*{NAME}|{NAME}\s*(?:==|!=|\bin\b|\bnot\s+in\b)"),
    "a transport backend imported": re.compile(r"distrl\.weights\.(?:fs|zmq|nccl)\b"),
}
# `dist.get_backend() == "nccl"` (distrl/learn/distributed.py) names torch's process-group backend of the
# learners' gradient all-reduce, not a weight transport.
NOT_A_TRANSPORT = re.compile(r"get_backend\(\)")


def branches(text: str) -> list[tuple[int, str, str]]:
    """(line number, rule, line) of each transport-name branch in a module's source."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]  # a comment may name a transport
        for rule, pattern in BRANCHES.items():
            if pattern.search(code) and not NOT_A_TRANSPORT.search(code):
                found.append((number, rule, line.strip()))
    return found


def test_no_transport_name_branch_outside_distrl_weights():
    found = {f"{path.relative_to(ROOT)}:{n}": (rule, line) for top in SEARCHED
             for path in sorted((ROOT / top).rglob("*.py")) for n, rule, line in branches(path.read_text())}
    assert not found, f"ask distrl.weights.transport(name) or the Loader/Publisher instead: {found}"


@pytest.mark.parametrize("line", [
    'if ann.location.startswith("nccl://"):',
    'if cfg.weights_transport == "nccl":',
    "if self.cfg.weights_transport in ('fs', 'zmq'):",
    'elif kind != "zmq":',
    'if "nccl" in names:',
    "from distrl.weights.nccl import BroadcastReceiver",
])
def test_the_grep_finds_each_kind_of_branch(line):
    assert branches(line), line


def test_the_grep_passes_comments_and_the_gradient_backend():
    assert not branches('    if dist.get_backend() == "nccl":  # the learners\' all-reduce')
    assert not branches("    x = 1  # with --weights_transport nccl the round waits")


def literals(hint) -> set:
    """The string values a Literal (or Optional Literal) type hint allows."""
    args = typing.get_args(hint)
    return {a for a in args if isinstance(a, str)} | {v for t in args for v in literals(t)}


def test_registry_matches_the_option_and_says_what_each_needs():
    assert literals(typing.get_type_hints(SharedOptions)["weights_transport"]) == set(TRANSPORTS)
    assert transport("fs").needs_shared_filesystem and not transport("zmq").needs_shared_filesystem
    nccl = transport("nccl")
    assert nccl.full_weights_only and nccl.needs_actors and nccl.needs_broadcast_port
    assert not any(transport(n).full_weights_only or transport(n).needs_actors for n in ("fs", "zmq"))
    shm = transport("shm")
    assert shm.full_weights_only and shm.same_host_only and not shm.needs_actors
    assert not any(transport(n).same_host_only for n in ("fs", "zmq", "nccl"))
    assert transport(None) is transport("fs")  # an unset --weights_transport
    with pytest.raises(ValueError, match="unknown weights transport 'ftp'"):
        transport("ftp")


def test_config_checks_ask_the_transport():
    from distrl.cmd.config import TrainConfig

    with pytest.raises(ValueError, match="--weights_transport nccl carries full weights: it needs --finetune full"):
        TrainConfig(weights_transport="nccl", finetune="lora")
    with pytest.raises(ValueError, match="--weights_transport nccl needs at least one actor"):
        TrainConfig(weights_transport="nccl", finetune="full", number_of_actors=0, learner_generates=True)
    TrainConfig(weights_transport="zmq", finetune="lora", number_of_actors=0, learner_generates=True)


def test_the_registry_imports_no_zmq_arrow_or_torch():
    code = ("import sys\nfrom distrl.weights import transport\nassert transport('nccl').full_weights_only\n"
            "heavy = [m for m in ('zmq', 'pyarrow', 'torch') if m in sys.modules]\nassert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
