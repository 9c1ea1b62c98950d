"""The ASGI app: llama-server's native endpoints, the OpenAI-compatible ones and Anthropic's Messages API.

The model loads in a background thread after the server is listening, so `/health`
answers 503 while loading and 200 once ready. Generation requests are tokenized here,
queued in the scheduler, and their events come back through an asyncio queue per request.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from specserve import __version__
from specserve.build_info import build_info
from specserve.errors import NotSupported, SpecserveError
from specserve.model.kv_ledger import KVCacheFull
from specserve.server import metrics, openapi, webui
from specserve.server.api_keys import key_index
from specserve.server.builders import (
    Builder,
    build_chat,
    build_completion,
    build_infill,
    build_messages,
    build_responses,
    build_v1_completion,
    built,
    count_chat_tokens,
    count_message_tokens,
    count_response_tokens,
)
from specserve.server.embeddings import embeddings
from specserve.server.engine import Engine, ServerSettings
from specserve.server.errors import RequestError, Unavailable, error_response, speaks_anthropic
from specserve.server.limits import SHUTTING_DOWN, Admission, BodyLimitMiddleware
from specserve.server.messages_request import CountTokensRequest, MessagesRequest
from specserve.server.middleware import HttpMiddleware
from specserve.server.openapi import operation
from specserve.server.params import llama_params
from specserve.server.request_log import RequestLogMiddleware
from specserve.server.responses_request import ResponsesRequest
from specserve.server.responses_store import ResponseStore
from specserve.server.schemas import (
    ApplyTemplateRequest,
    ChatRequest,
    CompletionRequest,
    InfillRequest,
    OpenAICompletionRequest,
    parse_body,
)
from specserve.server.sleeping_core import SleepingCore
from specserve.server.slot_files import slot_action
from specserve.server.streaming import respond
from specserve.server.tokenizing import json_list
from specserve.server.utility_schemas import (
    DetokenizeRequest,
    EmbeddingRequest,
    LoraScales,
    SlotFileRequest,
    TokenizeRequest,
)

log = logging.getLogger(__name__)

# No API key needed: as llama-server, and the schema (it holds nothing about the model).
PUBLIC_PATHS = {"/health", "/v1/health", "/models", "/v1/models", "/openapi.json"}


@dataclass
class ServerState:
    settings: ServerSettings
    admission: Admission
    api_keys: list[str] = field(default_factory=list)  # any of them opens the API; none: no key needed
    engine: Engine | None = None
    load_error: str | None = None
    responses: ResponseStore = field(default_factory=ResponseStore)  # for /v1/responses' previous_response_id


class GateMiddleware(HttpMiddleware):
    """API key check, 'still loading' and 'shutting down' answers, before any endpoint runs (streaming-safe
    pure ASGI)."""

    def __init__(self, app: ASGIApp, state: ServerState):
        super().__init__(app)
        self.state = state

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        status, message = 0, ""
        if self.state.admission.draining:  # /health too: a load balancer stops sending here
            await Unavailable(SHUTTING_DOWN).response()(scope, receive, send)
            return
        # the chat page and its files: no key, and served while loading
        page = self.state.settings.webui and webui.is_page_path(path)
        tenant = self._tenant(scope) if self.state.api_keys else ""
        if tenant is None and path not in PUBLIC_PATHS and not page:
            status, message = 401, "Invalid API Key"
        elif self.state.engine is None and path not in ("/health", "/v1/health", "/openapi.json") and not page:
            status, message = 503, "Loading model"
        if status:
            await error_response(status, message, path=path)(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant or ""
        await self.app(scope, receive, send)

    def _tenant(self, scope: Scope) -> str | None:
        """Which of the API keys the request gives ("key<i>"); None: none of them."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        index = key_index(headers, self.state.api_keys)
        return None if index is None else f"key{index}"


def _tokenize(engine: Engine, body: bytes) -> bytes:
    req = parse_body(TokenizeRequest, body)
    tok = engine.tokenizer
    ids = engine.encoder.encode(req.content, add_special=req.add_special, parse_special=req.parse_special)
    if not req.with_pieces:
        return json_list("tokens", ids)
    pieces = []
    for i in ids:
        raw = tok.token_bytes(i)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)  # a partial character: llama-server sends the bytes
        pieces.append({"id": i, "piece": piece})
    return json_list("tokens", pieces)


def _detokenize(engine: Engine, body: bytes) -> bytes:
    req = parse_body(DetokenizeRequest, body)
    return json.dumps({"content": engine.tokenizer.decode(req.tokens)}, ensure_ascii=False).encode()


def create_app(settings: ServerSettings, api_key: str | None = None, *, engine: Engine | None = None,
               on_load_error: Callable[[str], None] | None = None, progress: bool = True) -> FastAPI:
    """The app; without `engine` the model loads in a background thread at startup. `api_key`: one key or
    several separated by commas, as llama-server's --api-key."""
    keys = [k.strip() for k in (api_key or "").split(",") if k.strip()]
    state = ServerState(settings, Admission(settings.n_parallel, settings.max_queue), keys, engine,
                        responses=ResponseStore(settings.responses_store))

    def load() -> None:
        try:
            state.engine = Engine.load(settings, progress=progress)
            log.info("model loaded, server ready")
        except Exception as exc:  # SpecserveError, bad files, out of memory: the server cannot serve
            state.load_error = str(exc) if isinstance(exc, SpecserveError) else f"{type(exc).__name__}: {exc}"
            log.error("loading failed: %s", state.load_error)
            if on_load_error is not None:
                on_load_error(state.load_error)

    owns_engine = engine is None  # an engine given by the caller outlives this app (tests share one)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if state.engine is None:
            threading.Thread(target=load, name="specserve-load", daemon=True).start()
        yield
        if state.engine is not None and owns_engine:
            state.engine.shutdown()

    app = FastAPI(title="specserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.server = state
    app.add_middleware(GateMiddleware, state=state)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)  # outside the gate
    if settings.cors_origins:  # outside the gate: preflights carry no API key, and error answers need the headers
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"], max_age=600)
    app.add_middleware(RequestLogMiddleware)  # outermost: every answer is logged
    _add_error_handlers(app)
    _add_routes(app, state)
    if settings.webui:
        webui.install(app)
    openapi.install(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    # Each answer in the shape of the path's API (error_response: Anthropic's on the Messages endpoints).
    @app.exception_handler(SpecserveError)
    async def bad_request(request: Request, exc: SpecserveError) -> JSONResponse:
        path = request.url.path
        if isinstance(exc, RequestError):
            return error_response(exc.status, str(exc), path=path) if speaks_anthropic(path) else exc.response()
        if isinstance(exc, NotSupported):  # this set-up cannot (a flag not given, a remote runner): as llama-server
            return error_response(501, str(exc), path=path)
        if isinstance(exc, KVCacheFull):  # running requests hold the pool (a slot job's room): later, not never
            return error_response(503, str(exc), headers={"Retry-After": "1"}, path=path)
        return error_response(400, str(exc), path=path)

    @app.exception_handler(Unavailable)
    async def unavailable(request: Request, exc: Unavailable) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, f"invalid request: {exc.errors()[:3]}", path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), path=request.url.path)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", path=request.url.path)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    def eng() -> Engine:
        assert state.engine is not None  # GateMiddleware answers 503 before this
        return state.engine

    @app.get("/health", openapi_extra=operation())
    @app.get("/v1/health", openapi_extra=operation())
    async def health() -> Response:
        if state.engine is None:
            message = f"Loading failed: {state.load_error}" if state.load_error else "Loading model"
            return error_response(503, message)
        failure = state.engine.core.failure()
        if failure is not None:
            return error_response(503, failure)
        return JSONResponse({"status": "ok"})

    async def generate(request: Request, build: Builder) -> Response:
        ticket = state.admission.admit()  # before any work: a full queue refuses cheaply
        try:
            body = await request.body()
            engine = eng()
            job = await run_in_threadpool(built, build, engine, body)
            engine.scope_tasks(job.tasks, getattr(request.state, "tenant", ""))
            job.verbose = state.settings.verbose
            state.admission.widen(ticket, len(job.tasks))  # a batch or n choices: every task counts
            return await respond(request, engine, job, ticket)
        except BaseException:
            ticket.release()
            raise

    def generating(build: Builder) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await generate(request, build)
        return endpoint

    # The generating routes: name, paths, the body's schema (for the OpenAPI document), builder.
    for name, paths, schema, build in (
            ("completion", ("/completion", "/completions"), CompletionRequest, build_completion),
            ("infill", ("/infill",), InfillRequest, build_infill),
            ("v1_completions", ("/v1/completions",), OpenAICompletionRequest, build_v1_completion),
            ("chat_completions", ("/v1/chat/completions", "/chat/completions"), ChatRequest, build_chat),
            ("responses", ("/v1/responses",), ResponsesRequest, functools.partial(build_responses, state.responses)),
            ("messages", ("/v1/messages",), MessagesRequest, build_messages)):
        for path in paths:
            app.add_api_route(path, generating(build), methods=["POST"], name=name,
                              openapi_extra=operation(schema, stream=True, anthropic=schema is MessagesRequest))

    @app.post("/v1/messages/count_tokens", openapi_extra=operation(CountTokensRequest, anthropic=True))
    async def count_tokens(request: Request) -> Response:
        def count(engine: Engine, body: bytes) -> bytes:
            return json.dumps({"input_tokens": count_message_tokens(engine, body)}).encode()

        return await off_loop(request, count)

    @app.post("/v1/chat/completions/input_tokens", openapi_extra=operation(ChatRequest))
    @app.post("/chat/completions/input_tokens", openapi_extra=operation(ChatRequest))
    async def chat_input_tokens(request: Request) -> Response:
        def count(engine: Engine, body: bytes) -> bytes:
            return json.dumps({"object": "chat.completion.input_tokens",
                               "input_tokens": count_chat_tokens(engine, body)}).encode()

        return await off_loop(request, count)

    @app.post("/v1/responses/input_tokens", openapi_extra=operation(ResponsesRequest))
    async def responses_input_tokens(request: Request) -> Response:
        def count(engine: Engine, body: bytes) -> bytes:
            tokens = count_response_tokens(state.responses, engine, body)
            return json.dumps({"object": "response.input_tokens", "input_tokens": tokens}).encode()

        return await off_loop(request, count)

    async def off_loop(request: Request, work: Callable[[Engine, bytes], bytes]) -> Response:
        body = await request.body()
        return Response(await run_in_threadpool(work, eng(), body), media_type="application/json")

    @app.post("/tokenize", openapi_extra=operation(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        return await off_loop(request, _tokenize)

    @app.post("/detokenize", openapi_extra=operation(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        return await off_loop(request, _detokenize)

    @app.post("/apply-template", openapi_extra=operation(ApplyTemplateRequest))
    async def apply_template(request: Request) -> Response:
        def render(engine: Engine, body: bytes) -> bytes:
            prompt = engine.render_chat(parse_body(ApplyTemplateRequest, body))
            return json.dumps({"prompt": prompt}, ensure_ascii=False).encode()

        return await off_loop(request, render)

    @app.post("/embedding", openapi_extra=operation(EmbeddingRequest, not_supported=True, array=True))
    @app.post("/embeddings", openapi_extra=operation(EmbeddingRequest, not_supported=True, array=True))
    async def embedding(request: Request) -> Response:
        return JSONResponse(await embeddings(eng(), state.admission, await request.body(), openai=False))

    @app.post("/v1/embeddings", openapi_extra=operation(EmbeddingRequest, not_supported=True))
    async def v1_embeddings(request: Request) -> Response:
        return JSONResponse(await embeddings(eng(), state.admission, await request.body(), openai=True))

    @app.post("/slots/{id_slot}", openapi_extra=operation(SlotFileRequest, not_supported=True))
    async def slots_action(request: Request, id_slot: str, action: str = "") -> Response:
        return JSONResponse(await slot_action(eng(), id_slot, action, await request.body()))

    @app.get("/lora-adapters", openapi_extra=operation(array=True))
    async def lora_adapters() -> Response:
        return JSONResponse(eng().lora.to_json())

    @app.post("/lora-adapters", openapi_extra=operation(LoraScales))
    async def set_lora_adapters(request: Request) -> Response:
        eng().lora.set_global(parse_body(LoraScales, await request.body()).root)
        return JSONResponse({"success": True})

    @app.get("/props", openapi_extra=operation())
    async def props() -> Response:
        engine = eng()
        tok = engine.tokenizer
        return JSONResponse({
            "default_generation_settings": {"n_ctx": engine.n_ctx,
                                            "params": llama_params(engine.default_params(), False)},
            "total_slots": engine.settings.n_parallel,
            "model_alias": engine.model_name,
            "model_path": str(engine.model_path),
            "draft_model_path": str(engine.model.draft_path) if engine.model.draft_path is not None else None,
            "chat_template": tok.chat_template or "",
            "chat_format": engine.tool_style.format,  # how tool calls are read (server/tool_calls.py)
            "bos_token": tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
            "eos_token": tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
            "modalities": {"vision": False, "audio": False},
            "build_info": build_info(),
            "is_sleeping": isinstance(engine.core, SleepingCore) and engine.core.sleeping,
        })

    @app.get("/slots", openapi_extra=operation(array=True, not_supported=True))
    async def slots() -> Response:
        if not state.settings.endpoint_slots:  # --no-slots: llama-server's answer
            return error_response(501, "This server does not support slots endpoint. Start it with `--slots`")
        out = eng().core.slots_json()
        for slot in out:
            if "params" in slot:
                slot["params"] = llama_params(slot["params"])  # type: ignore[arg-type]
        return JSONResponse(out)

    @app.get("/models", openapi_extra=operation())
    @app.get("/v1/models", openapi_extra=operation())
    async def models() -> Response:
        engine = state.engine
        if engine is None:
            return error_response(503, "Loading model")
        m = engine.model
        meta = {"vocab_type": 2, "n_vocab": m.vocab_size, "n_ctx_train": m.context_length, "n_embd": m.hidden,
                "size": m.file_bytes}
        return JSONResponse({"object": "list", "data": [
            {"id": engine.model_name, "aliases": engine.aliases, "tags": state.settings.tags, "object": "model",
             "created": engine.created, "owned_by": "specserve", "meta": meta}]})

    registry = metrics.make_registry(lambda: state.engine.counters() if state.engine else None)

    @app.get("/metrics", openapi_extra=operation(text=True))
    async def get_metrics() -> Response:
        if not state.settings.endpoint_metrics:  # llama-server's answer without --metrics
            return error_response(501, "This server does not support metrics endpoint. Start it with `--metrics`")
        return Response(metrics.render(registry), media_type="text/plain; version=0.0.4; charset=utf-8",
                        headers={"Process-Start-Time-Unix": str(metrics.PROCESS_START)})
