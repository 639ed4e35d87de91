"""Give freed memory back to the operating system, for a long-running server (glibc's malloc only).

glibc raises its mmap threshold each time a large block is freed (up to 32 MiB); after that, tensors of that
size come from the heap and its per-thread arenas, and when freed they stay in the process, fragmented between
live blocks. A server computing runs and attention maps for thirty sessions in worker threads then grows past
what the sessions keep. malloc_trim returns the free pages, wherever they lie in the heap: about 7 ms with the
bundled model loaded, returning 70-100 MiB after a 400-word run (measured). The app trims after each run, after
each page's on-demand computation (thirty sessions computing their Attention maps at once otherwise took the server
459 MiB past its memory bound: docs/CLASSROOM.md) and whenever a session drops data for its budget; the bench,
before it measures a peak. (A fixed low mmap threshold would return every large block at once, but made an
inspected run 15-20 % slower here, from page faults on every large allocation.)"""
from __future__ import annotations

import ctypes
import sys


def trim() -> bool:
    """Hand the heap's free pages back to the system now; False (nothing done) off glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True
