"""The OpenAPI schema covers every route, with the request body each one parses (no server process)."""

from __future__ import annotations

from typing import Any

from fastapi.routing import APIRoute

from specserve.server.app import create_app
from specserve.server.settings import ServerSettings


def schema_and_routes() -> tuple[dict[str, Any], list[APIRoute]]:
    app = create_app(ServerSettings())  # the model loads only when the app starts: not here
    return app.openapi(), [r for r in app.routes if isinstance(r, APIRoute)]


def resolve(doc: dict[str, Any], ref: str) -> dict[str, Any]:
    assert ref.startswith("#/components/schemas/"), ref
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]]


def refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [value["$ref"]] if "$ref" in value else [r for v in value.values() for r in refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in refs(v)]
    return []


def test_every_route_is_in_the_schema_with_its_body() -> None:
    doc, routes = schema_and_routes()
    assert doc["openapi"].startswith("3.")
    assert len(routes) >= 15
    for route in routes:
        for method in route.methods:
            op = doc["paths"][route.path][method.lower()]
            assert {"200", "401", "413", "503"} <= op["responses"].keys(), route.path
            if method == "POST":
                body = op["requestBody"]["content"]["application/json"]["schema"]
                want = "array" if route.path == "/lora-adapters" else "object"  # (llama-server's [{id, scale}])
                assert resolve(doc, body["$ref"])["type"] == want, route.path
                assert "400" in op["responses"]
    for ref in refs(doc):  # nothing dangles
        resolve(doc, ref)


def test_request_schemas_name_the_fields_the_server_reads() -> None:
    doc, _ = schema_and_routes()
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]
    assert completion["required"] == ["prompt"]
    assert {"n_predict", "stream", "ignore_eos", "speculative.n_max", "speculative.type"} <= \
        completion["properties"].keys()
    assert completion["properties"]["top_p"]["anyOf"][0]["maximum"] == 1
    chat = schemas["ChatRequest"]
    assert "messages" in chat["required"] and {"model", "parse_special", "max_tokens"} <= chat["properties"].keys()
    assert schemas["TokenizeRequest"]["required"] == ["content"]
    assert {"code", "message", "type"} <= set(schemas["ErrorDetail"]["required"])
    sse = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert {"application/json", "text/event-stream"} <= sse.keys()
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_new_apis_and_their_error_shapes() -> None:
    doc, _ = schema_and_routes()
    schemas = doc["components"]["schemas"]
    assert "input" in schemas["ResponsesRequest"]["properties"]
    assert {"max_tokens", "messages"} <= set(schemas["MessagesRequest"]["required"])
    for path, error in (("/v1/responses", "ErrorBody"), ("/v1/messages", "AnthropicErrorBody"),
                        ("/v1/messages/count_tokens", "AnthropicErrorBody")):
        answer = doc["paths"][path]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
        assert answer["$ref"].endswith("/" + error), path
    assert set(schemas["AnthropicErrorBody"]["required"]) == {"type", "error"}
