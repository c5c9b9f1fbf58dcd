"""The TGI API's shapes, as Hugging Face text-generation-inference defines them.

Requests are strict (see schemas/common.py). TGI parameters this server does not implement are
declared so that clients sending their neutral value (`huggingface_hub` sends `"watermark": false`)
keep working, while a request that really asks for one gets a 422 saying so.
Extensions over TGI: `min_p`, `presence_penalty`, and `prompt_tokens` / `cropped_tokens` in details.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from nanoserve.server.api.common import MAX_COUNT, MAX_STOP_LENGTH, STRICT, CacheSalt, Seed
from nanoserve.server.api.structured import tgi_grammar

FinishReasonName = Literal["length", "eos_token", "stop_sequence"]


def _unsupported(field: str, why: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"`{field}` is not supported by this server: {why}")


class GenerateParameters(BaseModel):
    """Generation parameters. With no sampling parameter and no `do_sample`, decoding is greedy."""

    model_config = STRICT

    max_new_tokens: int | None = Field(
        default=None, ge=1, le=MAX_COUNT, description="Tokens to generate (server default if null)."
    )
    do_sample: bool | None = Field(
        default=None,
        description="Sample (else greedy). TGI's rule: a request also samples when a sampling "
        "parameter changes the distribution (temperature other than 1, top_k, top_p or typical_p "
        "below 1, min_p above 0), whatever do_sample says; temperature 0 is greedy.",
    )
    temperature: float | None = Field(default=None, ge=0.0, le=100.0, description="0 means greedy.")
    top_k: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="Extension: min_p * p(top) floor.")
    typical_p: float | None = Field(default=None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(
        default=None, gt=0.0, le=100.0, description="> 1 discourages repeats."
    )
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(
        default=None, ge=-2.0, le=2.0, description="Extension (OpenAI style)."
    )
    stop: list[str] | None = Field(
        default=None, description="Stop strings; generation ends with the first match, which "
        "`generated_text` keeps (as TGI's does)."
    )
    seed: Seed | None = Field(default=None, description="Same seed + same request = same tokens.")
    cache_salt: CacheSalt | None = None
    details: bool = Field(
        default=False, description="Return `details` (finish reason, tokens, logprobs, seed)."
    )
    return_full_text: bool = Field(default=False, description="Prepend the prompt to `generated_text`.")
    truncate: int | None = Field(
        default=None, ge=1, le=MAX_COUNT, description="Keep only the last `truncate` prompt tokens."
    )
    top_n_tokens: int | None = Field(
        default=None, ge=0, le=MAX_COUNT, description="Top alternatives per token."
    )
    decoder_input_details: bool = Field(
        default=False, description="With `details`, fill `details.prefill` with each prompt token and its "
        "logprob (null for the first). Not with streaming (TGI's rule)."
    )
    # TGI features not implemented: accepted only with their neutral value.
    watermark: bool = Field(default=False, description="Not supported (false only).")
    best_of: int | None = Field(
        default=None, ge=1, le=MAX_COUNT, description="Generate this many sequences (at most /info's "
        "max_best_of; sampling only, no seed, no streaming: TGI's rules) and answer the one with the "
        "highest mean token logprob; the others are in details.best_of_sequences."
    )
    grammar: dict[str, Any] | None = Field(
        default=None, description='{"type": "json", "value": <JSON Schema>}, {"type": "regex", "value": '
        '"<pattern>"} or {"type": "json_schema", "value": {"name": ..., "schema": {...}}}: the output is '
        "constrained to match."
    )
    adapter_id: str | None = Field(default=None, description="Not supported (null only).")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: list[str] | None) -> list[str] | None:
        for i, s in enumerate(stop or []):
            if not s:
                raise PydanticCustomError(
                    "value_error", "stop[{i}] is empty; stop strings must be non-empty", {"i": i}
                )
            if len(s) > MAX_STOP_LENGTH:
                raise PydanticCustomError(
                    "value_error", "stop[{i}] is longer than {n} characters", {"i": i, "n": MAX_STOP_LENGTH}
                )
        return stop

    @field_validator("watermark")
    @classmethod
    def _false_only(cls, value: bool, info: ValidationInfo) -> bool:
        if value:
            raise _unsupported(str(info.field_name), "only false is accepted")
        return value

    @field_validator("grammar")
    @classmethod
    def _known_grammar(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        tgi_grammar(value)  # raises on a shape TGI does not take
        return value

    @field_validator("adapter_id")
    @classmethod
    def _null_only(cls, value: object, info: ValidationInfo) -> object:
        if value is not None:
            raise _unsupported(str(info.field_name), "send null or leave it out")
        return value

    def sampling(self) -> bool:
        """Whether to sample (else greedy): TGI's rule (server/.../utils/tokens.py NextTokenChooser:
        `do_sample or has_warpers`), plus temperature 0 meaning greedy."""
        if self.temperature == 0.0:
            return False
        warpers = (
            (self.temperature is not None and self.temperature != 1.0)
            or self.top_k is not None
            or (self.top_p is not None and self.top_p < 1.0)
            or (self.typical_p is not None and self.typical_p < 1.0)
            or (self.min_p is not None and self.min_p > 0.0)
        )
        return bool(self.do_sample) or warpers


class GenerateRequest(BaseModel):
    """Body of POST /generate, POST /generate_stream and POST / (TGI's shape)."""

    model_config = STRICT

    inputs: str = Field(min_length=1, description="The prompt.")
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = Field(
        default=False, description="POST /generate and POST /: answer with the SSE stream instead."
    )


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None = None
    special: bool


class PrefillToken(BaseModel):
    """A prompt token in details.prefill (decoder_input_details), as TGI sends it."""

    id: int
    text: str
    logprob: float | None = Field(description="Given the tokens before it; null for the first.")


class BestOfSequence(BaseModel):
    """One of the sequences best_of generated and did not answer with (TGI's shape)."""

    generated_text: str
    finish_reason: FinishReasonName
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken] = Field(default_factory=list)
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None


class Details(BaseModel):
    finish_reason: FinishReasonName
    generated_tokens: int
    prompt_tokens: int = Field(description="Prompt tokens the model saw (after cropping/truncation).")
    cropped_tokens: int = Field(description="Prompt tokens dropped from the left to fit the window.")
    seed: int | None
    prefill: list[PrefillToken] = Field(default_factory=list, description="The prompt's tokens with "
                                        "`decoder_input_details`, else empty.")
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None
    best_of_sequences: list[BestOfSequence] | None = None


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: FinishReasonName
    generated_tokens: int
    prompt_tokens: int
    cropped_tokens: int
    input_length: int = Field(description="TGI's name for prompt_tokens.")
    seed: int | None


class StreamResponse(BaseModel):
    """One SSE event of /generate_stream; the last one has `generated_text` and `details`."""

    index: int
    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None = None
    details: StreamDetails | None = None


class TokenizeRequest(BaseModel):
    """POST /tokenize: TGI's generate request; of its parameters only `truncate` applies."""

    model_config = STRICT

    inputs: str = Field(description="Text to tokenize.")
    parameters: GenerateParameters = Field(
        default_factory=GenerateParameters,
        description="As for /generate; `truncate` keeps the last N tokens, the rest is validated only.",
    )
    stream: bool = Field(default=False, description="Accepted and ignored (TGI's request shape).")


class TGIErrorResponse(BaseModel):
    """Every error on the TGI routes has this body (TGI's ErrorResponse)."""

    error: str = Field(description="What went wrong, naming the offending field or limit.")
    error_type: str = Field(description="validation, overloaded, generation, incomplete_generation, or "
                            "the reason's code (e.g. not_ready).")


class SimpleToken(BaseModel):
    id: int
    text: str
    start: int = Field(description="Character offset of the token's text in `inputs`.")
    stop: int


class Info(BaseModel):
    """GET /info: TGI's fields, plus the model, checkpoint provenance and limits."""

    model_id: str
    model_sha: str | None = Field(default=None, description="The checkpoint's content hash (sha256 of its "
                                  "config, tokenizer and weights files).")
    model_dtype: str
    model_device_type: str
    model_pipeline_tag: str | None = "text-generation"
    max_concurrent_requests: int
    max_waiting_requests: int
    max_best_of: int = Field(description="The most sequences best_of may ask for: min(16, max_seqs).")
    max_stop_sequences: int
    max_input_tokens: int = Field(description="The most prompt tokens the model reads: min(the "
                                  "prompt cap, window - 1); a longer prompt is cropped or refused.")
    max_total_tokens: int = Field(description="Prompt plus generated tokens the model attends to at "
                                  "once: its window (longer generations shift the context).")
    validation_workers: int = Field(description="Threads that tokenize prompts beside the event loop.")
    max_client_batch_size: int = Field(description="Prompts in one /v1/completions request.")
    router: str = "nanoserve"
    version: str
    sha: str | None = None
    docker_label: str | None = None
    # Extensions over TGI.
    max_prompt_tokens: int = Field(description="Longest prompt accepted (in tokens) before cropping.")
    max_new_tokens: int
    max_top_n_tokens: int
    max_body_bytes: int
    window: int
    engine: dict[str, Any] = Field(description="The engine's own report: model config, checkpoint, limits.")
    model_version: str | None = Field(default=None, description="sha256:<12 hex>@step<N>: the content "
                                      "hash and the training step it was saved at.")
    models: list[dict[str, Any]] = Field(
        default_factory=list, description="Every served model, the default first: name, version, sha256, "
        "step, window, reloads and the last failed reload's reason (null when none failed).")
