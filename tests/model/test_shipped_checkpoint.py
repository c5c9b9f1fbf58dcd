"""The shipped default checkpoint: loads, is small, and meets its validation-loss bar."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nanoserve.model.checkpoint import load_checkpoint
from nanoserve.model.training.data import encode_and_split, read_corpus
from nanoserve.model.training.trainer import full_split_loss

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "checkpoints" / "shakespeare-char"
CORPUS = ROOT / "data" / "tinyshakespeare.txt"


def test_shipped_checkpoint_is_small_and_self_describing() -> None:
    size = sum(p.stat().st_size for p in CKPT.iterdir() if p.name != "optimizer.safetensors")
    assert size < 50 * 2**20
    ckpt = load_checkpoint(CKPT)
    prov = ckpt.provenance
    assert prov["corpus"] == CORPUS.name
    assert prov["corpus_sha256"] == read_corpus(CORPUS).sha256  # trained on the vendored bytes
    assert ckpt.tokenizer.kind == "char"
    assert ckpt.chat_template["roles"]["assistant"] == "JULIET"


@pytest.mark.slow
def test_shipped_checkpoint_val_loss_on_last_tenth() -> None:
    """Recompute the loss over the whole held-out last 10% of tiny shakespeare: <= 1.60 nats/char."""
    ckpt = load_checkpoint(CKPT)
    model = ckpt.build_model("cpu", torch.float32)
    splits = encode_and_split(read_corpus(CORPUS), ckpt.tokenizer, ckpt.config.block_size)
    loss = full_split_loss(model, splits.val, ckpt.config.block_size, "cpu")
    assert loss <= 1.60
    assert loss == pytest.approx(ckpt.provenance["val_loss_full"], abs=2e-3)
