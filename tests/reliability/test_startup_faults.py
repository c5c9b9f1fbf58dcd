"""A broken checkpoint stops `nanoserve serve` before the port opens, with one clear message.

Every variant runs `nanoserve serve`'s code in-process with the server's `run` replaced by a
failure, so reaching the point of opening the port fails the test; some variants also run as a real
process, to check its exit status, its output and that the port never accepted a connection.
Checkpoints that would load and then fail (a chat template that cannot render, sizes that would
allocate for minutes, values that break the first forward) are refused the same way, before
anything is allocated.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.server.server import free_port, serve_command, start_server

WEIGHTS = "model.safetensors"


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    # Clone: load_file memory-maps the file, and rewriting a mapped file under it is a SIGBUS.
    return {k: v.clone() for k, v in load_file(d / WEIGHTS).items()}


def _truncate(d: Path) -> None:
    data = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(data[: len(data) // 2])


def _tamper_header(d: Path) -> None:
    data = bytearray((d / WEIGHTS).read_bytes())
    data[12:40] = b"}" * 28  # inside the JSON header that says where each tensor lives
    (d / WEIGHTS).write_bytes(bytes(data))


def _tamper_values(d: Path) -> None:
    tensors = _tensors(d)
    tensors["wte.weight"][3, 5] = float("nan")
    save_file(tensors, str(d / WEIGHTS))


def _wrong_shape(d: Path) -> None:
    tensors = _tensors(d)
    tensors["wte.weight"] = torch.zeros(7, 3)
    save_file(tensors, str(d / WEIGHTS))


def _pickle_as_weights(d: Path) -> None:
    tensors = _tensors(d)
    (d / WEIGHTS).unlink()
    torch.save(tensors, d / WEIGHTS)  # a torch.save (pickle) file under the safetensors name


def _pickle_beside(d: Path) -> None:
    tensors = _tensors(d)
    (d / WEIGHTS).unlink()
    torch.save(tensors, d / "pytorch_model.bin")


def _missing(d: Path) -> None:
    shutil.rmtree(d)


def _edit_config(edit: Callable[[dict], None]) -> Callable[[Path], None]:  # type: ignore[type-arg]
    def damage(d: Path) -> None:
        manifest = json.loads((d / "config.json").read_text())
        edit(manifest)
        (d / "config.json").write_text(json.dumps(manifest))

    return damage


def _model(**changes: object) -> Callable[[Path], None]:
    return _edit_config(lambda m: m["model"].update(changes))


def _template(**changes: object) -> Callable[[Path], None]:
    return _edit_config(lambda m: m["chat_template"].update(changes))


def _nested_config(d: Path) -> None:
    (d / "config.json").write_text("[" * 100000 + "]" * 100000)


# Checkpoints that loaded and then failed: /ready said 200 and every chat request then got a 500 or
# a 422; minutes of loading; a traceback; NaN at the first forward.
LOAD_THEN_FAIL: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "template-placeholder": (_template(message="{role}: {text}\n"), ("chat_template", "{text}")),
    "template-missing-role": (_template(roles={"system": "S", "user": "U"}),
                              ("chat_template", "'assistant'")),
    "template-empty-stop": (_template(stop=[""]), ("chat_template", "stop strings")),
    "layers-100000": (_model(n_layer=100000), ("n_layer is 100000", "limit")),
    "layers-1000": (_model(n_layer=1000), (WEIGHTS, "missing tensor(s)", "more")),
    "width-2**40": (_model(n_embd=2**40), ("n_embd is 1099511627776", "limit")),
    "nested-config": (_nested_config, ("config.json", "nested too deeply")),
    "eps-negative": (_model(layer_norm_epsilon=-1.0), ("layer_norm_epsilon", "-1.0")),
    "eps-nan": (_model(layer_norm_epsilon=float("nan")), ("layer_norm_epsilon", "nan")),
    "bias-yes": (_model(bias="yes"), ("bias", "'yes'")),
    "vocab-mismatch": (_edit_config(lambda m: m["tokenizer"].update(vocab_size=7)),
                       ("tokenizer.vocab_size", "7")),
    "block-zero": (_model(block_size=0), ("block_size", "positive integer")),
}

# name -> (how to break a copy of a good checkpoint, words the error line must contain)
VARIANTS: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    **LOAD_THEN_FAIL,
    "missing": (_missing, ("not found",)),
    "truncated": (_truncate, (WEIGHTS, "safetensors")),
    "tampered-header": (_tamper_header, (WEIGHTS, "safetensors")),
    "tampered-values": (_tamper_values, (WEIGHTS, "wte.weight", "NaN")),
    "wrong-shape": (_wrong_shape, (WEIGHTS, "wte.weight", "shape")),
    "pickle-as-weights": (_pickle_as_weights, (WEIGHTS, "safetensors")),
    "pickle-beside": (_pickle_beside, ("pytorch_model.bin", "pickle")),
}


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _broken(tiny_checkpoint: Path, tmp_path: Path, name: str) -> Path:
    ckpt = tmp_path / name
    shutil.copytree(tiny_checkpoint, ckpt)
    VARIANTS[name][0](ckpt)
    return ckpt


def _assert_one_clear_line(name: str, output: str) -> None:
    lines = [line for line in output.splitlines() if line.strip()]
    words = VARIANTS[name][1]
    assert "Traceback" not in output, output
    assert len(lines) == 1 and all(w in lines[0] for w in words), (
        f"{name}: expected one line naming {words}, got:\n{output}"
    )


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_broken_checkpoint_is_one_clear_error_before_serving(
    name: str, tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`nanoserve serve`'s own code path, in-process: it must return before uvicorn would start."""
    from nanoserve.cli import main
    from nanoserve.server import serve_cli

    def would_serve(self: object) -> None:
        raise AssertionError("the server was about to open its port")

    monkeypatch.setattr(serve_cli.DrainingServer, "run", would_serve)
    for key in [k for k in os.environ if k.startswith("NANOSERVE_")]:
        monkeypatch.delenv(key)
    ckpt = _broken(tiny_checkpoint, tmp_path, name)
    status = main(["serve", "--checkpoint", str(ckpt), "--port", "0", "--device", "cpu"])
    captured = capsys.readouterr()
    assert status == 2
    _assert_one_clear_line(name, captured.err + captured.out)


def test_served_process_exits_nonzero_and_port_never_opens(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The real `nanoserve serve` process given a pickle as weights: exit status, output, port."""
    clean = {k: "" for k in os.environ if k.startswith("NANOSERVE_")}
    server = start_server(_broken(tiny_checkpoint, tmp_path, "pickle-as-weights"), env=clean)
    try:
        deadline, opened = time.monotonic() + 90, False
        while server.process.poll() is None and time.monotonic() < deadline:
            opened = opened or _port_open(server.port)
            time.sleep(0.05)
        assert server.process.poll() is not None, "still running after 90 s"
        assert server.process.returncode != 0
        assert not opened, "the port opened"
        _assert_one_clear_line("pickle-as-weights", server.logs())
    finally:
        server.stop(timeout=5)
        server.log_path.unlink(missing_ok=True)


def _serve_once(checkpoint: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The real `nanoserve serve`, run to its exit. The timeout is generous on purpose: it bounds
    the test, it does not time the refusal (the old load of 100,000 layers took minutes)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NANOSERVE_")}
    return subprocess.run(
        serve_command(checkpoint, free_port(), args), env=clean, capture_output=True, text=True,
        timeout=60, stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    "name", ["template-placeholder", "template-empty-stop", "layers-100000", "width-2**40", "nested-config",
             "eps-nan", "bias-yes"],
)
def test_a_checkpoint_that_would_fail_after_loading_is_refused_by_the_process(
    name: str, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    done = _serve_once(_broken(tiny_checkpoint, tmp_path, name))
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.startswith("nanoserve serve: error: cannot load checkpoint: ")
    _assert_one_clear_line(name, done.stderr)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: --device cuda is valid here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_device_this_torch_cannot_use_is_one_line_before_loading(
    device: str, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    # A checkpoint that could not load either: the device is refused first, before any loading.
    done = _serve_once(_broken(tiny_checkpoint, tmp_path, "layers-100000"), "--device", device)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert lines == [lines[0]] and lines[0].startswith(f"nanoserve serve: error: device '{device}': "), lines
    assert "CUDA" in lines[0] and "n_layer" not in lines[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_index_beyond_the_devices_is_one_line_before_loading(tiny_checkpoint: Path) -> None:
    index = torch.cuda.device_count()
    done = _serve_once(tiny_checkpoint, "--device", f"cuda:{index}")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert lines == [f"nanoserve serve: error: device 'cuda:{index}': {index} CUDA device(s) visible, "
                     f"cuda:0 to cuda:{index - 1}"]
