"""A load run's report: `LoadReport` (every request's result and the run's wall time), its
summary (throughput, nearest-rank TTFT / inter-token / end-to-end percentiles, how requests ended,
malformed streams) and `format_report`, the summary as the text bench/load.py prints.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from bench.load_config import KINDS, LoadConfig, RequestResult


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
