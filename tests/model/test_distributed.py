"""Data-parallel training with `torchrun --nproc_per_node 2` on CPU (gloo)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.model.checkpoint import load_checkpoint
from tests.model.test_trainer import make_corpus

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_process_torchrun_run_finishes_with_identical_replicas(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    assert torchrun.is_file(), f"{torchrun} missing: torch's launcher ships with torch"
    corpus = make_corpus(tmp_path / "plays.txt")
    out = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [
        str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "nanoserve.cli", "train",
        str(corpus), "--out", str(out), "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
        "--block-size", "32", "--batch-size", "8", "--max-iters", "30", "--warmup-iters", "3",
        "--lr", "3e-3", "--eval-interval", "10", "--eval-iters", "3", "--no-progress",
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = load_checkpoint(out)
    prov = ckpt.provenance
    assert prov["world_size"] == 2
    assert prov["tokens_seen"] == prov["steps"] * 8 * 32 * 2  # both ranks' batches count
    # Every rank ended with exactly the same weights (the trainer all-reduces max and min).
    assert prov["replica_max_abs_diff"] == 0.0
    history = json.loads((out / "trainer_state.json").read_text())["history"]
    assert [h["step"] for h in history] == [10, 20, 30]
    assert history[-1]["val_loss"] < history[0]["val_loss"]
    assert prov["best_val_loss"] < 0.8 * math.log(ckpt.config.vocab_size)  # learned something
    assert (out / "sample.txt").is_file() and (out / "loss.png").is_file()


def test_each_torchrun_process_takes_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: the rule alone. Under torchrun (TORCHELASTIC_RUN_ID set) plain `cuda` is the
    # process's LOCAL_RANK, not cuda:0 for all; an explicit index and cpu are left alone.
    from nanoserve.model.training.trainer import rank_device

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert rank_device("cuda") == "cuda"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device("cuda") == "cuda:3"
    assert rank_device("cuda:1") == "cuda:1" and rank_device("cpu") == "cpu"
