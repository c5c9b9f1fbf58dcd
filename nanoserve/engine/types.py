"""The engine's public vocabulary: request parameters, token events, errors, observer hooks.

Routes, metrics and tests speak only these types; everything that batches, caches or samples
stays behind `Engine` (nanoserve/engine/engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Protocol


class FinishReason(str, Enum):
    LENGTH = "length"  # max_new_tokens reached
    EOS_TOKEN = "eos_token"  # the model produced its end-of-text token
    STOP_SEQUENCE = "stop_sequence"  # a stop string appeared in the decoded text
    CANCELLED = "cancelled"  # the consumer went away / cancelled the iterator
    ERROR = "error"  # this request failed inside the engine (others keep running)


@dataclass(frozen=True)
class GrammarSpec:
    """Structured output: the text must match a JSON Schema (given as JSON text) or a regex."""

    kind: Literal["json_schema", "regex"]
    value: str


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation parameters (validated by the engine; routes validate shapes)."""

    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 means greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None  # multiplicative, HF/CTRL style (> 1 discourages)
    frequency_penalty: float = 0.0  # additive, OpenAI style
    presence_penalty: float = 0.0  # additive, OpenAI style
    stop: tuple[str, ...] = ()
    keep_stop: bool = False  # the text keeps a matched stop string (TGI) instead of ending before it
    stop_on_eos: bool = True
    seed: int | None = None  # None: the engine picks one and reports it
    logprobs: bool = False  # logprob of each chosen token
    top_n_tokens: int = 0  # this many top alternatives per step, with logprobs
    deadline_s: float | None = None  # optional wall-clock budget from submission
    truncate: int | None = None  # keep only the last `truncate` prompt tokens (TGI)
    # (token id, bias) pairs added to the logits before any processing or sampling (OpenAI's
    # logit_bias): -100 all but bans a token, +100 all but forces it.
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None  # the generated text must match it (nanoserve/engine/grammar.py)
    grammar_param: str = "grammar"  # the request field that carried the grammar, for errors
    # The first event carries the prompt as the model saw it (`TokenEvent.prompt`); with
    # `prompt_logprobs` N (not None) each prompt token is scored too, with its N most likely
    # alternatives (only with echo). max_new_tokens 0 is allowed with echo: the prompt is echoed
    # (and scored) and nothing generated.
    echo: bool = False
    prompt_logprobs: int | None = None
    # Prefix reuse (prefix_cache.py) with the requests naming the same salt (vLLM's cache_salt),
    # whatever their client, instead of with the requests of the same client.
    cache_salt: str | None = None


@dataclass(frozen=True)
class TopToken:
    id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class PromptToken:
    """One prompt token; `logprob` is that of the token given the ones before it (None for the
    first, which nothing predicts, or when the prompt was not scored)."""

    id: int
    text: str
    logprob: float | None = None
    top_tokens: tuple[TopToken, ...] = ()


@dataclass(frozen=True)
class Prompt:
    """The prompt as the model saw it (after any cropping): its text and its tokens."""

    text: str
    tokens: tuple[PromptToken, ...]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # tokens actually fed to the model after cropping
    generated_tokens: int
    cropped_tokens: int  # prompt tokens dropped from the left to fit the window
    seed: int  # the seed actually used (reported even when the request gave none)
    queue_time_s: float  # submission -> first scheduled
    prefill_time_s: float
    ttft_s: float  # submission -> first token
    total_time_s: float


# TokenEvent.error_code of a request whose grammar could not be followed (a bound passed, or a text
# this vocabulary cannot go on with): the request's own fault.
GRAMMAR_FAILED = "grammar_failed"


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. `text` is the delta: all deltas concatenate to the full text.

    `text` may be "" while a possible stop string or a partial UTF-8 character is held back.
    The last event of a request has `finish_reason` and `usage` set (and may carry
    `token_id = None` when the request ended without producing a new token, e.g. on error).
    """

    index: int
    token_id: int | None
    text: str
    logprob: float | None = None
    special: bool = False
    top_tokens: tuple[TopToken, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None  # set with finish_reason ERROR: what went wrong
    # With ERROR, when the request itself is at fault: GRAMMAR_FAILED (its grammar failed while
    # generating, engine/grammar_limits.py); a server answers it as the client's error.
    error_code: str | None = None
    prompt: Prompt | None = None  # on a request's first event when SamplingParams.echo asked for it


class EngineError(Exception):
    """Base class for errors `Engine.generate` raises before the first token."""

    code = "engine_error"


class Overloaded(EngineError):
    """The waiting queue is full: retry later (HTTP 429 + Retry-After)."""

    code = "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(EngineError):
    """Not warmed up yet, or draining / shut down (HTTP 503)."""

    code = "not_ready"


class Draining(NotReady):
    """The engine is shutting down: it admits nothing more (HTTP 503, as the server's drain gate)."""

    code = "draining"


class InvalidRequest(EngineError):
    """A request the engine cannot run, e.g. text the tokenizer cannot represent (HTTP 422)."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLong(InvalidRequest):
    """The prompt exceeds the window and the engine is set to reject instead of crop."""

    code = "prompt_too_long"

    def __init__(self, prompt_tokens: int, max_tokens: int) -> None:
        super().__init__(
            f"prompt has {prompt_tokens} tokens, more than the {max_tokens} this model's window "
            f"holds (cropping is disabled)",
            param="inputs",
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens


@dataclass
class EngineStats:
    """A snapshot for /metrics and /info: read at scrape time."""

    running: int
    waiting: int
    slots_used: int
    slots_total: int
    kv_cache_bytes: int
    steps: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class EngineObserver(Protocol):
    """Hooks the engine calls from its thread; metrics implement them. Must be cheap."""

    def on_step(self, duration_s: float, batch_size: int, prefill_tokens: int) -> None: ...

    def on_finish(self, reason: FinishReason, usage: Usage) -> None: ...

    def on_rejected(self, reason: str) -> None: ...


class NullObserver:
    def on_step(self, duration_s: float, batch_size: int, prefill_tokens: int) -> None:
        pass

    def on_finish(self, reason: FinishReason, usage: Usage) -> None:
        pass

    def on_rejected(self, reason: str) -> None:
        pass
