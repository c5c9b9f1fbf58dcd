"""The container image, built and run for real with podman (no Docker engine on these machines).

deploy/podman/build.sh builds the Debian base image from packages if it is missing (cached between
runs) and then the Dockerfile, with the host network and the local CPU torch wheel. Containers run with
`--network host` bound to 127.0.0.1 (the bridge network's private range is not allowed here), a
read-only root like the Kubernetes Deployment, and are removed in teardown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import require_tool
from tests.server.server import free_port

ROOT = Path(__file__).resolve().parents[2]
PODMAN = ROOT / "deploy" / "podman"
IMAGE = "localhost/nanoserve:ci-test"
# The drain the test gives the server: far longer than the streamed request needs.
DRAIN_TIMEOUT = 60
READY_TIMEOUT = 240.0  # torch import + checkpoint load + warm-up on a busy 2-core machine

pytestmark = [pytest.mark.system_tool, pytest.mark.slow, pytest.mark.timeout(3600)]


def podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(PODMAN / "containers.conf")}


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, env=podman_env()
    )
    if check and result.returncode != 0:
        pytest.fail(f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="module")
def image() -> str:
    """Build (or re-use the layer cache of) the image; a cold build takes minutes, a warm one seconds."""
    for tool in ("podman", "runc", "debootstrap"):
        require_tool(tool, "the container test builds and runs the image with podman")
    started = time.monotonic()
    result = subprocess.run(
        [str(PODMAN / "build.sh")], capture_output=True, text=True, timeout=3300,
        env={**podman_env(), "IMAGE": IMAGE},
    )
    if result.returncode != 0:
        pytest.fail(f"image build failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    print(f"\nimage build took {time.monotonic() - started:.1f}s")
    return IMAGE


class Container:
    """One `podman run -d` of the image on the host network; removed by `remove()`."""

    def __init__(self, image: str, env: dict[str, str], volumes: tuple[str, ...] = ()) -> None:
        self.name = f"nanoserve-test-{uuid.uuid4().hex[:10]}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {"NANOSERVE_HOST": "127.0.0.1", "NANOSERVE_PORT": str(self.port), **env}
        args = ["run", "-d", "--name", self.name, "--network", "host", "--read-only"]
        for key, value in env.items():
            args += ["-e", f"{key}={value}"]
        for volume in volumes:
            args += ["-v", volume]
        podman(*args, image)

    def state(self) -> dict:  # type: ignore[type-arg]
        out = podman("inspect", "--format", "{{json .State}}", self.name).stdout
        return json.loads(out)  # type: ignore[no-any-return]

    def logs(self) -> str:
        result = podman("logs", self.name, check=False)
        return result.stdout[-2000:] + result.stderr[-4000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if not self.state()["Running"]:
                pytest.fail(f"container exited before ready:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        pytest.fail(f"not ready within {READY_TIMEOUT}s:\n{self.logs()}")

    def wait_exit(self, timeout: float) -> int:
        result = podman("wait", self.name, timeout=timeout)
        return int(result.stdout.strip().splitlines()[-1])

    def remove(self) -> None:
        podman("rm", "-f", "-t", "0", self.name, check=False)


@pytest.fixture
def containers() -> Iterator[list[Container]]:
    started: list[Container] = []
    yield started
    for container in started:
        container.remove()


def sse_events(response: httpx.Response) -> Iterator[dict]:  # type: ignore[type-arg]
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[len("data: "):])


def test_sigterm_while_streaming_finishes_the_request_and_exits_zero(
    image: str, containers: list[Container]
) -> None:
    """The baked-in checkpoint serves; SIGTERM reaches the server as PID 1 and drains in-flight work."""
    container = Container(image, {"NANOSERVE_DRAIN_TIMEOUT": str(DRAIN_TIMEOUT)})
    containers.append(container)
    container.wait_ready()

    info = httpx.get(container.url + "/info", timeout=10).json()
    assert info["model_id"] == "shakespeare-char"  # the default checkpoint in the image
    assert info["engine"]["backend"]["name"] == "native"  # the image built nanoserve/engine/native/decode.c
    # The image's HEALTHCHECK (plain Python against /ready) passes once ready.
    assert podman("healthcheck", "run", container.name, check=False).returncode == 0

    max_new = 256
    body = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": max_new, "seed": 7, "do_sample": True}}
    tokens, final, before_signal = 0, None, None
    with httpx.stream("POST", container.url + "/generate_stream", json=body, timeout=120) as response:
        assert response.status_code == 200
        for event in sse_events(response):
            assert "error" not in event, event
            if event.get("token") is not None:
                tokens += 1
            if event.get("details") is not None:
                final = event
            if tokens == 2 and before_signal is None:
                before_signal = tokens
                podman("kill", "--signal", "TERM", container.name)
    assert before_signal is not None and before_signal < max_new, "SIGTERM was not sent mid-stream"
    assert final is not None, "the stream ended without its final event"
    assert final["details"]["finish_reason"] == "length"
    assert final["details"]["generated_tokens"] == tokens == max_new
    assert container.wait_exit(timeout=DRAIN_TIMEOUT + 30) == 0, container.logs()
    assert "drain" in container.logs().lower()


def test_mounted_checkpoint_via_env_runs_as_non_root_on_read_only_root(
    image: str, containers: list[Container], tiny_checkpoint: Path
) -> None:
    """NANOSERVE_CHECKPOINT selects a mounted checkpoint; the process is uid 10001 and cannot write /."""
    for path in [tiny_checkpoint, *tiny_checkpoint.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # readable by the container's non-root user
    container = Container(
        image, {"NANOSERVE_CHECKPOINT": "/models/tiny"}, volumes=(f"{tiny_checkpoint}:/models/tiny:ro",)
    )
    containers.append(container)
    container.wait_ready()
    assert httpx.get(container.url + "/info", timeout=10).json()["model_id"] == "tiny-test"
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 4, "details": True}}
    reply = httpx.post(container.url + "/generate", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["details"]["generated_tokens"] == 4

    assert podman("exec", container.name, "id", "-u").stdout.strip() == "10001"
    write = podman("exec", container.name, "python3", "-c", "open('/opt/x', 'w')", check=False)
    assert write.returncode != 0 and "Read-only file system" in write.stderr

    podman("stop", "--time", str(DRAIN_TIMEOUT), container.name, timeout=DRAIN_TIMEOUT + 30)
    assert container.state()["ExitCode"] == 0, container.logs()


def test_missing_checkpoint_exits_nonzero_with_one_clear_line(image: str) -> None:
    name = f"nanoserve-test-{uuid.uuid4().hex[:10]}"
    try:
        result = podman(
            "run", "--name", name, "--network", "host", "--read-only",
            "-e", "NANOSERVE_HOST=127.0.0.1", "-e", f"NANOSERVE_PORT={free_port()}",
            "-e", "NANOSERVE_CHECKPOINT=/models/nope", image, timeout=180, check=False,
        )
    finally:
        podman("rm", "-f", "-t", "0", name, check=False)
    assert result.returncode != 0
    assert "/models/nope" in result.stderr
    assert "Traceback" not in result.stderr


def test_healthcheck_script_fails_when_nothing_answers() -> None:
    """The HEALTHCHECK script itself (no podman needed): unhealthy when the port is closed."""
    port = free_port()
    result = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "image" / "healthcheck.py")], capture_output=True, text=True,
        timeout=30, env={**os.environ, "NANOSERVE_HOST": "0.0.0.0", "NANOSERVE_PORT": str(port)},
    )
    assert result.returncode == 1
    assert f"http://127.0.0.1:{port}/ready" in result.stderr
