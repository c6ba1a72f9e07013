"""One buffer per run directory (issue 41): while `distrl buffer` serves a run directory it holds an OS lock
(``buffer.lock``, distrl.buffer.lock); a second `distrl buffer --resume DIR` and a `distrl train --resume DIR`
exit 2 with one error line naming the holder's pid and host, before binding (or before Ray starts). The
lock dies with its process, SIGKILL included: a resume after a crash is not blocked."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
SHAPE = ["--batch_size", "2", "--group_size", "2", "--max_staleness", "1", "--prefault_bytes", "0"]


def start_buffer(*where: str) -> subprocess.Popen:
    """`python -m distrl buffer` on a free loopback port; returns once it says it is serving."""
    proc = subprocess.Popen([sys.executable, "-m", "distrl", "buffer", "--address", "tcp://127.0.0.1:0", *where,
                             *SHAPE], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    while not lines or "distrl buffer: serving at" not in lines[-1]:
        lines.append(proc.stdout.readline())
        assert lines[-1], "buffer exited before serving:\n" + "".join(lines)
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining its log
    return proc


def distrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distrl", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "error" in line]


def test_second_buffer_and_train_resume_are_refused_while_a_buffer_serves(tmp_path):
    run_dir = tmp_path / "run"
    first = start_buffer("--run_dir", str(run_dir))
    holder = f"pid {first.pid} on host {socket.gethostname()}"
    try:
        second = distrl("buffer", "--address", "tcp://127.0.0.1:0", "--resume", str(run_dir), *SHAPE)
        assert second.returncode == 2, second.stdout + second.stderr
        errors = error_lines(second)
        assert len(errors) == 1 and holder in errors[0] and "--resume" in errors[0], second.stderr
        assert "Traceback" not in second.stderr and "serving at" not in second.stdout

        train = distrl("train", "--resume", str(run_dir), "--max_steps", "2")
        assert train.returncode == 2, train.stdout + train.stderr
        errors = error_lines(train)
        assert len(errors) == 1 and holder in errors[0] and "distrl train: error: --resume" in errors[0], train.stderr
        assert "Traceback" not in train.stderr and "ray" not in train.stderr.lower()  # refused before Ray started
        assert not (run_dir / "logs" / "driver.log").exists()
        assert first.poll() is None  # the holder serves on, untouched
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0


def test_the_lock_dies_with_its_process(tmp_path):
    """A buffer SIGKILLed leaves buffer.lock behind, unheld: `--resume` serves at once."""
    run_dir = tmp_path / "run"
    first = start_buffer("--run_dir", str(run_dir))
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    assert (run_dir / "buffer.lock").is_file()
    again = start_buffer("--resume", str(run_dir))
    try:
        refused = distrl("buffer", "--address", "tcp://127.0.0.1:0", "--resume", str(run_dir), *SHAPE)
        assert refused.returncode == 2 and f"pid {again.pid} on host" in refused.stderr, refused.stderr
    finally:
        again.send_signal(signal.SIGTERM)
        assert again.wait(timeout=60) == 0
