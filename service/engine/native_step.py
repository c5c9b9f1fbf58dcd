"""Forwards as one native call (native/decode.c), on CPU, float32 or bfloat16 weights.

At batch 1 a decode step streams every weight once and is bound by memory bandwidth; through
torch's kernels it reached 5-7 GB/s of the 25-30 GB/s a plain two-thread read gets (on an AVX2
CPU; docs/performance.md), because each of the step's ~25 library calls is its own parallel
region with its own way of splitting the weight, and the Python between them is serial. The native
step runs the whole forward in one OpenMP region on the engine thread's own team (libgomp's entry
points, taken from the libgomp torch loaded), so it starts no second thread pool. Its rows are
tokens: decode rows and the tokens of prompt chunks alike, so one call runs a whole step's group.
Weights are repacked once into panels of 16 output features, so every loaded weight vector serves
up to six rows (it beat the oneDNN path at every batch and prompt size measured, 1 to 1024 rows).

It computes what `DecodeStep` and `GPT.forward` compute (the parity tests compare them) with a
different summation order, so logits agree to float32 rounding, not bit for bit. A bfloat16 model
keeps its weights and KV cache in bfloat16 (half the bytes to stream) but the step computes in
float32, widening each value as it is loaded: CPUs without bf16 arithmetic (AVX2-only ones) run
torch's bf16 kernels emulated, ~100x slower than float32 for matmuls. So its logits are those of
the float32 model with the same (bf16) weights and bf16-rounded keys and values, closer to that
than torch's bf16 forward, which rounds every intermediate to bf16. Each row is
computed on its own (no reduction runs across rows, and the threads split output features, never
a sum), so a row's logits do not depend on the batch around it or on the thread count.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from model.file_pages import FilePages
from model.gpt import GPT, Block
from service.engine.config import NATIVE_ISAS, TILE_ISAS
from service.engine.kv_slots import SpanKVCache

log = logging.getLogger(__name__)

_OMP_ENTRY_POINTS = ("GOMP_parallel", "GOMP_barrier", "omp_get_thread_num", "omp_get_num_threads")
_LIBRARY_NAME = "_decode"
_WEIGHTS_PER_LAYER = 12  # ln_1, c_attn, c_proj, ln_2, c_fc, mlp c_proj: weight and bias each
_LINEAR_WEIGHTS_AT = (2, 4, 8, 10)  # where c_attn, c_proj, c_fc and mlp c_proj's weights are in them
_TYPES = {torch.float32: 0, torch.bfloat16: 1}  # decode.c's F32, BF16


def library_path() -> Path | None:
    """The compiled native/decode.c (`pip install` builds it, see pyproject.toml), if present."""
    here = Path(__file__).parent / "native"
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"{_LIBRARY_NAME}{suffix}"
        if candidate.exists():
            return candidate
    return None


def omp_entry_points() -> list[int] | None:
    """Addresses of libgomp's parallel-region entry points as torch loaded them, or None when
    torch's OpenMP runtime does not export them (the step then runs on the calling thread)."""
    process = ctypes.CDLL(None)
    addresses = []
    for name in _OMP_ENTRY_POINTS:
        fn = getattr(process, name, None)
        if fn is None:
            return None
        addresses.append(ctypes.cast(fn, ctypes.c_void_p).value or 0)
    return addresses


def unavailable_reason(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> str | None:
    """Why the native step cannot run here, or None when it can."""
    if device.type != "cpu":
        return f"device is {device.type} (the native step is CPU-only)"
    for what, d in (("dtype", dtype), ("KV cache dtype", kv_dtype or dtype)):
        if d not in _TYPES:
            return f"{what} is {d} (the native step runs float32 and bfloat16)"
    if library_path() is None:
        return "service/engine/native/decode.c is not built (pip install builds it; needs a C compiler)"
    return None


PANEL = 16  # decode.c's PANEL


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear's (out, in) weight as decode.c reads it: panels of PANEL output features, (out /
    PANEL, in, PANEL), zero-padded to whole panels. bfloat16 interleaves each input's two halves
    of the panel (features j and j + 8 side by side), which decode.c widens with a shift and a mask."""
    out, inp = weight.shape
    full, half = out // PANEL, PANEL // 2
    packed = weight.new_zeros(-(-out // PANEL), inp, PANEL)
    # Written in place through a view of it in the weight's row order: no padded or transposed
    # copy of the weight on the way (at 124M the output layer's was a 154 MB start-up temporary).
    if weight.dtype == torch.bfloat16:
        rows = packed.view(-1, inp, half, 2).permute(0, 3, 2, 1)  # (panel, h, j, input): W[p*16 + 8h + j]
        rows[:full].copy_(weight[: full * PANEL].view(full, 2, half, inp))
        for r in range(full * PANEL, out):  # a last, partial panel: at most 15 rows
            rows[full, (r % PANEL) // half, r % half].copy_(weight[r])
    else:
        rows = packed.transpose(1, 2)  # (panel, j, input): W[p*16 + j]
        rows[:full].copy_(weight[: full * PANEL].view(full, PANEL, inp))
        if out > full * PANEL:
            rows[full, : out - full * PANEL].copy_(weight[full * PANEL :])
    return packed


def capture_weights(model: GPT) -> list[torch.Tensor | None]:
    """Copies of the model's weights in the order ns_create reads them (linear weights packed in
    panels), without the KV cache buffers (the step adds its cache's). Needs nn.Linear's layout:
    take them before any oneDNN packing (the engine does not pack where the native step runs).
    Embeddings and linear weights keep the model's dtype; biases and norms (a few KB) become
    float32. Copies, all of them: the step then shares no memory with the model or its checkpoint
    (whose tensors are views of the mapped file, and the mapping stays, whole and resident once
    read, while any one of them lives), so the engine can drop both (`release_weights`)."""

    pages = FilePages()  # a checkpoint file's pages go back as each weight is copied

    def copy(t: torch.Tensor | None, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        if t is None:
            return None
        out = make(t.detach())
        pages.release(t)
        return out

    def same(t: torch.Tensor) -> torch.Tensor:
        return t.to(memory_format=torch.contiguous_format, copy=True)

    def small(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float32, memory_format=torch.contiguous_format, copy=True)

    def linear(module: nn.Linear) -> list[torch.Tensor | None]:
        return [copy(module.weight, pack_panels), copy(module.bias, small)]

    def norm(module: nn.LayerNorm) -> list[torch.Tensor | None]:
        return [copy(module.weight, small), copy(module.bias, small)]

    # A tied output layer is the embedding: decode.c reads the embeddings from its panels then.
    tied = model.lm_head.weight is model.wte.weight
    if model.config.family != "gpt2" or model.wpe is None:
        raise ValueError("the native step runs the GPT-2 family only")
    w = [None if tied else copy(model.wte.weight, same), copy(model.wpe.weight, same)]
    blocks: list[Block] = list(model.h)  # type: ignore[arg-type]
    for block in blocks:
        attn, mlp = block.attn, block.mlp
        w += norm(cast(nn.LayerNorm, block.ln_1)) + linear(attn.c_attn) + linear(attn.c_proj)
        w += norm(cast(nn.LayerNorm, block.ln_2)) + linear(mlp.c_fc) + linear(mlp.c_proj)
    return w + norm(cast(nn.LayerNorm, model.ln_f)) + linear(model.lm_head)


def release_weights(model: GPT) -> int:
    """Free the model's weights once a NativeStep holds its own copies and runs every forward:
    without this the engine held the 124M model's linear weights twice (~490 MB in float32). They
    become meta tensors, so a torch forward fails loudly instead of computing with nothing.
    Returns the bytes released (freed once nothing else holds them: the engine keeps no checkpoint
    weights, see Engine.__init__)."""
    released = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied one once
    tied = model.lm_head.weight is model.wte.weight
    model.to(device="meta")
    if tied:  # conversion gives each module its own meta tensor
        model.lm_head.weight = model.wte.weight
    return released


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.ns_create.restype = ctypes.c_void_p
    lib.ns_create.argtypes = [
        *[ctypes.c_int] * 8, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p
    ]
    lib.ns_step.restype = None
    ptr, num = ctypes.c_void_p, ctypes.c_int
    lib.ns_step.argtypes = [ptr, num, ptr, ptr, ptr, num, ptr, ptr, num]
    lib.ns_free.restype = None
    lib.ns_free.argtypes = [ctypes.c_void_p]
    lib.ns_set_isa.restype = ctypes.c_int
    lib.ns_set_isa.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.ns_sample.restype = ctypes.c_int
    lib.ns_sample.argtypes = [ptr, num, num, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, num, ptr]
    for name, args in (("ns_tiles_only", [ctypes.c_void_p]), ("ns_tiles_possible", [ctypes.c_void_p]),
                       ("ns_tile_linear", [ctypes.c_void_p, ctypes.c_int])):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = args
    return lib


@dataclass
class SamplePenalties:
    """The repetition, frequency and presence penalties of NativeStep.sample's rows: per slot,
    whether each token was seen (prompt and generated) and how often it was generated, and each
    row's slot and factors (repetition 1, frequency and presence 0: none)."""

    seen: torch.Tensor  # (slots, V) bool
    counts: torch.Tensor  # (slots, V) int32
    slots: list[int]
    repetition: list[float]
    frequency: list[float]
    presence: list[float]

    def arrays(self, rows: int, vocab: int) -> list[torch.Tensor]:
        """The six arrays native/sampler.h reads, checked (it indexes raw memory with slots)."""
        seen, counts = self.seen, self.counts
        if not (seen.dtype == torch.bool and counts.dtype == torch.int32 and seen.is_contiguous()
                and counts.is_contiguous() and seen.shape == counts.shape and seen.shape[1] == vocab):
            raise ValueError("native sample: seen (slots, V) bool and counts (slots, V) int32, contiguous")
        columns = (self.slots, self.repetition, self.frequency, self.presence)
        if any(len(c) != rows for c in columns) or not all(0 <= s < len(seen) for s in self.slots):
            raise ValueError("native sample: a slot and three factors per row, slots within the cache")
        return [seen, counts, torch.tensor(self.slots, dtype=torch.int64),
                *(torch.tensor(c, dtype=torch.float32) for c in columns[1:])]


class NativeStep:
    """(tokens, positions, slots) of the rows that each feed one token -> logits (B, V).

    The library keeps raw pointers into the weights and the cache's buffers: this object holds
    the tensors, so they live as long as it does."""

    def __init__(
        self, model: GPT, cache: SpanKVCache, max_threads: int, use_openmp: bool = True, max_rows: int = 0,
        hold_once: bool = False, max_isa: str = "auto",
    ) -> None:
        """`hold_once`: where a tile level runs (a bfloat16 model on a CPU with AVX512-BF16 or AMX),
        keep only the tile copy of the linear layers' weights and free the panels, which only the
        lower levels read (the engine does: the weights are then held once; `use_isa` then stays at
        a tile level).
        `max_isa`: the highest kernel level to use ("auto": the best this CPU has)."""
        path = library_path()
        if path is None:
            raise RuntimeError("service/engine/native/decode.c is not built")
        self._lib = _load(path)
        cfg = model.config
        self.vocab, self.window, self.slots = cfg.vocab_size, cache.capacity, cache.slots
        self.max_threads = max_threads
        self.max_rows = max(max_rows, cache.slots)
        weights = capture_weights(model)
        caches: list = list(cache.layers)
        tensors: list[torch.Tensor | None] = weights[:2]
        for i, layer in enumerate(caches):
            tensors += weights[2 + i * _WEIGHTS_PER_LAYER : 2 + (i + 1) * _WEIGHTS_PER_LAYER]
            tensors += [layer.k, layer.v]
        tensors += weights[2 + len(caches) * _WEIGHTS_PER_LAYER :]
        wdtype: torch.dtype = model.wte.weight.dtype
        kvdtype: torch.dtype = caches[0].k.dtype
        if wdtype not in _TYPES or kvdtype not in _TYPES:
            raise ValueError(
                f"the native step runs float32 and bfloat16, not {wdtype} weights / {kvdtype} cache"
            )
        for t in tensors:
            plain = t is None or (t.dtype in (torch.float32, wdtype, kvdtype) and t.device.type == "cpu"
                                  and t.is_contiguous())
            if not plain:
                raise ValueError("the native step needs contiguous CPU tensors of the model's dtype")
        self._tensors = tensors
        ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() if t is not None else None for t in tensors])
        omp = omp_entry_points() if use_openmp else None
        if omp is None and max_threads > 1:
            log.warning("native step: no libgomp entry points in this process, one thread only")
        self._omp = (ctypes.c_void_p * len(omp))(*omp) if omp else None
        self._handle = self._lib.ns_create(
            cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cache.slots, cache.capacity, self.max_rows,
            max_threads, cfg.layer_norm_epsilon, _TYPES[wdtype], _TYPES[kvdtype], ptrs, self._omp,
        )
        if not self._handle:
            raise MemoryError("the native step could not allocate its buffers")
        del weights  # self._tensors holds them now: a panel let go of below is freed at once
        cap = len(NATIVE_ISAS) - 1 if max_isa == "auto" else NATIVE_ISAS.index(max_isa)
        best_tiles = self._lib.ns_tiles_possible(self._handle)
        if hold_once and best_tiles and cap >= NATIVE_ISAS.index(TILE_ISAS[0]):
            self._hold_once_in_tiles(len(caches), min(cap, best_tiles))
        self.isa = NATIVE_ISAS[self._lib.ns_set_isa(self._handle, cap)]
        # Per-call arguments (tokens, positions, slots, logit rows); like the library's own scratch
        # buffers they make a NativeStep single-threaded: only the engine thread calls it.
        self._args: list[Any] = [(ctypes.c_int64 * self.max_rows)() for _ in range(4)]

    def _hold_once_in_tiles(self, n_layer: int, level: int) -> None:
        """A tile level with the weights held once: each linear's tiles are made and its panels
        freed in turn (all tiles first would hold every weight twice for a while); then only the
        tile levels run."""
        # Each layer's block of tensors is its weights, then k and v; the output layer's weight is
        # second to last. The library numbers the linears in the same order.
        per_layer = _WEIGHTS_PER_LAYER + 2
        panels = [2 + i * per_layer + at for i in range(n_layer) for at in _LINEAR_WEIGHTS_AT]
        for index, at in enumerate([*panels, len(self._tensors) - 2]):
            if not self._lib.ns_tile_linear(self._handle, index):
                raise MemoryError("the native step could not copy its weights into tiles")
            self._tensors[at] = None
        # From here the panels are gone: only the tile levels may run (the library reads none of them).
        if self._lib.ns_set_isa(self._handle, level) != level or not self._lib.ns_tiles_only(self._handle):
            raise MemoryError("the native step could not set up its tile kernels after copying its weights")

    def use_isa(self, name: str) -> str:
        """Use kernels of at most level `name` (one of NATIVE_ISAS; for comparisons and benchmarks:
        levels up to avx512 compute the same function, avx2 and avx512 the same bits; the tile
        levels round a bf16 model's linear inputs). Returns the level in effect, which is lower
        where the CPU lacks the instructions (or a tile level once the panels are gone)."""
        self.isa = NATIVE_ISAS[self._lib.ns_set_isa(self._handle, NATIVE_ISAS.index(name))]
        return self.isa

    def __call__(
        self, tokens: list[int], positions: list[int], slots: list[int], logit_rows: list[int] | None = None
    ) -> torch.Tensor:
        """Row i feeds tokens[i] at positions[i] into cache slot slots[i] (writing its key and
        value there) and attends over that slot's positions 0..positions[i]: decode rows, or the
        tokens of prompt chunks (a sequence's rows in position order, all in one call). Returns
        the logits (len(logit_rows), V) of rows `logit_rows` (default: every row)."""
        rows = len(tokens)
        if not 0 < rows <= self.max_rows or len(positions) != rows or len(slots) != rows:
            raise ValueError(
                f"the native step takes 1..{self.max_rows} rows of one token, position and slot each"
            )
        out = list(range(rows)) if logit_rows is None else logit_rows
        # The library indexes raw memory with these: check every one.
        for name, values, bound in (("token", tokens, self.vocab), ("position", positions, self.window),
                                    ("slot", slots, self.slots), ("logit row", out, rows)):
            if values and (min(values) < 0 or max(values) >= bound):  # builtins first, in C
                bad = next(v for v in values if not 0 <= v < bound)
                raise ValueError(f"native step: {name} {bad} is outside [0, {bound})")
        # Filled in place: building four ctypes arrays per call was ~2% of a batch-1 step at 10.7M.
        tok, pos, slot, sel = self._args
        tok[:rows], pos[:rows], slot[:rows], sel[: len(out)] = tokens, positions, slots, out
        logits = torch.empty(len(out), self.vocab, dtype=torch.float32)
        threads = max(1, min(torch.get_num_threads(), self.max_threads))
        self._lib.ns_step(self._handle, rows, tok, pos, slot, len(out), sel, logits.data_ptr(), threads)
        return logits

    def sample(
        self, logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
        min_p: list[float], uniform: list[float], out: torch.Tensor, penalties: SamplePenalties | None = None,
        *, typical_p: list[float] | None = None,
    ) -> None:
        """Draws out[r] (int64) for each row r of `logits` (N, V), float32 and contiguous on the
        CPU, whose temperature is above 0: the penalties (if given), temperature, top_k (0: off),
        top_p (1: off), min_p (0: off), typical_p (1 or None: off), then inverse-CDF sampling with
        uniform[r], the rules of model/sampling.py's whole-vocabulary path (native/sampler.h says
        what may differ). A row of temperature 0 gets the first largest of its penalised logits
        (torch's max); the out of rows below 0 is left as it is."""
        n, v = logits.shape
        typical_p = [1.0] * n if typical_p is None else typical_p
        columns = (temperature, top_k, top_p, min_p, typical_p, uniform)
        if not (logits.dtype == torch.float32 and logits.is_contiguous() and out.dtype == torch.int64
                and out.is_contiguous() and len(out) == n and all(len(c) == n for c in columns)):
            raise ValueError("native sample: (N, V) float32 logits; N of each parameter; N int64 outs")
        pen, keep = None, []
        if penalties is not None:
            keep = penalties.arrays(n, v)
            pen = (ctypes.c_void_p * 6)(*(a.data_ptr() for a in keep))
        t = torch.tensor(temperature, dtype=torch.float32)
        k = torch.tensor(top_k, dtype=torch.int64)
        p, mp, tp, u = (torch.tensor(c, dtype=torch.float64) for c in (top_p, min_p, typical_p, uniform))
        # Rows are dealt to threads whole: below ~64k logits a second thread's wake-up costs more.
        threads = max(1, min(torch.get_num_threads(), self.max_threads)) if n * v >= 1 << 16 else 1
        args = (logits.data_ptr(), t.data_ptr(), k.data_ptr(), p.data_ptr(), mp.data_ptr(), tp.data_ptr(),
                u.data_ptr(), out.data_ptr())
        if self._lib.ns_sample(self._handle, n, v, *args, threads, pen):
            raise MemoryError("native sample: no scratch memory")
        del keep  # (the arrays the library read, alive until here)

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.ns_free(handle)
