"""The engine's large buffers sized from the config before any is allocated (memory_plan.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.memory_plan import GIB, check_memory, fit_slots, planned, weights_to_copy
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


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Configs that resolve to a GPU on this CPU host: the sizing is arithmetic on the figures given."""
    monkeypatch.setattr(EngineConfig, "resolved_device", lambda self: "cuda")


def test_gpu_memory_utilization_sizes_the_slots_from_free_memory(on_cuda: None) -> None:
    weights = {"w": torch.zeros(1000, 1000)}  # 4 MB copied to the GPU
    config = EngineConfig(max_seqs=16, max_context=65536, kv_cache_dtype="bfloat16", cpu_threads=1,
                          gpu_memory_utilization=0.9)
    free, device_total = 4 * GIB, 8 * GIB  # 4 GiB already held by something else
    # By hand: 0.9 x 8 GiB less the 4 GiB in use; fixed costs: the rotary tables (2^20 positions x
    # head_dim 16 x 32 bytes), one step's logits (2048 rows, the idle prefill budget, x 96 x 4), the
    # attention scratch (1 thread x 4 x 65536 x 4), the weights, and the padding slot's KV; each slot
    # its KV (2 x 2 layers x 2 heads x 65536 x 16 x 2 bytes = 16 MiB) and its penalty counts (96 x 5).
    budget = 0.9 * device_total - (device_total - free)
    slot_kv = 2 * 2 * 2 * 65536 * 16 * 2
    fixed = 2**20 * 16 * 32 + 2048 * 96 * 4 + 4 * 65536 * 4 + 4_000_000 + slot_kv
    want = int((budget - fixed) // (slot_kv + 96 * 5))
    fitted = fit_slots(_checkpoint(weights), config, free=free, device_total=device_total)
    assert fitted.max_seqs == want == 171
    check_memory(_checkpoint(weights), fitted, available=free, device_total=device_total)  # fits
    with pytest.raises(ValueError, match="the KV cache would take"):  # one slot more does not
        check_memory(_checkpoint(weights), replace(fitted, max_seqs=want + 1), available=free,
                     device_total=device_total)


def test_gpu_memory_utilization_is_bounded_and_refuses_too_little(on_cuda: None) -> None:
    config = EngineConfig(max_context=1024, gpu_memory_utilization=0.9)
    plenty = fit_slots(_checkpoint(), config, free=80 * GIB, device_total=80 * GIB)
    assert plenty.max_seqs == 4096  # max_seqs' own bound
    with pytest.raises(ValueError) as e:
        fit_slots(_checkpoint(), replace(config, gpu_memory_utilization=0.1), free=GIB, device_total=8 * GIB)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("gpu_memory_utilization 0.1 leaves 0.00 GiB of the GPU's 8.0 GiB")


def test_the_padding_slot_counts_on_cuda_only(on_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    kv = next(a for a in planned(ROPE, EngineConfig(max_seqs=4), window=1024) if a.what == "the KV cache")
    assert "max_seqs 4 + 1" in kv.because and kv.nbytes == 2 * 2 * 5 * 2 * 1024 * 16 * 4
    off = next(a for a in planned(ROPE, EngineConfig(max_seqs=4, cuda_graphs=False), window=1024)
               if a.what == "the KV cache")
    assert "max_seqs 4 x" in off.because and off.nbytes == 2 * 2 * 4 * 2 * 1024 * 16 * 4


def test_the_slots_are_max_seqs_off_cuda() -> None:
    config = EngineConfig(device="cpu", max_seqs=16, gpu_memory_utilization=0.5)
    assert fit_slots(_checkpoint(), config, free=80 * GIB, device_total=80 * GIB) is config
