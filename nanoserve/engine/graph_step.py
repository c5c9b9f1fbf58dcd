"""The decode step with static shapes, for both families, replayed as CUDA graphs on a GPU.

On a GPU a small model's decode step is bound by launching kernels from Python, one per
operation (5.1 ms at 124M batch 1 on an H200, where reading the weights takes 0.06 ms). A CUDA
graph records the step's kernels once and replays them with one launch, but it replays exactly
what it recorded: the same shapes, the same addresses, no value read back by the host. So this
step has none of the general forward's data-dependent parts:

- its inputs are one static int64 buffer (tokens, positions, slots: three rows of `bucket`
  entries) that one host-to-device copy fills per step; lengths are positions + 1, computed on
  the device;
- a batch of n rows runs as the next batch bucket (`batch_buckets`); the padding rows read token
  0 at position 0 and write their keys and values to a scratch slot the scheduler never hands
  out, so a real slot's cache is never touched by them;
- attention reads a span of the cache fixed per graph: the next span bucket (`span_buckets`) at
  or above the longest row's length, with positions past a row's own masked. One graph per
  (batch, span) bucket pair;
- keys and values are written with one fixed-shape `index_put_` per layer, read back with one
  `index_select` of the span, and attended by two batched matmuls (grouped-query heads as a
  reshape of the queries, no copy of the keys per query head);
- the logits land in a static buffer, copied out before the next replay overwrites it.

Off a GPU the same step runs eagerly: the CPU tests compare it with the general forward, and run
it under FakeTensorMode, which refuses any data-dependent shape or host read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.kv_slots import SpanKVCache, SpanLayerCache
from nanoserve.model.gpt import GPT, Block, apply_rope, rope_tables

# Batches up to 32 rows are bound by reading the weights, so padding 5 rows to 8 costs almost
# nothing; past 32 rows the per-row work (attention, the output layer) grows, so buckets step
# by 32 rows: a padded batch computes at most 31 rows more than it needs.
SMALL_BUCKETS = (1, 2, 4, 8, 16, 32)
LARGE_STEP = 32
# Attention's work is proportional to the span read: a row 150 tokens long reads 256 positions,
# not the whole window. Powers of two from here up to the window. At 144 tokens (16 + 128) the
# whole window read 4x the keys and values at 124M (1024 positions) and 32x at 135M (8192): the
# step took 1.75x as long at 124M batch 1, 7.5x at batch 16 and 5.1x at 135M batch 1, eager in
# float32 on a CPU (bench/gpu/span_cost.py). The cost of buckets: a graph per span bucket.
MIN_SPAN = 64


def cuda_graphs_off(config: EngineConfig) -> str | None:
    """Why the decode step runs without CUDA graphs under `config`, or None when it runs with them."""
    if not config.cuda_graphs:
        return "off (cuda_graphs false)"
    if not config.resolved_device().startswith("cuda"):
        return "ignored: not a CUDA device"
    if config.compile:
        return "off: the model is compiled (the compiled graph runs every step)"
    return None


def batch_buckets(max_rows: int) -> list[int]:
    """The batch sizes with a graph of their own: 1, 2, 4, ..., 32, then every 32 rows, up to and
    including `max_rows`."""
    buckets = [b for b in SMALL_BUCKETS if b < max_rows]
    b = LARGE_STEP * 2
    while b < max_rows:
        buckets.append(b)
        b += LARGE_STEP
    return [*buckets, max_rows]


def span_buckets(window: int) -> list[int]:
    """The attention spans with a graph of their own: powers of two from MIN_SPAN, then the window."""
    spans, s = [], MIN_SPAN
    while s < window:
        spans.append(s)
        s *= 2
    return [*spans, window]


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} is more than the largest bucket, {buckets[-1]}")


class GraphDecodeStep:
    """One token per row over the slot cache, shapes fixed per (batch, span) bucket.

    `cache` holds the scheduler's slots plus one more, the last, where padding rows write.
    """

    def __init__(self, model: GPT, cache: SpanKVCache, max_rows: int) -> None:
        if model.training:
            raise ValueError("the decode step is for inference: put the model in eval() mode")
        cfg = model.config
        if max_rows >= cache.slots:
            raise ValueError(f"{max_rows} rows need {max_rows + 1} cache slots (one for padding), "
                             f"the cache has {cache.slots}")
        self.model, self.cache = model, cache
        self.scratch = cache.slots - 1
        self.n_head, self.kv_heads = cfg.n_head, cfg.kv_heads
        self.head_dim, self.n_embd = cfg.head_dim, cfg.n_embd
        self.blocks: list[Block] = list(model.h)  # type: ignore[arg-type]
        self.layers: list[SpanLayerCache] = list(cache.layers)  # type: ignore[arg-type]
        self.batches = batch_buckets(max_rows)
        self.spans = span_buckets(cache.capacity)
        dev = model.wte.weight.device
        self.device = dev
        top = self.batches[-1]
        # Device-side inputs; on a GPU the host writes a pinned twin and copies it over.
        self.inputs = torch.zeros(3 * top, dtype=torch.long, device=dev)
        on_cpu = dev.type == "cpu"
        self.host = self.inputs if on_cpu else torch.zeros(3 * top, dtype=torch.long).pin_memory()
        self.copied: torch.cuda.Event | None = None  # the last copy out of `host`, on a GPU
        self.logits = torch.zeros(top, cfg.vocab_size, dtype=model.lm_head.weight.dtype, device=dev)
        self.arange = torch.arange(cache.capacity, device=dev)
        self.heads = torch.arange(self.kv_heads, device=dev)
        self.rope = rope_tables(cfg, dev) if model.wpe is None else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    # ---- the step ------------------------------------------------------------------------
    def __call__(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """Next-token logits (n, V) of n rows, each feeding token tokens[i] at positions[i] into
        slot slots[i]."""
        n = len(tokens)
        b = bucket_for(n, self.batches)
        s = bucket_for(max(positions) + 1, self.spans)
        pad = b - n
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the host buffer
        packed = self.host[: 3 * b].view(3, b).numpy()
        packed[0] = [*tokens, *[0] * pad]
        packed[1] = [*positions, *[0] * pad]
        packed[2] = [*slots, *[self.scratch] * pad]
        if self.host is not self.inputs:
            self.inputs[: 3 * b].copy_(self.host[: 3 * b], non_blocking=True)  # the step's one copy in
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(self.device))
        graph = self.graphs.get((b, s))
        if graph is not None:
            graph.replay()
        else:
            self.compute(b, s)
        # A copy: the next replay (another group of this step) overwrites the static buffer.
        return self.logits[:n].clone()

    @torch.no_grad()
    def compute(self, b: int, span: int) -> None:
        """The step for bucket `b` over `span` cache positions: reads `inputs`, writes the cache
        and `logits`. Every shape depends on (b, span) alone."""
        m, nkv, hs, c = self.model, self.kv_heads, self.head_dim, self.n_embd
        group = self.n_head // nkv  # query heads per key/value head
        tokens, pos, slots = self.inputs[: 3 * b].view(3, b).unbind(0)  # each (b,)
        x = m.wte(tokens)  # (b, C)
        rope = None
        if m.wpe is not None:
            x = x + m.wpe(pos)
        else:
            assert self.rope is not None
            cos, sin = self.rope
            rope = cos.index_select(0, pos).view(b, 1, 1, hs), sin.index_select(0, pos).view(b, 1, 1, hs)
        # Additive mask (b, 1, 1, span): 0 up to each row's own position, -inf past it.
        allowed = self.arange[:span].view(1, 1, 1, span) <= pos.view(b, 1, 1, 1)
        mask = torch.zeros((), dtype=torch.float32, device=self.device).masked_fill(~allowed, float("-inf"))
        write_at = (slots.view(b, 1), self.heads.view(1, nkv), pos.view(b, 1))  # broadcast to (b, nkv)
        scale = 1.0 / math.sqrt(hs)
        for block, layer in zip(self.blocks, self.layers, strict=True):
            q, k, v = block.attn.c_attn(block.ln_1(x)).split([c, nkv * hs, nkv * hs], dim=-1)
            q = q.view(b, nkv, group, hs)  # query head h is key/value head h // group's (repeat_kv)
            k = k.view(b, nkv, 1, hs)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            layer.k.index_put_(write_at, k.view(b, nkv, hs).to(layer.k.dtype))
            layer.v.index_put_(write_at, v.view(b, nkv, hs).to(layer.v.dtype))
            keys = layer.k[:, :, :span].index_select(0, slots).to(q.dtype)  # (b, nkv, span, hs)
            values = layer.v[:, :, :span].index_select(0, slots).to(q.dtype)
            scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # (b, nkv, group, span)
            # Softmax in float32 whatever the model's dtype, as the fused kernels do.
            probs = (scores.float() + mask).softmax(dim=-1).to(q.dtype)
            y = torch.matmul(probs, values).reshape(b, c)  # (b, nkv, group, hs) -> (b, C)
            x = x + block.attn.c_proj(y)
            x = x + block.mlp(block.ln_2(x))
        self.logits[:b].copy_(m.lm_head(m.ln_f(x)))

    # ---- CUDA graphs -----------------------------------------------------------------------
    @torch.no_grad()
    def capture(self) -> int:
        """Record every (batch, span) bucket's step as a CUDA graph, sharing one memory pool;
        returns how many. Every input row points at the scratch slot meanwhile, so capture writes
        no real slot's cache."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device.type}")
        with torch.cuda.device(self.device):  # graphs capture on the current device: the model's
            return self._capture()

    def _capture(self) -> int:
        pairs = sorted(((b, s) for b in self.batches for s in self.spans), reverse=True)
        # cuBLAS and the caching allocator set themselves up on first use: once per shape on a
        # side stream before capture, as torch.cuda.graphs' docs ask.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for b, s in pairs:
                self._at_scratch(b)
                self.compute(b, s)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # Largest first: the smaller graphs reuse the pool's blocks the larger ones freed.
        pool = torch.cuda.graph_pool_handle()
        for b, s in pairs:
            self._at_scratch(b)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another engine's thread may run its steps meanwhile (several models).
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.compute(b, s)
            self.graphs[(b, s)] = graph
        torch.cuda.synchronize(self.device)
        return len(self.graphs)

    def _at_scratch(self, b: int) -> None:
        """Bucket b's inputs: token 0 at position 0 of the scratch slot, in every row."""
        rows = self.inputs[: 3 * b].view(3, b)
        rows[:2].zero_()
        rows[2].fill_(self.scratch)

    def describe(self) -> str:
        how = f"{len(self.graphs)} CUDA graphs" if self.graphs else "eager"
        return f"{how}, batch buckets {self.batches}, span buckets {self.spans}"

