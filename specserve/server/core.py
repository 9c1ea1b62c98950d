"""The engine core: the scheduler with its runners, as the HTTP front sees it.

Two implementations of one interface (`EngineCore`): `LocalCore` runs the scheduler in a thread of this
process (tests, `--core-in-process`); `core_client.CoreClient` runs it in a process of its own
(core_process.py), so that HTTP, JSON and streaming never hold the GIL the step loop needs. The front
knows the model only through `ModelFacts`, which both give it.

Slot jobs are `work(runner, slot)` (module-level functions, or partials of them, so they can cross to the
core's process); they run on the scheduler's thread with the slot idle (engine/slot_jobs.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from specserve.engine.loading import load_with_draft
from specserve.engine.runner import Runner, model_file
from specserve.engine.scheduler import Scheduler
from specserve.engine.slots import SchedulerCounters, Slot
from specserve.engine.tasks import Cancellable, Event, Task
from specserve.errors import SpecserveError
from specserve.gguf.reader import MetadataFile
from specserve.gguf.tokenizer import Tokenizer
from specserve.speculative.factory import build_chain
from specserve.speculative.shared_suffix import SuffixStore

if TYPE_CHECKING:
    from specserve.server.settings import ServerSettings

CoreJob = Callable[[Runner, Slot], Any]


class EngineCore(Protocol):
    """What the front asks of the scheduler (thread-safe; events go to `emit` from another thread)."""

    def submit(self, task: Task, emit: Callable[[Event], None]) -> Cancellable: ...

    def submit_job(self, work: CoreJob, slot: int | None = None) -> Future[Any]: ...

    def slots_json(self) -> list[dict[str, object]]: ...

    def counters(self) -> SchedulerCounters: ...

    def failure(self) -> str | None:
        """Why the core cannot serve any more (its process died); None while it can."""
        ...

    def wake(self) -> None:
        """Work is coming: load what an idle timeout let go (sleeping_core.py); blocking, off the event loop."""
        ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class ModelFacts:
    """What the front knows of the loaded model."""

    file: MetadataFile  # what the tokenizer, the chat template and /props read
    draft_path: Path | None
    n_ctx: int  # positions one slot may reach
    vocab_size: int
    context_length: int  # the model's training context
    hidden: int
    file_bytes: int

    @property
    def path(self) -> Path:
        return self.file.path

    @classmethod
    def of(cls, path: Path, runner: Runner, draft_runner: Runner | None) -> ModelFacts:
        gguf = runner.gguf
        file = MetadataFile(path, dict(gguf.metadata) if gguf is not None else {})
        draft = model_file(draft_runner).path if draft_runner is not None else None
        cfg = runner.config
        return cls(file, draft, runner.n_ctx, cfg.vocab_size, cfg.context_length, cfg.hidden, runner.file_bytes)


# What the engine core loads its runners with: (target, draft or None, the model's path) for the settings.
Loader = Callable[["ServerSettings"], tuple[Runner, Runner | None, Path]]


def load_model(settings: ServerSettings, progress: bool = True) -> tuple[Runner, Runner | None, Path]:
    """The served model's runners (target, draft or None) and its path, warmed up for the slots."""
    ctx = settings.kv_size()  # the most one slot may reach: the pool, as given; else the runner's default
    runner, draft_runner, path = load_with_draft(settings.model, settings.model_draft, remote=settings.remote,
                                                 n_seqs=settings.n_parallel,
                                                 n_ctx=ctx, kv_size=ctx or settings.default_kv_size(),
                                                 device=settings.device, progress=progress,
                                                 weight_format=settings.weight_format, kv_types=settings.kv_types,
                                                 draft_kv_types=settings.draft_kv_types,
                                                 tensor_parallel=settings.tensor_parallel, mmap=settings.mmap,
                                                 adapters=[path for path, _ in settings.lora])
    build_chain(settings.spec)  # fail now, not per request, on e.g. a missing static lookup cache
    # Capture the CUDA graphs of decode/verify steps now (a no-op on CPU), not inside the first requests.
    spec = settings.spec
    trees = settings.n_parallel * max(1 + spec.n_max, spec.tree_nodes) if spec.tree_nodes else 0
    runner.warmup(max_rows=settings.n_parallel * (1 + spec.n_max), sequences=settings.n_parallel, trees=trees)
    if draft_runner is not None:  # the slots draft together: a row each per draft token
        draft_runner.warmup(max_rows=settings.n_parallel, sequences=settings.n_parallel)
    return runner, draft_runner, path


class LocalCore:
    """The scheduler in a thread of this process, with the shared suffix store its speculators draft from."""

    def __init__(self, settings: ServerSettings, runner: Runner, draft_runner: Runner | None, tokenizer: Tokenizer):
        if draft_runner is not None and draft_runner.n_seqs < settings.n_parallel:
            raise SpecserveError("the draft runner needs one sequence per slot")
        self.runner = runner
        self.suffix_store = SuffixStore(settings.spec_shared_tokens) if settings.spec_shared_tokens > 0 else None
        store = self.suffix_store
        self.scheduler = Scheduler(runner, tokenizer, n_batch=settings.n_batch, n_slots=settings.n_parallel,
                                   adaptive_drafts=settings.adaptive_drafts, chain_drafts=settings.chain_drafts,
                                   host_cache_bytes=settings.host_cache_bytes(runner.device.type),
                                   prefix_cache=settings.prefix_cache,
                                   chain_factory=lambda spec, slot: build_chain(spec, draft_runner, seq=slot,
                                                                                shared=store))

    def start(self) -> None:
        self.scheduler.start()

    def submit(self, task: Task, emit: Callable[[Event], None]) -> Cancellable:
        return self.scheduler.submit(task, emit)

    def submit_job(self, work: CoreJob, slot: int | None = None) -> Future[Any]:
        return self.scheduler.submit_job(functools.partial(work, self.runner), slot)

    def slots_json(self) -> list[dict[str, object]]:
        return self.scheduler.slots_json()

    def counters(self) -> SchedulerCounters:
        """The scheduler's counters, with the shared suffix store's size (/metrics)."""
        c = self.scheduler.counters_snapshot()
        if self.suffix_store is not None:
            c.shared_requests, c.shared_tokens = self.suffix_store.sizes()
        return c

    def failure(self) -> str | None:
        return None

    def wake(self) -> None:
        pass  # (always loaded)

    def shutdown(self) -> None:
        self.scheduler.shutdown()
