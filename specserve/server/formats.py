"""Response shapes: llama-server's native /completion and OpenAI's completions / chat completions.

Each format turns one task's events into JSON objects: `chunk` for one streamed step (none, one, or several:
a chat answer's tool call comes as chunks of its own), `final` for its streamed end, `body` for its whole
non-streaming answer. A request of several tasks (a batch of prompts, n choices) has one format per task,
placed (`place`) as choice / result `index` of one answer; the first format then writes what the answer has
once: `tail` (the stream's last events) and `combine` (the body).
"""

from __future__ import annotations

import functools
import secrets
import time
from typing import Any

import msgspec

from specserve.build_info import build_info
from specserve.engine.tasks import Chunk, Progress, Result, Task, TokenProb
from specserve.server.chat_output import ChatOutput, OutputSpec, delta_json, finish_reason, message_json, read_message
from specserve.server.engine import Engine
from specserve.server.errors import error_body
from specserve.server.params import llama_params

# A stream's events are encoded many times a step: msgspec's encoder (compact JSON, UTF-8 kept, as llama-server
# writes it) takes a tenth of json.dumps' time.
_json = msgspec.json.Encoder().encode

FINISH_REASON = {"eos": "stop", "word": "stop", "limit": "length", "cancelled": "stop"}


def usage(results: list[Result], formats: list[Format]) -> dict[str, Any]:
    """Generated tokens of every choice; each prompt's tokens once (n choices of a prompt share them, as
    OpenAI counts)."""
    firsts = [r for r, f in zip(results, formats, strict=True) if f.counts_prompt]
    n_prompt = sum(r.n_prompt for r in firsts)
    n_predicted = sum(r.n_predicted for r in results)
    drafted = [r.draft_sources.get("prediction", (0, 0)) for r in results]
    accepted = sum(a for _, a in drafted)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_predicted, "total_tokens": n_prompt + n_predicted,
            "prompt_tokens_details": {"cached_tokens": sum(r.n_cached for r in firsts)},
            # as OpenAI counts predicted outputs: prediction tokens the answer took, and those it did not
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": sum(g for g, _ in drafted) - accepted}}


class Format:
    done_marker = False  # OpenAI streams end with `data: [DONE]`
    named_events = False  # each event has an `event:` line with its `type` (the Responses and Messages APIs)

    def __init__(self, engine: Engine, task: Task):
        self.engine = engine
        self.task = task
        self.created = int(time.time())
        self.index = 0  # its place among the answer's choices or results
        self.counts_prompt = True  # the first choice of its prompt (usage counts the prompt once)

    def place(self, index: int, lead: Format) -> None:
        """Make this task the answer's `index`-th, in the answer `lead` (the first format) heads."""
        self.index, self.created = index, lead.created

    def start(self) -> list[dict[str, Any]]:
        return []

    def tail(self, results: list[Result], formats: list[Format]) -> list[dict[str, Any]]:
        """The stream's events after every task's final ones."""
        return []

    def combine(self, bodies: list[dict[str, Any]], results: list[Result],
                formats: list[Format]) -> dict[str, Any] | list[dict[str, Any]]:
        """The non-streaming answer from each task's body."""
        raise NotImplementedError

    def chunk(self, chunk: Chunk) -> list[dict[str, Any]]:
        raise NotImplementedError

    def progress(self, progress: Progress) -> list[dict[str, Any]]:
        """A stream's event for prompt progress (a request's return_progress); none in this API."""
        return []

    def final(self, result: Result) -> list[dict[str, Any]]:
        raise NotImplementedError

    def body(self, chunks: list[Chunk], result: Result) -> dict[str, Any]:
        raise NotImplementedError

    def sse(self, obj: dict[str, Any]) -> bytes:
        """One server-sent event, as the bytes the response sends."""
        data = b"data: " + _json(obj) + b"\n\n"
        return b"event: " + obj["type"].encode() + b"\n" + data if self.named_events else data

    def error(self, status: int, message: str) -> dict[str, Any]:
        """An error's body in this API's shape."""
        return error_body(status, message)

    def stream_error(self, status: int, message: str) -> dict[str, Any]:
        """The event that ends a stream that failed."""
        return self.error(status, message)

    def _piece(self, token: int) -> str:
        return self.engine.token_piece(token)

    def _truncated(self, result: Result) -> bool:
        """Stopped for want of context: also when n_predict was capped to exactly what fit (engine.make_task)."""
        return result.context_full or (result.stop_type == "limit" and not self.task.context_shift
                                       and result.n_prompt + result.n_predicted > self.engine.n_ctx)


def token_entry(engine: Engine, token: int, logprob: float) -> dict[str, Any]:
    """A token's text, log-probability and bytes, as llama-server and OpenAI chat report them."""
    piece = engine.tokenizer.token_bytes(token)
    return {"token": piece.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(piece)}


class NativeFormat(Format):
    """llama-server POST /completion."""

    def __init__(self, engine: Engine, task: Task, return_tokens: bool = False,
                 response_fields: list[str] | None = None, stream: bool = False):
        super().__init__(engine, task)
        self.return_tokens = return_tokens
        self.response_fields = response_fields or []
        self.stream = stream
        self._n_decoded = 0  # tokens streamed so far (each chunk's tokens_predicted, as llama-server's)

    def _probs(self, probs: list[TokenProb]) -> list[dict[str, Any]]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            return {"id": token, **token_entry(self.engine, token, logprob)}

        return [{**entry(p.token, p.logprob), "top_logprobs": [entry(t, lp) for t, lp in p.top]} for p in probs]

    def chunk(self, chunk: Chunk) -> list[dict[str, Any]]:
        # Streamed chunks carry their token ids whatever return_tokens says, as llama-server's do.
        self._n_decoded += len(chunk.tokens)
        if not chunk.text and not chunk.tokens and not chunk.probs:
            return []
        out: dict[str, Any] = {"index": self.index, "content": chunk.text, "tokens": chunk.tokens, "stop": False,
                               "tokens_predicted": self._n_decoded, "tokens_evaluated": len(self.task.prompt)}
        if chunk.probs:
            out["completion_probabilities"] = self._probs(chunk.probs)
        return [out]

    def progress(self, progress: Progress) -> list[dict[str, Any]]:
        return [{"index": self.index, "content": "", "tokens": [], "stop": False,
                 "prompt_progress": progress.to_json()}]

    def _summary(self, result: Result) -> dict[str, Any]:
        return {
            "index": self.index, "id_slot": result.slot, "stop": True, "model": self.engine.model_name,
            "tokens_predicted": result.n_predicted, "tokens_evaluated": result.n_prompt,
            "generation_settings": llama_params(self.task.params_json(), self.stream),
            "truncated": self._truncated(result),
            "stop_type": result.stop_type if result.stop_type != "cancelled" else "none",
            "stopping_word": result.stopping_word, "tokens_cached": result.n_prompt + result.n_predicted,
            "timings": result.timings(),
        }

    def _only_asked(self, out: dict[str, Any]) -> dict[str, Any]:
        """llama-server's response_fields: only those fields ("a/b" reaches into objects), under those names."""
        if not self.response_fields:
            return out
        picked: dict[str, Any] = {}
        for path in self.response_fields:
            value: Any = out
            for key in path.split("/"):
                if not isinstance(value, dict) or key not in value:
                    break
                value = value[key]
            else:
                picked[path] = value
        return picked

    def final(self, result: Result) -> list[dict[str, Any]]:
        return [self._only_asked({"content": "", "tokens": [], **self._summary(result)})]

    def body(self, chunks: list[Chunk], result: Result) -> dict[str, Any]:
        content = "".join(c.text for c in chunks)
        out = {"content": content, "tokens": [t for c in chunks for t in c.tokens] if self.return_tokens else [],
               "has_new_line": "\n" in content, **self._summary(result)}
        if self.task.n_probs:
            out["completion_probabilities"] = self._probs([p for c in chunks for p in c.probs or []])
        return self._only_asked(out)

    def combine(self, bodies: list[dict[str, Any]], results: list[Result],
                formats: list[Format]) -> dict[str, Any] | list[dict[str, Any]]:
        return bodies[0] if len(bodies) == 1 else bodies  # a batch of prompts: a list, as llama-server


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
                "system_fingerprint": build_info(), "choices": [choice] if choice is not None else []}

    def place(self, index: int, lead: Format) -> None:
        super().place(index, lead)
        assert isinstance(lead, OpenAIFormat)
        self.id = lead.id

    def _empty_choice(self) -> dict[str, Any]:
        raise NotImplementedError

    def progress(self, progress: Progress) -> list[dict[str, Any]]:
        return [{**self._envelope(None), "prompt_progress": progress.to_json()}]

    def _finish_reason(self, result: Result) -> str:
        return FINISH_REASON[result.stop_type]

    def final(self, result: Result) -> list[dict[str, Any]]:
        last = self._envelope({**self._empty_choice(), "finish_reason": self._finish_reason(result)})
        last["timings"] = result.timings()
        return [last]

    def tail(self, results: list[Result], formats: list[Format]) -> list[dict[str, Any]]:
        return [{**self._envelope(None), "usage": usage(results, formats)}] if self.include_usage else []

    def combine(self, bodies: list[dict[str, Any]], results: list[Result],
                formats: list[Format]) -> dict[str, Any] | list[dict[str, Any]]:
        """One answer: every task's choice, in index order, and the usage of all."""
        return {**bodies[0], "choices": [c for b in bodies for c in b["choices"]], "usage": usage(results, formats)}


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
        return {"text": "", "index": self.index, "logprobs": None}

    def start(self) -> list[dict[str, Any]]:
        if not self.echo_text:
            return []
        return [self._envelope({"text": self.echo_text, "index": self.index, "logprobs": None,
                                "finish_reason": None})]

    def chunk(self, chunk: Chunk) -> list[dict[str, Any]]:
        if not chunk.text and not chunk.probs:
            return []
        return [self._envelope({"text": chunk.text, "index": self.index, "logprobs": self._logprobs(chunk.probs),
                                "finish_reason": None})]

    def body(self, chunks: list[Chunk], result: Result) -> dict[str, Any]:
        probs = [p for c in chunks for p in c.probs or []] if self.task.n_probs else None
        text = self.echo_text + "".join(c.text for c in chunks)
        out = self._envelope({"text": text, "index": self.index, "logprobs": self._logprobs(probs),
                              "finish_reason": FINISH_REASON[result.stop_type]})
        return {**out, "usage": usage([result], [self]), "timings": result.timings()}


class ChatFormat(OpenAIFormat):
    """OpenAI POST /v1/chat/completions. The answer's text is read as reasoning, content and tool calls
    (chat_output.py); a stream sends each as it is certain, and what the readers hold at the end before the
    finish chunk."""

    id_prefix = "chatcmpl-"
    object = "chat.completion.chunk"

    def __init__(self, engine: Engine, task: Task, include_usage: bool = False, top_logprobs: int = 0,
                 output: OutputSpec | None = None):
        super().__init__(engine, task, include_usage)
        # the task computes at least one alternative; top_logprobs 0 shows none, as OpenAI
        self.top_logprobs = top_logprobs
        self.output = output or OutputSpec()
        self._reader = ChatOutput(self.output)

    def _logprobs(self, probs: list[TokenProb] | None) -> dict[str, Any] | None:
        if not self.task.n_probs or probs is None:
            return None

        entry = functools.partial(token_entry, self.engine)
        return {"content": [{**entry(p.token, p.logprob),
                             "top_logprobs": [entry(t, lp) for t, lp in p.top[:self.top_logprobs]]}
                            for p in probs]}

    def _empty_choice(self) -> dict[str, Any]:
        return {"index": self.index, "delta": {}, "logprobs": None}

    def start(self) -> list[dict[str, Any]]:
        # content null, as llama-server: clients take "" for the start of the text
        return [self._envelope({"index": self.index, "delta": {"role": "assistant", "content": None}, "logprobs": None,
                                "finish_reason": None})]

    def _delta(self, delta: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._envelope({"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": None})

    def chunk(self, chunk: Chunk) -> list[dict[str, Any]]:
        deltas = [delta_json(piece) for piece in self._reader.feed(chunk.text)]
        logprobs = self._logprobs(chunk.probs) if chunk.probs else None
        if not deltas:  # the readers hold this step's text: its log-probabilities still go out now
            return [self._delta({}, logprobs)] if logprobs is not None else []
        # one delta a chunk: a call's start and its arguments stay apart, as OpenAI streams them
        return [self._delta(delta, logprobs if i == 0 else None) for i, delta in enumerate(deltas)]

    def _finish_reason(self, result: Result) -> str:
        return finish_reason(FINISH_REASON[result.stop_type], self._reader.n_calls)

    def final(self, result: Result) -> list[dict[str, Any]]:
        held = [self._delta(delta_json(piece)) for piece in self._reader.finish()]
        return held + super().final(result)

    def body(self, chunks: list[Chunk], result: Result) -> dict[str, Any]:
        probs = [p for c in chunks for p in c.probs or []] if self.task.n_probs else None
        message = read_message("".join(c.text for c in chunks), self.output)
        choice = {"index": self.index, "message": message_json(message), "logprobs": self._logprobs(probs),
                  "finish_reason": finish_reason(FINISH_REASON[result.stop_type], len(message.calls))}
        return {**self._envelope(choice, "chat.completion"), "usage": usage([result], [self]),
                "timings": result.timings()}
