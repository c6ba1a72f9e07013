"""distrl.core.heap.steady_heap: the C heap keeps a freed block below the mmap threshold for reuse (glibc)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")

# Allocates, touches and frees a 20 MiB block with the C library's malloc; prints the resident set size
# (MiB) before the allocation, while it is held and after it is freed.
PROBE = """
import ctypes, os, sys
from distrl.core.heap import steady_heap
if sys.argv[1] == "steady":
    assert steady_heap()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page / 2**20
before = rss()
block = libc.malloc(20 * 2**20)
ctypes.memset(block, 1, 20 * 2**20)
held = rss()
libc.free(block)
print(before, held, rss())
"""


def probe(mode: str) -> tuple[float, float, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    before, held, freed = map(float, out.stdout.split())
    return before, held, freed


def test_a_freed_block_stays_in_the_steady_heap_and_goes_back_by_default():
    before, held, freed = probe("default")
    assert held - before > 19 and held - freed > 19  # glibc's default: 20 MiB is mmap-ed, freed to the system
    before, held, freed = probe("steady")
    assert held - before > 19 and held - freed < 1  # kept on the heap for the next version's allocations
