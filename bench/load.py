"""Load generator for a running nanoserve (or any TGI / OpenAI-compatible) server.

N concurrent clients stream over SSE, for a bounded number of requests or a bounded duration, and
every request is classified: completed, rejected (429 / 503 / other status), cut short (the stream
ended without its final event), ended by a server `event: error`, a transport failure, or
disconnected on purpose (`disconnect_after`). Latencies are measured from the moment the request is
sent, so time spent queued in the server counts towards time to first token.

    .venv/bin/python -m bench.load --url http://127.0.0.1:8000 -c 16 -n 200 --max-new-tokens 64
    .venv/bin/python -m bench.load --url http://127.0.0.1:8000 -c 8 --duration 30 --route chat --json

Importable: `run_load(LoadConfig(...))` returns a `LoadReport` whose `results` keep every request's
stream as the client saw it, so tests can compare them with the server's own counters. The parts:
load_config.py (the run's settings, each request's body and result), load_http.py (the client that
sends one request and reads its stream), load_report.py (the summary and its text).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Coroutine
from dataclasses import asdict
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx

from bench.load_config import ROUTES, LoadConfig, RequestResult
from bench.load_http import Connection, one_raw_request, one_request
from bench.load_report import LoadReport, format_report

T = TypeVar("T")


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
