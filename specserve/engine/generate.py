"""Generation for one sequence: prompt in chunks, then decode steps, speculative or not.

A speculative step evaluates `[last sampled] + draft` in one forward pass, lets the
sampler walk the draft (`sample_and_verify`), keeps the accepted prefix and drops the
KV entries of the rejected positions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specserve.engine.batch import Batch
from specserve.engine.greedy_chain import DEPTH, GreedyChain
from specserve.engine.host_copy import PendingTokens
from specserve.engine.runner import LocalRunner
from specserve.engine.sampling import Sampler
from specserve.errors import SpecserveError


class DraftSource(Protocol):
    """What generation needs of a speculator (a Speculator or a Chain)."""

    def begin(self, prompt: list[int]) -> None: ...
    def prepare(self, history: list[int]) -> None: ...
    def draft(self, history: list[int], last_sampled: int, n_max: int, n_min: int = 0) -> list[int]: ...
    def accept(self, n_accepted: int) -> None: ...
    def end(self) -> None: ...


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated: int = 0
    decode_seconds: float = 0.0
    target_forwards: int = 0  # forward passes of the target while decoding
    draft_tokens: int = 0  # drafted tokens sent to verification
    draft_accepted: int = 0
    stop_reason: str = "length"  # "length", "eog", "context"
    tokens: list[int] = field(default_factory=list)

    def timing_lines(self) -> list[str]:
        def line(label: str, seconds: float, n: int) -> str:
            ms = seconds * 1000
            per = ms / n if n else 0.0
            rate = n / seconds if seconds > 0 else 0.0
            return (f"{label} = {ms:10.2f} ms / {n:5d} tokens ({per:8.2f} ms per token, "
                    f"{rate:8.2f} tokens per second)")

        return [line("prompt eval time", self.prompt_seconds, self.prompt_tokens),
                line("       eval time", self.decode_seconds, self.generated)]


def sync(device: torch.device) -> None:
    """Wait for the device (timings), a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(runner: LocalRunner, seq: int, tokens: list[int], n_batch: int, start: int = 0) -> torch.Tensor:
    """Evaluate tokens[start:] (positions start..) in chunks; logits of the last token."""
    if not tokens[start:]:
        raise SpecserveError("nothing to evaluate: the prompt is empty")
    logits = None
    for chunk_start in range(start, len(tokens), n_batch):
        chunk = tokens[chunk_start:chunk_start + n_batch]
        batch = Batch()
        last = chunk_start + len(chunk) == len(tokens)
        batch.add_sequence(chunk, chunk_start, seq, "last" if last else "none")
        if last:
            logits = runner.forward(batch)[0]
        else:
            runner.forward(batch)
    assert logits is not None
    return logits


def generate(
    runner: LocalRunner,
    prompt: list[int],
    n_predict: int,
    sampler: Sampler,
    *,
    is_eog: Callable[[int], bool] = lambda token: False,
    speculator: DraftSource | None = None,
    n_draft_max: int = 16,
    n_draft_min: int = 0,
    seq: int = 0,
    n_batch: int = 512,
    stats: GenerationStats | None = None,
    overlap: bool = True,
) -> Iterator[int]:
    """Yield up to n_predict generated tokens (an end-of-generation token ends it, included).

    Greedy output is identical with or without a speculator. overlap: plain greedy steps are
    queued ahead of the host (GreedyChain), with a speculator too wherever it drafts nothing;
    False evaluates one step at a time (the reference the tests compare with).
    """
    stats = stats if stats is not None else GenerationStats()
    if len(prompt) >= runner.n_ctx:
        raise SpecserveError(f"the prompt ({len(prompt)} tokens) does not fit the context ({runner.n_ctx})")
    device = runner.device
    runner.kv_truncate(seq, 0)
    t0 = time.perf_counter()
    logits = prefill(runner, seq, prompt, n_batch)
    if speculator is not None:  # while the device evaluates the prompt: e.g. index it for drafting
        speculator.begin(prompt)
    try:  # (end() follows every begin())
        if speculator is not None:
            speculator.prepare(prompt)
        sampler.reset(prompt)
        token = sampler.sample(logits)
        sync(device)
        stats.prompt_tokens = len(prompt)
        stats.prompt_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        history = list(prompt)  # tokens in the KV cache; `token` is sampled but not yet evaluated
        if overlap and sampler.argmax_only:
            if speculator is None:
                yield from _decode_chained(runner, seq, token, len(history), n_predict, sampler, is_eog, stats)
            else:
                yield from _decode_speculative_chained(runner, seq, token, history, n_predict, sampler, is_eog,
                                                       speculator, n_draft_max, n_draft_min, stats)
            return
        pending = [token]
        max_draft = runner.draft_limit(n_draft_max)
        while True:
            if (yield from _hand_out(pending, n_predict, is_eog, stats)):
                return
            token = pending[-1]
            history.extend(pending[:-1])
            room = runner.n_ctx - len(history) - 1  # positions left after `token`
            if room < 0:
                stats.stop_reason = "context"
                return
            draft: list[int] = []
            if speculator is not None:
                limit = min(max_draft, n_predict - stats.generated - 1, room)
                if limit > 0:
                    draft = speculator.draft(history, token, limit, n_draft_min)
            batch = Batch()
            batch.add_sequence([token, *draft], len(history), seq, "all")
            logits = runner.forward(batch)
            stats.target_forwards += 1
            pending = sampler.sample_and_verify(logits, draft) if draft else [sampler.sample(logits[0])]
            history.append(token)
            if draft:
                n_acc = len(pending) - 1
                speculator.accept(n_acc)  # type: ignore[union-attr]
                stats.draft_tokens += len(draft)
                stats.draft_accepted += n_acc
                runner.kv_truncate(seq, len(history) + n_acc)
    finally:
        sync(device)
        stats.decode_seconds = time.perf_counter() - t0
        if speculator is not None:
            speculator.end()


def _hand_out(tokens: list[int], n_predict: int, is_eog: Callable[[int], bool],
              stats: GenerationStats) -> Generator[int, None, bool]:
    """Yield tokens in order, counting them; True (stats.stop_reason set) once one ends generation
    (end of generation, or n_predict reached): the rest are dropped."""
    for tok in tokens:
        stats.tokens.append(tok)
        stats.generated += 1
        yield tok
        if is_eog(tok):
            stats.stop_reason = "eog"
            return True
        if stats.generated >= n_predict:
            stats.stop_reason = "length"
            return True
    return False


def _decode_chained(runner: LocalRunner, seq: int, token: int, n_kv: int, n_predict: int, sampler: Sampler,
                    is_eog: Callable[[int], bool], stats: GenerationStats) -> Iterator[int]:
    """Plain greedy decoding through a GreedyChain: the steps after `token` are queued before it is
    yielded, so the consumer's work overlaps the device. n_kv: KV entries so far (`token` goes next)."""
    chain = GreedyChain(runner, seq, token, n_kv)
    try:
        while True:
            stats.tokens.append(token)
            stats.generated += 1
            stop = ("eog" if is_eog(token) else "length" if stats.generated >= n_predict
                    else "context" if n_kv >= runner.n_ctx else None)
            ahead = 0 if stop else min(DEPTH, n_predict - stats.generated)  # tokens to come
            while chain.in_flight < ahead and chain.position < runner.n_ctx:
                chain.submit()
            yield token
            if stop is not None:
                stats.stop_reason = stop
                return
            token = chain.next_token()
            stats.target_forwards += 1  # steps whose token was used (one queued past the end is not)
            sampler.accept([token], [])
            n_kv += 1
    finally:
        chain.close(n_kv)


def _decode_speculative_chained(runner: LocalRunner, seq: int, token: int, history: list[int], n_predict: int,
                                sampler: Sampler, is_eog: Callable[[int], bool], speculator: DraftSource,
                                n_draft_max: int, n_draft_min: int, stats: GenerationStats) -> Iterator[int]:
    """Greedy speculative decoding where stretches without drafts run as a GreedyChain.

    With a draft for `token` and nothing queued, one step verifies [token, *draft]. Without one,
    the step evaluating `token` and the one after it (its token fed back on the device) are queued
    before the host waits, so the next draft is made while the device works. A draft made while
    the step evaluating `token` runs is checked against that step's token first (no extra work
    when it is wrong), and a verify step of [that token, *draft[1:]] follows when it is right.
    Between a step's result and the next launch the host only drafts: the tokens before are handed
    out, and the speculator does its bookkeeping (`prepare`), while the device works; a verify step
    reads back just the argmax of each row.
    history: tokens in the KV cache (`token`, sampled, is not yet evaluated)."""
    chain: GreedyChain | None = None
    out = [token]  # tokens to hand out, then `token` is their last
    max_draft = runner.draft_limit(n_draft_max)
    launched: list[PendingTokens] = []  # the verify step in flight, if any

    def launch_verify(first: int, draft: list[int], position: int) -> None:
        """Queue the evaluation of [first (the last sampled token), *draft] at position.."""
        launched.append(runner.step_argmax(seq, [first, *draft], position))
        stats.target_forwards += 1
        stats.draft_tokens += len(draft)
        speculator.prepare(history)

    def verified(draft: list[int], position: int) -> list[int]:
        """The launched verify step's accepted draft prefix and one new token."""
        pending = sampler.accept(launched.pop().read(), draft)
        stats.draft_accepted += len(pending) - 1
        runner.kv_truncate(seq, position + len(pending))
        return pending

    try:
        while True:
            token = out[-1]
            position = len(history)
            room = runner.n_ctx - position - 1  # positions left after `token`
            left = n_predict - stats.generated - len(out)  # tokens wanted after `out`
            if left <= 0 or room < 0 or any(map(is_eog, out)):
                if not (yield from _hand_out(out, n_predict, is_eog, stats)):
                    stats.stop_reason = "context"
                return
            # Handing out `out` cannot end the generation now: it happens once the next step is queued.
            queued = chain is not None and chain.in_flight > 0  # a step evaluating `token` runs
            limit = min(max_draft, left - 1, room)
            draft = speculator.draft(history, token, limit, n_draft_min) if limit > 0 else []
            if draft and not queued:
                launch_verify(token, draft, position)
                yield from _hand_out(out, n_predict, is_eog, stats)
                pending = verified(draft, position)
                speculator.accept(len(pending) - 1)
                history += [token, *pending[:-1]]
                out = pending
                continue
            if chain is None:
                chain = GreedyChain(runner, seq, token, position)
            elif not queued and chain.position != position:  # verify steps ran since its last step
                chain.restart(token, position)
            if not queued:
                chain.submit()  # evaluates `token`
            if not draft and left >= 2 and chain.position < runner.n_ctx:
                chain.submit()  # evaluates the token after it, fed on the device: queued before the host waits
            speculator.prepare(history)
            yield from _hand_out(out, n_predict, is_eog, stats)
            nxt = chain.next_token()
            stats.target_forwards += 1
            sampler.accept([nxt], [])
            history.append(token)
            out = [nxt]
            if draft:  # draft[0] was a guess at nxt
                if nxt != draft[0]:
                    speculator.accept(0)
                elif len(draft) == 1:
                    speculator.accept(1)
                else:
                    launch_verify(nxt, draft[1:], position + 1)
                    pending = verified(draft[1:], position + 1)
                    speculator.accept(len(pending))
                    history += [nxt, *pending[:-1]]
                    out = [nxt, *pending]
    finally:
        for step in launched:
            step.wait()
        if chain is not None:
            chain.close(len(history))
        else:
            runner.kv_truncate(seq, len(history))
