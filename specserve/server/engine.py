"""The served model: runners, tokenizer and scheduler, plus request -> Task translation.

Everything here is independent of HTTP: it raises SpecserveError for bad input, which the
app turns into a 400.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specserve import catalog
from specserve.engine.constraints import GrammarCompiler, GrammarSource
from specserve.engine.loading import RemoteOptions, load_with_draft
from specserve.engine.local_runner import DEFAULT_CTX, checked_device
from specserve.engine.logit_bias import LogitBias
from specserve.engine.runner import Runner, model_file
from specserve.engine.sampling import SamplingParams, choice_seed
from specserve.engine.scheduler import Scheduler
from specserve.engine.slot_state import POOLINGS
from specserve.engine.slots import SchedulerCounters
from specserve.engine.tasks import Task
from specserve.errors import SpecserveError
from specserve.gguf.chat_template import apply_chat_template
from specserve.gguf.reader import GGUFFile
from specserve.gguf.tokenizer import Tokenizer
from specserve.model.registry import read_config
from specserve.server.chat_tokens import ControlTokens
from specserve.server.chat_tools import ToolPlan, ToolStyle, plan_tools
from specserve.server.errors import ContextSizeError
from specserve.server.prompts import PromptInput, resolve_logit_bias, split_prompts, tokenize_one
from specserve.server.reasoning import FORMATS as REASONING_FORMATS
from specserve.server.schemas import ChatTemplateFields, GenerationFields
from specserve.server.tokenizing import TextEncoder
from specserve.speculative.base import SpecParams
from specserve.speculative.factory import build_chain
from specserve.speculative.shared_suffix import DEFAULT_TOKENS, SuffixStore

log = logging.getLogger(__name__)

# Template variables a request's chat_template_kwargs must not replace.
_RESERVED_TEMPLATE_VARS = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"}


@dataclass
class ServerSettings:
    model: str | None = None  # catalog name or GGUF path; None = the default model
    model_draft: str | None = None
    # -c: KV positions all slots share (a paged pool), each slot able to reach all of them; None: 4096 a slot at
    # most (the model's training context if shorter), a pool of that times the slots
    ctx_size: int | None = None
    n_parallel: int = 4
    # prompt prefixes kept beyond the slots' caches (kv_room.py); None: as many as slots, at least 8
    cache_prefixes: int | None = None
    n_batch: int = 512
    adaptive_drafts: bool = True  # the draft gate (engine/draft_gate.py); False: slots draft whenever they can
    chain_drafts: bool = True  # past the gate's slot count, drafts ride chained steps; False: none drafts there
    # ngram-suffix also drafts from earlier requests of the same scope: tokens they keep in all (0: off)
    spec_shared_tokens: int = DEFAULT_TOKENS
    n_predict: int = -1
    device: str | None = None
    weight_format: str = "auto"  # see specserve.model.weights.WEIGHT_FORMATS
    remote: RemoteOptions | None = None  # run the model on a remote host
    tensor_parallel: int = 1  # ranks the model is split over (engine/tp_runner.py)
    alias: str | None = None  # names the API shows and accepts, comma-separated (the first is shown)
    tags: list[str] = field(default_factory=list)  # informational, shown by /v1/models (llama-server's --tags)
    chat_template: str | None = None  # Jinja text replacing the GGUF's template (--chat-template[-file])
    mmap: bool = True  # read the GGUF through a memory map; False: into memory at load (--no-mmap)
    endpoint_slots: bool = True  # GET /slots (llama-server's --slots / --no-slots)
    endpoint_metrics: bool = False  # GET /metrics (llama-server's --metrics: off unless asked for)
    context_shift: bool = False  # --context-shift: a generation that fills its context drops old tokens, goes on
    verbose: bool = False  # -v/--verbose: debug logs, and OpenAI answers carry `__verbose` (llama-server's)
    webui: bool = True  # the chat page at / (llama-server's --webui / --no-webui)
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    max_queue: int = 256  # generation requests waiting for a slot; more get 503
    responses_store: int = 256  # past /v1/responses kept for previous_response_id (responses_store.py); 0: none
    cors_origins: list[str] = field(default_factory=lambda: ["*"])  # browser origins allowed; [] = no CORS
    slot_save_path: str | None = None  # directory of /slots save/restore files; None: those actions are 501
    pooling: str | None = None  # embeddings: "mean" or "last"; None: the GGUF's pooling_type if one of them, else mean
    reasoning_format: str = "auto"  # --reasoning-format: how a chat answer's reasoning is split (reasoning.py)
    reasoning_budget: int = -1  # --reasoning-budget: -1 unlimited, 0 thinking off (the template's enable_thinking)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    spec: SpecParams = field(default_factory=SpecParams)

    def held_prefixes(self) -> int:
        return max(8, self.n_parallel) if self.cache_prefixes is None else self.cache_prefixes

    def kv_size(self) -> int | None:
        """-c: the pool's positions, which is also the most one slot may reach; None when not given."""
        if self.ctx_size is None or self.ctx_size == 0:
            return None
        if self.ctx_size < 16:
            raise SpecserveError(f"context size {self.ctx_size} is too small; give -c 16 or more")
        return self.ctx_size

    def default_kv_size(self) -> int:
        """Without -c: a pool of min(model, 4096) positions a slot (held prefixes get none of their own: they
        share what the slots leave). A remote host's model is not read here: 4096 a slot, the host's default
        context per sequence within it."""
        per_slot = DEFAULT_CTX
        if self.remote is None:
            gguf = GGUFFile(catalog.resolve(self.model))
            per_slot = min(read_config(gguf.metadata, set(gguf.tensor_names())).context_length,
                           DEFAULT_CTX)
        return per_slot * self.n_parallel


def check_settings(s: ServerSettings) -> None:
    if s.n_parallel < 1:
        raise SpecserveError(f"-np/--parallel must be at least 1, got {s.n_parallel}")
    if s.cache_prefixes is not None and s.cache_prefixes < 0:
        raise SpecserveError(f"--cache-prefixes must not be negative, got {s.cache_prefixes}")
    if s.n_batch < 1:
        raise SpecserveError(f"-b/--batch-size must be at least 1, got {s.n_batch}")
    if s.n_predict < -1:
        raise SpecserveError(f"-n/--n-predict must be -1 (unlimited) or more, got {s.n_predict}")
    if s.ctx_size is not None and s.ctx_size < 0:
        raise SpecserveError(f"-c/--ctx-size must not be negative, got {s.ctx_size}")
    if s.max_body_bytes < 1:
        raise SpecserveError(f"--max-body-bytes must be at least 1, got {s.max_body_bytes}")
    if s.max_queue < 0:
        raise SpecserveError(f"--max-queue must not be negative, got {s.max_queue}")
    if s.spec_shared_tokens < 0:
        raise SpecserveError(f"--spec-shared-tokens must not be negative, got {s.spec_shared_tokens}")
    if s.responses_store < 0:
        raise SpecserveError(f"--responses-store must not be negative, got {s.responses_store}")
    if s.pooling is not None and s.pooling not in POOLINGS:
        raise SpecserveError(f"--pooling must be one of {', '.join(POOLINGS)}, got {s.pooling!r}")
    if s.reasoning_format not in REASONING_FORMATS:
        raise SpecserveError(f"--reasoning-format must be one of {', '.join(REASONING_FORMATS)}, "
                             f"got {s.reasoning_format!r}")
    if s.reasoning_budget not in (-1, 0):  # a token budget would need the scheduler to end the block
        raise SpecserveError(f"--reasoning-budget: only -1 (unlimited) and 0 (thinking off) are supported, "
                             f"got {s.reasoning_budget}")
    if s.slot_save_path is not None:
        try:
            Path(s.slot_save_path).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SpecserveError(f"--slot-save-path {s.slot_save_path}: {exc.strerror or exc}") from None
    if s.remote is None:  # (a remote host checks its own device)
        checked_device(s.device)
    s.sampling.validate()
    s.spec.validate()


def _gguf_pooling(runner: Runner) -> str:
    """Embedding models say how they pool (`{arch}.pooling_type`: 1 mean, 3 last); generative ones do not."""
    gguf = getattr(runner, "gguf", None)
    meta = getattr(gguf, "metadata", None) or {}
    kind = meta.get(f"{meta.get('general.architecture')}.pooling_type")
    return "last" if kind == 3 else "mean"


class Engine:
    """A loaded model serving requests through its scheduler."""

    def __init__(self, settings: ServerSettings, model_path: Path, runner: Runner,
                 draft_runner: Runner | None, tokenizer: Tokenizer):
        self.settings = settings
        self.model_path = model_path
        self.runner = runner
        self.draft_runner = draft_runner
        self.tokenizer = tokenizer
        self.encoder = TextEncoder(tokenizer)
        self.control_tokens = ControlTokens(self.encoder)
        self.tool_style = ToolStyle.of(tokenizer)  # how the chat template has the model write tool calls
        self.grammars = GrammarCompiler(tokenizer)  # grammar / json_schema / response_format requests
        if draft_runner is not None and draft_runner.n_seqs < settings.n_parallel:
            raise SpecserveError("the draft runner needs one sequence per slot")
        self.suffix_store = SuffixStore(settings.spec_shared_tokens) if settings.spec_shared_tokens > 0 else None
        self.scheduler = Scheduler(runner, tokenizer, n_batch=settings.n_batch, n_slots=settings.n_parallel,
                                   adaptive_drafts=settings.adaptive_drafts, chain_drafts=settings.chain_drafts,
                                   chain_factory=lambda spec, slot: build_chain(spec, draft_runner, seq=slot,
                                                                                shared=self.suffix_store))
        self.n_ctx = runner.n_ctx
        self.pooling = settings.pooling or _gguf_pooling(runner)
        self.created = int(time.time())
        self.aliases = [a.strip() for a in (settings.alias or "").split(",") if a.strip()]
        name = self.aliases[0] if self.aliases else settings.model or catalog.DEFAULT_MODEL
        self.model_name = Path(name).stem if name.endswith(".gguf") else name

    @classmethod
    def load(cls, settings: ServerSettings, progress: bool = True) -> Engine:
        check_settings(settings)
        ctx = settings.kv_size()  # the most one slot may reach: the pool, as given; else the runner's default
        kv_size = ctx or settings.default_kv_size()
        runner, draft_runner, path = load_with_draft(settings.model, settings.model_draft, remote=settings.remote,
                                                     n_seqs=settings.n_parallel + settings.held_prefixes(),
                                                     n_ctx=ctx, kv_size=kv_size,
                                               device=settings.device, progress=progress,
                                               weight_format=settings.weight_format,
                                               tensor_parallel=settings.tensor_parallel, mmap=settings.mmap)
        build_chain(settings.spec)  # fail now, not per request, on e.g. a missing static lookup cache
        # Capture the CUDA graphs of decode/verify steps now (a no-op on CPU), not inside the first requests.
        runner.warmup(max_rows=settings.n_parallel * (1 + settings.spec.n_max), sequences=settings.n_parallel)
        if draft_runner is not None:  # the slots draft together: a row each per draft token
            draft_runner.warmup(max_rows=settings.n_parallel, sequences=settings.n_parallel)
        tokenizer = Tokenizer.from_gguf(model_file(runner))
        if settings.chat_template is not None:
            tokenizer.chat_template = settings.chat_template  # what /props shows and every chat renders
        engine = cls(settings, path, runner, draft_runner, tokenizer)
        engine.grammars.warm()  # the grammar library's vocabulary holds the GIL while built: now, not mid-stream
        engine.scheduler.start()
        return engine

    def slot_model(self) -> dict[str, object]:
        """What a slot file records of the model its K/V belong to (engine/slot_state.py)."""
        return {"file": self.model_path.name, "bytes": self.runner.file_bytes}

    def shutdown(self) -> None:
        self.scheduler.shutdown()

    def counters(self) -> SchedulerCounters:
        """The scheduler's counters, with the shared suffix store's size (/metrics)."""
        c = self.scheduler.counters_snapshot()
        if self.suffix_store is not None:
            c.shared_requests, c.shared_tokens = self.suffix_store.sizes()
        return c

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
                if self.draft_runner is None:
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
                                  cache_prompt=fields.cache_prompt, n_probs=n_probs, ignore_eos=fields.ignore_eos,
                                  constraint=constraint, logit_bias=logit_bias, keep_special=keep_special,
                                  prediction=prediction or None, return_progress=fields.return_progress,
                                  timings_per_token=fields.timings_per_token, context_shift=s.context_shift,
                                  n_keep=fields.n_keep))
        return tasks

    @staticmethod
    def scope_tasks(tasks: list[Task], tenant: str) -> None:
        """Tasks draft from earlier requests (shared_suffix.py) of their tenant (which API key authorised them)
        and, within it, of the scope their client named."""
        for task in tasks:
            task.spec = replace(task.spec, scope=f"{tenant}/{task.spec.scope}")

    def default_params(self) -> dict[str, object]:
        s = self.settings
        return Task([0], s.sampling, s.spec, n_predict=s.n_predict).params_json()

    def token_piece(self, token: int) -> str:
        return self.tokenizer.token_bytes(token).decode("utf-8", errors="replace")
