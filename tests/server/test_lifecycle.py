"""Start-up and shutdown of `nanoserve serve`: readiness, SIGTERM drain, refusing bad start-ups."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from nanoserve.cli import build_parser
from nanoserve.server.serve_cli import settings_from_args
from tests.server.asgi import AppClient, asgi_client
from tests.server.server import free_port, running_server, serve_command


async def _next_data(lines: AsyncIterator[str]) -> dict[str, Any]:
    async for line in lines:
        if line.startswith("data: "):
            return dict(json.loads(line[len("data: ") :]))
        assert not line.startswith("event:"), line
    raise AssertionError("the stream ended early")


async def test_drain_on_sigterm_finishes_in_flight_then_exits_zero(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    # Two in flight at SIGTERM: a 120-token stream that must finish whole, and an endless one that
    # holds the drain open (so the probes below certainly happen during it) until the test hangs up.
    env = {"NANOSERVE_DRAIN_TIMEOUT": "120", "NANOSERVE_MAX_SEQS": "2", "NANOSERVE_LOG_FORMAT": "json",
           "NANOSERVE_MAX_NEW_TOKENS": "1000000"}
    with running_server(tiny_checkpoint, env=env) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            endless = {"inputs": "Hi", "parameters": {"max_new_tokens": 1_000_000}}
            async with client.stream("POST", "/generate_stream", json=endless) as holder:
                # Kept referenced: a dropped line iterator gets finalized, which closes the
                # connection and so cancels the endless request before the signal (the server's
                # log showed it cancelled first in the runs that failed, under CPU load).
                holder_lines = holder.aiter_lines()
                await _next_data(holder_lines)
                finite = {"inputs": "Hello", "parameters": {"max_new_tokens": 120}}
                async with client.stream("POST", "/generate_stream", json=finite) as r:
                    lines = r.aiter_lines()
                    events = [await _next_data(lines)]
                    server.process.send_signal(signal.SIGTERM)
                    ready = await client.get("/ready")
                    refused = await client.post("/generate", json={"inputs": "Hi"})
                    health = await client.get("/health")
                    async for line in lines:
                        assert not line.startswith("event:"), line  # no error event: not cut short
                        if line.startswith("data: "):
                            events.append(json.loads(line[len("data: ") :]))
            # The endless one is closed by the client here: the drain can end.
            status = server.wait(60)
            logs = server.logs()
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "draining"
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert health.status_code == 200  # alive while draining: not a reason to restart the process
    assert len(events) == 120 and events[-1]["details"]["finish_reason"] == "length"
    assert status == 0, logs
    records = [json.loads(line) for line in logs.splitlines() if line.strip()]  # every line is JSON
    messages = [r.get("message", "") for r in records]
    signalled = next(i for i, m in enumerate(messages) if "received SIGTERM: draining" in m)
    assert "drained" in messages[signalled:]
    access = [(i, r) for i, r in enumerate(records)
              if r["logger"] == "nanoserve.access" and r.get("finish_reason") == "length"]
    assert len(access) == 1
    index, line = access[0]
    assert index > signalled  # it was still in flight when the signal came
    assert line["status"] == 200 and line["generated_tokens"] == 120 and line["ttft_ms"] > 0
    held = [r for r in records if r["logger"] == "nanoserve.access" and r.get("finish_reason") == "cancelled"]
    assert len(held) == 1 and held[0]["route"] == "/generate_stream"  # the one the client hung up


def _port_is_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _serve_fails(checkpoint: Path | str) -> str:
    port = free_port()
    proc = subprocess.Popen(serve_command(checkpoint, port), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # Poll while it starts: the port must never open, and the process must end by itself.
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            assert _port_is_closed(port), "the port opened for a start-up that should fail"
            time.sleep(0.05)
        out, err = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode not in (0, None)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("nanoserve serve: error: "), err
    assert "Traceback" not in out + err
    return lines[0]


def test_corrupt_checkpoint_exits_with_one_line_before_the_port_opens(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_checkpoint, corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    line = _serve_fails(corrupt)
    assert str(weights) in line and "safetensors" in line


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--checkpoint", "{tmp}/nope"], {}, ["{tmp}/nope", "not found"]),
        (["--max-seqs", "0"], {"NANOSERVE_API_KEYS": "short"}, ["max_seqs", "api_keys"]),
        (["--dtype", "float16", "--device", "cpu"], {}, ["float16", "GPU"]),
        (["--kv-cache-dtype", "float16", "--device", "cpu"], {}, ["kv_cache_dtype float16", "GPU"]),
        (["--kv-cache-dtype", "int8"], {}, ["kv_cache_dtype", "int8"]),
        (["--log-format", "xml"], {}, ["log_format", "xml"]),
    ],
)
def test_bad_settings_exit_with_one_line(  # type: ignore[no-untyped-def]
    tiny_checkpoint, tmp_path, capsys, monkeypatch, argv, env, expected
) -> None:
    from nanoserve.cli import main

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    status = main(["serve", "--checkpoint", str(tiny_checkpoint), "--port", str(free_port()), *argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("nanoserve serve: error: "), err
    for text in expected:
        assert text.replace("{tmp}", str(tmp_path)) in lines[0]
    assert "short" not in err  # an API key is never echoed, even a rejected one


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NANOSERVE_PORT", "9000")
    monkeypatch.setenv("NANOSERVE_MAX_SEQS", "3")
    monkeypatch.setenv("NANOSERVE_API_KEYS", "key-one-123, key-two-456")
    monkeypatch.setenv("NANOSERVE_REJECT_LONG_PROMPTS", "true")
    args = _parse("--port", "8123", "--checkpoint", str(tmp_path), "--no-reject-long-prompts")
    s = settings_from_args(args)
    assert s.port == 8123 and s.max_seqs == 3 and s.reject_long_prompts is False
    assert s.checkpoint == tmp_path.resolve()
    assert s.api_key_values() == [b"key-one-123", b"key-two-456"]
    assert "key-one" not in repr(s)


def test_default_checkpoint_is_found_from_any_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    s = settings_from_args(_parse())
    assert s.checkpoint == Path(__file__).resolve().parents[2] / "checkpoints" / "shakespeare-char"
    assert (s.host, s.port) == ("127.0.0.1", 8000)


async def test_not_ready_until_the_lifespan_has_loaded_the_model(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    from nanoserve.server.app import create_app
    from nanoserve.server.settings import Settings

    app = create_app(Settings(checkpoint=tiny_checkpoint, device="cpu"))
    # No lifespan: the model is never loaded.
    async with AppClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        ready = await client.get("/ready")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
        assert (await client.get("/health")).status_code == 200
        r = await client.post("/generate", json={"inputs": "Hi"})
        assert r.status_code == 503 and r.json()["error_type"] == "not_ready"


def test_every_setting_is_documented() -> None:
    from nanoserve.server.settings import Settings

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text(encoding="utf-8")
    for name, field in Settings.model_fields.items():
        row = f"| `--{name.replace('_', '-')}` / `NANOSERVE_{name.upper()}` |"
        assert row in doc, f"docs/configuration.md has no row for {name}"
        assert field.description, f"setting {name} has no description (it is the --help text)"


def test_every_engine_field_is_a_setting_with_its_default_and_help() -> None:
    from nanoserve.engine.config import EngineConfig, rules
    from nanoserve.server.app import engine_config
    from nanoserve.server.settings import Settings

    names = [f.name for f in dataclasses.fields(EngineConfig)]
    assert names == list(rules()) and set(names) <= set(Settings.model_fields)
    for f in dataclasses.fields(EngineConfig):
        setting = Settings.model_fields[f.name]
        assert setting.default == f.default, f.name
        assert setting.description == f.metadata["rule"].help, f.name
    # Every engine setting reaches the engine: a value off its default comes out of engine_config.
    off_default = {"max_seqs": 3, "prefill_budget": 7, "crop_policy": "sliding", "packed_linear": False,
                   "screen_head": False, "max_waiting_per_client": 2, "waiting_served_ratio": 2.5}
    config = engine_config(Settings(device="cpu", **off_default))
    assert dataclasses.asdict(config) == dataclasses.asdict(EngineConfig(device="cpu", **off_default))
    args = _parse("--max-seqs", "5", "--no-packed-linear", "--crop-policy", "sliding")
    assert dataclasses.asdict(engine_config(settings_from_args(args))) == dataclasses.asdict(
        EngineConfig(max_seqs=5, packed_linear=False, crop_policy="sliding"))


# Values of each type, most of them out of some field's bounds or choices.
_SAMPLES: dict[type, list[Any]] = {int: [-1, 0, 1, 2, 4096, 4097], float: [-1.0, 0.0, 0.5, 1e9],
                                   str: ["auto", "cpu", "cuda:x", "sliding", "int8", "sse", "bfloat16"],
                                   bool: [True, False]}


def test_settings_and_engine_config_accept_the_same_values() -> None:
    from pydantic import ValidationError

    from nanoserve.engine.config import ConfigError, EngineConfig, rules
    from nanoserve.server.settings import Settings

    checked = 0
    for name, (kind, _) in rules().items():
        if name == "device":  # beyond its form, EngineConfig also asks whether the device is there
            continue
        types = getattr(kind, "__args__", (kind,))
        values = [v for t in types if t in _SAMPLES for v in _SAMPLES[t]]
        for value in values + [None] * (type(None) in types):
            try:
                EngineConfig(**{name: value})
                engine_error = None
            except ConfigError as e:
                engine_error = e
            except ValueError:  # a combination (float16 on a CPU): not this field's own rule
                continue
            try:
                Settings(**{name: value})
                settings_error = None
            except ValidationError as e:
                settings_error = e
            assert (engine_error is None) == (settings_error is None), (name, value)
            if engine_error is not None:
                assert settings_error is not None and engine_error.field == name
                assert [(err["loc"], err["msg"]) for err in settings_error.errors()] == [
                    ((name,), engine_error.reason)]
                assert str(engine_error) == f"{name} {engine_error.reason}, got {value!r}"
            checked += 1
    assert checked > 60


def test_a_bad_engine_value_is_one_line_naming_the_field(tiny_checkpoint, capsys) -> None:  # type: ignore[no-untyped-def]
    from nanoserve.cli import main

    status = main(["serve", "--checkpoint", str(tiny_checkpoint), "--port", str(free_port()),
                   "--waiting-served-ratio", "0"])
    assert status == 2
    assert capsys.readouterr().err == (
        "nanoserve serve: error: waiting_served_ratio: must be more than 0 (got '0')\n")


def test_a_mistyped_variable_is_named_with_the_closest_setting() -> None:
    from nanoserve.server.settings import unknown_variables

    environ = {"NANOSERVE_MAX_SEQ": "4", "nanoserve_prefil_budget": "8", "NANOSERVE_PORT": "1",
               "NANOSERVE_MODEL_NAME_XYZ": "a", "NANOSERVE_TEST_FAULT": "nan:x", "HOME": "/root"}
    assert unknown_variables(environ) == [
        "NANOSERVE_MAX_SEQ is not a setting and is ignored; did you mean NANOSERVE_MAX_SEQS?",
        "NANOSERVE_MODEL_NAME_XYZ is not a setting and is ignored",
        "NANOSERVE_PREFIL_BUDGET is not a setting and is ignored; did you mean NANOSERVE_PREFILL_BUDGET?",
    ]


def test_the_server_warns_of_a_mistyped_variable_at_start_up(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    with running_server(tiny_checkpoint, env={"NANOSERVE_MAX_SEQ": "1"}) as server:
        assert httpx.get(server.base_url + "/info", timeout=10).json()["max_concurrent_requests"] == 16
        warning = "NANOSERVE_MAX_SEQ is not a setting and is ignored; did you mean NANOSERVE_MAX_SEQS?"
        assert warning in server.logs()


async def test_start_up_heap_is_frozen_while_serving_and_released_at_shutdown(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    # A full garbage collection over the start-up heap stalled every stream for 160-200 ms
    # (nanoserve/server/runtime/heap.py, freeze_startup_heap); frozen objects are out of its reach.
    assert gc.get_freeze_count() == 0
    async with asgi_client(tiny_checkpoint) as client:
        assert (await client.get("/ready")).status_code == 200
        assert gc.get_freeze_count() > 10_000  # torch, the model and the web stack, not a handful
    assert gc.get_freeze_count() == 0


async def test_blocking_work_off_the_event_loop_runs_on_one_torch_thread(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    # Loading and the engine's weight packing run in the loop's default executor; a thread there
    # on OpenMP's default count started a second pool, and the engine thread's workers then slept
    # between parallel regions (nanoserve/engine/threads.py, single_threaded_executor).
    async with asgi_client(tiny_checkpoint) as client:
        assert (await client.get("/ready")).status_code == 200
        assert await asyncio.to_thread(torch.get_num_threads) == 1
        assert await asyncio.to_thread(lambda: threading.current_thread().name.startswith("nanoserve-worker"))
