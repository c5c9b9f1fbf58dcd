"""The start-up heap kept out of Python's cyclic garbage collector, for long-running processes
that hold torch (the server, and the benchmarks' servers and peers)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def freeze_startup_heap() -> bool:
    """Move everything alive after start-up (torch, the model, FastAPI: a few hundred thousand
    objects) out of the cyclic garbage collector's reach; returns False if already frozen.

    A full collection walks every tracked object while holding the GIL, so it stalls the engine
    thread and every stream (160-200 ms here before freezing; the levers table of
    docs/performance.md has the measurement). Reference counting still frees these objects; only
    cycles among them would wait for `gc.unfreeze()` (at shutdown). What is garbage already goes first.
    """
    if gc.get_freeze_count():
        return False  # another app in this process froze the heap; it unfreezes it
    gc.collect()
    gc.freeze()
    return True


def return_free_memory() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim); False where unavailable.

    Freed tensors of up to 32 MB live on glibc's heap rather than in their own mappings once
    larger ones have been freed (its mmap threshold rises), and a freed block in the middle of
    the heap stays resident. After the engine releases the model's copies of the weights the
    native step packed, an engine's RSS at 124M bfloat16 stayed at 892 MB without this and went
    to 726 MB with it (at float32 the larger tensors had their own mappings: 1125 MB either way).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):  # not glibc
        return False
