"""Several checkpoints in one real server: each answered by its name, as it answers alone, at once."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import require_module, require_tool
from tests.server.conftest import metric_value
from tests.server.server import REPO_ROOT, ServerProcess, running_server, serve_command

SHAKESPEARE = REPO_ROOT / "checkpoints" / "shakespeare-char"
NAMES = REPO_ROOT / "checkpoints" / "baby-names"
PROMPTS = {"shakespeare-char": "ROMEO:\n", "baby-names": "\n"}


@pytest.fixture(scope="module")
def both() -> Any:
    with running_server(SHAKESPEARE, args=["--checkpoint", str(NAMES)]) as server:
        yield server


def _greedy(server: ServerProcess, model: str | None, prompt: str, tokens: int = 40) -> str:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        r = c.completions.create(model=model or "", prompt=prompt, max_tokens=tokens, temperature=0)
    assert r.model == (model or "shakespeare-char")
    return r.choices[0].text


def _greedy_tgi(server: ServerProcess, model: str, prompt: str, tokens: int = 40) -> str:
    from text_generation import Client

    client = Client(server.base_url, headers={"X-Model": model}, timeout=60)
    streamed = "".join(r.token.text for r in client.generate_stream(prompt, max_new_tokens=tokens)
                       if not r.token.special)
    assert client.generate(prompt, max_new_tokens=tokens).generated_text == streamed
    return streamed


def test_each_model_answers_by_name_as_it_answers_alone_concurrently(both: ServerProcess) -> None:
    alone = {}
    for name, path in (("shakespeare-char", SHAKESPEARE), ("baby-names", NAMES)):
        with running_server(path) as server:
            alone[name] = _greedy(server, name, PROMPTS[name])
    assert alone["shakespeare-char"] != alone["baby-names"]
    jobs = [(name, api) for name in alone for api in ("openai", "tgi") for _ in range(3)]
    def run(job: tuple[str, str]) -> tuple[str, str]:
        name, api = job
        return name, (_greedy if api == "openai" else _greedy_tgi)(both, name, PROMPTS[name])

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    for name, text in got:
        assert text == alone[name], name
    # No model named: the first one, as a one-model server answers today's clients.
    assert _greedy(both, None, PROMPTS["shakespeare-char"]) == alone["shakespeare-char"]
    r = httpx.post(both.base_url + "/generate", json={"inputs": "\n", "parameters": {"max_new_tokens": 4}})
    assert r.headers["X-Nanoserve-Model"] == "shakespeare-char"


def test_an_unknown_model_is_refused_naming_the_served_ones(both: ServerProcess) -> None:
    with openai.OpenAI(base_url=both.base_url + "/v1", api_key="none", max_retries=0) as c, \
            pytest.raises(openai.NotFoundError) as caught:
        c.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "model_not_found"
    assert "'shakespeare-char', 'baby-names'" in caught.value.message
    r = httpx.post(both.base_url + "/generate", json={"inputs": "hi"}, headers={"X-Model": "gpt-4"})
    assert r.status_code == 422 and "'shakespeare-char', 'baby-names'" in r.json()["error"]
    r = httpx.get(both.base_url + "/v1/models/gpt-4")
    assert r.status_code == 404 and "'baby-names'" in r.json()["error"]["message"]


def test_models_info_metrics_and_headers_list_every_model(both: ServerProcess) -> None:
    models = httpx.get(both.base_url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["shakespeare-char", "baby-names"]
    assert httpx.get(both.base_url + "/v1/models/baby-names").json()["max_model_len"] == 16
    info = httpx.get(both.base_url + "/info", headers={"X-Model": "baby-names"}).json()
    assert info["model_id"] == "baby-names" and info["window"] == 16
    assert [m["name"] for m in info["models"]] == ["shakespeare-char", "baby-names"]
    names = info["models"][1]
    assert info["model_sha"] == names["sha256"] and len(names["sha256"]) == 64
    assert info["model_version"] == names["version"] == f"sha256:{names['sha256'][:12]}@step{names['step']}"
    r = httpx.post(both.base_url + "/v1/completions",
                   json={"model": "baby-names", "prompt": "\n", "max_tokens": 2})
    assert r.headers["X-Nanoserve-Model"] == "baby-names"
    assert r.headers["X-Nanoserve-Model-Version"] == names["version"]
    metrics = httpx.get(both.base_url + "/metrics").text
    for name in ("shakespeare-char", "baby-names"):
        assert metric_value(metrics, f'nanoserve_model_ready{{model="{name}"}}') == 1
    assert metric_value(metrics, 'nanoserve_model_kv_slots_capacity{model="baby-names"}') > 0
    assert f'nanoserve_served_model_info{{model="baby-names",version="{names["version"]}"}} 1.0' in metrics


def test_two_models_of_one_name_stop_the_start(tmp_path: Path) -> None:
    command = serve_command(f"x={SHAKESPEARE}", 0, ["--checkpoint", f"x={NAMES}"])
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "two models are named 'x'" in done.stderr and "NAME=PATH" in done.stderr


def test_a_name_given_on_the_command_line_names_the_model() -> None:
    with running_server(f"bard={SHAKESPEARE}") as server:
        assert [m["id"] for m in httpx.get(server.base_url + "/v1/models").json()["data"]] == ["bard"]
        assert _greedy(server, "bard", "\n", 4)


def test_the_chat_page_picks_a_model(both: ServerProcess) -> None:
    from tests.server.test_chat_page import CHROMIUM_ARGS, wait_until

    chromium = require_tool("chromium", "the chat page is tested in a real browser")
    require_module("playwright")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page()
        sent: list[Any] = []
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/chat/completions")
                else None)
        page.goto(both.base_url + "/")
        wait_until(lambda: "shakespeare-char" in page.inner_text("#model"), what="the default model")
        picker = page.locator("#model-picker")
        assert picker.is_visible()
        assert [o.inner_text() for o in picker.locator("option").all()] == ["shakespeare-char", "baby-names"]
        picker.select_option("baby-names")
        wait_until(lambda: "baby-names · 16-token window" in page.inner_text("#model"), what="the pick")
        page.fill("#prompt", "hi")
        page.click("#send")
        wait_until(lambda: sent, what="the chat request")
        assert sent[0]["model"] == "baby-names"
        browser.close()


async def test_health_names_a_model_whose_engine_thread_is_gone(tiny_checkpoint: Path) -> None:
    from tests.server.asgi import asgi_client

    models = [str(tiny_checkpoint), f"two={tiny_checkpoint}"]
    async with asgi_client(tiny_checkpoint, models=models) as client:
        assert (await client.get("/health")).status_code == 200
        r = await client.post("/generate", json={"inputs": "hi"}, headers={"X-Model": "two"})
        assert r.status_code == 200 and r.headers["X-Nanoserve-Model"] == "two"
        (two,) = [m for m in client.app.state.registry if m.name == "two"]
        await two.engine.shutdown(0.0)
        r = await client.get("/health")
        assert r.status_code == 503 and "'two'" in r.json()["error"]["message"]
