"""The engine's large allocations, sized from the model's config and the engine's settings, and
checked against the memory this process may use before any of them is made.

A config's sizes are bounded one by one (nanoserve/model/config.py's SIZE_LIMITS), but their
products are what is allocated: `block_size` 1048576 on a rotary model is a legal window whose
KV cache, max_seqs x 2^20 positions, is tens of GiB. Allocated blindly it fails late (a
traceback, exit 3) or, under overcommit, takes the host down. `check_memory` says instead, in one
line, what does not fit, how big it is, and the setting or config field that makes it so.

On a GPU the plan also sizes: with `gpu_memory_utilization` (vLLM's flag), `fit_slots` gives the
KV cache as many slots as fit in that share of the GPU's memory once the weights, the engine's
other buffers and whatever else holds memory there are counted, in place of max_seqs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from nanoserve.engine.config import EngineConfig, rules
from nanoserve.engine.graph_step import cuda_graphs_off
from nanoserve.model.checkpoint import Checkpoint
from nanoserve.model.config import GPTConfig

GIB = 1 << 30
# Room kept for what is not planned here: the interpreter, torch's own buffers, requests' state.
HEADROOM = 0.9


@dataclass(frozen=True)
class Allocation:
    what: str  # "the KV cache"
    nbytes: int
    because: str  # the sizes it is the product of, the fields named


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def weights_to_copy(checkpoint: Checkpoint, config: EngineConfig) -> int:
    """Bytes of the weights' copy the engine makes: onto a GPU, or converted to another dtype
    (0: the model takes the checkpoint's tensors as they are)."""
    dtype, tensors = config.torch_dtype, checkpoint.state_dict.values()
    if config.resolved_device() == "cpu" and all(t.dtype == dtype for t in tensors):
        return 0
    return sum(t.numel() for t in tensors) * _element_bytes(dtype)


def planned(model: GPTConfig, config: EngineConfig, window: int, weights: int = 0) -> list[Allocation]:
    """The allocations an engine with `config` makes for `model`, the `weights` bytes it copies
    included, largest first."""
    slots, kv_bytes = config.max_seqs, _element_bytes(config.torch_kv_dtype)
    capped = config.max_context is not None and config.max_context < model.block_size
    window_from = f"--max-context {config.max_context}" if capped else f"block_size {model.block_size}"
    # CUDA graphs pad a batch to its bucket; the padding rows write to one more slot (graph_step.py).
    scratch = 0 if cuda_graphs_off(config) else 1
    kv = 2 * model.n_layer * (slots + scratch) * model.kv_heads * window * model.head_dim * kv_bytes
    plan = [Allocation(
        "the KV cache", kv,
        f"2 x n_layer {model.n_layer} x max_seqs {slots}{' + 1' * scratch} x kv heads {model.kv_heads} "
        f"x window {window} "
        f"({window_from}) x head_dim {model.head_dim} x {kv_bytes} bytes",
    )]
    if model.positions == "rope":
        # torch's tables cover block_size positions, built in float64 (angles, cos, sin) then kept
        # in float32; the native step's cover the window in float32.
        rope = model.block_size * model.head_dim * (3 * 8 + 2 * 4)
        plan.append(Allocation("the rotary tables", rope,
                               f"block_size {model.block_size} x head_dim {model.head_dim} x 32 bytes"))
    rows = max(config.max_seqs, config.prefill_budget, config.idle_prefill_budget)
    plan.append(Allocation("the logits of one step", rows * model.vocab_size * 4,
                           f"rows {rows} (max_seqs, prefill budgets) x vocab_size {model.vocab_size} "
                           "x 4 bytes"))
    plan.append(Allocation("the penalty counts", slots * model.vocab_size * 5,
                           f"max_seqs {slots} x vocab_size {model.vocab_size} x 5 bytes"))
    threads = config.cpu_threads or os.cpu_count() or 1  # the native step's attention rows
    plan.append(Allocation("the attention scratch", threads * 4 * window * 4,
                           f"threads {threads} x 4 rows x window {window} x 4 bytes"))
    if weights:
        plan.append(Allocation("the weights' copy", weights, f"the checkpoint's weights as {config.dtype} "
                               f"on {config.resolved_device()}"))
    return sorted(plan, key=lambda a: -a.nbytes)


def available_bytes(device: str) -> int | None:
    """Memory this process may still allocate on `device` (None: unknown). On a CPU the lower of
    the kernel's MemAvailable and what the cgroup's limit leaves."""
    if device.startswith("cuda"):
        return _cuda_memory(device)[0]
    found = [v for v in (_meminfo_available(), _cgroup_left()) if v is not None]
    return min(found) if found else None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_left() -> int | None:
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def _planned_bytes(checkpoint: Checkpoint, config: EngineConfig) -> list[Allocation]:
    model = checkpoint.config
    return planned(model, config, config.window_for(model.block_size), weights_to_copy(checkpoint, config))


def _budget(config: EngineConfig, available: int, device_total: int | None) -> float:
    """Bytes the engine's allocations may take: on a GPU with gpu_memory_utilization, that share
    of the device's memory less what is already in use there; else HEADROOM of what is free."""
    util = config.gpu_memory_utilization
    if util is None or device_total is None or not config.resolved_device().startswith("cuda"):
        return available * HEADROOM
    return device_total * util - (device_total - available)


def _cuda_memory(device: str) -> tuple[int, int]:
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)


def fit_slots(checkpoint: Checkpoint, config: EngineConfig, free: int | None = None,
              device_total: int | None = None) -> EngineConfig:
    """`config` with max_seqs set to the most KV slots that fit gpu_memory_utilization of the GPU
    (`free` and `device_total` bytes, default: measured now), the weights and the engine's other
    buffers counted; `config` itself off CUDA or without gpu_memory_utilization. At most
    max_seqs' own bound; ValueError (one line) when not one slot fits."""
    device = config.resolved_device()
    if config.gpu_memory_utilization is None or not device.startswith("cuda"):
        return config
    if free is None or device_total is None:
        free, device_total = _cuda_memory(device)
    budget = _budget(config, free, device_total)

    def cost(slots: int) -> int:
        return sum(a.nbytes for a in _planned_bytes(checkpoint, replace(config, max_seqs=slots)))

    def fits(slots: int) -> bool:
        return cost(slots) <= budget

    most = int(rules()["max_seqs"][1].le or 1)
    if not fits(1):
        raise ValueError(
            f"gpu_memory_utilization {config.gpu_memory_utilization:g} leaves {max(budget, 0) / GIB:.2f} "
            f"GiB of the GPU's {device_total / GIB:.1f} GiB ({free / GIB:.1f} GiB free) for the engine, "
            f"less than one KV slot with the weights and buffers needs ({cost(1) / GIB:.2f} GiB): "
            "raise it, or lower --max-context"
        )
    lo, hi = 1, most  # fits(lo); the cost grows with the slots, so bisect for the last that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return replace(config, max_seqs=lo)


def check_memory(checkpoint: Checkpoint, config: EngineConfig, available: int | None = None,
                 device_total: int | None = None) -> None:
    """Raise ValueError (one line) when the engine's allocations for `checkpoint` do not fit the
    memory left (`available`, default: measured now on the engine's device; unknown: nothing is
    checked). On a GPU with gpu_memory_utilization the limit is that share of `device_total`."""
    device = config.resolved_device()
    if available is None and device.startswith("cuda"):
        available, device_total = _cuda_memory(device)
    elif available is None:
        available = available_bytes(device)
    if available is None:
        return
    plan = _planned_bytes(checkpoint, config)
    total = sum(a.nbytes for a in plan)
    if total <= _budget(config, available, device_total):
        return
    big = plan[0]
    raise ValueError(
        f"{big.what} would take {big.nbytes / GIB:.1f} GiB ({big.because}); with the engine's other "
        f"buffers {total / GIB:.1f} GiB, more than the {available / GIB:.1f} GiB of memory available: "
        "lower --max-context or --max-seqs, or fix the checkpoint's block_size"
    )

