"""KV memory that follows use (engine/kv_room.py over the paged pool): slots share one pool, a slot may use
more of it than an even share, a shared prompt prefix is held once, and a pool too small for every running
request at once preempts the youngest, which reads its tokens again and ends with the text it would have
written alone (greedy, on the CPU whose rows do not depend on their batch)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specserve.engine.local_runner import LocalRunner
from specserve.engine.scheduler import Scheduler
from specserve.engine.slots import SlotState
from specserve.engine.tasks import Result
from specserve.gguf.tokenizer import Tokenizer
from specserve.model.batch import Batch
from specserve.speculative.base import SpecParams
from specserve.speculative.factory import build_chain
from tests.helpers import running_scheduler, submit, wait

PROMPTS = ["The capital of France is", "Here is a long list of fruits: apple, banana, cherry, date, elderberry,",
           "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def small_pool(smollm_path: Path) -> LocalRunner:
    """Three slots over 192 positions (12 blocks): less than the three requests below hold at once."""
    return LocalRunner(smollm_path, n_seqs=3, n_ctx=192, kv_size=192, device="cpu", progress=False)


@pytest.fixture(scope="module")
def tokenizer(small_pool: LocalRunner) -> Tokenizer:
    return Tokenizer.from_gguf(small_pool.gguf)


def test_a_full_pool_preempts_the_youngest_and_its_text_is_unchanged(small_pool: LocalRunner,
                                                                   tokenizer: Tokenizer) -> None:
    with running_scheduler(small_pool, tokenizer) as sched:
        plain = SpecParams(n_max=0)
        alone = [wait(submit(sched, tokenizer, p, n_predict=70, spec=plain)[1]) for p in PROMPTS]
        assert all(isinstance(r, Result) and r.n_predicted == 70 for _, r in alone)
        before = sched.counters_snapshot().kv_preemptions
        pending = [submit(sched, tokenizer, p, n_predict=70, spec=plain) for p in PROMPTS]
        together = [wait(events) for _, events in pending]
        assert sched.counters_snapshot().kv_preemptions > before
        assert [t for t, _ in together] == [t for t, _ in alone]
        # with speculation too: drafts are cut to the room left, and rejected positions give their blocks back
        spec = SpecParams(type="ngram-simple", n_max=8, ngram_size_n=2)
        drafted = [wait(events) for _, events in [submit(sched, tokenizer, p, n_predict=70, spec=spec)
                                                   for p in PROMPTS]]
        assert [t for t, _ in drafted] == [t for t, _ in alone]
    assert all(s.state == SlotState.IDLE for s in sched.slots)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: graphs, the Triton kernels, the QKV epilogue")
@pytest.mark.parametrize("weight_format", ["float", "gguf"])
def test_preempted_slots_end_with_their_text_alone_on_cuda(smollm_path: Path, weight_format: str) -> None:
    """As on the CPU, with batch-invariant kernels (a row's bits then do not depend on its step), through CUDA
    graphs: tokens read again as a prompt chunk give the K/V their decode rows gave."""
    from specserve.kernels import batch_invariant

    was = batch_invariant.enabled()
    batch_invariant.enable(True)
    try:
        runner = LocalRunner(smollm_path, n_seqs=3, n_ctx=192, kv_size=192, device="cuda", progress=False,
                             weight_format=weight_format)
        runner.warmup(24, 64)
        tokenizer = Tokenizer.from_gguf(runner.gguf)
        with running_scheduler(runner, tokenizer) as sched:
            plain = SpecParams(n_max=0)
            # past end-of-generation: three requests of 70 tokens each always overflow the pool
            alone = [wait(submit(sched, tokenizer, p, n_predict=70, spec=plain, ignore_eos=True)[1])[0]
                     for p in PROMPTS]
            pending = [submit(sched, tokenizer, p, n_predict=70, spec=plain, ignore_eos=True) for p in PROMPTS]
            together = [wait(events)[0] for _, events in pending]
            for i, (got, want) in enumerate(zip(together, alone, strict=True)):
                assert got == want, f"prompt {i}: apart from char {len(os.path.commonprefix([got, want]))}: {got!r}"
            assert sched.counters_snapshot().kv_preemptions > 0
    finally:
        batch_invariant.enable(was)


def test_one_slot_may_use_the_pool_beyond_an_even_share(small_pool: LocalRunner, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("one two three four five six seven eight nine ten " * 12)
    assert 64 < len(prompt) < 180  # more than 192 / 3 positions
    with running_scheduler(small_pool, tokenizer) as sched:
        text, result = wait(submit(sched, tokenizer, tokenizer.decode(prompt), n_predict=8)[1])
    assert isinstance(result, Result) and result.n_predicted == 8 and text


def test_a_shared_prefix_is_held_once(smollm_path: Path) -> None:
    """A request whose system prompt another (busy) slot holds takes that slot's blocks instead of copying them."""
    runner = LocalRunner(smollm_path, n_seqs=2, n_ctx=512, device="cpu", progress=False)
    tokenizer = Tokenizer.from_gguf(runner.gguf)
    system = "You are a careful assistant who answers in one short sentence. " * 8
    with running_scheduler(runner, tokenizer, n_batch=512) as sched:
        _, first = submit(sched, tokenizer, system + "Question one?", n_predict=40)
        chunk = first.get(timeout=120)  # the first slot is generating: the second request goes to the other
        _, second = submit(sched, tokenizer, system + "Another question, two?", n_predict=2)
        results = [wait(second)[1], wait(first)[1]]
    assert chunk and all(isinstance(r, Result) for r in results)
    shared = len(tokenizer.encode(system)) // 16 - 1  # whole blocks of the system prompt
    assert sched.counters_snapshot().prompt_tokens_shared >= 16 * shared
    tables = runner.ledger.blocks.tables
    assert tables[0][:shared] == tables[1][:shared] and runner.ledger.blocks.refs[tables[0][0]] == 2


def test_without_the_prefix_cache_a_prompt_reuses_only_its_own_slot(smollm_path: Path) -> None:
    """prefix_cache=False (serve --no-prefix-cache): a conversation's next turn on another slot, and the first turn
    again after the slot moved on, read every token; the same turn on its own idle slot still reuses that cache."""
    runner = LocalRunner(smollm_path, n_seqs=1, n_ctx=512, kv_size=1024, device="cpu", progress=False)
    tokenizer = Tokenizer.from_gguf(runner.gguf)
    a = "A conversation about the sea, its tides, its fish, its boats and the people on its shores. " * 3
    b = "Another one, about mountains: their snow, their rocks, the paths and the huts of the climbers. " * 3
    results = {}
    for cached in (True, False):
        sched = Scheduler(runner, tokenizer, n_batch=512, prefix_cache=cached)
        sched.start()
        try:
            wait(submit(sched, tokenizer, a, n_predict=4)[1])
            wait(submit(sched, tokenizer, b, n_predict=4)[1])
            _, again = wait(submit(sched, tokenizer, a + " And the next question?", n_predict=4)[1])
            _, own = wait(submit(sched, tokenizer, a + " And the next question? Yes.", n_predict=4)[1])
            results[cached] = (again, own, sched.counters_snapshot().prompt_tokens_shared)
        finally:
            sched.shutdown()
        runner.kv_truncate(0, 0)
    n_a = len(tokenizer.encode(a))
    (again_on, _, shared_on), (again_off, own_off, shared_off) = results[True], results[False]
    assert isinstance(again_on, Result) and again_on.n_cached >= n_a - 16 and shared_on > 0
    assert isinstance(again_off, Result) and again_off.n_cached == 0 and shared_off == 0
    assert isinstance(own_off, Result) and own_off.n_cached >= n_a


def test_prompt_caches_are_shared_only_within_a_cache_salt(smollm_path: Path) -> None:
    """Task.cache_salt (a request's cache_salt and API key): a prompt another salt's task cached, on this slot or in
    cached blocks, is read again; the same salt reuses it; the text is the same either way."""
    runner = LocalRunner(smollm_path, n_seqs=1, n_ctx=512, kv_size=1024, device="cpu", progress=False)
    tokenizer = Tokenizer.from_gguf(runner.gguf)
    a = "A conversation about the sea, its tides, its fish, its boats and the people on its shores. " * 3
    b = "Another one, about mountains: their snow, their rocks, the paths and the huts of the climbers. " * 3
    sched = Scheduler(runner, tokenizer, n_batch=512)
    sched.start()
    try:
        first = wait(submit(sched, tokenizer, a, n_predict=4, cache_salt="alice/")[1])
        other = wait(submit(sched, tokenizer, a, n_predict=4, cache_salt="bob/")[1])  # its own slot's cache too
        wait(submit(sched, tokenizer, b, n_predict=4, cache_salt="bob/")[1])
        again = wait(submit(sched, tokenizer, a, n_predict=4, cache_salt="alice/")[1])  # from cached blocks
    finally:
        sched.shutdown()
    n_a = len(tokenizer.encode(a))
    assert isinstance(other[1], Result) and other[1].n_cached == 0
    assert isinstance(again[1], Result) and again[1].n_cached >= n_a - 16
    assert first[0] == other[0] == again[0]


def test_a_draft_model_gives_up_idle_caches_for_room(smollm_path: Path) -> None:
    target = LocalRunner(smollm_path, n_seqs=3, n_ctx=192, kv_size=192, device="cpu", progress=False)
    draft = LocalRunner(smollm_path, n_seqs=3, n_ctx=192, kv_size=192, device="cpu", progress=False)
    tokenizer = Tokenizer.from_gguf(target.gguf)
    sched = Scheduler(target, tokenizer, n_batch=64, chain_factory=lambda s, slot: build_chain(s, draft, seq=slot),
                      adaptive_drafts=False)
    sched.start()
    try:
        spec = SpecParams(type="draft", n_max=4, p_min=0.0)
        plain = SpecParams(n_max=0)
        alone = [wait(submit(sched, tokenizer, p, n_predict=60, spec=plain)[1])[0] for p in PROMPTS]
        pending = [submit(sched, tokenizer, p, n_predict=60, spec=spec) for p in PROMPTS]
        together = [wait(events) for _, events in pending]
        assert [text for text, _ in together] == alone
        assert sum(r.draft_n for _, r in together) > 0  # the draft model drafted from its shared pool
    finally:
        sched.shutdown()


def test_slot_files_and_embeddings_round_trip_through_scattered_blocks(small_pool: LocalRunner) -> None:
    """kv_read / kv_write gather and scatter a sequence's rows through its table."""
    for seq in range(3):
        small_pool.kv_truncate(seq, 0)
    for seq, n in ((0, 20), (1, 40), (0, 50)):  # sequence 0 grows after 1 took blocks: its blocks interleave
        start = small_pool.seq_len[seq]
        batch = Batch()
        batch.add_sequence([(7 * i + seq) % 500 for i in range(start, n)], start, seq, "last")
        small_pool.forward(batch)
    saved = small_pool.kv_read(0)
    assert saved.shape[3] == 50
    small_pool.kv_write(2, saved)
    assert small_pool.seq_len[2] == 50 and (small_pool.kv_read(2) == saved).all()
    step = Batch()
    step.add(11, 50, 0, logits=True)
    step.add(11, 50, 2, logits=True)
    logits = small_pool.forward(step)
    assert (logits[0] == logits[1]).all()  # the restored copy attends to the same keys and values


def test_a_prefix_a_slot_gave_up_stays_cached_for_the_next_turn(smollm_path: Path) -> None:
    """One slot: conversation A's turn, then B's, then A's next turn reads only what is new (A's blocks stayed
    cached after the slot moved on); a pool too small to keep them all gives cached blocks up and still serves
    every request."""
    runner = LocalRunner(smollm_path, n_seqs=1, n_ctx=512, kv_size=1024, device="cpu", progress=False)
    tokenizer = Tokenizer.from_gguf(runner.gguf)
    a = "A conversation about the sea, its tides, its fish, its boats and the people on its shores. " * 3
    b = "Another one, about mountains: their snow, their rocks, the paths and the huts of the climbers. " * 3
    sched = Scheduler(runner, tokenizer, n_batch=512, n_slots=1)
    sched.start()
    try:
        wait(submit(sched, tokenizer, a, n_predict=4)[1])
        wait(submit(sched, tokenizer, b, n_predict=4)[1])
        _, result = wait(submit(sched, tokenizer, a + " And the next question?", n_predict=4)[1])
        n_a = len(tokenizer.encode(a))
        assert isinstance(result, Result) and result.n_cached >= n_a - 16
        assert sched.counters_snapshot().prompt_tokens_shared >= n_a - 16
    finally:
        sched.shutdown()
    tight = LocalRunner(smollm_path, n_seqs=1, n_ctx=128, kv_size=128, device="cpu", progress=False)
    sched = Scheduler(tight, tokenizer, n_batch=512, n_slots=1)
    sched.start()
    try:
        texts = [wait(submit(sched, tokenizer, p, n_predict=40)[1]) for p in (a[:200], b[:200], a[:150] + "?")]
        assert all(isinstance(r, Result) and r.n_predicted == 40 for _, r in texts)
    finally:
        sched.shutdown()


def test_a_slot_job_gets_room_from_idle_caches(smollm_path: Path) -> None:
    """An embedding needs more of the pool than is free while idle caches hold it: they are given up for it."""
    from specserve.engine import slot_state

    runner = LocalRunner(smollm_path, n_seqs=2, n_ctx=64, kv_size=64, device="cpu", progress=False)
    tokenizer = Tokenizer.from_gguf(runner.gguf)
    with running_scheduler(runner, tokenizer) as sched:
        wait(submit(sched, tokenizer, "one two three four five six seven eight nine ten", n_predict=40)[1])
        assert runner.ledger.blocks.free <= 1  # the idle slot's cache holds the pool
        tokens = tokenizer.encode("a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2)[:48]
        vector = sched.submit_job(lambda slot: slot_state.embed(runner, slot, tokens, 16, "mean")).result(60)
    assert vector.shape == (runner.config.hidden,) and vector.isfinite().all()


def test_without_c_the_pool_is_a_slots_context_each(smollm_path: Path) -> None:
    """Without -c the pool is min(model, 4096) positions a slot (cached prefixes keep what the slots leave)."""
    from specserve.server.settings import ServerSettings

    settings = ServerSettings(model=str(smollm_path), n_parallel=3)
    context = LocalRunner(smollm_path, device="cpu", progress=False).config.context_length
    assert settings.default_kv_size() == 3 * min(context, 4096)


def test_a_step_says_whether_it_reads_a_prompt(small_pool: LocalRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose rows do not all want logits reads a prompt (KVStep.prompt, which the GPU's attention tiles); a
    decode step does not."""
    heard: list[bool] = []
    real = small_pool.kv.step
    monkeypatch.setattr(small_pool.kv, "step", lambda *a, **k: heard.append(k["prompt"]) or real(*a, **k))
    small_pool.kv_truncate(0, 0)
    prompt = Batch()
    prompt.add_sequence(list(range(1, 11)), 0, 0)
    small_pool.forward(prompt)
    decode = Batch()
    decode.add_sequence([11], 10, 0)
    small_pool.forward(decode)
    small_pool.kv_truncate(0, 0)
    assert heard == [True, False]
