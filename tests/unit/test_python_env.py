"""The ``python`` environment's sandbox (issue 44, acceptance 3), with real subprocesses and no mocks: a write
outside its temp dir, a fork bomb, reading another process's files and connecting to a loopback port are each
refused or killed; normal output comes back; a loop, a CPU hog and a memory hog are stopped; the environment
plays an episode through the env worker pool; and ``--env python`` is refused (exit 2) where the sandbox does not
work. Tests run as root here, so the sandbox must be available: on Linux as root the probe is asserted, not
skipped."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from distrl.rollout.envs import sandbox
from distrl.rollout.envs.sandbox import Limits, run

REPO = Path(__file__).resolve().parents[2]
FAST = Limits(wall_s=30.0, cpu_s=10)  # programs that end on their own: room for a loaded machine
AS_ROOT_ON_LINUX = sys.platform.startswith("linux") and os.geteuid() == 0


@pytest.fixture(autouse=True, scope="module")
def sandbox_works():
    reason = sandbox.probe()
    if AS_ROOT_ON_LINUX:  # the machine the tests run on: the sandbox must work, never be skipped away
        assert reason is None, reason
    elif reason is not None:
        pytest.skip(f"the sandbox is unavailable here: {reason}")


def processes_of(uid: int) -> list[int]:
    """Host pids whose real uid is ``uid``."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uids = next(line for line in status.read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration):  # the process ended meanwhile
            continue
        if int(uids.split()[1]) == uid:
            pids.append(int(status.parent.name))
    return pids


def test_normal_code_prints_its_output_which_comes_back():
    result = run("import math\nprint(sum(i * i for i in range(10)), math.factorial(5))", FAST)
    assert result.status == "ok" and result.stdout == "285 120\n" and not result.truncated
    result = run("print('x' * 100_000)", Limits(wall_s=30.0, output_bytes=1000))
    assert result.status == "ok" and result.stdout == "x" * 1000 and result.truncated
    failed = run("1 / 0", FAST)
    assert failed.status == "error" and failed.stderr.strip().endswith("ZeroDivisionError: division by zero")


def test_the_program_runs_as_an_unprivileged_uid_with_no_host_environment(monkeypatch):
    monkeypatch.setenv("DISTRL_SECRET_TOKEN", "hunter2")
    result = run("import os\nprint(os.getuid(), os.getgid(), os.getgroups(), sorted(os.environ))", FAST)
    uid, gid, groups, names = result.stdout.split(" ", 3)
    assert int(uid) == int(gid) == result.uid and result.uid >= sandbox.UID_BASE and groups == "[]"
    assert "DISTRL_SECRET_TOKEN" not in names and "hunter2" not in result.stdout


def test_a_write_outside_its_temp_dir_is_refused_and_leaves_no_file(tmp_path):
    name = f"distrl-sandbox-{uuid.uuid4().hex}"
    targets = [REPO / name, tmp_path / name, Path("/dev/shm") / name, Path("/var/tmp") / name, Path("/") / name]
    code = "\n".join(["import sys", "for path in sys.argv[1:] or %r:" % [str(t) for t in targets],
                      "    try:", "        open(path, 'w').write('x')", "        print('WROTE', path)",
                      "    except OSError as exc:", "        print('REFUSED', path, type(exc).__name__)",
                      "open('/tmp/%s', 'w').write('inside')" % name, "print('TMP', open('/tmp/%s').read())" % name])
    result = run(code, FAST)
    assert result.status == "ok", result.stderr
    assert "WROTE" not in result.stdout and result.stdout.count("REFUSED") == len(targets)
    assert "TMP inside" in result.stdout  # its own /tmp is writable ...
    for target in [*targets, Path("/tmp") / name]:  # ... and private: nothing reached the host
        assert not target.exists(), target


def test_a_fork_bomb_is_limited_and_killed_and_the_host_is_unaffected():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    started = time.monotonic()
    result = run(bomb, Limits(wall_s=2.0, cpu_s=2, processes=16))
    took = time.monotonic() - started
    assert result.status in ("timeout", "killed") and took < 2.0 + 8.0
    assert processes_of(result.uid) == []  # every process of the bomb is gone
    assert subprocess.run(["true"]).returncode == 0  # the host still forks
    plain = run("import os\nwhile True:\n    os.fork()\n", Limits(wall_s=10.0, processes=16))
    assert plain.status in ("error", "timeout", "killed") and processes_of(plain.uid) == []
    assert plain.status == "timeout" or "BlockingIOError" in plain.stderr  # fork refused past RLIMIT_NPROC


def test_reading_another_processs_files_is_refused():
    secret = Path("/dev/shm") / f"distrl-secret-{uuid.uuid4().hex}"
    secret.write_text("hunter2")
    secret.chmod(0o600)  # root's, as a file of another user would be
    try:
        paths = [str(secret), f"/proc/{os.getpid()}/environ", f"/proc/{os.getppid()}/cmdline", "/etc/shadow",
                 str(REPO / "pyproject.toml"), "/root/.bashrc"]
        code = "\n".join(["for path in %r:" % paths, "    try:", "        print('READ', path, open(path).read())",
                          "    except OSError as exc:", "        print('REFUSED', path, type(exc).__name__)",
                          "import os", "try:", "    print('PIDS', os.listdir('/proc'))",
                          "except OSError:", "    print('PIDS hidden')"])
        result = run(code, FAST)
    finally:
        secret.unlink()
    assert result.status == "ok", result.stderr
    assert "READ" not in result.stdout and "hunter2" not in result.stdout
    assert result.stdout.count("REFUSED") == len(paths)
    assert "PIDS hidden" in result.stdout


def test_connecting_to_a_loopback_port_of_the_host_is_refused():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = "\n".join(["import socket", "for host in ('127.0.0.1', 'localhost', '::1'):", "    try:",
                          f"        socket.create_connection((host, {port}), timeout=1).close()",
                          "        print('CONNECTED', host)", "    except OSError as exc:",
                          "        print('REFUSED', host, type(exc).__name__)"])
        result = run(code, FAST)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing ever reached the listener
            server.accept()
    assert result.status == "ok", result.stderr
    assert "CONNECTED" not in result.stdout and result.stdout.count("REFUSED") == 3


def test_connecting_to_a_host_unix_socket_is_refused(tmp_path):
    """A socket anyone may connect to (mode 0777), outside /tmp, is out of the sandbox's reach (its root holds
    none of the host's sockets; abstract ones live in the host's network namespace)."""
    where = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(str(where / "s"))
            os.chmod(where, 0o777)
            os.chmod(where / "s", 0o777)
            server.listen()
            abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            abstract.bind(f"\0distrl-test-{uuid.uuid4().hex}")
            abstract.listen()
            paths = [str(where / "s"), abstract.getsockname()]
            code = "\n".join(["import socket", "for path in %r:" % paths, "    s = socket.socket(socket.AF_UNIX)",
                              "    try:", "        s.connect(path)", "        print('CONNECTED', path)",
                              "    except OSError as exc:", "        print('REFUSED', type(exc).__name__)"])
            result = run(code, FAST)
            for listener in (server, abstract):
                listener.setblocking(False)
                with pytest.raises(BlockingIOError):
                    listener.accept()
            abstract.close()
    finally:
        shutil.rmtree(where)
    assert result.status == "ok", result.stderr
    assert "CONNECTED" not in result.stdout and result.stdout.count("REFUSED") == 2


def test_an_infinite_loop_is_killed_at_the_time_limit():
    started = time.monotonic()
    result = run("while True:\n    pass\n", Limits(wall_s=1.5, cpu_s=30))
    assert result.status == "timeout" and 1.5 <= time.monotonic() - started < 1.5 + 5.0
    assert processes_of(result.uid) == []
    cpu = run("while True:\n    pass\n", Limits(wall_s=60.0, cpu_s=1))  # RLIMIT_CPU first: SIGXCPU
    assert cpu.status == "killed" and cpu.returncode in (-24, -9)


def test_a_memory_hog_is_refused():
    hog = "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))\n"
    result = run(hog, Limits(wall_s=30.0, memory_mb=256))
    assert result.status in ("error", "killed") and "MemoryError" in result.stderr


def test_the_environment_answers_code_blocks_and_scores_the_final_answer():
    from distrl.rollout.envs.python_env import PythonEnv
    from distrl.rollout.rewards import Problem

    env = PythonEnv()
    env.limits = FAST
    env.reset(Problem("p", "1/2 as a decimal", "\\frac{1}{2}"))
    assert env.step("```python\nprint(1 / 2)\n```\n") == ("0.5", 0.0, False, {"calls": 1, "errors": 0.0})
    observation, _, done, info = env.step("```py\nx = 1\nprint(x)\n1 / 0\n```\n")
    assert observation == "1\nError: ZeroDivisionError: division by zero" and not done and info["errors"] == 1.0
    env.limits = Limits(wall_s=1.5)
    assert env.step("```python\nwhile True: pass\n```\n")[0] == "Killed: time limit"
    env.limits = FAST
    assert env.step("```python\nx = 1\n```\n")[0] == "(no output)"
    assert env.step("So the answer is \\boxed{0.5}.") == (None, 1.0, True, {"correct": 1.0})  # math_verify
    env.reset(Problem("q", "6 * 7", "42"))
    assert env.step("The answer is \\boxed{41}.")[1:3] == (0.0, True)  # an integer gold: integer_match


def test_an_episode_through_the_env_worker_pool():
    from distrl.rollout.envs.pool import EnvPool

    pool = EnvPool("python", timeout_s=30.0)
    try:
        pool.reset(["e"], [{"prompt_id": "p", "question": "123 * 456", "gold": "56088", "meta": {}}])
        assert pool.poll(30.0) == [("e", {"observation": None, "stop": ["\n```\n"]})]
        pool.step("e", "Let me compute.\n```python\nprint(123 * 456)\n```\n")
        [(_, reply)] = pool.poll(30.0)
        assert reply["observation"] == "56088" and not reply["done"] and reply["info"]["errors"] == 0
        pool.step("e", "The answer is \\boxed{56088}.")
        [(_, reply)] = pool.poll(30.0)
        assert reply["observation"] is None and reply["done"] and reply["reward"] == 1.0
        assert pool.errors == 0
    finally:
        pool.close()


def test_env_python_is_refused_with_exit_2_where_the_sandbox_is_missing(tmp_path, qwen_tiny):
    """Without `unshare` on PATH the probe fails: the environment refuses to start, and `distrl train --env
    python` stops in preflight with exit status 2 (nothing run, no run directory)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(sys.executable, bin_dir / "python")
    env = {**os.environ, "PATH": str(bin_dir), "PYTHONPATH": str(REPO)}
    code = ("from distrl.rollout.envs.python_env import PythonEnv\n"
            "from distrl.rollout.envs.sandbox import SandboxUnavailable\n"
            "try:\n    PythonEnv()\nexcept SandboxUnavailable as exc:\n    print('REFUSED', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("REFUSED namespaces+landlock sandbox unavailable: no "
                                                         "`unshare`"), out.stderr
    done = subprocess.run([sys.executable, "-m", "distrl", "train", "--model", str(qwen_tiny), "--env", "python",
                           "--log_dir", str(tmp_path / "runs"), "--run_name", "r", "--max_steps", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "distrl train: error: --env: python: namespaces+landlock sandbox unavailable: no `unshare`" in done.stderr
    assert not (tmp_path / "runs" / "r").exists()
