"""A checkpoint file's pages go back to the kernel once copied, and nothing else is touched."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nanoserve.model.file_pages import FilePages


def resident_kib(t: torch.Tensor) -> int:
    """Resident KiB of the mapping that holds `t` (/proc/self/smaps)."""
    at, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= at < hi
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


def test_a_mapped_tensors_pages_go_and_its_values_stay(tmp_path: Path) -> None:
    weights = {"w": torch.randn(1024, 2048), "b": torch.randn(4096)}  # 8 MiB + 16 KiB
    save_file(weights, str(tmp_path / "m.safetensors"))
    loaded = load_file(str(tmp_path / "m.safetensors"))  # views of the mapped file
    assert torch.equal(loaded["w"], weights["w"])  # every page read: resident
    before = resident_kib(loaded["w"])
    assert before > 8 * 1024 * 0.9
    assert FilePages().release(loaded["w"])
    assert resident_kib(loaded["w"]) < before - 7 * 1024  # all but the pages it shares at its ends
    assert torch.equal(loaded["w"], weights["w"]) and torch.equal(loaded["b"], weights["b"])


def test_memory_that_is_not_a_file_is_left_alone() -> None:
    t = torch.randn(1024, 1024)
    want = t.clone()
    assert not FilePages().release(t)
    assert not FilePages().release(t[:, ::2])  # not contiguous
    assert torch.equal(t, want)
