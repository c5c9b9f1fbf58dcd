"""Echo and prompt logprobs over HTTP: OpenAI's `echo` (with `logprobs`, `max_tokens: 0`, streaming)
through the official client, TGI's `decoder_input_details` raw and through TGI's own client. The
prompt's scores are checked against the reference model's full forward over the prompt."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from nanoserve.model.checkpoint import load_checkpoint
from tests.conftest import require_module
from tests.server.conftest import OPENAI_API_KEY
from tests.server.server import ServerProcess

PROMPT = "Hello there, echo"  # the tiny checkpoint's tokenizer: one token a character
AUTH = {"Authorization": f"Bearer {OPENAI_API_KEY}"}


@pytest.fixture(scope="module")
def client(openai_client: openai.OpenAI) -> openai.OpenAI:
    return openai_client


@pytest.fixture(scope="module")
def want(tiny_checkpoint: Path) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and the reference model's log_softmax over them, (T, V)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server shares the two cores
    checkpoint = load_checkpoint(tiny_checkpoint)
    ids = checkpoint.tokenizer.encode(PROMPT)
    with torch.no_grad():
        lp = checkpoint.build_model("cpu")(torch.tensor([ids]))[0].log_softmax(-1)
    torch.set_num_threads(threads)
    return ids, lp


def _greedy(client: openai.OpenAI, max_tokens: int) -> str:
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(
    client: openai.OpenAI, want: tuple[list[int], torch.Tensor]
) -> None:
    ids, lp = want
    n = len(ids)
    out = client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                    temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPT + _greedy(client, 3)
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert logprobs.tokens[:n] == list(PROMPT) and len(logprobs.tokens) == n + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # as OpenAI and vLLM
    for i in range(1, n):
        assert logprobs.token_logprobs[i] == pytest.approx(lp[i - 1, ids[i]].item(), abs=1e-4)
        tops = logprobs.top_logprobs[i]
        assert tops is not None and tops[PROMPT[i]] == pytest.approx(lp[i - 1, ids[i]].item(), abs=1e-4)
        best = lp[i - 1].topk(2)
        assert sorted(tops.values(), reverse=True)[:2] == pytest.approx(best.values.tolist(), abs=1e-4)
    assert logprobs.text_offset == list(range(n + 3))  # one character a token
    assert all(v is not None for v in logprobs.token_logprobs[n:])  # the generated tokens follow
    assert out.usage is not None and out.usage.prompt_tokens == n and out.usage.completion_tokens == 3


def test_echo_without_logprobs_and_max_tokens_zero(
    client: openai.OpenAI, want: tuple[list[int], torch.Tensor]
) -> None:
    ids, lp = want
    plain = client.completions.create(model="m", prompt=PROMPT, echo=True, max_tokens=4, temperature=0)
    assert plain.choices[0].text == PROMPT + _greedy(client, 4) and plain.choices[0].logprobs is None
    # Scoring text: nothing generated, the prompt scored.
    scored = client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    total = sum(v for v in choice.logprobs.token_logprobs[1:] if v is not None)
    expected = sum(lp[i - 1, ids[i]].item() for i in range(1, len(ids)))
    assert total == pytest.approx(expected, abs=1e-3)
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="echo"):  # nothing to return without echo
        client.completions.create(model="m", prompt=PROMPT, max_tokens=0)


def test_streamed_echo_sends_the_prompt_in_the_first_chunk(
    client: openai.OpenAI, want: tuple[list[int], torch.Tensor]
) -> None:
    ids, lp = want
    chunks = list(client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == PROMPT
    assert first.logprobs is not None and first.logprobs.tokens == list(PROMPT)
    assert first.logprobs.token_logprobs is not None
    assert first.logprobs.token_logprobs[-1] == pytest.approx(lp[-2, ids[-1]].item(), abs=1e-4)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == PROMPT + _greedy(client, 3)
    # Several prompts in one stream: each choice's first chunk is its own prompt.
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model="m", prompt=[PROMPT, "Hi"], echo=True, max_tokens=2,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts[0].startswith(PROMPT) and texts[1].startswith("Hi")


def test_tgi_decoder_input_details_fills_prefill(
    openai_server: ServerProcess, want: tuple[list[int], torch.Tensor]
) -> None:
    ids, lp = want
    params = {"max_new_tokens": 2, "details": True, "decoder_input_details": True, "top_n_tokens": 2}
    with httpx.Client(base_url=openai_server.base_url, headers=AUTH, timeout=60) as http:
        r = http.post("/generate", json={"inputs": PROMPT, "parameters": params})
        assert r.status_code == 200, r.text
        details = r.json()["details"]
        prefill = details["prefill"]
        assert [t["id"] for t in prefill] == ids and "".join(t["text"] for t in prefill) == PROMPT
        assert prefill[0]["logprob"] is None  # TGI: nothing predicts the first token
        for i in range(1, len(ids)):
            assert set(prefill[i]) == {"id", "text", "logprob"}
            assert prefill[i]["logprob"] == pytest.approx(lp[i - 1, ids[i]].item(), abs=1e-4)
        assert len(details["top_tokens"]) == 2  # top_n_tokens still covers the generated tokens only
        plain = {"max_new_tokens": 1, "details": True}
        r = http.post("/generate", json={"inputs": PROMPT, "parameters": plain})
        assert r.json()["details"]["prefill"] == []  # only when asked for
        asked = {"inputs": PROMPT, "parameters": {"decoder_input_details": True}}
        streaming: list[tuple[str, dict]] = [("/generate_stream", {}), ("/generate", {"stream": True}),
                                             ("/", {"stream": True})]
        for route, body in streaming:
            r = http.post(route, json={**asked, **body})
            assert r.status_code == 422, (route, r.text)
            # TGI's words and error_type, which its clients map to their ValidationError.
            assert r.json()["error_type"] == "validation"
            tgi_words = "`decoder_input_details` == true is not supported when streaming tokens"
            assert tgi_words in r.json()["error"]


def test_text_generation_client_reads_prefill(
    openai_server: ServerProcess, want: tuple[list[int], torch.Tensor]
) -> None:
    require_module("text_generation")
    from text_generation import Client

    ids, lp = want
    client = Client(openai_server.base_url, headers=AUTH, timeout=60)
    out = client.generate(PROMPT, max_new_tokens=2, decoder_input_details=True)
    assert out.details is not None
    prefill = out.details.prefill
    assert [t.id for t in prefill] == ids and prefill[0].logprob is None
    assert prefill[-1].logprob == pytest.approx(lp[-2, ids[-1]].item(), abs=1e-4)


def test_huggingface_hub_reads_prefill(
    openai_server: ServerProcess, want: tuple[list[int], torch.Tensor]
) -> None:
    require_module("huggingface_hub")
    from huggingface_hub import InferenceClient

    ids, lp = want
    client = InferenceClient(model=openai_server.base_url, token=OPENAI_API_KEY, timeout=60)
    out = client.text_generation(PROMPT, max_new_tokens=2, details=True, decoder_input_details=True)
    assert out.details is not None and out.details.prefill is not None
    prefill = out.details.prefill
    assert [t.id for t in prefill] == ids and prefill[0].logprob is None
    assert prefill[1].logprob == pytest.approx(lp[0, ids[1]].item(), abs=1e-4)
