"""What a training run leaves beside its checkpoint: the loss curve, a sample and the model card."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_loss_curve(history: list[dict[str, float]], curve: list[list[float]], path: Path) -> None:
    """The training loss at every step (a thin line) and each evaluation's train and val estimates
    (markers, so that a run with a single evaluation still shows it)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if curve:
        ax.plot([p[0] for p in curve], [p[1] for p in curve], lw=0.8, alpha=0.5, color="tab:blue",
                label="train (each step's batch)")
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["train_loss"] for h in history], "o-", ms=4, color="tab:blue", label="train (eval)")
    ax.plot(steps, [h["val_loss"] for h in history], "s-", ms=4, color="tab:orange", label="val (eval)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def model_card(name: str, provenance: dict[str, Any], config: dict[str, Any], sample: str) -> str:
    p = provenance
    lines = [
        f"# {name}",
        "",
        f"A GPT-2-architecture model trained by `nanoserve train` on `{p['corpus']}` "
        f"(sha256 `{p['corpus_sha256']}`), with a `{p['tokenizer']}` tokenizer.",
        "",
        "## Result",
        f"- best validation loss (random windows, as nanoGPT reports it): {p['best_val_loss']:.4f} "
        f"nats/token at step {p['best_step']}",
        f"- validation loss over the whole held-out last {p['val_fraction']:.0%} of the corpus "
        f"(non-overlapping windows): {p['val_loss_full']:.4f} nats/token",
        f"- train loss at that step: {p['train_loss']:.4f}",
        f"- parameters: {p['parameters']:,}",
        f"- steps run: {p['steps']}, tokens seen: {p['tokens_seen']:,}, "
        f"wall time: {p['wall_time_s'] / 60:.1f} min on {p['machine']}",
        "",
        "## How it was produced",
        "One command per line; a `--resume` line continued the run saved by the line before it.",
        "```",
        *p.get("commands", [p["command"]]),
        "```",
        "",
        "## Model config",
        "```",
        *(f"{k} = {v}" for k, v in config.items()),
        "```",
        "",
        "## Sample (temperature 0.8, top-k 40, seed 0, from a newline)",
        "```",
        sample,
        "```",
        "",
        "The loss curve is `loss.png`; the full sample is `sample.txt`.",
        "",
    ]
    return "\n".join(lines)
