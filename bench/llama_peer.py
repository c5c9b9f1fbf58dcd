"""The llama.cpp peer for bench/engine_throughput.py: llama-cpp-python on a GGUF conversion of the exported
Hugging Face GPT-2 weights (the same weights every other peer runs).

The conversion mirrors llama.cpp's own GPT-2 converter: HF names -> GGUF names, GPT-2's Conv1D
weights transposed back to (out, in), 1-D tensors (norms, biases) kept in float32. Sequences are
decoded together through llama.cpp's batch API (one sequence id per request, a shared KV cache),
greedy, every sequence generating the same number of tokens, prefill included in the time.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.throughput_runs import Run

if TYPE_CHECKING:
    import torch

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_NAMES = {
    "ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",
}
_warned: set[str] = set()


def _skip(why: str) -> None:
    if why not in _warned:
        print(f"    llama.cpp peer skipped: {why}", flush=True)
        _warned.add(why)


def _gguf_name(hf_name: str) -> str:
    name = hf_name.removeprefix("transformer.")
    fixed = {"wte.weight": "token_embd.weight", "wpe.weight": "position_embd.weight",
             "ln_f.weight": "output_norm.weight", "ln_f.bias": "output_norm.bias"}
    if name in fixed:
        return fixed[name]
    _, layer, rest = name.split(".", 2)  # h.{i}.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_NAMES[module]}.{kind}"


def convert_to_gguf(hf_dir: Path, ckpt: Any, out: Path) -> Path:
    """Write `out` (GGUF, arch gpt2) from an exported HF GPT-2 directory."""
    import gguf
    from safetensors.torch import load_file

    cfg = ckpt.config
    bf16 = ckpt.dtype == "bfloat16"
    w = gguf.GGUFWriter(str(out), "gpt2")
    w.add_context_length(cfg.block_size)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(4 * cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_head_count(cfg.n_head)
    w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    tok = ckpt.tokenizer
    pieces = [tok.id_to_piece(i) for i in range(tok.vocab_size)]
    pieces += [f"<pad{i}>" for i in range(cfg.vocab_size - len(pieces))]
    w.add_tokenizer_model("gpt2")  # ids are fed directly; the vocabulary only has to load
    w.add_token_list(pieces)
    w.add_token_types([gguf.TokenType.CONTROL if tok.is_special(i) else gguf.TokenType.NORMAL
                       for i in range(len(pieces))])
    w.add_token_merges([f"{pieces[0]} {pieces[1]}"])
    if tok.eos_id is not None:
        w.add_eos_token_id(tok.eos_id)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    for hf_name, t in tensors.items():
        if hf_name.endswith(_CONV1D):
            t = t.t()  # Conv1D (in, out) -> (out, in)
        _add(w, _gguf_name(hf_name), t, bf16)
        if hf_name.endswith("wte.weight"):
            _add(w, "output.weight", t, bf16)  # the tied output projection, stored explicitly
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _gguf_for(hf_dir: Path, ckpt: Any) -> Path | None:
    """llama.cpp's own convert_hf_to_gguf.py when llama.cpp is built (any family); else this
    module's GPT-2 converter (GPT-2 only)."""
    from bench.gguf_convert import export_and_convert
    from bench.llama_cpp_build import locate

    lc = locate()
    if lc.built():
        return export_and_convert(ckpt, hf_dir, [ckpt.dtype], lc, hf_dir=hf_dir)[ckpt.dtype]
    if ckpt.config.family != "gpt2":
        _skip(f"a {ckpt.config.family} model needs llama.cpp's converter: run `make llama-cpp`")
        return None
    return convert_to_gguf(hf_dir, ckpt, hf_dir / f"model-{ckpt.dtype}.gguf")


def _add(w: Any, name: str, t: torch.Tensor, bf16: bool) -> None:
    import gguf
    import torch  # here, not at the top: a process that only runs llama.cpp (bench/memory.py) has no torch

    t = t.contiguous()
    if bf16 and t.dim() == 2:
        raw = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        w.add_tensor(name, raw, raw_shape=tuple(t.shape), raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        w.add_tensor(name, t.float().numpy())


def _quiet_log(level: int, text: bytes, _user: Any) -> None:
    if level == 3:  # GGML_LOG_LEVEL_ERROR
        print(f"    llama.cpp: {text.decode(errors='replace').rstrip()}", flush=True)


class LlamaRunner:
    def __init__(self, gguf_path: Path, n_seq: int, n_ctx_per_seq: int, threads: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        # llama.cpp logs every tensor and graph input at load (thousands of lines per peer): keep
        # its errors only. The callback must outlive the context, so it stays on the instance.
        self._log = lc.llama_log_callback(_quiet_log)
        lc.llama_log_set(self._log, ctypes.c_void_p(0))
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        load = getattr(lc, "llama_model_load_from_file", None) or lc.llama_load_model_from_file
        self.model = load(str(gguf_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_seq * n_ctx_per_seq
        cparams.n_batch = max(512, n_seq * n_ctx_per_seq)
        cparams.n_ubatch = cparams.n_batch
        cparams.n_seq_max = n_seq
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        new_ctx = getattr(lc, "llama_init_from_model", None) or lc.llama_new_context_with_model
        self.ctx = new_ctx(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        vocab = lc.llama_model_get_vocab(self.model) if hasattr(lc, "llama_model_get_vocab") else None
        self.n_vocab = lc.llama_vocab_n_tokens(vocab) if vocab is not None else lc.llama_n_vocab(self.model)
        self.batch = lc.llama_batch_init(cparams.n_batch, 0, n_seq)

    def decode(self, rows: list[tuple[int, list[int], int]]) -> list[int]:
        """rows: (seq_id, tokens, start position). Returns each row's greedy next token."""
        b, i, last = self.batch, 0, []
        for seq, toks, start in rows:
            for j, t in enumerate(toks):
                b.token[i], b.pos[i], b.n_seq_id[i] = t, start + j, 1
                b.seq_id[i][0] = seq
                b.logits[i] = j == len(toks) - 1
                i += 1
            last.append(i - 1)
        b.n_tokens = i
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        out = []
        for idx in last:
            ptr = ctypes.cast(self.lc.llama_get_logits_ith(self.ctx, idx), ctypes.POINTER(ctypes.c_float))
            logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
            out.append(int(logits.argmax()))
        return out

    def clear(self) -> None:
        lc = self.lc
        if hasattr(lc, "llama_get_memory"):
            lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        else:
            lc.llama_kv_cache_clear(self.ctx)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        free_model = getattr(self.lc, "llama_model_free", None) or self.lc.llama_free_model
        free_model(self.model)


_gguf_cache: dict[tuple[str, str], Path] = {}


def llama_cpp_python() -> bool:
    """Whether llama-cpp-python is importable; without it bench/llama_batched.py is the peer."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def bench_llama(
    hf_dir: Path, ckpt: Any, conc: int, prompts: list[list[int]], new: int, threads: int
) -> Run | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        _skip("llama-cpp-python is not installed (pip install llama-cpp-python gguf; builds llama.cpp)")
        return None
    try:
        import gguf  # noqa: F401
    except ImportError:
        _skip("the gguf package is not installed (pip install gguf)")
        return None

    key = (ckpt.name, ckpt.dtype)
    if key not in _gguf_cache:
        gguf_path = _gguf_for(hf_dir, ckpt)
        if gguf_path is None:
            return None
        _gguf_cache[key] = gguf_path
    plen = len(prompts[0])
    runner = LlamaRunner(_gguf_cache[key], conc, plen + new + 8, threads)
    try:
        runner.decode([(s, prompts[s][:2], 0) for s in range(conc)])  # warm-up
        runner.clear()
        t0 = time.perf_counter()
        nxt = runner.decode([(s, prompts[s], 0) for s in range(conc)])
        steps = []
        for k in range(1, new):
            ts = time.perf_counter()
            nxt = runner.decode([(s, [nxt[s]], plen + k - 1) for s in range(conc)])
            steps.append(time.perf_counter() - ts)
        elapsed = time.perf_counter() - t0
    finally:
        runner.close()
    steps.sort()
    return Run("llama.cpp", conc, conc * new, elapsed, 1e3 * steps[len(steps) // 2])
