"""bench/memory.py's KV cache column: sized by key/value heads, as the engine allocates it."""

from __future__ import annotations

import pytest

from bench.memory import kv_cache_mb
from bench.shapes import SHAPES


def test_grouped_query_attention_holds_a_third_of_full_attentions_cache_at_135m() -> None:
    kv = kv_cache_mb(SHAPES["135M"], conc=8, context=256, dtype="bfloat16")
    # 2 (keys, values) x 30 layers x 3 heads x 64 x 8 x 256 tokens x 2 bytes
    assert kv["kv_mb"] == pytest.approx(2 * 30 * 3 * 64 * 8 * 256 * 2 / 2**20)
    assert kv["kv_mha_mb"] == pytest.approx(3 * kv["kv_mb"])


def test_full_attention_is_its_own_mha_figure_at_124m() -> None:
    kv = kv_cache_mb(SHAPES["124M"], conc=1, context=1024, dtype="float32")
    assert kv["kv_mb"] == kv["kv_mha_mb"] == pytest.approx(2 * 12 * 768 * 1024 * 4 / 2**20)
