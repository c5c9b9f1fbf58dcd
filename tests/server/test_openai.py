"""The official `openai` client against a real `nanoserve serve` on 127.0.0.1 (tiny random model).

Greedy outputs are checked token for token against the slow reference generator, so these tests
prove the API returns the model's real continuation (with the chat template and its stop string
applied), not just something shaped like a completion.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from nanoserve.model.chat_template import render_chat
from nanoserve.model.checkpoint import Checkpoint, load_checkpoint
from nanoserve.model.gpt import GPT
from nanoserve.model.reference import reference_generate
from tests.server.conftest import (
    FAULT_MARKER,
    OPENAI_API_KEY,
    OPENAI_MAX_NEW_TOKENS,
    OPENAI_MAX_STOP_SEQUENCES,
    metric_value,
)
from tests.server.server import ServerProcess

MAX_NEW_TOKENS = OPENAI_MAX_NEW_TOKENS


@pytest.fixture(scope="module")
def server(openai_server: ServerProcess) -> ServerProcess:
    return openai_server


@pytest.fixture(scope="module")
def client(openai_client: openai.OpenAI) -> openai.OpenAI:
    return openai_client


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> Iterator[tuple[Checkpoint, GPT]]:
    """The checkpoint and its model for the reference generator, in this (test) process."""
    # One thread: the test process shares 2 cores with the server, where a 2-thread pool of a tiny
    # model spins against the other processes and runs ~100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    checkpoint = load_checkpoint(tiny_checkpoint)
    yield checkpoint, checkpoint.build_model("cpu")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(reference: tuple[Checkpoint, GPT]) -> Checkpoint:
    return reference[0]


@pytest.fixture(scope="module")
def greedy(reference: tuple[Checkpoint, GPT]) -> Callable[[str, int], str]:
    """The reference continuation of a prompt: n greedy tokens, decoded."""
    checkpoint, model = reference

    def continuation(prompt: str, n: int) -> str:
        ids = checkpoint.tokenizer.encode(prompt)
        return checkpoint.tokenizer.decode(reference_generate(model, ids, n))

    return continuation


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-test"]
    assert client.models.retrieve("tiny-test").id == "tiny-test"
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.models.retrieve("gpt-4")


def test_completion_is_the_models_greedy_continuation(
    client: openai.OpenAI, checkpoint: Checkpoint, greedy: Callable[[str, int], str]
) -> None:
    prompt = "ROMEO: But soft"
    out = client.completions.create(model="tiny-test", prompt=prompt, max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.model == "tiny-test" and out.id.startswith("cmpl-")
    assert out.choices[0].text == greedy(prompt, 12)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    n_prompt = len(checkpoint.tokenizer.encode(prompt))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        n_prompt, 12, n_prompt + 12)


def test_completion_stream_matches_whole_and_reports_usage(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": "tiny-test", "prompt": "To be", "max_tokens": 20, "temperature": 1.0,
                            "seed": 1234}
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text  # same seed, same tokens, streamed or not
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert not chunks[-1].choices and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20 == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stop_string_is_honoured(client: openai.OpenAI, greedy: Callable[[str, int], str]) -> None:
    reference = greedy("Hark", 24)
    stop = reference[6:8]
    out = client.completions.create(model="tiny-test", prompt="Hark", max_tokens=24, temperature=0,
                                    stop=[stop])
    assert out.choices[0].text == reference[: reference.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_chat_applies_the_template_and_its_stop(
    client: openai.OpenAI, checkpoint: Checkpoint, greedy: Callable[[str, int], str]
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who goes there?"}]
    prompt = render_chat(checkpoint.chat_template, messages)
    reference = greedy(prompt, 30)
    # the tiny checkpoint's template stop (nanoserve/model/checkpoint.py's default template)
    turn_end = "\n\n"
    assert checkpoint.chat_template["stop"] == [turn_end]
    expected = reference.split(turn_end)[0]

    out = client.chat.completions.create(model="tiny-test", messages=messages, max_tokens=30,  # type: ignore[arg-type]
                                         temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    assert out.choices[0].finish_reason == ("stop" if turn_end in reference else "length")
    assert out.usage is not None and out.usage.prompt_tokens == len(checkpoint.tokenizer.encode(prompt))


def test_a_chat_longer_than_the_window_loses_its_oldest_turns_not_its_system_prompt(
    client: openai.OpenAI, checkpoint: Checkpoint, greedy: Callable[[str, int], str]
) -> None:
    window, max_tokens = checkpoint.config.block_size, 8
    budget = window - min(max_tokens, window // 4)  # room left for the reply (routes/openai.py)
    system = {"role": "system", "content": "Be brief."}
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"line {i} of the talk"}
             for i in range(9)]
    messages = [system, *turns]
    template, tok = checkpoint.chat_template, checkpoint.tokenizer
    assert len(tok.encode(render_chat(template, messages))) > window  # the whole talk does not fit

    for stream in (False, True):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny-test", messages=messages, max_tokens=max_tokens, temperature=0,  # type: ignore[arg-type]
            stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
        dropped = int(raw.headers["x-nanoserve-dropped-messages"])
        prompt = render_chat(template, [system, *turns[dropped:]])
        assert len(tok.encode(prompt)) <= budget  # fits, with the system prompt first
        fewer = render_chat(template, [system, *turns[dropped - 1 :]])
        assert len(tok.encode(fewer)) > budget  # no more turns dropped than needed
        expected = greedy(prompt, max_tokens).split("\n\n")[0]
        if stream:
            chunks = list(raw.parse())
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            out = raw.parse()
            text, usage = out.choices[0].message.content, out.usage
        assert text == expected  # the model read exactly the fitted conversation
        assert usage is not None and usage.prompt_tokens == len(tok.encode(prompt))


def test_chat_stream_shape(client: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": "tiny-test", "messages": [{"role": "user", "content": "Speak"}],
                            "max_tokens": 15, "temperature": 0.9, "seed": 7, "stop": "\n"}
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert "\n" not in text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert whole.usage is not None and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_logprobs(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                          stop=["zzzz"])
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob >= max(t.logprob for t in entry.top_logprobs) - 1e-4
    legacy = client.completions.create(model="tiny-test", prompt="Hi", max_tokens=5, temperature=0,
                                       logprobs=1)
    lp = legacy.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert "".join(lp.tokens) == legacy.choices[0].text and len(lp.token_logprobs) == 5
    # OpenAI: the chosen token is always among top_logprobs (so up to N + 1 entries).
    sampled = client.completions.create(model="tiny-test", prompt="Hi", max_tokens=8, temperature=1.5,
                                        seed=3, logprobs=1)
    lp = sampled.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert lp.token_logprobs is not None
    for token, logprob, tops in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(tops) <= 2 and tops[token] == logprob


@pytest.mark.parametrize(("kwargs", "field", "says"), [
    ({"tools": [{"type": "function", "function": {"name": "f g", "parameters": {}}}]},
     "tools[0].function.name", "function names"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate", "Extra inputs"),
    ({"extra_body": {"temperature": True}}, "temperature", "valid number"),
    ({"max_tokens": MAX_NEW_TOKENS + 1}, "max_tokens", f"limit of {MAX_NEW_TOKENS}"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", f"limit of {OPENAI_MAX_STOP_SEQUENCES}"),
    ({"messages": [{"role": "user", "content": "caf\u00e9"}]}, "messages", "\u00e9"),
])
def test_chat_refusals_surface_in_the_sdk(client: openai.OpenAI, kwargs: dict, field: str, says: str) -> None:
    args: dict[str, Any] = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 4, **kwargs}
    for stream in (False, True):  # a streamed request is refused before its stream starts
        with pytest.raises(openai.BadRequestError) as info:  # OpenAI's 400, not 422
            client.chat.completions.create(**args, stream=stream)
        body = info.value.body
        assert isinstance(body, dict) and body["param"].startswith(field), body
        assert says in body["message"], body


def test_prompt_forms_and_unknown_model(client: openai.OpenAI, checkpoint: Checkpoint) -> None:
    as_text = client.completions.create(model="tiny-test", prompt="Hath", max_tokens=6, temperature=0)
    ids = checkpoint.tokenizer.encode("Hath")
    as_ids = client.completions.create(model="tiny-test", prompt=ids, max_tokens=6, temperature=0)
    as_list = client.completions.create(model="tiny-test", prompt=["Hath"], max_tokens=6, temperature=0)
    assert as_text.choices[0].text == as_ids.choices[0].text == as_list.choices[0].text
    with pytest.raises(openai.BadRequestError, match="token id 5000 is not in"):
        client.completions.create(model="tiny-test", prompt=[1, 5000], max_tokens=1)
    # Several prompts: one choice each, in the order given, usage summed.
    several = client.completions.create(model="tiny-test", prompt=["Hath", "ROMEO", "Hath"],
                                        max_tokens=6, temperature=0)
    assert [c.index for c in several.choices] == [0, 1, 2]
    alone = client.completions.create(model="tiny-test", prompt="ROMEO", max_tokens=6, temperature=0)
    texts = [c.text for c in several.choices]
    assert texts == [as_text.choices[0].text, alone.choices[0].text, as_text.choices[0].text]
    assert several.usage is not None and several.usage.completion_tokens == 18
    as_ids_twice = client.completions.create(model="tiny-test", prompt=[ids, ids], max_tokens=6,
                                             temperature=0)
    assert [c.text for c in as_ids_twice.choices] == [as_text.choices[0].text] * 2
    # ... and streamed: each prompt's chunks under its index, both finishes, then the summed usage.
    chunks = list(client.completions.create(model="tiny-test", prompt=["Hath", "ROMEO"], max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    streamed = ["", ""]
    finishes = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        streamed[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    assert streamed == texts[:2] and finishes == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    # `model` does not choose (one model is served): any name gets the served model's answer.
    other = client.completions.create(model="gpt-4", prompt="Hath", max_tokens=6, temperature=0)
    assert other.model == "tiny-test" and other.choices[0].text == as_text.choices[0].text


def test_null_means_default_and_neutral_fields_are_accepted(client: openai.OpenAI) -> None:
    omitted = client.completions.create(model="tiny-test", prompt="Hath", temperature=0)
    null = client.completions.create(model="tiny-test", prompt="Hath", temperature=0,
                                     extra_body={"max_tokens": None})
    assert omitted.usage is not None and null.usage is not None
    assert omitted.usage.completion_tokens == null.usage.completion_tokens == 16  # OpenAI's default
    assert omitted.choices[0].text == null.choices[0].text
    reply = client.chat.completions.create(
        model="whatever-the-client-calls-it", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        tools=[], tool_choice="none", parallel_tool_calls=False, store=False, metadata={}, temperature=0,
        top_p=None, n=None, presence_penalty=None,  # the SDK sends these as null
    )
    assert reply.model == "tiny-test" and reply.choices[0].finish_reason in ("length", "stop")


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI, checkpoint: Checkpoint) -> None:
    tok = checkpoint.tokenizer
    free = client.completions.create(model="tiny-test", prompt="Hath", max_tokens=6, temperature=0)
    first = tok.encode(free.choices[0].text[0])[0]
    banned = client.completions.create(model="tiny-test", prompt="Hath", max_tokens=6, temperature=0,
                                       logit_bias={str(first): -100})
    assert free.choices[0].text[0] not in banned.choices[0].text
    x = tok.encode("x")[0]
    forced = client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=1.0, seed=2, logit_bias={str(x): 100})
    assert forced.choices[0].message.content == "xxxxx"
    with pytest.raises(openai.BadRequestError, match="not in this model's vocabulary") as info:
        client.completions.create(model="tiny-test", prompt="x", max_tokens=1, logit_bias={"99999": 1})
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "logit_bias"


def test_unknown_v1_route_is_openais_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.post("/frobnicate", body={}, cast_to=dict)
    assert info.value.body == {"message": "Invalid URL (POST /v1/frobnicate)",
                               "type": "invalid_request_error", "code": "unknown_url", "param": None}


def test_sse_wire_format(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Go"}], "max_tokens": 5, "stream": True}
    headers = {"Authorization": f"Bearer {OPENAI_API_KEY}"}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert '"usage":null' in lines[-2]  # no usage chunk unless stream_options asks for it
    refused = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert refused.status_code == 401  # the API key protects the OpenAI routes


def test_closing_a_stream_frees_its_slot(client: openai.OpenAI, server: ServerProcess) -> None:
    cancelled = 'nanoserve_requests_cancelled_total{route="/v1/completions"}'
    before = metric_value(httpx.get(server.base_url + "/metrics", timeout=5).text, cancelled)
    stream = client.completions.create(model="tiny-test", prompt="Long", max_tokens=MAX_NEW_TOKENS,
                                       temperature=1.0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    # The engine cancels it (rather than generating all its tokens) and frees the slot.
    _assert_cancelled(server, cancelled, before + 1)


def _assert_cancelled(server: ServerProcess, cancelled: str, want: float) -> None:
    """Within 20 s the cancelled counter reaches `want` and no sequence holds a slot."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        metrics = httpx.get(server.base_url + "/metrics", timeout=5).text
        if metric_value(metrics, cancelled) == want and "nanoserve_running_sequences 0.0" in metrics:
            break
        time.sleep(0.1)
    assert metric_value(metrics, cancelled) == want
    assert "nanoserve_running_sequences 0.0" in metrics


def test_closing_a_stream_of_several_prompts_cancels_them_all(client: openai.OpenAI,
                                                               server: ServerProcess) -> None:
    cancelled = 'nanoserve_requests_cancelled_total{route="/v1/completions"}'
    before = metric_value(httpx.get(server.base_url + "/metrics", timeout=5).text, cancelled)
    stream = client.completions.create(model="tiny-test", prompt=["Long", "Longer"],
                                       max_tokens=MAX_NEW_TOKENS, temperature=1.0, stream=True)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    _assert_cancelled(server, cancelled, before + 2)
    # One prompt failing inside the engine ends the shared stream with the error event.
    with pytest.raises(openai.APIError, match="non-finite logits"):
        for _ in client.completions.create(model="tiny-test", prompt=["Hath", f"{FAULT_MARKER} x"],
                                           max_tokens=5, stream=True):
            pass


def test_a_failed_generation_surfaces_as_an_sdk_error(client: openai.OpenAI, server: ServerProcess) -> None:
    messages: Any = [{"role": "user", "content": f"{FAULT_MARKER} please"}]
    with pytest.raises(openai.InternalServerError, match="generation failed"):
        client.chat.completions.create(model="tiny-test", messages=messages, max_tokens=5)
    # After the 200 the failure is an `event: error`, which the SDK raises with our message and code.
    with pytest.raises(openai.APIError, match="non-finite logits") as info:
        for _ in client.chat.completions.create(model="tiny-test", messages=messages, max_tokens=5,
                                                stream=True):
            pass
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "generation_error"
    assert httpx.get(server.base_url + "/ready", timeout=5).status_code == 200
    ok = client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")
