"""The chat page: GET / and its static files, shipped as package data in server/static/.

The page is plain HTML, one script and one stylesheet (no build step, nothing from a CDN: a server may run
offline). It talks to the API like any client, so it needs no routes of its own beyond serving its files.
As llama-server does, the page itself needs no API key; the user types the key into the page, which sends it
with every API call.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_PREFIX = "/static/"


def is_page_path(path: str) -> bool:
    """Paths served without an API key and while the model loads (the page shows that state itself)."""
    return path == "/" or path.startswith(STATIC_PREFIX)


def install(app: FastAPI) -> None:
    """Plain Starlette routes, kept out of the OpenAPI schema: they are the page, not the API."""

    async def index(request: Request) -> Response:
        # no-cache: after an upgrade the browser must not pair an old page with a new script
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.add_route("/", index, methods=["GET"], include_in_schema=False)
    app.mount(STATIC_PREFIX.rstrip("/"), StaticFiles(directory=STATIC_DIR), name="static")
