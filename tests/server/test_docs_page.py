"""GET /docs works with no network: the page loads Swagger UI from this server, never a CDN, and
every URL it references answers here."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest

from nanoserve.server.app import create_app
from nanoserve.server.settings import Settings

# src="..." / href="..." attributes, and the quoted strings of the page's own script (its `url:`).
_REFERENCES = re.compile(r"""(?:src|href)="([^"]+)"|url:\s*'([^']+)'""")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """The app without its lifespan: the docs page and the document need no model."""
    # With keys on: the page, its files and the document are public all the same.
    app = create_app(Settings(device="cpu", api_keys="a-long-test-key"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        yield c


async def test_the_docs_page_references_only_this_server(client: httpx.AsyncClient) -> None:
    page = await client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text  # no CDN, no validator badge
    urls = {a or b for a, b in _REFERENCES.findall(page.text)}
    assert urls == {"/static/swagger-ui/swagger-ui.css", "/static/swagger-ui/favicon-32x32.png",
                    "/static/swagger-ui/swagger-ui-bundle.js", "/openapi.json"}
    types = {}
    for url in urls:
        r = await client.get(url)
        assert r.status_code == 200 and r.content, url
        types[url] = r.headers["content-type"].split(";")[0]
    assert types["/static/swagger-ui/swagger-ui-bundle.js"] == "text/javascript"
    assert types["/static/swagger-ui/swagger-ui.css"] == "text/css"
    assert types["/openapi.json"] == "application/json"
    bundle = (await client.get("/static/swagger-ui/swagger-ui-bundle.js")).text
    assert "SwaggerUIBundle" in bundle  # the real library, not a stub


async def test_the_oauth2_page_and_only_the_vendored_files_are_served(client: httpx.AsyncClient) -> None:
    assert (await client.get("/docs/oauth2-redirect")).status_code == 200
    for name in ("LICENSE", "README.md", "../chat.html", "swagger-ui-bundle.js.LICENSE.txt"):
        assert (await client.get(f"/static/swagger-ui/{name}")).status_code == 404, name
