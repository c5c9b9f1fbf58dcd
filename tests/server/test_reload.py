"""Reloading a served checkpoint from disk on a real server: SIGHUP, POST /admin/reload and --watch.

A stream started before the reload finishes on the old weights, the next request uses the new ones
(greedy output equal to a fresh server's on the new checkpoint), and no request fails; a checkpoint
that fails validation leaves the old one serving and says why.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from nanoserve.model.checkpoint import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    load_checkpoint,
    save_checkpoint,
)
from nanoserve.model.training.atomic_dir import staged_directory
from tests.server.conftest import metric_value
from tests.server.server import REPO_ROOT, ServerProcess, running_server

SHAKESPEARE = REPO_ROOT / "checkpoints" / "shakespeare-char"
NAMES = REPO_ROOT / "checkpoints" / "baby-names"
KEY = "reload-tests-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _copy(source: Path, target: Path) -> Path:
    """Swap `source`'s checkpoint files in at `target` whole, as `nanoserve train` saves."""
    with staged_directory(target) as stage:
        for name in (CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE):
            shutil.copy2(source / name, stage / name)
    return target


def _retrained(source: Path, target: Path, seed: int) -> Path:
    """`source` with every weight nudged (seeded) and its step advanced: a later save of a run."""
    ckpt = load_checkpoint(source)
    model = ckpt.build_model("cpu", torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05 * p.std().clamp_min(1e-3))
    steps = int(ckpt.provenance.get("steps", 0)) + 100
    return save_checkpoint(target, model, ckpt.tokenizer, name=ckpt.name, chat_template=ckpt.chat_template,
                           provenance={**ckpt.provenance, "steps": steps})


def _greedy(server: ServerProcess, prompt: str, tokens: int) -> str:
    r = httpx.post(server.base_url + "/generate", headers=AUTH, timeout=120,
                   json={"inputs": prompt, "parameters": {"max_new_tokens": tokens}})
    assert r.status_code == 200, r.text
    return str(r.json()["generated_text"])


def _version(server: ServerProcess) -> str:
    return str(httpx.get(server.base_url + "/info", headers=AUTH, timeout=10).json()["model_version"])


def _wait_for(what: str, check: Callable[[], bool], timeout: float = 60) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(0.05)
    raise TimeoutError(what)


class Traffic:
    """Short requests in a loop on another thread; every status is kept."""

    def __init__(self, server: ServerProcess) -> None:
        self.server, self._stop = server, threading.Event()
        self.statuses: list[int] = []
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with httpx.Client(base_url=self.server.base_url, headers=AUTH, timeout=60) as c:
            while not self._stop.is_set():
                r = c.post("/generate", json={"inputs": "\n", "parameters": {"max_new_tokens": 4}})
                self.statuses.append(r.status_code)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(60)


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("versions")
    return {"old": _copy(SHAKESPEARE, root / "old"), "new": _retrained(SHAKESPEARE, root / "new", seed=1),
            "names": _copy(NAMES, root / "names"), "names-new": _retrained(NAMES, root / "names-new", seed=2)}


def test_a_stream_started_before_a_sighup_finishes_on_the_old_weights(
    versions: dict[str, Path], tmp_path: Path
) -> None:
    served = _copy(versions["old"], tmp_path / "shakespeare")
    prompt, long = "ROMEO:\n", 3000  # about 10 s of generation on one thread
    env = {"NANOSERVE_API_KEYS": KEY, "NANOSERVE_MAX_NEW_TOKENS": str(long)}
    with running_server(served, env=env, args=["--cpu-threads", "1"]) as server:
        old_text = _greedy(server, prompt, long)
        old_version = _version(server)
        streamed: list[str] = []
        ended: list[float] = []
        started = threading.Event()

        def stream() -> None:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": long}}
            with httpx.stream("POST", server.base_url + "/generate_stream", json=body, headers=AUTH,
                              timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        started.set()
                        streamed.append(line)
            ended.append(time.monotonic())

        reader = threading.Thread(target=stream)
        with Traffic(server) as traffic:
            reader.start()
            assert started.wait(60)
            _copy(versions["new"], served)
            server.process.send_signal(signal.SIGHUP)
            swapped = _wait_for("the new version served", lambda: _version(server) != old_version)
            new_text = _greedy(server, prompt, 60)
            reader.join(120)
        events = [json.loads(line.removeprefix("data:")) for line in streamed]
        assert events[-1]["generated_text"] == old_text  # all of it from the old weights
        assert ended and ended[0] > swapped  # the stream was still running when the swap happened
        assert traffic.statuses and set(traffic.statuses) == {200}
        assert server.process.poll() is None  # SIGHUP reloads; it no longer ends the process
        logs = server.logs()
        assert "received SIGHUP" in logs and "reloaded shakespeare-char" in logs
        assert metric_value(httpx.get(server.base_url + "/metrics").text,
                            'nanoserve_model_reloads_total{model="shakespeare-char",result="reloaded"}') == 1
    with running_server(versions["new"]) as fresh:
        assert _greedy(fresh, prompt, 60) == new_text
    assert not old_text.startswith(new_text)  # the new weights do write something else


def test_a_checkpoint_failing_validation_leaves_the_old_one_serving(
    versions: dict[str, Path], tmp_path: Path
) -> None:
    served = _copy(versions["names"], tmp_path / "names")
    with running_server(served, env={"NANOSERVE_API_KEYS": KEY}) as server:
        before, version = _greedy(server, "\n", 12), _version(server)
        assert httpx.post(server.base_url + "/admin/reload").status_code == 401  # behind the key
        with staged_directory(served) as stage:  # a save whose weights file is cut short
            shutil.copy2(versions["names-new"] / CONFIG_FILE, stage / CONFIG_FILE)
            shutil.copy2(versions["names-new"] / TOKENIZER_FILE, stage / TOKENIZER_FILE)
            data = (versions["names-new"] / WEIGHTS_FILE).read_bytes()
            (stage / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
        r = httpx.post(server.base_url + "/admin/reload", headers=AUTH, timeout=60)
        assert r.status_code == 200
        (entry,) = r.json()["models"]
        assert entry["result"] == "failed" and entry["version"] == version
        assert "model.safetensors" in entry["error"]
        info = httpx.get(server.base_url + "/info", headers=AUTH).json()
        assert info["model_version"] == version and info["models"][0]["last_reload_error"] == entry["error"]
        assert _greedy(server, "\n", 12) == before
        assert metric_value(httpx.get(server.base_url + "/metrics").text,
                            'nanoserve_model_reloads_total{model="baby-names",result="failed"}') == 1
        assert "reload of baby-names failed" in server.logs()
        # Unchanged files are not loaded again; a good save then reloads.
        _copy(versions["names-new"], served)
        (entry,) = httpx.post(server.base_url + "/admin/reload", headers=AUTH, timeout=60).json()["models"]
        assert entry["result"] == "reloaded" and entry["previous"] == version
        assert entry["version"].endswith(f"@step{load_checkpoint(served).provenance['steps']}")
        (entry,) = httpx.post(server.base_url + "/admin/reload", headers=AUTH, timeout=60).json()["models"]
        assert entry["result"] == "unchanged"


def test_watch_serves_each_save_the_trainer_swaps_in(versions: dict[str, Path], tmp_path: Path) -> None:
    served = _copy(versions["names"], tmp_path / "names")
    with running_server(served, args=["--watch"]) as server:
        version = str(httpx.get(server.base_url + "/info").json()["model_version"])
        _copy(versions["names-new"], served)
        _wait_for("the watcher's reload",
                  lambda: httpx.get(server.base_url + "/info").json()["model_version"] != version)
        with running_server(versions["names-new"]) as fresh:
            assert _greedy(server, "\n", 12) == _greedy(fresh, "\n", 12)


def test_train_serve_serves_each_improved_checkpoint_while_training(tmp_path: Path) -> None:
    from tests.model.test_trainer import make_corpus
    from tests.server.server import free_port

    corpus, out, port = make_corpus(tmp_path / "plays.txt"), tmp_path / "run", free_port()
    command = [str(Path(sys.executable).parent / "nanoserve"), "train", str(corpus), "--out", str(out),
               "--serve", "--serve-port", str(port), "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
               "--block-size", "32", "--batch-size", "8", "--max-iters", "100000", "--warmup-iters", "2",
               "--eval-interval", "20", "--eval-iters", "2", "--no-progress",
               "--max-minutes", "0.5"]  # long enough to span the server's start, however fast
    log = tmp_path / "train.log"
    with open(log, "wb") as sink:
        run = subprocess.Popen(command, cwd=REPO_ROOT, stdout=sink, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        seen: set[str] = set()

        def served() -> str:
            with contextlib.suppress(httpx.TransportError, KeyError, ValueError):
                version = str(httpx.get(base + "/info", timeout=5).json()["model_version"])
                seen.add(version)
                return version
            return ""

        _wait_for("training to finish while serving",
                  lambda: bool(served()) and "training finished; still serving" in log.read_text(),
                  timeout=180)
        final = load_checkpoint(out).provenance["steps"]
        _wait_for("the final checkpoint served", lambda: served().endswith(f"@step{final}"))
        assert httpx.post(base + "/generate", json={"inputs": "KING"}, timeout=30).status_code == 200
        assert len(seen) >= 2, seen  # earlier saves were served before the last
        run.send_signal(signal.SIGINT)
        assert run.wait(60) == 0, log.read_text()
        with pytest.raises(httpx.TransportError):
            httpx.get(base + "/health", timeout=2)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(30)


def test_a_checkpoint_too_big_for_memory_is_refused_before_it_is_allocated(
    versions: dict[str, Path], tmp_path: Path
) -> None:
    served = _copy(versions["names"], tmp_path / "names")
    # 1,024 slots of a 2^20-token window: 8 TiB of KV cache, more than any host has.
    with running_server(served, args=["--max-seqs", "1024"]) as server:
        version = _version(server)
        with staged_directory(served) as stage:  # rotary positions: the window is only a number
            config = json.loads((versions["names-new"] / CONFIG_FILE).read_text())
            config["model"]["block_size"] = 1 << 20  # the most a config may say
            (stage / CONFIG_FILE).write_text(json.dumps(config))
            for name in (TOKENIZER_FILE, WEIGHTS_FILE):
                shutil.copy2(versions["names-new"] / name, stage / name)
        (entry,) = httpx.post(server.base_url + "/admin/reload", timeout=60).json()["models"]
        assert entry["result"] == "failed" and "GiB" in entry["error"] and "--max-context" in entry["error"]
        assert _version(server) == version
        assert httpx.get(server.base_url + "/ready").status_code == 200
