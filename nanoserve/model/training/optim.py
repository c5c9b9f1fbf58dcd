"""AdamW with decay / no-decay groups, the learning-rate schedule, and optimizer state on disk.

Optimizer state is stored as safetensors + JSON beside the checkpoint (never pickled); the server
never reads it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_STATE_FILE = "trainer_state.json"


def make_optimizer(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    # Decay matrices (Linear and Embedding weights); never biases or LayerNorm gains, whose
    # decay only pulls them away from their natural scale.
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def lr_at(step: int, *, max_lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup to max_lr, then cosine decay to min_lr at `total` steps."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


def save_optimizer(out_dir: Path, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, pstate in sd["state"].items():
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"state.{idx}.{key}"] = value
    save_file(tensors, str(out_dir / OPTIMIZER_FILE))
    meta = {"param_groups": sd["param_groups"], "scalars": scalars, **state}
    (out_dir / TRAINER_STATE_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def load_optimizer(ckpt_dir: Path, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore optimizer state; returns the trainer state (step, best loss, history...)."""
    meta = json.loads((ckpt_dir / TRAINER_STATE_FILE).read_text(encoding="utf-8"))
    tensors = load_file(str(ckpt_dir / OPTIMIZER_FILE))
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = t
    for name, value in meta.pop("scalars").items():
        _, idx, key = name.split(".", 2)
        state.setdefault(int(idx), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta.pop("param_groups")})
    return meta
