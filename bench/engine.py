"""Engine benchmark: this engine vs its peers and vs the machine's measured limits, in one run.

    python bench/engine.py [--shapes 10.7M,124M] [--dtypes float32] [--concurrency 1,8,32,64]

For each model shape (random GPT-2-architecture weights) and dtype, on the same prompts:
  (a) this engine (in-process, greedy, every sequence generating the same number of tokens),
  (b) a naive recompute loop like nanoGPT's sample.py (no KV cache, whole context every token),
  (c) Hugging Face transformers `generate()` with its KV cache on the exported GPT-2 weights,
  (d) llama.cpp through llama-cpp-python on a GGUF conversion (skipped when not installed),
plus the machine's limits measured in the same run: memory read bandwidth (a forward reads every
weight once) and matmul throughput (a forward costs 2 FLOPs per weight per token it feeds): the
fastest of torch's matmul in the dtype, in float32 (bf16 weights can be widened), and the vector
units' measured multiply-add peak (bench/peak.py; torch's matmul can fall far short of it). From
them, the shortest time a run could take (`run_bound_s`): the prompts' forward, then one forward
per further generated token, each taking the longer of reading the weights and computing its
tokens. Every peer does that same work, so "x / limit" is the run's bound over its measured time:
the share of the machine it used.
Prints ratios to this engine and writes bench/results/engine.json and engine.md. Not a test:
nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.peak import vector_peaks
from model.checkpoint import Checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.tokenizer import CharTokenizer, WordTokenizer
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from service.engine.threads import single_threaded_elsewhere
from service.engine.types import FinishReason, SamplingParams, Usage

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES: dict[str, dict[str, int]] = {
    # nanoGPT's shakespeare_char model (10.7M parameters) and GPT-2 small (124M).
    "10.7M": dict(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384),
    "124M": dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Run:
    peer: str
    concurrency: int
    tokens: int
    seconds: float
    step_ms: float  # median decode step (engine: measured per step; peers: total / new tokens)
    note: str = ""

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds


@dataclass
class ShapeResult:
    shape: str
    dtype: str
    params: int
    prompt_tokens: int = 0  # per sequence
    new_tokens: int = 0  # generated per sequence
    runs: list[Run] = field(default_factory=list)
    limits: dict[str, float] = field(default_factory=dict)

    def run_bound_s(self, conc: int) -> float:
        """The shortest time `conc` sequences could take on this machine's measured limits.

        Prompts count: a run of 16-token prompts and 32 new tokens feeds 1.5x the tokens it
        generates (2x at 124M, 16 new), and every peer's time includes its prefill; leaving them
        out reads 30-50% low at batch 32-64. Prefill here is one forward of every prompt token
        (the engine runs it so within its prefill budget), with the output layer for each
        sequence's last token only (the engine, HF's generate and llama.cpp all compute only
        those logits: counting the output layer for every prompt token put this bound below the
        engine's measured 124M batch-64 run); its first generated token comes out of that forward."""
        lim = self.limits
        rate = lim["matmul_GFLOPs"] * 1e9
        read_s = lim["weight_bytes"] / (lim["bandwidth_GBps"] * 1e9)
        token_s, head_s = lim["flops_per_token"] / rate, lim["head_flops_per_token"] / rate
        prefill = max(read_s, conc * (self.prompt_tokens * (token_s - head_s) + head_s))
        return prefill + (self.new_tokens - 1) * max(read_s, conc * token_s)

    def bound_tps(self, conc: int) -> float:
        return conc * self.new_tokens / self.run_bound_s(conc)


def random_model(shape: str, dtype: str = "float32") -> tuple[GPT, Any]:
    """One of the issue's shapes with random weights (seed 0), and a tokenizer every id of its
    vocabulary decodes with."""
    cfg = GPTConfig(**SHAPES[shape])
    if cfg.vocab_size <= 256:
        tok: Any = CharTokenizer([chr(32 + i) for i in range(cfg.vocab_size)])
    else:  # a synthetic word vocabulary of GPT-2's size: every id decodes
        tok = WordTokenizer([f"w{i}" for i in range(cfg.vocab_size - 1)])
    torch.manual_seed(0)
    return GPT(cfg).to(DTYPES[dtype]), tok


def make_checkpoint(shape: str, dtype: str) -> Checkpoint:
    model, tok = random_model(shape, dtype)
    cfg = model.config
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return Checkpoint(config=cfg, tokenizer=tok, state_dict=state, name=f"random-{shape}", dtype=dtype)


def prompts_for(ckpt: Checkpoint, n: int, length: int) -> list[list[int]]:
    return random_prompts(ckpt.tokenizer.vocab_size, n, length)


def random_prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


# ---------------------------------------------------------------------------------- (a) engine
class StepTimes:
    def __init__(self) -> None:
        self.decode: list[float] = []

    def on_step(self, duration_s: float, batch_size: int, prefill_tokens: int) -> None:
        if prefill_tokens == 0:
            self.decode.append(duration_s)

    def on_finish(self, reason: FinishReason, usage: Usage) -> None:
        pass

    def on_rejected(self, reason: str) -> None:
        pass


async def _engine_run(
    engine: Engine, prompts: list[list[int]], new: int, extra: dict[str, Any] | None = None
) -> float:
    base: dict[str, Any] = {"temperature": 0.0, "seed": 0, **(extra or {})}
    params = SamplingParams(max_new_tokens=new, stop_on_eos=False, **base)

    async def one(p: list[int]) -> int:
        return len([e async for e in await engine.generate(p, params) if e.token_id is not None])

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    elapsed = time.perf_counter() - t0
    assert all(c == new for c in counts), counts
    return elapsed


def bench_engine(
    ckpt: Checkpoint, conc: int, prompts: list[list[int]], new: int, cfg: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None, name: str = "engine",
) -> Run:
    times = StepTimes()
    window = min(ckpt.config.block_size, 256)  # bounds KV memory; prompts + new tokens fit
    cfg = {"max_context": window, **(cfg or {})}
    config = EngineConfig(max_seqs=conc, max_queue=conc, dtype=ckpt.dtype, **cfg)
    engine = Engine(ckpt, config, observer=times)
    engine.start()

    async def go() -> float:
        await engine.warmup()
        # Warm this batch size's shapes, and give the thread tuner (service/engine/threads.py)
        # its first measurements: a long-running server has them after its first few steps.
        await _engine_run(engine, prompts[:conc], 16, params)
        times.decode.clear()
        elapsed = await _engine_run(engine, prompts[:conc], new, params)
        await engine.shutdown(0.0)
        return elapsed

    elapsed = asyncio.run(go())
    step = 1e3 * statistics.median(times.decode) if times.decode else float("nan")
    return Run(name, conc, conc * new, elapsed, step)


# ------------------------------------------------------------------------------- (b) naive loop
@torch.inference_mode()
def bench_naive(model: GPT, conc: int, prompts: list[list[int]], new: int) -> Run:
    """nanoGPT sample.py: crop to block_size, full forward, take the last logits, append."""
    block = model.config.block_size
    idx = torch.tensor(prompts[:conc], dtype=torch.long)
    model(idx[:, -block:])  # warm-up
    t0 = time.perf_counter()
    for _ in range(new):
        logits = model(idx[:, -block:])[:, -1, :]
        idx = torch.cat((idx, logits.argmax(dim=-1, keepdim=True)), dim=1)
    elapsed = time.perf_counter() - t0
    return Run("naive", conc, conc * new, elapsed, 1e3 * elapsed / new)


# ---------------------------------------------------------------------------------- (c) HF
def hf_model(ckpt: Checkpoint) -> Any:
    from transformers import GPT2LMHeadModel

    from model.hf import export_hf

    out = Path(tempfile.mkdtemp(prefix="nanoserve-bench-hf-"))
    export_hf(ckpt, out)
    return GPT2LMHeadModel.from_pretrained(out, dtype=DTYPES[ckpt.dtype]).eval(), out


@torch.inference_mode()
def bench_hf(
    model: Any, conc: int, prompts: list[list[int]], new: int, params: dict[str, Any] | None = None
) -> Run:
    """HF generate: greedy, or sampled with `params` (temperature, top_k, top_p, min_p: the
    engine's names; top_k 0 when not given, since generate() would otherwise add its default 50)."""
    ids = torch.tensor(prompts[:conc], dtype=torch.long)
    sampling: dict[str, Any] = {"do_sample": False}
    if params and params.get("temperature", 0) > 0:
        sampling = {"do_sample": True, "top_k": 0, **params}
    kwargs = dict(
        attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=None, use_cache=True, **sampling
    )
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
    elapsed = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new
    return Run("hf", conc, conc * new, elapsed, 1e3 * elapsed / new)


# ------------------------------------------------------------------------------- limits
def read_bandwidth(nbytes: int, reads: int) -> float:
    """Bytes per second summing a float32 buffer of `nbytes`, best of `reads` passes."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    best = 0.0
    for _ in range(reads):
        t0 = time.perf_counter()
        buf.sum()
        best = max(best, buf.nbytes / (time.perf_counter() - t0))
    return best


def measure_limits(dtype: torch.dtype, weight_bytes: float = 0.0) -> dict[str, float]:
    """Memory read bandwidth and matmul FLOP/s, best of a few.

    The bandwidth is the better of two reads: a 512 MiB buffer (memory), and a buffer the size of
    the model's weights read over and over (where they fit in the last-level cache, as the 10.7M
    model's 21 MB of bf16 weights do in a 32 MiB L3, and its 43 MB of float32 ones in part, they
    are read from there); with the memory read alone, the engine's batch-1 step of the 10.7M model
    reads its weights faster than the bound."""
    memory = read_bandwidth(512 * 2**20, 5)
    resident = read_bandwidth(int(weight_bytes), 20) if weight_bytes else 0.0
    rates = {str(d).removeprefix("torch."): _matmul_flops(d) for d in dict.fromkeys([dtype, torch.float32])}
    # The vector units' own peak: no matmul beats it, and torch's can fall far short of it (MKL's
    # float32 matmul on AMD Zen 5: ~216 GFLOP/s of a measured ~2x that), which made the old limit
    # read over 100%.
    peaks = {name.replace(" ", "_"): r for name, r in vector_peaks(dtype, torch.get_num_threads()).items()}
    # A CPU without bf16 arithmetic (AVX2) still multiplies bf16 weights at its float32 rate by
    # widening them as they load (the native step does; torch's emulated bf16 matmul is ~100x
    # slower), so the compute limit for a dtype is the fastest of its own rates and float32's.
    return {"bandwidth_GBps": max(memory, resident) / 1e9, "bandwidth_memory_GBps": memory / 1e9,
            "bandwidth_weights_GBps": resident / 1e9,
            "matmul_GFLOPs": max(*rates.values(), *peaks.values()) / 1e9,
            **{f"matmul_GFLOPs_{name}": r / 1e9 for name, r in rates.items()},
            **{f"matmul_GFLOPs_peak_{name}": r / 1e9 for name, r in peaks.items()}}


def _matmul_flops(dtype: torch.dtype) -> float:
    n = 2048 if dtype == torch.float32 else 512  # emulated bf16 takes ~1 s per 2048^3 product
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    best_flops = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best_flops = max(best_flops, 2 * n**3 / (time.perf_counter() - t0))
    return best_flops


def model_costs(cfg: GPTConfig, dtype: torch.dtype) -> tuple[float, float, float]:
    """(bytes of weights read per decode step, matmul FLOPs per generated token, the output
    layer's share of them)."""
    with torch.device("meta"):
        m = GPT(cfg)
    total = sum(p.numel() for p in m.parameters())  # tied lm_head counted once
    elem = torch.finfo(dtype).bits // 8
    # Per token: every Linear (incl. the tied lm_head) costs 2 FLOPs per weight; embeddings are lookups.
    linear = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    return float(total * elem), float(2 * linear), float(2 * m.lm_head.weight.numel())


# ------------------------------------------------------------------------------- driver
def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def run_shape(shape: str, dtype: str, concs: list[int], args: argparse.Namespace) -> ShapeResult:
    from bench.levers import LEVERS
    from bench.peers import PEERS, PeerProcess

    cfg = GPTConfig(**SHAPES[shape])
    with torch.device("meta"):
        params = GPT(cfg).num_params(non_embedding=False)
    new = args.new_tokens if shape == "10.7M" else max(4, args.new_tokens // 2)
    res = ShapeResult(shape, dtype, params, args.prompt_tokens, new)
    peers = {p: PeerProcess(p, shape, dtype, args.threads, args.prompt_tokens, max(concs)) for p in PEERS}
    try:
        # Every peer builds its model when it starts (124M: seconds of CPU and memory traffic):
        # the limits are measured once they all have, not beside them (beside a start-up, a read
        # measured a third of the bandwidth).
        for peer in peers.values():
            peer.call("ready")
        first = peers["naive"].call("limits")
        for conc in concs:
            print(f"[{shape} {dtype}] concurrency {conc}  (load {load_avg()})", flush=True)
            # Shared, noisy machines: the engine, HF and llama.cpp take turns `repeats` times, each
            # one's best run kept, so no ratio rides on one draw.
            eng_runs, hf_runs, llama_runs = [], [], []
            for i in range(args.repeats):
                eng_runs.append(peers["engine"].call("run", conc, new))
                if i < (args.hf_repeats or args.repeats):
                    hf_runs.append(peers["hf"].call("run", conc, new))
                llama_runs.append(peers["llama.cpp"].call("run", conc, new))  # None: not installed
            res.runs.append(max(eng_runs, key=lambda r: r.tps))
            naive_new = new if shape == "10.7M" or conc <= 8 else max(2, new // 4)
            if not args.no_naive:
                res.runs.append(peers["naive"].call("run", conc, naive_new))
            res.runs.append(max(hf_runs, key=lambda r: r.tps))
            if llama_runs[0] is not None:
                res.runs.append(max(llama_runs, key=lambda r: r.tps))
            if args.levers and conc in (1, 32):
                res.runs.extend(peers["engine"].call("run", conc, new, c, p, n) for n, c, p in LEVERS)
            for r in res.runs:
                if r.concurrency == conc:
                    line = f"    {r.peer:22s} {r.tps:9.1f} tok/s  step {r.step_ms:8.2f} ms {r.note}"
                    print(line, flush=True)
        # Measured again after the runs, each figure's best kept: on a shared host one reading
        # can land beside another tenant and read low by half or more.
        again = peers["naive"].call("limits")
        res.limits = {k: max(v, again[k]) for k, v in first.items()}
        weight_bytes, flops_per_token, head_flops = model_costs(cfg, DTYPES[dtype])
        res.limits.update(weight_bytes=weight_bytes, flops_per_token=flops_per_token,
                          head_flops_per_token=head_flops)
        res.limits["bound_tps_batch1"] = res.limits["bandwidth_GBps"] * 1e9 / weight_bytes
        res.limits["bound_tps_compute"] = res.limits["matmul_GFLOPs"] * 1e9 / flops_per_token
    finally:
        for peer in peers.values():
            peer.close()
    return res


def write_results(out: str | Path, payload: dict[str, Any], md: str) -> None:
    """A benchmark's results: `out`.json (everything measured) and `out`.md (its table)."""
    path = Path(out)
    if path.suffix in (".json", ".md"):
        path = path.with_suffix("")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Suffixes appended, not swapped: a name like results/engine-10.7M would otherwise lose ".7M".
    path.with_name(path.name + ".json").write_text(json.dumps(payload, indent=2) + "\n")
    path.with_name(path.name + ".md").write_text(md)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="10.7M,124M")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(RESULTS / "engine"))
    ap.add_argument("--repeats", type=int, default=2, help="alternating engine/HF runs, best kept")
    ap.add_argument("--hf-repeats", type=int, default=0,
                    help="HF runs per cell if fewer than --repeats (bf16 HF on AVX2: minutes per run)")
    ap.add_argument("--no-naive", action="store_true",
                    help="skip the naive loop (bf16 on a CPU without bf16 arithmetic: minutes per cell)")
    ap.add_argument("--levers", action="store_true", help="also measure each engine lever off/on")
    ap.add_argument("--crop", action="store_true", help="also measure shift vs sliding past the window")
    ap.add_argument("--render", metavar="JSON",
                    help="write a saved run's tables again (limits recomputed from its measurements)")
    args = ap.parse_args(argv)
    from bench.engine_report import load_results, render

    if args.render:
        saved = json.loads(Path(args.render).read_text())
        write_results(Path(args.render).with_suffix(""), *render(saved["meta"], load_results(saved)))
        return 0
    # Every peer runs in a process of its own (bench/peers.py); this one only drives them.
    single_threaded_elsewhere()
    concs = [int(c) for c in args.concurrency.split(",")]
    started = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_before": load_avg()}
    results = [
        run_shape(shape, dtype, concs, args)
        for shape in args.shapes.split(",") for dtype in args.dtypes.split(",")
    ]
    meta = {**started, "load_after": load_avg(), "machine": machine(), "args": vars(args)}
    crop = ""
    if args.crop:
        from bench.levers import crop_runs, crop_table

        crop = "\n\nCropping past the window (10.7M, float32):\n\n" + crop_table(crop_runs())
    payload, md = render(meta, results, crop)
    print(md)
    write_results(args.out, payload, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
