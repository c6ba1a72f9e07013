"""A damaged model file is one error line naming it, exit 2 (issue 40): a GGUF cut short or with a broken header
(transformers' reader raised struct.error, a 24-line traceback), a truncated or damaged safetensors in a --model
directory (a traceback in the role). Also `distrl --version`."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distrl.core.errors import PreflightError
from distrl.core.gguf import resolve_model
from distrl.core.hub import check_model
from distrl.core.tiny import build_tiny_model
from tests.helpers import smollm2_gguf

ROOT = Path(__file__).resolve().parents[2]


def distrl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distrl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_package_version(flag):
    done = distrl(flag)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"distrl {importlib.metadata.version('distrl')}\n", "")


@pytest.fixture(scope="module")
def gguf_bytes() -> bytes:
    return smollm2_gguf().read_bytes()


@pytest.mark.parametrize("size,reason", [
    (8, "its header runs past the end of the file at 8 bytes: truncated or damaged"),
    (1000, "its header runs past the end of the file at 1,000 bytes: truncated or damaged"),
    (1_000_000, "its header runs past the end of the file at 1,000,000 bytes: truncated or damaged"),
    (3_000_000, "cannot reshape array of size 1214336 into shape (49152,612)"),  # the header whole, data cut
    (0, "cannot mmap an empty file"),
])
def test_a_truncated_gguf_is_one_line_naming_it(tmp_path, monkeypatch, gguf_bytes, size, reason):
    monkeypatch.setenv("DISTRL_GGUF_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_bytes[:size])
    with pytest.raises(PreflightError) as info:
        resolve_model(str(path))
    assert info.value.flag == "--model"
    assert info.value.problem == f"{path}: transformers cannot load this GGUF file ({reason})"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # no half-written model directory


def test_a_gguf_with_a_broken_header_is_one_line_naming_it(tmp_path, monkeypatch, gguf_bytes):
    monkeypatch.setenv("DISTRL_GGUF_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    broken = bytearray(gguf_bytes[:2_000_000])
    broken[24:32] = (2**62).to_bytes(8, "little")  # the first metadata key's length: far past the end
    path.write_bytes(bytes(broken))
    with pytest.raises(PreflightError) as info:
        resolve_model(str(path))
    assert info.value.problem == f"{path}: transformers cannot load this GGUF file ('utf-8' codec can't decode " \
                                 "byte 0xc3 in position 694: invalid continuation byte)"  # the key read as text


def test_the_cli_says_it_in_one_line_with_exit_2(tmp_path, gguf_bytes):
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_bytes[:1000])
    done = distrl("eval", "--model", str(path), "--limit", "1", env={"DISTRL_GGUF_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[1:] == [
        f"distrl eval: error: --model: {path}: transformers cannot load this GGUF file (its header runs past the "
        "end of the file at 1,000 bytes: truncated or damaged)",
        "  fix: give a complete GGUF of an architecture transformers supports (with the gguf package installed: "
        "pip install gguf), or a model directory"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.mark.parametrize("damage,reason", [
    (lambda data: data[: len(data) // 2], "incomplete metadata, file not fully covered"),
    (lambda data: data[:4], "header too small"),
    (lambda data: data[:8] + b"[" + data[9:], "invalid JSON in header: invalid type: sequence"),
])
def test_a_damaged_safetensors_in_a_model_directory_is_named(tmp_path, tiny_dir, damage, reason):
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    check_model(str(model))  # whole: passes
    weights = model / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(PreflightError) as info:
        check_model(str(model))
    assert info.value.flag == "--model" and info.value.problem.startswith(f"{weights}: damaged safetensors file (")
    assert reason in info.value.problem
    done = distrl("eval", "--model", str(model), "--limit", "1")
    assert done.returncode == 2 and done.stderr.startswith(f"distrl eval: error: --model: {weights}: damaged "
                                                           "safetensors file ("), done.stderr
    assert len(done.stderr.splitlines()) == 2  # the error and its fix
