"""Give freed memory back to the operating system, for a long-running server (glibc's malloc only).

glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), so after the first large
tensor is freed, later ones of that size come from the heap and arenas; freed, they stay in the process
(fragmented between live blocks), and a server that computes attention maps for thirty sessions in worker
threads grows far past what the sessions keep. A fixed threshold (which also turns that adjustment off) puts
every block of 1 MiB or more in its own mapping, returned to the system when freed. Small blocks, which
is nearly all of a decode step's, are untouched."""
from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 1 << 20
TRIM_THRESHOLD = 8 << 20


def return_freed_memory() -> bool:
    """Set glibc's thresholds for this process; False (nothing changed) on another C library or system."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1


def trim() -> None:
    """Hand the heap's free pages back to the system now (after a session dropped data); a no-op off glibc."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
