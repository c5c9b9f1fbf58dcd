"""The chat page at GET /, in a real headless Chromium (Debian's package) driven by Playwright.

The server (shared with the OpenAI tests) runs with an API key, as a careful operator would deploy
it: the page itself must load without one, and the key typed into the page must carry its API calls.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from nanoserve.server.api.chat_page import STATIC_DIR
from tests.conftest import require_module, require_tool
from tests.server.conftest import OPENAI_API_KEY, metric_value
from tests.server.server import ServerProcess

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
XSS = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


@pytest.fixture(scope="module")
def server(openai_server: ServerProcess) -> ServerProcess:
    return openai_server


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = require_tool("chromium", "the chat page is tested in a real browser")
    require_module("playwright")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # Debian's Chromium: `playwright install` cannot download browsers here (nor in CI).
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield b
        b.close()


def wait_until(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll `check` from Python (the page's CSP forbids Playwright's in-page eval-based waits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_page_is_public_self_contained_and_locked_down(server: ServerProcess) -> None:
    page = httpx.get(server.base_url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert "http://" not in page.text and "https://" not in page.text  # no CDN, works offline
    for name in ("chat.js", "chat.css"):
        asset = httpx.get(f"{server.base_url}/static/{name}", timeout=10)
        assert asset.status_code == 200, name
        assert asset.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(server.base_url + "/static/chat.html.bak", timeout=10).status_code == 404
    # The API itself still wants the key.
    assert httpx.get(server.base_url + "/v1/models", timeout=10).status_code == 401
    # Model output and user text only ever enter the page as text.
    script = (STATIC_DIR / "chat.js").read_text(encoding="utf-8")
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink


def metrics(server: ServerProcess) -> str:
    return httpx.get(server.base_url + "/metrics", timeout=5).text


def assistant_text(page: Any) -> str:
    return str(page.locator(".msg.assistant .body").last.inner_text())


STOP_WHILE_STREAMING = """() => new Promise((resolve, reject) => {
  let first = null, done = false;
  const check = () => {
    const bodies = document.querySelectorAll(".msg.assistant .body");
    const len = bodies.length ? bodies[bodies.length - 1].textContent.length : 0;
    if (first === null && len >= 3) first = len;
    if (first !== null && len > first) {
      const stop = document.getElementById("stop");
      const enabled = !stop.disabled;
      const streaming = document.querySelectorAll(".msg.assistant.streaming").length;
      stop.click();
      done = true;
      resolve([first, len, enabled, streaming]);
    }
    return done;
  };
  // On every change to the page's text, not once per animation frame: a fast server keeps the
  // page's main thread busy with stream chunks and frames can wait until the reply has ended.
  const watcher = new MutationObserver(() => { if (check()) watcher.disconnect(); });
  watcher.observe(document.body, { subtree: true, childList: true, characterData: true });
  const fail = () => {
    watcher.disconnect();
    const metas = document.querySelectorAll(".msg.assistant .meta");
    const state = `first=${first}; reply: ${metas.length ? metas[metas.length - 1].textContent : "none"}; ` +
      `status: ${document.getElementById("status").textContent}`;
    reject(new Error("no streamed tokens within 30 s (" + state + ")"));
  };
  setTimeout(() => { if (!done) fail(); }, 30000);
  // Send only now: the watcher must be in place before the reply starts (under load the page's
  // thread was busy with the whole 4000-token reply before a watcher installed after the click ran).
  document.getElementById("send").click();
})"""


def test_type_send_stream_and_stop(browser: Any, server: ServerProcess) -> None:
    page = browser.new_page(viewport={"width": 1100, "height": 700})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.base_url + "/")
    wait_until(lambda: "API key required" in page.inner_text("#model"), what="the page to ask for a key")
    page.fill("#api-key", OPENAI_API_KEY)
    page.press("#api-key", "Tab")  # "change" stores the key and reloads the model list
    wait_until(lambda: "tiny-test" in page.inner_text("#model"), what="the model name")

    # Greedy, so the replies are fixed by the checkpoint (a random turn-ending "\n\n" cannot flake).
    page.fill("#temperature", "0")
    assert page.inner_text("#temperature-value") == "0.00"
    # A short reply runs to its token limit.
    page.fill("#max-tokens", "5")
    page.fill("#prompt", "Good morrow")
    page.press("#prompt", "Enter")
    last_meta = page.locator(".msg.assistant .meta").last
    meta = wait_until(lambda: "finish: length" in (m := last_meta.inner_text()) and m,
                      what="the first reply to finish")
    assert "5 tokens" in meta and "tok/s" in meta
    assert page.locator(".msg.user .body").first.inner_text() == "Good morrow"
    assert len(assistant_text(page)) > 0

    # A long reply streams in and the Stop button ends it.
    cancelled = 'nanoserve_requests_cancelled_total{route="/v1/chat/completions"}'
    ran_out = 'nanoserve_requests_finished_total{finish_reason="length",route="/v1/chat/completions"}'
    assert metric_value(metrics(server), ran_out) >= 1  # the first reply ran out: the series is named right
    page.fill("#max-tokens", "4000")
    # The tiny model streams its 4000 tokens in ~1.5 s: under the full suite's load the browser's
    # abort has reached the server after the last token (the server then rightly counts a finished
    # request, not a cancelled one). Such a try shows nothing about cancelling: try again, and
    # fail only if the server never cancels.
    for _ in range(3):
        m = metrics(server)
        was = {series: metric_value(m, series) for series in (cancelled, ran_out)}
        page.fill("#prompt", "Tell me everything")
        # Send, watch and click Stop inside the page, on the change that shows more text arriving:
        # from Python, on an idle machine, the reply could finish between a check that Stop is
        # enabled and the click.
        first_len, clicked_len, was_enabled, streaming = page.evaluate(STOP_WHILE_STREAMING)
        assert clicked_len > first_len >= 3  # streamed in pieces, not at once
        assert was_enabled and streaming == 1
        page.wait_for_selector("body[data-busy=false]", timeout=10_000)
        assert "finish: stopped" in page.locator(".msg.assistant .meta").last.inner_text()
        stopped = assistant_text(page)
        time.sleep(0.5)
        assert assistant_text(page) == stopped and page.is_disabled("#stop")
        assert "finish: stopped" in page.inner_text("#status")
        # The server ended the generation one way or the other and freed its slot.
        def ended(was: dict[str, float] = was) -> bool:
            m = metrics(server)
            return (any(metric_value(m, series) == was[series] + 1 for series in was)
                    and "nanoserve_running_sequences 0.0" in m)

        wait_until(ended, what="the server to end the stopped generation")
        if metric_value(metrics(server), cancelled) == was[cancelled] + 1:
            break  # cancelled rather than run to its 4000 tokens
    else:
        raise AssertionError("the server ran each of 3 stopped generations to its end")
    page.screenshot(path="/tmp/nanoserve-chat-page.png")
    assert errors == []
    page.close()


def sse_body(pieces: list[str], ending: str | None = None) -> str:
    """A chat completion stream; `ending` replaces the finish chunk and `[DONE]` when given."""

    def chunk(delta: dict[str, str], finish: str | None = None) -> str:
        data = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return "data: " + json.dumps(data) + "\n\n"

    events = [chunk({"role": "assistant", "content": ""})] + [chunk({"content": p}) for p in pieces]
    return "".join(events) + (ending if ending is not None else chunk({}, "stop") + "data: [DONE]\n\n")


def test_model_output_is_rendered_as_text_never_html(browser: Any, server: ServerProcess) -> None:
    # CSP bypassed on purpose: the page must be safe by construction, not only thanks to the CSP.
    context = browser.new_context(bypass_csp=True)
    page = context.new_page()
    dialogs: list[str] = []

    def on_dialog(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", on_dialog)
    # The model's reply, as the network delivers it, is hostile markup split across chunks.
    pieces = ["Here: <scr", "ipt>window.__pwned = 1</script>", '<img src=x onerror="alert(2)">', " end"]
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=sse_body(pieces)))
    page.goto(server.base_url + "/")
    page.fill("#prompt", XSS)
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant .meta:has-text('finish: stop')", timeout=10_000)
    assert assistant_text(page) == "".join(pieces)
    assert page.locator(".msg.user .body").last.inner_text() == XSS
    assert page.locator("#transcript script, #transcript img").count() == 0
    time.sleep(0.3)  # an injected onerror would have fired by now
    assert page.evaluate("() => window.__pwned") is None
    assert dialogs == []
    context.close()


def test_the_reply_says_when_old_messages_were_left_out(browser: Any, server: ServerProcess) -> None:
    # The server's header (a real server's is tested in test_openai.py) reaches the reply's line.
    page = browser.new_page()
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, body=sse_body(["Anon."]),
        headers={"Content-Type": "text/event-stream", "X-Nanoserve-Dropped-Messages": "3"}))
    page.goto(server.base_url + "/")
    page.fill("#prompt", "Once more")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant .meta:has-text('finish: stop')", timeout=10_000)
    assert "3 oldest messages left out" in page.locator(".msg.assistant .meta").last.inner_text()
    page.close()


def test_errors_are_shown_in_the_transcript(browser: Any, server: ServerProcess) -> None:
    page = browser.new_page()
    page.goto(server.base_url + "/")
    page.fill("#api-key", OPENAI_API_KEY)
    page.press("#api-key", "Tab")
    wait_until(lambda: "tiny-test" in page.inner_text("#model"), what="the model name")
    # Refused before streaming: the server's own 400 message, naming the field.
    page.fill("#max-tokens", "5000")
    page.fill("#prompt", "Hello")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.error", timeout=10_000)
    assert "400: max_tokens is 5000, more than this server's limit" in page.inner_text(".msg.error")
    assert "finish: error" in page.inner_text("#status")
    # Failed after the 200: the stream's `event: error` ends the reply, its message shown.
    failure = {"error": {"message": "generation failed: <b>boom</b>", "type": "server_error",
                         "code": "generation_error", "param": None}}
    body = sse_body(["partial"], ending="event: error\ndata: " + json.dumps(failure) + "\n\n")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    page.fill("#max-tokens", "5")
    page.fill("#prompt", "Again")
    page.press("#prompt", "Enter")
    wait_until(lambda: page.locator(".msg.error").count() == 2, what="the in-stream error")
    assert page.locator(".msg.error .body").last.inner_text() == "generation failed: <b>boom</b>"
    assert page.locator("#transcript b").count() == 0
    page.close()
