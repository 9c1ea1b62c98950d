"""The slot scheduler in-process: batching invariance, draft-model slots, failures, stop strings."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import pytest

from specserve.engine.generate import generate
from specserve.engine.local_runner import LocalRunner
from specserve.engine.sampling import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.tasks import Chunk, Failure, Result, Task, TaskHandle
from specserve.engine.text_stream import TextStream, partial_stop_len
from specserve.errors import SpecserveError
from specserve.gguf.tokenizer import Tokenizer
from specserve.speculative.base import Chain, SpecParams, Speculator
from specserve.speculative.factory import build_chain
from tests.helpers import GREEDY, running_scheduler, submit, wait

N_SLOTS = 2


@pytest.fixture(scope="module")
def target(smollm_path: Path) -> LocalRunner:
    return LocalRunner(smollm_path, n_seqs=N_SLOTS, n_ctx=256, device="cpu", progress=False)


@pytest.fixture(scope="module")
def tokenizer(target: LocalRunner) -> Tokenizer:
    return Tokenizer.from_gguf(target.gguf)


@pytest.fixture
def scheduler(target: LocalRunner, tokenizer: Tokenizer) -> Iterator[Scheduler]:
    with running_scheduler(target, tokenizer) as sched:
        yield sched


PROMPTS = ["The capital of France is", "Here is a long list of fruits: apple, banana, cherry, date, elderberry,"]


def test_batched_equals_alone_with_draft_model(target: LocalRunner, tokenizer: Tokenizer,
                                                smollm_path: Path) -> None:
    # The target as its own draft model: every drafted token that clears p_min is accepted. The slots draft
    # together: one draft forward carries several sequences (slot_drafts' prefetch).
    draft = LocalRunner(smollm_path, n_seqs=N_SLOTS, n_ctx=256, device="cpu", progress=False)
    seqs_per_forward: list[int] = []
    forward = draft.forward
    draft.forward = lambda batch: (seqs_per_forward.append(len(set(batch.seq_ids))), forward(batch))[1]  # type: ignore[method-assign]
    sched = Scheduler(target, tokenizer, n_batch=16, chain_factory=lambda s, slot: build_chain(s, draft, seq=slot),
                      adaptive_drafts=False)
    sched.start()
    try:
        plain = SpecParams(n_max=0)
        alone = [wait(submit(sched, tokenizer, p, spec=plain)[1]) for p in PROMPTS]
        spec = SpecParams(n_max=4, p_min=0.0)
        pending = [submit(sched, tokenizer, p, spec=spec) for p in PROMPTS]
        together = [wait(events) for _, events in pending]
        assert [t for t, _ in together] == [t for t, _ in alone]
        for _, result in together:
            assert isinstance(result, Result)
            assert result.draft_n > 0 and result.draft_n_accepted == result.draft_n
        counters = sched.counters_snapshot()
        assert counters.draft_generated["draft"] == counters.draft_accepted["draft"] > 0
        assert max(seqs_per_forward) == len(PROMPTS)
    finally:
        sched.shutdown()


def test_seeded_sampling_independent_of_batching_and_drafts(scheduler: Scheduler, tokenizer: Tokenizer) -> None:
    # Non-greedy, penalized: the sampler path. Its noise is per position, so the same seed gives
    # the same text alone, batched with another request, and with drafts.
    sampling = SamplingParams(temperature=0.9, seed=1234, repeat_penalty=1.1)
    spec = SpecParams(type="ngram-simple", ngram_size_n=2, ngram_size_m=8, n_max=8)

    def run(prompt: str, spec: SpecParams) -> tuple[TaskHandle, queue.Queue]:
        events: queue.Queue = queue.Queue()
        task = Task(tokenizer.encode(prompt), sampling, spec, n_predict=16)
        return scheduler.submit(task, events.put), events

    prompts = ["a b c d e f g h, a b c d e f g h, a b c d e f g h, a b c", PROMPTS[1]]
    alone = [wait(run(p, SpecParams(n_max=0))[1])[0] for p in prompts]
    together = [wait(events) for _, events in [run(p, spec) for p in prompts]]
    assert [text for text, _ in together] == alone
    assert sum(r.draft_n for _, r in together if isinstance(r, Result)) > 0


def test_failed_step_fails_its_tasks_and_keeps_serving(scheduler: Scheduler, tokenizer: Tokenizer,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = scheduler.runner
    real_launch = runner.launch
    calls = {"n": 0}

    def flaky(batch, fed=None, **kw):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated device error")
        return real_launch(batch, fed, **kw)

    monkeypatch.setattr(runner, "launch", flaky)
    outcomes = [wait(submit(scheduler, tokenizer, p)[1])[1] for p in PROMPTS[:1]]
    assert isinstance(outcomes[0], Failure) and "simulated device error" in outcomes[0].message
    text, result = wait(submit(scheduler, tokenizer, PROMPTS[0])[1])
    assert isinstance(result, Result) and result.n_predicted == 12 and text
    assert not any(s["is_processing"] for s in scheduler.slots_json())


def test_queue_cancel_and_n_predict_zero(scheduler: Scheduler, tokenizer: Tokenizer) -> None:
    pending = [submit(scheduler, tokenizer, p, n_predict=40) for p in ["One", "Two", "Three"]]
    pending[2][0].cancel()  # the third waits for a slot: dropped without running
    pending[0][0].cancel()
    first, third = wait(pending[0][1]), wait(pending[2][1])
    # cancelled while running, or (if the thread had not picked it up yet) while queued
    assert (isinstance(first[1], Result) and first[1].stop_type == "cancelled") or (
        isinstance(first[1], Failure) and "cancelled" in first[1].message)
    assert isinstance(third[1], Failure) and "cancelled" in third[1].message
    assert isinstance(wait(pending[1][1])[1], Result)
    text, result = wait(submit(scheduler, tokenizer, "Hello", n_predict=0)[1])
    assert text == "" and isinstance(result, Result) and result.n_predicted == 0


def test_prompt_cache_reuses_prefix(scheduler: Scheduler, tokenizer: Tokenizer) -> None:
    first = wait(submit(scheduler, tokenizer, PROMPTS[1])[1])
    again = wait(submit(scheduler, tokenizer, PROMPTS[1])[1])
    fresh = wait(submit(scheduler, tokenizer, PROMPTS[1], cache_prompt=False)[1])
    assert first[0] == again[0] == fresh[0]
    n_prompt = len(tokenizer.encode(PROMPTS[1]))
    assert isinstance(again[1], Result) and again[1].n_cached == n_prompt - 1
    assert isinstance(fresh[1], Result) and fresh[1].n_cached == 0


def test_generation_stops_when_the_slot_context_is_full(scheduler: Scheduler, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("a b c d e f g h, " * 28)
    n_ctx = scheduler.n_ctx
    assert n_ctx - 40 < len(prompt) < n_ctx
    events: queue.Queue = queue.Queue()
    scheduler.submit(Task(prompt, GREEDY, SpecParams(type="ngram-simple", ngram_size_n=3, ngram_size_m=8)), events.put)
    _, result = wait(events)
    assert isinstance(result, Result) and result.stop_type == "limit" and result.context_full
    # Every position of the slot holds a token; the last generated token is emitted, never evaluated.
    assert result.n_predicted == n_ctx - len(prompt) + 1


def test_prompt_must_fit_the_slot(scheduler: Scheduler, tokenizer: Tokenizer) -> None:
    with pytest.raises(SpecserveError, match="does not fit"):
        submit(scheduler, tokenizer, "word " * 300)


def test_stop_string_split_over_tokens(tokenizer: Tokenizer) -> None:
    text = "The answer is 42. The end."
    ids = tokenizer.encode(text, add_special=False)
    stream = TextStream(tokenizer, ["42. The"])
    sent, stopped = "", False
    for token in ids:
        stopped = stream.add(token)
        sent += stream.take(final=stopped)
        assert "4" not in sent  # a possible start of the stop string is never sent early
        if stopped:
            break
    assert stopped and sent == "The answer is " and stream.stopping_word == "42. The"


def test_partial_stop_len() -> None:
    assert partial_stop_len("hello wor", ["world"]) == 3
    assert partial_stop_len("hello", ["xyz", "lo!"]) == 2
    assert partial_stop_len("abc", []) == 0
    assert partial_stop_len("abc", ["abc"]) == 0  # a whole stop string is a match, not a partial one
    assert partial_stop_len("xab", ["abc"]) == 2


def test_speculators_prepare_while_the_step_runs(scheduler: Scheduler, tokenizer: Tokenizer,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step of a speculating slot hands its history to the speculator's prepare() (the index
    work done while the device runs); a prepare() that raises fails that task only."""
    from specserve.speculative.ngram_suffix import NgramSuffix

    seen: list[list[int]] = []
    real_prepare = NgramSuffix.prepare

    def recording(self, history):  # type: ignore[no-untyped-def]
        seen.append(list(history))
        real_prepare(self, history)

    monkeypatch.setattr(NgramSuffix, "prepare", recording)
    prompt = PROMPTS[1]
    plain_text, plain = wait(submit(scheduler, tokenizer, prompt, n_predict=24)[1])
    spec_text, spec = wait(submit(scheduler, tokenizer, prompt, n_predict=24, spec=SpecParams(type="ngram-suffix"))[1])
    assert isinstance(spec, Result) and spec_text == plain_text
    prompt_tokens = tokenizer.encode(prompt)
    assert len(seen) >= 2 and all(h[:len(prompt_tokens)] == prompt_tokens for h in seen)
    assert [len(h) for h in seen] == sorted(len(h) for h in seen)  # the history only grows

    def failing(self, history):  # type: ignore[no-untyped-def]
        raise RuntimeError("simulated index error")

    monkeypatch.setattr(NgramSuffix, "prepare", failing)
    _, failed = wait(submit(scheduler, tokenizer, prompt, n_predict=24, spec=SpecParams(type="ngram-suffix"))[1])
    assert isinstance(failed, Failure) and "simulated index error" in failed.message
    text, again = wait(submit(scheduler, tokenizer, prompt, n_predict=24)[1])
    assert isinstance(again, Result) and text == plain_text


def test_greedy_text_is_the_same_with_and_without_overlap_and_among_others(target: LocalRunner,
                                                                            tokenizer: Tokenizer) -> None:
    """Queuing step N + 1 before step N is read (fed tokens, drafts riding behind the token in flight) changes
    nothing: each prompt's greedy text, alone or beside another, speculating or not, is the reference's
    (every step settled before the next, one request at a time)."""
    factory = lambda s, slot: build_chain(s, None, seq=slot)  # noqa: E731
    reference = Scheduler(target, tokenizer, n_batch=16, overlap=False, chain_factory=factory)
    prompts = [*PROMPTS, "def add(a, b):\n    return a + b\n\ndef add(a, b):"]
    expected = [generate(target, tokenizer, tokenizer.encode(p), 20, scheduler=reference).tokens for p in prompts]
    overlapped = Scheduler(target, tokenizer, n_batch=16, chain_factory=factory)
    overlapped.start()
    try:
        for spec in (SpecParams(n_max=0), SpecParams(type="ngram-suffix"),
                     SpecParams(type="ngram-simple", ngram_size_n=2, ngram_size_m=6)):
            events: list[queue.Queue] = []
            for p in prompts:
                q: queue.Queue = queue.Queue()
                overlapped.submit(Task(tokenizer.encode(p), GREEDY, spec, n_predict=20), q.put)
                events.append(q)
            tokens = []
            for q in events:
                got: list[int] = []
                while not isinstance(event := q.get(timeout=120), Result | Failure):
                    got.extend(event.tokens)
                assert isinstance(event, Result)
                tokens.append(got)
            assert tokens == expected, spec
    finally:
        overlapped.shutdown()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failing_speculator_fails_its_task_only(target: LocalRunner, tokenizer: Tokenizer, overlap: bool) -> None:
    """A speculator that raises ends its own task with a clear message; the other slot's text is untouched."""

    class Broken(Speculator):
        name = "broken"

        def _propose(self, history: list[int], last_sampled: int, n_max: int) -> list[int]:
            raise RuntimeError("simulated speculator bug")

    def chains(spec: SpecParams, slot: int) -> Chain | None:  # n_max 7 marks the broken one
        return Chain([Broken()]) if spec.n_max == 7 else build_chain(spec, None, seq=slot)

    sched = Scheduler(target, tokenizer, n_batch=16, chain_factory=chains, overlap=overlap, adaptive_drafts=False)
    sched.start()
    try:
        plain = wait(submit(sched, tokenizer, PROMPTS[1], spec=SpecParams(n_max=0))[1])[0]
        broken = submit(sched, tokenizer, PROMPTS[0], spec=SpecParams(type="ngram-simple", n_max=7))[1]
        fine = submit(sched, tokenizer, PROMPTS[1], spec=SpecParams(type="ngram-simple"))[1]
        _, failure = wait(broken)
        text, result = wait(fine)
        assert isinstance(failure, Failure) and "simulated speculator bug" in failure.message
        assert isinstance(result, Result) and text == plain
        assert not any(s["is_processing"] for s in sched.slots_json())
    finally:
        sched.shutdown()


SYSTEM = ("You are a careful assistant. Answer in one short sentence, without lists, and never repeat the "
          "question. Question: ")


def test_a_prompt_prefix_cached_by_another_slot_is_taken_not_evaluated(scheduler: Scheduler, target: LocalRunner,
                                                                        tokenizer: Tokenizer) -> None:
    """Two requests sharing a system prompt arrive together: the first takes the slot that holds the prefix, the
    second takes its cached full blocks (counted as shared), and its text equals its text without any cache."""
    questions = ["What is the capital of France?", "Why is the sky blue?"]
    alone = [wait(submit(scheduler, tokenizer, SYSTEM + q, cache_prompt=False)[1])[0] for q in questions]
    unrelated = [submit(scheduler, tokenizer, p) for p in PROMPTS]  # both slots now hold other text
    assert all(isinstance(wait(events)[1], Result) for _, events in unrelated)
    _, warm = wait(submit(scheduler, tokenizer, SYSTEM + "How far is the moon?")[1])  # a slot now holds SYSTEM
    assert isinstance(warm, Result)
    before = scheduler.counters_snapshot().prompt_tokens_shared
    runs = [submit(scheduler, tokenizer, SYSTEM + q) for q in questions]
    results = [wait(events) for _, events in runs]
    assert [text for text, _ in results] == alone
    prefix = len(tokenizer.encode(SYSTEM))
    shared = scheduler.counters_snapshot().prompt_tokens_shared - before
    # the system prompt's full blocks (tokens at its end may merge with the question)
    blocks = (prefix - 2) // 16 * 16
    assert 0 < blocks <= shared <= prefix + 2
    cached = sorted(r.n_cached for _, r in results if isinstance(r, Result))
    assert len(cached) == 2 and cached[0] >= blocks and cached[1] >= prefix - 2  # one took the blocks, one kept it
    counters = scheduler.counters_snapshot()  # both slots now hold a prompt and its answer
    assert 2 * prefix < counters.kv_tokens <= counters.kv_capacity == target.n_seqs * target.n_ctx


def test_the_draft_gate_counts_slots_reading_prompts(target: LocalRunner, tokenizer: Tokenizer,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A drafting turn is unchained for every slot, prompt chunks too, so the gate is asked with the busy slots:
    one slot generating beside one reading its prompt is two, not a lone slot (which always drafts)."""
    from specserve.engine.draft_gate import DraftGate
    from specserve.engine.slots import SlotState

    sched = Scheduler(target, tokenizer, n_batch=8, chain_factory=lambda s, slot: build_chain(s, None, seq=slot))
    asked: list[tuple[int, int]] = []  # (slots the gate was told of, slots generating)
    real_allow = DraftGate.allow

    def recording(self, n_slots):  # type: ignore[no-untyped-def]
        asked.append((n_slots, sum(s.state == SlotState.GENERATING for s in sched.slots)))
        return real_allow(self, n_slots)

    monkeypatch.setattr(DraftGate, "allow", recording)
    sched.start()
    try:
        short = submit(sched, tokenizer, PROMPTS[0], n_predict=16, spec=SpecParams(type="ngram-simple"))[1]
        long = submit(sched, tokenizer, PROMPTS[1] * 3, n_predict=4, spec=SpecParams(type="ngram-simple"))[1]
        assert all(isinstance(wait(events)[1], Result) for events in (short, long))
    finally:
        sched.shutdown()
    assert (2, 1) in asked  # one generating, one still reading: the gate heard of both
    assert all(n >= g for n, g in asked)


def test_the_next_step_is_in_flight_before_a_steps_tokens_are_handed_out(target: LocalRunner,
                                                                       tokenizer: Tokenizer) -> None:
    """A step with a draft cannot be chained, so the device waits while the host plans the next one; that
    one is launched before the settled tokens go to their readers (an HTTP loop wanting the GIL), also
    after drafted steps, and the text is that of plain greedy decoding."""
    with running_scheduler(target, tokenizer) as sched:
        in_flight: list[bool] = []
        sizes: list[int] = []  # tokens per chunk: more than one after an accepted draft
        events: queue.Queue = queue.Queue()

        def emit(event: object) -> None:
            if isinstance(event, Chunk) and event.tokens:
                in_flight.append(sched._in_flight is not None)
                sizes.append(len(event.tokens))
            events.put(event)

        prompt = tokenizer.encode(PROMPTS[1] * 2)
        sched.submit(Task(prompt, GREEDY, SpecParams(type="ngram-simple"), n_predict=100), emit)
        text, result = wait(events)
        plain_text, _ = wait(submit(sched, tokenizer, PROMPTS[1] * 2, n_predict=100)[1])
    assert isinstance(result, Result) and result.draft_n > 0 and text == plain_text
    assert any(n > 1 for n in sizes[:-1]), sizes  # a drafted step that did not end the task
    assert all(in_flight[:-1]), in_flight  # every chunk but the last: the next step was running already


def test_many_slots_draft_in_chained_steps_with_the_same_text(smollm_path: Path, tokenizer: Tokenizer) -> None:
    """Past the gate's slot count, drafts ride chained steps: the next step assumes each draft accepted whole
    and a slot whose draft fell short drops its queued rows. Texts stay the reference's, and drafts were
    verified (without chaining, nothing drafts there)."""
    n = 10
    runner = LocalRunner(smollm_path, n_seqs=n, n_ctx=160, device="cpu", progress=False)
    factory = lambda s, slot: build_chain(s, None, seq=slot)  # noqa: E731
    reference = Scheduler(runner, tokenizer, n_batch=64, overlap=False, chain_factory=factory)
    prompts = [f"def f{i}(a, b):\n    return a + b * {i}\n\ndef f{i}(a, b):\n    return a + b * {i}\n\ndef f{i}(a"
               for i in range(n)]
    expected = [generate(runner, tokenizer, tokenizer.encode(p), 24, scheduler=reference).tokens for p in prompts]
    accepted = {}
    for chain_drafts in (True, False):
        sched = Scheduler(runner, tokenizer, n_batch=64, chain_factory=factory, chain_drafts=chain_drafts)
        sched.start()
        try:
            pending = [submit(sched, tokenizer, p, n_predict=24, spec=SpecParams(type="ngram-suffix"))
                       for p in prompts]
            results = [wait(events) for _, events in pending]
            assert all(isinstance(r, Result) for _, r in results)
            tokens = [r.n_predicted for _, r in results]
            assert tokens == [len(e) for e in expected]
            assert [tokenizer.decode(e) for e in expected] == [t for t, _ in results]
            accepted[chain_drafts] = sched.counters_snapshot().spec_accepted
        finally:
            sched.shutdown()
    assert accepted[True] > 2 * accepted[False], accepted  # (gated: drafts only once a few slots are left)
