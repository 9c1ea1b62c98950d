"""A generation request and the events that flow back to its requester.

The scheduler consumes Tasks and emits Chunk / Result / Failure through the requester's
callback; the server turns them into HTTP responses.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from specserve.engine.constraints import Constraint
from specserve.engine.logit_bias import LogitBias
from specserve.engine.sampling import SamplingParams
from specserve.errors import SpecserveError
from specserve.speculative.base import SpecParams

log = logging.getLogger(__name__)

_task_ids = itertools.count()


# What besides its tokens a cached K/V's reuse depends on: the LoRA scales it was computed with and the cache salt
KVKey = tuple[tuple[float, ...], str]


@dataclass
class Task:
    """One generation request, already tokenized and validated."""

    prompt: list[int]
    sampling: SamplingParams
    spec: SpecParams
    n_predict: int = -1  # -1: until end of generation or a full context
    stop: list[str] = field(default_factory=list)
    cache_prompt: bool = True
    n_probs: int = 0  # top log-probabilities reported per generated token
    ignore_eos: bool = False  # generate past end-of-generation tokens (benchmarks)
    # grammar / JSON schema: this task's own matcher state (GrammarCompiler.compile() makes one per task)
    constraint: Constraint | None = None
    logit_bias: LogitBias | None = None  # None when the request gives none (the greedy argmax shortcut stays open)
    prediction: list[int] | None = None  # the request's guess at its answer: a draft source (speculative/prediction.py)
    # Control tokens whose text the answer keeps (the others are left out): a chat's tool-call markers, which
    # its parser reads (server/chat_tools.py)
    keep_special: frozenset[int] = frozenset()
    return_progress: bool = False  # Progress events while the prompt is read (llama-server's return_progress)
    # A generation that fills the context drops the oldest half of its tokens after the first n_keep (-1: the
    # prompt's) and goes on (llama-server's --context-shift); False: it ends there (stop_type limit, truncated)
    context_shift: bool = False
    n_keep: int = 0
    timings_per_token: bool = False  # every Chunk carries the timings so far
    adapters: tuple[float, ...] = ()  # a scale per loaded LoRA adapter (model/lora.py); (): none applies
    # Prompt caches are reused only between tasks of one salt (vLLM's cache_salt; the server puts the request's
    # API key in it): another salt's cached K/V are neither taken nor timed
    cache_salt: str = ""
    id: int = field(default_factory=lambda: next(_task_ids))

    @property
    def kv_key(self) -> KVKey:
        """What besides the tokens decides which cached K/V the task may reuse."""
        return self.adapters, self.cache_salt

    def params_json(self) -> dict[str, object]:
        """The task's parameters as llama-server shows them (in /slots and in responses)."""
        s, p = self.sampling, self.spec
        return {
            "n_predict": self.n_predict, "seed": s.seed, "temperature": s.temperature, "top_k": s.top_k,
            "top_p": s.top_p, "min_p": s.min_p, "repeat_penalty": s.repeat_penalty,
            "repeat_last_n": s.repeat_last_n, "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty, "stop": list(self.stop), "n_probs": self.n_probs,
            "cache_prompt": self.cache_prompt, "ignore_eos": self.ignore_eos,
            "timings_per_token": self.timings_per_token, "return_progress": self.return_progress,
            "n_keep": self.n_keep, "lora": [{"id": i, "scale": s} for i, s in enumerate(self.adapters)],
            "grammar": self.constraint.source.text if self.constraint is not None else "",
            "logit_bias": self.logit_bias.to_json() if self.logit_bias is not None else [],
            "speculative.n_max": p.n_max, "speculative.n_min": p.n_min, "speculative.p_min": p.p_min,
            "speculative.type": p.type, "speculative.ngram_size_n": p.ngram_size_n,
            "speculative.ngram_size_m": p.ngram_size_m, "speculative.ngram_c_rate": p.ngram_check_rate,
            "speculative.ngram_m_hits": p.ngram_min_hits,
        }


def check_task(task: Task, n_ctx: int, speculates: bool) -> None:
    """SpecserveError for a task no slot of n_ctx positions can run (speculates: the scheduler has speculators)."""
    if not task.prompt:
        raise SpecserveError("the prompt is empty")
    if len(task.prompt) >= n_ctx:
        raise SpecserveError(f"the prompt ({len(task.prompt)} tokens) does not fit the slot context "
                             f"({n_ctx} tokens, one of them for the first generated token)")
    if task.spec.n_max > 0 and task.spec.type != "none" and not speculates:
        raise SpecserveError("this scheduler has no speculators")


# ---- what flows back to the requester ------------------------------------------------------------


@dataclass
class TokenProb:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # most likely tokens at this position, best first


@dataclass
class Chunk:
    """Text produced by one step (possibly several tokens when a draft was accepted)."""

    text: str
    tokens: list[int]
    probs: list[TokenProb] | None = None
    timings: dict[str, Any] | None = None  # Result.timings() so far, for a task with timings_per_token


@dataclass
class Progress:
    """How far the prompt has been read (llama-server's prompt_progress): `processed` of `total` prompt tokens,
    `cache` of them taken from the cache, `time_ms` since the task started."""

    total: int
    cache: int
    processed: int
    time_ms: float

    def to_json(self) -> dict[str, Any]:
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": self.time_ms}


@dataclass
class Result:
    """The end of a generation."""

    slot: int
    stop_type: str  # "eos", "word", "limit" (n_predict or context full), "cancelled"
    stopping_word: str
    n_prompt: int  # prompt tokens
    n_cached: int  # prompt tokens reused from the slot's cache
    n_predicted: int  # tokens generated (an end-of-generation token included)
    prompt_ms: float
    predicted_ms: float
    draft_n: int
    draft_n_accepted: int
    context_full: bool = False
    n_steps: int = 0  # decode and verify steps the task took part in
    # draft tokens (generated, accepted) of this task by source: a speculator's name ("prediction", "ngram_suffix", ...)
    draft_sources: dict[str, tuple[int, int]] = field(default_factory=dict)

    def timings(self) -> dict[str, object]:
        n_eval = self.n_prompt - self.n_cached

        def per(ms: float, n: int) -> tuple[float, float]:
            return (ms / n if n else 0.0, 1000.0 * n / ms if ms > 0 else 0.0)

        p_tok, p_sec = per(self.prompt_ms, n_eval)
        g_tok, g_sec = per(self.predicted_ms, self.n_predicted)
        return {
            "cache_n": self.n_cached, "prompt_n": n_eval, "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": p_tok, "prompt_per_second": p_sec, "predicted_n": self.n_predicted,
            "predicted_ms": self.predicted_ms, "predicted_per_token_ms": g_tok, "predicted_per_second": g_sec,
            "draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted,
            # by source (a speculator's name: "prediction", "ngram_suffix", "draft_model", ...)
            "draft_sources": {name: {"n": n, "accepted": a} for name, (n, a) in self.draft_sources.items()},
        }


@dataclass
class Failure:
    message: str


Event = Chunk | Progress | Result | Failure


class Cancellable(Protocol):
    """What a requester keeps of a submitted task: a TaskHandle, or the HTTP front's stand-in for one in the
    engine core's process (server/core_client.py)."""

    def cancel(self) -> None: ...


class TaskHandle:
    """The requester's side of a submitted task."""

    def __init__(self, task: Task, emit: Callable[[Event], None], wake: Callable[[], None]):
        self.task = task
        self._emit = emit
        self._wake = wake
        self.cancelled = False
        self.done = False

    def cancel(self) -> None:
        """Stop the task (the client went away); its slot is freed at the next step boundary."""
        if not self.done:
            self.cancelled = True
            self._wake()

    def emit(self, event: Event) -> None:
        if isinstance(event, Result | Failure):
            self.done = True
        try:
            self._emit(event)
        except Exception:  # the receiver is gone (e.g. its event loop closed): nothing to tell
            log.debug("dropped an event for task %d", self.task.id)
