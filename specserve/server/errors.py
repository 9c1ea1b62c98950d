"""Error bodies as llama-server and OpenAI clients read them: `{"error": {"code", "message", "type"}}`; on the
Anthropic Messages endpoints as Anthropic's clients read them: `{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from specserve.errors import SpecserveError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
               501: "not_supported_error", 503: "unavailable_error"}


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                         429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def error_body(status: int, message: str, **extra: Any) -> dict[str, Any]:
    """extra adds fields to the error object (or replaces `type`)."""
    return {"error": {"code": status, "message": message, "type": ERROR_TYPES.get(status, "server_error"), **extra}}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


def speaks_anthropic(path: str) -> bool:
    """Whether errors on this path take Anthropic's shape."""
    return path.rstrip("/") in ANTHROPIC_PATHS


def error_response(status: int, message: str, headers: dict[str, str] | None = None, *, path: str = "",
                   **extra: Any) -> JSONResponse:
    """The error answer; `path`: the request's, whose API may word errors its own way (extra is then left out)."""
    body = anthropic_error_body(status, message) if speaks_anthropic(path) else error_body(status, message, **extra)
    return JSONResponse(body, status_code=status, headers=headers)


class Unavailable(Exception):
    """503 with Retry-After: the queue is full or the server is shutting down."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after

    def response(self, path: str = "") -> JSONResponse:
        return error_response(503, str(self), headers={"Retry-After": str(self.retry_after)}, path=path)


class RequestError(SpecserveError):
    """A bad request whose answer is more than a 400 with a message."""

    status = 400

    def response(self) -> JSONResponse:
        raise NotImplementedError


class ContextSizeError(RequestError):
    """A prompt that leaves no room in a slot: 400 `exceed_context_size_error`, as llama-server."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int):
        super().__init__(f"the prompt ({n_prompt_tokens} tokens) is longer than the slot context allows "
                         f"({n_ctx} tokens per slot, including at least one generated token)")
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx

    def response(self) -> JSONResponse:
        return error_response(400, str(self), type="exceed_context_size_error",
                              n_prompt_tokens=self.n_prompt_tokens, n_ctx=self.n_ctx)
