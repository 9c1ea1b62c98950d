"""Request bodies: strict types and ranges; anything wrong becomes an HTTP 400.

Field names follow llama-server (`/completion`, incl. the dotted `speculative.*` keys) and
the OpenAI API. Unknown fields are ignored, as both servers do, except unknown
`speculative.*` keys: a misspelt speculative option must not be silently dropped. No
field can name a file on the server (lookup-cache files are server flags only).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specserve.engine.constraints import GrammarSource
from specserve.errors import SpecserveError
from specserve.model.token_tree import MAX_TREE_NODES
from specserve.server.prompts import LogitBiasInput, PromptInput, PromptPart
from specserve.server.tool_grammar import validate_tools

SPEC_FIELDS = {  # request key -> SpecParams field
    "speculative.type": "type",
    "speculative.n_max": "n_max",
    "speculative.n_min": "n_min",
    "speculative.p_min": "p_min",
    "speculative.ngram_size_n": "ngram_size_n",
    "speculative.ngram_size_m": "ngram_size_m",
    "speculative.ngram_c_rate": "ngram_check_rate",
    "speculative.ngram_m_hits": "ngram_min_hits",
    "speculative.scope": "scope",
    "speculative.tree_nodes": "tree_nodes",
}
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                   "presence_penalty", "frequency_penalty", "seed")
MAX_N_PROBS = 20


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _finite(**kw: Any) -> Any:
    return Field(None, allow_inf_nan=False, **kw)


class JsonSchemaFormat(StrictModel):
    """OpenAI's response_format.json_schema; only `schema` constrains (name, description, strict are
    accepted and otherwise unused: every schema is enforced)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class PredictionPart(StrictModel):
    type: Literal["text"]
    text: str


class Prediction(StrictModel):
    """OpenAI's predicted output: text the answer is expected to repeat (the file being edited), a draft source."""

    type: Literal["content"]
    content: str | list[PredictionPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(StrictModel):
    """OpenAI's response_format; `schema` beside type json_object is llama-server's extension."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    def source(self) -> GrammarSource | None:
        if self.type == "text":
            return None
        if self.type == "json_object":  # OpenAI: a JSON object (llama-server: any value when no schema)
            return GrammarSource.json_schema(self.schema_ if self.schema_ is not None else {"type": "object"})
        if self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        schema = self.json_schema.schema_
        return GrammarSource.json_schema(schema if schema is not None else {})


class LoraScale(StrictModel):
    """One LoRA adapter's scale (llama-server's `lora` entries and POST /lora-adapters)."""

    id: int = Field(ge=0)
    scale: float = Field(allow_inf_nan=False)


class GenerationFields(StrictModel):
    """Sampling, stop and speculative options shared by all generation endpoints; None = server default."""

    temperature: float | None = _finite()
    top_k: int | None = None
    top_p: float | None = _finite(ge=0, le=1)
    min_p: float | None = _finite(ge=0, le=1)
    repeat_penalty: float | None = _finite(gt=0)
    repeat_last_n: int | None = Field(None, ge=-1)
    presence_penalty: float | None = _finite()
    frequency_penalty: float | None = _finite()
    seed: int | None = Field(None, ge=-1, le=2**64 - 1)
    stop: str | list[str] | None = None
    cache_prompt: bool = True
    # vLLM's: prompt caches are shared only between requests of the same salt (and API key)
    cache_salt: str | None = Field(None, max_length=256)
    n_keep: int = Field(0, ge=-1)  # with --context-shift: tokens kept from the start when the context fills
    return_progress: bool = False  # streams: prompt_progress while the prompt is read (llama-server's)
    timings_per_token: bool = False  # streams: every chunk carries the timings so far (llama-server's)
    ignore_eos: bool = False  # generate past end-of-generation tokens
    spec_type: str | None = Field(None, alias="speculative.type")
    spec_n_max: int | None = Field(None, alias="speculative.n_max", ge=0)
    spec_n_min: int | None = Field(None, alias="speculative.n_min", ge=0)
    spec_p_min: float | None = _finite(alias="speculative.p_min", ge=0, le=1)
    # The ngram sizes are clamped to [1, 1024] like llama-server does (spec/speculative.md).
    spec_ngram_size_n: int | None = Field(None, alias="speculative.ngram_size_n")
    spec_ngram_size_m: int | None = Field(None, alias="speculative.ngram_size_m")
    spec_ngram_c_rate: int | None = Field(None, alias="speculative.ngram_c_rate")
    spec_ngram_m_hits: int | None = Field(None, alias="speculative.ngram_m_hits")
    # whose earlier requests ngram-suffix may draft from, within the API key's (shared_suffix.py)
    spec_scope: str | None = Field(None, alias="speculative.scope", max_length=256)
    # a token tree of this many nodes from every drafter's candidate, verified in one step (0: chains)
    spec_tree_nodes: int | None = Field(None, alias="speculative.tree_nodes", ge=0, le=MAX_TREE_NODES)
    # Constrained output (engine/constraints.py): at most one of these; "" grammar = none, as llama-server.
    grammar: str | None = None  # llama.cpp GBNF
    json_schema: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    # llama-server's [[token id or text, bias or false], ...] or OpenAI's {"token id": bias} (server/prompts.py)
    logit_bias: LogitBiasInput | None = None
    prediction: Prediction | None = None  # OpenAI's; on every generation endpoint (llama-server has none)
    lora: list[LoraScale] | None = None  # LoRA scales for this request (server/lora_adapters.py)

    @model_validator(mode="before")
    @classmethod
    def _known_speculative_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(k for k in data if isinstance(k, str) and k.startswith("speculative.")
                             and k not in SPEC_FIELDS)
            if unknown:
                raise ValueError(f"unknown speculative option(s): {', '.join(unknown)} "
                                 f"(known: {', '.join(SPEC_FIELDS)})")
            if "speculative" in data:
                raise ValueError("give speculative options as flat keys, e.g. \"speculative.n_max\": 8")
        return data

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> GenerationFields:
        given = [name for name, on in (("grammar", bool(self.grammar)), ("json_schema", self.json_schema is not None),
                                       ("response_format", self.response_format is not None
                                        and self.response_format.type != "text")) if on]
        if len(given) > 1:
            raise ValueError(f"give one of grammar, json_schema and response_format, not {' and '.join(given)}")
        if self.response_format is not None:
            self.response_format.source()  # a json_schema type without its json_schema: say so here
        return self

    def grammar_source(self) -> GrammarSource | None:
        """What the output is constrained by, if anything (compiled by the engine, off the event loop)."""
        if self.grammar:
            return GrammarSource("gbnf", self.grammar)
        if self.json_schema is not None:
            return GrammarSource.json_schema(self.json_schema)
        return self.response_format.source() if self.response_format is not None else None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_overrides(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}

    def spec_overrides(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, name in SPEC_FIELDS.items():
            value = getattr(self, "spec_" + key.removeprefix("speculative."))
            if value is None:
                continue
            if key.startswith("speculative.ngram_"):
                value = min(max(value, 1), 1024)
            out[name] = value
        return out


MAX_CHOICES = 128  # n, as OpenAI's limit


class CompletionRequest(GenerationFields):
    """llama-server's native POST /completion (a batch of prompts gives a list of results)."""

    prompt: PromptInput
    n_predict: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=-1)  # llama-server accepts it as n_predict's alias
    stream: bool = False
    n_probs: int = Field(0, ge=0, le=MAX_N_PROBS)
    return_tokens: bool = False
    response_fields: list[str] | None = None  # only these fields of each result ("a/b": b inside a)


class ExtraChunk(StrictModel):
    """One file of /infill's input_extra: context put before the prefix."""

    text: str
    filename: str = "tmp"


class InfillRequest(CompletionRequest):
    """llama-server's POST /infill: fill in between input_prefix and input_suffix (FIM models)."""

    prompt: str = ""  # type: ignore[assignment]  # (text that follows the prefix; one string here)
    input_prefix: str | list[PromptPart]
    input_suffix: str | list[PromptPart]
    input_extra: list[ExtraChunk] = Field(default_factory=list)


class StreamOptions(StrictModel):
    include_usage: bool = False


class OpenAICommon(GenerationFields):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    n_predict: int | None = Field(None, ge=-1)  # llama-server's own name; wins over max_tokens, as there
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices, each its own task
    stream: bool = False
    stream_options: StreamOptions | None = None


class OpenAICompletionRequest(OpenAICommon):
    """POST /v1/completions."""

    prompt: PromptInput
    logprobs: int | None = Field(None, ge=0, le=MAX_N_PROBS)
    echo: bool = False
    suffix: None = None  # fill-in-the-middle is not supported


class ContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_calls, ...) go to the chat template unchanged."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[ContentPart] | None = None

    def template_dict(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=False)
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        return out


class ToolChoiceFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    """OpenAI's tool_choice that forces one function: {"type": "function", "function": {"name": ...}}."""

    type: Literal["function"]
    function: ToolChoiceFunction


class ChatTemplateFields(StrictModel):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    # OpenAI's: None means "auto" when there are tools, else "none" (server/chat_tools.py says what each does)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # vLLM's: the last (assistant) message is continued, as a trailing assistant message always is here; it
    # asks for add_generation_prompt false, as there
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _continued_message(self) -> ChatTemplateFields:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: set "
                             "add_generation_prompt to false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

    @model_validator(mode="after")
    def _valid_tools(self) -> ChatTemplateFields:
        if self.tools:
            validate_tools(self.tools)  # its ValueError names the tool
        choice = self.choice()
        if choice in ("none", "auto"):
            return self
        if not self.tools:
            raise ValueError("tool_choice requires a call, but no tools are given")
        name = choice["function"]["name"] if isinstance(choice, dict) else None
        if name is not None and all(tool["function"]["name"] != name for tool in self.tools):
            raise ValueError(f"tool_choice names function '{name}', which is not among the tools")
        return self

    def choice(self) -> str | dict[str, Any]:
        """tool_choice as call_grammar takes it: "none", "auto", "required" or the named-function object."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice

    @field_validator("messages")
    @classmethod
    def _one_trailing_assistant(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        # As llama-server: a last assistant message is the start of the answer; two are a mistake.
        if len(value) >= 2 and value[-1].role == value[-2].role == "assistant":
            raise ValueError("cannot have 2 or more assistant messages at the end of the list")
        return value

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]


class ChatRequest(OpenAICommon, ChatTemplateFields):
    """POST /v1/chat/completions."""

    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_N_PROBS)
    # Control-token text in messages and tools is tokenized as text unless this is true (docs/compatibility.md).
    parse_special: bool = False
    # How reasoning is split from the answer (server/reasoning.py); None: the server's --reasoning-format
    reasoning_format: Literal["none", "deepseek", "auto"] | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:  # as OpenAI and llama-server
            raise ValueError("top_logprobs requires logprobs to be set to true")
        return self

    @model_validator(mode="after")
    def _tool_choice_or_grammar(self) -> ChatRequest:
        # Both would constrain the output, and two grammars cannot both hold.
        if self.tool_choice not in (None, "none") and self.grammar_source() is not None:
            raise ValueError("tool_choice cannot be combined with grammar, json_schema or response_format")
        return self


class ApplyTemplateRequest(ChatTemplateFields):
    """POST /apply-template."""


M = TypeVar("M", bound=BaseModel)
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        if err["type"] == "json_invalid":
            return f"malformed JSON: {err['msg'].removeprefix('Invalid JSON: ')}"
        if err["type"] == "model_type" and not err["loc"]:
            return "the request body must be a JSON object"
        # Union members show up in the location as type names ('str', 'list[int]'): leave them out.
        loc = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p)))
        msg = err["msg"].removeprefix("Value error, ")
        part = f"{loc}: {msg}" if loc else msg
        if part not in parts:
            parts.append(part)
    return "invalid request: " + "; ".join(parts)


def parse_body(model: type[M], body: bytes) -> M:
    """Validate a JSON body; SpecserveError (-> 400) with a readable message otherwise."""
    if not body.strip():
        raise SpecserveError("the request body is empty (expected a JSON object)")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise SpecserveError(_describe(exc)) from None
