"""The shipped names checkpoint: its validation loss recomputed, and what it is for."""

from __future__ import annotations

import re
from pathlib import Path

from nanoserve.model.checkpoint import load_checkpoint
from nanoserve.model.training.line_split import line_loss, sample_lines, split_lines

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "checkpoints" / "baby-names"


def test_the_validation_loss_is_the_cards_and_under_two_nats() -> None:
    ckpt = load_checkpoint(CKPT)
    assert ckpt.config.family == "llama" and ckpt.config.kv_heads == 2
    train, held_out = split_lines((ROOT / "data" / "names" / "names.txt").read_text(encoding="utf-8"))
    assert (len(train), len(held_out)) == (28_830, 3_203)
    loss = line_loss(ckpt.build_model(), ckpt.tokenizer, held_out)
    card = (CKPT / "README.md").read_text(encoding="utf-8")
    stated = float(re.search(r"validation loss: \*\*([0-9.]+) nats per character", card).group(1))  # type: ignore[union-attr]
    assert abs(loss - stated) < 1e-3 and loss <= 2.0, (loss, stated)


def test_it_makes_up_names_most_of_them_new() -> None:
    ckpt = load_checkpoint(CKPT)
    train, _ = split_lines((ROOT / "data" / "names" / "names.txt").read_text(encoding="utf-8"))
    names = sample_lines(ckpt.build_model(), ckpt.tokenizer, 1000, seed=0)
    seen = set(train)
    novel = sum(1 for name in names if name and name not in seen)
    card = (CKPT / "README.md").read_text(encoding="utf-8")
    assert f"of 1,000 names sampled at temperature 1 from a fresh line (seed 0), {novel} are not" in card
    assert all(re.fullmatch(r"[a-z]*", name) for name in names)
