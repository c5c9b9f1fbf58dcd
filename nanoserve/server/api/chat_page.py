"""GET /: the built-in chat page, and the two files it loads from /static.

The page is three static files with no external asset (it works offline). It needs no API key to
load — it holds no data; the key, if the server wants one, is typed into the page and sent with
every /v1 request. A strict Content-Security-Policy allows only this origin's own script, style
and API, as a second line of defence behind the page never inserting text as HTML.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
# Exactly the files the page is made of: nothing else in the package is reachable by name.
ASSETS = {"chat.js": "text/javascript; charset=utf-8", "chat.css": "text/css; charset=utf-8"}

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidate (ETag) so an upgraded server never runs a stale script against a new API.
    "Cache-Control": "no-cache",
}

router = APIRouter(tags=["chat page"])


@router.get("/", response_class=FileResponse,
            responses={200: {"description": "The chat page.", "content": {"text/html": {}}}})
async def chat_page() -> FileResponse:
    """The chat page (HTML)."""
    return FileResponse(STATIC_DIR / "chat.html", media_type="text/html; charset=utf-8",
                        headers=SECURITY_HEADERS)


@router.get("/static/{name}", include_in_schema=False)
async def chat_asset(name: str) -> FileResponse:
    """The chat page's script and style sheet."""
    media_type = ASSETS.get(name)
    if media_type is None:
        raise HTTPException(status_code=404, detail=f"no static file {name!r}")
    return FileResponse(STATIC_DIR / name, media_type=media_type, headers=SECURITY_HEADERS)
