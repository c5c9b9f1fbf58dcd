"""API keys and CORS: every route but the probes (and /metrics unless configured) needs a key."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from nanoserve.server.http.auth import is_public, key_matches
from nanoserve.server.http.error_dialects import family
from tests.server.asgi import AppClient, asgi_client

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEYS = ("first-secret-key-1234", "second-secret-key-5678")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_checkpoint) -> AsyncIterator[AppClient]:  # type: ignore[no-untyped-def]
    async with asgi_client(tiny_checkpoint, api_keys=",".join(KEYS), cors_origins="https://ok.example") as c:
        yield c


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


GEN = {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}


def protected_routes(client: AppClient) -> list[tuple[str, str]]:
    """Every (method, path) the app serves that is not public: new routers are covered too."""
    paths = client.app.openapi()["paths"]
    return [
        (method.upper(), path)
        for path, operations in paths.items()
        for method in operations
        if not is_public(method.upper(), path, metrics_require_auth=False)
    ]


async def test_every_protected_route_refuses_missing_and_wrong_keys(client: AppClient) -> None:
    routes = protected_routes(client)
    assert ("POST", "/generate") in routes and ("GET", "/info") in routes
    for method, path in routes:
        for headers, code in (({}, "missing_api_key"), (bearer("wrong-key-000000"), "invalid_api_key"),
                              ({"Authorization": "Basic Zm9vOmJhcg=="}, "missing_api_key")):
            r = await client.request(method, path, headers=headers, json=GEN)
            assert r.status_code == 401, (method, path, r.text)
            if family(method, path) == "tgi":  # TGI's shape on its routes, the shared one elsewhere
                assert r.json() == {"error": r.json()["error"], "error_type": code}
            else:
                error = r.json()["error"]
                assert error["code"] == code and error["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"


async def test_either_configured_key_is_accepted(client: AppClient) -> None:
    for key in KEYS:
        assert (await client.post("/generate", json=GEN, headers=bearer(key))).status_code == 200
        assert (await client.get("/info", headers=bearer(key))).status_code == 200


async def test_probes_and_metrics_stay_open(client: AppClient) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert (await client.get(path)).status_code == 200, path


async def test_metrics_can_require_a_key(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    async with asgi_client(tiny_checkpoint, api_keys=KEYS[0], metrics_require_auth=True) as c:
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.get("/metrics", headers=bearer(KEYS[0]))).status_code == 200
        assert (await c.get("/health")).status_code == 200


async def test_keys_never_reach_the_logs(client: AppClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        await client.post("/generate", json=GEN, headers=bearer(KEYS[0]))
        await client.post("/generate", json=GEN, headers=bearer("wrong-but-secret-999"))
        await client.get("/info", headers=bearer(KEYS[1]))
    assert any(r.name == "nanoserve.access" for r in caplog.records)  # the requests were logged
    for record in caplog.records:
        text = record.getMessage() + repr(record.__dict__)
        for secret in (*KEYS, "wrong-but-secret-999"):
            assert secret not in text


async def test_key_comparison() -> None:
    keys = [k.encode() for k in KEYS]
    assert key_matches(KEYS[1], keys)
    assert not key_matches(KEYS[1][:-1], keys) and not key_matches("", keys)
    assert not key_matches(KEYS[0] + "x", keys)
    assert not key_matches("\ud800", keys)  # a lone surrogate neither matches nor raises


async def test_cors_allows_only_configured_origins(client: AppClient) -> None:
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = await client.options("/generate", headers={"Origin": "https://ok.example", **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
    evil = await client.options("/generate", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in evil.headers
    # Refused in the path's error dialect, as JSON (Starlette answers it in plain text).
    assert evil.status_code == 400 and evil.headers["content-type"] == "application/json"
    assert evil.json()["error_type"] == "validation" and "CORS" in evil.json()["error"]
    evil = await client.options("/v1/chat/completions",
                                headers={"Origin": "https://evil.example", **preflight})
    assert evil.status_code == 400 and evil.json()["error"]["code"] == "cors_preflight_rejected"
    simple = await client.get("/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in simple.headers
    # A cross-origin page may read the chat route's count of dropped messages.
    ok = await client.get("/health", headers={"Origin": "https://ok.example"})
    exposed = ok.headers["access-control-expose-headers"].lower()
    assert "x-nanoserve-dropped-messages" in exposed and "x-request-id" in exposed


async def test_cors_is_off_unless_configured(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    async with asgi_client(tiny_checkpoint) as c:
        r = await c.get("/health", headers={"Origin": "https://ok.example"})
        assert "access-control-allow-origin" not in r.headers
        pre = await c.options("/generate", headers={"Origin": "https://ok.example",
                                                     "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in pre.headers


async def test_no_key_is_401_before_the_body_is_read(client: AppClient) -> None:
    # Without a key the body is never parsed: broken JSON, a wrong content type or a huge field are
    # all the same 401, so a caller without a key learns nothing about the request's validation.
    for content, ctype in ((b"{not json", "application/json"), (b"inputs=x", "text/plain"),
                           (b'{"inputs": 5}', "application/json")):
        r = await client.post("/generate", content=content, headers={"content-type": ctype})
        assert r.status_code == 401 and r.json()["error_type"] == "missing_api_key", r.text
    r = await client.post("/generate", content=b"{not json", headers={"content-type": "application/json",
                                                                      **bearer(KEYS[0])})
    assert r.status_code == 422


async def test_unknown_paths_and_trailing_slashes_neither_redirect_nor_disclose(client: AppClient) -> None:
    # No 307 whose Location comes from the Host header (an open redirect), before or after the key.
    evil = {"host": "evil.example"}
    for headers, status in ((evil, 401), ({**evil, **bearer(KEYS[0])}, 404)):
        for method, path in (("POST", "/generate/"), ("GET", "/info/"), ("GET", "/v1/models/"),
                             ("GET", "/no-such-route")):
            r = await client.request(method, path, headers=headers, json=GEN)
            assert r.status_code == status, (method, path, r.status_code)
            assert "location" not in r.headers and "evil.example" not in r.text


async def test_public_paths_are_exactly_the_documented_ones(client: AppClient) -> None:
    for path in ("/health", "/ready", "/metrics", "/", "/openapi.json", "/docs", "/redoc"):
        assert (await client.get(path)).status_code == 200, path
        head = await client.head(path)
        assert head.status_code == 200 and head.content == b"", path
    for path in ("/info", "/v1/models"):
        assert (await client.head(path)).status_code == 401, path
        assert (await client.get(path)).status_code == 401, path
    # Only reads are public: a POST to a public path still needs a key.
    assert (await client.post("/health")).status_code == 401


async def test_head_answers_as_get_without_a_body(client: AppClient) -> None:
    get = await client.get("/info", headers=bearer(KEYS[0]))
    head = await client.head("/info", headers=bearer(KEYS[0]))
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    assert head.headers["content-length"] == get.headers["content-length"]


async def test_info_shows_no_directories(tiny_checkpoint, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["provenance"] = {"command": "nanoserve train /home/alice/corpora/poems.txt --out /srv/m",
                            "commands": ["nanoserve train C:\\Users\\bob\\poems.txt"], "corpus": "poems.txt"}
    (ckpt / "config.json").write_text(json.dumps(config))
    async with asgi_client(ckpt) as c:
        info = (await c.get("/info")).json()
    prov = info["engine"]["provenance"]
    assert prov["command"] == "nanoserve train poems.txt --out m"
    assert prov["commands"] == ["nanoserve train poems.txt"] and prov["corpus"] == "poems.txt"
    assert "/home" not in json.dumps(info) and "Users" not in json.dumps(info)
