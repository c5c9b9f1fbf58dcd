"""A chat model imported from Hugging Face, served: its ChatML prompt is transformers' token for
token, and its reply ends at <|im_end|>, which never shows as text, on the OpenAI and TGI routes,
streamed or not. `serve --chat-template FILE` replaces the checkpoint's template, and a template
that cannot serve stops the start with one line."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from nanoserve.cli import main
from nanoserve.model.chat_template import render_chat
from nanoserve.model.checkpoint import load_checkpoint
from tests.conftest import require_module
from tests.model.chatml_llama import MESSAGES, REPLY, TEMPLATES, ChatMLLlama, save_chatml_llama
from tests.server.asgi import AppClient, asgi_client

END = "<|im_end|>"


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> ChatMLLlama:
    require_module("transformers")
    return save_chatml_llama(tmp_path_factory.mktemp("chatml-llama"))


@pytest.fixture(scope="module")
def imported(chatml: ChatMLLlama, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("imported") / "ckpt"
    assert main(["import-hf", str(chatml.path), str(out), "--name", "chatml"]) == 0
    return out


@pytest.fixture
async def client(imported: Path) -> AsyncIterator[AppClient]:
    async with asgi_client(imported, max_seqs=2) as c:
        yield c


def _sdk(client: AppClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="unused",
                              http_client=client)  # type: ignore[arg-type]  # an httpx.AsyncClient


async def test_the_openai_sdk_gets_the_reply_without_the_end_token(client: AppClient,
                                                                   chatml: ChatMLLlama) -> None:
    sdk = _sdk(client)
    done = await sdk.chat.completions.create(model="chatml", messages=MESSAGES,  # type: ignore[arg-type]
                                             max_tokens=16, temperature=0)
    assert done.choices[0].message.content == REPLY and done.choices[0].finish_reason == "stop"
    prompt = chatml.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert done.usage is not None and done.usage.prompt_tokens == len(prompt)
    assert done.usage.completion_tokens == len(REPLY) + 1  # "a", "b", <|im_end|>
    stream = await sdk.chat.completions.create(model="chatml", messages=MESSAGES,  # type: ignore[arg-type]
                                               max_tokens=16, temperature=0, stream=True)
    chunks = [chunk.choices[0] async for chunk in stream if chunk.choices]  # type: ignore[union-attr]
    assert "".join(c.delta.content or "" for c in chunks) == REPLY
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]


async def test_tgi_routes_end_at_the_end_token_with_finish_reason_eos_token(client: AppClient,
                                                                          imported: Path) -> None:
    ckpt = load_checkpoint(imported)
    prompt = render_chat(ckpt.chat_template, MESSAGES)
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 16, "details": True}}
    r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["generated_text"] == REPLY and out["details"]["finish_reason"] == "eos_token"
    last = out["details"]["tokens"][-1]
    assert last["text"] == "" and last["special"] is True  # the end token, named special, no text
    async with client.stream("POST", "/generate_stream", json=body) as s:
        events = [json.loads(line[5:]) async for line in s.aiter_lines() if line.startswith("data:")]
    assert "".join(e["token"]["text"] for e in events) == REPLY
    assert events[-1]["generated_text"] == REPLY and events[-1]["details"]["finish_reason"] == "eos_token"


async def test_without_end_tokens_the_turn_runs_on_as_text(imported: Path, tmp_path: Path) -> None:
    """The checkpoint as import-hf wrote it before end tokens: <|im_end|> came back as text."""
    old = shutil.copytree(imported, tmp_path / "old")
    manifest = json.loads((old / "config.json").read_text())
    del manifest["end_token_ids"]
    (old / "config.json").write_text(json.dumps(manifest))
    async with asgi_client(old) as client:
        done = await _sdk(client).chat.completions.create(
            model="chatml", messages=MESSAGES, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert (done.choices[0].message.content or "").startswith(REPLY + END)
    assert done.choices[0].finish_reason == "length"


async def test_chat_template_setting_replaces_the_checkpoints(imported: Path, chatml: ChatMLLlama,
                                                               tmp_path: Path) -> None:
    """Qwen2.5's ChatML opens with its own default system prompt where SmolLM2's has another."""
    qwen, user = TEMPLATES / "qwen2.5.jinja", MESSAGES[1:]
    async with asgi_client(imported, chat_template=qwen) as client:
        done = await _sdk(client).chat.completions.create(
            model="chatml", messages=user, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    ours = chatml.tokenizer.apply_chat_template(user, add_generation_prompt=True, return_dict=False)
    chatml.tokenizer.chat_template = qwen.read_text(encoding="utf-8")
    try:
        theirs = chatml.tokenizer.apply_chat_template(user, add_generation_prompt=True, return_dict=False)
    finally:
        chatml.tokenizer.chat_template = (TEMPLATES / "smollm2.jinja").read_text(encoding="utf-8")
    assert done.usage is not None and done.usage.prompt_tokens == len(theirs) != len(ours)


def _template(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "template.jinja"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(("text", "says"), [
    ("{% if %}", "does not compile: line 1"),
    ("{{ raise_exception('not for chat') }}", "cannot render a user message and a reply: not for chat"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "rendering took more than 1 s"),
    (None, "cannot read it"),
])
def test_a_chat_template_that_cannot_serve_stops_the_start_with_one_line(
    text: str | None, says: str, imported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from nanoserve.server import serve_cli

    def would_serve(self: Any) -> None:
        raise AssertionError("the server was about to open its port")

    monkeypatch.setattr(serve_cli.DrainingServer, "run", would_serve)
    for key in [k for k in os.environ if k.startswith("NANOSERVE_")]:
        monkeypatch.delenv(key)
    path = _template(tmp_path, text) if text is not None else tmp_path / "missing.jinja"
    status = main(["serve", "--checkpoint", str(imported), "--port", "0", "--device", "cpu",
                   "--chat-template", str(path)])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith(f"nanoserve serve: error: --chat-template {path}: ")
    assert says in err and "Traceback" not in err, err


async def test_a_conversation_the_template_refuses_is_a_400_in_its_words(imported: Path) -> None:
    async with asgi_client(imported, chat_template=TEMPLATES / "mistral.jinja") as client:
        sdk = _sdk(client)
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.chat.completions.create(model="chatml", messages=MESSAGES)  # type: ignore[arg-type]
        ok = await sdk.chat.completions.create(model="chatml", messages=MESSAGES[1:],  # type: ignore[arg-type]
                                               max_tokens=1)
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "messages"
    assert "Conversation roles must alternate user/assistant/user/assistant/..." in body["message"]
    assert ok.choices[0].finish_reason is not None


async def test_a_template_that_loops_on_some_conversations_is_cut_off_per_request(
    imported: Path, tmp_path: Path
) -> None:
    """It passes the two-message probe at start-up; a longer conversation makes it loop, and that
    request gets a 400 after the render's time bound, the server unharmed."""
    looping = _template(tmp_path, "{% if messages|length > 2 %}{% for i in range(100000) %}"
                                  "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
                                  "{% for m in messages %}{{ m.content }}{% endfor %}")
    async with asgi_client(imported, chat_template=looping) as client:
        sdk = _sdk(client)
        with pytest.raises(openai.BadRequestError, match="rendering took more than 1 s"):
            await sdk.chat.completions.create(model="chatml", messages=MESSAGES * 2)  # type: ignore[arg-type]
        ok = await sdk.chat.completions.create(model="chatml", messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
    assert ok.choices[0].finish_reason is not None
