"""Memory: what each peer holds resident to serve the same model, measured in the same run.

    python -m bench.memory [--shapes 10.7M 124M] [--dtypes float32 bfloat16] [-c 8] [--new 64]

Every peer loads the same random weights (bench/shapes.py: GPT-2's architecture, or SmolLM2-135M's
Llama-family shape with grouped-query attention) from disk, in a fresh process of its
own, generates `c` sequences of `--new` tokens after 16-token prompts (so its KV cache is in use),
and reports its resident set (VmRSS) and its peak (VmHWM) from /proc:
  - `nanoserve serve`: the real server (uvicorn, FastAPI, metrics) on 127.0.0.1, loaded from a
    saved checkpoint, driven by `c` concurrent /generate requests;
  - engine alone: the same engine in a bare process, built the way the server builds it (the
    checkpoint dropped once the engine holds the weights, free heap pages returned);
  - HF transformers: `AutoModelForCausalLM.from_pretrained` on the exported weights, `generate`
    (its KV cache grows with the sequences instead of being allocated up front);
  - llama.cpp: llama-cpp-python on a GGUF of the same weights, greedy decode, its defaults
    otherwise: the file mmap'd (the pages it reads count as resident) and a float16 KV cache for
    c x context tokens; without llama-cpp-python, llama.cpp's own `llama-server` (built by
    `make llama-cpp`; --parallel c, c x context tokens) driven by c concurrent requests, like the
    nanoserve server row; skipped when neither is there;
  - bare interpreter: python with torch imported, the floor every torch peer starts from.
The weights' own bytes are listed beside them, and the engine's KV cache: sized by key/value heads,
so grouped-query attention's saving is real (135M: 3 key/value heads of 9, a third of full
multi-head attention's cache, which the table lists beside it).
Writes bench/results/memory.json and memory.md.
Not a test: nothing here asserts a size.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 16


def status_mb(pid: int | str = "self") -> dict[str, float]:
    """VmRSS and VmHWM of a process, in MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def _engine_alone(ckpt_dir: str, dtype: str, prompts: list[list[int]], new: int,
                  context: int) -> dict[str, float]:
    import asyncio

    from nanoserve.engine.threads import single_threaded_elsewhere

    single_threaded_elsewhere()
    from bench.peer_runs import generate_batch
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.engine import Engine
    from nanoserve.model.checkpoint import load_checkpoint
    from nanoserve.server.runtime.heap import return_free_memory

    checkpoint = load_checkpoint(ckpt_dir)
    engine = Engine(checkpoint, EngineConfig(max_seqs=len(prompts), max_queue=len(prompts), dtype=dtype,
                                               max_context=context))
    del checkpoint  # as nanoserve/server/app.py's lifespan does
    return_free_memory()
    engine.start()

    async def go() -> None:
        await engine.warmup()
        await generate_batch(engine, prompts, new)
        await engine.shutdown(0.0)

    asyncio.run(go())
    return status_mb()


def _hf(hf_dir: str, dtype: str, prompts: list[list[int]], new: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from bench.peer_runs import bench_hf
    from bench.shapes import DTYPES

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=DTYPES[dtype]).eval()
    bench_hf(model, len(prompts), prompts, new)
    return status_mb()


def _llama(gguf: str, prompts: list[list[int]], new: int, context: int) -> dict[str, float]:
    from bench.llama_peer import LlamaRunner

    conc, plen = len(prompts), len(prompts[0])
    runner = LlamaRunner(Path(gguf), conc, context, threads=2)
    nxt = runner.decode([(s, prompts[s], 0) for s in range(conc)])
    for k in range(1, new):
        nxt = runner.decode([(s, [nxt[s]], plen + k - 1) for s in range(conc)])
    return status_mb()


def _bare() -> dict[str, float]:
    import torch

    torch.ones(1).sum()
    return status_mb()


def _child(conn: Any, fn: str, args: tuple[Any, ...]) -> None:
    try:
        conn.send((True, globals()[fn](*args)))
    except Exception as exc:  # reported by the driver
        conn.send((False, f"{type(exc).__name__}: {exc}"))


def in_fresh_process(fn: str, *args: Any) -> dict[str, float] | str:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, fn, args), daemon=True)
    proc.start()
    child.close()
    ok, value = parent.recv()
    proc.join(60)
    return value if ok else str(value)


def _server(ckpt_dir: Path, dtype: str, prompts: list[list[int]], new: int, context: int,
            tokenizer: Any) -> dict[str, float]:
    from tests.server.server import running_server

    env = {"NANOSERVE_MAX_SEQS": str(len(prompts)), "NANOSERVE_DTYPE": dtype,
           "NANOSERVE_LOG_LEVEL": "warning", "NANOSERVE_MAX_CONTEXT": str(context)}
    with running_server(ckpt_dir, env=env) as server:
        bodies = [{"inputs": tokenizer.decode(p), "parameters": {"max_new_tokens": new, "temperature": 0.0}}
                  for p in prompts]
        return _loaded_rss(f"{server.base_url}/generate", bodies, server.process.pid)


def _llama_server(gguf: Path, prompts: list[list[int]], new: int, context: int) -> dict[str, float]:
    from bench.llama_cpp_build import locate
    from bench.llama_server import LlamaServerConfig, running_llama_server
    from tests.server.server import free_port

    config = LlamaServerConfig(slots=len(prompts), slot_context=context, threads=2)
    with running_llama_server(locate().server, gguf, config, free_port()) as server:
        bodies = [{"prompt": p, "max_tokens": new, "temperature": 0.0} for p in prompts]
        return _loaded_rss(f"{server.base_url}/v1/completions", bodies, server.process.pid)


def _loaded_rss(url: str, bodies: list[dict[str, Any]], pid: int) -> dict[str, float]:
    """Every body POSTed to `url` at once; then the server's resident memory (status_mb)."""
    import asyncio

    import httpx

    async def go() -> None:
        async with httpx.AsyncClient() as client:
            for r in await asyncio.gather(*(client.post(url, json=b, timeout=600) for b in bodies)):
                r.raise_for_status()

    asyncio.run(go())
    time.sleep(0.5)
    return status_mb(pid)


def kv_cache_mb(cfg: Any, conc: int, context: int, dtype: str) -> dict[str, float]:
    """The engine's KV cache (keys and values, every layer, `conc` x `context` tokens) with the
    model's key/value heads, and what full multi-head attention's would be."""
    per_head = 2 * cfg.n_layer * cfg.head_dim * conc * context * (4 if dtype == "float32" else 2) / 2**20
    return {"kv_mb": per_head * cfg.kv_heads, "kv_mha_mb": per_head * cfg.n_head}


def _llama_row(hf_dir: Path, ckpt: Any, prompts: list[list[int]], new: int, context: int) -> Any:
    from bench.gguf_convert import export_and_convert
    from bench.llama_cpp_build import locate
    from bench.llama_peer import convert_to_gguf, llama_cpp_python

    lc = locate()
    if lc.built():  # llama.cpp's own converter: any family
        gguf_path = export_and_convert(ckpt, hf_dir, [ckpt.dtype], lc, hf_dir=hf_dir)[ckpt.dtype]
    elif ckpt.config.family == "gpt2" and llama_cpp_python():
        gguf_path = convert_to_gguf(hf_dir, ckpt, hf_dir / f"model-{ckpt.dtype}.gguf")
    else:
        return "skipped: neither llama-cpp-python with the gguf package nor `make llama-cpp`'s build"
    if llama_cpp_python():
        row = in_fresh_process("_llama", str(gguf_path), prompts, new, context)
        return {**row, "via": "llama-cpp-python"} if isinstance(row, dict) else row
    return {**_llama_server(gguf_path, prompts, new, context), "via": "llama-server"}


def run_shape(shape: str, dtype: str, conc: int, new: int, context: int, work: Path) -> dict[str, Any]:
    from bench.shapes import make_checkpoint, prompts_for
    from nanoserve.model.checkpoint import save_checkpoint
    from nanoserve.model.hf import export_hf

    ckpt = make_checkpoint(shape, dtype)
    weights_mb = sum(t.numel() * t.element_size() for t in ckpt.state_dict.values()) / 2**20
    prompts = prompts_for(ckpt, conc, PROMPT_TOKENS)
    ckpt_dir = work / f"{shape}-{dtype}"
    save_checkpoint(ckpt_dir, ckpt.build_model("cpu"), ckpt.tokenizer, name=ckpt.name)
    hf_dir = work / f"{shape}-{dtype}-hf"
    export_hf(ckpt, hf_dir)
    rows: dict[str, Any] = {"weights_mb": weights_mb, **kv_cache_mb(ckpt.config, conc, context, dtype)}
    rows["nanoserve serve"] = _server(ckpt_dir, dtype, prompts, new, context, ckpt.tokenizer)
    rows["engine alone"] = in_fresh_process("_engine_alone", str(ckpt_dir), dtype, prompts, new, context)
    rows["HF transformers"] = in_fresh_process("_hf", str(hf_dir), dtype, prompts, new)
    try:
        rows["llama.cpp"] = _llama_row(hf_dir, ckpt, prompts, new, context)
    except ImportError:
        rows["llama.cpp"] = "skipped: the gguf package is not installed"
    rows["bare python + torch"] = in_fresh_process("_bare")
    return rows


PEERS = ("nanoserve serve", "engine alone", "HF transformers", "llama.cpp", "bare python + torch")


def table_row(shape: str, dtype: str, rows: dict[str, Any]) -> str:
    def cell(v: Any) -> str:
        if not isinstance(v, dict):
            return str(v)
        via = f", {v['via']}" if "via" in v else ""  # which llama.cpp program
        return f"{v['VmRSS']:.0f} ({v['VmHWM']:.0f}{via})"

    def ratio(peer: str) -> str:
        a, b = rows[peer], rows["engine alone"]
        ok = isinstance(a, dict) and isinstance(b, dict)
        return f"{a['VmRSS'] / b['VmRSS']:.2f}" if ok else "-"

    kv = f"{rows['kv_mb']:.0f} ({rows['kv_mha_mb']:.0f})"
    cells = " | ".join(cell(rows[k]) for k in PEERS)
    return (f"| {shape} | {dtype} | {rows['weights_mb']:.0f} | {kv} | {cells}"
            + f" | {ratio('HF transformers')} | {ratio('llama.cpp')} |")


def main(argv: list[str] | None = None) -> int:
    from bench.record import RESULTS, cpu_label, load_avg, machine, write_results

    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["10.7M", "124M"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--context", type=int, default=256, help="tokens per sequence every peer makes room for")
    ap.add_argument("--out", default=str(RESULTS / "memory"))
    args = ap.parse_args(argv)
    meta: dict[str, Any] = {"load_before": load_avg(), "machine": machine(), "args": vars(args)}
    results: dict[str, Any] = {}
    lines = [f"Machine: {cpu_label(meta['machine'])}, {meta['machine']['cores']} cores. "
             f"{args.concurrency} sequences x ({PROMPT_TOKENS} prompt + {args.new} new tokens), room for "
             f"{args.context} tokens each; "
             "resident MiB after the run (peak in brackets), each peer in a fresh process; the "
             "engine's KV cache (what full multi-head attention's would be in brackets).\n",
             "| model | dtype | weights | engine KV | nanoserve serve | engine alone | HF transformers "
             "| llama.cpp | bare python + torch | HF / engine | llama.cpp / engine |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="nanoserve-memory-") as tmp:
        for shape in args.shapes:
            for dtype in args.dtypes:
                rows = results[f"{shape}/{dtype}"] = run_shape(shape, dtype, args.concurrency, args.new,
                                                               args.context, Path(tmp))
                print(shape, dtype, json.dumps(rows), flush=True)
                lines.append(table_row(shape, dtype, rows))
    meta["load_after"] = load_avg()
    md = "\n".join(lines) + "\n"
    print(md)
    write_results(args.out, {"meta": meta, "results": results}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
