"""The parsers of the llama.cpp benchmarks: llama-batched-bench's output as the engine benchmark's
run, a streamed /v1/completions as bench/load.py reads it, and the serving figures compared."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.gguf_convert import write_vocab
from bench.llama_batched import batched_bench_args, parse_jsonl, parse_markdown, to_run
from bench.llama_server import LlamaServerConfig
from bench.load import LoadConfig, RequestResult
from bench.load_config import build_request
from bench.load_http import _read_stream
from bench.server_vs_llama_report import compare, figures, table

# llama-batched-bench's output, both formats, with llama.cpp's log on the same stream.
LOG = "llama_model_loader: loaded meta data with 24 key-value pairs\nmain: n_kv_max = 2560, n_batch = 2560\n"
JSONL = LOG + (
    '{"n_kv_max": 2560, "n_batch": 2560, "n_ubatch": 2560, "flash_attn": -1, "is_pp_shared": 0, '
    '"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 15, "pl": 32, '
    '"n_kv": 992, "t_pp": 0.800000, "speed_pp": 640.000000, "t_tg": 1.500000, "speed_tg": 320.000000, '
    '"t": 2.300000, "speed": 431.304348}\n'
    "\nllama_perf_context_print:        load time =     123.45 ms\n"
)
MARKDOWN = LOG + """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |     15 |    1 |     31 |    0.020 |   800.00 |    0.150 |   100.00 |    0.170 |   182.35 |
|    16 |     15 |   32 |    992 |    0.800 |   640.00 |    1.500 |   320.00 |    2.300 |   431.30 |
"""


def test_batched_bench_jsonl_is_read_past_the_log_and_maps_to_a_run() -> None:
    rows = parse_jsonl(JSONL)
    assert len(rows) == 1
    run = to_run(rows[0], new=16)
    # 32 sequences x 16 tokens: the prompt forward gives the first, 15 steps the rest
    assert (run.peer, run.concurrency, run.tokens, run.seconds) == ("llama.cpp", 32, 512, 2.3)
    assert run.step_ms == pytest.approx(100.0)  # T_TG / TG
    assert run.tps == pytest.approx(512 / 2.3)


def test_batched_bench_markdown_table_gives_the_same_records() -> None:
    rows = parse_markdown(MARKDOWN)
    assert [r["pl"] for r in rows] == [1, 32]
    assert rows[1] == {k: v for k, v in parse_jsonl(JSONL)[0].items() if k in rows[1]} | {"speed": 431.30}
    assert parse_markdown(LOG) == []


def test_batched_bench_is_asked_for_new_minus_one_steps_in_a_context_that_fits() -> None:
    args = batched_bench_args(Path("/bin/bb"), Path("m.gguf"), prompt_tokens=16, new=32, concs=[1, 64],
                              threads=2)
    opt = dict(zip(args[1::2], args[2::2], strict=False))
    assert (opt["-npp"], opt["-ntg"], opt["-npl"], opt["-t"], opt["--output-format"]) == (
        "16", "31", "1,64", "2", "jsonl")
    assert int(opt["-c"]) >= 64 * (16 + 32)


async def _lines(text: str) -> AsyncIterator[str]:
    for line in text.split("\n"):
        yield line


def _chunk(text: str, finish: str | None = None, usage: dict[str, int] | None = None) -> str:
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
    body: dict[str, object] = {"choices": [choice], "object": "text_completion"}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


def _read(stream: str) -> RequestResult:
    result = RequestResult(index=0)
    config = LoadConfig(url="http://127.0.0.1:1", route="completions", requests=1)
    asyncio.run(_read_stream(_lines(stream), result, config, 0.0))
    return result


def test_a_streamed_completion_counts_tokens_and_takes_the_servers_count() -> None:
    usage = {"completion_tokens": 3, "prompt_tokens": 25, "total_tokens": 28}
    r = _read(_chunk("w1") + _chunk("w2") + _chunk("w3") + _chunk("", "length", usage) + "data: [DONE]\n\n")
    assert (r.kind, r.tokens, r.details_tokens, r.finish_reason, r.text) == ("ok", 3, 3, "length", "w1w2w3")
    assert r.ttft_s is not None and len(r.itl_s) == 2


def test_a_completion_stream_without_done_is_cut() -> None:
    assert _read(_chunk("w1") + _chunk("", "length")).kind == "cut"


def test_completions_requests_send_token_ids_and_top_k() -> None:
    config = LoadConfig(url="http://x", route="completions", prompt_ids=[[1, 2], [3, 4]], top_k=40, seed=5,
                        max_new_tokens=64, extra={"min_p": 0.0})
    path, body = build_request(config, 3)
    assert path == "/v1/completions"
    sent = tuple(body[k] for k in ("prompt", "top_k", "seed", "max_tokens", "stream", "min_p"))
    assert sent == ([3, 4], 40, 8, 64, True, 0.0)


def _summary(tps: float, ttft: float, outcomes: dict[str, int] | None = None) -> dict[str, object]:
    return {"outcomes": outcomes or {"ok": 8}, "malformed_streams": 0, "tokens_per_s": tps,
            "tokens_generated": 512, "requests": 8, "ttft_s": {"p50": ttft, "p90": ttft, "p99": 2 * ttft},
            "itl_s": {"p50": 0.01, "p90": 0.02, "p99": 0.03}}


def test_figures_refuse_a_run_that_lost_requests() -> None:
    assert figures(_summary(100.0, 0.02))["ttft_p99"] == 0.04
    with pytest.raises(RuntimeError, match="http_503"):
        figures(_summary(100.0, 0.02, {"ok": 7, "http_503": 1}))


def test_compare_gives_medians_ranges_and_ratios_round_by_round() -> None:
    rounds = {"nanoserve": [figures(_summary(1400.0, 0.2)), figures(_summary(1200.0, 0.1))],
              "llama-server": [figures(_summary(700.0, 0.1)), figures(_summary(600.0, 0.1))]}
    cells = compare(rounds)
    tps = cells["tokens_per_s"]
    assert tps["nanoserve"] == {"median": 1300.0, "min": 1200.0, "max": 1400.0}
    assert tps["ratio"] == pytest.approx(2.0)
    assert tps["round_ratios"] == pytest.approx([2.0, 2.0])
    assert cells["ttft_p50"]["ratio"] == pytest.approx(1.5)
    assert "| tokens/s | 1,300 (1,200-1,400) | 650 (600-700) | 2.00 (higher is better) |" in table(cells)


def test_a_server_measured_alone_is_reported_without_a_ratio() -> None:
    cells = compare({"nanoserve": [], "llama-server": [figures(_summary(179.0, 0.01))]})
    assert "ratio" not in cells["tokens_per_s"]
    assert "| tokens/s | not available | 179 (179-179) | - |" in table(cells)


def test_llama_server_gets_one_slot_per_stream_and_no_web_ui_where_it_has_the_switch() -> None:
    config = LlamaServerConfig(slots=32, slot_context=256, threads=2)
    args = config.args(Path("/bin/llama-server"), Path("m.gguf"), 8080, help_text="--no-webui ...")

    def opt(name: str) -> str:
        return args[args.index(name) + 1]

    assert (opt("--host"), opt("--parallel"), opt("-c"), opt("-t"), opt("-tb")) == (
        "127.0.0.1", "32", "8192", "2", "2")
    assert "--cont-batching" in args and "--no-webui" in args
    assert "--no-webui" not in config.args(Path("s"), Path("m"), 1, help_text="")


def test_the_vocabulary_for_gguf_is_padded_and_has_no_repeated_piece(tmp_path: Path) -> None:
    pieces = ["a", "b", "a", "<eos>"]
    tok = SimpleNamespace(vocab_size=4, eos_id=3, id_to_piece=pieces.__getitem__, is_special=lambda i: i == 3)
    ckpt = SimpleNamespace(tokenizer=tok, config=SimpleNamespace(vocab_size=6))
    v = json.loads(write_vocab(ckpt, tmp_path).read_text())
    assert v["pieces"] == ["a", "b", "<dup2>", "<eos>", "<pad0>", "<pad1>"]
    assert (v["special"], v["eos"]) == ([3], 3)


def _fake_batched_bench(tmp_path: Path, outputs: list[tuple[int, str]]) -> Path:
    """An executable standing in for llama-batched-bench: its n-th run prints outputs[n]'s text and
    exits with its status (a counter file between runs)."""
    for i, (_, text) in enumerate(outputs):
        (tmp_path / f"out{i}").write_text(text)
    statuses = " ".join(str(status) for status, _ in outputs)
    script = tmp_path / "llama-batched-bench"
    script.write_text(
        "#!/bin/sh\n"
        f'n=$(cat "{tmp_path}/count" 2>/dev/null || echo 0)\n'
        f'echo $((n + 1)) > "{tmp_path}/count"\n'
        f'cat "{tmp_path}/out$n"\n'
        f"set -- {statuses}\n"
        'shift "$n"\n'
        'exit "$1"\n'
    )
    script.chmod(0o755)
    return script


def test_batched_bench_runs_again_when_its_result_line_was_lost(tmp_path: Path) -> None:
    # llama.cpp's asynchronous logger can drop the result line at exit with status 0.
    from bench.llama_batched import bench_batched

    binary = _fake_batched_bench(tmp_path, [(0, LOG), (0, LOG), (0, JSONL)])
    run = bench_batched(binary, tmp_path / "model.gguf", 32, 16, 16, 2)
    assert (tmp_path / "count").read_text().strip() == "3"
    assert (run.concurrency, run.tokens, run.seconds) == (32, 32 * 16, 2.3)


def test_batched_bench_gives_up_after_its_attempts_and_at_once_on_a_failing_status(tmp_path: Path) -> None:
    from bench.llama_batched import bench_batched

    (tmp_path / "lost").mkdir()
    lost = _fake_batched_bench(tmp_path / "lost", [(0, LOG)] * 4)
    with pytest.raises(RuntimeError, match=r"no result \(0, 3 runs at most\)"):
        bench_batched(lost, tmp_path / "model.gguf", 8, 16, 16, 2)
    assert (tmp_path / "lost" / "count").read_text().strip() == "3"

    (tmp_path / "crash").mkdir()
    crash = _fake_batched_bench(tmp_path / "crash", [(134, LOG + "GGML_ASSERT failed\n"), (0, JSONL)])
    with pytest.raises(RuntimeError, match="GGML_ASSERT failed"):
        bench_batched(crash, tmp_path / "model.gguf", 8, 16, 16, 2)
    assert (tmp_path / "crash" / "count").read_text().strip() == "1"
