"""Run untrusted Python code in a sandbox: Linux namespaces + Landlock + an unprivileged uid + rlimits.

The mechanism (named ``namespaces+landlock`` in messages), set up by :mod:`.sandbox_init` before it ``execve``s
the program:

- **namespaces** (``unshare`` from util-linux): mount, PID, network, IPC and UTS namespaces of the program's own
  (plus a user namespace when the caller is not root). No network device but a loopback that is down: nothing on
  the host, its loopback included, can be reached; no process of the host can be seen. The program's root is a
  private tmpfs (``Limits.file_mb``, gone when the program ends) holding read-only binds of ``/usr``, ``/lib*``,
  ``/bin``, ``/etc``, the interpreter's prefix (at ``/python``) and four devices (null, zero, random, urandom),
  and a writable ``/tmp``: no other path of the host (no ``/proc``, ``/run``, home or work directory, socket).
- **an unprivileged uid**: from root, the program runs as a uid/gid of its own (``UID_BASE`` + a random offset,
  owning no file; no supplementary groups, no capabilities, no_new_privs), so file permissions hold (``/etc/shadow``),
  it cannot leave its ``chroot``, and RLIMIT_NPROC is enforced (it is not for uid 0) and not shared with other
  sandboxes. Not root: the caller's own uid, inside a user namespace (its capabilities there do not reach the
  host, and Landlock forbids it to change mounts).
- **Landlock** (Linux >= 5.13; up to the kernel's ABI): reads and execution only beneath the interpreter and the
  system library directories (``/usr``, ``/lib*``, ``/bin``, ``/etc``), writes only beneath ``/tmp``, no TCP
  bind or connect (ABI >= 4), no signals or abstract unix sockets to processes outside it (ABI >= 6).
- **rlimits**: CPU seconds, address space, processes, file size, 64 open files, no core; and a wall clock after
  which PID 1 of the namespace is killed, which takes every process in it along. PID 1 (sandbox_init, under the
  same restrictions) runs the program as its child and reports its exit status on a pipe of its own, so the
  program's signals and exit codes are its own (not those of an init process).

The program gets no environment variables of the caller and no stdin. :func:`probe` runs a trivial program once
per process: where any part is missing (no ``unshare``, namespaces or Landlock refused, e.g. in a container
without the rights), it says why, and callers refuse to run code (never unsandboxed). Linux only.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

MECHANISM = "namespaces+landlock"
UID_BASE = 2_000_000_000  # sandbox uids: UID_BASE + [0, 2**24), owning no file on the host
INIT = Path(__file__).with_name("sandbox_init.py")
KILL_WAIT_S = 5.0  # seconds unshare may take to exit once its namespace is killed
SETUP_EXIT = 125  # sandbox_init's exit status when the sandbox could not be set up


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (the message says which part failed and what to change)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one program may use; past a limit it is killed or its call fails (a fork, an allocation, a write)."""

    wall_s: float = 5.0
    """seconds of wall clock from start; then every process of the sandbox is killed (status ``timeout``)."""
    cpu_s: int = 5
    """RLIMIT_CPU, CPU seconds per process (SIGXCPU, then SIGKILL one second later)."""
    memory_mb: int = 512
    """RLIMIT_AS, MiB of address space per process (an allocation past it fails: Python's MemoryError)."""
    processes: int = 16
    """RLIMIT_NPROC: processes and threads of the sandbox uid (a fork past it fails with EAGAIN)."""
    file_mb: int = 16
    """RLIMIT_FSIZE, MiB of one file, and the size of the private /tmp."""
    output_bytes: int = 4096
    """bytes of stdout and of stderr kept each; the rest is read and dropped (``Result.truncated``)."""


@dataclasses.dataclass
class Result:
    """One run. ``status``: ``ok`` (exit 0), ``error`` (another exit status), ``killed`` (a signal, e.g. an
    rlimit's), ``timeout`` (past ``Limits.wall_s``). ``returncode``: the program's exit status, or minus the
    signal that ended it (None: killed at the time limit); ``uid`` the sandbox's (host) uid."""

    stdout: str
    stderr: str
    status: str
    returncode: int | None
    truncated: bool
    uid: int


def _spec(uid: int, limits: Limits) -> dict:
    """sandbox_init's SPEC: the uid, the limits in bytes and seconds, and where the interpreter lives."""
    prefix = Path(sys.base_prefix).resolve()
    exe = Path(sys.executable).resolve()
    if not exe.is_relative_to(prefix):  # a venv's python links to its base interpreter
        exe = prefix / "bin" / exe.name
    return {"uid": uid, "prefix": str(prefix), "exe": str(exe.relative_to(prefix)),
            "host_mnt_ns": os.stat("/proc/self/ns/mnt").st_ino, "cpu_s": int(limits.cpu_s),
            "memory_bytes": limits.memory_mb << 20, "processes": limits.processes,
            "file_bytes": limits.file_mb << 20}


def _command(spec: dict) -> list[str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SandboxUnavailable("no `unshare` (util-linux) on PATH")
    namespaces = ["--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return [unshare, *user, *namespaces, sys.executable, "-I", "-S", str(INIT), json.dumps(spec)]


def run(code: str, limits: Limits = Limits()) -> Result:
    """Run the Python source ``code`` in a fresh sandbox (see the module docstring) and return its output.

    Blocks for at most ``limits.wall_s`` seconds plus the start (about 0.1 s). Raises SandboxUnavailable when
    the sandbox could not be set up (the program did not run).
    """
    uid = UID_BASE + random.randrange(1 << 24) if os.geteuid() == 0 else os.geteuid()
    status_read, status_write = os.pipe()  # sandbox_init's PID 1 writes the program's exit there
    try:
        inside = uid if os.geteuid() == 0 else 0  # not root: the caller's uid is root of the user namespace
        command = _command({**_spec(inside, limits), "status_fd": status_write})
        deadline = time.monotonic() + limits.wall_s
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(status_write,), start_new_session=True,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except BaseException:
        os.close(status_read)
        raise
    finally:
        os.close(status_write)
    with open(status_read, "rb") as status_pipe:
        try:
            try:
                proc.stdin.write(code.encode())
                proc.stdin.close()
            except BrokenPipeError:  # it failed before reading the program: its stderr says why
                pass
            out, err, ended = _collect([proc.stdout, proc.stderr, status_pipe], deadline, limits.output_bytes)
            timed_out = _wait(proc, deadline)
        finally:
            _kill(proc)
    stderr = err[0].decode(errors="replace")
    returncode = int(ended[0]) if ended[0].strip() else None  # None: the program did not end on its own
    if returncode is None and proc.returncode == SETUP_EXIT and "SETUP_FAILED" in stderr:
        raise SandboxUnavailable(stderr.strip().splitlines()[-1])
    status = ("timeout" if timed_out else "error" if returncode is None or returncode > 0
              else "killed" if returncode < 0 else "ok")
    return Result(out[0].decode(errors="replace"), stderr, status, returncode, out[1] or err[1], uid)


def _collect(pipes: list, deadline: float, limit: int) -> list[tuple[bytes, bool]]:
    """Read ``pipes`` until all close or ``deadline`` (monotonic s); keep ``limit`` bytes of each. Returns
    (bytes kept, whether some were dropped) per pipe."""
    kept = {pipe.fileno(): bytearray() for pipe in pipes}
    dropped = dict.fromkeys(kept, False)
    open_fds = set(kept)
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select(list(open_fds), [], [], left)
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.discard(fd)
                continue
            room = max(0, limit - len(kept[fd]))
            kept[fd] += chunk[:room]
            dropped[fd] |= len(chunk) > room
    return [(bytes(kept[p.fileno()]), dropped[p.fileno()]) for p in pipes]


def _wait(proc: subprocess.Popen, deadline: float) -> bool:
    """Wait for the exit until ``deadline``; True when it ran past it (then it is killed)."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return False
    except subprocess.TimeoutExpired:
        _kill(proc)
        return True


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL PID 1 of the sandbox's namespace (``unshare``'s child): the kernel kills every other process in it
    and ``unshare`` exits once they are all gone. Then ``unshare``'s process group, should it linger."""
    if proc.poll() is None:
        for pid in _children(proc.pid):  # unshare has not reaped it: the pid is still its child's
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its child dies with it (--kill-child)
            proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _children(pid: int) -> list[int]:
    """The child pids of ``pid`` (Linux ``/proc/PID/task/PID/children``; empty where the kernel lacks it)."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


@functools.cache
def probe() -> str | None:
    """None when the sandbox works here (a trivial program ran in it and printed what it should), else why not,
    one line. Cached per process; takes about 0.2 s the first time."""
    if not sys.platform.startswith("linux"):
        return f"{MECHANISM} needs Linux, this is {sys.platform}"
    try:
        result = run("print(6 * 7)", Limits(wall_s=30.0))  # room for a loaded machine
    except (SandboxUnavailable, OSError) as exc:
        return f"{MECHANISM} sandbox unavailable: {exc}"
    if result.status != "ok" or result.stdout.strip() != "42":
        return (f"{MECHANISM} sandbox probe failed ({result.status}, exit {result.returncode}): "
                f"{result.stderr.strip()[-300:]}")
    return None


def require() -> None:
    """Raise SandboxUnavailable (with :func:`probe`'s reason and what to change) unless the sandbox works here."""
    reason = probe()
    if reason is not None:
        raise SandboxUnavailable(f"{reason}; the python environment never runs code unsandboxed: run on Linux "
                                 ">= 5.13 with util-linux `unshare`, Landlock enabled and namespaces allowed (as "
                                 "root, or unprivileged user namespaces on)")
