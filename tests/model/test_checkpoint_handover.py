"""What a training run hands a watching server: whole saves swapped in at once, and a loss plot
that shows the training curve even for a run too short for more than one evaluation."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from nanoserve.model.checkpoint import CheckpointError, load_checkpoint
from nanoserve.model.training.atomic_dir import staged_directory
from nanoserve.model.training.report import plot_loss_curve
from nanoserve.model.training.trainer import train
from tests.model.test_trainer import make_corpus, tiny_run


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "plays.txt")


def test_a_staged_directory_replaces_the_old_one_whole_and_keeps_other_files(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "a.txt").write_text("old a")
    (target / "notes.txt").write_text("the user's")
    (target / "plots").mkdir()
    (target / "plots" / "old.png").write_bytes(b"png")
    inode = (target / "notes.txt").stat().st_ino
    with staged_directory(target) as stage:
        (stage / "a.txt").write_text("new a")
        assert (target / "a.txt").read_text() == "old a"  # nothing visible before the swap
    assert (target / "a.txt").read_text() == "new a"
    assert (target / "notes.txt").read_text() == "the user's"
    assert (target / "notes.txt").stat().st_ino == inode  # linked, not copied
    assert (target / "plots" / "old.png").read_bytes() == b"png"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging directory left behind


def test_a_failed_save_leaves_the_old_directory_untouched(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "a.txt").write_text("old a")
    with pytest.raises(RuntimeError), staged_directory(target) as stage:
        (stage / "a.txt").write_text("half")
        raise RuntimeError("disk full")
    assert (target / "a.txt").read_text() == "old a"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_a_reader_never_sees_a_partial_save_while_training_saves(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    train(tiny_run(corpus, out, max_iters=2, eval_interval=1))  # a checkpoint to start from
    failures: list[str] = []
    loads = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal loads
        while not done.is_set():
            try:
                load_checkpoint(out)
                loads += 1
            except CheckpointError as e:
                failures.append(str(e))

    reader = threading.Thread(target=watch)
    reader.start()
    try:  # a save at every step: the reader races dozens of swaps
        train(tiny_run(corpus, out, max_iters=40, eval_interval=1, resume=True))
    finally:
        done.set()
        reader.join(30)
    assert loads > 0 and failures == []


def test_the_training_curve_is_recorded_at_every_step_and_plotted(corpus: Path, tmp_path: Path) -> None:
    import matplotlib.image

    out = tmp_path / "out"
    train(tiny_run(corpus, out, max_iters=6, eval_interval=250))  # one evaluation, at the end
    state = json.loads((out / "trainer_state.json").read_text())
    assert [p[0] for p in state["train_curve"]] == [1, 2, 3, 4, 5, 6]
    assert len(state["history"]) == 1
    only_evals, with_curve = tmp_path / "evals.png", tmp_path / "curve.png"
    plot_loss_curve(state["history"], [], only_evals)
    plot_loss_curve(state["history"], state["train_curve"], with_curve)

    def inked(path: Path) -> int:
        return int((matplotlib.image.imread(str(path))[..., :3] < 0.9).any(axis=-1).sum())

    # The single evaluation is drawn (markers), and the per-step curve adds a line to it.
    assert inked(with_curve) > inked(only_evals)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
