"""Giving back a mapped checkpoint file's pages once its tensors have been copied.

safetensors maps the checkpoint file: a tensor loaded from it is a view of the mapping, and every
page read stays resident in this process while any tensor of the file lives. Whoever copies the
weights (a dtype or device conversion in `Checkpoint.build_model`, the serving engine's packed
copies) would otherwise hold the file's pages and the copies at once until the last tensor of the
file goes: a 124M float32 serving engine peaked at ~1.5 GiB at start-up against ~0.9 steady. Once
a tensor's copy exists, its file pages are handed back (MADV_PAGEOUT: clean file pages are
dropped, and read again from the file if anything touches them). Nothing is lost either way:
memory that is not a file mapping is left alone, and the advice never changes what a page holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from collections.abc import Callable

import torch

MADV_PAGEOUT = 21  # Linux 5.4+; older kernels refuse it (EINVAL) and nothing happens


class FilePages:
    """The process's file mappings as they are now, and a way to page out a tensor's part of one."""

    def __init__(self) -> None:
        self._ranges = _file_mappings()
        self._madvise = _madvise() if self._ranges else None

    def release(self, t: torch.Tensor) -> bool:
        """Page out the whole pages under `t` when they lie in a file mapping; True if advised."""
        if self._madvise is None or t.device.type != "cpu" or not t.is_contiguous():
            return False
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        if not any(lo <= start and end <= hi for lo, hi in self._ranges):
            return False
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, end // page * page  # pages wholly inside `t`
        return last > first and self._madvise(first, last - first, MADV_PAGEOUT) == 0


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of each mapping of a file (not anonymous memory, the heap or the stack)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    lo, hi = fields[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:  # not Linux
        return []
    return ranges


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]
