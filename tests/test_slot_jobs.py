"""In-process: logit_bias in the scheduler (with speculative verification), embeddings and slot files as
slot jobs on the scheduler's thread."""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specserve.engine import slot_state
from specserve.engine.local_runner import LocalRunner
from specserve.engine.logit_bias import LogitBias
from specserve.engine.sampling import Sampler, SamplingParams, choice_seed
from specserve.engine.scheduler import Scheduler
from specserve.engine.slot_results import Settler
from specserve.engine.slots import Slot
from specserve.engine.tasks import Chunk, Result, Task, TaskHandle
from specserve.errors import SpecserveError
from specserve.gguf.tokenizer import Tokenizer
from specserve.speculative.base import SpecParams
from tests.helpers import running_scheduler

GREEDY = SamplingParams(temperature=0.0)
REPEATING = "a b c d e f g h, a b c d e f g h, a b c d e f g h, a b c d e f g h, a b c"
MODEL = {"file": "smollm2", "bytes": 1}


@pytest.fixture
def sched(smollm_runner: LocalRunner, smollm_tokenizer: Tokenizer) -> Iterator[Scheduler]:
    with running_scheduler(smollm_runner, smollm_tokenizer) as s:
        yield s


@pytest.fixture
def tokenizer(smollm_tokenizer: Tokenizer) -> Tokenizer:
    return smollm_tokenizer


def run(sched: Scheduler, prompt: list[int], n_predict: int = 12, **kw: object) -> tuple[list[int], Result]:
    events: queue.Queue = queue.Queue()
    sched.submit(Task(prompt, kw.pop("sampling", GREEDY), kw.pop("spec", SpecParams(n_max=0)),  # type: ignore[arg-type]
                      n_predict=n_predict, **kw), events.put)  # type: ignore[arg-type]
    tokens: list[int] = []
    while True:
        event = events.get(timeout=120)
        if isinstance(event, Chunk):
            tokens += event.tokens
        else:
            assert isinstance(event, Result), event
            return tokens, event


# ---- logit_bias ----------------------------------------------------------------------------------


def test_a_forbidden_draft_token_is_rejected() -> None:
    """Every row's argmax is token 5, which the bias forbids: greedy verification accepts none of the draft."""
    rows = torch.zeros((3, 10))
    rows[:, 5], rows[:, 7] = 10.0, 1.0
    slot = Slot(0)
    slot.sampler = Sampler(GREEDY)
    task = Task([1], GREEDY, SpecParams(), logit_bias=LogitBias({5: -math.inf}))
    slot.handle = TaskHandle(task, lambda e: None, lambda: None)
    assert not slot.greedy_only  # no on-device argmax shortcut for a biased task
    assert Settler._choose(slot, None, rows, [5, 5]) == [7]
    assert Settler._choose(slot, None, rows, [7, 7]) == [7, 7, 7]  # allowed drafts still pass
    assert LogitBias({5: -math.inf}).to_json() == [{"token": 5, "bias": False}]


def test_bias_bans_the_greedy_token_with_and_without_speculation(sched: Scheduler, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode(REPEATING)
    plain, _ = run(sched, prompt)  # " d e f g h, a b c ..."
    banned = plain[3]
    bias = LogitBias({banned: -math.inf})
    alone, _ = run(sched, prompt, logit_bias=bias)
    assert banned not in alone and alone[:3] == plain[:3] and alone != plain
    # ngram-simple drafts the repeated text, the banned token included: every such draft must be rejected
    spec = SpecParams(type="ngram-simple", n_max=8, ngram_size_n=2, ngram_size_m=8)
    drafted, result = run(sched, prompt, spec=spec, logit_bias=bias)
    assert result.draft_n > 0
    assert drafted == alone
    boosted, _ = run(sched, prompt, n_predict=4, logit_bias=LogitBias({tokenizer.encode(" zebra")[0]: 100.0}))
    assert boosted == [tokenizer.encode(" zebra")[0]] * 4


def test_choice_seeds_differ_and_repeat() -> None:
    assert choice_seed(42, 0) == 42 and choice_seed(-1, 3) == -1
    seeds = {choice_seed(42, i) for i in range(1, 50)}
    assert len(seeds) == 49 and 42 not in seeds and choice_seed(42, 7) == choice_seed(42, 7)


# ---- embeddings ----------------------------------------------------------------------------------


def embed(sched: Scheduler, tokens: list[int], pooling: str = "mean", n_batch: int = 16) -> torch.Tensor:
    return sched.submit_job(lambda slot: slot_state.embed(sched.runner, slot, tokens, n_batch, pooling)).result(120)


def test_embedding_pools_the_normed_final_hidden_state(sched: Scheduler, tokenizer: Tokenizer) -> None:
    runner = sched.runner
    tokens = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    mean = embed(sched, tokens)
    assert mean.shape == (runner.config.hidden,)  # type: ignore[attr-defined]
    assert torch.equal(embed(sched, tokens), mean)  # same text, same vector
    assert torch.allclose(embed(sched, tokens, n_batch=512), mean, atol=1e-4)  # chunking does not matter
    other = embed(sched, tokenizer.encode("Completely different words about ships"))
    assert torch.nn.functional.cosine_similarity(mean, other, dim=0) < 0.99
    last = embed(sched, tokens, pooling="last")
    assert not torch.allclose(last, mean)
    # the last token's hidden state is what the output head turns into the next-token logits
    logits = runner.kernels.linear(last[None].to(runner.dtype), runner.weights.output,  # type: ignore[attr-defined]
                                   out_dtype=torch.float32)
    assert int(logits.argmax()) == run(sched, tokens, n_predict=1)[0][0]
    with pytest.raises(SpecserveError, match="must be 1"):
        embed(sched, [])


def test_embedding_matches_transformers(sched: Scheduler, tokenizer: Tokenizer, smollm_hf) -> None:  # noqa: ANN001
    tokens = tokenizer.encode("Embeddings are the mean of the final hidden states.")
    with torch.no_grad():
        out = smollm_hf(torch.tensor([tokens]), output_hidden_states=True)
    reference = out.hidden_states[-1][0].mean(dim=0)  # after the final norm, as ours
    ours = embed(sched, tokens)
    assert torch.nn.functional.cosine_similarity(ours, reference, dim=0) > 0.999


# ---- slot files ----------------------------------------------------------------------------------


def test_save_restore_round_trip_continues_alike(sched: Scheduler, tokenizer: Tokenizer, tmp_path: Path) -> None:
    prompt = tokenizer.encode("Once upon a time, in a land far away, there lived a")
    first, r1 = run(sched, prompt)
    slot_id = r1.slot
    path = tmp_path / "s.bin"
    n_saved, n_bytes = sched.submit_job(lambda s: slot_state.save(sched.runner, s, path, MODEL), slot_id).result(60)
    assert n_saved == len(prompt) + len(first) - 1 and n_bytes == path.stat().st_size > 0
    for sid in range(len(sched.slots)):  # every slot forgets it, so only the restored cache can serve the prompt
        sched.submit_job(lambda s: slot_state.erase(sched.runner, s), sid).result(60)
    assert all(not s.cache for s in sched.slots)
    other = (slot_id + 1) % len(sched.slots)
    n_restored, _ = sched.submit_job(lambda s: slot_state.restore(sched.runner, s, path, MODEL), other).result(60)
    assert n_restored == n_saved and sched.slots[other].cache[:len(prompt)] == prompt
    again, r2 = run(sched, prompt)
    assert r2.slot == other and r2.n_cached == len(prompt) - 1  # the restored K/V serve the prompt
    assert again == first
    with pytest.raises(SpecserveError, match="another model"):
        sched.submit_job(lambda s: slot_state.restore(sched.runner, s, path, {"file": "x"}), 0).result(60)
    path.write_bytes(b"not a slot file")
    with pytest.raises(SpecserveError, match="not a slot save file"):
        sched.submit_job(lambda s: slot_state.restore(sched.runner, s, path, MODEL), 0).result(60)
    with pytest.raises(SpecserveError, match="Invalid slot ID"):
        sched.submit_job(lambda s: None, 7)


def test_a_busy_slots_job_waits_until_it_is_idle(sched: Scheduler, tokenizer: Tokenizer) -> None:
    events: queue.Queue = queue.Queue()
    # (far more tokens than 0.3 s decodes on a fast CPU: the slot must still be busy when the wait ends)
    handle = sched.submit(Task(tokenizer.encode("Count: 1, 2, 3,"), GREEDY, SpecParams(n_max=0), n_predict=600),
                          events.put)
    while not isinstance(events.get(timeout=60), Chunk):  # generating now
        pass
    slot_id = next(s.id for s in sched.slots if s.handle is handle)
    ran = threading.Event()
    future = sched.submit_job(lambda s: (ran.set(), s.handle is None)[1], slot_id)
    assert not ran.wait(0.3)
    handle.cancel()
    assert future.result(60) is True
