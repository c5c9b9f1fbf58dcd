"""bench/timing.py: the helper every same-process comparison of variants goes through."""

from __future__ import annotations

import pytest

from bench import timing
from bench.timing import best_median_s


def test_variants_take_turns_in_alternating_order() -> None:
    # A fixed order favoured whichever variant ran second (~1%), so the order must
    # turn round every other round.
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    best_median_s(fns, steps=2, rounds=3)
    assert calls == list("aabbcc") + list("ccbbaa") + list("aabbcc")


def test_each_variant_keeps_its_best_round_median(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake clock: "slow" costs 3 s a call in the first round and 1 s in the second; "fast"
    # always 0.5 s.
    now = [0.0]
    cost = {"slow": iter([3.0, 3.0, 3.0, 1.0, 1.0, 1.0]), "fast": iter([0.5] * 6)}
    fns = {name: (lambda name=name: now.__setitem__(0, now[0] + next(cost[name]))) for name in cost}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    assert best_median_s(fns, steps=3, rounds=2) == {"slow": 1.0, "fast": 0.5}
