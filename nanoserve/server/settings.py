"""Server settings: one typed object read from flags and `NANOSERVE_*` environment variables.

Nothing here runs at import: `Settings()` is built by `nanoserve serve` (flags override the
environment) or by a test, and handed to `create_app(settings)`. Model hyperparameters are not
settings; they come from the checkpoint.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationInfo, create_model, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from nanoserve.engine.config import ConfigError, EngineConfig, check_value, rules

# The repository root when installed editable (`make serve`), so the default checkpoint is found
# whatever the working directory is.
PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CHECKPOINT = PROJECT_ROOT / "checkpoints" / "shakespeare-char"

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
ENV_PREFIX = "NANOSERVE_"


def _split_commas(value: object) -> object:
    # `NANOSERVE_API_KEYS=a,b` reads better than a JSON list in an environment file.
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def _check_engine_value(value: Any, info: ValidationInfo) -> Any:
    assert info.field_name is not None
    try:
        check_value(info.field_name, value)
    except ConfigError as e:  # the error's place names the field; its message says the rest
        raise PydanticCustomError("engine_setting", e.reason) from None
    return value


def _engine_settings() -> type[BaseSettings]:
    """The engine's settings as pydantic fields: EngineConfig's names, types, defaults and help,
    each value checked by EngineConfig's own rule (nanoserve/engine/config.py)."""
    declared: dict[str, Any] = {
        name: (kind, Field(default=EngineConfig.__dataclass_fields__[name].default, description=rule.help))
        for name, (kind, rule) in rules().items()
    }
    check = field_validator(*declared)(_check_engine_value)
    return create_model("EngineSettings", __base__=BaseSettings,
                        __validators__={"_check_engine_value": check}, **declared)


if TYPE_CHECKING:
    class EngineSettings(BaseSettings, EngineConfig):  # the type checker sees EngineConfig's fields
        pass
else:
    EngineSettings = _engine_settings()


class Settings(EngineSettings):
    """Everything an operator can set. Every field is `--flag` or `NANOSERVE_FIELD`; the engine's
    come from EngineConfig."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", validate_default=True)

    # What to serve, where.
    checkpoint: Path = Field(default=DEFAULT_CHECKPOINT, description="Checkpoint directory to serve.")
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Checkpoints to serve together, comma-separated, each PATH or NAME=PATH (named by "
        "its checkpoint's name otherwise); the first is the default. `--checkpoint` given more than "
        "once fills this; empty: `checkpoint` alone.",
    )
    watch: bool = Field(
        default=False, description="Reload a checkpoint when its files change on disk (polled each second)."
    )
    chat_template: Path | None = Field(
        default=None,
        description="A chat template to use instead of the checkpoint's: a Jinja file (as Hugging Face "
        "models have), a tokenizer_config.json, or a .json data-only template.",
    )
    gil_switch_interval: float = Field(
        default=0.0,
        ge=0,
        description="Python's GIL switch interval in seconds: 0 picks it by device (0.5 ms on a GPU, where "
        "the event loop waits for the GIL the decode step holds; Python's 5 ms on CPU).",
    )
    host: str = Field(default="127.0.0.1", min_length=1, description="Address to listen on.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port to listen on.")

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

    @field_validator("api_keys", "cors_origins", "models", mode="before")
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


# Variables with these prefixes belong to the tests and benchmarks, not to the server.
NOT_SETTINGS = ("NANOSERVE_TEST_", "NANOSERVE_BENCH_")


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One warning per NANOSERVE_* variable that names no setting (the settings ignore it, so a
    typo would go unnoticed), with the closest setting's variable where one is close."""
    names = list(Settings.model_fields)
    warnings = []
    for variable in sorted(v.upper() for v in environ):
        if not variable.startswith(ENV_PREFIX) or variable.startswith(NOT_SETTINGS):
            continue
        name = variable.removeprefix(ENV_PREFIX).lower()
        if name in names:
            continue
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"; did you mean {ENV_PREFIX}{close[0].upper()}?" if close else ""
        warnings.append(f"{variable} is not a setting and is ignored{hint}")
    return warnings
