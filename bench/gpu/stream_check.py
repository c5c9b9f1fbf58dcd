"""Streaming through a real uvicorn on the device, token for token against the reference.

    python -m bench.gpu.stream_check --device cuda --json stream.json

A real `nanoserve serve` (tests/server/server.py) serves the engine tests' lively checkpoint
(sharp, context-dependent predictions: a wrong token shows) on `--device` in float32 through the
torch backend (the one a GPU runs), with two KV slots and a 16-token prefill budget, so four
concurrent greedy streams queue, prefill in chunks, batch, and run past the 32-token window. Each
stream's token ids must be what the slow reference generator (nanoserve/model/reference.py, on the CPU)
gives for its prompt; /info must name the device and the torch backend.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx

from nanoserve.model.checkpoint import load_checkpoint
from nanoserve.model.reference import reference_generate
from tests.engine.conftest import make_lively_checkpoint
from tests.server.server import running_server

PROMPTS = ["H", "Hello", "The quick brown fox", "To be, or not to be: that is the question" * 2]
NEW_TOKENS = 70


async def stream_ids(client: httpx.AsyncClient, prompt: str) -> list[int]:
    """The token ids of one greedy /generate_stream, in the order they arrived."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "do_sample": False}}
    ids: list[int] = []
    async with client.stream("POST", "/generate_stream", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                event = json.loads(line[5:])
                if "token" not in event:
                    raise RuntimeError(f"an event without a token: {line}")
                ids.append(int(event["token"]["id"]))
    return ids


async def streams(base_url: str) -> tuple[list[list[int]], dict[str, Any]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        got = await asyncio.gather(*(stream_ids(client, p) for p in PROMPTS))
        info = (await client.get("/info")).json()
    return list(got), info


def check(device: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="nanoserve-stream-") as tmp:
        path = make_lively_checkpoint(Path(tmp) / "lively")
        ckpt = load_checkpoint(path)
        model = ckpt.build_model("cpu")
        eos = ckpt.tokenizer.eos_id
        env = {"NANOSERVE_MAX_SEQS": "2", "NANOSERVE_PREFILL_BUDGET": "16", "NANOSERVE_LOG_LEVEL": "warning"}
        args = ("--device", device, "--dtype", "float32", "--backend", "torch")
        with running_server(path, env=env, args=args) as server:
            got, info = asyncio.run(streams(server.base_url))
    engine = info.get("engine", {})
    mismatches = []
    for prompt, ids in zip(PROMPTS, got, strict=True):
        want = reference_generate(model, ckpt.tokenizer.encode(prompt), NEW_TOKENS, policy="shift")
        # The server ends a stream at the end-of-sequence token; the reference runs on past it.
        complete = len(ids) == NEW_TOKENS or (eos is not None and ids and ids[-1] == eos)
        if ids != want[: len(ids)] or not complete:
            mismatches.append({"prompt": prompt, "got": ids, "want": want})
    served_on = str(engine.get("device"))
    backend = engine.get("backend") or {}
    ok = not mismatches and served_on.startswith(device.split(":")[0]) and backend.get("name") == "torch"
    return {"ok": ok, "device": device, "served_on": served_on, "backend": backend,
            "streams": len(PROMPTS), "tokens": sum(map(len, got)), "mismatches": mismatches}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.stream_check", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", required=True, help="where to write the result")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = check(args.device)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "mismatches"}), flush=True)
    for m in result["mismatches"]:
        print(f"MISMATCH {m['prompt']!r}:\n  got  {m['got']}\n  want {m['want']}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
