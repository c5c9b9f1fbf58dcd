"""Server settings: one typed object read from flags and `NANOSERVE_*` environment variables.

Nothing here runs at import: `Settings()` is built by `nanoserve serve` (flags override the
environment) or by a test, and handed to `create_app(settings)`. Model hyperparameters are not
settings; they come from the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# The repository root when installed editable (`make serve`), so the default checkpoint is found
# whatever the working directory is.
PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CHECKPOINT = PROJECT_ROOT / "checkpoints" / "shakespeare-char"

LogLevel = Literal["debug", "info", "warning", "error", "critical"]


def _split_commas(value: object) -> object:
    # `NANOSERVE_API_KEYS=a,b` reads better than a JSON list in an environment file.
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class Settings(BaseSettings):
    """Everything an operator can set. Every field is `--flag` or `NANOSERVE_FIELD`."""

    model_config = SettingsConfigDict(env_prefix="NANOSERVE_", extra="ignore", validate_default=True)

    # What to serve, where.
    checkpoint: Path = Field(default=DEFAULT_CHECKPOINT, description="Checkpoint directory to serve.")
    device: str = Field(
        default="auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$", description="auto|cpu|cuda[:N]"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="float32|bfloat16|float16 (float16 on a GPU only)."
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="KV cache element type: auto (the model's dtype), float32, bfloat16 (half the "
        "memory; keys and values rounded to bf16), float16 (GPU only).",
    )
    native_isa: Literal["auto", "c", "avx2", "avx512", "avx512bf16", "amx"] = Field(
        default="auto",
        description="The native step's kernels, at most: auto (the best this CPU has), c, avx2, avx512, "
        "avx512bf16, amx. avx512bf16 and amx round a bfloat16 model's linear inputs to bf16; up to "
        "avx512 they stay float32, the same results on any x86 CPU.",
    )
    quantize: Literal["none", "int8"] = Field(
        default="none",
        description="Linear layers' weights: none (as loaded, in dtype) or int8 (symmetric, a scale per "
        "output feature, on the native CPU backend's int8 kernels; embeddings and KV cache keep dtype).",
    )
    screen_head: bool = Field(
        default=True,
        description="A float32 model's output layer on the native backend computed in bf16 and only the "
        "logits that could be a greedy or top-k row's k largest again in float32 (CPUs with AVX512-BF16): "
        "the same tokens, bit for bit; holds two more copies of the output layer.",
    )
    gil_switch_interval: float = Field(
        default=0.0,
        ge=0,
        description="Python's GIL switch interval in seconds: 0 picks it by device (0.5 ms on a GPU, where "
        "the event loop waits for the GIL the decode step holds; Python's 5 ms on CPU).",
    )
    host: str = Field(default="127.0.0.1", min_length=1, description="Address to listen on.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port to listen on.")

    # Engine (passed to EngineConfig).
    max_seqs: int = Field(default=16, ge=1, le=4096, description="KV slots = max concurrent sequences.")
    max_queue: int = Field(default=64, ge=1, description="Waiting requests beyond which new ones get 429.")
    max_context: int | None = Field(
        default=None, ge=2,
        description="Tokens per sequence, prompt and output (default: the model's window); the KV "
        "cache holds max_seqs x max_context tokens.",
    )
    prefill_budget: int = Field(
        default=96, ge=1,
        description="Prompt tokens prefilled per engine step (smaller: steadier streams; a long prompt "
        "takes more steps).",
    )
    idle_prefill_budget: int = Field(
        default=2048, ge=1,
        description="Prompt tokens prefilled per engine step while no sequence is decoding.",
    )
    waiting_served_ratio: float = Field(
        default=1.2, gt=0,
        description="The idle prefill budget also applies while requests prefilling outnumber those "
        "decoding by this ratio (TGI's option): a wave of prompts is prefilled in one step.",
    )
    crop_policy: Literal["shift", "sliding"] = Field(
        default="shift", description="Past the window: shift (amortized) or sliding (nanoGPT's)."
    )
    shift_keep: int | None = Field(default=None, ge=1, description="Tokens kept on a context shift.")
    reject_long_prompts: bool = Field(default=False, description="422 instead of cropping over-long prompts.")
    deterministic: bool = Field(default=False, description="Same tokens alone or batched (slower).")
    prefix_cache: bool = Field(
        default=True,
        description="Reuse the KV cache a finished request leaves in its slot for a prompt that starts "
        "with the same tokens (a chat turn prefills only what is new).",
    )
    cpu_threads: int | None = Field(
        default=None, ge=1,
        description="CPU threads for the model (default: OMP_NUM_THREADS, else every CPU the "
        "process may use); the rest of the server stays on one.",
    )
    compile: bool = Field(default=False, description="torch.compile the decode step at warm-up.")
    backend: Literal["auto", "native", "torch"] = Field(
        default="auto",
        description="What computes: auto (native where it can run: CPU, float32/bfloat16, library "
        "built; else torch), native (an error where it cannot run), torch (any device).",
    )

    # Request limits.
    max_prompt_tokens: int = Field(
        default=32768, ge=1, description="Longer prompts are refused (before cropping)."
    )
    max_new_tokens: int = Field(default=4096, ge=1, description="Cap on a request's max_new_tokens.")
    default_max_new_tokens: int = Field(default=64, ge=1, description="Used when a request sets none.")
    max_stop_sequences: int = Field(default=8, ge=0, description="Stop strings allowed per request.")
    max_top_n_tokens: int = Field(default=5, ge=0, description="Cap on top_n_tokens / top_logprobs.")
    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="Larger request bodies get 413.")
    body_timeout: float = Field(
        default=30.0, gt=0, description="Seconds a body may take after its headers; then 408."
    )
    max_header_bytes: int = Field(
        default=32 << 10, ge=1024, description="Request headers larger in total get 431."
    )
    max_headers: int = Field(default=100, ge=8, description="Requests with more headers get 431.")

    responses_store: int = Field(
        default=1000, ge=0, le=1_000_000,
        description="Responses API: finished responses kept in memory for GET /v1/responses/{id} and "
        "previous_response_id, the least recently used evicted first (0: none are kept).",
    )
    responses_store_mb: int = Field(
        default=64, ge=1, le=1 << 20, description="Responses API: MiB those stored responses may hold."
    )

    # Connections.
    max_connections: int = Field(
        default=1024, ge=1, le=1_000_000,
        description="Open client connections beyond which a new one gets 503 and is closed (lowered "
        "at start-up to fit the open-file limit).",
    )
    max_connections_per_client: int = Field(
        default=0, ge=0, le=1_000_000,
        description="Open connections one client address may hold (0: no limit per address); "
        "beyond it a new one gets 503. Leave 0 behind a proxy: there every client has the proxy's address.",
    )
    header_timeout: float = Field(
        default=10.0, gt=0, le=3600, allow_inf_nan=False,
        description="Seconds a request's line and headers may take, from the connection's start or "
        "the request's first byte; then 408 (or a close when nothing came) and the connection closed.",
    )
    idle_timeout: float = Field(
        default=5.0, gt=0, le=3600, allow_inf_nan=False,
        description="Seconds a kept-alive connection may wait for its next request before it is closed.",
    )

    # Security.
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="Accepted bearer keys, comma-separated; empty = no auth."
    )
    metrics_require_auth: bool = Field(default=False, description="GET /metrics needs an API key too.")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Origins allowed cross-origin access; empty = CORS off."
    )

    # Fairness and admission.
    max_waiting_per_client: int | None = Field(
        default=None, ge=1,
        description="Waiting requests one client may have; beyond, 429 (default: half of max_queue). "
        "A client is its API key when keys are set, else its address (or client_id_header).",
    )
    client_id_header: str | None = Field(
        default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9-]+$",
        description="A header a trusted proxy sets to identify the caller (e.g. X-Forwarded-For), "
        "used for fairness instead of the peer address when API keys are not set.",
    )
    max_pending_encode_chars: int = Field(
        default=4 << 20, ge=1024,
        description="Prompt characters waiting to be tokenized off the event loop; beyond, 429.",
    )

    # Lifecycle and logs.
    drain_timeout: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        allow_inf_nan=False,
        description="Seconds in-flight requests get to finish after SIGTERM.",
    )
    keepalive_interval: float = Field(
        default=15.0,
        gt=0,
        le=300,
        allow_inf_nan=False,
        description="Seconds between SSE keep-alive comments.",
    )
    stream_interval: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Stream tokens N at a time (the first at once): fewer writes per token under load.",
    )
    log_level: LogLevel = Field(default="info", description="debug|info|warning|error|critical")
    log_format: Literal["text", "json"] = Field(
        default="text", description="text, or one JSON object a line."
    )

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        return _split_commas(value)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("api_keys")
    @classmethod
    def _keys_not_blank(cls, keys: list[SecretStr]) -> list[SecretStr]:
        for key in keys:
            if len(key.get_secret_value()) < 8:
                raise ValueError("every API key must be at least 8 characters long")
        return keys

    @field_validator("checkpoint")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        return path.expanduser().resolve()

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.default_max_new_tokens > self.max_new_tokens:
            if "default_max_new_tokens" not in self.model_fields_set:
                # Lowering the cap lowers the default with it; only an explicit clash is an error.
                self.default_max_new_tokens = self.max_new_tokens
                return self
            raise ValueError(
                f"default_max_new_tokens ({self.default_max_new_tokens}) exceeds "
                f"max_new_tokens ({self.max_new_tokens})"
            )
        return self

    def api_key_values(self) -> list[bytes]:
        """The keys as bytes, for constant-time comparison (never log these)."""
        return [key.get_secret_value().encode() for key in self.api_keys]
