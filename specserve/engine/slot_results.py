"""The scheduler's second half: settling a step (each slot verifies its rows, keeps what it accepted,
streams it) and ending tasks. One stop vocabulary, llama-server's: "eos", "word", "limit" (n_predict or a
full context, the latter flagged), "cancelled".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from specserve.engine import step_trace
from specserve.engine.draft_gate import chained_surplus, next_room
from specserve.engine.runner import Runner
from specserve.engine.slot_drafts import DraftPolicy
from specserve.engine.slots import SchedulerCounters, Slot, SlotState
from specserve.engine.step_plan import Entry, InFlight
from specserve.engine.tasks import Chunk, Event, Failure, Progress, Result, TaskHandle, TokenProb
from specserve.errors import SpecserveError
from specserve.gguf.tokenizer import Tokenizer
from specserve.model.batch import common_prefix
from specserve.model.token_tree import TokenTree

log = logging.getLogger(__name__)


class Settler:
    """Settles the scheduler's steps and ends its tasks. It shares the scheduler's runner, slots, counters and lock;
    `drafting` is set by the scheduler (the policy's failures end tasks here). `outbox`: while not None, events
    wait in it (the scheduler launches the next step first, then hands them out). name_blocks(slot) caches the full
    blocks of what a slot has settled by content (KVMemory.cache_settled): called as its prompt is read and when
    its task ends."""

    def __init__(self, runner: Runner, tokenizer: Tokenizer, slots: list[Slot], counters: SchedulerCounters,
                 lock: threading.Condition, name_blocks: Callable[[Slot], None]):
        self.runner = runner
        self.name_blocks = name_blocks
        self.tokenizer = tokenizer
        self.n_ctx = runner.n_ctx
        self.slots = slots
        self.counters = counters
        self._cond = lock
        self.drafting: DraftPolicy | None = None
        self.outbox: list[tuple[TaskHandle, Event]] | None = None
        # a miss halves a slot's draft room (cheap verify rows), else cuts it (draft_gate.next_room)
        self._halve_room = runner.device.type == "cuda"

    def _drafting(self) -> DraftPolicy:
        assert self.drafting is not None, "the scheduler sets the drafting policy"
        return self.drafting

    def _post(self, handle: TaskHandle, event: Event) -> None:
        """Hand an event to its task, or hold it in the outbox while the scheduler launches a step."""
        if self.outbox is not None:
            self.outbox.append((handle, event))
        else:
            handle.emit(event)

    def settle(self, flight: InFlight, live: list[Entry]) -> None:
        """Verify and hand out the step's rows (live: its entries that were current when the next step was
        planned; each is checked again, as a failed launch since may have ended its task)."""
        if not live:
            return
        greedy = [e.slot.greedy_only for e in live]
        if step_trace.TRACE is not None:
            step_trace.TRACE.mark(flight.trace, "wait")
        tokens = flight.step.tokens() if any(greedy) else None
        if step_trace.TRACE is not None:
            step_trace.TRACE.mark(flight.trace, "ready")
        logits = flight.step.logits() if not all(greedy) else None
        for e, argmax_only in zip(live, greedy, strict=True):
            if not e.current():
                continue
            span = slice(e.logit_row, e.logit_row + e.n_logits)
            picked = tokens[span] if argmax_only and tokens is not None else None
            rows = logits[span] if logits is not None else None
            try:
                if e.replay:
                    self._after_replay_chunk(e)
                elif e.prompt:
                    self._after_prompt_chunk(e, picked, rows)
                else:
                    self._after_decode(e, picked, rows)
            except Exception as exc:
                log.exception("processing slot %d failed", e.slot.id)
                self.fail(e.slot, str(exc) if isinstance(exc, SpecserveError) else f"internal error: {exc}")
        with self._cond:
            self.counters.n_tokens_max = max([self.counters.n_tokens_max, *(len(s.cache) for s in self.slots)])

    @staticmethod
    def _choose(slot: Slot, picked: list[int] | None, rows: torch.Tensor | None, draft: list[int]) -> list[int]:
        """The accepted draft prefix plus one new token (row i is the target's view after draft[:i])."""
        assert slot.sampler is not None
        if picked is not None:
            return slot.sampler.accept(picked, draft)
        assert rows is not None
        if slot.task.logit_bias is not None:  # before penalties, as llama.cpp's chain; a draft token at -inf
            rows = slot.task.logit_bias.apply(rows)  # can never be its row's choice: it is rejected
        constraint = slot.task.constraint
        if constraint is not None:  # forbidden tokens at -inf before argmax or sampling; a forbidden draft
            rows = constraint.apply(rows, draft)  # token can then never match its row: it is rejected
        out = slot.sampler.sample_and_verify(rows, draft) if draft else [slot.sampler.sample(rows[0])]
        return out if constraint is None else constraint.advance(out)

    def _after_prompt_chunk(self, e: Entry, picked: list[int] | None, rows: torch.Tensor | None) -> None:
        slot = e.slot
        task = slot.task
        slot.cache.extend(task.prompt[slot.n_past:slot.n_past + e.n_rows])
        slot.n_past += e.n_rows
        self.name_blocks(slot)  # other slots' prompts may start the same way
        if task.return_progress:
            elapsed = (time.perf_counter() - slot.t_start) * 1000
            self._post(slot.handle, Progress(len(task.prompt), slot.n_cached, slot.n_past, elapsed))  # type: ignore[arg-type]
        if not e.final:
            return
        slot.t_prompt_done = time.perf_counter()
        with self._cond:
            self.counters.prompt_tokens += len(task.prompt) - slot.n_cached
            self.counters.prompt_tokens_cached += slot.n_cached
            self.counters.prompt_seconds += slot.t_prompt_done - slot.t_start
        slot.state = SlotState.GENERATING
        if task.n_predict == 0:
            self.finish(slot, "limit")
            return
        slot.last = self._choose(slot, picked, rows, [])[0]
        if slot.use_chain:
            slot.chain.begin(task.prompt)  # type: ignore[union-attr]
        self._emit_tokens(slot, [slot.last], rows)

    @staticmethod
    def _after_replay_chunk(e: Entry) -> None:
        """A preempted slot's tokens, read again: once all are back it generates on from its last token."""
        slot = e.slot
        slot.cache.extend(slot.replay[len(slot.cache):len(slot.cache) + e.n_rows])
        if len(slot.cache) == len(slot.replay):
            slot.state = SlotState.GENERATING
            slot.replay = []

    def _after_decode(self, e: Entry, picked: list[int] | None, rows: torch.Tensor | None) -> None:
        if e.tree is not None:
            assert picked is not None  # (trees are drafted for greedy tasks only)
            self._after_tree(e, e.tree, picked)
            return
        slot = e.slot
        first = slot.last  # what row 0 evaluated (a fed row: the token the step before gave)
        guessed = e.guess is not None and first == e.guess
        if e.guess is not None and not guessed:  # the draft's first token guessed wrong: only row 0 counts
            out = self._choose(slot, picked[:1] if picked is not None else None,
                               rows[:1] if rows is not None else None, [])
        else:
            out = self._choose(slot, picked, rows, e.draft)
        if e.guess is not None or e.draft:
            assert slot.chain is not None
            # A guess at the token in flight counts as drafted (and accepted when right), as the speculator's
            # own statistics and /metrics count it; it saves no step, so tokens = steps + accepted - right guesses.
            verified = len(out) - 1 if e.guess is None or guessed else 0
            if slot.chain.tree:  # candidates of a tree that came out as one path
                slot.chain.accept_path(out[:verified])
            else:
                slot.chain.accept(verified + int(guessed))
            drafted, accepted = len(e.draft) + int(e.guess is not None), verified + int(guessed)
            slot.draft_n += drafted
            slot.draft_accepted += accepted
            if self._drafting().chained:
                slot.draft_surplus = chained_surplus(slot.draft_surplus, len(out), len(out) == e.n_rows)
            if e.draft:
                slot.draft_room = next_room(slot.draft_room, len(e.draft), verified, slot.task.spec.n_max,
                                             self._halve_room)
            self._count_drafts(slot, drafted, accepted)
        slot.n_steps += 1
        slot.cache.append(first)
        slot.cache.extend(out[:-1])
        if len(slot.cache) < e.position + e.n_rows:  # drop the rejected draft positions (and what a step queued
            self.runner.kv_truncate(slot.id, len(slot.cache))  # after this one wrote past them)
        slot.last = out[-1]
        self._emit_tokens(slot, out, rows)

    def _after_tree(self, e: Entry, tree: TokenTree, picked: list[int]) -> None:
        """A token tree's verdict: the path the target's own choices take through it; its K/V kept, the rest of
        the tree's dropped."""
        slot = e.slot
        path, out = tree.walk(picked)
        assert slot.chain is not None
        first = slot.chain.tree[0][1] if slot.chain.tree else []
        slot.tree_value.note(len(path) - 1 - common_prefix(first, out[:-1]), max(0, len(tree) - 1 - len(first)))
        slot.chain.accept_path(out[:-1])
        drafted, accepted = len(tree) - 1, len(path) - 1
        slot.draft_n += drafted
        slot.draft_accepted += accepted
        slot.draft_room = next_room(slot.draft_room, max(tree.depths()), accepted, slot.task.spec.n_max,
                                    self._halve_room)
        self._count_drafts(slot, drafted, accepted)
        slot.n_steps += 1
        slot.cache.append(slot.last)
        slot.cache.extend(out[:-1])
        self.runner.kv_compact(slot.id, e.position, path)
        slot.last = out[-1]
        self._emit_tokens(slot, out, None)

    def _count_drafts(self, slot: Slot, drafted: int, accepted: int) -> None:
        """Count one verified draft, and move the chain members' new draft counts into the per-type counters."""
        assert slot.chain is not None
        with self._cond:
            c = self.counters
            c.spec_drafts += 1
            c.spec_draft_tokens += drafted
            c.spec_accepted += accepted
            for m in slot.chain.members:
                gen0, acc0 = slot.spec_seen.get(m.name, (0, 0))
                gen, acc = m.stats.gen_tokens, m.stats.acc_tokens
                if gen != gen0 or acc != acc0:
                    c.draft_generated[m.name] = c.draft_generated.get(m.name, 0) + gen - gen0
                    c.draft_accepted[m.name] = c.draft_accepted.get(m.name, 0) + acc - acc0
                    slot.spec_seen[m.name] = (gen, acc)

    def _emit_tokens(self, slot: Slot, tokens: list[int], rows: torch.Tensor | None) -> None:
        """Hand out the step's tokens (row i of rows produced tokens[i]) and stop when a condition hits."""
        task = slot.task
        stream = slot.stream
        assert stream is not None
        stop_type = ""
        emitted: list[int] = []
        for token in tokens:
            slot.n_decoded += 1
            emitted.append(token)
            if not task.ignore_eos and self.tokenizer.is_eog(token):
                stop_type = "eos"
                break
            if stream.add(token):
                stop_type = "word"
                break
            if 0 <= task.n_predict <= slot.n_decoded:
                stop_type = "limit"
                break
        self._drafting().count(len(emitted))
        if not stop_type and task.constraint is not None and task.constraint.done:
            stop_type = "eos"  # the grammar is complete: nothing but end-of-generation could follow
        context_full = not stop_type and len(slot.cache) >= self.n_ctx  # no position left for `last`
        if context_full and task.context_shift:
            self._shift_context(slot)
            context_full = False
        elif context_full:
            stop_type = "limit"
        probs = None
        if task.n_probs > 0 and rows is not None:
            probs = self._probs(rows[:len(emitted)], emitted, task.n_probs)
        if stop_type and stop_type != "word":
            stream.flush()
        text = stream.take(final=bool(stop_type))
        if text or emitted:
            timings = self._result(slot, "", time.perf_counter()).timings() if task.timings_per_token else None
            self._post(slot.handle, Chunk(text, emitted, probs, timings))  # type: ignore[arg-type]
        if stop_type:
            self.finish(slot, stop_type, context_full)

    def _shift_context(self, slot: Slot) -> None:
        """The context is full: keep the first n_keep tokens and the newer half of the rest, and read them again
        from position 0 (as a preempted slot does: RESUMING, kv_room.py), then generate on from `last`. llama.cpp
        moves the kept keys instead of reading them again; the tokens kept are the same."""
        task = slot.task
        n_keep = len(task.prompt) if task.n_keep < 0 else task.n_keep
        n_keep = min(n_keep, len(slot.cache) - 2)  # at least one token is discarded, one kept after n_keep
        n_discard = max(1, (len(slot.cache) - n_keep) // 2)
        kept = slot.cache[:n_keep] + slot.cache[n_keep + n_discard:]
        self.runner.kv_truncate(slot.id, 0)
        slot.cache, slot.replay, slot.n_planned = [], kept, 0
        slot.state = SlotState.RESUMING
        with self._cond:
            self.counters.context_shifts += 1

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

    # -- task end ----------------------------------------------------------------------------------

    def _result(self, slot: Slot, stop_type: str, now: float, context_full: bool = False) -> Result:
        """The task's result as of `now` (also its timings so far, with an empty stop_type)."""
        assert slot.handle is not None and slot.stream is not None
        prompt_done = slot.t_prompt_done if slot.state in (SlotState.GENERATING, SlotState.RESUMING) else now
        return Result(
            slot=slot.id, stop_type=stop_type, stopping_word=slot.stream.stopping_word,
            n_prompt=len(slot.handle.task.prompt), n_cached=slot.n_cached, n_predicted=slot.n_decoded,
            prompt_ms=(prompt_done - slot.t_start) * 1000, predicted_ms=(now - prompt_done) * 1000,
            draft_n=slot.draft_n, draft_n_accepted=slot.draft_accepted, context_full=context_full,
            n_steps=slot.n_steps, draft_sources=self._task_drafts(slot),
        )

    def finish(self, slot: Slot, stop_type: str, context_full: bool = False) -> None:
        handle = slot.handle
        assert handle is not None and slot.stream is not None
        now = time.perf_counter()
        prompt_done = slot.t_prompt_done if slot.state in (SlotState.GENERATING, SlotState.RESUMING) else now
        if stop_type != "word":
            slot.stream.flush()
        text = slot.stream.take(final=True)
        if text and stop_type != "cancelled":
            self._post(handle, Chunk(text, []))
        result = self._result(slot, stop_type, now, context_full)
        # Steps queued after this one may have written past what the slot keeps.
        self.runner.kv_truncate(slot.id, len(slot.cache))
        self.name_blocks(slot)  # (a conversation's next turn starts with all of it)
        with self._cond:
            c = self.counters
            c.tokens_predicted += slot.n_decoded
            c.predicted_seconds += now - prompt_done
            c.requests_done += 1
            self._release(slot)
        if slot.use_chain:
            self._end_chain(slot)
        self._post(handle, result)

    @staticmethod
    def _task_drafts(slot: Slot) -> dict[str, tuple[int, int]]:
        """The task's draft tokens (generated, accepted) by speculator, from the chain's counts at its start."""
        out = {}
        for m in slot.chain.members if slot.chain is not None else ():
            gen0, acc0 = slot.spec_base.get(m.name, (0, 0))
            if m.stats.gen_tokens > gen0:
                out[m.name] = (m.stats.gen_tokens - gen0, m.stats.acc_tokens - acc0)
        return out

    def fail(self, slot: Slot, message: str) -> None:
        handle = slot.handle
        with self._cond:
            self.counters.requests_failed += 1
            self._release(slot)
        # The slot's cache may not match its KV any more: start the next task from scratch.
        slot.cache = []
        slot.chain, slot.chain_key = None, None
        if handle is not None:
            self._post(handle, Failure(message))

    def _release(self, slot: Slot) -> None:
        """(Under the lock.)"""
        slot.handle = None
        slot.state = SlotState.IDLE
        slot.last_used = time.perf_counter()
        self.counters.requests_processing = sum(s.handle is not None for s in self.slots)
        if not self.counters.requests_processing:
            self._drafting().pause()  # the time until the next task is not a turn's

    def _end_chain(self, slot: Slot) -> None:
        if slot.chain is None:
            return
        try:
            slot.chain.end(slot.cache)  # e.g. the shared suffix store takes the task's text
        except Exception:
            log.exception("speculator end() failed on slot %d", slot.id)
            slot.chain, slot.chain_key = None, None
