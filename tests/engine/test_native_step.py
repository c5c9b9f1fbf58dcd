"""The native step (nanoserve/engine/native/decode.c) gives the torch decode step's logits, and the
model's for the Llama family."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from nanoserve.engine.config import NATIVE_ISAS, TILE_ISAS
from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.engine.native_step import NativeStep, omp_entry_points
from nanoserve.engine.packed_linear import PackedLinear
from nanoserve.engine.torch_decode import TorchDecodeStep
from nanoserve.model.checkpoint import Checkpoint, load_checkpoint
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from tests.engine.conftest import EngineFactory, collect, make_lively_checkpoint, token_ids

# Widths that are not multiples of the kernels' vector and block sizes (40 features, heads of 10,
# 97 logits), so every tail path runs; and the common aligned shape.
SHAPES = {
    "ragged": GPTConfig(vocab_size=97, block_size=48, n_layer=2, n_head=4, n_embd=40),
    "aligned": GPTConfig(vocab_size=64, block_size=48, n_layer=2, n_head=2, n_embd=64, bias=False),
}


def _llama(**sizes: Any) -> GPTConfig:
    return GPTConfig(norm="rmsnorm", mlp="swiglu", positions="rope", block_size=48, **sizes)


# The Llama family (RMSNorm, SwiGLU, rotary positions): grouped-query attention (two query heads
# per key/value head), untied; multi-query with a group of six (more than the four queries one
# pass of the vector kernel takes), biases and an MLP width of 40 (gate and up padded to whole
# panels), tied; multi-head with heads of 64; heads of 10 (no vector kernel blocks).
LLAMA_SHAPES = {
    "llama gqa": _llama(vocab_size=97, n_layer=2, n_head=4, n_embd=64, n_kv_head=2, bias=False,
                        tie_embeddings=False),
    "llama mqa": _llama(vocab_size=64, n_layer=2, n_head=6, n_embd=96, n_kv_head=1, mlp_hidden=40),
    "llama mha": _llama(vocab_size=64, n_layer=1, n_head=2, n_embd=128, bias=False, rope_theta=500000.0),
    "llama ragged": _llama(vocab_size=97, n_layer=2, n_head=4, n_embd=40, n_kv_head=2, tie_embeddings=False),
}
ALL_SHAPES = {**SHAPES, **LLAMA_SHAPES}


pytestmark = [pytest.mark.usefixtures("native_library"), pytest.mark.backends("native")]


def _model(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # sharper logits than GPT-2's init: differences would show
    return model


def _bf16_pair(model: GPT) -> tuple[GPT, GPT]:
    """The model in bfloat16 (as the native step gets it), and the float32 model of the same
    bfloat16-rounded weights (the reference: the native step computes in float32)."""
    low = copy.deepcopy(model).to(torch.bfloat16)
    return low, copy.deepcopy(low).float()


@contextlib.contextmanager
def _bf16_inputs(model: torch.nn.Module, active: bool) -> Iterator[list[Any]]:
    """While active, every linear layer of `model` (oneDNN-packed ones too) rounds its input to
    bfloat16 first, as the native step's tile levels do (and torch's bf16 linear layers). Yields
    the hooks, one per linear layer."""
    hooks = [
        module.register_forward_pre_hook(lambda _m, args: (args[0].to(torch.bfloat16).float(), *args[1:]))
        for module in model.modules() if active and isinstance(module, (torch.nn.Linear, PackedLinear))
    ]
    try:
        yield hooks
    finally:
        for hook in hooks:
            hook.remove()


# Two float32 computations of the same logits in another order are float32 rounding apart. Where the
# reference's own distance from the exact (float64) logits is known, the bound is derived from it
# (`_float32_apart`); this is the least allowed, and the bound where no float64 run is made.
FLOAT32_TOL = 2e-5
# A bf16 rounding (of a cached key, of a linear layer's input) that a float32 rounding difference
# flips moves that value by one bf16 unit (2^-8 of it): bf16's own error, which the logits of these
# sharp test models (magnitudes up to ~13) carry as at most a few 1e-2.
BF16_FLIP_TOL = 3e-2


def _chunked_logits(
    model: GPT, cache: SpanKVCache, work: list[tuple[int, int, int]], tokens: list[int]
) -> torch.Tensor:
    """The model's logits for `work`'s chunks, (slot, first position, tokens) each, fed in order
    over `cache` (which `tokens` follow); one row per token."""
    out, at = [], 0
    for slot, start, n in work:
        cache.prepare([slot], [start + n])
        toks = torch.tensor(tokens[at : at + n]).view(1, -1)
        pos = torch.arange(start, start + n).view(1, -1)
        out.append(model(toks, input_pos=pos, cache=cache, slots=torch.tensor([slot]))[0])
        at += n
    return torch.cat(out)


def _float32_apart(
    model: GPT, lengths: dict[int, int], work: list[tuple[int, int, int]], tokens: list[int],
    want: torch.Tensor,
) -> float:
    """How far another float32 computation of `want` may be from it. The reference is as far from
    the exact logits (the model in float64) as float32 rounding through these layers takes it; the
    native step, summing the same products in another order, is about as far on its own side, and
    its C level, which rounds every product before adding it, up to twice that: 4x the reference's
    measured error, never less than FLOAT32_TOL. (On AMD hosts torch's kernels happen to round
    close to the native ones; Intel's oneDNN kernels sum in other orders, up to 2.3x further.)"""
    exact_model = copy.deepcopy(model).double()
    exact = _chunked_logits(exact_model, _prefilled(exact_model, 8, lengths, torch.float64), work, tokens)
    return max(FLOAT32_TOL, 4 * float((want.double() - exact).abs().max()))


def _prefilled(
    model: GPT, slots: int, lengths: dict[int, int], dtype: torch.dtype = torch.float32
) -> SpanKVCache:
    """A cache of `dtype` with slot s prefilled by `model` for lengths[s] positions."""
    cfg = model.config
    cache = SpanKVCache(cfg.n_layer, slots, cfg.kv_heads, cfg.block_size, cfg.head_dim, dtype, "cpu")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for slot, n in lengths.items():
            cache.prepare([slot], [n])
            prompt = torch.randint(0, cfg.vocab_size, (1, n), generator=gen)
            model(prompt, input_pos=torch.arange(n).view(1, -1), cache=cache, slots=torch.tensor([slot]))
    return cache


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("rows", [1, 3, 5])  # 5: a block of three rows and two single rows
@pytest.mark.parametrize("openmp", [True, False])
@torch.no_grad()
def test_native_step_matches_the_torch_decode_step(shape: str, rows: int, openmp: bool) -> None:
    if openmp and omp_entry_points() is None:
        pytest.skip("torch's OpenMP runtime exports no libgomp entry points here")
    model = _model(SHAPES[shape])
    slots = [6, 0, 3, 1, 4][:rows]  # scattered slots, each at its own position
    lengths = dict(zip(slots, [5, 17, 1, 30, 9], strict=False))
    torch_cache, native_cache = _prefilled(model, 8, lengths), _prefilled(model, 8, lengths)
    reference = TorchDecodeStep(model, torch_cache)
    native = NativeStep(model, native_cache, max_threads=2, use_openmp=openmp)
    gen = torch.Generator().manual_seed(2)
    positions = [lengths[s] for s in slots]
    torch.set_num_threads(2)
    try:
        for _ in range(4):
            tokens = torch.randint(0, model.config.vocab_size, (rows,), generator=gen).tolist()
            torch_cache.prepare(slots, [p + 1 for p in positions])
            want = reference(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots))
            got = native(tokens, positions, slots)
            torch.testing.assert_close(got, want, rtol=FLOAT32_TOL, atol=FLOAT32_TOL)
            positions = [p + 1 for p in positions]
    finally:
        torch.set_num_threads(1)
    # The keys and values it wrote are the torch path's, to rounding.
    for theirs, ours in zip(torch_cache.layers, native_cache.layers, strict=True):
        torch.testing.assert_close(ours.k, theirs.k, rtol=FLOAT32_TOL, atol=FLOAT32_TOL)  # type: ignore[union-attr]
        torch.testing.assert_close(ours.v, theirs.v, rtol=FLOAT32_TOL, atol=FLOAT32_TOL)  # type: ignore[union-attr]


@pytest.mark.parametrize("shape", sorted(SHAPES))
@torch.no_grad()
def test_an_untied_output_layer_reads_its_own_weights_and_the_embeddings_theirs(shape: str) -> None:
    # Tied models (every GPT here) read their embeddings from the output layer's panels; an
    # untied one must read the embedding table itself.
    model = _model(SHAPES[shape])
    model.lm_head.weight = torch.nn.Parameter(model.wte.weight.flip(0).clone())
    lengths = {0: 7, 2: 3}
    torch_cache, native_cache = _prefilled(model, 4, lengths), _prefilled(model, 4, lengths)
    native = NativeStep(model, native_cache, max_threads=1, use_openmp=False)
    tokens, positions, slots = [5, 9], [7, 3], [0, 2]
    torch_cache.prepare(slots, [p + 1 for p in positions])
    step = TorchDecodeStep(model, torch_cache)
    want = step(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots))
    torch.testing.assert_close(native(tokens, positions, slots), want, rtol=FLOAT32_TOL, atol=FLOAT32_TOL)


@pytest.mark.parametrize("shape", sorted(ALL_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("level", NATIVE_ISAS)
@torch.no_grad()
def test_prompt_chunks_and_decode_rows_in_one_call_match_the_model(
    shape: str, dtype: torch.dtype, level: str
) -> None:
    """A decode row, a first prompt chunk and a later chunk, in one call: every row's logits are
    the model's for that position (a chunk's rows attend to each other's keys; a rotary model's
    keys are cached turned, as the model caches them), at every kernel level this CPU runs. A
    bfloat16 model (weights and cache in bf16, arithmetic in float32) gives the logits of the
    float32 model with the same weights over a bf16 cache, which torch's forward runs by widening
    the cache; on a tile level (AVX512-BF16 or AMX), with each linear layer's input rounded to bf16
    as well."""
    model = native_model = _model(ALL_SHAPES[shape])
    if dtype == torch.bfloat16:
        native_model, model = _bf16_pair(model)
    lengths = {2: 10, 5: 12}
    runs = NativeStep(native_model, _prefilled(model, 1, {}, dtype), max_threads=1, max_isa=level).isa
    if runs != level:
        pytest.skip(f"kernel level {level} does not run this model here (it runs {runs})")
    tiles = level in TILE_ISAS
    with _bf16_inputs(model, tiles):  # the caches must be filled the same way
        native_cache = _prefilled(model, 8, lengths, dtype)
        torch_cache = _prefilled(model, 8, lengths, dtype)
    native = NativeStep(native_model, native_cache, max_threads=2, max_rows=32, max_isa=level)
    gen = torch.Generator().manual_seed(3)
    work = [(2, 10, 1), (0, 0, 7), (5, 12, 5)]  # (slot, first position, tokens)
    tokens, positions, slots = [], [], []
    for slot, start, n in work:
        tokens += torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
        positions += list(range(start, start + n))
        slots += [slot] * n
    with _bf16_inputs(model, tiles):
        want = _chunked_logits(model, torch_cache, work, tokens)
    torch.set_num_threads(2)
    try:
        every = native(tokens, positions, slots)
        last = native(tokens, positions, slots, logit_rows=[0, 7, 12])  # writes the same keys again
    finally:
        torch.set_num_threads(1)
    # On the C level (products rounded before they are added) and the tile levels (inputs rounded to
    # bf16), a bf16 model's float32 rounding difference now and then flips a bf16 rounding (of a
    # cached key, of a linear layer's input): bf16's error, in the rows after it.
    if dtype == torch.bfloat16:
        tol = BF16_FLIP_TOL if level not in ("avx2", "avx512") else FLOAT32_TOL
    else:
        tol = _float32_apart(model, lengths, work, tokens, want)
    torch.testing.assert_close(every, want, rtol=tol, atol=tol)
    assert torch.equal(last, every[[0, 7, 12]])
    for theirs, ours in zip(torch_cache.layers, native_cache.layers, strict=True):
        # Keys and values written in the cache's dtype; a bf16 rounding may land one unit apart.
        tol = FLOAT32_TOL if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(ours.k, theirs.k, rtol=tol, atol=tol)  # type: ignore[union-attr]
        torch.testing.assert_close(ours.v, theirs.v, rtol=tol, atol=tol)  # type: ignore[union-attr]


@pytest.mark.parametrize("shape", sorted(ALL_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@torch.no_grad()
def test_a_row_gets_the_same_bits_alone_batched_and_on_any_thread_count(
    shape: str, dtype: torch.dtype
) -> None:
    model = _model(ALL_SHAPES[shape]).to(dtype)
    lengths = {0: 7, 1: 12, 2: 3, 3: 20}
    results = []
    # Three threads as well: each phase's chunks are cut into one part per thread (decode.c,
    # claim), and three parts of a few chunks come out uneven or empty.
    for rows, threads in ((4, 2), (4, 3), (1, 3), (1, 2), (4, 1), (1, 1)):
        cache = _prefilled(model, 4, lengths, dtype)
        native = NativeStep(model, cache, max_threads=3)
        torch.set_num_threads(threads)
        try:
            slots = list(range(rows))
            logits = native([5, 9, 2, 40][:rows], [lengths[s] for s in slots], slots)
        finally:
            torch.set_num_threads(1)
        results.append(logits[0])
    for other in results[1:]:
        assert torch.equal(other, results[0])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kernels", ["float32", "float32 avx2", "bfloat16", "bfloat16 widened"])
@pytest.mark.parametrize("rows", [13, 28])  # AVX-512 blocks 7 + 6 and 12 + 8 + 8 (a last 1 or 4 evened)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@torch.no_grad()
def test_rows_in_several_blocks_get_their_bits_alone_on_wide_layers(
    threads: int, kernels: str, rows: int, family: str
) -> None:
    # Wide enough that a thread's chunk of a layer holds two panel pairs or more, and more rows
    # than one kernel block (12 rows): on AVX-512 the kernels of every block then also prefetch
    # the next pair (matmul.inc AHEAD_LOOP, in PANEL512 and tiles.inc PANELDP), a second loop of each
    # kernel that must give the same bits as the plain loop a lone row runs.
    wide = GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=4, n_embd=256)
    if family == "llama":  # SwiGLU's gate and up panel pairs in chunks too; four heads per key/value head
        wide = _llama(vocab_size=64, n_layer=1, n_head=8, n_embd=256, n_kv_head=2, mlp_hidden=688)
    dtype = torch.float32 if kernels == "float32" else torch.bfloat16
    model = _model(wide).to(dtype)
    lengths = {s: 3 + s % 9 for s in range(rows)}
    tokens = [(7 * s) % 64 for s in range(rows)]
    together = NativeStep(model, _prefilled(model, rows, lengths, dtype), max_threads=2)
    alone = NativeStep(model, _prefilled(model, rows, lengths, dtype), max_threads=2)
    if kernels == "bfloat16 widened":  # bf16 weights on the AVX-512 widening kernels, not a tile level
        together.use_isa("avx512"), alone.use_isa("avx512")
    if kernels == "float32 avx2":  # blocks of 6 rows (13: 6 + 4 + 3, a last block of 1 evened out)
        together.use_isa("avx2"), alone.use_isa("avx2")
    torch.set_num_threads(threads)
    try:
        batched = together(tokens, [lengths[s] for s in range(rows)], list(range(rows)))
        for s in range(rows):
            assert torch.equal(batched[s], alone([tokens[s]], [lengths[s]], [s])[0]), s
    finally:
        torch.set_num_threads(1)


PROMPT_SHAPES = {  # head sizes 10 (no blocks), 32 (16-dim groups), 64 and 96 (64-dim groups, then 16)
    **ALL_SHAPES,
    "heads of 64": GPTConfig(vocab_size=64, block_size=48, n_layer=2, n_head=2, n_embd=128),
    "heads of 96": GPTConfig(vocab_size=64, block_size=48, n_layer=1, n_head=2, n_embd=192),
}


@pytest.mark.parametrize("shape", sorted(PROMPT_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@torch.no_grad()
def test_a_prompt_chunk_gets_the_bits_of_its_tokens_fed_one_at_a_time(shape: str, dtype: torch.dtype) -> None:
    # A chunk's rows (one slot, consecutive positions) attend in blocks of up to four that read
    # each key and value once (AVX-512 level); decode rows never form blocks. 11 tokens: blocks of
    # 4, 4 and 3, beside a decode row of another slot.
    cfg = PROMPT_SHAPES[shape]
    model = _model(cfg).to(dtype)
    lengths = {0: 5, 1: 9}
    tokens = [7] + [(3 * i + 1) % cfg.vocab_size for i in range(11)]
    positions = [5] + [9 + i for i in range(11)]
    slots = [0] + [1] * 11
    together_cache, alone_cache = _prefilled(model, 2, lengths, dtype), _prefilled(model, 2, lengths, dtype)
    torch.set_num_threads(2)
    try:
        together = NativeStep(model, together_cache, max_threads=2, max_rows=16)(tokens, positions, slots)
        alone = NativeStep(model, alone_cache, max_threads=2)
        rows = zip(tokens, positions, slots, strict=True)
        one_by_one = torch.cat([alone([t], [p], [s]) for t, p, s in rows])
    finally:
        torch.set_num_threads(1)
    assert torch.equal(together, one_by_one)
    for a, b in zip(together_cache.layers, alone_cache.layers, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


# float32 bit patterns whose bfloat16 rounding has a rule of its own: ties to even (down and up),
# just above and below a tie, denormals (kept, not flushed: the smallest rounds to zero, others
# keep their bits; the smallest negative one rounds to -0), the largest finite values (round to
# infinity), infinities, NaNs (all-ones payloads would carry into the sign if rounded as numbers),
# zero.
ROUNDING_EDGES = [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x00000001, 0x00408000, 0x00418000,
                  0x807FFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
                  0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x80000001, 0x00000000, 0x40490FDB, 0xC0200000]


@pytest.mark.parametrize("level", ["c", "best"])
@torch.no_grad()
def test_keys_and_values_are_stored_in_bfloat16_as_torch_rounds_them(level: str) -> None:
    """A bf16 cache holds exactly torch's float32 -> bfloat16 rounding of each key and value
    (NaN as some NaN): the stores round eight at a time on x86 and the rest one by one; heads of
    12 take both. The keys and values come straight from the QKV bias (weights zero), so they
    are the edge cases above, in a decode row and in a prompt chunk's rows."""
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=4, n_embd=48)
    model = _model(cfg)
    edges = torch.tensor(ROUNDING_EDGES, dtype=torch.int64).to(torch.int32).view(torch.float32)
    kv = edges.repeat(2 * cfg.n_embd // len(edges) + 1)[: 2 * cfg.n_embd]
    attn = model.h[0].attn.c_attn
    attn.weight.zero_()
    attn.bias[cfg.n_embd :] = kv
    cache = _prefilled(model, 2, {}, torch.bfloat16)
    native = NativeStep(model, cache, max_threads=2, max_rows=8)
    if level == "c":
        assert native.use_isa("c") == "c"
    native([1, 2, 3, 4], [0, 0, 1, 2], [0, 1, 1, 1])  # a decode row, then a chunk of three
    want = kv.to(torch.bfloat16).view(2, cfg.n_head, cfg.head_dim)  # keys, values per head
    for slot, pos in [(0, 0), (1, 0), (1, 1), (1, 2)]:
        layer = cache.layers[0]
        for got, expected in ((layer.k[slot, :, pos], want[0]), (layer.v[slot, :, pos], want[1])):  # type: ignore[index]
            nan = expected.isnan()
            assert torch.equal(got.isnan(), nan), (slot, pos)
            assert torch.equal(got[~nan].view(torch.int16), expected[~nan].view(torch.int16)), (slot, pos)


@pytest.mark.parametrize(
    ("tokens", "positions", "slots", "message"),
    [
        ([97], [3], [0], "token 97 is outside"),
        ([1], [48], [0], "position 48 is outside"),
        ([1], [-1], [0], "position -1 is outside"),
        ([1], [3], [4], "slot 4 is outside"),
        ([1, 2], [3], [0, 1], "rows of one token"),
        ([1] * 5, [3] * 5, [0] * 5, "rows of one token"),
    ],
)
def test_out_of_range_rows_raise_instead_of_reaching_the_library(
    tokens: list[int], positions: list[int], slots: list[int], message: str
) -> None:
    model = _model(SHAPES["ragged"])
    native = NativeStep(model, _prefilled(model, 4, {}), max_threads=1)
    with pytest.raises(ValueError, match=message):
        native(tokens, positions, slots)


async def test_the_engine_decodes_natively_with_the_torch_paths_tokens(
    make_engine: EngineFactory, lively: Checkpoint
) -> None:
    native = make_engine(max_seqs=4)
    plain = make_engine(max_seqs=4, backend="torch")
    assert native.info()["backend"]["name"] == "native" and plain.info()["backend"]["name"] == "torch"
    assert native.info()["backend"]["kernels"] in ("avx2", "avx512", "c")
    assert plain.info()["backend"]["kernels"].startswith("torch cpu")
    assert "asked for" in plain.info()["backend"]["reason"]
    assert native.backend.name == "native" and plain.backend.name == "torch"
    for prompt in ("hello wor", "The quick brown", "~~ 42 ~~"):
        want = token_ids(await collect(plain, prompt, max_new_tokens=40, temperature=0.0))
        got = token_ids(await collect(native, prompt, max_new_tokens=40, temperature=0.0))
        assert got == want


async def test_deterministic_mode_batches_rows_on_the_native_step(make_engine: EngineFactory) -> None:
    """The native step computes every row alone anyway, so deterministic mode lets rows share its
    forwards: decode rows, and equal-length prompt chunks."""
    engine = make_engine(max_seqs=4, deterministic=True)
    assert engine.backend.name == "native"
    groups: list[tuple[int, int]] = []  # (rows, tokens per row) of every forward
    run_group = engine.runner._run_group

    def spy(items):  # type: ignore[no-untyped-def]
        groups.append((len(items), len(items[0].tokens)))
        return run_group(items)

    engine.runner._run_group = spy  # type: ignore[method-assign]
    prompts = ("first one", "other one", "third one")  # the same length: one prefill forward
    await asyncio.gather(*(collect(engine, p, max_new_tokens=12, temperature=0.0) for p in prompts))
    assert any(rows > 1 and tokens == 1 for rows, tokens in groups), groups
    assert any(rows > 1 and tokens > 1 for rows, tokens in groups), groups


async def test_a_bfloat16_engine_decodes_natively_as_float32_does_with_its_weights(
    make_engine: EngineFactory, lively: Checkpoint
) -> None:
    """dtype bfloat16 on CPU runs on the native step (bf16 weights and cache, float32 arithmetic):
    its greedy tokens are those of the float32 engine given the same bf16-rounded weights (the
    cache's rounding is the only difference, too small to move these sharp argmaxes). Kernels up
    to avx512 (`native_isa`) keep the linear layers' inputs in float32 on any CPU."""
    rounded = _rounded(lively)
    low = make_engine(max_seqs=4, dtype="bfloat16", native_isa="avx512")
    full = make_engine(rounded, max_seqs=4)
    assert low.info()["backend"]["name"] == "native" and low.info()["dtype"] == "bfloat16"
    assert low.info()["backend"]["kernels"] in ("c", "avx2", "avx512")
    assert low.runner.cache.layers[0].k.dtype == torch.bfloat16  # type: ignore[union-attr]
    for prompt in ("hello wor", "The quick brown", "~~ 42 ~~"):
        want = token_ids(await collect(full, prompt, max_new_tokens=40, temperature=0.0))
        got = token_ids(await collect(low, prompt, max_new_tokens=40, temperature=0.0))
        assert got == want


async def test_a_bfloat16_engine_on_bf16_dot_products_decodes_as_float32_does_with_its_inputs_rounded(
    make_engine: EngineFactory, lively: Checkpoint
) -> None:
    """On a tile level (AVX512-BF16 or AMX) the linear layers' inputs are rounded to bf16 too: the
    float32 engine on the same rounded weights gives the same greedy tokens when its linear layers
    round their inputs."""
    low = make_engine(max_seqs=4, dtype="bfloat16")
    if low.info()["backend"]["kernels"] not in TILE_ISAS:
        runs = low.info()["backend"]["kernels"]
        pytest.skip(f"this CPU has no AVX512-BF16 nor AMX (the native step runs {runs})")
    full = make_engine(_rounded(lively), max_seqs=4, backend="torch")  # torch's forward, to hook
    with _bf16_inputs(full.model, True) as hooks:
        assert len(hooks) == 4 * lively.config.n_layer + 1
        for prompt in ("hello wor", "The quick brown", "~~ 42 ~~"):
            want = token_ids(await collect(full, prompt, max_new_tokens=40, temperature=0.0))
            got = token_ids(await collect(low, prompt, max_new_tokens=40, temperature=0.0))
            assert got == want


def _rounded(checkpoint: Checkpoint) -> Checkpoint:
    """The checkpoint with its weights rounded to bfloat16 and held as float32."""
    state = {k: v.to(torch.bfloat16).float() for k, v in checkpoint.state_dict.items()}
    return dataclasses.replace(checkpoint, state_dict=state)


async def test_a_bfloat16_kv_cache_halves_the_cache_and_both_paths_agree(
    make_engine: EngineFactory,
) -> None:
    """kv_cache_dtype=bfloat16 under float32 weights: half the cache bytes; the native step and
    torch's kernels (which widen the cache) give the same greedy tokens from it."""
    full = make_engine(max_seqs=4)
    native = make_engine(max_seqs=4, kv_cache_dtype="bfloat16")
    plain = make_engine(max_seqs=4, kv_cache_dtype="bfloat16", backend="torch")
    assert native.info()["backend"]["name"] == "native" and plain.info()["backend"]["name"] == "torch"
    for engine in (native, plain):
        assert engine.info()["kv_cache_dtype"] == "bfloat16"
        assert engine.info()["kv_cache_bytes"] * 2 == full.info()["kv_cache_bytes"]
    assert full.info()["kv_cache_dtype"] == "float32"
    for prompt in ("hello wor", "The quick brown", "~~ 42 ~~"):
        want = token_ids(await collect(plain, prompt, max_new_tokens=40, temperature=0.0))
        got = token_ids(await collect(native, prompt, max_new_tokens=40, temperature=0.0))
        assert got == want


@pytest.mark.parametrize("native", [True, False])
async def test_an_engine_on_the_native_step_holds_no_checkpoint_memory(
    make_engine: EngineFactory, lively: Checkpoint, tmp_path: Path, native: bool
) -> None:
    # A checkpoint loaded for this test alone: its tensors are views of the mapped file, and the
    # mapping (all of it resident once read) goes only when none of them is held any more. With
    # the native step, which holds its own copy of every weight (the linear layers packed), the
    # engine releases the model's, so nothing of the checkpoint may stay.
    ckpt = load_checkpoint(make_lively_checkpoint(tmp_path / "ckpt"))
    refs = [StorageWeakRef(t.untyped_storage()) for t in ckpt.state_dict.values()]
    # The control keeps torch's layout too (no oneDNN packing, which replaces the weights as well).
    engine = make_engine(ckpt, max_seqs=2, backend="native" if native else "torch", packed_linear=False)
    want = token_ids(await collect(make_engine(lively, max_seqs=2, backend="torch"), "hello wor",
                                   max_new_tokens=20, temperature=0.0))
    del ckpt
    gc.collect()
    assert [ref.expired() for ref in refs] == [native] * len(refs)
    assert not engine.checkpoint.state_dict  # the engine keeps the checkpoint's metadata only
    assert (getattr(engine.backend, "released_bytes", 0) > 0) == native
    if native:  # gone from the model too; the tied embedding with its output layer (read from its panels)
        assert engine.model.h[0].mlp.c_fc.weight.is_meta and engine.model.wte.weight.is_meta
        assert engine.model.wte.weight is engine.model.lm_head.weight
    # Generation never touched the released weights (a torch forward on meta tensors would fail).
    assert token_ids(await collect(engine, "hello wor", max_new_tokens=20, temperature=0.0)) == want


@pytest.mark.parametrize("shape", sorted(ALL_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@torch.no_grad()
def test_every_kernel_level_computes_the_same_logits(shape: str, dtype: torch.dtype) -> None:
    # 40 rows: blocks of 12, 12, 12 and 4 rows for the AVX-512 and AVX512-BF16 kernels (6 x 6 + 4
    # for AVX2, 32 + 8 for AMX); the ragged shape's 97 logits are 7 panels, so a panel pair and a
    # single panel run.
    model = _model(ALL_SHAPES[shape]).to(dtype)
    rows = 40
    lengths = {s: 1 + (7 * s) % 40 for s in range(rows)}
    native = NativeStep(model, _prefilled(model, rows, lengths, dtype), max_threads=2)
    best = native.isa
    tokens = [(5 * s + 3) % ALL_SHAPES[shape].vocab_size for s in range(rows)]
    positions, slots = [lengths[s] for s in range(rows)], list(range(rows))
    torch.set_num_threads(2)
    try:
        by_level = {}
        for level in ("c", "avx2", "avx512"):
            if native.use_isa(level) == level:
                by_level[level] = native(tokens, positions, slots)
        tiles = {}
        for level in TILE_ISAS:  # bf16 inputs: their own function, the same bits per row
            if native.use_isa(level) == level:
                tiles[level] = native(tokens, positions, slots)
                for row in (0, 11, 12, 31, 33, 39):
                    alone = native(tokens[row : row + 1], positions[row : row + 1], slots[row : row + 1])
                    assert torch.equal(alone[0], tiles[level][row]), f"{level}, row {row}"
    finally:
        torch.set_num_threads(1)
        native.use_isa(best)
    assert "c" in by_level and len(by_level) >= 2, f"only {sorted(by_level)} run on this CPU"
    assert not tiles or dtype == torch.bfloat16  # a float32 model never rounds its inputs
    if "avx512" not in by_level:
        pytest.skip("this CPU has no AVX-512: only the C and AVX2 kernels were compared")
    # The vector levels sum every output in the same order: the same bits.
    assert torch.equal(by_level["avx512"], by_level["avx2"])
    if dtype == torch.float32:
        # The C kernels round each product before adding it (no FMA): float32 rounding apart.
        # (Not for bfloat16: keys and values stored in bf16 turn such a difference into bf16's.)
        torch.testing.assert_close(by_level["avx512"], by_level["c"], rtol=5e-5, atol=5e-5)


@pytest.mark.parametrize("shape", sorted(ALL_SHAPES))
@torch.no_grad()
def test_the_two_tile_levels_compute_the_same_function(shape: str) -> None:
    # AVX512-BF16 and AMX take the same bf16-rounded inputs and exact bf16 products, summed in
    # another order: float32 rounding apart, until a difference flips the bf16 rounding of a later
    # linear layer's input. A float32 cache here: in a bf16 one a stored key's rounding flips too.
    model = _model(ALL_SHAPES[shape]).to(torch.bfloat16)
    rows = 40
    lengths = {s: 1 + (7 * s) % 40 for s in range(rows)}
    native = NativeStep(model, _prefilled(model, rows, lengths, torch.float32), max_threads=2)
    if native.use_isa("amx") != "amx" or native.use_isa("avx512bf16") != "avx512bf16":
        pytest.skip(f"this CPU does not run both tile levels (the native step runs {native.isa})")
    tokens = [(5 * s + 3) % ALL_SHAPES[shape].vocab_size for s in range(rows)]
    positions, slots = [lengths[s] for s in range(rows)], list(range(rows))
    torch.set_num_threads(2)
    try:
        dot = native(tokens, positions, slots)
        native.use_isa("amx")
        tiles = native(tokens, positions, slots)
    finally:
        torch.set_num_threads(1)
    # Where the float32 difference flips none of a row's bf16 roundings, the row is float32 rounding
    # apart; where it flips one, the row carries bf16's error from that layer on (BF16_FLIP_TOL). A
    # flip needs a float32 difference to straddle a bf16 rounding boundary, so it is rare (2 of 40
    # rows in the shapes that have any, on an Emerald Rapids host); a kernel error shows in every row.
    apart = (dot - tiles).abs().amax(dim=1)
    flipped = int((apart > FLOAT32_TOL).sum())
    assert flipped <= rows // 4, f"{flipped} of {rows} rows differ by more than float32 rounding"
    torch.testing.assert_close(dot, tiles, rtol=BF16_FLIP_TOL, atol=BF16_FLIP_TOL)


@pytest.mark.parametrize("shape", sorted(ALL_SHAPES))
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@torch.no_grad()
def test_on_a_tile_level_the_weights_are_held_once_with_the_same_logits(shape: str, tied: bool) -> None:
    # hold_once drops the linear layers' panels once the tile copy holds them (AVX512-BF16 or AMX);
    # a tied model then reads its embeddings from the output layer's tiles. Same logits, bit for bit.
    model = _model(ALL_SHAPES[shape]).to(torch.bfloat16)
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 0.5)
    lengths = {0: 7, 1: 12, 2: 3}
    keep = NativeStep(model, _prefilled(model, 3, lengths, torch.bfloat16), max_threads=2)
    if keep.isa not in TILE_ISAS:
        pytest.skip(f"no AVX512-BF16 nor AMX here (the native step runs {keep.isa}): nothing is dropped")
    once = NativeStep(model, _prefilled(model, 3, lengths, torch.bfloat16), max_threads=2, hold_once=True)
    dropped = sum(t is None for t in once._tensors.values()) - sum(t is None for t in keep._tensors.values())
    assert dropped == 4 * model.config.n_layer + 1
    assert once.isa == keep.isa
    assert once.use_isa("avx512") == "avx512bf16"  # nothing left for the lower levels to read
    once.use_isa(keep.isa)
    torch.set_num_threads(2)
    try:
        for tokens in ([5, 9, 2], [40, 1, 0]):
            positions = [lengths[s] for s in range(3)]
            assert torch.equal(once(tokens, positions, [0, 1, 2]), keep(tokens, positions, [0, 1, 2]))
    finally:
        torch.set_num_threads(1)


def test_native_isa_names_a_bad_choice_and_caps_the_kernels() -> None:
    from nanoserve.engine.config import EngineConfig

    choices = "auto, c, avx2, avx512, avx512bf16, amx"
    with pytest.raises(ValueError, match=f"native_isa must be one of {choices}, got 'sse'"):
        EngineConfig(native_isa="sse")
    model = _model(SHAPES["aligned"])
    capped = NativeStep(model, _prefilled(model, 1, {}), max_threads=1, max_isa="avx2")
    assert capped.isa in ("c", "avx2")  # avx2 where the CPU has it, never above the cap
