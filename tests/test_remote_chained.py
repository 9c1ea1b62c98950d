"""Chained drafts (more busy slots than the draft gate weighs) through a remote host: the step after a drafted one
is fed from the draft's last row on the host, and the texts stay plain greedy's."""

from __future__ import annotations

from pathlib import Path

from specserve.engine.generate import generate
from specserve.engine.local_runner import LocalRunner
from specserve.engine.scheduler import Scheduler
from specserve.engine.tasks import Result
from specserve.gguf.tokenizer import Tokenizer
from specserve.remote.client import RemoteRunner
from specserve.speculative.base import SpecParams
from specserve.speculative.factory import build_chain
from tests.helpers import submit, wait
from tests.remote_utils import host_thread

N = 10  # past draft_gate.MAX_DRAFTING_SLOTS


def load(model: str, n_seqs: int, n_ctx: int, kv_size: int, weight_format: str, device: str):
    from specserve.cli.remote_host import load_runner

    return load_runner(model, n_seqs, n_ctx, kv_size, weight_format, "cpu")


def test_chained_drafts_through_a_remote_host(tmp_path: Path, smollm_path: Path) -> None:
    local = LocalRunner(smollm_path, n_seqs=1, n_ctx=160, device="cpu", progress=False)
    tok = Tokenizer.from_gguf(local.gguf)
    prompts = [f"def g{i}(x):\n    return x * {i} + 1\n\ndef g{i}(x):\n    return x * {i} + 1\n\ndef g{i}(x"
               for i in range(N)]
    factory = lambda s, slot: build_chain(s, None, seq=slot)  # noqa: E731
    expected = [tok.decode(generate(local, tok, tok.encode(p), 24, chain_factory=factory).tokens) for p in prompts]
    with host_thread(f"unix:{tmp_path / 'h.sock'}", load) as address:
        remote = RemoteRunner(address, str(smollm_path), n_seqs=N, n_ctx=160)
        sched = Scheduler(remote, tok, n_batch=64, chain_factory=factory)
        sched.start()
        try:
            pending = [submit(sched, tok, p, n_predict=24, spec=SpecParams(type="ngram-suffix")) for p in prompts]
            results = [wait(events) for _, events in pending]
            assert all(isinstance(r, Result) for _, r in results)
            assert [t for t, _ in results] == expected
            assert sched.counters_snapshot().spec_accepted > 0
        finally:
            sched.shutdown()
            remote.close()
