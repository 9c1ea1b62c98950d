"""The ASGI app: llama-server's native endpoints and the OpenAI-compatible ones.

The model loads in a background thread after the server is listening, so `/health`
answers 503 while loading and 200 once ready. Generation requests are tokenized here,
queued in the scheduler, and their events come back through an asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from specserve import __version__
from specserve.engine.tasks import Chunk, Event, Failure, Result, Task, TaskHandle
from specserve.errors import SpecserveError
from specserve.server import metrics
from specserve.server.engine import Engine, ServerSettings
from specserve.server.formats import ChatFormat, CompletionFormat, Format, NativeFormat
from specserve.server.schemas import (
    ApplyTemplateRequest,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAICompletionRequest,
    TokenizeRequest,
    parse_body,
)

log = logging.getLogger(__name__)

PUBLIC_PATHS = {"/health", "/v1/health", "/models", "/v1/models"}  # no API key needed (as llama-server)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 500: "server_error", 503: "unavailable_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"code": status, "message": message, "type": ERROR_TYPES.get(status, "server_error")}}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


@dataclass
class ServerState:
    settings: ServerSettings
    api_key: str | None = None
    engine: Engine | None = None
    load_error: str | None = None


class GateMiddleware:
    """API key check and 'still loading' answers, before any endpoint runs (streaming-safe pure ASGI)."""

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status, message = 0, ""
        if self.state.api_key and path not in PUBLIC_PATHS and not self._key_ok(scope):
            status, message = 401, "Invalid API Key"
        elif self.state.engine is None and path not in ("/health", "/v1/health"):
            status, message = 503, "Loading model"
        if status:
            await error_response(status, message)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _key_ok(self, scope: Scope) -> bool:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-api-key") or ""
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return bool(given) and hmac.compare_digest(given.encode(), (self.state.api_key or "").encode())


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ClientGone(Exception):
    pass


_DISCONNECTED = object()


def _subscribe(engine: Engine, task: Task) -> tuple[TaskHandle, asyncio.Queue[Any]]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def emit(event: Event) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, event)

    return engine.scheduler.submit(task, emit), queue


async def _watch_disconnect(request: Request, handle: TaskHandle, queue: asyncio.Queue[Any]) -> None:
    """The body is read already, so the next ASGI message is the client hanging up."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            queue.put_nowait(_DISCONNECTED)
            return


async def _collect(request: Request, engine: Engine, task: Task) -> tuple[list[Chunk], Result]:
    handle, queue = _subscribe(engine, task)
    watcher = asyncio.create_task(_watch_disconnect(request, handle, queue))
    try:
        chunks: list[Chunk] = []
        while True:
            event = await queue.get()
            if isinstance(event, Chunk):
                chunks.append(event)
            elif isinstance(event, Result):
                return chunks, event
            elif isinstance(event, Failure):
                raise RuntimeError(event.message)
            else:
                raise ClientGone()
    finally:
        watcher.cancel()
        handle.cancel()  # no-op when finished; frees the slot when the request was abandoned


async def _stream(engine: Engine, task: Task, fmt: Format) -> AsyncIterator[str]:
    handle, queue = _subscribe(engine, task)
    try:
        for obj in fmt.start():
            yield sse(obj)
        while True:
            event = await queue.get()
            if isinstance(event, Chunk):
                obj = fmt.chunk(event)
                if obj is not None:
                    yield sse(obj)
            elif isinstance(event, Result):
                for obj in fmt.final(event):
                    yield sse(obj)
                break
            else:
                yield sse(error_body(500, event.message))
                break
        if fmt.done_marker:
            yield "data: [DONE]\n\n"
    finally:
        # Runs also when Starlette cancels the stream because the client disconnected.
        handle.cancel()


async def _respond(request: Request, engine: Engine, task: Task, fmt: Format, stream: bool) -> Response:
    if stream:
        return StreamingResponse(_stream(engine, task, fmt), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        chunks, result = await _collect(request, engine, task)
    except ClientGone:
        return Response(status_code=499)
    except RuntimeError as exc:
        return error_response(500, str(exc))
    return JSONResponse(fmt.body(chunks, result))


def create_app(settings: ServerSettings, api_key: str | None = None, *, engine: Engine | None = None,
               on_load_error: Callable[[str], None] | None = None, progress: bool = True) -> FastAPI:
    """The app; without `engine` the model loads in a background thread at startup."""
    state = ServerState(settings, api_key or None, engine)

    def load() -> None:
        try:
            state.engine = Engine.load(settings, progress=progress)
            log.info("model loaded, server ready")
        except Exception as exc:  # SpecserveError, bad files, out of memory: the server cannot serve
            state.load_error = str(exc) if isinstance(exc, SpecserveError) else f"{type(exc).__name__}: {exc}"
            log.error("loading failed: %s", state.load_error)
            if on_load_error is not None:
                on_load_error(state.load_error)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.engine is None:
            threading.Thread(target=load, name="specserve-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="specserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    app.add_middleware(GateMiddleware, state=state)
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SpecserveError)
    async def bad_request(request: Request, exc: SpecserveError) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, f"invalid request: {exc.errors()[:3]}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def _add_routes(app: FastAPI, state: ServerState) -> None:
    def eng() -> Engine:
        assert state.engine is not None  # GateMiddleware answers 503 before this
        return state.engine

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> Response:
        if state.engine is None:
            message = f"Loading failed: {state.load_error}" if state.load_error else "Loading model"
            return error_response(503, message)
        return JSONResponse({"status": "ok"})

    @app.post("/completion")
    @app.post("/completions")
    async def completion(request: Request) -> Response:
        req = parse_body(CompletionRequest, await request.body())
        engine = eng()
        prompt = await run_in_threadpool(engine.tokenize_prompt, req.prompt)
        n_predict = req.n_predict if req.n_predict is not None else req.max_tokens
        task = engine.make_task(req, prompt, n_predict, req.n_probs)
        return await _respond(request, engine, task, NativeFormat(engine, task, req.return_tokens), req.stream)

    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Response:
        req = parse_body(OpenAICompletionRequest, await request.body())
        engine = eng()
        prompt = await run_in_threadpool(engine.tokenize_prompt, req.prompt)
        task = engine.make_task(req, prompt, req.max_tokens, req.logprobs or 0)
        echo = ""
        if req.echo:
            echo = req.prompt if isinstance(req.prompt, str) else engine.tokenizer.decode(prompt)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _respond(request, engine, task, CompletionFormat(engine, task, echo, include_usage), req.stream)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_body(ChatRequest, await request.body())
        engine = eng()
        prompt = await run_in_threadpool(engine.chat_prompt, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        n_probs = (req.top_logprobs or 1) if req.logprobs else 0
        task = engine.make_task(req, prompt, max_tokens, n_probs)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await _respond(request, engine, task, ChatFormat(engine, task, include_usage), req.stream)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse_body(TokenizeRequest, await request.body())
        tok = eng().tokenizer
        ids = tok.encode(req.content, add_special=req.add_special, parse_special=req.parse_special)
        if not req.with_pieces:
            return JSONResponse({"tokens": ids})
        pieces = []
        for i in ids:
            raw = tok.token_bytes(i)
            try:
                piece: str | list[int] = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)  # a partial character: llama-server sends the bytes
            pieces.append({"id": i, "piece": piece})
        return JSONResponse({"tokens": pieces})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse_body(DetokenizeRequest, await request.body())
        return JSONResponse({"content": eng().tokenizer.decode(req.tokens)})

    @app.post("/apply-template")
    async def apply_template(request: Request) -> Response:
        req = parse_body(ApplyTemplateRequest, await request.body())
        return JSONResponse({"prompt": await run_in_threadpool(eng().render_chat, req)})

    @app.get("/props")
    async def props() -> Response:
        engine = eng()
        tok = engine.tokenizer
        return JSONResponse({
            "default_generation_settings": {"n_ctx": engine.n_ctx, "params": engine.default_params()},
            "total_slots": engine.runner.n_seqs,
            "model_alias": engine.model_name,
            "model_path": str(engine.model_path),
            "draft_model_path": str(engine.draft_runner.gguf.path) if engine.draft_runner else None,
            "chat_template": tok.chat_template or "",
            "bos_token": tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
            "eos_token": tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
            "modalities": {"vision": False, "audio": False},
            "build_info": f"specserve {__version__}",
        })

    @app.get("/slots")
    async def slots() -> Response:
        return JSONResponse(eng().scheduler.slots_json())

    @app.get("/models")
    @app.get("/v1/models")
    async def models() -> Response:
        engine = state.engine
        if engine is None:
            return error_response(503, "Loading model")
        cfg = engine.runner.config
        meta = {"vocab_type": 2, "n_vocab": cfg.vocab_size, "n_ctx_train": cfg.context_length,
                "n_embd": cfg.hidden, "size": engine.runner.file_bytes}
        return JSONResponse({"object": "list", "data": [
            {"id": engine.model_name, "object": "model", "created": engine.created, "owned_by": "specserve",
             "meta": meta}]})

    registry = metrics.make_registry(lambda: state.engine.scheduler.counters_snapshot() if state.engine else None)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(registry), media_type="text/plain; version=0.0.4; charset=utf-8")
