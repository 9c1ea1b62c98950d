"""Slots (one per KV sequence) and the counters /metrics reads, as the scheduler keeps them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from specserve.engine.draft_gate import TreeValue
from specserve.engine.sampling import Sampler
from specserve.engine.tasks import KVKey, Task, TaskHandle
from specserve.engine.text_stream import TextStream
from specserve.model.batch import common_prefix
from specserve.speculative.base import Chain, SpecParams


class SlotState(Enum):
    IDLE = "idle"
    PROMPT = "processing_prompt"
    GENERATING = "generating"
    RESUMING = "resuming"  # preempted while generating: reading its tokens again (engine/kv_room.py)


# The states the scheduler's per-turn scans over every slot ask for, as module names (a class attribute lookup
# and an enum comparison per slot cost ~3x an identity test)
GENERATING = SlotState.GENERATING
READING = (SlotState.PROMPT, SlotState.RESUMING)


@dataclass
class Slot:
    id: int
    state: SlotState = SlotState.IDLE
    handle: TaskHandle | None = None
    cache: list[int] = field(default_factory=list)  # tokens whose K/V sit in this slot's sequence (settled)
    last_used: float = 0.0
    adapters: tuple[float, ...] = ()  # the LoRA scales its sequence's K/V were computed with (Task.adapters)
    cache_salt: str = ""  # the salt of the task that left its cache (Task.cache_salt)

    @property
    def kv_key(self) -> KVKey:
        return self.adapters, self.cache_salt

    # per task
    n_past: int = 0  # prompt tokens in the cache
    n_planned: int = 0  # prompt tokens in launched steps (n_past once they are settled)
    n_cached: int = 0  # prompt tokens reused from the previous task
    replay: list[int] = field(default_factory=list)  # RESUMING: the tokens it held when preempted
    last: int = -1  # newest sampled token: the next step of this slot evaluates it first
    n_decoded: int = 0
    n_steps: int = 0  # decode and verify steps settled
    draft_n: int = 0
    draft_accepted: int = 0
    draft_room: int = 1 << 30  # most tokens its next draft may have (draft_gate.next_room)
    draft_surplus: float = 0.0  # chained drafts: tokens a drafted step gives over two plain ones (draft_gate)
    tree_value: TreeValue = field(default_factory=TreeValue)  # what its token trees' other branches give
    # timings (perf_counter): the task's start, its prompt's end
    t_start: float = 0.0
    t_prompt_done: float = 0.0
    sampler: Sampler | None = None
    stream: TextStream | None = None
    # speculator, kept across tasks while the speculative parameters stay the same
    chain: Chain | None = None
    chain_key: SpecParams | None = None
    use_chain: bool = False  # the current task speculates
    spec_seen: dict[str, tuple[int, int]] = field(default_factory=dict)  # member -> (gen, acc) counted
    spec_base: dict[str, tuple[int, int]] = field(default_factory=dict)  # member -> (gen, acc) when the task began

    @property
    def task(self) -> Task:
        assert self.handle is not None
        return self.handle.task

    def runs(self, task_id: int) -> bool:
        """Whether the slot still runs task task_id (not finished, failed or cancelled since)."""
        h = self.handle
        return h is not None and h.task.id == task_id and not h.cancelled

    argmax_task: bool = False  # the current task needs only argmax rows (set at its start: greedy_only)

    @property
    def greedy_only(self) -> bool:
        """The task needs only each row's argmax (no sampling, no probabilities, no grammar mask, no logit
        bias): its steps can be chained."""
        return self.argmax_task and self.handle is not None

    def note_task_kind(self) -> None:
        """(At a task's start, its sampler made.) What greedy_only reads, once per task instead of per row."""
        task = self.task
        self.argmax_task = (self.sampler is not None and self.sampler.argmax_only and task.n_probs == 0
                            and task.constraint is None and task.logit_bias is None)

    def to_json(self, n_ctx: int) -> dict[str, object]:
        """The slot as llama-server's /slots shows it: `next_token` a list of one object, and `params` only
        while a task runs (llama-server's never-used slots have none; ours forget a finished task's)."""
        handle = self.handle
        task = handle.task if handle is not None else None
        n_remain = -1
        if task is not None and task.n_predict >= 0:
            n_remain = max(task.n_predict - self.n_decoded, 0)
        out: dict[str, object] = {
            "id": self.id,
            "id_task": task.id if task is not None else -1,
            "n_ctx": n_ctx,
            "state": self.state.value if handle is not None else "idle",
            "is_processing": handle is not None,
            "speculative": handle is not None and self.use_chain,
            "n_cached_tokens": len(self.cache),
            "next_token": [{
                "has_next_token": handle is not None,
                "n_remain": n_remain,
                "n_decoded": self.n_decoded if handle is not None else 0,
                "n_prompt_tokens_processed": self.n_past - self.n_cached if handle is not None else 0,
            }],
        }
        if task is not None:
            out["params"] = task.params_json()
        return out


@dataclass
class SchedulerCounters:
    prompt_tokens: int = 0
    prompt_tokens_shared: int = 0  # taken from blocks cached by content instead of evaluated (part of the cached)
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    predicted_seconds: float = 0.0
    n_decode: int = 0  # forward passes
    n_busy_slots: int = 0  # summed over forward passes
    requests_processing: int = 0
    requests_deferred: int = 0
    n_tokens_max: int = 0
    kv_tokens: int = 0  # KV pool positions in use (whole blocks), idle slots' prompt caches too (counters_snapshot)
    kv_capacity: int = 0  # positions of the pool
    kv_cached_tokens: int = 0  # positions in blocks cached by content, held by a slot or free (counters_snapshot)
    kv_preemptions: int = 0  # running slots that gave back their KV for others (engine/kv_room.py)
    context_shifts: int = 0  # generations that filled their context and dropped old tokens (--context-shift)
    # the host prompt cache (host_cache.py): caches it took from the pool, prompt tokens written back, bytes held
    host_cache_kept: int = 0
    prompt_tokens_host: int = 0  # (part of prompt_tokens_cached)
    host_cache_bytes: int = 0
    # the shared suffix store (speculative/shared_suffix.py; the engine fills these in): requests and tokens kept
    shared_requests: int = 0
    shared_tokens: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    prompt_tokens_cached: int = 0  # prompt tokens reused from a slot's cache (not in prompt_tokens)
    spec_drafts: int = 0  # verify steps that carried a draft (llama-server's spec_decode_num_drafts)
    spec_draft_tokens: int = 0  # draft tokens verified, a guess at the token in flight included
    spec_accepted: int = 0  # of those, accepted
    turns_drafting: int = 0  # turns with two or more generating slots that were allowed to draft
    turns_plain: int = 0  # such turns that the draft gate kept from drafting
    draft_generated: dict[str, int] = field(default_factory=dict)  # speculator name -> tokens
    draft_accepted: dict[str, int] = field(default_factory=dict)

    def copy(self) -> SchedulerCounters:
        return SchedulerCounters(**{**self.__dict__, "draft_generated": dict(self.draft_generated),
                                    "draft_accepted": dict(self.draft_accepted)})

    def after(self, earlier: SchedulerCounters) -> SchedulerCounters:
        """These counters continuing `earlier`'s (a scheduler's that came before, e.g. before a sleep): totals
        summed, levels (LEVELS) this one's, the largest batch the larger."""
        out = self.copy()
        for name, value in earlier.__dict__.items():
            if name in LEVELS:
                continue
            if isinstance(value, dict):
                mine = getattr(out, name)
                for key, n in value.items():
                    mine[key] = mine.get(key, 0) + n
            else:
                setattr(out, name, max(value, getattr(out, name)) if name == "n_tokens_max"
                        else value + getattr(out, name))
        return out


# SchedulerCounters' fields that say how things stand now, not how many so far
LEVELS = frozenset({"requests_processing", "requests_deferred", "kv_tokens", "kv_capacity", "kv_cached_tokens",
                    "shared_requests", "shared_tokens", "host_cache_bytes"})


def reusable(seq: Slot, task: Task) -> int:
    """How many of the task's prompt tokens the slot's cache holds for it: K/V computed with other LoRA scales are
    other values, and another cache salt's are not shared (Task.kv_key)."""
    return common_prefix(seq.cache, task.prompt) if seq.kv_key == task.kv_key else 0
