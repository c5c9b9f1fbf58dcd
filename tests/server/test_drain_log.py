"""What an operator reads at start-up and shutdown: the weights' format (int8 here), and a drain
whose timeout cut a stream says so (how many) instead of "drained"."""

from __future__ import annotations

import json
import signal

import httpx

from tests.server.server import running_server


def test_int8_weights_are_named_and_a_cut_drain_is_counted(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    env = {"NANOSERVE_DRAIN_TIMEOUT": "0.5", "NANOSERVE_MAX_NEW_TOKENS": "1000000",
           "NANOSERVE_LOG_FORMAT": "json"}
    with running_server(tiny_checkpoint, env=env, args=["--quantize", "int8"]) as server:
        endless = {"inputs": "Hi", "parameters": {"max_new_tokens": 1_000_000}}
        with httpx.stream("POST", server.base_url + "/generate_stream", json=endless, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            server.process.send_signal(signal.SIGTERM)
            rest = list(lines)  # the drain's timeout ends the stream
        status = server.wait(60)
        logs = server.logs()
    assert status == 0, logs
    last = json.loads([line for line in rest if line.startswith("data: ")][-1][len("data: "):])
    assert "shut down" in last["error"], last  # TGI's error event: the stream was cut
    messages = [json.loads(line).get("message", "") for line in logs.splitlines() if line.strip()]
    serving = next(m for m in messages if m.startswith("serving "))
    assert "weights int8 (linear layers; the rest float32)" in serving, serving
    assert "drain timeout (0.5s) cut 1 unfinished request" in messages, messages[-6:]
    assert "drained" not in messages
