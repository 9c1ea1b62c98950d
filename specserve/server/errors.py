"""Error bodies as llama-server and OpenAI clients read them: `{"error": {"code", "message", "type"}}`."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
               503: "unavailable_error"}


def error_body(status: int, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"code": status, "message": message, "type": ERROR_TYPES.get(status, "server_error"), **extra}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(error_body(status, message, **extra), status_code=status, headers=headers)


class Unavailable(Exception):
    """503 with Retry-After: the queue is full or the server is shutting down."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        return error_response(503, str(self), headers={"Retry-After": str(self.retry_after)})

