"""The engine's read-only snapshots: `Engine.stats()` and `Engine.info()`.

`engine_stats` reads the scheduler's counters and the slots and queue in use (what the metrics
collector scrapes); `engine_info` describes what the engine serves and how it was set up: the
model, the tokenizer, the window, the dtype, the scheduling settings and the backend chosen (the
GET /info payload). Both take the engine's parts and change nothing.
"""

from __future__ import annotations

import sys
from typing import Any

from nanoserve.engine.backends.base import Backend
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.cpu_quota import CpuBudget
from nanoserve.engine.runner import ModelRunner
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.types import EngineStats
from nanoserve.model.checkpoint import Checkpoint
from nanoserve.model.tokenizer import Tokenizer


def engine_stats(
    scheduler: Scheduler, waiting: int, config: EngineConfig, runner: ModelRunner
) -> EngineStats:
    """The engine's counters and occupancy now; `waiting` is the waiting queue's length."""
    s = scheduler
    return EngineStats(
        running=len(s.running),
        waiting=waiting,
        slots_used=config.max_seqs - len(s.free_slots),
        slots_total=config.max_seqs,
        kv_cache_bytes=runner.cache.nbytes,
        steps=s.steps,
        extra={
            "generated_tokens_total": float(s.generated_tokens),
            "prefill_tokens_total": float(s.prefilled_tokens),
            "context_shifts_total": float(s.context_shifts),
            "preemptions_total": float(s.preemptions),
            # Prompt tokens of n > 1 / best_of choices copied from one prefill, not recomputed.
            "prefill_tokens_shared_total": float(s.shared_prefill_tokens),
            # Prompt prefix reuse (prefix_cache.py): placements that looked, that reused, and
            # the prompt tokens they did not prefill.
            "prefix_cache_lookups_total": float(s.prefix.lookups),
            "prefix_cache_hits_total": float(s.prefix.hits),
            "prefix_cache_reused_tokens_total": float(s.prefix.reused_tokens),
        },
    )


def engine_info(
    checkpoint: Checkpoint, config: EngineConfig, tokenizer: Tokenizer, runner: ModelRunner,
    scheduler: Scheduler, *, num_params: int, window: int, device: str, dtype_slowdown: float,
    backend: Backend, backend_reason: str, cpu_budget: CpuBudget,
) -> dict[str, Any]:
    """What the engine serves and how it is set up."""
    cfg = checkpoint.config
    return {
        "model": checkpoint.name,
        "model_config": cfg.to_dict(),
        "parameters": num_params,
        "tokenizer": {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size,
                      "eos_id": tokenizer.eos_id},
        "window": window,
        "device": device,
        "dtype": config.dtype,
        "kv_cache_dtype": str(runner.cache.layers[0].k.dtype).removeprefix("torch."),
        "dtype_matmul_slowdown_vs_float32": round(dtype_slowdown, 2),
        "max_seqs": config.max_seqs,
        "max_queue": config.max_queue,
        "prefill_budget": config.prefill_budget,
        "idle_prefill_budget": config.idle_prefill_budget,
        "waiting_served_ratio": config.waiting_served_ratio,
        "crop_policy": config.crop_policy,
        "shift_keep": config.keep_tokens(window),
        "reject_long_prompts": config.reject_long_prompts,
        "deterministic": config.deterministic,
        "prefix_cache": scheduler.prefix.enabled,  # off when deterministic on torch
        "cpu_threads": runner.cpu_threads,
        # Where the count came from: the flag, OMP_NUM_THREADS, the affinity mask or the cgroup's
        # CPU quota (cpu_quota.py), and what was read.
        "cpu_threads_from": {"source": cpu_budget.source, "detail": cpu_budget.detail},
        "gil_switch_interval_s": sys.getswitchinterval(),  # process-wide; see gil.py
        # Forward size (tokens, rounded up to a power of two) -> threads the tuner chose.
        "cpu_threads_by_forward_size": {str(k): v for k, v in runner.threads.choices().items()},
        # Which backend computes, with which kernels, and why it was chosen (backends/).
        "backend": {**backend.describe(), "reason": backend_reason},
        "kv_cache_bytes": runner.cache.nbytes,
        "provenance": checkpoint.provenance,
    }
