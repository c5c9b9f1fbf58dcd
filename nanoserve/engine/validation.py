"""Request checks done before a request is queued, so HTTP can answer 4xx before a 200."""

from __future__ import annotations

import dataclasses
import math

from nanoserve.engine.types import InvalidRequest, PromptTooLong, SamplingParams

MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
MAX_TOP_N_TOKENS = 20
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_SEED = 2**63 - 1
# Counts and lengths pass through C ints and int64 tensors: anything above this is refused rather
# than left to overflow in the middle of a batch's step.
MAX_COUNT = 2**31 - 1


def _finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value!r}", param=name)


def _in_range(name: str, value: float | None, lo: float, hi: float, lo_open: bool = False) -> None:
    if value is None:
        return
    _finite(name, value)
    if value < lo or value > hi or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise InvalidRequest(f"{name} must be in {bound}, got {value!r}", param=name)


def _positive_int(name: str, value: int | None, allow_zero: bool = False) -> None:
    if value is None:
        return
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_COUNT:
        raise InvalidRequest(f"{name} must be an integer in [{low}, {MAX_COUNT}], got {value!r}",
                             param=name)


# Below this a temperature samples the argmax anyway, and logits / temperature overflows float32
# (from ~1e-37 at logits of ~10: either sampler then drew nonsense), so such requests decode
# greedily. vLLM's threshold.
GREEDY_BELOW = 1e-5


def effective_params(p: SamplingParams, vocab_size: int) -> SamplingParams:
    """The parameters the engine runs: a temperature above 0 but below GREEDY_BELOW is greedy, and
    a top_k of the whole vocabulary or more is off (0), so no sampler sees a k it cannot hold."""
    if 0 < p.temperature < GREEDY_BELOW:
        p = dataclasses.replace(p, temperature=0.0)
    if p.top_k is not None and p.top_k >= vocab_size:
        p = dataclasses.replace(p, top_k=0)
    return p


def validate_params(p: SamplingParams, vocab_size: int) -> None:
    """Raise InvalidRequest naming the first bad parameter."""
    # Echoing (and scoring) a prompt without generating, max_new_tokens 0, is how clients score text.
    _positive_int("max_new_tokens", p.max_new_tokens, allow_zero=p.echo)
    _in_range("temperature", p.temperature, 0.0, 100.0)
    _positive_int("top_k", p.top_k, allow_zero=True)  # 0 = disabled, as in HF
    _in_range("top_p", p.top_p, 0.0, 1.0, lo_open=True)
    _in_range("min_p", p.min_p, 0.0, 1.0)
    _in_range("typical_p", p.typical_p, 0.0, 1.0, lo_open=True)
    _in_range("repetition_penalty", p.repetition_penalty, 0.0, 100.0, lo_open=True)
    _in_range("frequency_penalty", p.frequency_penalty, -2.0, 2.0)
    _in_range("presence_penalty", p.presence_penalty, -2.0, 2.0)
    if not isinstance(p.stop, tuple | list) or not all(isinstance(s, str) for s in p.stop):
        raise InvalidRequest("stop must be a list of strings", param="stop")
    if len(p.stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(p.stop)}", param="stop")
    for s in p.stop:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise InvalidRequest(
                f"stop sequences must have 1 to {MAX_STOP_LENGTH} characters, got {s!r}", param="stop"
            )
    if p.seed is not None and (
        isinstance(p.seed, bool) or not isinstance(p.seed, int) or not 0 <= p.seed <= MAX_SEED
    ):
        raise InvalidRequest(f"seed must be an integer in [0, 2**63 - 1], got {p.seed!r}", param="seed")
    _positive_int("top_n_tokens", p.top_n_tokens, allow_zero=True)
    if p.top_n_tokens > min(MAX_TOP_N_TOKENS, vocab_size):
        raise InvalidRequest(
            f"top_n_tokens must be at most {min(MAX_TOP_N_TOKENS, vocab_size)}, got {p.top_n_tokens}",
            param="top_n_tokens",
        )
    if p.prompt_logprobs is not None:
        if not p.echo:  # the scores travel with the echoed prompt
            raise InvalidRequest("prompt_logprobs needs echo", param="prompt_logprobs")
        _positive_int("prompt_logprobs", p.prompt_logprobs, allow_zero=True)
        if p.prompt_logprobs > min(MAX_TOP_N_TOKENS, vocab_size):
            raise InvalidRequest(f"prompt_logprobs must be at most {min(MAX_TOP_N_TOKENS, vocab_size)}, "
                                 f"got {p.prompt_logprobs}", param="prompt_logprobs")
    if p.deadline_s is not None:
        _in_range("deadline_s", p.deadline_s, 0.0, 86400.0, lo_open=True)
    _positive_int("truncate", p.truncate)
    _check_logit_bias(p.logit_bias, vocab_size)


def _check_logit_bias(bias: tuple[tuple[int, float], ...], vocab_size: int) -> None:
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}",
                             param="logit_bias")
    for token, value in bias:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequest(f"logit_bias: token id {token!r} is not in this model's vocabulary "
                                 f"[0, {vocab_size})", param="logit_bias")
        _in_range("logit_bias", value, -100.0, 100.0)


def validate_ids(ids: list[int], vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequest(
                f"prompt token {i} is {t!r}, not a token id in [0, {vocab_size})", param="inputs"
            )


def crop_prompt(
    ids: list[int], window: int, truncate: int | None, reject_long: bool
) -> tuple[list[int], int]:
    """Keep the most recent tokens that fit: (kept ids, number dropped from the left).

    `truncate` (the request's own limit) always applies; beyond that, a prompt longer than the
    window is cropped, or rejected when the engine is set to reject.
    """
    limit = window
    if truncate is not None:
        limit = min(limit, truncate)
    elif reject_long and len(ids) > window:
        raise PromptTooLong(len(ids), window)
    if len(ids) <= limit:
        return list(ids), 0
    return list(ids[-limit:]), len(ids) - limit
