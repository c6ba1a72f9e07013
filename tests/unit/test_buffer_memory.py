"""distrl.buffer.memory: the prefaulted heap keeps its memory and later allocations (libzmq's messages are
malloc'd) are served from it, so a buffer that keeps what it receives does not take new memory per PUT.

Each case runs in a fresh interpreter: mallopt changes the whole process (one arena, no trimming)."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from distrl.buffer.memory import capped, memory_limit, prefault_heap

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20

PROBE = """
import ctypes, json, sys
from distrl.buffer.memory import capped, memory_limit, prefault_heap

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
before = rss()
seconds = prefault_heap(int(sys.argv[1]))
prefaulted = rss()
blocks = [libc.malloc(350_000) for _ in range(100)]  # 35 MB of PUT-sized messages, kept
for block in blocks:
    ctypes.memset(block, 1, 350_000)
print(json.dumps({"seconds": seconds, "kept": prefaulted - before, "new_for_messages": rss() - prefaulted}))
"""


def probe(nbytes: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(nbytes)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="prefault_heap configures glibc malloc")
def test_prefaulted_heap_stays_resident_and_serves_later_messages():
    cold, warm = probe(0), probe(64 * MiB)
    assert cold["seconds"] is None and warm["seconds"] > 0
    assert cold["new_for_messages"] > 30 * MiB  # without it, every kept message is new memory
    assert warm["kept"] > 60 * MiB  # written once and freed to the heap, not to the OS
    assert warm["new_for_messages"] < 4 * MiB  # the 35 MB of messages came out of it


def test_prefault_heap_refuses_a_negative_size_and_does_nothing_for_zero():
    with pytest.raises(ValueError, match="prefault"):
        prefault_heap(-1)
    assert prefault_heap(0) is None



def test_prefault_beyond_half_the_memory_is_cut_to_half(caplog):
    half = memory_limit() // 2
    assert memory_limit() <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert capped(64 * MiB) == 64 * MiB and not caplog.records
    assert capped(1 << 60) == half
    assert "more than half the memory this process may use" in caplog.text


RECEIVE = """
import json, os, sys
from distrl.buffer.memory import prefault_heap, single_arena

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

single_arena()  # what `distrl buffer` does before importing the server
import pyarrow  # noqa: F401 - starts jemalloc's background thread, as the buffer's imports do
import zmq

payload = os.urandom(350_000)
prefault_heap(64 << 20)
ctx = zmq.Context()
server, client = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
client.connect(f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}")
before, held = rss(), []
for _ in range(100):  # 35 MB received by ZeroMQ's I/O thread and kept, as the buffer keeps PUT bodies
    client.send(payload, copy=False)
    held.append(server.recv(copy=False))
print(json.dumps({"new_for_messages": rss() - before}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="prefault_heap configures glibc malloc")
def test_messages_received_by_zeromq_land_in_the_prefaulted_heap():
    proc = subprocess.run([sys.executable, "-c", RECEIVE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["new_for_messages"] < 8 * MiB  # not the 35 MB of new memory
