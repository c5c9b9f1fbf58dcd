"""LangChain's `ChatOpenAI` (langchain-openai), unmodified, against a real server on a BPE checkpoint:
invoke, stream, and `with_structured_output` of a pydantic model. Its default structured-output
method in this version is "json_schema": it sends our `response_format` json_schema (no tools)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import make_tiny_bpe_checkpoint, require_module
from tests.server.server import ServerProcess, running_server

CORPUS = ('{"name": "Ada", "age": 36, "mood": "calm"}\nHello there, a plain sentence of prose.\n'
          '{"name": "Bo", "age": 7, "mood": "glad"}\n') * 30
ENV = {"NANOSERVE_MAX_SEQS": "4", "OMP_NUM_THREADS": "1"}
QUESTION = "Tell me about a person."


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    mood: Literal["calm", "glad"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = make_tiny_bpe_checkpoint(tmp_path_factory.mktemp("ckpt") / "bpe", CORPUS, vocab_size=300,
                                    block_size=256, name="tiny-langchain")
    with running_server(path, env=ENV) as s:
        yield s


def chat_model(server: ServerProcess, **kwargs: Any) -> Any:
    require_module("langchain_openai")
    from langchain_openai import ChatOpenAI

    # The model name is a placeholder, as LangChain users configure one: the server ignores it.
    return ChatOpenAI(base_url=server.base_url + "/v1", api_key="unused", model="gpt-4o-mini",  # type: ignore[arg-type]
                      max_retries=0, timeout=60, **kwargs)


def sdk_answer(server: ServerProcess, max_tokens: int) -> str:
    """The same question through the openai SDK, greedy: what LangChain must return."""
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}],
                                             temperature=0, max_tokens=max_tokens)
    return out.choices[0].message.content or ""


def test_invoke_and_stream(server: ServerProcess) -> None:
    llm = chat_model(server, temperature=0, max_tokens=12)
    want = sdk_answer(server, 12)
    assert want  # a random model still says something in 12 tokens
    reply = llm.invoke(QUESTION)
    assert reply.content == want
    assert reply.response_metadata["finish_reason"] in ("length", "stop")
    assert reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] <= 12
    chunks = list(llm.stream(QUESTION))
    assert len(chunks) > 1  # streamed, not one block
    assert "".join(str(c.content) for c in chunks) == want


def test_with_structured_output_gives_valid_models(server: ServerProcess) -> None:
    """Random weights: only the grammar makes every answer a valid Person, whatever the seed."""
    for seed in range(4):
        llm = chat_model(server, temperature=1.0, seed=seed, max_tokens=80)
        structured = llm.with_structured_output(Person)  # method="json_schema", LangChain's default
        person = structured.invoke(QUESTION)
        assert isinstance(person, Person), person
        # include_raw shows what came back: JSON text in the message content, no tool calls.
        raw = llm.with_structured_output(Person, include_raw=True).invoke(QUESTION)
        assert raw["parsing_error"] is None and isinstance(raw["parsed"], Person)
        assert not raw["raw"].tool_calls
