"""One in-process Engine (smollm2-135m on the CPU) shared by the tests that talk to the ASGI app directly.

Loaded once per test process (the model takes seconds on the CPU): several apps can be built over it with
different settings, and a starlette TestClient used without `with` runs no lifespan, so no app shuts it down.
"""

from __future__ import annotations

import atexit
import dataclasses
import tempfile
from functools import cache
from typing import Any

import openai
from fastapi import FastAPI
from starlette.testclient import TestClient

from specserve.server.app import create_app
from specserve.server.engine import Engine, ServerSettings

CTX = 512  # the KV pool, and the most one slot may hold
SETTINGS = ServerSettings(model="smollm2-135m", device="cpu", n_parallel=2, ctx_size=CTX, n_predict=4,
                          alias="smollm2-135m,tiny", tags=["small", "test"], endpoint_metrics=True,
                          slot_save_path=tempfile.mkdtemp(prefix="specserve-slots-"))  # slot actions served


@cache
def engine() -> Engine:
    eng = Engine.load(SETTINGS, progress=False)
    atexit.register(eng.shutdown)
    return eng


def app(**changes: object) -> FastAPI:
    """An app over the shared engine; changes replace ServerSettings fields (e.g. endpoint_slots=False)."""
    # (the engine keeps what it loaded with: names, context, defaults; the app reads the rest from these)
    return create_app(dataclasses.replace(SETTINGS, **changes), engine=engine())


def client(**changes: object) -> TestClient:
    return TestClient(app(**changes))


def openai_client(http: TestClient, api_key: str = "x") -> openai.OpenAI:
    """The official client over the in-process app (the TestClient is an httpx client, as the openai client's own)."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key=api_key, http_client=http, max_retries=0)


def greedy_chat(client: openai.OpenAI, messages: list[Any], max_tokens: int,
                **options: Any) -> openai.types.chat.ChatCompletion:
    """A greedy chat completion of the embedded model; options: the create() call's other arguments."""
    return client.chat.completions.create(model="smollm2-135m", messages=messages, temperature=0,
                                          max_tokens=max_tokens, **options)
