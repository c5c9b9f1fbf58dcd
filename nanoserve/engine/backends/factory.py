"""One choice at start-up: which backend computes, and why."""

from __future__ import annotations

import logging

import torch

from nanoserve.engine.backends.base import Backend
from nanoserve.engine.backends.native_backend import NativeBackend
from nanoserve.engine.backends.torch_backend import TorchBackend
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.graph_step import cuda_graphs_off
from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.engine.native_step import family_unsupported, unavailable_reason
from nanoserve.engine.packed_linear import packed_linear_supported
from nanoserve.model.gpt import GPT

log = logging.getLogger(__name__)


def native_unavailable(config: EngineConfig) -> str | None:
    """Why the native backend cannot serve with these settings here, or None when it can."""
    if config.compile:
        return "the model is compiled (the compiled graph runs every step)"
    device = torch.device(config.resolved_device())
    return unavailable_reason(device, config.torch_dtype, config.torch_kv_dtype)


def check_backend(config: EngineConfig) -> None:
    """Raise ValueError (one line) when the backend asked for cannot run: before anything loads."""
    if config.backend == "native" and (why := native_unavailable(config)):
        raise ValueError(f"backend native cannot run here: {why}")
    if config.quantize != "none" and (why := native_unavailable(config)):
        raise ValueError(f"quantize {config.quantize} needs the native backend, which cannot run here: {why}")


def choose_backend(model: GPT, config: EngineConfig, window: int, cpu_threads: int,
                   usable_vocab: int = 0) -> tuple[Backend, str]:
    """The backend for `model` (already on its device and dtype), with a KV cache of
    config.max_seqs slots x `window` tokens, and a sentence saying why it was chosen.
    `usable_vocab`: the ids the tokenizer can decode (the native backend screens its output layer
    over them, config.screen_head; 0: the model's whole vocabulary)."""
    check_backend(config)
    cfg = model.config
    # The cache holds the key/value heads (fewer than the query heads under grouped-query attention),
    # and under CUDA graphs one slot more, where a padded batch's padding rows write.
    graphs_off = cuda_graphs_off(config)
    cache = SpanKVCache(cfg.n_layer, config.max_seqs + (graphs_off is None), cfg.kv_heads, window,
                        cfg.head_dim, config.torch_kv_dtype, model.wte.weight.device)
    why_not_native = native_unavailable(config) or family_unsupported(cfg)
    if config.backend == "native" and why_not_native:
        raise ValueError(f"backend native cannot run here: {why_not_native}")
    if config.quantize != "none" and why_not_native:
        raise ValueError(
            f"quantize {config.quantize} needs the native backend, which cannot run here: {why_not_native}"
        )
    if config.backend == "torch":
        why = "asked for (backend torch)"
    elif why_not_native is None:
        # Its capacity: the largest step the engine runs.
        rows = max(config.max_seqs, config.prefill_budget, config.idle_prefill_budget)
        usable = usable_vocab or cfg.vocab_size
        backend: Backend = NativeBackend(model, cache, max_rows=rows, cpu_threads=cpu_threads,
                                         isa=config.native_isa, quantize=config.quantize,
                                         screen_usable=usable if config.screen_head else 0)
        why = "asked for" if config.backend == "native" else "CPU, library built, float32/bfloat16 model"
        return backend, why
    else:
        why = f"the native backend cannot run: {why_not_native}"
    pack = config.packed_linear and packed_linear_supported(model.wte.weight.device, config.torch_dtype)
    graph_rows = config.max_seqs if graphs_off is None else 0
    on_gpu = model.wte.weight.device.type == "cuda"  # where the flash kernels and device sampling pay
    return TorchBackend(model, cache, compile=config.compile, pack=pack, batch_hint=config.max_seqs,
                        graph_rows=graph_rows, graphs_off=graphs_off or "", flash_prefill=on_gpu,
                        device_sampler=on_gpu), why
