"""Load generator for a running nanoserve (or any TGI / OpenAI-compatible) server.

N concurrent clients stream over SSE, for a bounded number of requests or a bounded duration, and
every request is classified: completed, rejected (429 / 503 / other status), cut short (the stream
ended without its final event), ended by a server `event: error`, a transport failure, or
disconnected on purpose (`disconnect_after`). Latencies are measured from the moment the request is
sent, so time spent queued in the server counts towards time to first token.

    .venv/bin/python -m bench.load --url http://127.0.0.1:8000 -c 16 -n 200 --max-new-tokens 64
    .venv/bin/python -m bench.load --url http://127.0.0.1:8000 -c 8 --duration 30 --route chat --json

Importable: `run_load(LoadConfig(...))` returns a `LoadReport` whose `results` keep every request's
stream as the client saw it, so tests can compare them with the server's own counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

T = TypeVar("T")

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


@dataclass
class LoadReport:
    config: LoadConfig
    results: list[RequestResult]
    wall_s: float

    def by_kind(self) -> dict[str, int]:
        counts = Counter(r.kind for r in self.results)
        return {k: counts[k] for k in KINDS if counts[k]}

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.kind == "ok"]
        # Generated tokens as the server counted them where it said (a chat delta may hold more
        # than one token, e.g. text held back while it could still become a stop string).
        tokens = sum(r.details_tokens if r.details_tokens is not None else r.tokens for r in self.results)
        itls = [gap for r in self.results for gap in r.itl_s]
        return {
            "url": self.config.url,
            "route": self.config.route,
            "concurrency": self.config.concurrency,
            "requests": len(self.results),
            "wall_s": round(self.wall_s, 3),
            "completed_per_s": round(len(ok) / self.wall_s, 3) if self.wall_s else 0.0,
            "tokens_generated": tokens,
            "tokens_per_s": round(tokens / self.wall_s, 2) if self.wall_s else 0.0,
            "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
            "itl_s": percentiles(itls),
            "e2e_s": percentiles([r.duration_s for r in ok]),
            "outcomes": self.by_kind(),
            "malformed_streams": sum(1 for r in self.results if r.malformed),
        }


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles (no interpolation: every figure is a latency that happened)."""
    if not values:
        return {f"p{q}": None for q in qs}
    ordered = sorted(values)
    return {f"p{q}": round(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)], 6) for q in qs}


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


class SSEParser:
    """Incremental `text/event-stream` parser: feed lines, get (event, data) pairs."""

    def __init__(self) -> None:
        self.event: str | None = None
        self.data: list[str] = []

    def feed(self, line: str) -> tuple[str, str] | None:
        if line == "":
            if not self.data:
                self.event = None
                return None
            out = (self.event or "message", "\n".join(self.data))
            self.event, self.data = None, []
            return out
        if line.startswith(":"):  # comment, e.g. `: keep-alive`
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self.event = value
        elif name == "data":
            self.data.append(value)
        return None


class _StreamState:
    """What one request's stream has shown so far; `on_event` returns True when it is complete."""

    def __init__(self, result: RequestResult, config: LoadConfig, t0: float) -> None:
        self.result, self.route, self.t0 = result, config.route, t0
        self.on_token = config.on_token
        self.last_token_at: float | None = None
        self.last_index: int | None = None

    def token_arrived(self, text: str) -> None:
        now = time.perf_counter()
        r = self.result
        if self.last_token_at is None:
            r.ttft_s = now - self.t0
        else:
            r.itl_s.append(now - self.last_token_at)
        self.last_token_at = now
        r.tokens += 1
        r.text += text
        if self.on_token is not None:
            self.on_token(r)

    def on_event(self, event: str, data: str) -> bool:
        r = self.result
        if self.route in OPENAI_ROUTES and data == "[DONE]":
            return True
        try:
            payload = json.loads(data)
        except json.JSONDecodeError:
            r.malformed.append(f"data is not JSON: {data[:80]!r}")
            return False
        if not isinstance(payload, dict):
            r.malformed.append(f"data is not a JSON object: {data[:80]!r}")
            payload = {"error": payload} if event == "error" else {}
        if event == "error" or "error" in payload:
            err = payload.get("error")
            r.kind = "error_event"
            r.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return True
        return self._on_openai(payload) if self.route in OPENAI_ROUTES else self._on_tgi(payload)

    def _on_tgi(self, payload: dict[str, Any]) -> bool:
        r = self.result
        token = payload.get("token")
        if isinstance(token, dict):
            index = payload.get("index")
            if self.last_index is not None and index != self.last_index + 1:
                r.malformed.append(f"token index {index} after {self.last_index}")
            self.last_index = index
            self.token_arrived(token.get("text") or "")
        details = payload.get("details")
        if payload.get("generated_text") is None and details is None:
            return False
        r.final_text = payload.get("generated_text")
        if details is None:
            r.malformed.append("final event without details")
        else:
            r.details_tokens = details.get("generated_tokens")
            r.finish_reason = details.get("finish_reason")
        r.kind = "ok"
        return True

    def _on_openai(self, payload: dict[str, Any]) -> bool:
        r = self.result
        for choice in payload.get("choices") or []:
            # chat: the text in a delta; completions: in the choice itself
            delta = choice.get("delta") or {}
            content = delta.get("content") if self.route == "chat" else choice.get("text")
            if content:
                self.token_arrived(content)
            if choice.get("finish_reason"):
                r.finish_reason = choice["finish_reason"]
        usage = payload.get("usage")
        if usage:
            r.details_tokens = usage.get("completion_tokens")
        if r.finish_reason is not None:
            r.kind = "ok"  # provisional: [DONE] must still follow, else the stream was cut
        return False


async def one_request(client: httpx.AsyncClient, config: LoadConfig, index: int) -> RequestResult:
    """Send request `index` through an httpx client, read its stream, classify how it ended."""
    path, body = build_request(config, index)
    result = RequestResult(index=index)
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body, headers=_headers(config),
                                 timeout=config.timeout_s) as resp:
            result.status = resp.status_code
            result.request_id = resp.headers.get("x-request-id")
            if resp.status_code != 200:
                result.retry_after = resp.headers.get("retry-after")
                result.kind = _status_kind(resp.status_code)
                result.error = (await resp.aread()).decode("utf-8", "replace")[:500]
                return result
            await _read_stream(resp.aiter_lines(), result, config, t0)
    except (httpx.TransportError, httpx.StreamError) as e:
        # A stream that broke after it started was cut; one that never answered is transport.
        result.kind = "cut" if result.status == 200 else "transport"
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.duration_s = time.perf_counter() - t0
    return result


class Connection:
    """One client's HTTP/1.1 connection to the server, reused for its next request while the
    server keeps it open (`LoadConfig.keep_alive`)."""

    def __init__(self) -> None:
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self.close()
        self.reader, self.writer = await asyncio.open_connection(host, port)
        return self.reader, self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def one_raw_request(config: LoadConfig, index: int, conn: Connection | None = None) -> RequestResult:
    """The same request over a plain asyncio connection (HTTP/1.1): `conn`'s, kept open for the
    client's next request when the response ended cleanly, or a new one closed afterwards.

    The load generator shares the machine's cores with the server it measures, so its own cost
    per streamed token is part of what a same-machine benchmark sees: through httpx (httpcore,
    h11, anyio) it was ~300 us per token, a third of a core at 32 streams.
    """
    path, body = build_request(config, index)
    result = RequestResult(index=index)
    url = urlsplit(config.url)
    payload = json.dumps(body).encode()
    keep = config.keep_alive and conn is not None
    conn = conn or Connection()
    head = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}"] + ([] if keep else ["Connection: close"])
    head += [f"{k}: {v}" for k, v in _headers(config).items()]
    message = "\r\n".join(head).encode() + b"\r\n\r\n" + payload
    t0 = time.perf_counter()
    reusable = False
    try:
        async with asyncio.timeout(config.timeout_s):
            reader, raw = await _send(conn, url.hostname or "127.0.0.1", url.port or 80, message)
            status, headers = _parse_head(raw)
            result.status = status
            result.request_id = headers.get("x-request-id")
            framed = "chunked" in headers.get("transfer-encoding", "").lower() or "content-length" in headers
            if status != 200:
                result.retry_after = headers.get("retry-after")
                result.kind = _status_kind(status)
                data = b"".join([chunk async for chunk in _body(reader, headers)])
                result.error = data.decode("utf-8", "replace")[:500]
            else:
                await _read_stream(_lines(_body(reader, headers)), result, config, t0)
            # Read to its end (not left mid-stream on purpose), and the server did not say close.
            reusable = framed and result.kind != "disconnected" and headers.get("connection") != "close"
    except (OSError, EOFError, ValueError, TimeoutError, asyncio.LimitOverrunError) as e:
        # EOFError covers asyncio.IncompleteReadError: the peer closed mid-message.
        result.kind = "cut" if result.status == 200 else "transport"
        result.error = f"{type(e).__name__}: {e}"
    finally:
        if not (keep and reusable):
            conn.close()
        result.duration_s = time.perf_counter() - t0
    return result


async def _send(conn: Connection, host: str, port: int,
                message: bytes) -> tuple[asyncio.StreamReader, bytes]:
    """Send `message` and read the response head, on `conn`'s open connection if it has one. A
    kept connection the server has closed meanwhile (its idle timeout) fails before any byte of
    a response: then once more on a new connection, as HTTP clients' pools do."""
    if conn.reader is not None and conn.writer is not None:
        try:
            conn.writer.write(message)
            return conn.reader, await conn.reader.readuntil(b"\r\n\r\n")
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            if isinstance(e, asyncio.IncompleteReadError) and e.partial:
                raise
    reader, writer = await conn.open(host, port)
    writer.write(message)
    return reader, await reader.readuntil(b"\r\n\r\n")


def _headers(config: LoadConfig) -> dict[str, str]:
    headers = {"Accept": "text/event-stream"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    return headers


def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(rest.split(" ", 1)[0]), headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives: chunked, by Content-Length, or up to the close."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields
                    pass
                return
            chunk = await reader.readexactly(size + 2)
            yield chunk[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while chunk := await reader.read(65536):
            yield chunk


async def _lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Lines of a byte stream (split before decoding, so a character split across chunks is whole)."""
    pending = b""
    async for chunk in chunks:
        *complete, pending = (pending + chunk).split(b"\n")
        for line in complete:
            yield line.removesuffix(b"\r").decode("utf-8", "replace")
    if pending:
        yield pending.decode("utf-8", "replace")


async def _read_stream(lines: AsyncIterator[str], result: RequestResult, config: LoadConfig,
                       t0: float) -> None:
    state, parser, complete = _StreamState(result, config, t0), SSEParser(), False
    result.kind = "cut"  # until the final event arrives
    async for line in lines:
        parsed = parser.feed(line)
        if parsed is None:
            continue
        if config.read_delay_s:
            await asyncio.sleep(config.read_delay_s)
        if complete:
            result.malformed.append(f"event after the final one: {parsed[1][:80]!r}")
            continue
        complete = state.on_event(*parsed)
        if config.disconnect_after is not None and result.tokens >= config.disconnect_after \
                and not complete:
            result.kind = "disconnected"
            return  # the caller closes the connection mid-stream
    if config.route in OPENAI_ROUTES and not complete:
        result.kind = "cut"  # finish_reason seen but no [DONE], or nothing at all


def _status_kind(status: int) -> str:
    if status in (429, 503):
        return f"http_{status}"
    return "http_5xx" if status >= 500 else "http_4xx"


async def run_load(config: LoadConfig, client: httpx.AsyncClient | None = None) -> LoadReport:
    """Run the load; `client` lets tests pass their own (its base_url must be the server).

    Without one, plain http:// URLs are driven over raw asyncio connections (cheaper per token,
    see `one_raw_request`) and https:// through httpx.
    """
    raw = client is None and urlsplit(config.url).scheme == "http"
    own = client is None
    if client is None:
        keepalive = config.concurrency if config.keep_alive else 0
        limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=keepalive)
        client = httpx.AsyncClient(base_url=config.url, limits=limits)
    results: list[RequestResult] = []
    counter = iter(range(config.requests if config.requests is not None else sys.maxsize))
    start = time.perf_counter()
    deadline = None if config.duration_s is None else start + config.duration_s

    async def worker() -> None:
        conn = Connection()
        try:
            for index in counter:  # a shared iterator: each index is taken by exactly one worker
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                results.append(await (one_raw_request(config, index, conn) if raw
                                      else one_request(client, config, index)))
        finally:
            conn.close()

    try:
        await asyncio.gather(*(worker() for _ in range(config.concurrency)))
    finally:
        if own:
            await client.aclose()
    results.sort(key=lambda r: r.index)
    return LoadReport(config=config, results=results, wall_s=time.perf_counter() - start)


def format_report(summary: dict[str, Any]) -> str:
    def ms(p: dict[str, float | None]) -> str:
        return " ".join(f"{k}={v * 1000:.1f}ms" if v is not None else f"{k}=-" for k, v in p.items())

    lines = [
        f"{summary['requests']} requests to {summary['url']} ({summary['route']}, "
        f"concurrency {summary['concurrency']}) in {summary['wall_s']:.2f}s",
        f"  completed/s   {summary['completed_per_s']:.2f}",
        f"  tokens/s      {summary['tokens_per_s']:.1f} ({summary['tokens_generated']} tokens)",
        f"  TTFT          {ms(summary['ttft_s'])}",
        f"  inter-token   {ms(summary['itl_s'])}",
        f"  end-to-end    {ms(summary['e2e_s'])}",
        "  outcomes      " + ", ".join(f"{k}={v}" for k, v in summary["outcomes"].items()),
    ]
    if summary["malformed_streams"]:
        lines.append(f"  MALFORMED streams: {summary['malformed_streams']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[LoadConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m bench.load",
                                description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("-c", "--concurrency", type=int, default=8)
    p.add_argument("-n", "--requests", type=int, default=None,
                   help="total requests (default 64 without --duration)")
    p.add_argument("--duration", type=float, default=None, help="seconds to keep starting requests")
    p.add_argument("--route", choices=sorted(ROUTES), default="generate_stream")
    p.add_argument("--model", default=None, help="chat route: the model id to send")
    p.add_argument("--prompt", default="ROMEO:")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--spread", type=int, default=0,
                   help="request i asks for max-new-tokens +- up to this many (the same mean)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--new-connections", action="store_true",
                   help="a new connection for every request (default: each client keeps its own open)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--per-request", action="store_true", help="with --json: every request too")
    a = p.parse_args(argv)
    config = LoadConfig(
        url=a.url, concurrency=a.concurrency,
        requests=a.requests if a.requests is not None or a.duration is not None else 64,
        duration_s=a.duration, route=a.route, model=a.model, prompt=a.prompt,
        max_new_tokens=a.max_new_tokens, spread=a.spread,
        temperature=a.temperature, seed=a.seed, api_key=a.api_key, timeout_s=a.timeout,
        keep_alive=not a.new_connections,
    )
    return config, a


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on uvloop where it is installed (uvicorn[standard] brings it on Linux), as the
    server runs. A same-machine load generator takes its CPU from the server it measures: at 32
    streams uvloop's loop cost it ~10.6% of a core against ~11.8%, and HTTP throughput came out
    4-7% higher in each of 3 alternating pairs."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def main(argv: list[str] | None = None) -> int:
    config, args = parse_args(argv)
    report = run_loop(run_load(config))
    summary = report.summary()
    if args.json:
        if args.per_request:
            summary["results"] = [asdict(r) for r in report.results]
        print(json.dumps(summary, indent=2))
    else:
        print(format_report(summary))
    # Non-zero when anything other than completion or an orderly rejection happened.
    bad = {"http_4xx", "http_5xx", "cut", "error_event", "transport"} & set(report.by_kind())
    return 1 if bad or summary["malformed_streams"] else 0


if __name__ == "__main__":
    sys.exit(main())
