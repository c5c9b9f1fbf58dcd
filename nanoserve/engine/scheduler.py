"""Iteration-level (continuous) batching: what runs in each step.

Waiting requests are admitted into free KV slots (admission.py decides which); each step,
`schedule()` plans work for every running sequence (the next prompt chunk within the prefill
budget, or one decode token) as a `StepPlan` of plain data, the engine core (core.py) executes
it on the runner, and `update_from_output()` turns each sampled token into an event. Requests
that finish, fail or are cancelled give back their slot in the same step. Nothing here touches
tensors: what admission and prompt sharing do to the KV slots is recorded as slot operations the
next plan carries.

Context cropping lives here too. Positions are learned embeddings, so a sequence that outgrows
the window must be recomputed from a cropped context:
- `sliding`: after every token keep the last `window` tokens and re-prefill them (exactly
  nanoGPT's `generate`; costs a full-window prefill per token once past the window);
- `shift`: when the context would exceed the window, keep its last `keep` tokens and
  re-prefill them once; the next `window - keep` tokens decode from the cache again.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.prefix_cache import PrefixCache, tenant_of
from nanoserve.engine.prompt_scores import ScoringCost
from nanoserve.engine.request import Request
from nanoserve.engine.step_cost import StepBudget, StepCost
from nanoserve.engine.step_plan import (
    CopyPrefix,
    ResetSlot,
    RowError,
    SlotOp,
    StepOutput,
    StepPlan,
    samples_tokens,
)
from nanoserve.engine.types import FinishReason, TokenEvent, TopToken
from nanoserve.engine.work import SampleResult, WorkItem
from nanoserve.model.tokenizer import Tokenizer


@dataclass
class StepResult:
    events: list[tuple[Request, TokenEvent]] = field(default_factory=list)
    batch_size: int = 0  # rows that ran this step
    prefill_tokens: int = 0  # prompt / re-prefill tokens fed this step
    decode_tokens: int = 0

    @property
    def finished(self) -> list[tuple[Request, TokenEvent]]:
        return [(r, e) for r, e in self.events if e.finish_reason is not None]


class Scheduler:
    """Owned by the engine thread; nothing here is thread-safe."""

    def __init__(self, tokenizer: Tokenizer, config: EngineConfig, window: int, *,
                 batch_invariant: bool, scoring: ScoringCost | None = None) -> None:
        """`batch_invariant`: the backend computes a row the same whatever else its forward holds;
        `scoring`: what a row that scores its prompt costs (default: as a plain row, unbounded)."""
        self.tokenizer = tokenizer
        self.config = config
        self.window = window
        self.keep = config.keep_tokens(window)
        self.eos_id = tokenizer.eos_id
        self.free_slots = list(range(config.max_seqs))
        self.running: list[Request] = []  # in admission order (FIFO for prefill)
        self.steps = 0
        self.context_shifts = 0
        self.preemptions = 0
        self.generated_tokens = 0
        self.prefilled_tokens = 0
        self.shared_prefill_tokens = 0  # prompt tokens a choice copied from its leader's slot
        # Prompt prefix reuse (prefix_cache.py). Deterministic mode promises the same bits whatever
        # the batch: a backend whose numbers depend on the forward's shape cannot keep it with reuse.
        reuse = config.prefix_cache and (not config.deterministic or batch_invariant)
        self.prefix = PrefixCache(enabled=reuse, shared=config.prefix_cache_shared)
        self._slot_ops: list[SlotOp] = []  # for the next plan, in order
        self.scoring = scoring or ScoringCost()
        self._turns = 0  # prompt chunks planned so far
        self._prefill_turn: dict[str | None, int] = {}  # client -> its last chunk's turn, while prefilling
        self.step_cost = StepCost()  # what a step's prompt rows cost its decoding rows (step_cost.py)
        self._credit = 0.0  # prompt rows still paid for while rows decode (plan())
        self._planned: tuple[int, bool] = (0, False)  # the last plan's charged prompt rows, decoding
        self._planned_at = 0.0

    def fits(self, req: Request) -> bool:
        """Whether `req` and its followers (one slot per choice) can all be admitted now."""
        return len(self.free_slots) >= 1 + len(req.followers)

    @property
    def has_free_slot(self) -> bool:
        return bool(self.free_slots)

    def admit(self, req: Request, now: float) -> None:
        """Seat `req` (and its followers) in free slots; `req` starts with whatever prefix of its
        context the prefix cache holds already in place."""
        if req.needs_prompt_logits:  # a reused prefix would compute none of its prompt's logits
            self._seat(req, self.prefix.cheapest(self.free_slots), now)
        else:
            # Placed where the longest prefix of its context is cached (prefix_cache.py).
            place = self.prefix.place(req.ctx, self.free_slots, self.running, tenant_of(req))
            if place.source is not None:
                self._slot_ops.append(CopyPrefix(place.source, place.slot, place.reuse))
            self._seat(req, place.slot, now)
            req.n_cached = place.reuse
        for follower in req.followers:  # each holds its slot, idle until the leader shares
            self._seat(follower, self.prefix.cheapest(self.free_slots), now)

    def _seat(self, req: Request, slot: int, now: float) -> None:
        self.free_slots.remove(slot)
        self.prefix.forget(slot)
        req.slot = slot
        req.scheduled_at = now
        self.running.append(req)
        self._slot_ops.append(ResetSlot(req, slot))

    def release(self, req: Request, reusable: bool = True) -> None:
        """Give back `req`'s slot; unless `reusable` is False (its cache may hold garbage), the slot
        remembers the tokens its cache holds for a later prompt to reuse."""
        if req.slot >= 0:
            if reusable:
                self.prefix.remember(req.slot, req.ctx[: req.n_cached], tenant_of(req))
            else:
                self.prefix.forget(req.slot)
            self.free_slots.append(req.slot)
            self.free_slots.sort()  # lowest first: batches stay dense in the cache
            req.slot = -1
        if req in self.running:
            self.running.remove(req)
        for follower in req.followers:  # the leader ends before sharing: each prefills alone
            follower.leader = None
        req.followers = []

    def share_prefill(self, leader: Request) -> None:
        """The leader's prompt is in its slot: copy it into each follower's slot (before the next
        forward), all but the last position, which each follower feeds itself to compute its own
        first logits."""
        length = leader.n_cached
        for follower in leader.followers:
            shared = max(0, length - 1)
            self._slot_ops.append(CopyPrefix(leader.slot, follower.slot, shared))
            follower.n_cached = shared
            follower.leader = None
            follower.prompt_scores.extend(leader.prompt_scores)  # the same prompt, scored once
            self.shared_prefill_tokens += shared
        leader.followers = []

    def preempt(self, req: Request) -> None:
        """Take `req`'s slot back for another client; when admitted again it re-prefills its
        context (less what the prefix cache still holds of it) and goes on drawing the same tokens
        (a draw depends on the request's seed and step only)."""
        self.release(req)
        req.n_cached = 0
        if req.needs_prompt_logits:  # scored again from the start with the re-prefill
            req.prompt_scores.clear()
        self.preemptions += 1

    def victims(self, req: Request, *, aged: bool) -> list[Request] | None:
        """Running requests whose slots, with the free ones, seat `req`'s group (one slot a
        choice), or None when not enough may be taken: one at a time from the client holding the
        most slots, its newest first. Unless `aged` (a group that has waited past
        max_group_wait_s: whoever holds its slots yields), a client yields only while it keeps a
        slot (so it never becomes one that waits with none and preempts back), and requests
        without a client and `req`'s own client never yield. Choices whose leader has not shared
        its prompt yet never yield (one of them waits to copy it)."""
        missing = 1 + len(req.followers) - len(self.free_slots)
        if missing <= 0:
            return []
        held = Counter(r.client for r in self.running)
        yielding = [r for r in self.running if not _grouped(r)
                    and (aged or (r.client is not None and r.client != req.client))]
        chosen: list[Request] = []
        while len(chosen) < missing:
            # `yielding` is in admission order: max over its reverse takes the newest of the tie.
            victim = max(reversed(yielding), key=lambda r: held[r.client], default=None)
            if victim is None or (not aged and held[victim.client] < 2):
                return None
            yielding.remove(victim)
            held[victim.client] -= 1
            chosen.append(victim)
        return chosen

    def reap(self, now: float) -> list[tuple[Request, TokenEvent]]:
        """End running requests that were cancelled or ran out of time before this step."""
        ended: list[tuple[Request, TokenEvent]] = []
        for req in list(self.running):
            if req.cancelled:
                event = req.final_event(FinishReason.CANCELLED, now)
            elif req.deadline is not None and now >= req.deadline:
                event = req.final_event(FinishReason.LENGTH, now)
            else:
                continue
            self.release(req)
            ended.append((req, event))
        return ended

    def fail_all(self, message: str, result: StepResult) -> None:
        now = time.perf_counter()
        for req in list(self.running):
            self._end(req, result, req.final_event(FinishReason.ERROR, now, error=message))

    def _end(self, req: Request, result: StepResult, event: TokenEvent) -> None:
        # A failed forward or non-finite logits: the slot's cache is not worth reusing.
        self.release(req, reusable=event.finish_reason is not FinishReason.ERROR)
        result.events.append((req, event))

    def plan(self) -> list[WorkItem]:
        """Decode rows (one pending token) always run; prompt chunks run within the budget, the
        clients whose prompts were served longest ago first (round robin, then admission order),
        so one client's long prompts do not hold another's first chunk for all of theirs.

        A chunk is min(pending, prefill_budget) whatever else runs, so a request is cut into the
        same chunks alone or batched. A chunk that scores its prompt is charged what its rows cost
        (prompt_scores.ScoringCost: the output layer over the vocabulary, a plain row skips it),
        so it takes fewer rows, and a step's scored rows hold at most max_rows rows of logits.
        When no row decodes, nobody waits for the step: its budget is the larger idle one (the
        first chunk always runs), except that long prompts' chunks that do not complete take at
        most prefill_budget or the rows below, whichever is more: a request that arrives waits for
        the step in flight. While rows decode, chunks share prefill_budget and are also paid from
        a credit that grows each step by the prompt rows half a decode-only step's time buys
        (step_cost.py, once measured): a decoding stream's steps cost at most 1.5x a decode-only
        step on average, however many clients send long prompts. A chunk that credit cannot pay
        waits, and so do the chunks behind it, so none is passed for ever. When prompts outnumber
        decoding rows by waiting_served_ratio, the chunks that complete their prompt (a wave of
        prompts arriving together) take the idle budget without credit, and the wave gets its
        first tokens from one forward; long prompts' other chunks do not.
        """
        # A follower waits for its leader's prefill (share_prefill): it plans nothing.
        leaders = [req for req in self.running if req.leader is None]
        prompts = [req for req in leaders if req.pending > 1]
        decoding = len(leaders) - len(prompts)
        wave = len(prompts) >= self.config.waiting_served_ratio * decoding
        per_step = self.step_cost.prompt_rows_per_step()
        budgets = StepBudget(self.config, decoding, wave, self._prompt_credit(decoding, per_step), per_step)
        self._prefill_turn = {r.client: self._prefill_turn.get(r.client, -1) for r in prompts}
        chunks: dict[int, WorkItem] = {}
        scored_room = self.scoring.max_rows
        for req in sorted(prompts, key=lambda r: self._prefill_turn[r.client]):  # stable: oldest first
            scoring = req.prompt_rows_to_score(req.n_cached, req.pending) > 0
            limit = self.scoring.rows(self.config.prefill_budget) if scoring else self.config.prefill_budget
            chunk = min(req.pending, limit)
            cost = self.scoring.cost(chunk) if scoring else chunk
            if chunks and scoring and chunk > scored_room:
                continue
            if not budgets.take(cost, completes=chunk == req.pending, first=not chunks):
                continue
            scored_room -= chunk if scoring else 0
            self._turns += 1
            self._prefill_turn[req.client] = self._turns
            tokens = req.ctx[req.n_cached : req.n_cached + chunk]
            chunks[id(req)] = WorkItem(req, tokens, req.n_cached, completes=chunk == req.pending,
                                       scores=req.prompt_rows_to_score(req.n_cached, chunk))
        self._credit = budgets.credit if decoding else 0.0  # a stream that starts decoding pays its own way
        self._planned = (budgets.spent, decoding > 0)
        items = []
        for req in leaders:  # in admission order, as they run
            if req.pending == 1:
                items.append(WorkItem(req, req.ctx[-1:], req.n_cached, completes=True))
            elif id(req) in chunks:
                items.append(chunks[id(req)])
        return items

    def _prompt_credit(self, decoding: int, per_step: float | None) -> float:
        """Prompt rows the credit lets this step carry beside decoding rows: what is left, plus
        `per_step` (what a share of a decode-only step's time buys), at most prefill_budget (it
        never banks a burst, nor starts with one); unbounded while nothing decodes or before both
        costs are measured."""
        if decoding == 0 or per_step is None:
            return float("inf")
        return min(self._credit + max(1.0, per_step), self.config.prefill_budget)

    def schedule(self, now: float) -> StepPlan:
        """This step's plan: requests cancelled or past their deadline end first, then every
        running sequence's work (plan()), with the slot operations recorded since the last plan."""
        ended = self.reap(now)
        items = self.plan()
        self._planned_at = now
        if items:
            self.steps += 1
        ops, self._slot_ops = self._slot_ops, []
        return StepPlan(self.steps if items else 0, items, ops, ended)

    def update_from_output(self, plan: StepPlan, output: StepOutput) -> StepResult:
        """Apply what the backend made of `plan`: cached positions, finished prefills, prompt
        sharing, and one event per drawn token (or failure)."""
        result = StepResult(events=list(plan.ended))
        if not plan.items:
            return result
        self.step_cost.observe(output.forward_done - self._planned_at, *self._planned)
        for i, item in enumerate(plan.items):
            req, n = item.req, len(item.tokens)
            if i in output.errors:
                self._end(req, result, req.final_event(FinishReason.ERROR, output.forward_done,
                                                       error=output.errors[i]))
                continue
            req.n_cached += n - (i in output.deferred)  # a deferred row feeds its token again
            if n > 1 or req.prefill_done_at is None:
                result.prefill_tokens += n
            if item.completes and req.prefill_done_at is None:
                req.prefill_done_at = output.forward_done
                if req.followers:
                    self.share_prefill(req)
        result.batch_size = len(plan.items)
        self.prefilled_tokens += result.prefill_tokens
        # A request that only scores its prompt (max_new_tokens 0) ends here, its prompt on its only event.
        now = time.perf_counter()
        for i in output.rows:
            req = plan.items[i].req
            if not samples_tokens(req):
                self._end(req, result, req.final_event(FinishReason.LENGTH, now))
        for sampled in output.samples:
            if isinstance(sampled, RowError):
                req = sampled.req
                self._end(req, result, req.final_event(FinishReason.ERROR, time.perf_counter(),
                                                       error=sampled.message))
            else:
                self._emit(sampled, result)
        return result

    def _emit(self, sampled: SampleResult, result: StepResult) -> None:
        now = time.perf_counter()
        for j, req in enumerate(sampled.reqs):
            if not sampled.finite[j]:
                event = req.final_event(
                    FinishReason.ERROR, now, error="the model produced non-finite logits (NaN/inf)"
                )
                self._end(req, result, event)
                continue
            token = sampled.tokens[j]
            event = req.accept_token(token, self.eos_id, _logprob(sampled, j), self._top(sampled, j), now)
            result.decode_tokens += 1
            self.generated_tokens += 1
            if req.finished:
                self._end(req, result, event)
                continue
            result.events.append((req, event))
            self._extend_context(req, token)

    def _extend_context(self, req: Request, token: int) -> None:
        req.ctx.append(token)
        if len(req.ctx) <= self.window:
            return
        # The context outgrew the window: crop and recompute (see the module docstring).
        keep = self.window if self.config.crop_policy == "sliding" else self.keep
        req.ctx = req.ctx[-keep:]
        req.n_cached = 0
        req.shifts += 1
        self.context_shifts += 1

    def _top(self, sampled: SampleResult, j: int) -> tuple[TopToken, ...]:
        n = sampled.reqs[j].params.top_n_tokens
        if n <= 0 or sampled.top_ids is None or sampled.top_logprobs is None:
            return ()
        ids, lps = sampled.top_ids[j][:n], sampled.top_logprobs[j][:n]
        return tuple(TopToken(i, self.tokenizer.id_to_piece(i), lp) for i, lp in zip(ids, lps, strict=True))


def _grouped(req: Request) -> bool:
    return req.leader is not None or bool(req.followers)


def _logprob(sampled: SampleResult, j: int) -> float | None:
    params = sampled.reqs[j].params
    if sampled.logprobs is None or not (params.logprobs or params.top_n_tokens):
        return None
    return sampled.logprobs[j]
