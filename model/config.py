"""Model hyperparameters: the one dataclass every other model file reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2 architecture hyperparameters.

    They travel inside every checkpoint's ``config.json``, so a checkpoint describes the module
    that can hold its weights without any code-side table of sizes.
    """

    vocab_size: int
    block_size: int = 256  # the context window: positions the learned embedding table covers
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True  # GPT-2 uses biases in Linear and LayerNorm; off is slightly faster
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {', '.join(unknown)}")
        return cls(**data)


# Named sizes for `nanoserve train --preset`. "baby" is nanoGPT's CPU config, "small-char" is
# nanoGPT's shakespeare_char GPU config, "gpt2" is GPT-2 small's shape.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
    "baby": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64},
    "char-medium": {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 128},
    "small-char": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256},
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024},
}
