"""bench/native_ab.py: how two builds' instances are paired into one ratio per round."""

from __future__ import annotations

import pytest

from bench.native_ab import MADE, abba_ratios


def test_instances_are_made_base_head_head_base() -> None:
    # With one instance of each build, the one made second ran 1-6% faster on the same code: the
    # making order must give both builds the same average place.
    places = {role: [i for i, r in enumerate(MADE) if r == role] for role in ("base", "head")}
    assert sum(places["base"]) == sum(places["head"]) and len(places["base"]) == len(places["head"])


def test_a_bias_by_making_order_cancels_out() -> None:
    # The same code in all four instances, each made later running 2% faster: every round's ratio
    # comes out 1 (one instance of each, made base then head, would read 1.02).
    t = [1.0, 0.98, 0.96, 0.94]
    medians = [[x, x * 1.5] for x in t]  # two rounds, the second slower throughout
    ratios, base, head = abba_ratios(medians)
    assert ratios == pytest.approx([1.0, 1.0])
    assert base == pytest.approx([0.97, 1.455]) and head == pytest.approx([0.97, 1.455])


def test_a_faster_head_reads_above_one() -> None:
    medians = [[1.0], [0.8], [0.8], [1.0]]
    ratios, _, _ = abba_ratios(medians)
    assert ratios == pytest.approx([1.25])
