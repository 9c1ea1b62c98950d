"""The host prompt cache (engine/host_cache.py, --cache-ram): caches the KV pool gives up are kept in host memory
and read back for a prompt that starts with them, with the text plain greedy gives; its bookkeeping on its own."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.host_cache import HostCache
from specserve.engine.local_runner import LocalRunner
from specserve.engine.scheduler import Scheduler
from specserve.engine.tasks import KVKey
from tests.helpers import submit, wait

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima",
         "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey",
         "xray", "yankee", "zulu"]


def _text(seed: int, n: int = 90) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(n))


def _run(runner: LocalRunner, tokenizer, prompts: list[str], host_bytes: int) -> tuple[list, Scheduler]:
    """Each prompt in turn on one slot: (text, Result) of each, and the scheduler."""
    sched = Scheduler(runner, tokenizer, n_batch=64, n_slots=1, host_cache_bytes=host_bytes)
    sched.start()
    try:
        return [wait(submit(sched, tokenizer, p, n_predict=8)[1]) for p in prompts], sched
    finally:
        sched.shutdown()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_a_prompt_the_pool_gave_up_is_read_back_from_host_memory(smollm_path, smollm_tokenizer, device) -> None:
    # A pool of 160 positions: the third prompt makes the pool give up the first's cache.
    runner = LocalRunner(smollm_path, n_seqs=2, n_ctx=160, kv_size=160, device=device, progress=False)
    first, second, third = _text(1, 45), _text(2, 45), _text(3, 70)
    again = first + " and then some more words"
    prompts = [first, second, third, again]
    with_host, sched = _run(runner, smollm_tokenizer, prompts, -1)
    c = sched.counters_snapshot()
    assert c.host_cache_kept >= 1 and c.host_cache_bytes > 0
    result = with_host[3][1]
    n_first = len(smollm_tokenizer.encode(first))
    assert result.n_cached >= n_first - 1 and c.prompt_tokens_host >= n_first - 16
    fresh = LocalRunner(smollm_path, n_seqs=2, n_ctx=160, kv_size=160, device=device, progress=False)
    without, plain = _run(fresh, smollm_tokenizer, prompts, 0)
    assert plain.counters_snapshot().prompt_tokens_host == 0 and without[3][1].n_cached < n_first / 2
    assert [text for text, _ in with_host] == [text for text, _ in without]


KEY: KVKey = ((), "")  # no LoRA adapter, no cache salt


def test_host_cache_entries() -> None:
    kv = torch.zeros(2, 2, 1, 20, 4)  # 1280 bytes of fp32 for 20 tokens
    cache = HostCache(limit_bytes=3 * 1280)
    a, b, c = list(range(20)), list(range(100, 120)), list(range(200, 220))
    assert cache.keep(a, KEY, lambda: kv) and cache.keep(b, KEY, lambda: kv) and cache.keep(c, KEY, lambda: kv)
    assert not cache.keep(a[:18], KEY, lambda: kv)  # held already
    assert not cache.keep(a[:8], KEY, lambda: kv)  # too short to keep
    assert cache.best(a + [7], KEY) == (20, cache.best(a, KEY)[1])
    assert cache.best(a, ((1.0,), "")) == cache.best(a, ((), "tenant/")) == (0, None)  # other scales, another salt
    assert cache.keep(list(range(300, 320)), KEY, lambda: kv)  # over the limit: b (least recently used) goes
    assert cache.best(b, KEY)[0] == 0 and cache.best(c, KEY)[0] == 20 and len(cache) == 3
    longer = torch.zeros(2, 2, 1, 25, 4)
    assert cache.keep(a + [1, 2, 3, 4, 5], KEY, lambda: longer)  # it extends a: a's entry goes, and for room the
    assert len(cache) == 2 and cache.bytes == 1280 + 1600  # least recently used (300..319; c was just read)
    assert cache.best(c, KEY)[0] == 20 and cache.best(a, KEY)[0] == 20
    assert not HostCache(100).keep(a, KEY, lambda: kv)  # larger than the whole limit
