"""Received messages in memory touched before serving: the buffer's heap, prefaulted and never trimmed.

The buffer holds every PUT body it accepts zero-copy, as the ZeroMQ message it arrived in. libzmq
allocates each message with ``malloc``; memory the process has never written costs a page fault per
4 KiB page the first time it is written (and on a VM whose host backs guest memory lazily, much more:
0.3-0.4 GB/s against 5-7 GB/s for memory just freed, ``bench/buffer.py``'s memory probe). A server that
keeps what it receives pays that for every byte; a raw ZeroMQ server that drops each message reuses the
same few buffers and never does.

:func:`prefault_heap` makes the buffer reuse memory too (glibc only): one malloc arena for every thread
(ZeroMQ's I/O thread included), allocations under 32 MiB from that heap, no trimming (freed memory
stays in the process), then ``nbytes`` of heap written once and freed. ZeroMQ's messages are then carved
out of memory already written, and the messages of groups that leave the buffer go back to the heap for
the next ones. It must run before the process starts other threads (the ZeroMQ context's I/O thread
included): ``distrl buffer`` and the buffer role of ``distrl train`` call it first thing.
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


def capped(nbytes: int) -> int:
    """``nbytes``, or half the machine's physical memory (with a warning) if it is more than that."""
    half = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    if nbytes > half:
        log.warning("buffer: --prefault_bytes %d is more than half this machine's memory: writing %d", nbytes, half)
        return half
    return nbytes


def prefault_heap(nbytes: int) -> float | None:
    """Configure glibc malloc as the module docstring says and write ``nbytes`` of heap once.

    Returns the seconds it took, or None where the C library is not glibc (nothing is changed). The
    memory stays with the process (its resident size starts at about ``nbytes``); more than half the
    machine's memory is cut to half, with a warning. Raises ValueError if ``nbytes`` is negative.
    """
    if nbytes < 0:
        raise ValueError(f"prefault bytes must be >= 0, got {nbytes}")
    if nbytes == 0 or platform.libc_ver()[0] != "glibc":
        return None
    nbytes = capped(nbytes)
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    for param, value in ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, 2**31 - 1)):
        if libc.mallopt(param, value) != 1:
            log.warning("buffer: mallopt(%d, %d) failed: received messages may take new memory", param, value)
            return None
    t0 = time.perf_counter()
    blocks = [libc.malloc(BLOCK) for _ in range(-(-nbytes // BLOCK))]
    for block in blocks:
        if block:
            ctypes.memset(block, 0, BLOCK)
    for block in blocks:
        libc.free(block)  # back to the heap, not to the OS (no trimming)
    seconds = time.perf_counter() - t0
    log.info("buffer: %.0f MiB of heap written in %.2f s for received messages", nbytes / 2**20, seconds)
    return seconds
