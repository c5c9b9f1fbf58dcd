"""Engine settings: how much to batch, queue, cache and crop. Model shape comes from the checkpoint."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CROP_POLICIES = ("shift", "sliding")
# The native step's kernel levels, lowest first (decode.c ns_set_isa). The tile levels run a
# bfloat16 model's linear layers on bf16 dot products, their inputs rounded to bf16 first.
NATIVE_ISAS = ("c", "avx2", "avx512", "avx512bf16", "amx")
TILE_ISAS = ("avx512bf16", "amx")
# Load-time weight quantization: "none", or "int8" (the native step's linear layers in symmetric
# int8, a scale per output feature; int8_weights.py).
QUANTIZE = ("none", "int8")
_ISAS = ("auto", *NATIVE_ISAS)
BACKENDS = ("auto", "native", "torch")


def _check_device(device: str) -> None:
    """Raise ValueError unless `device` names a device this process can use (before any load)."""
    if device in ("auto", "cpu"):
        return
    index = device.removeprefix("cuda:") if device.startswith("cuda:") else None
    if device != "cuda" and not (index is not None and index.isascii() and index.isdigit()):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if not torch.cuda.is_available():
        built = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
        reason = "no CUDA device is visible" if built else "this PyTorch build has no CUDA support"
        raise ValueError(f"device {device!r}: {reason} (torch {torch.__version__}); use cpu or auto")
    count = torch.cuda.device_count()
    if index is not None and int(index) >= count:
        raise ValueError(f"device {device!r}: {count} CUDA device(s) visible, cuda:0 to cuda:{count - 1}")


@dataclass
class EngineConfig:
    device: str = "auto"  # auto|cpu|cuda
    dtype: str = "float32"  # float32|bfloat16|float16 (fp16 GPU only)
    # The KV cache's element type: "auto" (the model's dtype), float32, bfloat16 or float16 (GPU).
    # bfloat16 halves the cache (twice the slots in the same memory) and what a decode step reads
    # attending; keys and values then carry bf16 rounding (the weights keep their dtype).
    kv_cache_dtype: str = "auto"
    max_seqs: int = 16  # KV slots = max concurrent running sequences
    max_queue: int = 64  # waiting requests beyond which generate() raises Overloaded
    # Waiting requests one client (generate's `client`) may have; beyond, Overloaded. None: half
    # of max_queue, so one caller cannot fill the queue and turn everyone else away.
    max_waiting_per_client: int | None = None
    # Prompt tokens prefilled per step (chunked prefill). Every decoding stream waits for the
    # step's prompt chunks: at 32 streams through HTTP (124M bf16, 25-token prompts, alternating
    # runs) 256 -> 96 took inter-token p99 from 133-140 to 59-68 ms and TTFT p50 from 176-205 to
    # 120-163 ms at the same tokens/s, TTFT p99 414-449 -> 552-599 ms (a wave of prompts takes more
    # steps). A long prompt alone takes more, smaller steps: raise it for long-prompt workloads.
    prefill_budget: int = 96
    # Prompt tokens per step when no sequence is decoding (still cut into prefill_budget-sized
    # chunks): nobody's next token waits on such a step, so a burst of prompts is prefilled in one
    # forward, not several (through HTTP at 32 streams, 2048 and 256 measured alike).
    idle_prefill_budget: int = 2048
    # The idle budget also applies while prompts outnumber decoding rows by this ratio (TGI's
    # waiting_served_ratio, its default): a wave of requests arriving together is prefilled in one
    # forward instead of being interleaved in prefill_budget-sized chunks with the decode steps of
    # its first few members, which made the wave's last first token (TTFT p99) wait for those
    # steps and those members' next tokens wait for the chunks (inter-token p99).
    waiting_served_ratio: float = 1.2
    crop_policy: str = "shift"  # shift (amortized, default) | sliding (exactly nanoGPT)
    shift_keep: int | None = None  # tokens kept on a context shift (default: window // 2)
    reject_long_prompts: bool = False  # True: PromptTooLong instead of cropping
    # Context window per sequence (<= the model's block_size; None = block_size). The KV cache is
    # max_seqs x max_context tokens, so this bounds its memory for long-context models.
    max_context: int | None = None
    deterministic: bool = False  # every row computed alone: bit-identical alone vs batched
    # Reuse the KV cache a finished sequence leaves in its slot for a prompt that starts with the
    # same tokens (prefix_cache.py): a chat turn prefills only what is new. Off in deterministic
    # mode on a backend that is not batch-invariant (the torch one).
    prefix_cache: bool = True
    # CPU threads the engine thread may use (None: OMP_NUM_THREADS, else every CPU this process
    # may run on). Other threads stay single-threaded (see threads.py).
    cpu_threads: int | None = None
    compile: bool = False  # torch.compile the decode step (warm-up compiles it)
    # CPU: run linear layers through oneDNN with weights reordered once (see packed_linear.py),
    # where torch runs the forwards (the native step off or unavailable).
    packed_linear: bool = True
    # Which backend computes (backends/factory.py): "auto" (native where it can run: a CPU, a
    # float32 or bfloat16 model, the library built; else torch), "native" (an error where it
    # cannot run) or "torch" (torch's kernels, any device).
    backend: str = "auto"
    # The native step's kernels, at most this level: "auto" (the best the CPU has) or one of c,
    # avx2, avx512, avx512bf16, amx (NATIVE_ISAS). Up to avx512 a bfloat16 model keeps its linear
    # layers' inputs in float32 (the same results on any x86 CPU); avx512bf16 and amx round them
    # to bf16 (bf16 dot products: AMD Zen 4/5 and Intel Cooper Lake, or Intel's AMX).
    native_isa: str = "auto"
    # The linear layers' weights as loaded ("none") or quantized to int8 ("int8": the native
    # backend's int8 kernels; embeddings, norms and the KV cache keep `dtype`). CPU only.
    quantize: str = "none"
    # A float32 model's output layer on the native backend, screened in bf16 where a step's rows all
    # read only their k largest logits (greedy picks, top-k draws) and the CPU has AVX512-BF16: the
    # same tokens and the same k largest logits, bit for bit (native/head_screen.inc). Costs a
    # row-major float32 and a bf16 copy of the output layer's weights.
    screen_head: bool = True

    def client_queue_share(self) -> int:
        """Waiting requests one client may have (max_waiting_per_client, default half the queue)."""
        if self.max_waiting_per_client is not None:
            return self.max_waiting_per_client
        return max(1, self.max_queue // 2)

    def __post_init__(self) -> None:
        _check_device(self.device)
        if self.native_isa not in _ISAS:
            raise ValueError(f"native_isa must be one of {', '.join(_ISAS)}, got {self.native_isa!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.dtype == "float16" and self.resolved_device() == "cpu":
            raise ValueError("dtype float16 is only supported on a GPU; use bfloat16 or float32 on CPU")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in _DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be auto or one of {', '.join(_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype == "float16" and self.resolved_device() == "cpu":
            raise ValueError("kv_cache_dtype float16 is only supported on a GPU; use bfloat16 on CPU")
        for name in ("max_seqs", "max_queue", "prefill_budget", "idle_prefill_budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.waiting_served_ratio > 0:
            raise ValueError(f"waiting_served_ratio must be positive, got {self.waiting_served_ratio!r}")
        if self.crop_policy not in CROP_POLICIES:
            raise ValueError(f"crop_policy must be shift or sliding, got {self.crop_policy!r}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {self.max_context!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be a positive integer, got {self.cpu_threads!r}")
        if self.max_waiting_per_client is not None and self.max_waiting_per_client < 1:
            raise ValueError(
                f"max_waiting_per_client must be a positive integer, got {self.max_waiting_per_client!r}"
            )
        if self.shift_keep is not None and self.shift_keep < 1:
            raise ValueError(f"shift_keep must be a positive integer, got {self.shift_keep!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {self.quantize!r}")
        if self.quantize == "int8" and self.backend == "torch":
            raise ValueError("quantize int8 runs on the native backend only, not backend torch")
        if self.quantize == "int8" and self.resolved_device() != "cpu":
            raise ValueError("quantize int8 runs on the native CPU backend only; use device cpu")

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.kv_cache_dtype == "auto" else _DTYPES[self.kv_cache_dtype]

    def window_for(self, block_size: int) -> int:
        return min(block_size, self.max_context or block_size)

    def keep_tokens(self, window: int) -> int:
        """Tokens a context shift keeps: shift_keep clamped to the window (at least 1)."""
        keep = self.shift_keep if self.shift_keep is not None else window // 2
        return max(1, min(keep, window))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
