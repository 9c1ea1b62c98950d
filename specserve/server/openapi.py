"""The OpenAPI schema (GET /openapi.json): every route with its request body and its answers.

The routes read their bodies themselves (to parse them off the event loop and word errors as
llama-server), so FastAPI sees no body parameter: each route's request schema comes from the pydantic
model its handler parses, put in through `openapi_extra`, and the models' JSON schemas are added to the
components once.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. n_prompt_tokens and n_ctx, param
    code: int | str
    message: str
    type: str


class ErrorBody(BaseModel):
    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """Errors on the Anthropic Messages endpoints."""

    type: str
    error: AnthropicErrorDetail


_models: list[type[BaseModel]] = [ErrorBody, AnthropicErrorBody]


# One server-sent event of a stream (as OpenAPI 3.2's itemSchema for text/event-stream, which fuzzers apply
# to each event): `data` holds a JSON chunk, or `[DONE]` at the end of an OpenAI stream.
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                               "id": {"type": "string"}}}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def operation(body: type[BaseModel] | None = None, *, stream: bool = False, text: bool = False,
              array: bool = False, not_supported: bool = False, anthropic: bool = False) -> dict[str, Any]:
    """openapi_extra for a route: the body it parses, its 200 answer (a JSON object, or array; SSE if it
    streams, or text) and the errors any route may answer; not_supported: a 501 when a flag turned the
    endpoint off; anthropic: its errors have Anthropic's shape."""
    error_schema = _ref(AnthropicErrorBody if anthropic else ErrorBody)

    def _error(description: str) -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": error_schema}}}

    answer = {"type": "array", "items": {"type": "object"}} if array else {"type": "object"}
    ok: dict[str, Any] = {"application/json": {"schema": answer}}
    if stream:
        ok["text/event-stream"] = {"schema": _SSE_EVENT}
    if text:
        ok = {"text/plain": {"schema": {"type": "string"}}}
    out: dict[str, Any] = {"responses": {
        "200": {"description": "OK (with \"stream\": true, server-sent events)" if stream else "OK", "content": ok},
        "401": _error("missing or wrong API key (when the server has one)"),
        "413": _error("request body larger than --max-body-bytes"),
        "503": _error("loading the model, queue full (--max-queue) or shutting down; see Retry-After"),
    }}
    if not_supported:
        out["responses"]["501"] = _error("not offered by this server as started (e.g. --no-slots, no "
                                         "--slot-save-path, embeddings on a --remote runner)")
    if body is not None:
        if body not in _models:
            _models.append(body)
        out["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
        out["responses"]["400"] = _error("invalid request")
        out["responses"]["404"] = _error("unknown model (OpenAI and Anthropic endpoints), or previous_response_id")
        out["responses"]["500"] = _error("the generation failed")
    return out


def install(app: FastAPI) -> None:
    """Make app.openapi() include the request models (call it after the routes are added)."""

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                              description="llama-server and OpenAI compatible inference server")
            _, defs = models_json_schema([(m, "validation") for m in _models], ref_template=REF)
            doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]
