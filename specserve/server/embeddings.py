"""POST /embedding (llama-server's) and /v1/embeddings (OpenAI's): one pooled, normalised final hidden state
per input.

Each input is one slot job (engine/slot_jobs.py): the scheduler's thread evaluates it in an idle slot between
steps and pools the hidden states after the output norm (engine/slot_state.py). Pooling is the mean over
the input's tokens by default (docs/compatibility.md says why); `--pooling last` takes the last token's.
"""

from __future__ import annotations

import asyncio
import base64
import functools
from typing import Any

import torch
from starlette.concurrency import run_in_threadpool

from specserve.engine import slot_state
from specserve.errors import SpecserveError
from specserve.server.engine import Engine
from specserve.server.errors import ContextSizeError
from specserve.server.limits import Admission
from specserve.server.schemas import parse_body
from specserve.server.utility_schemas import EmbeddingRequest


def normalize(vector: torch.Tensor, p: int) -> torch.Tensor:
    """llama.cpp's embd_normalize: -1 none, 0 max absolute scaled to int16's range, 1 taxicab, 2 euclidean,
    p > 2 the p-norm; a zero vector stays zero."""
    if p == -1:
        return vector
    norm = vector.abs().max() / 32760.0 if p == 0 else torch.linalg.vector_norm(vector.double(), ord=p).float()
    return vector / norm if norm > 0 else torch.zeros_like(vector)


def _parse(engine: Engine, body: bytes) -> tuple[EmbeddingRequest, list[list[int]]]:
    req = parse_body(EmbeddingRequest, body)
    inputs = engine.tokenize_prompts(req.texts())
    for tokens in inputs:
        if not tokens:
            raise SpecserveError("Input content cannot be empty")
        if len(tokens) >= engine.n_ctx:
            raise ContextSizeError(len(tokens), engine.n_ctx)
    engine.core.wake()  # (--sleep-idle-seconds: here, off the event loop)
    return req, inputs


async def embeddings(engine: Engine, admission: Admission, body: bytes, openai: bool) -> Any:
    """The answer's JSON: llama-server's list of {index, embedding: [vector]}, or OpenAI's list object."""
    ticket = admission.admit()  # each input waits for a slot like a generation: the queue limit counts it
    try:
        req, inputs = await run_in_threadpool(_parse, engine, body)
        admission.widen(ticket, len(inputs))
        work = [functools.partial(slot_state.embed, tokens=tokens, n_batch=engine.settings.n_batch,
                                  pooling=engine.pooling) for tokens in inputs]
        futures = [engine.core.submit_job(w) for w in work]
        vectors = [normalize(await asyncio.wrap_future(f), req.embd_normalize) for f in futures]
    finally:
        ticket.release()
    if not openai:
        return [{"index": i, "embedding": [v.tolist()]} for i, v in enumerate(vectors)]

    def encoded(v: torch.Tensor) -> list[float] | str:
        if req.encoding_format == "base64":  # little-endian float32, what OpenAI's client decodes
            return base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
        return v.tolist()

    n_tokens = sum(len(t) for t in inputs)
    usage = {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    return {"model": engine.model_name, "object": "list", "usage": usage,
            "data": [{"embedding": encoded(v), "index": i, "object": "embedding"} for i, v in enumerate(vectors)]}
