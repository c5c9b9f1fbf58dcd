"""Engine settings: how much to batch, queue, cache and crop. Model shape comes from the checkpoint.

Each field is declared once, here: its default, and in its metadata a `Rule` (the help text, the
allowed choices or bounds). `EngineConfig` checks every value against its rule (`check_value`);
the server builds its `--flags` and `NANOSERVE_*` variables from the same fields and rules
(nanoserve/server/settings.py), so both accept exactly the same values.
"""

from __future__ import annotations

import re
import types
from dataclasses import asdict, dataclass, field, fields
from functools import cache
from typing import Any, get_type_hints

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
DEVICE_FORM = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


@dataclass(frozen=True)
class Rule:
    """What a field accepts, besides its type, and what it is for (the `--help` text)."""

    help: str
    choices: tuple[str, ...] = ()
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    form: re.Pattern[str] | None = None  # the whole value must match
    form_help: str = ""  # what `form` accepts, in words

    def problem(self, value: Any) -> str | None:
        """Why `value` breaks this rule ("must be ..."), or None."""
        if value is None:
            return None
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        if self.form is not None and not self.form.fullmatch(value):
            return f"must be {self.form_help}"
        if self.ge is not None and value < self.ge:
            return f"must be at least {self.ge:g}"
        if self.gt is not None and not value > self.gt:
            return f"must be more than {self.gt:g}"
        if self.le is not None and value > self.le:
            return f"must be at most {self.le:g}"
        return None


class ConfigError(ValueError):
    """A value an engine field does not accept: `field` names it, `reason` says what it must be."""

    def __init__(self, field_name: str, reason: str, value: Any) -> None:
        super().__init__(f"{field_name} {reason}, got {value!r}")
        self.field = field_name
        self.reason = reason


def setting(default: Any, help: str, **rule: Any) -> Any:
    """A field with its default and its `Rule` (in the field's metadata, under "rule")."""
    return field(default=default, metadata={"rule": Rule(help, **rule)})


def _check_device(device: str) -> None:
    """Raise ValueError unless `device` (auto, cpu, cuda or cuda:N) names a device this process
    can use (before any load)."""
    if device in ("auto", "cpu"):
        return
    index = device.removeprefix("cuda:") if device.startswith("cuda:") else None
    if not torch.cuda.is_available():
        built = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
        reason = "no CUDA device is visible" if built else "this PyTorch build has no CUDA support"
        raise ValueError(f"device {device!r}: {reason} (torch {torch.__version__}); use cpu or auto")
    count = torch.cuda.device_count()
    if index is not None and int(index) >= count:
        raise ValueError(f"device {device!r}: {count} CUDA device(s) visible, cuda:0 to cuda:{count - 1}")


@dataclass
class EngineConfig:
    device: str = setting("auto", "auto|cpu|cuda[:N]", form=DEVICE_FORM,
                          form_help="auto, cpu, cuda or cuda:N")
    dtype: str = setting("float32", "float32|bfloat16|float16 (float16 on a GPU only).",
                         choices=tuple(_DTYPES))
    # The KV cache's element type: "auto" (the model's dtype), float32, bfloat16 or float16 (GPU).
    # bfloat16 halves the cache (twice the slots in the same memory) and what a decode step reads
    # attending; keys and values then carry bf16 rounding (the weights keep their dtype).
    kv_cache_dtype: str = setting(
        "auto", "KV cache element type: auto (the model's dtype), float32, bfloat16 (half the memory; "
        "keys and values rounded to bf16), float16 (GPU only).", choices=("auto", *_DTYPES))
    max_seqs: int = setting(16, "KV slots = max concurrent sequences.", ge=1, le=4096)
    max_queue: int = setting(64, "Waiting requests beyond which new ones get 429 (generate() raises "
                             "Overloaded).", ge=1)
    # Waiting requests one client (generate's `client`) may have; beyond, Overloaded. None: half
    # of max_queue, so one caller cannot fill the queue and turn everyone else away.
    max_waiting_per_client: int | None = setting(
        None, "Waiting requests one client may have; beyond, 429 (default: half of max_queue). A client "
        "is its API key when keys are set, else its address (or client_id_header).", ge=1)
    # A group (n / best_of, one slot a choice) that does not fit lets smaller requests pass it
    # (admission.py); past this wait it is passed no more and takes the slots it lacks by
    # preemption. Streams of a few hundred tokens end within a few seconds on a CPU, so most
    # groups fit by turnover well within it, and the preemptions (a re-prefill each) are left to
    # the streams that would hold their slots for minutes.
    max_group_wait_s: float = setting(
        10.0, "Seconds a request for several choices (n, best_of) may be passed by smaller requests "
        "while its slots are taken; then it goes first, and the newest sequences of the clients "
        "holding the most slots step aside for it.", ge=0)
    # Prompt tokens prefilled per step (chunked prefill). Every decoding stream waits for the
    # step's prompt chunks, so a smaller budget steadies inter-token latency at the cost of the
    # last first token of a wave (256 -> 96 halved the 32-stream inter-token p99: docs/performance.md,
    # levers). A long prompt alone takes more, smaller steps: raise it for long-prompt workloads.
    # While rows decode, the chunks are also held to what half a decode-only step's time buys
    # (scheduler.py, step_cost.py): where a chunk costs more than a decode step (a CPU), a long
    # prompt's chunks join one step in several, and a stream stays within about 1.5-2x.
    prefill_budget: int = setting(
        96, "Prompt tokens prefilled per engine step, and the chunk a prompt is cut into (smaller: "
        "steadier streams; a long prompt takes more steps). While sequences decode, a step also "
        "carries no more prompt tokens on average than half a decode step's time buys.", ge=1)
    # Prompt tokens per step when no sequence is decoding (still cut into prefill_budget-sized
    # chunks): nobody's next token waits on such a step, so a burst of prompts is prefilled in one
    # forward, not several (through HTTP at 32 streams, 2048 and 256 measured alike).
    idle_prefill_budget: int = setting(
        2048, "Prompt tokens prefilled per engine step while no sequence is decoding, and for a "
        "wave's prompts that complete in the step (waiting_served_ratio).", ge=1)
    # The idle budget also applies while prompts outnumber decoding rows by this ratio (TGI's
    # waiting_served_ratio, its default), to the chunks that complete their prompt: a wave of
    # requests arriving together is prefilled in one forward instead of being interleaved in
    # prefill_budget-sized chunks with the decode steps of its first few members, which made the
    # wave's last first token (TTFT p99) wait for those steps and those members' next tokens wait
    # for the chunks (inter-token p99). Long prompts' other chunks keep the ordinary budget: two
    # clients' long prompts outnumber one stream as well, and made each of its steps carry both.
    waiting_served_ratio: float = setting(
        1.2, "The idle prefill budget also applies while requests prefilling outnumber those decoding "
        "by this ratio (TGI's option), to the prompts that complete in the step: a wave of prompts "
        "is prefilled in one step.", gt=0)
    # shift (amortized, default) | sliding (exactly nanoGPT)
    crop_policy: str = setting("shift", "Past the window: shift (amortized) or sliding (nanoGPT's).",
                               choices=CROP_POLICIES)
    shift_keep: int | None = setting(None, "Tokens kept on a context shift (default: half the window).",
                                     ge=1)
    # True: PromptTooLong instead of cropping
    reject_long_prompts: bool = setting(False, "422 instead of cropping over-long prompts.")
    # Context window per sequence (<= the model's block_size; None = block_size). The KV cache is
    # max_seqs x max_context tokens, so this bounds its memory for long-context models.
    max_context: int | None = setting(
        None, "Tokens per sequence, prompt and output (default: the model's window); the KV cache "
        "holds max_seqs x max_context tokens.", ge=2)
    # Every row computed alone: bit-identical alone vs batched.
    deterministic: bool = setting(False, "Same tokens alone or batched (slower).")
    # Reuse the KV cache a finished sequence leaves in its slot for a prompt that starts with the
    # same tokens (prefix_cache.py): a chat turn prefills only what is new. Off in deterministic
    # mode on a backend that is not batch-invariant (the torch one).
    prefix_cache: bool = setting(
        True, "Reuse the KV cache a finished request leaves in its slot for a prompt that starts with "
        "the same tokens (a chat turn prefills only what is new).")
    # Reused only within a tenant by default (prefix_cache.py): a hit is faster than a miss, so
    # a cache shared across clients tells one of them what prompts another sent.
    prefix_cache_shared: bool = setting(
        False, "Reuse a cached prompt prefix across clients (API keys, addresses): a shared system "
        "prompt is prefilled once for all, but one client's time to first token then tells whether "
        "another sent a prompt. Off: only within a client, or a request's cache_salt.")
    # CPU threads the engine thread may use (None: OMP_NUM_THREADS, else what the affinity mask and
    # the cgroup's CPU quota leave, see cpu_quota.py). Other threads stay single-threaded (threads.py).
    cpu_threads: int | None = setting(
        None, "CPU threads for the model (default: OMP_NUM_THREADS, else the CPUs the affinity mask "
        "and the cgroup's CPU quota leave the process); the rest of the server stays on one.", ge=1)
    compile: bool = setting(False, "torch.compile the decode step at warm-up.")
    # CUDA only (ignored on a CPU, as /info says): the torch backend's decode step recorded as CUDA
    # graphs at start-up, one per batch and attention-span bucket, and replayed each step
    # (graph_step.py): one launch instead of one per operation.
    cuda_graphs: bool = setting(
        True, "On CUDA: decode steps replayed as CUDA graphs captured at start-up (one per batch and "
        "span bucket); ignored on a CPU.")
    # CUDA only: the KV cache's slots (max_seqs is then ignored) are as many as fit in this fraction
    # of the GPU's memory, less what is in use and the weights and the engine's other buffers
    # (vLLM's --gpu-memory-utilization; memory_plan.fit_slots). None: max_seqs slots.
    gpu_memory_utilization: float | None = setting(
        None, "On CUDA: size the KV cache (its slots, in place of max_seqs) to this fraction of the GPU's "
        "memory, less what is in use and the weights (as vLLM's); default: max_seqs slots.", gt=0, le=1)
    # CPU: run linear layers through oneDNN with weights reordered once (see packed_linear.py),
    # where torch runs the forwards (the native step off or unavailable).
    packed_linear: bool = setting(
        True, "Where torch runs the forwards on a CPU: linear layers through oneDNN with their weights "
        "reordered once.")
    # Which backend computes (backends/factory.py): "auto" (native where it can run: a CPU, a
    # float32 or bfloat16 model, the library built; else torch), "native" (an error where it
    # cannot run) or "torch" (torch's kernels, any device).
    backend: str = setting(
        "auto", "What computes: auto (native where it can run: CPU, float32/bfloat16, library built; "
        "else torch), native (an error where it cannot run), torch (any device).", choices=BACKENDS)
    # The native step's kernels, at most this level: "auto" (the best the CPU has) or one of c,
    # avx2, avx512, avx512bf16, amx (NATIVE_ISAS). Up to avx512 a bfloat16 model keeps its linear
    # layers' inputs in float32 (the same results on any x86 CPU); avx512bf16 and amx round them
    # to bf16 (bf16 dot products: AMD Zen 4/5 and Intel Cooper Lake, or Intel's AMX).
    native_isa: str = setting(
        "auto", "The native step's kernels, at most: auto (the best this CPU has), c, avx2, avx512, "
        "avx512bf16, amx. avx512bf16 and amx round a bfloat16 model's linear inputs to bf16; up to "
        "avx512 they stay float32, the same results on any x86 CPU. With int8 weights (--quantize int8) "
        "amx means AMX-INT8 tiles from 16 rows a product, the same integers as avx512's VNNI.", choices=_ISAS)
    # The linear layers' weights as loaded ("none") or quantized to int8 ("int8": the native
    # backend's int8 kernels; embeddings, norms and the KV cache keep `dtype`). CPU only.
    quantize: str = setting(
        "none", "Linear layers' weights: none (as loaded, in dtype) or int8 (symmetric, a scale per "
        "output feature, on the native CPU backend's int8 kernels; embeddings and KV cache keep dtype).",
        choices=QUANTIZE)
    # A float32 model's output layer on the native backend, screened in bf16 where a step's rows all
    # read only their k largest logits (greedy picks, top-k draws) and the CPU has AVX512-BF16: the
    # same tokens and the same k largest logits, bit for bit (native/head_screen.inc). Costs a
    # row-major float32 and a bf16 copy of the output layer's weights.
    screen_head: bool = setting(
        True, "A float32 model's output layer on the native backend computed in bf16 and only the logits "
        "that could be a greedy or top-k row's k largest again in float32 (CPUs with AVX512-BF16): the "
        "same tokens, bit for bit; holds two more copies of the output layer.")

    def client_queue_share(self) -> int:
        """Waiting requests one client may have (max_waiting_per_client, default half the queue)."""
        if self.max_waiting_per_client is not None:
            return self.max_waiting_per_client
        return max(1, self.max_queue // 2)

    def __post_init__(self) -> None:
        for f in fields(self):
            check_value(f.name, getattr(self, f.name))
        # What one field cannot say alone: the device and the combinations.
        _check_device(self.device)
        if self.dtype == "float16" and self.resolved_device() == "cpu":
            raise ValueError("dtype float16 is only supported on a GPU; use bfloat16 or float32 on CPU")
        if self.kv_cache_dtype == "float16" and self.resolved_device() == "cpu":
            raise ValueError("kv_cache_dtype float16 is only supported on a GPU; use bfloat16 on CPU")
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


@cache
def rules() -> dict[str, tuple[Any, Rule]]:
    """Every EngineConfig field: its type (int | None, ...) and its rule, in declaration order."""
    hints = get_type_hints(EngineConfig)
    return {f.name: (hints[f.name], f.metadata["rule"]) for f in fields(EngineConfig)}


def check_value(name: str, value: Any) -> None:
    """Raise ConfigError unless EngineConfig's field `name` accepts `value` (its type and rule)."""
    kind, rule = rules()[name]
    if not _has_type(kind, value):
        raise ConfigError(name, f"must be {_type_name(kind)}", value)
    reason = rule.problem(value)
    if reason is not None:
        raise ConfigError(name, reason, value)


def _has_type(kind: Any, value: Any) -> bool:
    options = kind.__args__ if isinstance(kind, types.UnionType) else (kind,)
    if value is None:
        return type(None) in options
    if isinstance(value, bool):  # not an int, whatever Python says
        return bool in options
    if isinstance(value, int) and float in options:
        return True
    return isinstance(value, tuple(t for t in options if t is not type(None) and t is not bool))


def _type_name(kind: Any) -> str:
    options = kind.__args__ if isinstance(kind, types.UnionType) else (kind,)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return " or ".join("None" if t is type(None) else names[t] for t in options)
