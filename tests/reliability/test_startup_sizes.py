"""Sizes a checkpoint's config or the settings make too big for this host, and vocabulary text that
cannot be sent, stop `nanoserve serve` before anything is allocated: exit 2, one line naming the
field (not a traceback and exit 3 from the lifespan, nor a host out of memory).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from nanoserve.model.checkpoint import save_checkpoint
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from nanoserve.model.tokenizer import CharTokenizer
from tests.conftest import TINY_VOCAB_TEXT, make_tiny_checkpoint
from tests.server.server import free_port, serve_command

LONG_WINDOW = 2**20  # the largest block_size a config may name (SIZE_LIMITS)


def _serve_once(checkpoint: Path, *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NANOSERVE_")}
    return subprocess.run(serve_command(checkpoint, free_port(), args), env=clean, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and lines[0].startswith("nanoserve serve: error: "), done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def rotary_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny rotary model whose config names a window of 2^20 positions (no position table:
    nothing in its weights grows with it)."""
    tok = CharTokenizer.train(TINY_VOCAB_TEXT)
    config = GPTConfig(vocab_size=tok.vocab_size, block_size=LONG_WINDOW, n_layer=2, n_head=2, n_embd=32,
                       positions="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    torch.manual_seed(0)
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "rope-long", GPT(config), tok, name="rope-long")


def _slots_beyond_this_host() -> int:
    """KV slots whose cache at 2^20 positions (0.5 GiB a slot for the tiny model) is 4x this host's RAM."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(4096, math.ceil(4 * total / (2 * 2 * 2 * LONG_WINDOW * 16 * 4)))


def test_a_kv_cache_larger_than_memory_is_one_line_naming_block_size(rotary_long: Path) -> None:
    line = _one_line(_serve_once(rotary_long, "--max-seqs", str(_slots_beyond_this_host())))
    assert "the KV cache would take" in line and "block_size 1048576" in line, line
    assert "--max-context" in line


def test_max_context_bounds_the_cache_and_the_same_checkpoint_starts(
    rotary_long: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --max-context the same config passes the check and reaches the port (in-process)."""
    from nanoserve.cli import main
    from nanoserve.server import serve_cli

    class Reached(Exception):
        pass

    def would_serve(self: object) -> None:
        raise Reached

    monkeypatch.setattr(serve_cli.DrainingServer, "run", would_serve)
    for key in [k for k in os.environ if k.startswith("NANOSERVE_")]:
        monkeypatch.delenv(key)
    with pytest.raises(Reached):
        main(["serve", "--checkpoint", str(rotary_long), "--port", "0", "--device", "cpu",
              "--max-seqs", str(_slots_beyond_this_host()), "--max-context", "256"])


def test_a_vocabulary_entry_that_is_not_text_is_refused_at_load(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "surrogate")
    tokenizer = json.loads((ckpt / "tokenizer.json").read_text())
    tokenizer["vocab"][40] = "\ud800"  # JSON admits a lone surrogate ("\ud800"); UTF-8 does not
    (ckpt / "tokenizer.json").write_text(json.dumps(tokenizer))
    line = _one_line(_serve_once(ckpt))
    assert "tokenizer.json" in line and "vocabulary entry 40" in line and "'\\ud800'" in line, line
