"""One request's life inside the engine: its context, its slot, its text and its events.

Everything here except `cancelled` is touched only by the engine thread.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from nanoserve.engine.detokenizer import IncrementalDecoder, StopMatcher
from nanoserve.engine.grammar import Constraint
from nanoserve.engine.inbox import Inbox
from nanoserve.engine.prompt_scores import PromptScores, prompt_of
from nanoserve.engine.types import (
    GRAMMAR_FAILED,
    FinishReason,
    Prompt,
    SamplingParams,
    TokenEvent,
    TopToken,
    Usage,
)
from nanoserve.model.tokenizer import Tokenizer


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]  # after cropping: what the model is fed
    params: SamplingParams
    seed: int
    cropped: int
    tokenizer: Tokenizer
    loop: asyncio.AbstractEventLoop
    queue: Inbox[TokenEvent]
    client: str | None = None  # who asked (an API key's or a peer's id), for fair admission
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set from the event loop; read by the engine thread
    constraint: Constraint | None = None  # structured output: masks the logits, ends the text
    # --- engine-thread state ---
    slot: int = -1
    ctx: list[int] = field(default_factory=list)  # tokens the next logits are conditioned on
    n_cached: int = 0  # ctx[:n_cached] sit in the KV cache at positions 0..n_cached-1
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    shifts: int = 0
    scheduled_at: float | None = None
    prefill_done_at: float | None = None
    first_token_at: float | None = None
    # --- one prompt, several choices (n / best_of): the leader prefills it once ---
    leader: Request | None = None  # a follower waits (holding its slot) until this one's prefill
    followers: list[Request] = field(default_factory=list)  # the leader's, until it shares
    # --- echo and prompt logprobs ---
    prompt_scores: PromptScores = field(default_factory=PromptScores)
    prompt_sent: bool = False  # the first event carried the prompt

    @property
    def group(self) -> list[Request]:
        """This request and the followers waiting for its prefill."""
        return [self, *self.followers]

    def __post_init__(self) -> None:
        self.ctx = list(self.prompt_ids)
        self.decoder = IncrementalDecoder(self.tokenizer)
        self.stopper = StopMatcher(self.params.stop, keep=self.params.keep_stop)
        self.deadline = (
            self.submitted + self.params.deadline_s if self.params.deadline_s is not None else None
        )

    @property
    def pending(self) -> int:
        """Context tokens not yet in the cache (a whole prompt, a re-prefill, or one new token)."""
        return len(self.ctx) - self.n_cached

    @property
    def needs_prompt_logits(self) -> bool:
        """The prompt is still to be scored (prompt logprobs): every prompt token must go through
        the model (a prefix cache may not skip any), each position's logits returned."""
        return self.params.prompt_logprobs is not None and len(self.prompt_scores) < len(self.prompt_ids) - 1

    def prompt_rows_to_score(self, start: int, count: int) -> int:
        """How many positions of a chunk feeding positions start..start+count-1 score the prompt
        token after them: those up to the last but one prompt token, when the chunk continues the
        scores (the context still begins with the prompt: no window shift yet)."""
        if not self.needs_prompt_logits or self.shifts or start != len(self.prompt_scores):
            return 0
        return max(0, min(start + count, len(self.prompt_ids) - 1) - start)

    def _prompt_once(self) -> Prompt | None:
        """The prompt for the request's first event, when echo asked for it."""
        if self.prompt_sent or not self.params.echo:
            return None
        self.prompt_sent = True
        scored = self.prompt_scores if self.params.prompt_logprobs is not None else None
        return prompt_of(self.tokenizer, self.prompt_ids, scored)

    def usage(self, now: float) -> Usage:
        scheduled = self.scheduled_at if self.scheduled_at is not None else now
        prefill_done = self.prefill_done_at if self.prefill_done_at is not None else scheduled
        first = self.first_token_at if self.first_token_at is not None else now
        return Usage(
            prompt_tokens=len(self.prompt_ids),
            generated_tokens=len(self.generated),
            cropped_tokens=self.cropped,
            seed=self.seed,
            queue_time_s=scheduled - self.submitted,
            prefill_time_s=prefill_done - scheduled,
            ttft_s=first - self.submitted,
            total_time_s=now - self.submitted,
        )

    def accept_token(
        self,
        token_id: int,
        eos_id: int | None,
        logprob: float | None,
        top: tuple[TopToken, ...],
        now: float,
    ) -> TokenEvent:
        """Record a sampled token; returns its event (the final one when the request ends)."""
        c = self.constraint
        if c is not None and c.failure is None:
            c.accept(token_id)
        if c is not None and c.failure is not None:
            # The grammar cannot be followed (a limit hit, or its masks over budget): the token
            # was drawn without a valid mask, or broke the matcher, and is not kept.
            return self.final_event(FinishReason.ERROR, now, error=c.failure, code=GRAMMAR_FAILED)
        if self.first_token_at is None:
            self.first_token_at = now
        index = len(self.generated)
        self.generated.append(token_id)
        special = self.tokenizer.is_special(token_id)
        reason: FinishReason | None = None
        if self.params.stop_on_eos and (token_id == eos_id or token_id in self.tokenizer.end_ids):
            # An end token (end-of-text, a chat model's end of turn) ends the text; it is not part of it.
            text, reason = self.stopper.flush(), FinishReason.EOS_TOKEN
        else:
            text, stopped = self.stopper.feed(self.decoder.add(token_id))
            if stopped:
                reason = FinishReason.STOP_SEQUENCE
            elif self.constraint is not None and self.constraint.complete:
                reason = FinishReason.EOS_TOKEN  # the grammar allows nothing more: the text is done
            elif len(self.generated) >= self.params.max_new_tokens:
                reason = FinishReason.LENGTH
            elif self.deadline is not None and now >= self.deadline:
                reason = FinishReason.LENGTH  # a time budget is a length limit (llama.cpp does so)
            if reason is not None and reason is not FinishReason.STOP_SEQUENCE:
                text += self._flush_text()
        event = TokenEvent(
            index=index, token_id=token_id, text=text, logprob=logprob, special=special, top_tokens=top,
            prompt=self._prompt_once(),
        )
        if reason is None:
            return event
        self.finished = True
        return replace(event, finish_reason=reason, usage=self.usage(now))

    def _flush_text(self) -> str:
        text, stopped = self.stopper.feed(self.decoder.flush())
        return text if stopped else text + self.stopper.flush()

    def final_event(self, reason: FinishReason, now: float, error: str | None = None,
                    code: str | None = None) -> TokenEvent:
        """The closing event when the request ends without a new token (cancel, error, drain)."""
        self.finished = True
        text = self._flush_text() if reason is not FinishReason.ERROR else ""
        prompt = self._prompt_once() if reason is not FinishReason.ERROR else None
        event = TokenEvent(index=len(self.generated), token_id=None, text=text, prompt=prompt)
        return replace(event, finish_reason=reason, usage=self.usage(now), error=error, error_code=code)
