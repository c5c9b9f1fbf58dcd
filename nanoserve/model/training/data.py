"""The training corpus: read and check the text, encode it, split it, draw batches."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve.model.tokenizer import Tokenizer, TokenizerError


class TrainInputError(ValueError):
    """Bad trainer input (corpus, flags, output dir); the CLI prints it as one line."""


@dataclass
class Corpus:
    name: str
    sha256: str
    text: str


def read_corpus(path: str | Path) -> Corpus:
    p = Path(path)
    if not p.is_file():
        raise TrainInputError(f"corpus {p} does not exist or is not a file")
    raw = p.read_bytes()
    if not raw.strip():
        raise TrainInputError(f"corpus {p} is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TrainInputError(f"corpus {p} is not valid UTF-8 (byte offset {e.start})") from None
    return Corpus(name=p.name, sha256=hashlib.sha256(raw).hexdigest(), text=text)


@dataclass
class TokenSplits:
    train: torch.Tensor  # (N_train,) int64 token ids
    val: torch.Tensor  # (N_val,)


def encode_and_split(
    corpus: Corpus, tokenizer: Tokenizer, block_size: int, val_fraction: float = 0.1
) -> TokenSplits:
    """Encode, then split by position: the first 90% trains, the last 10% validates."""
    try:
        ids = torch.tensor(tokenizer.encode(corpus.text), dtype=torch.long)
    except TokenizerError as e:  # a resumed run's vocabulary meeting a different corpus
        raise TrainInputError(f"corpus {corpus.name}: {e}") from None
    n_val = int(len(ids) * val_fraction)
    train, val = ids[: len(ids) - n_val], ids[len(ids) - n_val :]
    # A batch row needs block_size + 1 tokens (inputs plus the shifted targets).
    for split, t in (("training", train), ("validation", val)):
        if len(t) < block_size + 1:
            raise TrainInputError(
                f"corpus {corpus.name} is too short: its {split} split has {len(t)} tokens, "
                f"fewer than one block of {block_size} + 1 (use a longer text or a smaller "
                f"--block-size)"
            )
    return TokenSplits(train=train, val=val)


def get_batch(
    data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: x is (B, T) inputs, y is (B, T) the same shifted by one token."""
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    offsets = torch.arange(block_size)
    x = data[starts.unsqueeze(1) + offsets]  # (B, T)
    y = data[starts.unsqueeze(1) + offsets + 1]  # (B, T)
    return x, y


def sequential_batches(
    data: torch.Tensor, batch_size: int, block_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every non-overlapping window of the split once, for an exact full-split loss."""
    n = (len(data) - 1) // block_size
    x = data[: n * block_size].view(n, block_size)
    y = data[1 : n * block_size + 1].view(n, block_size)
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, n, batch_size)]
