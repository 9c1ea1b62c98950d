"""Slot scheduler: continuous batching with speculative decoding per slot.

One background thread owns the runner(s). Every step it builds ONE Batch over all active
slots — prompt chunks for slots still reading, `[last sampled] + draft` for generating
slots — runs one forward pass, then lets each slot's own sampler verify its draft. So the
drafts of all slots are verified together, and a new request joins as soon as a slot is
free (the others wait in a FIFO queue).

Requests come in through `submit()` from any thread; results go out through the `emit`
callback given with each request (the server turns it into an asyncio queue put). Slot i
uses KV sequence i of the target runner and of the draft runner.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum

import torch

from specserve.engine.batch import Batch, common_prefix
from specserve.engine.runner import LocalRunner
from specserve.engine.sampling import Sampler
from specserve.engine.tasks import Chunk, Event, Failure, Result, Task, TaskHandle, TokenProb
from specserve.engine.text_stream import TextStream
from specserve.errors import SpecserveError
from specserve.gguf.tokenizer import Tokenizer
from specserve.speculative.base import Chain, SpecParams
from specserve.speculative.factory import build_chain

log = logging.getLogger(__name__)

# ---- slots ------------------------------------------------------------------------------------------


class SlotState(Enum):
    IDLE = "idle"
    PROMPT = "processing_prompt"
    GENERATING = "generating"


@dataclass
class Slot:
    id: int
    state: SlotState = SlotState.IDLE
    handle: TaskHandle | None = None
    cache: list[int] = field(default_factory=list)  # tokens whose K/V sit in this slot's sequence
    last_used: float = 0.0
    # per task
    n_past: int = 0  # prompt tokens in the cache
    n_cached: int = 0  # prompt tokens reused from the previous task
    last: int = -1  # newest sampled token, not yet evaluated
    n_decoded: int = 0
    draft_n: int = 0
    draft_accepted: int = 0
    t_start: float = 0.0
    t_prompt_done: float = 0.0
    sampler: Sampler | None = None
    stream: TextStream | None = None
    # speculator, kept across tasks while the speculative parameters stay the same
    chain: Chain | None = None
    chain_key: SpecParams | None = None
    use_chain: bool = False  # the current task speculates
    spec_seen: dict[str, tuple[int, int]] = field(default_factory=dict)  # member -> (gen, acc) counted

    @property
    def task(self) -> Task:
        assert self.handle is not None
        return self.handle.task


# ---- counters read by /metrics -------------------------------------------------------------------


@dataclass
class SchedulerCounters:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    predicted_seconds: float = 0.0
    n_decode: int = 0  # forward passes
    n_busy_slots: int = 0  # summed over forward passes
    requests_processing: int = 0
    requests_deferred: int = 0
    n_tokens_max: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    draft_generated: dict[str, int] = field(default_factory=dict)  # speculator name -> tokens
    draft_accepted: dict[str, int] = field(default_factory=dict)


class Scheduler:
    """Owns the runner(s) in one thread; serves up to runner.n_seqs tasks at once."""

    def __init__(self, runner: LocalRunner, tokenizer: Tokenizer, *, draft_runner: LocalRunner | None = None,
                 n_batch: int = 512):
        if n_batch < 1:
            raise SpecserveError(f"batch size must be at least 1, got {n_batch}")
        if draft_runner is not None and draft_runner.n_seqs < runner.n_seqs:
            raise SpecserveError("the draft runner needs one sequence per slot")
        self.runner = runner
        self.draft_runner = draft_runner
        self.tokenizer = tokenizer
        self.n_batch = n_batch
        self.n_ctx = runner.n_ctx
        self.slots = [Slot(i) for i in range(runner.n_seqs)]
        self.counters = SchedulerCounters()
        self._queue: deque[TaskHandle] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="specserve-scheduler", daemon=True)

    # -- public, thread-safe ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, task: Task, emit: Callable[[Event], None]) -> TaskHandle:
        """Queue a task; events go to `emit` (called from the scheduler thread)."""
        if not task.prompt:
            raise SpecserveError("the prompt is empty")
        if len(task.prompt) >= self.n_ctx:
            raise SpecserveError(f"the prompt ({len(task.prompt)} tokens) does not fit the slot context "
                                 f"({self.n_ctx} tokens, one of them for the first generated token)")
        handle = TaskHandle(task, emit, self._wake)
        with self._cond:
            if self._stopping:
                raise SpecserveError("the server is shutting down")
            self._queue.append(handle)
            self.counters.requests_deferred = len(self._queue)
            self._cond.notify_all()
        return handle

    def slots_json(self) -> list[dict[str, object]]:
        with self._cond:
            return [self._slot_json(s) for s in self.slots]

    def counters_snapshot(self) -> SchedulerCounters:
        with self._cond:
            c = self.counters
            return SchedulerCounters(**{**c.__dict__, "draft_generated": dict(c.draft_generated),
                                        "draft_accepted": dict(c.draft_accepted)})

    # -- the loop ---------------------------------------------------------------------------------

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._queue and all(s.handle is None for s in self.slots):
                    self._cond.wait()
                if self._stopping:
                    break
            # Outside the lock: ending a speculator may write its cache file.
            for slot in self.slots:
                if slot.handle is not None and slot.handle.cancelled:
                    self._finish(slot, "cancelled")
            with self._cond:
                queued = self._admit()
            for handle in queued:
                self._start_task(handle)
            try:
                self._step()
            except Exception as exc:  # a bug in the step itself: fail the active tasks, keep serving
                log.exception("scheduler step failed")
                for slot in self.slots:
                    if slot.handle is not None:
                        self._fail(slot, f"internal error: {exc}")
        self._drain("the server is shutting down")

    def _admit(self) -> list[TaskHandle]:
        """(Under the lock.) Drop cancelled queued tasks; pop as many queued tasks as there are idle slots."""
        for handle in [h for h in self._queue if h.cancelled]:
            handle.emit(Failure("cancelled while waiting for a slot"))
        self._queue = deque(h for h in self._queue if not h.cancelled)
        n_idle = sum(s.handle is None for s in self.slots)
        started = [self._queue.popleft() for _ in range(min(n_idle, len(self._queue)))]
        for handle in started:  # reserve the slots now so /slots and the counters are right at once
            slot = self._pick_slot(handle)
            slot.handle, slot.state = handle, SlotState.PROMPT
        self.counters.requests_deferred = len(self._queue)
        self.counters.requests_processing = sum(s.handle is not None for s in self.slots)
        return started

    def _pick_slot(self, handle: TaskHandle) -> Slot:
        """The idle slot whose cache shares the longest prefix with the prompt, else the least recently used."""
        idle = [s for s in self.slots if s.handle is None]
        prompt = handle.task.prompt
        if handle.task.cache_prompt:
            best = max(idle, key=lambda s: (common_prefix(s.cache, prompt), -s.last_used))
            if common_prefix(best.cache, prompt) > 0:
                return best
        return min(idle, key=lambda s: s.last_used)

    def _drain(self, message: str) -> None:
        with self._cond:
            for slot in self.slots:
                if slot.handle is not None:
                    self._fail(slot, message)
            while self._queue:
                self._queue.popleft().emit(Failure(message))

    # -- task start / end --------------------------------------------------------------------------

    def _start_task(self, handle: TaskHandle) -> None:
        slot = next(s for s in self.slots if s.handle is handle)
        task = handle.task
        try:
            keep = common_prefix(slot.cache, task.prompt) if task.cache_prompt else 0
            keep = min(keep, len(task.prompt) - 1)  # evaluate at least one token: its logits start generation
            self.runner.kv_truncate(slot.id, keep)
            slot.cache = task.prompt[:keep]
            slot.n_past = slot.n_cached = keep
            slot.n_decoded = slot.draft_n = slot.draft_accepted = 0
            slot.last = -1
            slot.t_start = time.perf_counter()
            slot.sampler = Sampler(task.sampling)
            slot.sampler.reset(task.prompt)
            slot.stream = TextStream(self.tokenizer, task.stop)
            self._prepare_chain(slot, task.spec)
            slot.use_chain = slot.chain is not None and task.spec.n_max > 0
        except Exception as exc:
            log.exception("could not start task %d", task.id)
            self._fail(slot, str(exc) if isinstance(exc, SpecserveError) else f"internal error: {exc}")

    def _prepare_chain(self, slot: Slot, spec: SpecParams) -> None:
        if spec.n_max == 0:
            return  # speculation off for this task; keep the slot's chain for later tasks
        key = replace(spec, n_max=0, n_min=0)  # draft limits are passed per draft() call
        if key != slot.chain_key:
            slot.chain = build_chain(spec, self.draft_runner, seq=slot.id)
            slot.chain_key = key
            slot.spec_seen = {}

    def _finish(self, slot: Slot, stop_type: str, context_full: bool = False) -> None:
        handle = slot.handle
        assert handle is not None and slot.stream is not None
        now = time.perf_counter()
        prompt_done = slot.t_prompt_done if slot.state == SlotState.GENERATING else now
        if stop_type != "word":
            slot.stream.flush()
        text = slot.stream.take(final=True)
        if text and stop_type != "cancelled":
            handle.emit(Chunk(text, []))
        result = Result(
            slot=slot.id, stop_type=stop_type, stopping_word=slot.stream.stopping_word,
            n_prompt=len(handle.task.prompt), n_cached=slot.n_cached, n_predicted=slot.n_decoded,
            prompt_ms=(prompt_done - slot.t_start) * 1000, predicted_ms=(now - prompt_done) * 1000,
            draft_n=slot.draft_n, draft_n_accepted=slot.draft_accepted, context_full=context_full,
        )
        with self._cond:
            c = self.counters
            c.tokens_predicted += slot.n_decoded
            c.predicted_seconds += now - prompt_done
            c.requests_done += 1
            self._release(slot)
        if slot.use_chain:
            self._end_chain(slot)
        handle.emit(result)

    def _fail(self, slot: Slot, message: str) -> None:
        handle = slot.handle
        with self._cond:
            self.counters.requests_failed += 1
            self._release(slot)
        # The slot's cache may not match its KV any more: start the next task from scratch.
        slot.cache = []
        slot.chain, slot.chain_key = None, None
        if handle is not None:
            handle.emit(Failure(message))

    def _release(self, slot: Slot) -> None:
        """(Under the lock.)"""
        slot.handle = None
        slot.state = SlotState.IDLE
        slot.last_used = time.perf_counter()
        self.counters.requests_processing = sum(s.handle is not None for s in self.slots)

    def _end_chain(self, slot: Slot) -> None:
        if slot.chain is None:
            return
        try:
            slot.chain.end()  # e.g. ngram-cache saves its dynamic file
        except Exception:
            log.exception("speculator end() failed on slot %d", slot.id)
            slot.chain, slot.chain_key = None, None

    # -- one step ------------------------------------------------------------------------------------

    def _step(self) -> None:
        generating = [s for s in self.slots if s.state == SlotState.GENERATING]
        reading = sorted((s for s in self.slots if s.state == SlotState.PROMPT), key=lambda s: s.t_start)
        batch = Batch()
        # (slot, draft or None for a prompt chunk, tokens in the batch, logit rows)
        plan: list[tuple[Slot, list[int] | None, int, int]] = []
        for slot in generating:
            try:
                draft = self._draft(slot)
            except Exception as exc:
                self._drafting_failed(slot, exc)
                continue
            batch.add_sequence([slot.last, *draft], len(slot.cache), slot.id, "all")
            plan.append((slot, draft, 1 + len(draft), 1 + len(draft)))
        # Prompt chunks share what is left of n_batch, but always get a share so they never starve.
        budget = max(self.n_batch - len(batch), self.n_batch // 4, 1)
        for slot in reading:
            if budget <= 0:
                break
            prompt = slot.task.prompt
            chunk = prompt[slot.n_past:slot.n_past + budget]
            final = slot.n_past + len(chunk) == len(prompt)
            batch.add_sequence(chunk, slot.n_past, slot.id, "last" if final else "none")
            plan.append((slot, None, len(chunk), int(final)))
            budget -= len(chunk)
        if not plan:
            return
        try:
            logits = self.runner.forward(batch)
        except Exception as exc:
            log.exception("forward pass failed")
            for slot, _, _, _ in plan:
                self.runner.kv_truncate(slot.id, 0)
                self._fail(slot, str(exc) if isinstance(exc, SpecserveError) else f"forward pass failed: {exc}")
            return
        with self._cond:
            self.counters.n_decode += 1
            self.counters.n_busy_slots += len(plan)
        # Plain greedy slots need only the argmax of their rows: one transfer for the whole
        # batch instead of one device sync per slot.
        argmax_rows = logits.argmax(dim=-1) if any(self._plain_greedy(s) for s, *_ in plan) else None
        for slot, draft, _, _ in plan:  # while the device works: the speculators' bookkeeping
            if draft is not None and slot.use_chain and slot.chain is not None and slot.handle is not None:
                try:
                    slot.chain.prepare(slot.cache)
                except Exception as exc:
                    self._drafting_failed(slot, exc)
        argmax = argmax_rows.tolist() if argmax_rows is not None else []
        row = 0
        for slot, draft, n_tokens, n_rows in plan:
            rows = logits[row:row + n_rows]
            greedy = argmax[row:row + n_rows] if self._plain_greedy(slot) else None
            row += n_rows
            if slot.handle is None:
                continue
            try:
                if draft is None:
                    self._after_prompt_chunk(slot, n_tokens, rows, greedy)
                else:
                    self._after_decode(slot, rows, draft, greedy)
            except Exception as exc:
                log.exception("processing slot %d failed", slot.id)
                self._fail(slot, str(exc) if isinstance(exc, SpecserveError) else f"internal error: {exc}")
        with self._cond:
            self.counters.n_tokens_max = max([self.counters.n_tokens_max, *(len(s.cache) for s in self.slots)])

    def _drafting_failed(self, slot: Slot, exc: Exception) -> None:
        """A speculator raised (draft or prepare): that slot's task fails, the others go on."""
        log.exception("drafting failed on slot %d", slot.id)
        self._fail(slot, f"speculative drafting failed: {exc}")

    def _draft(self, slot: Slot) -> list[int]:
        task = slot.task
        spec = task.spec
        if not slot.use_chain or slot.chain is None:
            return []
        room = self.n_ctx - len(slot.cache) - 1  # positions left after `last`
        left = task.n_predict - slot.n_decoded - 1 if task.n_predict >= 0 else room
        limit = min(self.runner.draft_limit(spec.n_max), left, room)
        if limit < max(spec.n_min, 1):
            return []
        return slot.chain.draft(slot.cache, slot.last, limit, spec.n_min)

    @staticmethod
    def _plain_greedy(slot: Slot) -> bool:
        return slot.sampler is not None and slot.sampler.argmax_only

    @staticmethod
    def _choose(slot: Slot, rows: torch.Tensor, draft: list[int], greedy: list[int] | None) -> list[int]:
        """The accepted draft prefix plus one new token (row i is the target's view after draft[:i])."""
        assert slot.sampler is not None
        if greedy is not None:
            return slot.sampler.accept(greedy, draft)
        return slot.sampler.sample_and_verify(rows, draft) if draft else [slot.sampler.sample(rows[0])]

    def _after_prompt_chunk(self, slot: Slot, n_tokens: int, rows: torch.Tensor, greedy: list[int] | None) -> None:
        task = slot.task
        slot.cache.extend(task.prompt[slot.n_past:slot.n_past + n_tokens])
        slot.n_past += n_tokens
        if slot.n_past < len(task.prompt):
            return
        slot.t_prompt_done = time.perf_counter()
        with self._cond:
            self.counters.prompt_tokens += len(task.prompt) - slot.n_cached
            self.counters.prompt_seconds += slot.t_prompt_done - slot.t_start
        slot.state = SlotState.GENERATING
        if task.n_predict == 0:
            self._finish(slot, "limit")
            return
        slot.last = self._choose(slot, rows, [], greedy)[0]
        if slot.use_chain:
            slot.chain.begin(task.prompt)  # type: ignore[union-attr]
        self._emit_tokens(slot, [slot.last], rows)

    def _after_decode(self, slot: Slot, rows: torch.Tensor, draft: list[int], greedy: list[int] | None) -> None:
        out = self._choose(slot, rows, draft, greedy)
        if draft:
            n_acc = len(out) - 1
            assert slot.chain is not None
            slot.chain.accept(n_acc)
            slot.draft_n += len(draft)
            slot.draft_accepted += n_acc
            self._count_drafts(slot)
        slot.cache.append(slot.last)
        slot.cache.extend(out[:-1])
        self.runner.kv_truncate(slot.id, len(slot.cache))  # drop the rejected draft positions
        slot.last = out[-1]
        self._emit_tokens(slot, out, rows)

    def _count_drafts(self, slot: Slot) -> None:
        """Move the chain members' new draft counts into the per-type counters."""
        assert slot.chain is not None
        with self._cond:
            c = self.counters
            for m in slot.chain.members:
                gen0, acc0 = slot.spec_seen.get(m.name, (0, 0))
                gen, acc = m.stats.gen_tokens, m.stats.acc_tokens
                if gen != gen0 or acc != acc0:
                    c.draft_generated[m.name] = c.draft_generated.get(m.name, 0) + gen - gen0
                    c.draft_accepted[m.name] = c.draft_accepted.get(m.name, 0) + acc - acc0
                    slot.spec_seen[m.name] = (gen, acc)

    def _emit_tokens(self, slot: Slot, tokens: list[int], rows: torch.Tensor) -> None:
        """Hand out the step's tokens (row i of rows produced tokens[i]) and stop when a condition hits."""
        task = slot.task
        stream = slot.stream
        assert stream is not None
        stop_type = ""
        emitted: list[int] = []
        for token in tokens:
            slot.n_decoded += 1
            emitted.append(token)
            if self.tokenizer.is_eog(token):
                stop_type = "eos"
                break
            if stream.add(token):
                stop_type = "word"
                break
            if 0 <= task.n_predict <= slot.n_decoded:
                stop_type = "limit"
                break
        context_full = not stop_type and len(slot.cache) >= self.n_ctx  # no position left for `last`
        if context_full:
            stop_type = "limit"
        probs = self._probs(rows[:len(emitted)], emitted, task.n_probs) if task.n_probs > 0 else None
        if stop_type and stop_type != "word":
            stream.flush()
        text = stream.take(final=bool(stop_type))
        if text or emitted:
            slot.handle.emit(Chunk(text, emitted, probs))  # type: ignore[union-attr]
        if stop_type:
            self._finish(slot, stop_type, context_full)

    @staticmethod
    def _probs(rows: torch.Tensor, tokens: list[int], n_top: int) -> list[TokenProb]:
        """Log-probabilities of the model's distribution (before sampling filters) at each row."""
        logp = torch.log_softmax(rows.float(), dim=-1)
        top = torch.topk(logp, min(n_top, logp.shape[-1]), dim=-1)
        rows_idx = torch.arange(len(tokens), device=logp.device)
        chosen = logp[rows_idx, torch.tensor(tokens, device=logp.device)].tolist()
        top_ids, top_vals = top.indices.tolist(), top.values.tolist()
        return [TokenProb(t, lp, list(zip(ids, vals, strict=True)))
                for t, lp, ids, vals in zip(tokens, chosen, top_ids, top_vals, strict=True)]

    # -- introspection --------------------------------------------------------------------------------

    def _slot_json(self, slot: Slot) -> dict[str, object]:
        handle = slot.handle
        task = handle.task if handle is not None else None
        n_remain = -1
        if task is not None and task.n_predict >= 0:
            n_remain = max(task.n_predict - slot.n_decoded, 0)
        return {
            "id": slot.id,
            "id_task": task.id if task is not None else -1,
            "n_ctx": self.n_ctx,
            "state": slot.state.value if handle is not None else "idle",
            "is_processing": handle is not None,
            "speculative": handle is not None and slot.use_chain,
            "n_cached_tokens": len(slot.cache),
            "params": task.params_json() if task is not None else {},
            "next_token": {
                "has_next_token": handle is not None,
                "n_remain": n_remain,
                "n_decoded": slot.n_decoded if handle is not None else 0,
                "n_prompt_tokens_processed": slot.n_past - slot.n_cached if handle is not None else 0,
            },
        }
