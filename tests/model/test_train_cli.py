"""`nanoserve train` bad input: one error line naming the problem, a non-zero exit, no traceback.

The cases from issue 2 run as real subprocesses, concurrently (each spends most of its time
importing torch); the further flag checks run in-process through the same `main()`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.cli import main
from tests.model.test_trainer import make_corpus

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "32", "--max-iters", "4",
        "--warmup-iters", "1", "--eval-interval", "2", "--eval-iters", "1", "--batch-size", "4",
        "--no-progress"]


def _cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (argv after `train`, text the error line must contain)."""
    good = make_corpus(tmp / "good.txt", sentences=60)
    (tmp / "empty.txt").write_text("")
    (tmp / "latin1.txt").write_bytes("Caf\u00e9 au lait, s'il vous pla\u00eet.\n".encode("latin-1") * 50)
    (tmp / "short.txt").write_text("To be or not to be.\n")
    (tmp / "a-file").write_text("not a directory")
    bad_json, no_roles = tmp / "bad.json", tmp / "no-roles.json"
    bad_json.write_text("{roles: 1")
    no_roles.write_text('{"message": "{role}: {content}\\n", "generation_prompt": "{role}:"}')
    out = str(tmp / "out")
    return {
        "empty": ([str(tmp / "empty.txt"), "--out", out, *TINY], "empty.txt is empty"),
        "not-utf8": ([str(tmp / "latin1.txt"), "--out", out, *TINY], "is not valid UTF-8 (byte offset 3)"),
        "too-short": ([str(tmp / "short.txt"), "--out", out, *TINY], "too short"),
        "missing": ([str(tmp / "nope.txt"), "--out", out, *TINY], "does not exist"),
        "unwritable": ([str(good), "--out", str(tmp / "a-file" / "ckpt"), *TINY], "is not writable"),
        "resume-and-size": ([str(good), "--out", out, "--resume", "--preset", "tiny"],
                            "--resume takes the model size from the checkpoint"),
        "resume-nothing": ([str(good), "--out", out, "--resume"], "holds no optimizer state"),
        "heads": ([str(good), "--out", out, *TINY, "--n-embd", "30", "--n-head", "4"],
                  "must be divisible by n_head"),
        "warmup": ([str(good), "--out", out, *TINY, "--warmup-iters", "10"],
                   "--warmup-iters must be at least 0 and less than --max-iters"),
        "tokenizer": ([str(good), "--out", out, *TINY, "--tokenizer", "bpe:10"], "at least 257"),
        "fp16-cpu": ([str(good), "--out", out, *TINY, "--dtype", "float16"], "needs a CUDA device"),
        "template-json": ([str(good), "--out", out, *TINY, "--chat-template", str(bad_json)],
                          "bad.json: Expecting"),
        "template-keys": ([str(good), "--out", out, *TINY, "--chat-template", str(no_roles)],
                          "no-roles.json: no 'roles'"),
    }


# Issue 2's list: empty, non-UTF-8, shorter than a block, unwritable output, conflicting flags.
SUBPROCESS_CASES = ["empty", "not-utf8", "too-short", "unwritable", "resume-and-size"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    tmp = tmp_path_factory.mktemp("train-cli")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "nanoserve.cli", "train", *argv], cwd=ROOT, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        for name, (argv, _) in _cases(tmp).items() if name in SUBPROCESS_CASES
    }
    # The installed console script, as users type it (the module form where it is not installed).
    script = Path(sys.executable).parent / "nanoserve"
    nanoserve = [str(script)] if script.is_file() else [sys.executable, "-m", "nanoserve.cli"]
    procs["help"] = subprocess.Popen([*nanoserve, "train", "--help"], cwd=ROOT, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=240)
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    out["_messages"] = _cases(tmp)  # type: ignore[assignment]
    return out


def _check_one_error_line(returncode: int, stderr: str, message: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode != 0
    assert "Traceback" not in stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("nanoserve train: error: ") and message in lines[0], lines[0]


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_bad_input_in_a_subprocess(results, case: str) -> None:  # type: ignore[no-untyped-def]
    r = results[case]
    _check_one_error_line(r.returncode, r.stderr, results["_messages"][case][1])


IN_PROCESS_CASES = ["missing", "resume-nothing", "heads", "warmup", "tokenizer", "fp16-cpu",
                    "template-json", "template-keys"]


@pytest.mark.parametrize("case", IN_PROCESS_CASES)
def test_bad_flags_in_process(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv, message = _cases(tmp_path)[case]
    code = main(["train", *argv])
    _check_one_error_line(code, capsys.readouterr().err, message)


def test_a_serving_install_without_the_training_extra_is_told_which_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """matplotlib and tqdm are the `train` extra's, not the server's: without them a run stops before
    it starts (the loss plot is drawn last) and names the extra."""
    import importlib.util

    corpus = make_corpus(tmp_path / "c.txt", sentences=60)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("matplotlib", "tqdm") else find_spec(name, *a))
    code = main(["train", str(corpus), "--out", str(tmp_path / "out"), *TINY[:-1]])
    _check_one_error_line(code, capsys.readouterr().err, "needs matplotlib, tqdm; install the training "
                          "extra: pip install 'nanoserve[train]'")
    assert not (tmp_path / "out").exists()


def test_train_help_lists_the_options(results) -> None:  # type: ignore[no-untyped-def]
    r = results["help"]
    assert r.returncode == 0 and r.stderr == ""
    for flag in ("--tokenizer", "--preset", "--resume", "--grad-accum", "--dtype", "--max-minutes"):
        assert flag in r.stdout


def test_resuming_on_a_corpus_the_vocabulary_cannot_encode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = make_corpus(tmp_path / "good.txt", sentences=60)
    out = str(tmp_path / "out")
    assert main(["train", str(good), "--out", out, *TINY]) == 0
    other = tmp_path / "other.txt"
    other.write_text(good.read_text() + "Five \u20ac.\n")
    capsys.readouterr()
    code = main(["train", str(other), "--out", out, "--resume", "--max-iters", "6",
                 "--warmup-iters", "1", "--no-progress"])
    _check_one_error_line(code, capsys.readouterr().err, "other.txt: character '\u20ac' (U+20AC) at position")


def test_training_a_llama_family_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nanoserve.model.checkpoint import load_checkpoint

    corpus = make_corpus(tmp_path / "c.txt", sentences=60)
    out = tmp_path / "llama"
    args = ["train", str(corpus), "--out", str(out), *TINY, "--n-head", "4", "--arch", "llama",
            "--n-kv-head", "2", "--untied", "--rope-theta", "500"]
    assert main(args) == 0, capsys.readouterr().err
    config = load_checkpoint(out).config
    assert (config.norm, config.mlp, config.positions) == ("rmsnorm", "swiglu", "rope")
    assert (config.kv_heads, config.tie_embeddings, config.rope_theta) == (2, False, 500.0)
    assert config.bias is False
    bad = ["train", str(corpus), "--out", str(tmp_path / "bad"), *TINY, "--arch", "llama", "--n-kv-head", "3"]
    assert main(bad) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["nanoserve train: error: GPTConfig.n_head (2) must be a multiple of n_kv_head (3)"]
