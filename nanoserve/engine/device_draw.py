"""Backend.draw on the logits' device: nanoserve/model/device_sampling.py fed from the requests.

A step's per-row parameters go to the device as one packed int64 tensor in one host-to-device copy
(from a pinned staging buffer on CUDA, non-blocking); everything after it, the penalty state's
update included, is fixed-shape device work with no host read, so it can be captured in a CUDA
graph. `TokenReadback` brings the drawn tokens back in one pinned, non-blocking device-to-host copy.
"""

from __future__ import annotations

import numpy as np
import torch

from nanoserve.engine.penalties import PenaltyState
from nanoserve.engine.request import Request
from nanoserve.engine.work import needs_draw, uses_penalties
from nanoserve.model.device_sampling import FLOAT_COLUMNS, PACKED_WIDTH, DeviceParams, device_sample


def pack_params(reqs: list[Request], vocab: int, rows: int = 0, pad_slot: int = 0) -> np.ndarray:
    """(max(rows, N), PACKED_WIDTH) int64: each request's parameters with the reference's
    defaults for what it leaves unset (torch_backend.sampling_batch's), floats as float64 bits.

    Rows past the requests pad a batch to a captured graph's size: greedy, drawing nothing, no
    penalty, in `pad_slot`. Their penalty writes are no-ops, but a write races with a request's
    in the same slot, so `pad_slot` must be one no request holds (a scratch slot), with a row in
    the PenaltyState."""
    floats = np.array([
        (p.temperature, 1.0 if p.top_p is None else p.top_p, p.min_p or 0.0,
         1.0 if p.typical_p is None else p.typical_p, p.repetition_penalty or 1.0,
         p.frequency_penalty, p.presence_penalty)
        for p in (r.params for r in reqs)
    ], dtype=np.float64).reshape(len(reqs), len(FLOAT_COLUMNS))
    ints = np.array([
        (min(max(r.params.top_k or vocab, 1), vocab), r.seed, len(r.generated), r.slot,
         needs_draw(r), uses_penalties(r))
        for r in reqs
    ], dtype=np.int64).reshape(len(reqs), PACKED_WIDTH - len(FLOAT_COLUMNS))
    packed = np.concatenate([floats.view(np.int64), ints], axis=1)
    if rows <= len(reqs):
        return packed
    pad = np.array([(0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0)], dtype=np.float64).view(np.int64)
    pad = np.concatenate([pad, [[vocab, 0, 0, pad_slot, 0, 0]]], axis=1)
    return np.concatenate([packed, np.repeat(pad, rows - len(reqs), axis=0)])


def record_penalties(penalties: PenaltyState, p: DeviceParams, tokens: torch.Tensor) -> None:
    """PenaltyState.record without its host-side row selection: every row writes, rows without
    penalties write what was there (| False, + 0). Slots are distinct within a step, so no two
    rows touch the same cell and a plain write does what an accumulating one would (CUDA's
    accumulating index_put_ sorts the indices first)."""
    where = (p.slot, tokens)
    penalties.seen.index_put_(where, penalties.seen[where] | p.penalised)
    penalties.counts.index_put_(where, penalties.counts[where] + p.penalised.to(penalties.counts.dtype))


class DeviceDraw:
    """Callable as torch_backend.torch_draw (reqs, logits, greedy, penalties, vocab); holds the
    pinned staging buffer its parameter copies go through, so make one per backend."""

    def __init__(self) -> None:
        self._staging: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def params(self, reqs: list[Request], vocab: int, device: torch.device) -> DeviceParams:
        """The rows' parameters on `device`, one copy."""
        packed = torch.from_numpy(pack_params(reqs, vocab))
        if device.type != "cuda":
            return DeviceParams.unpack(packed.to(device))
        if self._copied is not None:  # the last copy out of the staging buffer has finished
            self._copied.synchronize()
        if self._staging is None or self._staging.shape[0] < len(reqs):
            self._staging = torch.empty((max(len(reqs), 64), PACKED_WIDTH), dtype=torch.int64).pin_memory()
        staged = self._staging[: len(reqs)]
        staged.copy_(packed)
        on_device = staged.to(device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return DeviceParams.unpack(on_device)

    def __call__(self, reqs: list[Request], logits: torch.Tensor, greedy: torch.Tensor,
                 penalties: PenaltyState, vocab: int) -> torch.Tensor:
        """The next token of every row: rows that draw (needs_draw) by device_sample, the others
        `greedy`; the penalised rows' tokens recorded in `penalties`. Logit bias and grammar masks
        are already in `logits` (the runner adds them before any draw)."""
        p = self.params(reqs, vocab, logits.device)
        # Host-known flags choose which ops run (and so which graph a capture would replay).
        penal = any(uses_penalties(r) for r in reqs)
        typical = any(r.params.typical_p is not None and r.params.typical_p < 1 for r in reqs)
        sample = any(r.params.temperature > 0 for r in reqs)
        seen = penalties.seen.index_select(0, p.slot) if penal else None
        counts = penalties.counts.index_select(0, p.slot) if penal else None
        drawn = device_sample(logits, p, seen, counts, typical=typical, sample=sample)
        tokens = torch.where(p.draws, drawn, greedy)
        if penal:
            record_penalties(penalties, p, tokens)
        return tokens


class TokenReadback:
    """A step's tokens to the host in one copy: on CUDA into a pinned buffer, non-blocking, the
    host waiting on an event only when it reads them (`tokens`), so it can plan the next step
    meanwhile; elsewhere a plain copy."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._ready: torch.cuda.Event | None = None
        self._rows = 0

    def start(self, tokens: torch.Tensor) -> None:
        self._rows = len(tokens)
        if tokens.device.type != "cuda":
            self._host, self._ready = tokens.cpu(), None
            return
        if self._ready is not None:  # the buffer's last copy is read before it is reused
            self._ready.synchronize()
        if self._host is None or self._host.shape[0] < self._rows:
            self._host = torch.empty(max(self._rows, 64), dtype=torch.long).pin_memory()
        self._host[: self._rows].copy_(tokens, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def tokens(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        assert self._host is not None, "start() first"
        return self._host[: self._rows].tolist()
