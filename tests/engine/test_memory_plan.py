"""The engine's large buffers sized from the config before any is allocated (memory_plan.py)."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.memory_plan import GIB, check_memory, planned, weights_to_copy
from nanoserve.model.checkpoint import Checkpoint
from nanoserve.model.config import GPTConfig
from nanoserve.model.tokenizer import CharTokenizer

ROPE = GPTConfig(vocab_size=96, block_size=2**20, n_layer=2, n_head=2, n_embd=32, positions="rope",
                 norm="rmsnorm", mlp="swiglu", bias=False)


def _checkpoint(state_dict: dict[str, torch.Tensor] | None = None) -> Checkpoint:
    return Checkpoint(config=ROPE, tokenizer=CharTokenizer.train("abc"), state_dict=state_dict or {})


def test_the_kv_cache_is_the_product_of_its_sizes() -> None:
    config = EngineConfig(max_seqs=4, kv_cache_dtype="bfloat16")
    kv = next(a for a in planned(ROPE, config, window=1024) if a.what == "the KV cache")
    assert kv.nbytes == 2 * 2 * 4 * 2 * 1024 * 16 * 2  # k and v, layers, slots, heads, window, head_dim, bf16
    assert "window 1024" in kv.because and "max_seqs 4" in kv.because


def test_too_much_is_one_line_naming_the_largest_and_its_fields() -> None:
    with pytest.raises(ValueError) as e:
        check_memory(_checkpoint(), EngineConfig(max_seqs=16, cpu_threads=1), available=4 * GIB)
    line = str(e.value)
    assert "\n" not in line and line.startswith("the KV cache would take 8.0 GiB")
    assert "block_size 1048576" in line and "--max-context" in line
    check_memory(_checkpoint(), EngineConfig(max_seqs=16, max_context=4096), available=4 * GIB)  # fits


def test_max_context_is_named_when_it_sets_the_window() -> None:
    with pytest.raises(ValueError, match=r"window 65536 \(--max-context 65536\)"):
        check_memory(_checkpoint(), EngineConfig(max_seqs=4096, max_context=65536), available=GIB)


def test_a_converted_copy_of_the_weights_counts() -> None:
    weights = {"w": torch.zeros(1000, 1000)}  # float32, 4 MB
    assert weights_to_copy(_checkpoint(weights), EngineConfig(device="cpu")) == 0  # used as they are
    assert weights_to_copy(_checkpoint(weights), EngineConfig(device="cpu", dtype="bfloat16")) == 2_000_000
