"""n > 1 and best_of through the official `openai` client: choice i is what seed + i gives alone."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.server.conftest import OPENAI_API_KEY, metric_value
from tests.server.server import ServerProcess

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]
MAX = 8


@pytest.fixture(scope="module")
def client(openai_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=openai_server.base_url + "/v1", api_key=OPENAI_API_KEY, max_retries=0, timeout=60
    ) as c:
        yield c


def _alone_chat(client: openai.OpenAI, seed: int) -> str:
    out = client.chat.completions.create(
        model="m", messages=MESSAGES, seed=seed, temperature=1.0, max_tokens=MAX
    )
    return out.choices[0].message.content or ""


def _alone_completion(client: openai.OpenAI, seed: int) -> tuple[str, list[float]]:
    out = client.completions.create(
        model="m", prompt="Hello", seed=seed, logprobs=0, temperature=1.0, max_tokens=MAX
    )
    lps = out.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
    return out.choices[0].text, [lp for lp in lps or [] if lp is not None]


def test_chat_n2_choices_are_the_seeds_alone(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="m", messages=MESSAGES, n=2, seed=11, temperature=1.0, max_tokens=MAX
    )
    assert [c.index for c in out.choices] == [0, 1]
    texts = [c.message.content for c in out.choices]
    assert texts == [_alone_chat(client, 11), _alone_chat(client, 12)]
    alone = client.chat.completions.create(
        model="m", messages=MESSAGES, seed=11, temperature=1.0, max_tokens=MAX
    )
    assert out.usage is not None and alone.usage is not None
    assert out.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counts once
    assert out.usage.completion_tokens == 2 * MAX


def test_chat_n2_streams_each_choice_under_its_index(client: openai.OpenAI) -> None:
    texts, finished = ["", ""], set()
    stream = client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        n=2,
        seed=11,
        stream=True,
        stream_options={"include_usage": True},
        temperature=1.0,
        max_tokens=MAX,
    )
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert texts == [_alone_chat(client, 11), _alone_chat(client, 12)]
    assert usage is not None and usage.completion_tokens == 2 * MAX


def test_completions_n2_streamed_and_not(client: openai.OpenAI) -> None:
    expected = [_alone_completion(client, 21)[0], _alone_completion(client, 22)[0]]
    out = client.completions.create(model="m", prompt="Hello", n=2, seed=21, temperature=1.0, max_tokens=MAX)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected
    texts = ["", ""]
    for chunk in client.completions.create(
        model="m", prompt="Hello", n=2, seed=21, stream=True, temperature=1.0, max_tokens=MAX
    ):  # type: ignore[arg-type]
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == expected


def test_completions_best_of_returns_the_highest_mean_logprob(client: openai.OpenAI) -> None:
    candidates = [_alone_completion(client, 31 + i) for i in range(3)]
    best = max(candidates, key=lambda c: sum(c[1]) / len(c[1]))[0]
    out = client.completions.create(
        model="m", prompt="Hello", best_of=3, seed=31, temperature=1.0, max_tokens=MAX
    )
    assert [c.text for c in out.choices] == [best]
    assert out.usage is not None and out.usage.completion_tokens == 3 * MAX


@pytest.mark.parametrize(
    "kwargs", [{"n": 5}, {"best_of": 5}, {"n": 2, "best_of": 1}, {"best_of": 2, "stream": True}]
)
def test_choice_limits_are_bad_requests(client: openai.OpenAI, kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="Hello", temperature=1.0, max_tokens=MAX, **kwargs)


def test_the_shared_prefill_is_counted(client: openai.OpenAI, openai_server: ServerProcess) -> None:
    series = "nanoserve_engine_prefill_tokens_shared_total"
    before = metric_value(httpx.get(openai_server.base_url + "/metrics", timeout=5).text, series)
    prompt = "Hello there, how are you"
    out = client.completions.create(model="m", prompt=prompt, n=3, seed=1, temperature=1.0, max_tokens=2)
    assert out.usage is not None
    after = metric_value(httpx.get(openai_server.base_url + "/metrics", timeout=5).text, series)
    assert after - before == 2 * (out.usage.prompt_tokens - 1)  # two followers, all but the last token
