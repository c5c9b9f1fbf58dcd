"""bench/engine_ab.py: how rounds become one line per batch size."""

from __future__ import annotations

from bench.engine_ab import summary


def run(tps: float, tokens: list[list[int]]) -> dict[str, dict[str, object]]:
    return {"1": {"tokens_per_s": tps, "tokens": tokens}}


def test_medians_ratio_and_token_check() -> None:
    rounds = [{"base": run(100.0, [[1, 2]]), "head": run(110.0, [[1, 2]])},
              {"base": run(200.0, [[1, 2]]), "head": run(180.0, [[1, 2]])},
              {"base": run(150.0, [[1, 2]]), "head": run(150.0, [[1, 2]])}]
    (line,) = summary(rounds, [1])  # type: ignore[arg-type]
    assert line.startswith("batch 1: base 150 tok/s, head 150 tok/s, head / base 1.00 "
                           "(rounds: 1.10, 0.90, 1.00)")
    assert line.endswith("the same tokens")
    rounds[1]["head"] = run(180.0, [[1, 3]])
    assert summary(rounds, [1])[0].endswith("DIFFERENT TOKENS")  # type: ignore[arg-type]
