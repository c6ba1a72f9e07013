"""Acceptance (issue 16, item 7): `distrl train` on a terminal shows the live view alone.

Each test runs `distrl train` (tiny model, HF engine, a few versions) on a pseudo-terminal of 140 x 40
and reads every byte it wrote there (all redraws, not one screen):

* a run that ends: no role INFO line or library warning ever reached the terminal, while the role
  log files hold the INFO lines; the live view and the report are there;
* a role that raises while it runs (a `--reward` that fails on real completions): its error message,
  the last lines of its traceback and its log file on the terminal, no Ray dump, exit 1; the log file
  holds the whole traceback.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

from tests.integration.test_train import ENV, ROOT

FLAGS = ["--model", "tiny", "--task", "arith", "--engine", "hf", "--backend", "hf", "--finetune", "full",
         "--torch_threads", "1", "--batch_size", "4", "--group_size", "4", "--max_new_tokens", "5"]
ROLE_NOISE = ["switched from policy version", "GET waits", "Detected no triton", "Failed to load", "_pytree",
              " INFO ", "(RolloutRole pid=", "(LearnerRole pid=", "(BufferRole pid=", "(raylet)"]


def on_terminal(args: list[str], timeout_s: float = 600) -> tuple[int, str]:
    """Run `distrl` with stdin, stdout and stderr on a new 140 x 40 pseudo-terminal; (exit code, all output)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    env = {**ENV, "TERM": "xterm-256color", "COLUMNS": "140", "LINES": "40"}
    proc = subprocess.Popen([sys.executable, "-m", "distrl", *args], cwd=ROOT, env=env, stdin=follower,
                            stdout=follower, stderr=follower, start_new_session=True)
    os.close(follower)
    chunks = []
    try:
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = proc.wait(timeout=timeout_s)
    finally:
        os.close(leader)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    text = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    return code, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)  # colours and cursor moves


def test_live_view_stands_alone_and_role_logs_hold_the_info_lines(tmp_path):
    code, out = on_terminal(["train", *FLAGS, "--max_steps", "6", "--run_name", "tty", "--log_dir", str(tmp_path)])
    assert code == 0, out[-4000:]
    for noise in ROLE_NOISE:
        assert noise not in out, (noise, out[-4000:])
    assert "staleness mean/max" in out and "distrl run report" in out  # the live view, then the report
    assert f"role logs:   {tmp_path / 'tty'}/logs/<role>.log" in out  # a start-up line
    logs = tmp_path / "tty" / "logs"
    assert "switched from policy version" in (logs / "actor0.log").read_text()
    assert "learner0: version 6 " in (logs / "learner0.log").read_text()
    assert "buffer serving at" in (logs / "buffer0.log").read_text()


def test_role_that_raises_shows_its_error_and_log_file(tmp_path):
    reward = tmp_path / "fails.py"  # passes the actor's start-up check (an empty completion), then raises
    reward.write_text("def score(text, problem):\n    if text:\n        raise RuntimeError('reward failed on purpose')"
                      "\n    return 0.0\n")
    run_dir = tmp_path / "fails"
    code, out = on_terminal(["train", *FLAGS, "--max_steps", "50", "--reward", f"{reward}:score",
                             "--max_actor_restarts", "0", "--run_name", run_dir.name, "--log_dir", str(tmp_path)])
    assert code == 1, out[-4000:]
    error = out[out.index("distrl train: error: "):].strip().splitlines()
    assert error[0].startswith("distrl train: error: actor0 failed: ") and "reward failed on purpose" in error[0]
    assert error[-1] == f"  see {run_dir}/logs/actor0.log" and len(error) <= 12, error
    assert any(line.startswith("    File ") for line in error)  # the innermost frames
    assert "Traceback" not in out and "RayTaskError" not in out and "(raylet)" not in out, out[-4000:]
    actor_log = (run_dir / "logs" / "actor0.log").read_text()
    assert "actor0 failed (its error, as Ray gave it to the driver)" in actor_log
    assert "reward failed on purpose" in actor_log and "distrl/rollout/actor.py" in actor_log  # every frame
