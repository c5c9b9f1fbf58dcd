"""Shared test fixtures and the rule for system tools: skip locally, fail in CI."""

from __future__ import annotations

import os
import shutil

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

# One torch thread for the test process and every server it starts (subprocesses inherit this):
# the tests' models are tiny, and a test process plus a server process each spinning two threads on
# a 2-core machine made single forwards tens of times slower. Set before torch is first imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


def require_tool(name: str, why: str = "") -> str:
    """Path of a system tool; skips the test when it is missing (fails instead under CI=true)."""
    path = shutil.which(name)
    if path is None:
        message = f"system tool {name!r} not found{': ' + why if why else ''}"
        if IN_CI:
            pytest.fail(message + " (CI installs it via .ci/apt-packages.txt)")
        pytest.skip(message)
    return path


def require_module(name: str) -> None:
    """Skip (fail in CI) when an optional Python module is missing."""
    try:
        __import__(name)
    except ImportError:
        if IN_CI:
            pytest.fail(f"Python module {name!r} is missing in CI")
        pytest.skip(f"Python module {name!r} not installed")


# Printable ASCII plus newline: the vocabulary of the tiny random checkpoint tests serve.
TINY_VOCAB_TEXT = "".join(chr(c) for c in range(32, 127)) + "\n"


def make_tiny_checkpoint(  # type: ignore[no-untyped-def]
    path, *, block_size: int = 64, seed: int = 0, n_layer: int = 2, n_embd: int = 32
):
    """A random-weight char-level checkpoint: fast to build, fixed by its seed."""
    import torch

    from nanoserve.model.checkpoint import save_checkpoint
    from nanoserve.model.config import GPTConfig
    from nanoserve.model.gpt import GPT
    from nanoserve.model.tokenizer import CharTokenizer

    tok = CharTokenizer.train(TINY_VOCAB_TEXT)
    torch.manual_seed(seed)
    config = GPTConfig(
        vocab_size=tok.vocab_size, block_size=block_size, n_layer=n_layer, n_head=2, n_embd=n_embd
    )
    model = GPT(config)
    return save_checkpoint(
        path, model, tok, name="tiny-test", provenance={"note": "random weights for tests"}
    )


def make_tiny_bpe_checkpoint(  # type: ignore[no-untyped-def]
    path, corpus: str, *, vocab_size: int, block_size: int, name: str
):
    """A random-weight checkpoint with a byte-level BPE vocabulary trained on `corpus`."""
    import torch

    from nanoserve.model.checkpoint import save_checkpoint
    from nanoserve.model.config import GPTConfig
    from nanoserve.model.gpt import GPT
    from nanoserve.model.tokenizer import BPETokenizer

    tok = BPETokenizer.train(corpus, vocab_size=vocab_size)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tok.vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=32)
    return save_checkpoint(path, GPT(config), tok, name=name, provenance={"note": "random weights"})


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):  # type: ignore[no-untyped-def]
    """Path of a tiny random char-level checkpoint (block_size 64), shared by every test."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")
