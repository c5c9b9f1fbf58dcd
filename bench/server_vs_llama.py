"""Serving benchmark: `nanoserve serve` against llama.cpp's `llama-server`, the same weights, the
same load, the two servers alternating.

    python -m bench.server_vs_llama [--shape 124M|135M] [--dtypes bfloat16,float32,int8]
                                    [--concurrency 1,32] [--rounds 2] [--max-new-tokens 64]

The model is bench/shapes.py's random weights of the shape (GPT-2 124M, or SmolLM2-135M's
Llama-family shape): nanoserve serves its checkpoint; llama.cpp serves the same weights exported
to a Hugging Face directory and converted by its own convert_hf_to_gguf.py (bench/gguf_convert.py):
float32 -> f32, bfloat16 -> bf16, int8 -> q8_0 (nanoserve: `--quantize int8` where `nanoserve
serve` offers it, beside `--int8-dtype` bfloat16). llama.cpp is built from source first when missing
(bench/llama_cpp_build.py). Both servers run on 127.0.0.1 with the same capacity: llama-server
with continuous batching, `--parallel` slots of `--slot-context` tokens each and `--threads`
threads; nanoserve with max_seqs slots of max_context tokens and as many CPU threads.

Load (bench/load.py, from this process): OpenAI-style streaming /v1/completions, a prompt of
random token ids (a different one per request, the same list for both servers, so neither server's
prompt cache helps), `--max-new-tokens` new tokens, temperature 1, top_k 40 (top_p 1 and min_p 0
sent explicitly: llama-server's defaults differ), request i seeded
with i; at each concurrency c, max(8, 2c) requests after a warm-up of c. Each round starts each
server once per dtype (who goes first alternates between rounds) and measures every concurrency.
Reports tokens/s, TTFT p50/p99 and inter-token p50/p99 per server and the ratio
nanoserve / llama-server; writes bench/results/server-vs-llama-<machine>-<shape>.{json,md}.
Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.gguf_convert import OUTTYPES, export_and_convert
from bench.llama_cpp_build import LlamaCpp, LlamaCppBuildError, ensure_built
from bench.llama_server import LlamaServerConfig, running_llama_server
from bench.load import LoadConfig, run_load, run_loop
from bench.record import RESULTS, load_avg, machine, write_results
from bench.server_vs_llama_report import WAYS, figures, render
from bench.shapes import SHAPES, make_checkpoint, random_prompts

DTYPES = ("bfloat16", "float32", "int8")
# Sent explicitly: llama-server's defaults are top_p 0.95 and min_p 0.05, nanoserve's 1 and off;
# the same sampling maths on both sides (temperature 1, top_k 40, nothing else).
SAMPLING = {"top_p": 1.0, "min_p": 0.0}
GGUF_TYPE = {"bfloat16": "bfloat16", "float32": "float32", "int8": "q8_0"}  # -> bench/gguf_convert.py


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.server_vs_llama", description=__doc__.split("\n")[0])
    # Word vocabularies only: each token's piece is printable text in llama.cpp's byte-level BPE
    # decoding, so every streamed token arrives as a non-empty chunk both ways (10.7M's characters
    # include a space, which that decoding drops).
    ap.add_argument("--shape", default="124M", choices=[s for s in SHAPES if SHAPES[s].vocab_size > 256])
    ap.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)}")
    ap.add_argument("--concurrency", default="1,32", help="concurrent streams, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both servers, alternating")
    ap.add_argument("--requests", type=int, default=0, help="requests per run (0: max(8, 2 x concurrency))")
    ap.add_argument("--prompt-tokens", type=int, default=25)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=32, help="llama-server --parallel; nanoserve max_seqs")
    ap.add_argument("--slot-context", type=int, default=256, help="tokens per slot, both servers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nanoserve-int8-args", default="",
                    help="the `nanoserve serve` options that serve int8 weights (default: `--quantize "
                         "int8` when `nanoserve serve --help` offers it; else the int8 rows measure "
                         "llama.cpp q8_0 only)")
    ap.add_argument("--int8-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="nanoserve's dtype beside int8 weights (embeddings, activations, KV cache)")
    ap.add_argument("--machine", default=None,
                    help="results name tag (default: the CPU's microarchitecture, e.g. zen4)")
    ap.add_argument("--out", default=None, help="results path without suffix")
    return ap


def nanoserve_int8(args: argparse.Namespace) -> str | None:
    """Sets args.nanoserve_int8_args when `nanoserve serve` offers int8 weights; returns None when
    int8 can be served, else why not."""
    if args.nanoserve_int8_args:
        return None
    done = subprocess.run([sys.executable, "-m", "nanoserve.cli", "serve", "--help"], capture_output=True,
                          text=True, timeout=120, check=False)
    if "--quantize" in done.stdout and "int8" in done.stdout:
        args.nanoserve_int8_args = "--quantize int8"
        return None
    if "int8" in done.stdout:
        return "`nanoserve serve --help` names an int8 option: pass it with --nanoserve-int8-args"
    return "`nanoserve serve` has no int8 option"


def one_server(way: str, dtype: str, args: argparse.Namespace, concs: list[int], ckpt_dir: Path,
               ggufs: dict[str, Path], prompts: list[list[int]], lc: LlamaCpp) -> dict[int, dict[str, Any]]:
    """Start `way` serving `dtype`, run every concurrency's load against it, stop it."""
    from tests.server.server import free_port, running_server

    if way == "llama-server":
        config = LlamaServerConfig(args.slots, args.slot_context, args.threads)
        with running_llama_server(lc.server, ggufs[GGUF_TYPE[dtype]], config, free_port()) as srv:
            return _loads(srv.base_url, args, concs, prompts)
    env = {"NANOSERVE_MAX_SEQS": str(args.slots), "NANOSERVE_MAX_CONTEXT": str(args.slot_context),
           "NANOSERVE_CPU_THREADS": str(args.threads), "NANOSERVE_MAX_QUEUE": "4096",
           "NANOSERVE_LOG_LEVEL": "warning"}
    extra: list[str] = []
    env["NANOSERVE_DTYPE"] = args.int8_dtype if dtype == "int8" else dtype
    if dtype == "int8":
        extra = shlex.split(args.nanoserve_int8_args)
    with running_server(ckpt_dir, env=env, args=extra) as server:
        return _loads(server.base_url, args, concs, prompts)


def _loads(url: str, args: argparse.Namespace, concs: list[int], prompts: list[list[int]]) -> dict[int, Any]:
    used = 0  # each request a prompt no earlier one of this server sent: no prompt cache helps

    def load(conc: int, requests: int) -> dict[str, Any]:
        nonlocal used
        assert used + requests <= len(prompts), "more requests than distinct prompts"
        config = LoadConfig(url=url, route="completions", concurrency=conc, requests=requests,
                            max_new_tokens=args.max_new_tokens, temperature=1.0, top_k=40, seed=0,
                            prompt_ids=prompts[used : used + requests], extra=SAMPLING)
        used += requests
        return figures(run_loop(run_load(config)).summary())

    out = {}
    for conc in concs:
        load(conc, conc)  # warm-up: this batch size's shapes, and the server's first requests
        out[conc] = load(conc, args.requests or max(8, 2 * conc))
    return out


def _last_error_line(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no output"])[-1][:300]


def measure(args: argparse.Namespace, lc: LlamaCpp, tmp: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """runs[dtype][conc][way]: one figures dict per round; and the dtypes nanoserve cannot serve."""
    from bench.serving import random_checkpoint

    dtypes = args.dtypes.split(",")
    concs = [int(c) for c in args.concurrency.split(",")]
    ckpt = make_checkpoint(args.shape, "float32")  # one export; the GGUF types round it as nanoserve does
    ggufs = export_and_convert(ckpt, tmp / "gguf", sorted({GGUF_TYPE[d] for d in dtypes}), lc)
    ckpt_dir, _ = random_checkpoint(args.shape, tmp / "nanoserve")
    vocab = ckpt.tokenizer.vocab_size - 1  # the last id may be a special token: prompts avoid it
    prompts = random_prompts(vocab, 4 * max(8, 2 * max(concs)), args.prompt_tokens)
    unavailable = {"int8": why} if "int8" in dtypes and (why := nanoserve_int8(args)) else {}
    runs: dict[str, Any] = {d: {c: {w: [] for w in WAYS} for c in concs} for d in dtypes}
    for r in range(args.rounds):
        for dtype in dtypes:
            ways = WAYS if r % 2 == 0 else WAYS[::-1]
            for way in ways:
                if way == "nanoserve" and dtype in unavailable:
                    continue
                print(f"round {r + 1}/{args.rounds} {dtype} {way}  (load {load_avg()})", flush=True)
                try:
                    by_conc = one_server(way, dtype, args, concs, ckpt_dir, ggufs, prompts, lc)
                except RuntimeError as e:
                    if not (way == "nanoserve" and dtype == "int8"):
                        raise
                    # e.g. int8 kernels that exist for one model family and not the other
                    unavailable["int8"] = f"`nanoserve serve {args.nanoserve_int8_args}` did not start: " + \
                        _last_error_line(str(e))
                    print(f"    {unavailable['int8']}", flush=True)
                    continue
                for conc, fig in by_conc.items():
                    runs[dtype][conc][way].append(fig)
                    print(f"    c={conc:3d} {fig['tokens_per_s']:8.1f} tok/s  TTFT p50 "
                          f"{1e3 * fig['ttft_p50']:6.1f} ms p99 {1e3 * fig['ttft_p99']:6.1f} ms  ITL p50 "
                          f"{1e3 * fig['itl_p50']:5.1f} ms p99 {1e3 * fig['itl_p99']:5.1f} ms", flush=True)
    return runs, unavailable


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bad = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if bad:
        print(f"error: unknown dtype(s) {bad}; choose from {list(DTYPES)}", file=sys.stderr)
        return 2
    try:
        lc = ensure_built()
    except LlamaCppBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    started = {"load_before": load_avg()}
    with tempfile.TemporaryDirectory(prefix="nanoserve-vs-llama-") as tmp:
        runs, unavailable = measure(args, lc, Path(tmp))
    m = machine()
    meta = {**started, "load_after": load_avg(), "machine": m, "args": vars(args),
            "llama_cpp": lc.version.split(".")[0],
            "gguf_types": {d: OUTTYPES[GGUF_TYPE[d]] for d in args.dtypes.split(",")}}
    payload, md = render(meta, runs, unavailable)
    print(md)
    out = args.out or RESULTS / f"server-vs-llama-{args.machine or m['microarch']}-{args.shape}"
    write_results(out, payload, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
