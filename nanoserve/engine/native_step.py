"""Forwards as one native call (native/decode.c), on CPU, float32 or bfloat16 weights, for models of
the GPT-2 and the Llama family (RMSNorm, SwiGLU, rotary positions, grouped-query attention).

At batch 1 a decode step streams every weight once and is bound by memory bandwidth; through
torch's kernels it reached 5-7 GB/s of the 25-30 GB/s a plain two-thread read gets (on an AVX2
CPU; docs/performance.md), because each of the step's ~25 library calls is its own parallel
region with its own way of splitting the weight, and the Python between them is serial. The native
step runs the whole forward in one OpenMP region on the engine thread's own team (libgomp's entry
points, taken from the libgomp torch loaded), so it starts no second thread pool. Its rows are
tokens: decode rows and the tokens of prompt chunks alike, so one call runs a whole step's group.
Weights are repacked once into panels of 16 output features, so every loaded weight vector serves
up to six rows (it beat the oneDNN path at every batch and prompt size measured, 1 to 1024 rows).

It computes what `TorchDecodeStep` and `GPT.forward` compute (the parity tests compare them) with a
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from nanoserve.engine.config import NATIVE_ISAS, QUANTIZE, TILE_ISAS
from nanoserve.engine.int8_weights import pack_int8_panels, quantize_int8
from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.engine.native_abi import (
    FAMILY_CHOICES,
    Config,
    Layer,
    LibraryMismatch,
    OpenMP,
    Penalties,
    SampleArgs,
    StepArgs,
    Weights,
    load,
)
from nanoserve.model.config import GPTConfig
from nanoserve.model.file_pages import FilePages
from nanoserve.model.gpt import GPT, Block

log = logging.getLogger(__name__)

# libgomp's entry points by the ns_openmp field that takes each.
_OMP_ENTRY_POINTS = {"parallel": "GOMP_parallel", "thread_num": "omp_get_thread_num",
                     "num_threads": "omp_get_num_threads"}
_LIBRARY_NAME = "_decode"
_DTYPES = (torch.float32, torch.bfloat16)  # the library's NS_F32 and NS_BF16
_LAYER_LINEARS = ("attn", "proj", "fc", "mproj")  # ns_layer's linears, in ns_tile_linear's numbering


def family_unsupported(config: GPTConfig) -> str | None:
    """Why the native kernels cannot compute a model of this configuration, or None when they can
    (its norm, MLP and positions each one the library knows: native_abi.FAMILY_CHOICES)."""
    for what in ("norm", "mlp", "positions"):
        if (choice := getattr(config, what)) not in FAMILY_CHOICES:
            return f"its kernels have no {what} {choice!r}"
    return None


def library_path() -> Path | None:
    """The compiled native/decode.c (`pip install` builds it, see pyproject.toml), if present."""
    here = Path(__file__).parent / "native"
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"{_LIBRARY_NAME}{suffix}"
        if candidate.exists():
            return candidate
    return None


def omp_entry_points() -> dict[str, int] | None:
    """Addresses of libgomp's parallel-region entry points as torch loaded them, by ns_openmp field,
    or None when torch's OpenMP runtime does not export them (the step then runs on the calling
    thread)."""
    process = ctypes.CDLL(None)
    addresses = {}
    for field, name in _OMP_ENTRY_POINTS.items():
        fn = getattr(process, name, None)
        if fn is None:
            return None
        addresses[field] = ctypes.cast(fn, ctypes.c_void_p).value or 0
    return addresses


def unavailable_reason(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> str | None:
    """Why the native step cannot run here, or None when it can."""
    if device.type != "cpu":
        return f"device is {device.type} (the native step is CPU-only)"
    for what, d in (("dtype", dtype), ("KV cache dtype", kv_dtype or dtype)):
        if d not in _DTYPES:
            return f"{what} is {d} (the native step runs float32 and bfloat16)"
    path = library_path()
    if path is None:
        return "nanoserve/engine/native/decode.c is not built (pip install builds it; needs a C compiler)"
    try:
        load(path)
    except (LibraryMismatch, OSError) as e:
        return f"the native library does not match this code ({e})"
    return None


def pack_panels(weight: torch.Tensor, panel: int) -> torch.Tensor:
    """nn.Linear's (out, in) weight as decode.c reads it: panels of `panel` (the library's NS_PANEL)
    output features, (out / panel, in, panel), zero-padded to whole panels. bfloat16 interleaves each
    input's two halves of the panel (features j and j + panel / 2 side by side), which decode.c
    widens with a shift and a mask."""
    out, inp = weight.shape
    full, half = out // panel, panel // 2
    packed = weight.new_zeros(-(-out // panel), inp, panel)
    # Written in place through a view of it in the weight's row order: no padded or transposed
    # copy of the weight on the way (at 124M the output layer's was a 154 MB start-up temporary).
    if weight.dtype == torch.bfloat16:
        rows = packed.view(-1, inp, half, 2).permute(0, 3, 2, 1)  # (panel, h, j, input): W[p*16 + 8h + j]
        rows[:full].copy_(weight[: full * panel].view(full, 2, half, inp))
        for r in range(full * panel, out):  # a last, partial panel
            rows[full, (r % panel) // half, r % half].copy_(weight[r])
    else:
        rows = packed.transpose(1, 2)  # (panel, j, input): W[p*16 + j]
        rows[:full].copy_(weight[: full * panel].view(full, panel, inp))
        if out > full * panel:
            rows[full, : out - full * panel].copy_(weight[full * panel :])
    return packed


def gate_up_panels(t: torch.Tensor, panel: int) -> torch.Tensor:
    """SwiGLU's fused c_fc weight (2 H, in) or bias (2 H,), gate rows then up rows (nanoserve/model/gpt.py's
    MLP), as ns_layer's fc takes it: each half padded with zeros to whole panels (Hp rows), then
    interleaved panel by panel (gate panel i, up panel i, ...), (2 Hp, ...), so that one panel pair
    of decode.c gives silu(gate) * up for `panel` features."""
    hidden, rest = t.shape[0] // 2, t.shape[1:]
    padded = -(-hidden // panel) * panel
    halves = t.new_zeros((2, padded, *rest))
    halves[:, :hidden].copy_(t.reshape(2, hidden, *rest))
    # (2, Hp / panel, panel, ...) -> (Hp / panel, 2, panel, ...): panel i of gate, then of up
    return halves.view(2, padded // panel, panel, *rest).transpose(0, 1).reshape(2 * padded, *rest)


def capture_weights(
    model: GPT, panel: int, int8_group: int = 0, int8_head: bool = True
) -> dict[str, torch.Tensor | None]:
    """Copies of the model's weights, each by the path of the ns_weights field that points to it
    ("wte", "layers.0.attn.w", "head.b"; native/nanoserve_native.h), linear weights packed in panels
    of `panel` (a SwiGLU MLP's gate and up interleaved, see gate_up_panels), without the KV cache
    buffers (the step adds its cache's); wpe None with rotary positions. Needs nn.Linear's layout:
    take them before any oneDNN packing (the engine does not pack where the native step runs).
    Embeddings and linear weights keep the model's dtype; biases and norms (a few KB) become
    float32. With `int8_group` (the library's NS_I8_GROUP) the linear layers' weights are int8
    instead, with a scale per output feature ("attn.scale"; int8_weights.py), the output layer's
    too unless not `int8_head`. Copies, all of them: the step then shares no memory with the model
    or its checkpoint (whose tensors are views of the mapped file, and the mapping stays, whole and
    resident once read, while any one of them lives), so the engine can drop both
    (`release_weights`)."""

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

    def packed(t: torch.Tensor) -> torch.Tensor:
        return pack_panels(t, panel)

    def gate_up(t: torch.Tensor) -> torch.Tensor:
        return pack_panels(gate_up_panels(t, panel), panel)

    def gate_up_bias(t: torch.Tensor) -> torch.Tensor:
        return small(gate_up_panels(t, panel))

    # A tied output layer is the embedding: decode.c reads the embeddings from its panels then
    # (float ones: an int8 output layer leaves the embeddings their own copy).
    tied = model.lm_head.weight is model.wte.weight and not (int8_group and int8_head)
    wpe = model.wpe.weight if model.wpe is not None else None
    w = {"wte": None if tied else copy(model.wte.weight, same), "wpe": copy(wpe, same)}

    def linear(name: str, module: nn.Linear, gated: bool = False) -> None:
        w[f"{name}.b"] = copy(module.bias, gate_up_bias if gated else small)
        w[f"{name}.scale"] = None
        if int8_group and (int8_head or name != "head"):
            # Quantized per output feature after SwiGLU's interleave, so the scales follow it.
            order = (lambda t: gate_up_panels(t, panel)) if gated else (lambda t: t)
            q, w[f"{name}.scale"] = quantize_int8(order(module.weight))
            w[f"{name}.w"] = copy(module.weight, lambda _: pack_int8_panels(q, panel, int8_group))
        else:
            w[f"{name}.w"] = copy(module.weight, gate_up if gated else packed)

    def norm(name: str, module: nn.Module) -> None:
        module = cast(nn.LayerNorm | nn.RMSNorm, module)  # a LayerNorm's bias is optional, RMSNorm has none
        bias = getattr(module, "bias", None)
        w[f"{name}.w"], w[f"{name}.b"] = copy(module.weight, small), copy(bias, small)

    blocks: list[Block] = list(model.h)  # type: ignore[arg-type]
    for i, block in enumerate(blocks):
        attn, mlp = block.attn, block.mlp
        norm(f"layers.{i}.ln1", block.ln_1)
        linear(f"layers.{i}.attn", attn.c_attn)
        linear(f"layers.{i}.proj", attn.c_proj)
        norm(f"layers.{i}.ln2", block.ln_2)
        linear(f"layers.{i}.fc", mlp.c_fc, gated=mlp.swiglu)
        linear(f"layers.{i}.mproj", mlp.c_proj)
    norm("lnf", model.ln_f)
    linear("head", model.lm_head)
    return w


def point_at(struct: ctypes.Structure, tensors: Mapping[str, torch.Tensor | None], prefix: str = "") -> None:
    """Each pointer field of `struct`, and of the structs in it, at the memory of the tensor named
    by its path (`prefix` + "attn.w"; None: NULL). A field with no tensor of its name is a KeyError."""
    for name, kind, *_ in struct._fields_:
        if isinstance(kind, type) and issubclass(kind, ctypes.Structure):
            point_at(getattr(struct, name), tensors, f"{prefix}{name}.")
        elif kind is ctypes.c_void_p:
            t = tensors[prefix + name]
            setattr(struct, name, None if t is None else t.data_ptr())


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

    def arrays(self, rows: int, vocab: int) -> dict[str, torch.Tensor]:
        """The six arrays native/sampler.inc reads, by ns_penalties field, checked (it indexes raw
        memory with slots)."""
        seen, counts = self.seen, self.counts
        if not (seen.dtype == torch.bool and counts.dtype == torch.int32 and seen.is_contiguous()
                and counts.is_contiguous() and seen.shape == counts.shape and seen.shape[1] == vocab):
            raise ValueError("native sample: seen (slots, V) bool and counts (slots, V) int32, contiguous")
        columns = (self.slots, self.repetition, self.frequency, self.presence)
        if any(len(c) != rows for c in columns) or not all(0 <= s < len(seen) for s in self.slots):
            raise ValueError("native sample: a slot and three factors per row, slots within the cache")
        factors = {name: torch.tensor(c, dtype=torch.float32)
                   for name, c in (("repetition", self.repetition), ("frequency", self.frequency),
                                   ("presence", self.presence))}
        slot = torch.tensor(self.slots, dtype=torch.int64)
        return {"seen": seen, "counts": counts, "slot": slot, **factors}


class NativeStep:
    """(tokens, positions, slots) of the rows that each feed one token -> logits (B, V).

    The library keeps raw pointers into the weights and the cache's buffers: this object holds
    the tensors, so they live as long as it does."""

    def __init__(
        self, model: GPT, cache: SpanKVCache, max_threads: int, use_openmp: bool = True, max_rows: int = 0,
        hold_once: bool = False, max_isa: str = "auto", quantize: str = "none", int8_head: bool = True,
        screen_usable: int = 0,
    ) -> None:
        """`hold_once`: where a tile level runs (a bfloat16 model on a CPU with AVX512-BF16 or AMX),
        keep only the tile copy of the linear layers' weights and free the panels, which only the
        lower levels read (the engine does: the weights are then held once; `use_isa` then stays at
        a tile level).
        `max_isa`: the highest kernel level to use ("auto": the best this CPU has).
        `quantize`: "int8" runs the linear layers on int8 copies of their weights (int8_weights.py;
        the output layer's too unless not `int8_head`), "none" on the model's.
        `screen_usable`: screen the output layer (`screen_head`), logits from it on never screened
        in; 0: do not."""
        if quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
        path = library_path()
        if path is None:
            raise RuntimeError("nanoserve/engine/native/decode.c is not built")
        native = load(path)  # LibraryMismatch where it is not the library this code was written for
        self._lib, self._levels = native.lib, native.isa_levels
        cfg = model.config
        self.vocab, self.window, self.slots = cfg.vocab_size, cache.capacity, cache.slots
        self.max_threads = max_threads
        self.max_rows = max(max_rows, cache.slots)
        wdtype: torch.dtype = model.wte.weight.dtype
        caches: list = list(cache.layers)
        kvdtype: torch.dtype = caches[0].k.dtype
        if wdtype not in _DTYPES or kvdtype not in _DTYPES:
            raise ValueError(
                f"the native step runs float32 and bfloat16, not {wdtype} weights / {kvdtype} cache"
            )
        if why := family_unsupported(cfg):
            raise ValueError(f"the native step cannot run this model: {why}")
        if caches[0].k.shape[1] != cfg.kv_heads:
            raise ValueError(f"the KV cache holds {caches[0].k.shape[1]} heads, the model {cfg.kv_heads}")
        types = {torch.float32: native.f32, torch.bfloat16: native.bf16}
        config = Config(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, vocab=cfg.vocab_size,
                        slots=cache.slots, window=cache.capacity, max_rows=self.max_rows,
                        max_threads=max_threads, eps=cfg.layer_norm_epsilon, weight_type=types[wdtype],
                        kv_type=types[kvdtype], n_kv_head=cfg.kv_heads, mlp_hidden=cfg.hidden,
                        norm=native.family[cfg.norm], mlp=native.family[cfg.mlp],
                        positions=native.family[cfg.positions], rope_theta=cfg.rope_theta)
        # Named as the ns_weights fields that point at them: this object holds them for the library.
        group = native.i8_group if quantize == "int8" else 0
        self._tensors = capture_weights(model, native.panel, int8_group=group, int8_head=int8_head)
        for i, layer in enumerate(caches):
            self._tensors[f"layers.{i}.k"], self._tensors[f"layers.{i}.v"] = layer.k, layer.v
        for t in self._tensors.values():
            plain = t is None or (t.dtype in (torch.float32, wdtype, kvdtype, torch.int8)
                                  and t.device.type == "cpu" and t.is_contiguous())
            if not plain:
                raise ValueError("the native step needs contiguous CPU tensors of the model's dtype")
        self._handle: int | None = self._create(config, cfg.n_layer, use_openmp)
        cap = self._levels[NATIVE_ISAS[-1] if max_isa == "auto" else max_isa]
        best_tiles = self._lib.ns_tiles_possible(self._handle)
        if hold_once and best_tiles and cap >= self._levels[TILE_ISAS[0]]:
            self._hold_once_in_tiles(cfg.n_layer, min(cap, best_tiles))
        self.isa = self._isa_name(self._lib.ns_set_isa(self._handle, cap))
        # Per-call arguments (tokens, positions, slots, logit rows), the arrays and the struct that
        # points at them made once; like the library's own scratch buffers they make a NativeStep
        # single-threaded: only the engine thread calls it.
        self._args: list[Any] = [(ctypes.c_int64 * self.max_rows)() for _ in range(4)]
        tok, pos, slot, out = (ctypes.addressof(a) for a in self._args)
        self._step = StepArgs(tok=tok, pos=pos, slot=slot, out=out)
        self._step_ptr = ctypes.pointer(self._step)
        self._screen: Any = (ctypes.c_int32 * self.max_rows)()
        self.screening = False
        if screen_usable:
            self.screen_head(model, screen_usable)

    def screen_head(self, model: GPT, usable: int) -> bool:
        """Screen the output layer (native/head_screen.inc) where a step's every row wants only its
        k largest logits (`__call__`'s `screen`): a float32 model (not quantized) on a CPU with
        AVX512-BF16. Holds a row-major float32 copy of the output layer's weights (its exact
        recomputation reads one output's weights as one row) and the library a bf16 one. Logits
        from `usable` on are never screened in. Call before the model's weights are released.
        Returns whether it is on."""
        if self.screening:
            return True
        weight = model.lm_head.weight
        quantized = self._tensors.get("head.scale") is not None
        if weight.dtype != torch.float32 or quantized or not 0 < usable <= self.vocab:
            return False
        rowmajor = weight.detach().to(memory_format=torch.contiguous_format, copy=True)
        if not self._lib.ns_screen_head(self._handle, rowmajor.data_ptr(), usable):
            return False
        self._tensors["screen.rowmajor"] = rowmajor
        self.screening = True
        return True

    def _create(self, config: Config, n_layer: int, use_openmp: bool) -> int:
        """The library's model over self._tensors (its handle)."""
        weights, layers = Weights(), (Layer * n_layer)()
        point_at(weights, self._tensors)
        for i in range(n_layer):
            point_at(layers[i], self._tensors, f"layers.{i}.")
        weights.layers = layers
        omp = omp_entry_points() if use_openmp else None
        if omp is None and config.max_threads > 1:
            log.warning("native step: no libgomp entry points in this process, one thread only")
        handle = self._lib.ns_create(ctypes.byref(config), ctypes.byref(weights),
                                     ctypes.byref(OpenMP(**omp)) if omp else None)
        if not handle:
            raise MemoryError("the native step could not allocate its buffers")
        return int(handle)

    def _isa_name(self, level: int) -> str:
        return next(name for name, at in self._levels.items() if at == level)

    def _hold_once_in_tiles(self, n_layer: int, level: int) -> None:
        """A tile level with the weights held once: each linear's tiles are made and its panels
        freed in turn (all tiles first would hold every weight twice for a while); then only the
        tile levels run."""
        panels = [f"layers.{i}.{name}.w" for i in range(n_layer) for name in _LAYER_LINEARS]
        for index, name in enumerate([*panels, "head.w"]):  # ns_tile_linear's numbering
            if not self._lib.ns_tile_linear(self._handle, index):
                raise MemoryError("the native step could not copy its weights into tiles")
            self._tensors[name] = None
        # From here the panels are gone: only the tile levels may run (the library reads none of them).
        if self._lib.ns_set_isa(self._handle, level) != level or not self._lib.ns_tiles_only(self._handle):
            raise MemoryError("the native step could not set up its tile kernels after copying its weights")

    def use_isa(self, name: str) -> str:
        """Use kernels of at most level `name` (one of NATIVE_ISAS; for comparisons and benchmarks:
        levels up to avx512 compute the same function, avx2 and avx512 the same bits; the tile
        levels round a bf16 model's linear inputs). Returns the level in effect, which is lower
        where the CPU lacks the instructions (or a tile level once the panels are gone)."""
        self.isa = self._isa_name(self._lib.ns_set_isa(self._handle, self._levels[name]))
        return self.isa

    def __call__(
        self, tokens: list[int], positions: list[int], slots: list[int], logit_rows: list[int] | None = None,
        screen: list[int] | None = None,
    ) -> torch.Tensor:
        """Row i feeds tokens[i] at positions[i] into cache slot slots[i] (writing its key and
        value there) and attends over that slot's positions 0..positions[i]: decode rows, or the
        tokens of prompt chunks (a sequence's rows in position order, all in one call). Returns
        the logits (len(logit_rows), V) of rows `logit_rows` (default: every row). `screen`: per
        logit row, k if only its k largest logits will be read (then, with `screen_head` on and
        every row's k at most 256, only those are exact: see native/head_screen.inc), 0 if all."""
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
        step = self._step  # points at self._args already: only the counts and the logits change
        step.rows, step.n_out, step.logits = rows, len(out), logits.data_ptr()
        step.threads = max(1, min(torch.get_num_threads(), self.max_threads))
        step.screen = None
        if self.screening and screen is not None and len(screen) == len(out) and all(screen):
            self._screen[: len(out)] = screen
            step.screen = ctypes.addressof(self._screen)
        self._lib.ns_step(self._handle, self._step_ptr)
        return logits

    def sample(
        self, logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
        min_p: list[float], uniform: list[float], out: torch.Tensor, penalties: SamplePenalties | None = None,
        *, typical_p: list[float] | None = None,
    ) -> None:
        """Draws out[r] (int64) for each row r of `logits` (N, V), float32 and contiguous on the
        CPU, whose temperature is above 0: the penalties (if given), temperature, top_k (0: off),
        top_p (1: off), min_p (0: off), typical_p (1 or None: off), then inverse-CDF sampling with
        uniform[r], the rules of nanoserve/model/sampling.py's whole-vocabulary path (native/sampler.inc says
        what may differ). A row of temperature 0 gets the first largest of its penalised logits
        (torch's max); the out of rows below 0 is left as it is."""
        n, v = logits.shape
        typical_p = [1.0] * n if typical_p is None else typical_p
        columns = (temperature, top_k, top_p, min_p, typical_p, uniform)
        if not (logits.dtype == torch.float32 and logits.is_contiguous() and out.dtype == torch.int64
                and out.is_contiguous() and len(out) == n and all(len(c) == n for c in columns)):
            raise ValueError("native sample: (N, V) float32 logits; N of each parameter; N int64 outs")
        pen, keep = None, {}
        if penalties is not None:
            keep = penalties.arrays(n, v)
            pen = ctypes.pointer(Penalties(**{name: a.data_ptr() for name, a in keep.items()}))
        t = torch.tensor(temperature, dtype=torch.float32)
        k = torch.tensor(top_k, dtype=torch.int64)
        p, mp, tp, u = (torch.tensor(c, dtype=torch.float64) for c in (top_p, min_p, typical_p, uniform))
        # Rows are dealt to threads whole: below ~64k logits a second thread's wake-up costs more.
        threads = max(1, min(torch.get_num_threads(), self.max_threads)) if n * v >= 1 << 16 else 1
        args = SampleArgs(logits=logits.data_ptr(), temperature=t.data_ptr(), top_k=k.data_ptr(),
                          top_p=p.data_ptr(), min_p=mp.data_ptr(), typical_p=tp.data_ptr(),
                          uniform=u.data_ptr(), out=out.data_ptr(), penalties=pen, rows=n, vocab=v,
                          threads=threads)
        if self._lib.ns_sample(self._handle, ctypes.byref(args)):
            raise MemoryError("native sample: no scratch memory")
        del keep  # (the arrays the library read, alive until here)

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.ns_free(handle)
