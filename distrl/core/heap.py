"""A steady C heap for long-running roles (glibc's malloc; a no-op elsewhere).

glibc adapts two thresholds while a process runs: a freed ``mmap``-ed block larger than the mmap
threshold raises that threshold (up to 32 MiB on 64-bit), and the trim threshold follows at twice it.
A role that allocates and frees tensors and Arrow buffers of a few MiB every policy version therefore
moves them between ``mmap`` and the heap, and its heap top is trimmed and grown again at irregular
intervals: the resident set size wanders by tens of MB with no change in memory in use, which hides a
real leak of a few MB per thousand versions (bench/soak.py, BENCHMARKS.md "Soak").

:func:`steady_heap` fixes both thresholds once at start-up (``mallopt``, which also turns the
adaptation off): blocks of at least :data:`MMAP_THRESHOLD` bytes are always ``mmap``-ed and returned to
the system when freed; smaller ones come from the heap, whose freed top is kept up to
:data:`TRIM_THRESHOLD` bytes for reuse, so a version's transient peak is not given back and taken again
the next version. RSS then follows the high-water mark of memory in use (a role's steady footprint), and
grows after warm-up only if memory in use does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # bytes: the largest value glibc itself would adapt to (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 512 * 2**20  # bytes: freed heap top kept for reuse; a step's transient peak is not trimmed


def steady_heap() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (see the module docstring).

    Returns True when they were set, False where the C library is not glibc (nothing changes there).
    Call it once, early in a role's process; it never raises.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.debug("mallopt refused the heap thresholds: the C heap adapts them as usual")
    return ok
