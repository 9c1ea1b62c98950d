"""Response shapes: llama-server's native /completion and OpenAI's completions / chat completions.

Each format turns the scheduler's events into JSON objects: `chunk` for one streamed step,
`final` for the streamed tail, `body` for a whole non-streaming answer.
"""

from __future__ import annotations

import functools
import secrets
import time
from typing import Any

from specserve.engine.tasks import Chunk, Result, Task, TokenProb
from specserve.server.engine import Engine
from specserve.server.params import llama_params

FINISH_REASON = {"eos": "stop", "word": "stop", "limit": "length", "cancelled": "stop"}


def usage(result: Result) -> dict[str, Any]:
    return {"prompt_tokens": result.n_prompt, "completion_tokens": result.n_predicted,
            "total_tokens": result.n_prompt + result.n_predicted,
            "prompt_tokens_details": {"cached_tokens": result.n_cached}}


class Format:
    done_marker = False  # OpenAI streams end with `data: [DONE]`

    def __init__(self, engine: Engine, task: Task):
        self.engine = engine
        self.task = task
        self.created = int(time.time())

    def start(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, chunk: Chunk) -> dict[str, Any] | None:
        raise NotImplementedError

    def final(self, result: Result) -> list[dict[str, Any]]:
        raise NotImplementedError

    def body(self, chunks: list[Chunk], result: Result) -> dict[str, Any]:
        raise NotImplementedError

    def _piece(self, token: int) -> str:
        return self.engine.token_piece(token)

    def _truncated(self, result: Result) -> bool:
        """Stopped for want of context: also when n_predict was capped to exactly what fit (engine.make_task)."""
        return result.context_full or (result.stop_type == "limit"
                                       and result.n_prompt + result.n_predicted > self.engine.n_ctx)


def token_entry(engine: Engine, token: int, logprob: float) -> dict[str, Any]:
    """A token's text, log-probability and bytes, as llama-server and OpenAI chat report them."""
    piece = engine.tokenizer.token_bytes(token)
    return {"token": piece.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(piece)}


class NativeFormat(Format):
    """llama-server POST /completion."""

    def __init__(self, engine: Engine, task: Task, return_tokens: bool = False, stream: bool = False):
        super().__init__(engine, task)
        self.return_tokens = return_tokens
        self.stream = stream
        self._n_decoded = 0  # tokens streamed so far (each chunk's tokens_predicted, as llama-server's)

    def _probs(self, probs: list[TokenProb]) -> list[dict[str, Any]]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            return {"id": token, **token_entry(self.engine, token, logprob)}

        return [{**entry(p.token, p.logprob), "top_logprobs": [entry(t, lp) for t, lp in p.top]} for p in probs]

    def chunk(self, chunk: Chunk) -> dict[str, Any] | None:
        # Streamed chunks carry their token ids whatever return_tokens says, as llama-server's do.
        self._n_decoded += len(chunk.tokens)
        if not chunk.text and not chunk.tokens and not chunk.probs:
            return None
        out: dict[str, Any] = {"index": 0, "content": chunk.text, "tokens": chunk.tokens, "stop": False,
                               "tokens_predicted": self._n_decoded, "tokens_evaluated": len(self.task.prompt)}
        if chunk.probs:
            out["completion_probabilities"] = self._probs(chunk.probs)
        return out

    def _summary(self, result: Result) -> dict[str, Any]:
        return {
            "index": 0, "id_slot": result.slot, "stop": True, "model": self.engine.model_name,
            "tokens_predicted": result.n_predicted, "tokens_evaluated": result.n_prompt,
            "generation_settings": llama_params(self.task.params_json(), self.stream),
            "truncated": self._truncated(result),
            "stop_type": result.stop_type if result.stop_type != "cancelled" else "none",
            "stopping_word": result.stopping_word, "tokens_cached": result.n_prompt + result.n_predicted,
            "timings": result.timings(),
        }

    def final(self, result: Result) -> list[dict[str, Any]]:
        return [{"content": "", "tokens": [], **self._summary(result)}]

    def body(self, chunks: list[Chunk], result: Result) -> dict[str, Any]:
        content = "".join(c.text for c in chunks)
        out = {"content": content, "tokens": [t for c in chunks for t in c.tokens] if self.return_tokens else [],
               "has_new_line": "\n" in content, **self._summary(result)}
        if self.task.n_probs:
            out["completion_probabilities"] = self._probs([p for c in chunks for p in c.probs or []])
        return out


class OpenAIFormat(Format):
    """What OpenAI's completions and chat completions share: the envelope, `[DONE]`, and a stream
    tail of an empty choice with the finish reason, then (if asked) a choice-less usage chunk."""

    done_marker = True
    id_prefix = ""
    object = ""  # of streamed chunks

    def __init__(self, engine: Engine, task: Task, include_usage: bool = False):
        super().__init__(engine, task)
        self.id = self.id_prefix + secrets.token_hex(12)
        self.include_usage = include_usage

    def _envelope(self, choice: dict[str, Any] | None, obj: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": obj or self.object, "created": self.created, "model": self.engine.model_name,
                "system_fingerprint": "specserve", "choices": [choice] if choice is not None else []}

    def _empty_choice(self) -> dict[str, Any]:
        raise NotImplementedError

    def final(self, result: Result) -> list[dict[str, Any]]:
        last = self._envelope({**self._empty_choice(), "finish_reason": FINISH_REASON[result.stop_type]})
        last["timings"] = result.timings()
        out = [last]
        if self.include_usage:
            out.append({**self._envelope(None), "usage": usage(result)})
        return out


class CompletionFormat(OpenAIFormat):
    """OpenAI POST /v1/completions."""

    id_prefix = "cmpl-"
    object = "text_completion"

    def __init__(self, engine: Engine, task: Task, echo_text: str = "", include_usage: bool = False):
        super().__init__(engine, task, include_usage)
        self.echo_text = echo_text
        self._offset = len(echo_text)

    def _logprobs(self, probs: list[TokenProb] | None) -> dict[str, Any] | None:
        if not self.task.n_probs or probs is None:
            return None
        tokens = [self._piece(p.token) for p in probs]
        offsets = []
        for text in tokens:
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": [p.logprob for p in probs],
                "top_logprobs": [{self._piece(t): lp for t, lp in p.top} for p in probs], "text_offset": offsets}

    def _empty_choice(self) -> dict[str, Any]:
        return {"text": "", "index": 0, "logprobs": None}

    def start(self) -> list[dict[str, Any]]:
        if not self.echo_text:
            return []
        return [self._envelope({"text": self.echo_text, "index": 0, "logprobs": None, "finish_reason": None})]

    def chunk(self, chunk: Chunk) -> dict[str, Any] | None:
        if not chunk.text and not chunk.probs:
            return None
        return self._envelope({"text": chunk.text, "index": 0, "logprobs": self._logprobs(chunk.probs),
                               "finish_reason": None})

    def body(self, chunks: list[Chunk], result: Result) -> dict[str, Any]:
        probs = [p for c in chunks for p in c.probs or []] if self.task.n_probs else None
        text = self.echo_text + "".join(c.text for c in chunks)
        out = self._envelope({"text": text, "index": 0, "logprobs": self._logprobs(probs),
                              "finish_reason": FINISH_REASON[result.stop_type]})
        return {**out, "usage": usage(result), "timings": result.timings()}


class ChatFormat(OpenAIFormat):
    """OpenAI POST /v1/chat/completions."""

    id_prefix = "chatcmpl-"
    object = "chat.completion.chunk"

    def __init__(self, engine: Engine, task: Task, include_usage: bool = False, top_logprobs: int = 0):
        super().__init__(engine, task, include_usage)
        # the task computes at least one alternative; top_logprobs 0 shows none, as OpenAI
        self.top_logprobs = top_logprobs

    def _logprobs(self, probs: list[TokenProb] | None) -> dict[str, Any] | None:
        if not self.task.n_probs or probs is None:
            return None

        entry = functools.partial(token_entry, self.engine)
        return {"content": [{**entry(p.token, p.logprob),
                             "top_logprobs": [entry(t, lp) for t, lp in p.top[:self.top_logprobs]]}
                            for p in probs]}

    def _empty_choice(self) -> dict[str, Any]:
        return {"index": 0, "delta": {}, "logprobs": None}

    def start(self) -> list[dict[str, Any]]:
        # content null, as llama-server: clients take "" for the start of the text
        return [self._envelope({"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None,
                                "finish_reason": None})]

    def chunk(self, chunk: Chunk) -> dict[str, Any] | None:
        if not chunk.text and not chunk.probs:
            return None
        return self._envelope({"index": 0, "delta": {"content": chunk.text},
                               "logprobs": self._logprobs(chunk.probs), "finish_reason": None})

    def body(self, chunks: list[Chunk], result: Result) -> dict[str, Any]:
        probs = [p for c in chunks for p in c.probs or []] if self.task.n_probs else None
        message = {"role": "assistant", "content": "".join(c.text for c in chunks)}
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(probs),
                  "finish_reason": FINISH_REASON[result.stop_type]}
        return {**self._envelope(choice, "chat.completion"), "usage": usage(result), "timings": result.timings()}
