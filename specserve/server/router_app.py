"""The HTTP front of router mode (server/model_router.py): the model list and load/unload endpoints here, every
other request forwarded to its model's own server, chosen by the body's `model` field (POST) or the `model` query
parameter (GET), as llama-server routes. Answers, streams included, pass through as the model's server gives
them; a client that goes away closes the forwarded request, which cancels its generation there."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from specserve.server import webui
from specserve.server.api_keys import key_index
from specserve.server.errors import error_response
from specserve.server.model_router import ModelEntry, ModelInstances

PUBLIC = ("/health", "/v1/health")
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-authorization", "host",
               "content-length", "authorization", "x-api-key"}


def _model_named(body: bytes, request: Request) -> str | None:
    if request.method == "POST" and body:
        with contextlib.suppress(ValueError):
            data = json.loads(body)
            if isinstance(data, dict) and isinstance(data.get("model"), str):
                return data["model"]
    return request.query_params.get("model")


def _autoload(request: Request) -> bool | None:
    value = request.query_params.get("autoload")
    return None if value is None else value.lower() in ("1", "true", "on", "yes")


def create_router_app(instances: ModelInstances, api_keys: list[str], webui_on: bool = True,
                      cors_origins: list[str] | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await instances.start()
        try:
            yield
        finally:
            await instances.close()

    app = FastAPI(title="specserve (router)", lifespan=lifespan, docs_url=None, redoc_url=None)
    if webui_on:
        webui.install(app)  # the chat page, with its model picker (before the catch-all route)

    @app.middleware("http")
    async def check_key(request: Request, call_next: Any) -> Response:
        path = request.url.path
        allowed = (not api_keys or path in PUBLIC or (webui_on and webui.is_page_path(path))
                   or key_index(request.headers, api_keys) is not None)
        return await call_next(request) if allowed else error_response(401, "Invalid API Key", path=request.url.path)

    if cors_origins:  # outermost: preflights name no model and carry no key; the router answers them itself
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"], max_age=600)

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/models")
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        instances.check_crashed()
        return {"object": "list", "data": [e.listing() for e in instances.models.values()]}

    async def _named(request: Request) -> tuple[str, Response | None]:
        try:
            name = (await request.json())["model"]
        except (ValueError, KeyError, TypeError):
            return "", error_response(400, 'give the model: {"model": NAME}')
        if name not in instances.models:
            return name, _unknown(name)
        return name, None

    async def on_model(request: Request, action: Callable[[str], Awaitable[object]]) -> Response:
        name, error = await _named(request)
        if error is not None:
            return error
        try:
            await action(name)
        except LookupError as exc:  # (unload: not loaded)
            return error_response(400, str(exc))
        except RuntimeError as exc:  # (load: its server failed to start)
            return error_response(500, str(exc))
        return JSONResponse({"success": True})

    @app.post("/models/load")
    async def load(request: Request) -> Response:
        return await on_model(request, instances.load)

    @app.post("/models/unload")
    async def unload(request: Request) -> Response:
        return await on_model(request, instances.unload)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "OPTIONS"])
    async def forward(request: Request, path: str) -> Response:
        body = await request.body()
        name = _model_named(body, request) or _only_model(instances)
        if name is None:
            return error_response(400, "this server routes by model: name one (the `model` field, or ?model= on a "
                                       "GET); GET /v1/models lists them", path=request.url.path)
        if name not in instances.models:
            return _unknown(name, request.url.path)
        try:
            entry = await instances.ready(name, _autoload(request))
        except LookupError as exc:
            return error_response(400, str(exc), path=request.url.path)
        except RuntimeError as exc:
            return error_response(500, str(exc), path=request.url.path)
        return await _send(instances, entry, request, body)

    return app


def _only_model(instances: ModelInstances) -> str | None:
    """The model a request without a name means: the one loaded, or the one known; else None."""
    loaded = [e.id for e in instances.models.values() if e.status == "loaded"]
    candidates = loaded if len(loaded) == 1 else list(instances.models) if len(instances.models) == 1 else []
    return candidates[0] if candidates else None


def _unknown(name: str, path: str = "") -> Response:
    return error_response(404, f"model '{name}' not found (GET /v1/models lists them)", path=path,
                          type="model_not_found")


async def _send(instances: ModelInstances, entry: ModelEntry, request: Request, body: bytes) -> Response:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    headers["authorization"] = f"Bearer {entry.key}"
    url = entry.url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
    try:
        upstream = await instances.client.send(
            instances.client.build_request(request.method, url, headers=headers, content=body), stream=True)
    except httpx.TransportError as exc:  # its process ended under the request
        instances.check_crashed()
        return error_response(502, f"model '{entry.id}' did not answer: {exc}", path=request.url.path)
    # (the model's own CORS headers go: the router adds its own, and a browser refuses two)
    out_headers = {k: v for k, v in upstream.headers.items()
                   if k.lower() not in HOP_HEADERS and not k.lower().startswith("access-control-")}
    return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code, headers=out_headers,
                             background=BackgroundTask(upstream.aclose))
