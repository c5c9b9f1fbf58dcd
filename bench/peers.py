"""Each peer of bench/engine_throughput.py in a process of its own, kept for a whole model shape.

Why processes: torch and llama.cpp share one OpenMP runtime (libgomp) per process, and an
OpenMP thread pool left behind by one peer (its worker threads outlive the measurement) slows
every later parallel region in the process, whichever peer runs next: in one process HF generate
fell from 147 to 84 tok/s after the engine had run, llama.cpp from ~500 to ~150. A process per
peer gives each the machine as it would have it alone; the driver only sends "run" and collects.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from bench.limits import measure_limits, model_costs
from bench.llama_batched import bench_llama_batched
from bench.llama_peer import bench_llama, llama_cpp_python
from bench.peer_runs import bench_engine, bench_hf, bench_naive, hf_model
from bench.shapes import DTYPES, make_checkpoint, prompts_for
from nanoserve.engine.threads import single_threaded_elsewhere
from nanoserve.server.runtime.heap import freeze_startup_heap

PEERS = ("engine", "hf", "naive", "llama.cpp")


class PeerProcess:
    """One peer's worker process; `call` sends a request and waits for its answer."""

    def __init__(
        self, peer: str, shape: str, dtype: str, threads: int, prompt_tokens: int, prompts: int
    ) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited threads or pools
        self.peer = peer
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker, args=(child, peer, shape, dtype, threads, prompt_tokens, prompts),
            name=f"bench-{peer}", daemon=True,
        )
        self.process.start()
        child.close()

    def call(self, *request: Any) -> Any:
        self.conn.send(request)
        ok, value = self.conn.recv()
        if not ok:
            raise RuntimeError(f"{self.peer} worker failed:\n{value}")
        return value

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.conn.send(None)
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _worker(conn: Connection, peer: str, shape: str, dtype: str, threads: int, prompt_tokens: int,
            n_prompts: int) -> None:
    if peer == "engine":
        single_threaded_elsewhere()  # the engine thread takes `threads` (cpu_threads)
    else:
        torch.set_num_threads(threads)
    ckpt = make_checkpoint(shape, dtype)
    prompts = prompts_for(ckpt, n_prompts, prompt_tokens)
    state: dict[str, Any] = {}
    # Every peer alike: the start-up heap (torch, transformers, ...) out of the cyclic GC, as
    # `nanoserve serve` does, so a 140-160 ms full collection (seen in the first runs) does not
    # land inside one peer's measurement and not another's.
    freeze_startup_heap()
    while True:
        request = conn.recv()
        if request is None:
            return
        try:
            conn.send((True, _handle(request, peer, ckpt, prompts, threads, state)))
        except Exception:
            conn.send((False, traceback.format_exc()))


def _handle(request: tuple[Any, ...], peer: str, ckpt: Any, prompts: list[list[int]], threads: int,
            state: dict[str, Any]) -> Any:
    kind, *args = request
    if kind == "ready":  # answered once this process has built its model and prompts
        return True
    if kind == "limits":
        dtype = DTYPES[ckpt.dtype]
        return measure_limits(dtype, model_costs(ckpt.config, dtype)[0])
    conc, new, *extra = args
    if peer == "engine":
        cfg, params, name = extra if extra else ({}, None, "engine")
        return bench_engine(ckpt, conc, prompts, new, {"cpu_threads": threads, **cfg}, params, name)
    if peer == "naive":
        if "model" not in state:
            state["model"] = ckpt.build_model("cpu")
        return bench_naive(state["model"], conc, prompts, new)
    if peer == "llama.cpp" and not llama_cpp_python():
        return bench_llama_batched(ckpt, conc, len(prompts[0]), new, threads, state)
    if "hf" not in state:
        state["hf"] = hf_model(ckpt)  # (model, exported directory)
    if peer == "hf":
        return bench_hf(state["hf"][0], conc, prompts, new, *extra)
    return bench_llama(state["hf"][1], ckpt, conc, prompts, new, threads)
