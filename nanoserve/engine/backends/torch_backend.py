"""The torch backend: forwards through torch's kernels on any device (the model's own forward, or
for one-token rows the static-shape `GraphDecodeStep`, replayed as CUDA graphs on a GPU, or the
straight-line `TorchDecodeStep`; on a GPU prompt chunks that need no mask through `FlashPrefill`),
tokens drawn by nanoserve/model/sampling.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nanoserve.engine.backends.base import Backend
from nanoserve.engine.device_draw import DeviceDraw
from nanoserve.engine.flash_prefill import FlashPrefill, flash_applies
from nanoserve.engine.graph_step import GraphDecodeStep
from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.engine.packed_linear import pack_linears
from nanoserve.engine.penalties import PenaltyState
from nanoserve.engine.request import Request
from nanoserve.engine.torch_decode import TorchDecodeStep
from nanoserve.engine.work import WorkItem, needs_draw
from nanoserve.model.gpt import GPT
from nanoserve.model.sampling import SamplingBatch, candidate_width, sample_tokens, seeded_uniform


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, model: GPT, cache: SpanKVCache, *, compile: bool = False, pack: bool = False,
                 batch_hint: int = 1, graph_rows: int = 0, graphs_off: str = "off",
                 flash_prefill: bool = False, device_sampler: bool = False) -> None:
        """graph_rows: decode batches of up to this many rows run as graph_step.py's static step
        (the cache holds one slot more, for its padding), captured as CUDA graphs on a GPU and
        eager elsewhere; 0: the straight-line step or the model's forward, `graphs_off` saying why
        (for /info). flash_prefill: prompt chunks that need no mask through flash_prefill.py.
        device_sampler: tokens drawn by device_draw.py (fixed shapes, one parameter copy, no host
        read) instead of the reference sampler, which reads the host between its filters: on a GPU
        each read is a sync; on a CPU the reference is the faster (it works on a head of candidates)."""
        self.cache = cache
        self.device = model.wte.weight.device
        self.vocab = model.config.vocab_size
        self.compiled = compile
        # CPU: linear layers through oneDNN with their weights reordered once (packed_linear.py).
        self.packed_linears = pack_linears(model, batch_hint=batch_hint) if pack and not compile else 0
        self.model: torch.nn.Module = model
        # One-token rows skip the general forward (torch_decode.py), except when the model is
        # compiled: then the compiled graph runs every step. Shapes vary with batch size, chunk
        # length and attention span, so it compiles dynamically; the first forward of each shape
        # family compiles (minutes on 2 CPU cores), which the engine's warm-up pays.
        straight = not compile and model.config.family == "gpt2"  # the decode step is GPT-2's
        self.decode_step: TorchDecodeStep | None = TorchDecodeStep(model, cache) if straight else None
        if compile:
            self.model = torch.compile(model, dynamic=True)  # type: ignore[assignment]
        self.graph_step = GraphDecodeStep(model, cache, graph_rows) if graph_rows else None
        if self.graph_step is not None and self.device.type == "cuda":
            self.graph_step.capture()
        self.graphs_off = None if graph_rows else graphs_off
        self.prefill = FlashPrefill(model, cache) if flash_prefill and not compile else None
        self.device_draw = DeviceDraw() if device_sampler else None  # one per backend: its pinned buffer

    def describe(self) -> dict[str, Any]:
        graphs = self.graph_step.describe() if self.graph_step is not None else self.graphs_off
        return {**super().describe(), "cuda_graphs": graphs, "flash_prefill": self.prefill is not None,
                "sampler": "device" if self.device_draw is not None else "reference"}

    def kernels(self) -> str:
        graphs = self.graph_step is not None and self.graph_step.graphs
        how = ("compiled" if self.compiled else "CUDA graphs" if graphs
               else "oneDNN packed" if self.packed_linears else "eager")
        return f"torch {self.device.type} ({how})"

    def forward(self, items: Sequence[WorkItem]) -> torch.Tensor:
        scoring = [item.scores > 0 for item in items]
        if any(scoring) and not all(scoring):
            return self._forward_mixed(items, scoring)
        t = len(items[0].tokens)
        slot_list = [item.req.slot for item in items]
        if t == 1 and self.graph_step is not None and not any(scoring):
            tokens = [item.tokens[0] for item in items]
            return self.graph_step(tokens, [item.start for item in items], slot_list)
        idx = torch.tensor([item.tokens for item in items], dtype=torch.long, device=self.device)
        start = torch.tensor([item.start for item in items], dtype=torch.long, device=self.device)
        pos = start.view(-1, 1) + torch.arange(t, device=self.device).view(1, -1)  # (G, T)
        slots = torch.tensor(slot_list, dtype=torch.long, device=self.device)
        self.cache.prepare(slot_list, [item.start + t for item in items])
        if t > 1 and self.prefill is not None and not any(scoring) and flash_applies(items):
            return self.prefill(idx, pos, slots, slot_list[0], items[0].start)
        if t == 1 and self.decode_step is not None:
            return self.decode_step(idx.view(-1), pos.view(-1), slots)
        if not any(scoring):
            out = self.model(idx, input_pos=pos, cache=self.cache, slots=slots, last_only=True)
            return out[:, -1, :]  # type: ignore[no-any-return]
        # Prompt logprobs: every item scores its prompt, so every position's logits are wanted.
        out = self.model(idx, input_pos=pos, cache=self.cache, slots=slots)  # (G, T, V)
        return out.reshape(-1, out.shape[-1])  # type: ignore[no-any-return]

    def _forward_mixed(self, items: Sequence[WorkItem], scoring: list[bool]) -> torch.Tensor:
        """Items that score their prompt and items that do not, as two forwards: the model
        computes the output layer at every position or at the last one only, so one forward
        would hold a vocabulary's worth of logits for every position of the others too."""
        full = self.forward([it for it, s in zip(items, scoring, strict=True) if s])  # (S * T, V)
        last = self.forward([it for it, s in zip(items, scoring, strict=True) if not s])  # (G - S, V)
        t = len(items[0].tokens)
        pieces, at_full, at_last = [], 0, 0
        for s in scoring:  # work.logit_rows' order
            if s:
                pieces.append(full[at_full : at_full + t])
                at_full += t
            else:
                pieces.append(last[at_last : at_last + 1])
                at_last += 1
        return torch.cat(pieces)

    def draw(self, reqs: list[Request], logits: torch.Tensor, greedy: torch.Tensor,
             penalties: PenaltyState) -> torch.Tensor:
        if self.device_draw is not None:
            return self.device_draw(reqs, logits, greedy, penalties, self.vocab)
        return torch_draw(reqs, logits, greedy, penalties, self.vocab)


def torch_draw(reqs: list[Request], logits: torch.Tensor, greedy: torch.Tensor, penalties: PenaltyState,
               vocab: int) -> torch.Tensor:
    """Backend.draw by nanoserve/model/sampling.py's sample_tokens, on the logits' device."""
    rows = [j for j, r in enumerate(reqs) if needs_draw(r)]
    if len(rows) == len(reqs):
        return _sample_with_penalties(reqs, logits, penalties, vocab)
    tokens = greedy.clone()
    tokens[rows] = _sample_with_penalties([reqs[j] for j in rows], logits[rows], penalties, vocab)
    return tokens


def _sample_with_penalties(reqs: list[Request], logits: torch.Tensor, penalties: PenaltyState,
                           vocab: int) -> torch.Tensor:
    """sample_tokens, penalties and their bookkeeping included."""
    batch = sampling_batch(reqs, vocab, logits.device)
    slots = torch.tensor([r.slot for r in reqs], device=logits.device)
    penal = batch.repetition_penalty is not None or batch.frequency_penalty is not None
    tokens = sample_tokens(
        logits, batch,
        seen=penalties.seen.index_select(0, slots) if penal else None,
        counts=penalties.counts.index_select(0, slots) if penal else None,
    )
    penalties.record(reqs, tokens)
    return tokens


def sampling_batch(reqs: list[Request], vocab: int, dev: torch.device) -> SamplingBatch:
    """The rows' parameters as nanoserve/model/sampling.py's SamplingBatch takes them."""
    ps = [r.params for r in reqs]

    def col(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=dev).view(-1, 1)

    temps = [p.temperature for p in ps]
    batch = SamplingBatch(
        temperature=col(temps),
        greedy=torch.tensor([t == 0 for t in temps], device=dev),
        uniform=torch.tensor(
            [seeded_uniform(r.seed, len(r.generated)) for r in reqs], dtype=torch.float64, device=dev
        ),
        all_greedy=all(t == 0 for t in temps),
        any_greedy=any(t == 0 for t in temps),
    )
    # Greedy rows ignore top_k: k = 1 lets an all-top-k batch take the candidates-only path.
    ks = [1 if p.temperature == 0 else (p.top_k or vocab) for p in ps]
    if any(k < vocab for k in ks):
        batch.top_k = torch.tensor(ks, dtype=torch.long, device=dev).view(-1, 1).clamp(1, vocab)
        batch.top_k_max = min(max(ks), vocab)
    if any(p.top_p is not None and p.top_p < 1 for p in ps):
        batch.top_p = col([p.top_p if p.top_p is not None else 1.0 for p in ps])
    if any(p.min_p for p in ps):
        batch.min_p = col([p.min_p or 0.0 for p in ps])
    if any(p.typical_p is not None and p.typical_p < 1 for p in ps):
        batch.typical_p = col([p.typical_p if p.typical_p is not None else 1.0 for p in ps])
    sampling = [p for p in ps if p.temperature > 0]
    batch.candidates = candidate_width(
        vocab,
        [min(k, vocab) for k, p in zip(ks, ps, strict=True) if p.temperature > 0],
        [p.top_p if p.top_p is not None else 1.0 for p in sampling],
        [p.min_p or 0.0 for p in sampling],
        typical=batch.typical_p is not None,
    )
    if any(p.repetition_penalty not in (None, 1.0) for p in ps):
        batch.repetition_penalty = col([p.repetition_penalty or 1.0 for p in ps])
    if any(p.frequency_penalty or p.presence_penalty for p in ps):
        batch.frequency_penalty = col([p.frequency_penalty for p in ps])
        batch.presence_penalty = col([p.presence_penalty for p in ps])
    return batch
