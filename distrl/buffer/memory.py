"""Received messages in memory touched before serving: the buffer's heap, prefaulted and never trimmed.

The buffer holds every PUT body it accepts zero-copy, as the ZeroMQ message it arrived in. libzmq
allocates each message with ``malloc``; memory the process has never written costs a page fault per
4 KiB page the first time it is written (and on a VM whose host backs guest memory lazily, much more:
``bench/buffer.py``'s memory probe compares fresh pages with pages just given back). A server that keeps
what it receives pays that for every byte; a raw ZeroMQ server that drops each message reuses the same few
buffers and never does.

:func:`prefault_heap` makes the buffer reuse memory too (glibc only): one malloc arena for every thread
(:func:`single_arena`; ZeroMQ's I/O thread included), allocations under 32 MiB from that heap, no
trimming (freed memory stays in the process), then ``nbytes`` of heap written once and freed. ZeroMQ's
messages are then carved out of memory already written, and the messages of groups that leave the
buffer go back to the heap for the next ones. The one-arena setting only holds for threads that had not
allocated yet, so it has to come before any other thread starts (importing pyarrow starts one):
``distrl buffer`` calls :func:`single_arena` before it imports the server, and ``distrl train`` starts
its buffer actor with ``MALLOC_ARENA_MAX=1`` in its environment.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import time

log = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: bigger allocations are mmapped (and unmapped on free)
BLOCK = 16 * 2**20


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_limit() -> int:
    """Bytes of memory this process may use: the machine's physical memory, or the memory cgroup's
    limit (v2 or v1) when that is lower."""
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in CGROUP_LIMITS:
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value.isdigit():
            limit = min(limit, int(value))
    return limit


def capped(nbytes: int) -> int:
    """``nbytes``, or half of :func:`memory_limit` (with a warning) if it is more than that."""
    half = memory_limit() // 2
    if nbytes > half:
        log.warning("buffer: --prefault_bytes %d is more than half the memory this process may use: writing %d",
                    nbytes, half)
        return half
    return nbytes


def _libc():
    """glibc through ctypes, or None where the C library is another one."""
    if platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


def single_arena() -> bool:
    """One malloc arena for the threads that allocate from now on (glibc ``M_ARENA_MAX``); False where
    it cannot be set (not glibc). Call it before other threads start."""
    libc = _libc()
    return libc is not None and libc.mallopt(M_ARENA_MAX, 1) == 1


def prefault_heap(nbytes: int) -> float | None:
    """Configure glibc malloc as the module docstring says and write ``nbytes`` of heap once.

    Returns the seconds it took, or None where the C library is not glibc (nothing is changed). The
    memory stays with the process (its resident size starts at about ``nbytes``); more than half the
    memory the process may use is cut to half, with a warning. Raises ValueError if ``nbytes`` is
    negative.
    """
    if nbytes < 0:
        raise ValueError(f"prefault bytes must be >= 0, got {nbytes}")
    libc = _libc()
    if nbytes == 0 or libc is None:
        return None
    nbytes = capped(nbytes)
    # M_TRIM_THRESHOLD -1 (SIZE_MAX once in size_t): never trim, however much is freed at the top
    for param, value in ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, -1)):
        if libc.mallopt(param, value) != 1:
            log.warning("buffer: mallopt(%d, %d) failed: received messages may take new memory", param, value)
            return None
    t0 = time.perf_counter()
    blocks = [libc.malloc(BLOCK) for _ in range(-(-nbytes // BLOCK))]
    written = [block for block in blocks if block]
    for block in written:
        ctypes.memset(block, 0, BLOCK)
    for block in written:
        libc.free(block)  # back to the heap, not to the OS (no trimming)
    seconds = time.perf_counter() - t0
    if len(written) < len(blocks):
        log.warning("buffer: malloc refused %d of %d blocks of %d MiB: %.0f MiB of heap written",
                    len(blocks) - len(written), len(blocks), BLOCK >> 20, len(written) * BLOCK / 2**20)
    log.info("buffer: %.0f MiB of heap written in %.2f s for received messages", len(written) * BLOCK / 2**20,
             seconds)
    return seconds
