"""Model hyperparameters: the one dataclass every other model file reads."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

# Upper bounds on the sizes: far above any model this GPT can serve (GPT-3 175B has 96 layers and a
# width of 12,288), low enough that a typo such as `"n_embd": 2**40` is refused by name instead of
# becoming an overflow or an attempt to allocate terabytes.
SIZE_LIMITS = {
    "vocab_size": 2**22,
    "block_size": 2**20,
    "n_layer": 1024,
    "n_head": 1024,
    "n_embd": 2**16,
}


def _is_finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


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
        # Strict types: a config.json value like `"bias": "yes"` or `"n_layer": 2.5` is refused
        # here rather than coerced or left to fail later (a bool is not an int, nor a number).
        for name, limit in SIZE_LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
            if value > limit:
                raise ValueError(f"GPTConfig.{name} is {value}, more than the limit of {limit}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not isinstance(self.bias, bool):
            raise ValueError(f"GPTConfig.bias must be true or false, got {self.bias!r}")
        if not _is_finite_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be a number in [0, 1), got {self.dropout!r}")
        # LayerNorm divides by sqrt(var + eps): eps <= 0 or NaN gives NaN activations at the
        # first forward, long after loading succeeded.
        if not _is_finite_number(self.layer_norm_epsilon) or self.layer_norm_epsilon <= 0:
            raise ValueError(
                "GPTConfig.layer_norm_epsilon must be a finite number above 0, "
                f"got {self.layer_norm_epsilon!r}"
            )

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
        if "vocab_size" not in data:
            raise ValueError("missing GPTConfig field: vocab_size")
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
