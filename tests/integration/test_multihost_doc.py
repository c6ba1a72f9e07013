"""docs/multihost.md runs as written: its key script, `common.yaml` and the three launcher commands,
each a plain process on this machine, with the doc's host address replaced by loopback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distrl.buffer.segments import read_segments

ROOT = Path(__file__).resolve().parents[2]
HOST_A = "10.0.0.1"


def doc_blocks() -> dict[str, list[str]]:
    """The fenced blocks of docs/multihost.md by language, the doc's address swapped for loopback."""
    text = (ROOT / "docs" / "multihost.md").read_text().replace(HOST_A, "127.0.0.1")
    blocks: dict[str, list[str]] = {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S):
        blocks.setdefault(lang, []).append(body)
    return blocks


@pytest.mark.slow
def test_multihost_doc_commands_run_verbatim(tmp_path):
    blocks = doc_blocks()
    keys, buffer_cmd, learn_cmd, rollout_cmd, kill_cmd = blocks["bash"][:5]
    assert buffer_cmd.startswith("distrl buffer") and learn_cmd.startswith("distrl learn")
    assert rollout_cmd.startswith("distrl rollout") and kill_cmd.startswith("kill")
    (tmp_path / "common.yaml").write_text(blocks["yaml"][0])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    procs: list[subprocess.Popen] = []

    def start(cmd: str, name: str) -> subprocess.Popen:
        procs.append(subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=tmp_path, env=env,
                                      stdout=open(tmp_path / f"{name}.out", "w"), stderr=subprocess.STDOUT))
        return procs[-1]

    subprocess.run(["bash", "-c", keys], cwd=tmp_path, env=env, check=True)
    buffer = start(buffer_cmd, "buffer")
    try:
        while not (tmp_path / "runs" / "job1" / "buffer.json").exists():  # the buffer is bound
            assert buffer.poll() is None, (tmp_path / "buffer.out").read_text()
            time.sleep(0.2)
        learn = start(learn_cmd, "learn")
        while not (tmp_path / "runs" / "job1" / "model" / "config.json").exists():  # the learner built the model
            assert learn.poll() is None, (tmp_path / "learn.out").read_text()
            time.sleep(0.2)
        rollout = start(rollout_cmd, "rollout")
        assert rollout.wait(timeout=600) == 0, (tmp_path / "rollout.out").read_text()[-3000:]
        assert learn.wait(timeout=120) == 0, (tmp_path / "learn.out").read_text()[-3000:]
        subprocess.run(["bash", "-c", kill_cmd], cwd=tmp_path, env=env, check=True)
        assert buffer.wait(timeout=60) == 0
    finally:
        for proc in procs:  # only what this test started, by handle
            if proc.poll() is None:
                proc.kill()
    run_dir = tmp_path / "runs" / "job1"
    assert "version 5" in (tmp_path / "learn.out").read_text()
    assert "last policy version 5" in (tmp_path / "rollout.out").read_text()
    # the shared file: each role left out the other roles' keys, on one line (docs/multihost.md, section 2)
    ignored = "ignoring 2 keys that other commands take: max_staleness, max_steps"
    assert ignored in (tmp_path / "rollout.out").read_text()
    table = read_segments(run_dir)
    assert set(table.column("actor_id").to_pylist()) == {0} and table.num_rows > 0
    assert json.loads((run_dir / "buffer.json").read_text())["config"]["curve_secret_key"].endswith("key_secret")
