"""The tensor side of a step: batched forwards over the KV cache slots, then sampling.

The scheduler decides *what* runs (which rows, which tokens, which positions); the runner turns
that into as few forward passes as possible and isolates failures to the rows that caused them.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

import torch

from model.gpt import GPT
from model.sampling import (
    SamplingBatch,
    candidate_width,
    row_max,
    sample_tokens,
    seeded_uniform,
    token_logprobs,
)
from service.engine.decode_step import DecodeStep
from service.engine.kv_slots import SpanKVCache
from service.engine.native_step import NativeStep, SamplePenalties, release_weights
from service.engine.request import Request
from service.engine.threads import ThreadTuner

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injection hook (EngineConfig.fault_injection)."""


@dataclass
class WorkItem:
    """Feed `tokens` of `req` at positions start.. into its slot; sample if `completes`."""

    req: Request
    tokens: list[int]
    start: int
    completes: bool


@dataclass
class SampleResult:
    """Host-side results of one step's sampling, row-aligned with the rows that sampled."""

    reqs: list[Request]
    tokens: list[int]
    finite: list[bool]
    logprobs: list[float] | None
    top_logprobs: list[list[float]] | None
    top_ids: list[list[int]] | None


@dataclass
class Forward:
    """A step's logits: row k belongs to item rows[k]; failed items are in errors instead."""

    rows: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # (len(rows), V)
    errors: dict[int, str] = field(default_factory=dict)
    pieces: list[torch.Tensor] = field(default_factory=list)  # one per group, joined into logits

    def joined(self) -> Forward:
        # One group (every decode step without prompt chunks) is handed on as it came: no copy.
        if self.pieces:
            self.logits = self.pieces[0] if len(self.pieces) == 1 else torch.cat(self.pieces)
        self.pieces = []
        return self


def _inference(fn: Callable[P, R]) -> Callable[P, R]:
    """torch.inference_mode for callers outside it; free for the engine thread, which runs its
    whole loop inside one (entering and leaving the mode per call was ~4% of a batch-1 step at
    10.7M, measured with py-spy)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run


class ModelRunner:
    def __init__(
        self, model: GPT, slots: int, window: int, usable_vocab: int, deterministic: bool = False,
        cpu_threads: int = 1, native_max_rows: int = 0, kv_dtype: torch.dtype | None = None,
        native_isa: str = "auto",
    ) -> None:
        self.model = model
        self.device = model.wte.weight.device
        cfg = model.config
        kv_dtype = kv_dtype or model.wte.weight.dtype
        self.cache = SpanKVCache(cfg.n_layer, slots, cfg.n_head, window, cfg.head_dim, kv_dtype, self.device)
        # Decode steps (one token per row) skip the general forward (decode_step.py); None
        # when the model is compiled, so the compiled graph runs every step.
        self.decode_step: DecodeStep | None = DecodeStep(model, self.cache)
        # With native_max_rows > 0 (CPU, float32 or bfloat16) every forward of up to that many tokens (decode
        # rows and prompt chunks alike; the engine sizes it to its largest step) is one native
        # call instead (native_step.py). Rows are computed independently there, so batched and
        # alone give the same bits and deterministic mode may batch them too.
        self.native_step: NativeStep | None = None
        self.released_bytes = 0
        if native_max_rows > 0:
            self.native_step = NativeStep(
                model, self.cache, max_threads=cpu_threads, max_rows=native_max_rows, hold_once=True,
                max_isa=native_isa,
            )
            # Every forward now fits the native step (the engine sizes it to its largest step),
            # which holds its own copies of the weights: the model's would only hold them twice
            # (native_step.release_weights); nothing may run the torch path after this.
            self.decode_step = None
            self.released_bytes = release_weights(model)
        self.vocab = model.config.vocab_size
        # nanoGPT pads the vocabulary (50257 -> 50304) for speed: ids the tokenizer cannot
        # decode must never be sampled.
        self.usable_vocab = usable_vocab
        self.deterministic = deterministic
        # Penalty state per slot, kept on the device so a step never rebuilds it from lists:
        # which tokens the context holds (repetition) and how often each was generated (OpenAI).
        self.seen = torch.zeros(slots, self.vocab, dtype=torch.bool, device=self.device)
        self.counts = torch.zeros(slots, self.vocab, dtype=torch.int32, device=self.device)
        # CPU threads per forward: measured per forward size, see threads.py. Deterministic
        # mode keeps one fixed count (a different count may change the kernels' rounding).
        self.cpu_threads = cpu_threads
        self.threads = ThreadTuner(cpu_threads, enabled=self.device.type == "cpu" and not deterministic)

    # ---- forward -------------------------------------------------------------------------
    def forward(self, items: list[WorkItem]) -> Forward:
        """Run every item; returns the last-position logits of the items that complete their
        context (one row each, in `Forward.rows` order) and an error text per failed item index."""
        groups: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            # Deterministic mode runs rows alone, except on the native step: that computes each
            # row the same way whatever the batch, so they may share a forward.
            native = self.native_step is not None and len(item.tokens) <= self.native_step.max_rows
            key = i if self.deterministic and not native else -len(item.tokens)
            groups.setdefault(key, []).append(i)
        out = Forward()
        for idx in groups.values():
            # Rows in slot order: consecutive slots let the cache hand out a view, not a copy.
            idx.sort(key=lambda i: items[i].req.slot)
            t = len(items[idx[0]].tokens)
            # Groups the native step takes go to it in pieces of at most max_rows tokens.
            per = self.native_step.max_rows // t if self.native_step is not None else 0
            per = per if per > 0 else len(idx)
            for k in range(0, len(idx), per):
                self._run_isolated(items, idx[k : k + per], out)
        return out.joined()

    def _run_isolated(self, items: list[WorkItem], idx: list[int], out: Forward) -> None:
        """Forward a group; if it raises, bisect so only the culprit rows fail."""
        try:
            rows = self._run_group([items[i] for i in idx])
        except Exception as e:  # any failure is isolated to its rows
            if len(idx) == 1:
                log.warning("request %s failed in forward: %s", items[idx[0]].req.request_id, e)
                out.errors[idx[0]] = f"forward pass failed: {type(e).__name__}: {e}"
                return
            half = len(idx) // 2
            self._run_isolated(items, idx[:half], out)
            self._run_isolated(items, idx[half:], out)
            return
        keep = [j for j, i in enumerate(idx) if items[i].completes]
        if not keep:
            return
        if len(keep) < len(idx):  # prompt chunks that do not end their prompt sample nothing
            rows = rows[keep]
        out.rows += [idx[j] for j in keep]
        out.pieces.append(rows)

    @_inference
    def _run_group(self, items: list[WorkItem]) -> torch.Tensor:
        if any(item.req.fault == "raise" for item in items):
            raise InjectedFault("injected fault (fault_injection raise)")
        t = len(items[0].tokens)
        slot_list = [item.req.slot for item in items]
        if self.native_step is not None and len(items) * t > self.native_step.max_rows:
            # forward() never sends one; the model's weights are released (see __init__).
            raise RuntimeError(f"a forward of {len(items) * t} tokens is more than the native step's "
                               f"{self.native_step.max_rows} rows")
        self.threads.begin(len(items) * t)
        if self.native_step is not None:
            # Every token is a row; a prompt chunk's rows see each other's keys (native_step.py).
            tokens = [tok for it in items for tok in it.tokens]
            positions = [p for it in items for p in range(it.start, it.start + t)]
            rows = [it.req.slot for it in items for _ in range(t)]
            logits = self.native_step(tokens, positions, rows, [j * t + t - 1 for j in range(len(items))])
        else:
            idx = torch.tensor([item.tokens for item in items], dtype=torch.long, device=self.device)
            start = torch.tensor([item.start for item in items], dtype=torch.long, device=self.device)
            pos = start.view(-1, 1) + torch.arange(t, device=self.device).view(1, -1)  # (G, T)
            slots = torch.tensor(slot_list, dtype=torch.long, device=self.device)
            self.cache.prepare(slot_list, [item.start + t for item in items])
            if t == 1 and self.decode_step is not None:
                logits = self.decode_step(idx.view(-1), pos.view(-1), slots)
            else:
                out = self.model(idx, input_pos=pos, cache=self.cache, slots=slots, last_only=True)
                logits = out[:, -1, :]
        self.threads.end()
        nan_rows = [j for j, item in enumerate(items) if item.req.fault == "nan"]
        if nan_rows:
            logits = logits.clone()
            logits[nan_rows] = float("nan")
        return logits  # (G, V)

    # ---- penalty state -------------------------------------------------------------------
    def reset_slot(self, req: Request) -> None:
        if not _uses_penalties(req):
            return
        self.seen[req.slot].zero_()
        self.counts[req.slot].zero_()
        self.seen[req.slot, torch.tensor(req.prompt_ids, device=self.device)] = True
        if req.generated:  # a preempted request admitted again: what it generated so far counts
            generated = torch.tensor(req.generated, device=self.device)
            self.seen[req.slot, generated] = True
            self.counts[req.slot].index_put_(
                (generated,), torch.ones_like(generated, dtype=torch.int32), accumulate=True
            )

    def _record(self, reqs: list[Request], tokens: torch.Tensor) -> None:
        rows = [j for j, r in enumerate(reqs) if _uses_penalties(r)]
        if not rows:
            return
        sel = torch.tensor(rows, device=self.device)
        slots = torch.tensor([reqs[j].slot for j in rows], device=self.device)
        toks = tokens[sel]
        self.seen[slots, toks] = True
        self.counts.index_put_((slots, toks), torch.ones_like(toks, dtype=torch.int32), accumulate=True)

    # ---- sampling ------------------------------------------------------------------------
    @_inference
    def sample(self, reqs: list[Request], logits: torch.Tensor) -> SampleResult:
        """Sample one token for each row of logits (N, V); rows without a usable distribution
        (a NaN, a +inf, or nothing above -inf) are flagged."""
        if self.usable_vocab < self.vocab:
            logits[:, self.usable_vocab :] = float("-inf")
        self._add_logit_bias(reqs, logits)
        # One pass gives both the check and the greedy pick: max propagates NaN, a +inf max breaks
        # the softmax, an all -inf row has nothing to pick; -inf entries elsewhere are ordinary
        # (probability zero). isfinite().all() + where + argmax took 3.6x as long at 50k logits
        # (220 vs 61 us a row), a fixed ~0.1 ms of a 1.3 ms batch-1 step at 10.7M.
        top, greedy = row_max(logits)  # ties: the first index, as argmax
        finite = [math.isfinite(v) for v in top]  # a few rows: cheaper than a torch op
        if not any(_draws(r) for r in reqs):
            tokens = greedy  # what sample_tokens returns for such a batch, without building one
        else:
            if not all(finite):  # rows without a distribution sample from zeros (then flagged)
                logits = torch.where(torch.tensor(finite, device=logits.device).view(-1, 1), logits, 0.0)
            tokens = self._draw(reqs, logits, greedy)
        top_n = max(r.params.top_n_tokens for r in reqs)
        want_lp = top_n > 0 or any(r.params.logprobs for r in reqs)
        lp = top_v = top_i = None
        if want_lp:
            lp, top_v, top_i = token_logprobs(logits, tokens, top_n)
        return SampleResult(
            reqs=reqs,
            tokens=tokens.tolist(),
            finite=finite,
            logprobs=lp.tolist() if lp is not None else None,
            top_logprobs=top_v.tolist() if top_v is not None else None,
            top_ids=top_i.tolist() if top_i is not None else None,
        )

    def _add_logit_bias(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """OpenAI's logit_bias, added in place to the raw logits of the rows that carry one: every
        later step (the greedy pick, penalties, filters, either sampler, logprobs) sees it, so
        the native and the torch sampler apply it alike."""
        for j, req in enumerate(reqs):
            if req.params.logit_bias:
                ids, values = zip(*req.params.logit_bias, strict=True)
                logits[j, list(ids)] += torch.tensor(values, dtype=logits.dtype, device=logits.device)

    def _draw(self, reqs: list[Request], logits: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        """Each row's token: rows the native sampler takes (native_sampler_takes) are drawn by it,
        the other sampled rows by model/sampling.py's sample_tokens, and greedy rows without a
        penalty keep their argmax. The way depends only on the row's own
        parameters, so a request draws the same tokens alone or beside any others."""
        tokens = greedy.clone()
        natively = [self.native_sampler_takes(r, logits) for r in reqs]
        if any(natively):
            assert self.native_step is not None
            ps = [r.params for r in reqs]
            penal = [j for j, r in enumerate(reqs) if natively[j] and _uses_penalties(r)]
            self.native_step.sample(
                logits,
                [p.temperature if n else -1.0 for p, n in zip(ps, natively, strict=True)],  # -1: skip
                [p.top_k or 0 for p in ps],
                [p.top_p if p.top_p is not None else 1.0 for p in ps],
                [p.min_p or 0.0 for p in ps],
                [seeded_uniform(r.seed, len(r.generated)) for r in reqs],
                tokens,
                SamplePenalties(
                    self.seen, self.counts, [r.slot for r in reqs],
                    [p.repetition_penalty or 1.0 for p in ps], [p.frequency_penalty for p in ps],
                    [p.presence_penalty for p in ps],
                ) if penal else None,
                typical_p=[p.typical_p if p.typical_p is not None else 1.0 for p in ps],
            )
            if penal:
                self._record([reqs[j] for j in penal], tokens[penal])
        rows = [j for j, (r, n) in enumerate(zip(reqs, natively, strict=True)) if not n and _draws(r)]
        if len(rows) == len(reqs):
            return self._sample(reqs, logits)
        if rows:
            tokens[rows] = self._sample([reqs[j] for j in rows], logits[rows])
        return tokens

    def native_sampler_takes(self, req: Request, logits: torch.Tensor) -> bool:
        """Whether the native step's sampler draws this row: sampled (temperature above 0), or
        greedy with a penalty (its argmax after the penalties), on CPU float32 logits; penalties,
        top_k, top_p, min_p and typical_p are its own."""
        return (
            self.native_step is not None and logits.dtype == torch.float32 and logits.is_contiguous()
            and self.seen.device.type == "cpu" and _draws(req)
        )

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """model/sampling.py's sample_tokens, penalties and their bookkeeping included."""
        batch = self._batch(reqs)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        penal = batch.repetition_penalty is not None or batch.frequency_penalty is not None
        tokens = sample_tokens(
            logits, batch,
            seen=self.seen.index_select(0, slots) if penal else None,
            counts=self.counts.index_select(0, slots) if penal else None,
        )
        self._record(reqs, tokens)
        return tokens

    def _batch(self, reqs: list[Request]) -> SamplingBatch:
        dev = self.device
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
        ks = [1 if p.temperature == 0 else (p.top_k or self.vocab) for p in ps]
        if any(k < self.vocab for k in ks):
            batch.top_k = torch.tensor(ks, dtype=torch.long, device=dev).view(-1, 1).clamp(1, self.vocab)
            batch.top_k_max = min(max(ks), self.vocab)
        if any(p.top_p is not None and p.top_p < 1 for p in ps):
            batch.top_p = col([p.top_p if p.top_p is not None else 1.0 for p in ps])
        if any(p.min_p for p in ps):
            batch.min_p = col([p.min_p or 0.0 for p in ps])
        if any(p.typical_p is not None and p.typical_p < 1 for p in ps):
            batch.typical_p = col([p.typical_p if p.typical_p is not None else 1.0 for p in ps])
        sampling = [p for p in ps if p.temperature > 0]
        batch.candidates = candidate_width(
            self.vocab,
            [min(k, self.vocab) for k, p in zip(ks, ps, strict=True) if p.temperature > 0],
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


def _draws(req: Request) -> bool:
    """Whether a row needs more than the argmax of its raw logits: it samples, or a penalty
    moves its greedy pick."""
    return req.params.temperature > 0 or _uses_penalties(req)


def _uses_penalties(req: Request) -> bool:
    p = req.params
    return p.repetition_penalty not in (None, 1.0) or bool(p.frequency_penalty or p.presence_penalty)
