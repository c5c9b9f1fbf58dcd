"""The llama.cpp peer of bench/engine_throughput.py without llama-cpp-python: llama.cpp's own
`llama-batched-bench` (built by bench/llama_cpp_build.py) on the GGUF its convert_hf_to_gguf.py
makes of the exported weights (bench/gguf_convert.py), GPT-2 and Llama shapes alike.

How its measurement maps onto the other peers' (`Run`: `conc` sequences, prompt and generation,
timed end to end): with `-npp P -ntg G -npl B` it clears the KV cache, decodes the B prompts of P
tokens in one batch (logits for each prompt's last token only, as the engine, HF generate and the
llama-cpp-python peer compute them) - that is T_PP - then G batched decode steps of one token per
sequence - T_TG - and reports T = T_PP + T_TG. The other peers' first generated token comes out of
the prompt forward, so `new` tokens take the prompt forward and new - 1 steps: G = new - 1, and
the run is B x new tokens in T seconds. Its median step is T_TG / G (one timed span, not a median
of steps). Two differences, both in llama.cpp's favour and small at these sizes: its tokens are
random ids rather than drawn from the logits (no argmax over the vocabulary per sequence and step),
and its own warm-up (one 16-token decode) precedes every run, as the others' warm-ups do.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.throughput_runs import Run

PEER = "llama.cpp"
_warned: set[str] = set()


def batched_bench_args(binary: Path, gguf: Path, prompt_tokens: int, new: int, concs: list[int],
                       threads: int) -> list[str]:
    ctx = max(concs) * (prompt_tokens + new + 8)  # every sequence's prompt and tokens fit
    batch = str(max(512, ctx))  # every prompt in one batch, as the llama-cpp-python peer sets it
    return [str(binary), "-m", str(gguf), "-c", str(ctx), "-b", batch, "-ub", batch,
            "-npp", str(prompt_tokens), "-ntg", str(max(1, new - 1)),
            "-npl", ",".join(str(c) for c in concs), "-t", str(threads), "-tb", str(threads),
            "--output-format", "jsonl"]


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    """llama-batched-bench --output-format jsonl: one JSON object per (pp, tg, pl) run; every other
    line (llama.cpp's load log on the same stream) is skipped."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            rows.append(json.loads(line))
    return rows


def parse_markdown(text: str) -> list[dict[str, Any]]:
    """The default table (`|    PP |     TG |    B |   N_KV |   T_PP s | ...`) as the same records."""
    keys = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(keys) or not cells[0].isdigit():
            continue  # the header, the rule and the log
        values = zip(keys, cells, strict=True)
        rows.append({k: (int(v) if i < 4 else float(v)) for i, (k, v) in enumerate(values)})
    return rows


def to_run(row: dict[str, Any], new: int) -> Run:
    """One batched-bench record as the engine benchmark's run: pl sequences x `new` tokens in T s."""
    conc = int(row["pl"])
    steps = max(1, int(row["tg"]))
    return Run(PEER, conc, conc * new, float(row["t"]), 1e3 * float(row["t_tg"]) / steps,
               note="llama-batched-bench")


# Runs of llama-batched-bench per measurement before one that ended well without its result is a
# failure. It prints its result through llama.cpp's asynchronous logger, whose writer thread the
# process does not wait for at exit (common/log.cpp leaks the logger on purpose, and says its last
# lines may be lost): at 10.7M bf16 about one run in three ended with status 0 and no result line.
ATTEMPTS = 3


def bench_batched(binary: Path, gguf: Path, conc: int, prompt_tokens: int, new: int, threads: int,
                  attempts: int = ATTEMPTS) -> Run:
    """One run of `conc` sequences; run again (up to `attempts` in all) while it ends with status 0
    but without its result line. A failing status is a failure at once."""
    args = batched_bench_args(binary, gguf, prompt_tokens, new, [conc], threads)
    for _ in range(max(1, attempts)):
        done = subprocess.run(args, capture_output=True, text=True, timeout=1800, check=False)
        output = done.stdout + done.stderr
        rows = parse_jsonl(output)
        if done.returncode == 0 and len(rows) == 1:
            return to_run(rows[0], new)
        if done.returncode != 0 or rows:
            break  # a real failure, or more results than one run gives: no point running again
    tail = "\n".join(output.splitlines()[-15:])
    raise RuntimeError(f"llama-batched-bench gave no result ({done.returncode}, {attempts} runs at most):"
                       f"\n{tail}")


def bench_llama_batched(ckpt: Any, conc: int, prompt_tokens: int, new: int, threads: int,
                        state: dict[str, Any]) -> Run | None:
    """The peer's run in bench/peers.py's worker (`state` keeps the GGUF for the process's life);
    None, said once, when llama.cpp is not built: building takes 10+ minutes, so it is asked
    for (`make llama-cpp`), never started from here."""
    from bench.gguf_convert import export_and_convert
    from bench.llama_cpp_build import locate

    lc = locate()
    if not lc.built():
        why = f"neither llama-cpp-python nor a built llama.cpp ({lc.batched_bench}): run `make llama-cpp`"
        if why not in _warned:
            print(f"    llama.cpp peer skipped: {why}", flush=True)
            _warned.add(why)
        return None
    if "gguf" not in state:
        state["gguf_dir"] = tempfile.TemporaryDirectory(prefix="nanoserve-bench-gguf-")
        out = Path(state["gguf_dir"].name)
        state["gguf"] = export_and_convert(ckpt, out, [ckpt.dtype], lc)[ckpt.dtype]
    return bench_batched(lc.batched_bench, state["gguf"], conc, prompt_tokens, new, threads)
