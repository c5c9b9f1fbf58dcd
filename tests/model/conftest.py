"""Model tests run single-threaded: tiny models gain nothing from threads, and on a shared 2-core
machine two threads contending with other work made each forward ~50x slower."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
