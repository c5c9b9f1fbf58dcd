"""What a load run asks for and what each of its requests got.

`LoadConfig` is one run of bench/load.py (the server, the route, how many clients and requests,
the sampling settings, the fault knobs); `build_request` turns it into request i's path and JSON
body, with its own token budget (`new_tokens`) and seed; `RequestResult` is how that request ended,
as the client saw its stream. The HTTP client (load_http.py) fills the results and the report
(load_report.py) sums them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ROUTES = {"generate_stream": "/generate_stream", "chat": "/v1/chat/completions",
          "completions": "/v1/completions"}
OPENAI_ROUTES = ("chat", "completions")  # streams that end with `data: [DONE]`
# Every way a request can end, in the order the text report lists them.
KINDS = ("ok", "http_429", "http_503", "http_4xx", "http_5xx", "cut", "error_event", "transport",
         "disconnected")


@dataclass
class LoadConfig:
    url: str
    concurrency: int = 8
    requests: int | None = 64  # total requests; None: run until `duration_s`
    duration_s: float | None = None  # stop starting new requests after this long
    route: str = "generate_stream"  # or "chat" / "completions" (OpenAI /v1/..., stream=true)
    model: str | None = None  # chat route: the `model` field (None: the server's only model)
    prompt: str = "ROMEO:"
    # completions route: request i sends prompt_ids[i % len] (token ids) instead of `prompt`, so
    # servers with different tokenizers see the same tokens (bench/server_vs_llama.py)
    prompt_ids: list[list[int]] | None = field(default=None, repr=False)
    top_k: int | None = None  # completions route: sent when set (an extension both servers take)
    extra: dict[str, Any] = field(default_factory=dict)  # completions route: more body fields
    max_new_tokens: int = 32
    # Request i asks for max_new_tokens + an offset cycling through -spread..spread (the same
    # mean): streams of different lengths end in different steps, as real traffic's do, instead
    # of all together in waves.
    spread: int = 0
    temperature: float = 1.0
    seed: int | None = None  # request i uses seed + i when set
    api_key: str | None = None
    timeout_s: float = 120.0  # per request, connect to last byte
    disconnect_after: int | None = None  # close the stream after this many tokens (fault tests)
    read_delay_s: float = 0.0  # sleep after each event: a slow reader
    # Each client sends its requests over one kept-alive connection, as an HTTP client's pool (the
    # openai SDK's, httpx's, vLLM's benchmark) does; False: a new connection for every request.
    keep_alive: bool = True
    # Called with the request's result after each token arrives (tests use it to act mid-stream).
    on_token: Callable[[RequestResult], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.route not in ROUTES:
            raise ValueError(f"route must be one of {sorted(ROUTES)}, got {self.route!r}")
        if self.requests is None and self.duration_s is None:
            raise ValueError("give a request count, a duration, or both")
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")


@dataclass
class RequestResult:
    index: int
    kind: str = "transport"
    status: int | None = None
    retry_after: str | None = None
    request_id: str | None = None
    tokens: int = 0  # token events received
    details_tokens: int | None = None  # generated token count the final event reported
    finish_reason: str | None = None
    text: str = ""  # concatenated token text deltas
    final_text: str | None = None  # generated_text of the final event (TGI route)
    ttft_s: float | None = None  # request sent -> first token event
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive token events
    duration_s: float = 0.0
    error: str | None = None  # server error message / exception text
    malformed: list[str] = field(default_factory=list)  # protocol violations seen in the stream


def new_tokens(mean: int, spread: int, index: int) -> int:
    """Request `index`'s token budget: `mean` plus an offset stepping through -spread..spread by a
    stride coprime with their number, so each comes once a cycle and neighbouring requests differ."""
    width = 2 * spread + 1
    stride = 7 if width % 7 else 1
    return max(1, mean - spread + (index * stride) % width)


def build_request(config: LoadConfig, index: int) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of request `index`."""
    seed = None if config.seed is None else config.seed + index
    if config.route == "chat":
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": config.prompt}],
            "max_tokens": new_tokens(config.max_new_tokens, config.spread, index),
            "temperature": config.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if seed is not None:
            body["seed"] = seed
        if config.model is not None:
            body["model"] = config.model
        return ROUTES["chat"], body
    if config.route == "completions":
        return ROUTES["completions"], _completions_body(config, index, seed)
    params: dict[str, Any] = {"max_new_tokens": new_tokens(config.max_new_tokens, config.spread, index),
                              "details": True}
    if config.temperature > 0:
        params.update(do_sample=True, temperature=config.temperature)
    if seed is not None:
        params["seed"] = seed
    return ROUTES["generate_stream"], {"inputs": config.prompt, "parameters": params}


def _completions_body(config: LoadConfig, index: int, seed: int | None) -> dict[str, Any]:
    ids = config.prompt_ids
    body: dict[str, Any] = {
        "prompt": ids[index % len(ids)] if ids else config.prompt,
        "max_tokens": new_tokens(config.max_new_tokens, config.spread, index),
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.top_k is not None:
        body["top_k"] = config.top_k
    body.update(config.extra)
    if seed is not None:
        body["seed"] = seed
    if config.model is not None:
        body["model"] = config.model
    return body
