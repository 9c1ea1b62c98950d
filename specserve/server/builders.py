"""What a generation route does in a worker thread: parse the body, render the template, tokenize, and
build the Job: one task per prompt and choice, each with the format of its part of the answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specserve.engine.tasks import Task
from specserve.server.chat_output import OutputSpec
from specserve.server.engine import Engine
from specserve.server.formats import ChatFormat, CompletionFormat, Format, NativeFormat
from specserve.server.infill import infill_prompt
from specserve.server.messages_format import MessagesFormat
from specserve.server.messages_request import CountTokensRequest, MessagesRequest
from specserve.server.prompts import split_prompts
from specserve.server.reasoning import prompt_opens_thinking
from specserve.server.responses_format import ResponsesFormat
from specserve.server.responses_request import ResponsesRequest, conversation
from specserve.server.responses_store import ResponseStore
from specserve.server.schemas import (
    ChatRequest,
    CompletionRequest,
    InfillRequest,
    OpenAICompletionRequest,
    parse_body,
)
from specserve.server.streaming import Job

Builder = Callable[[Engine, bytes], Job]


def _job(tasks: list[Task], make: Callable[[int, Task], Format], stream: bool, n_choices: int = 1) -> Job:
    """Job over tasks made prompt-major, n_choices per prompt; make(i, task) gives task i's format."""
    formats = []
    for i, task in enumerate(tasks):
        fmt = make(i, task)
        fmt.counts_prompt = i % n_choices == 0  # usage counts each prompt once
        formats.append(fmt)
    return Job(tasks, formats, stream)


def _native(engine: Engine, req: CompletionRequest, prompts: list[list[int]]) -> Job:
    n_predict = req.n_predict if req.n_predict is not None else req.max_tokens
    tasks = engine.make_tasks(req, prompts, n_predict, req.n_probs)
    return _job(tasks, lambda _, t: NativeFormat(engine, t, req.return_tokens, req.response_fields, req.stream),
                req.stream)


def build_completion(engine: Engine, body: bytes) -> Job:
    req = parse_body(CompletionRequest, body)
    return _native(engine, req, engine.tokenize_prompts(req.prompt))


def build_infill(engine: Engine, body: bytes) -> Job:
    req = parse_body(InfillRequest, body)
    n_predict = next((n for n in (req.n_predict, req.max_tokens) if n is not None), engine.settings.n_predict)
    prompt = infill_prompt(engine.encoder, req, engine.settings.n_batch, engine.n_ctx, n_predict)
    return _native(engine, req, [prompt])


def build_v1_completion(engine: Engine, body: bytes) -> Job:
    req = parse_body(OpenAICompletionRequest, body)
    prompts = engine.tokenize_prompts(req.prompt)
    n_predict = req.n_predict if req.n_predict is not None else req.max_tokens  # llama-server's name wins
    tasks = engine.make_tasks(req, prompts, n_predict, req.logprobs or 0, req.n)
    given = split_prompts(req.prompt)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def make(i: int, task: Task) -> Format:
        echo = ""
        if req.echo:
            text = given[i // req.n]
            echo = text if isinstance(text, str) else engine.tokenizer.decode(task.prompt)
        return CompletionFormat(engine, task, echo, include_usage)

    return _job(tasks, make, req.stream, req.n)


def chat_tasks(engine: Engine, req: ChatRequest) -> tuple[list[Task], OutputSpec]:
    """A chat request's tasks and how their text is read: the chat completions path, which the Responses and
    Messages APIs take too."""
    plan = engine.tool_plan(req, own_constraint=req.grammar_source() is not None)
    prompt, text = engine.chat_prompt(req, plan, req.parse_special)
    max_tokens = next((n for n in (req.n_predict, req.max_completion_tokens, req.max_tokens) if n is not None), None)
    n_probs = (req.top_logprobs or 1) if req.logprobs else 0
    tasks = engine.make_tasks(req, [prompt], max_tokens, n_probs, req.n, grammar=plan.grammar,
                              keep_special=plan.keep_special)
    output = OutputSpec(reasoning_format=req.reasoning_format or engine.settings.reasoning_format,
                        started_open=prompt_opens_thinking(text), tool_format=plan.parse_format,
                        tool_names=plan.names)
    return tasks, output


def build_chat(engine: Engine, body: bytes) -> Job:
    req = parse_body(ChatRequest, body)
    tasks, output = chat_tasks(engine, req)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return _job(tasks, lambda _, t: ChatFormat(engine, t, include_usage, req.top_logprobs or 0, output),
                req.stream, req.n)


def build_responses(store: ResponseStore, engine: Engine, body: bytes) -> Job:
    """POST /v1/responses: the chat path over the conversation (the stored one it goes on from, then its input);
    the answer's conversation is stored under its id when it is complete, unless the request says store false."""
    req = parse_body(ResponsesRequest, body)
    history = store.conversation(req.previous_response_id) if req.previous_response_id else []
    messages = req.messages(history)
    tasks, output = chat_tasks(engine, req.chat(messages))

    def keep(response_id: str, items: list[dict[str, Any]]) -> None:
        store.put(response_id, [*messages, *conversation(items)])

    on_done = keep if req.store else None
    return _job(tasks, lambda _, t: ResponsesFormat(engine, t, output, req.echo(), on_done), req.stream)


def build_messages(engine: Engine, body: bytes) -> Job:
    """POST /v1/messages: the chat path, answered as Anthropic's Messages API."""
    req = parse_body(MessagesRequest, body)
    tasks, output = chat_tasks(engine, req.chat())
    return _job(tasks, lambda _, t: MessagesFormat(engine, t, output), req.stream)


def count_message_tokens(engine: Engine, body: bytes) -> int:
    """POST /v1/messages/count_tokens: the tokens of the prompt /v1/messages renders for the same request."""
    return _prompt_tokens(engine, parse_body(CountTokensRequest, body).chat())


def count_chat_tokens(engine: Engine, body: bytes) -> int:
    """POST /v1/chat/completions/input_tokens: the tokens of the prompt the same chat request would have."""
    return _prompt_tokens(engine, parse_body(ChatRequest, body))


def count_response_tokens(store: ResponseStore, engine: Engine, body: bytes) -> int:
    """POST /v1/responses/input_tokens (OpenAI's): the tokens of the prompt the same /v1/responses request would
    have, the stored conversation it goes on from included."""
    req = parse_body(ResponsesRequest, body)
    history = store.conversation(req.previous_response_id) if req.previous_response_id else []
    return _prompt_tokens(engine, req.chat(req.messages(history)))


def _prompt_tokens(engine: Engine, chat: ChatRequest) -> int:
    prompt, _ = engine.chat_prompt(chat, engine.tool_plan(chat), chat.parse_special)
    return len(prompt)


def built(build: Builder, engine: Engine, body: bytes) -> Job:
    """A request's job, the core woken for it (--sleep-idle-seconds) while still off the event loop."""
    job = build(engine, body)
    engine.core.wake()
    return job
