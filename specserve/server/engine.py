"""The served model as the HTTP front sees it: its facts, tokenizer and engine core (core.py), plus request ->
Task translation.

Everything here is independent of HTTP: it raises SpecserveError for bad input, which the
app turns into a 400.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from specserve import catalog
from specserve.engine.constraints import GrammarCompiler, GrammarSource
from specserve.engine.logit_bias import LogitBias
from specserve.engine.runner import Runner, model_file
from specserve.engine.sampling import choice_seed
from specserve.engine.slots import SchedulerCounters
from specserve.engine.tasks import Task
from specserve.errors import SpecserveError
from specserve.gguf.chat_template import apply_chat_template
from specserve.gguf.tokenizer import Tokenizer
from specserve.server.chat_tokens import ControlTokens
from specserve.server.chat_tools import ToolPlan, ToolStyle, plan_tools
from specserve.server.core import EngineCore, LocalCore, ModelFacts, load_model
from specserve.server.core_client import CoreClient
from specserve.server.errors import ContextSizeError
from specserve.server.lora_adapters import LoraAdapters
from specserve.server.prompts import PromptInput, resolve_logit_bias, split_prompts, tokenize_one
from specserve.server.schemas import ChatTemplateFields, GenerationFields
from specserve.server.settings import ServerSettings, check_settings
from specserve.server.sleeping_core import SleepingCore
from specserve.server.tokenizing import TextEncoder

log = logging.getLogger(__name__)

# Template variables a request's chat_template_kwargs must not replace.
_RESERVED_TEMPLATE_VARS = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"}


def _gguf_pooling(metadata: dict[str, Any]) -> str:
    """Embedding models say how they pool (`{arch}.pooling_type`: 1 mean, 3 last); generative ones do not."""
    kind = metadata.get(f"{metadata.get('general.architecture')}.pooling_type")
    return "last" if kind == 3 else "mean"


class Engine:
    """A loaded model serving requests through its engine core (core.py: in this process, or in its own)."""

    def __init__(self, settings: ServerSettings, model: ModelFacts, core: EngineCore, tokenizer: Tokenizer):
        self.settings = settings
        self.model = model
        self.core = core
        self.tokenizer = tokenizer
        self.encoder = TextEncoder(tokenizer)
        self.control_tokens = ControlTokens(self.encoder)
        self.tool_style = ToolStyle.of(tokenizer)  # how the chat template has the model write tool calls
        self.grammars = GrammarCompiler(tokenizer)  # grammar / json_schema / response_format requests
        self.n_ctx = model.n_ctx
        self.pooling = settings.pooling or _gguf_pooling(model.file.metadata)
        self.created = int(time.time())
        self.aliases = [a.strip() for a in (settings.alias or "").split(",") if a.strip()]
        name = self.aliases[0] if self.aliases else settings.model or catalog.DEFAULT_MODEL
        self.model_name = Path(name).stem if name.endswith(".gguf") else name
        self.lora = LoraAdapters(settings.lora)

    @classmethod
    def local(cls, settings: ServerSettings, model_path: Path, runner: Runner, draft_runner: Runner | None,
              tokenizer: Tokenizer) -> Engine:
        """An engine over runners of this process, its scheduler in a thread here (started)."""
        return cls(settings, ModelFacts.of(model_path, runner, draft_runner),
                   _local_core(settings, runner, draft_runner, tokenizer), tokenizer)

    @classmethod
    def load(cls, settings: ServerSettings, progress: bool = True) -> Engine:
        """The model loaded, in an engine core process of its own (settings.core_process) or in this one."""
        check_settings(settings)
        core, facts, tokenizer = _load_core(settings, None, progress)
        engine = cls(settings, facts, core, tokenizer)
        if settings.sleep_idle_seconds > 0:
            def reload() -> EngineCore:
                return _load_core(settings, tokenizer, False)[0]

            engine.core = SleepingCore(core, reload, settings.sleep_idle_seconds, settings.n_parallel, engine.n_ctx)
        engine.grammars.warm()  # the grammar library's vocabulary holds the GIL while built: now, not mid-stream
        return engine

    @property
    def model_path(self) -> Path:
        return self.model.path

    def slot_model(self) -> dict[str, object]:
        """What a slot file records of the model its K/V belong to (engine/slot_state.py)."""
        return {"file": self.model.path.name, "bytes": self.model.file_bytes}

    def shutdown(self) -> None:
        self.core.shutdown()

    def counters(self) -> SchedulerCounters:
        """The scheduler's counters, with the shared suffix store's size (/metrics)."""
        return self.core.counters()

    # -- prompts ------------------------------------------------------------------------------------

    def tokenize_prompts(self, prompt: PromptInput) -> list[list[int]]:
        """A completion request's prompts (one, or a batch: server/prompts.py), text with bos as the model
        asks. (CPU-heavy: call it from a worker thread, as every method here that tokenizes or renders.)"""
        return [tokenize_one(self.encoder, p) for p in split_prompts(prompt)]

    def _render(self, req: ChatTemplateFields, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None) -> str:
        extra: dict[str, Any] = dict(req.chat_template_kwargs or {})
        reserved = _RESERVED_TEMPLATE_VARS & extra.keys()
        if reserved:
            raise SpecserveError(f"chat_template_kwargs must not set {', '.join(sorted(reserved))}")
        if tools is not None:
            extra["tools"] = tools
        if self.settings.reasoning_budget == 0:  # thinking off, as llama-server: templates that can, skip it
            extra.setdefault("enable_thinking", False)
        # Assistant prefill, as llama-server: a last assistant message is the start of the answer, so what
        # comes before it is rendered with the generation prompt and its text follows unchanged.
        prefill, add_generation_prompt = "", req.add_generation_prompt
        if messages and messages[-1].get("role") == "assistant":
            prefill, messages, add_generation_prompt = messages[-1].get("content") or "", messages[:-1], True
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                   **extra) + prefill

    def tool_plan(self, req: ChatTemplateFields, own_constraint: bool = False) -> ToolPlan:
        """What the request's tools do to its prompt, constraint and output (chat_tools.py)."""
        return plan_tools(req, self.tool_style, own_constraint)

    def render_chat(self, req: ChatTemplateFields) -> str:
        plan = self.tool_plan(req)
        return self._render(req, plan.messages, plan.tools)

    def chat_prompt(self, req: ChatTemplateFields, plan: ToolPlan,
                    parse_special: bool = False) -> tuple[list[int], str]:
        """The chat's prompt tokens and rendered text. Control-token text inside messages and tools is plain
        text unless parse_special (chat_tokens.py); the template writes any bos itself, as HF's
        apply_chat_template does."""
        messages, tools = plan.messages, plan.tools
        if parse_special or not self.control_tokens.found_in([messages, tools]):
            text = self._render(req, messages, tools)
            return self.encoder.encode(text, add_special=False, parse_special=True), text
        (messages, tools), placeholders = self.control_tokens.mask([messages, tools])
        text = self._render(req, messages, tools)
        return self.control_tokens.encode_rendered(text, placeholders), text

    # -- tasks --------------------------------------------------------------------------------------

    def make_tasks(self, fields: GenerationFields, prompts: list[list[int]], n_predict: int | None,
                   n_probs: int = 0, n_choices: int = 1, *, grammar: GrammarSource | None = None,
                   keep_special: frozenset[int] = frozenset()) -> list[Task]:
        """n_choices tasks per prompt, prompt-major; with a fixed seed choice i samples with a seed of its
        own drawn from (seed, i), so choices differ and repeat. `grammar` constrains the output where the
        request's fields do not (a forced tool call); `keep_special`: see Task."""
        s = self.settings
        try:
            sampling = replace(s.sampling, **fields.sampling_overrides()).validate()
            overrides = fields.spec_overrides()
            if overrides.get("type") == "draft":
                if self.model.draft_path is None:
                    raise SpecserveError("speculative type 'draft' needs a draft model (start the server with -md)")
                overrides["type"] = "none"  # the draft model drafts whenever the draft-free type has nothing
            spec = s.spec.with_overrides(**overrides)
        except TypeError as exc:  # a value of the wrong kind that the schema let through
            raise SpecserveError(f"invalid parameter: {exc}") from None
        bias = resolve_logit_bias(self.encoder, fields.logit_bias) if fields.logit_bias else {}
        logit_bias = LogitBias(bias) if bias else None  # (read-only: the tasks share it)
        source = fields.grammar_source() or grammar
        # plain text: a prediction that spells a control token must not become one
        prediction = (self.encoder.encode(fields.prediction.text(), add_special=False, parse_special=False)
                      if fields.prediction is not None else None)
        adapters = self.lora.for_request(fields.lora)
        tasks = []
        for prompt in prompts:
            if not prompt:
                raise SpecserveError("the prompt is empty")
            if len(prompt) >= self.n_ctx:
                raise ContextSizeError(len(prompt), self.n_ctx)
            limit = s.n_predict if n_predict is None else n_predict
            # At most the tokens that fit the slot (the last generated one needs no room of its own), so
            # the limit shown in /slots and generation_settings is one the request can reach (a context shift
            # makes room as it goes).
            if not s.context_shift:
                limit = min(limit, self.n_ctx - len(prompt) + 1)
            for choice in range(n_choices):
                # Compiled here, in the request's worker thread (never on the event loop or the scheduler's
                # thread); each task gets a matcher of its own.
                constraint = self.grammars.compile(source) if source is not None else None
                tasks.append(Task(prompt=prompt, sampling=replace(sampling, seed=choice_seed(sampling.seed, choice)),
                                  spec=spec, n_predict=limit, stop=fields.stop_list(),
                                  cache_prompt=fields.cache_prompt, cache_salt=fields.cache_salt or "",
                                  n_probs=n_probs, ignore_eos=fields.ignore_eos,
                                  constraint=constraint, logit_bias=logit_bias, keep_special=keep_special,
                                  prediction=prediction or None, return_progress=fields.return_progress,
                                  timings_per_token=fields.timings_per_token, context_shift=s.context_shift,
                                  n_keep=fields.n_keep, adapters=adapters))
        return tasks

    @staticmethod
    def scope_tasks(tasks: list[Task], tenant: str) -> None:
        """Tasks draft from earlier requests (shared_suffix.py) of their tenant (which API key authorised them)
        and, within it, of the scope their client named; they reuse prompt caches of their tenant only (with API
        keys), and within it of their cache salt."""
        for task in tasks:
            task.spec = replace(task.spec, scope=f"{tenant}/{task.spec.scope}")
            if tenant:
                task.cache_salt = f"{tenant}/{task.cache_salt}"

    def default_params(self) -> dict[str, object]:
        s = self.settings
        return Task([0], s.sampling, s.spec, n_predict=s.n_predict).params_json()

    def token_piece(self, token: int) -> str:
        return self.tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def _local_core(settings: ServerSettings, runner: Runner, draft_runner: Runner | None,
                tokenizer: Tokenizer) -> LocalCore:
    core = LocalCore(settings, runner, draft_runner, tokenizer)
    core.start()
    return core


def _load_core(settings: ServerSettings, tokenizer: Tokenizer | None,
               progress: bool) -> tuple[EngineCore, ModelFacts, Tokenizer]:
    """The model loaded into a core (a process of its own, or this one's thread), what the front knows of it, and
    its tokenizer (given: one read before, when the core is loaded again after a sleep)."""
    if settings.core_process:
        client = CoreClient(settings)
        tok = tokenizer or _with_template(Tokenizer.from_gguf(client.model.file), settings)
        return client, client.model, tok
    runner, draft_runner, path = load_model(settings, progress)
    tok = tokenizer or _with_template(Tokenizer.from_gguf(model_file(runner)), settings)
    return _local_core(settings, runner, draft_runner, tok), ModelFacts.of(path, runner, draft_runner), tok


def _with_template(tokenizer: Tokenizer, settings: ServerSettings) -> Tokenizer:
    if settings.chat_template is not None:
        tokenizer.chat_template = settings.chat_template  # what /props shows and every chat renders
    return tokenizer
