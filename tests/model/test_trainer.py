"""The trainer, run in-process: loss falls for every tokenizer kind, resume, determinism, artefacts."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from nanoserve.model.checkpoint import load_checkpoint
from nanoserve.model.training.trainer import TrainConfig, train

WORDS = {
    "subject": ["the king", "a fool", "my lord", "the queen", "good Romeo", "this knave"],
    "verb": ["loves", "fears", "speaks to", "dreams of", "mocks", "follows"],
    "object": ["the crown", "sweet Juliet", "his horse", "the night", "a rose", "thy honour"],
}


def make_corpus(path: Path, sentences: int = 400, seed: int = 0) -> Path:
    """A small, learnable, seeded text: subject-verb-object lines in a play's layout."""
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        who = rng.choice(["KING", "FOOL", "QUEEN"])
        s, v, o = (rng.choice(WORDS[k]) for k in ("subject", "verb", "object"))
        lines.append(f"{who}:\n{s.capitalize()} {v} {o}.\n")
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "plays.txt")


def tiny_run(corpus: Path, out: Path, **overrides: Any) -> TrainConfig:
    cfg: dict[str, Any] = dict(
        corpus=corpus, out_dir=out, model={"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
        batch_size=16, max_iters=40, lr=3e-3, min_lr=3e-4, warmup_iters=4, eval_interval=10,
        eval_iters=4, sample_tokens=40, progress=False, seed=7,
    )
    cfg.update(overrides)
    return TrainConfig(**cfg)


def _history(out: Path) -> list[dict[str, float]]:
    return list(json.loads((out / "trainer_state.json").read_text())["history"])


@pytest.mark.parametrize("tokenizer", ["char", "word", "bpe:300"])
def test_loss_falls_for_every_tokenizer_kind(corpus: Path, tmp_path: Path, tokenizer: str) -> None:
    block = 16 if tokenizer == "word" else 32  # the word-level corpus is ~5x fewer tokens
    cfg = tiny_run(corpus, tmp_path / "out", tokenizer=tokenizer,
                   model={"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": block})
    prov = train(cfg)
    ckpt = load_checkpoint(tmp_path / "out")
    history = _history(tmp_path / "out")
    chance = math.log(ckpt.config.vocab_size)  # the loss of a model that knows nothing
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert prov["best_val_loss"] < 0.8 * chance, (prov["best_val_loss"], chance, history)
    assert prov["tokenizer"] == tokenizer and ckpt.tokenizer.kind == tokenizer.split(":")[0]


def test_run_writes_checkpoint_card_sample_and_loss_curve(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prov = train(tiny_run(corpus, out, max_iters=20, command="nanoserve train plays.txt"))
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sample = (out / "sample.txt").read_text(encoding="utf-8")
    assert len(sample) >= 40  # 40 sampled characters plus the prompt's newline
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "nanoserve train plays.txt" in card and "plays.txt" in card
    ckpt = load_checkpoint(out)
    assert ckpt.provenance["corpus_sha256"] == prov["corpus_sha256"] and "val_loss_full" in ckpt.provenance
    assert ckpt.provenance["steps"] == ckpt.provenance["best_step"] <= 20


def test_the_same_seed_gives_the_same_run(corpus: Path, tmp_path: Path) -> None:
    train(tiny_run(corpus, tmp_path / "a", max_iters=20))
    train(tiny_run(corpus, tmp_path / "b", max_iters=20))
    train(tiny_run(corpus, tmp_path / "c", max_iters=20, seed=8))
    assert _history(tmp_path / "a") == _history(tmp_path / "b")
    assert _history(tmp_path / "a") != _history(tmp_path / "c")
    a, b = (load_file(str(tmp_path / x / "model.safetensors")) for x in "ab")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_continues_from_the_saved_step_with_optimizer_state(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    train(tiny_run(corpus, out, max_iters=20))
    before = json.loads((out / "trainer_state.json").read_text())
    adam_before = load_file(str(out / "optimizer.safetensors"))
    assert float(adam_before["state.0.step"]) == before["step"]
    train(tiny_run(corpus, out, max_iters=40, resume=True))
    after = json.loads((out / "trainer_state.json").read_text())
    # History continues where it stopped: no step is evaluated twice, none restarts from zero.
    steps = [h["step"] for h in after["history"]]
    assert after["history"][: len(before["history"])] == before["history"]
    assert steps == sorted(set(steps)) and steps[-1] == 40
    # Adam's step counter went on from the saved one rather than restarting at zero.
    assert after["step"] > before["step"]
    assert float(load_file(str(out / "optimizer.safetensors"))["state.0.step"]) == after["step"]
    assert load_checkpoint(out).provenance["steps"] == after["step"]
