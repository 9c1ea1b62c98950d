"""Tensor parallelism on CPU (gloo): 2 and 4 ranks against one process, commands, and the followers' ends.

Logits. Each rank sums its part of a row-parallel product (attention's output, the feed-forward's down) and
the all-reduce adds the parts: an order of fp32 additions one process never takes, so the logits differ in
the last bits, and the differences grow through the layers. One process differs from itself as much: the
prompt below evaluated at once or token by token gives last-position logits 2.9e-5 apart on smollm2 (and on
qwen2.5-coder-0.5b, 1 thread against 2 differs by 1.6e-5), and its fp32 logits are 3.2e-5 from fp64's; two
ranks are 3.1e-5 from one process and 2.5e-5 from fp64. A flat 1e-5 is below fp32's own noise here, so the
check is against that noise, measured in the test: the ranks may differ from one process by at most twice
as much as one process differs from itself (prompt at once vs token by token), and 1e-5 always passes.
With one rank the path is bit for bit one process's (every other cut, column-parallel products and the
vocabulary-parallel embedding and logits, changes no sum).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch

from specserve import catalog
from specserve.cli.session import GenerationSession
from specserve.engine.local_runner import LocalRunner
from specserve.engine.sampling import SamplingParams
from specserve.engine.tp_runner import TensorParallelRunner, start_tensor_parallel
from specserve.errors import SpecserveError
from specserve.gguf.tokenizer import Tokenizer
from specserve.kernels import settings as kernel_settings
from specserve.kernels.quant_weight import QuantWeight
from specserve.model.batch import Batch
from specserve.model.config import ModelConfig
from specserve.model.kv_blocks import content_hashes
from specserve.model.tp_layout import ShardLayout, check_tensor_parallel
from specserve.speculative.base import SpecParams
from tests.server_utils import REPO, ServerProcess

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
N_CTX = 256
# What the device docs ask to keep set (NVLink multicast off): the followers must see them unchanged.
KEPT_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def config(n_heads: int, n_kv: int, hidden: int = 576, ffn: int = 1536, vocab: int = 49152) -> ModelConfig:
    return ModelConfig(arch="llama", n_layers=2, hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv,
                       head_dim=hidden // n_heads, ffn=ffn, vocab_size=vocab, context_length=2048, rope_base=1e4,
                       rope_dim=hidden // n_heads, rope_style="neox", rope_scale=1.0, rms_eps=1e-5,
                       tied_embeddings=True, qkv_bias=False, qk_norm=False)


@pytest.mark.parametrize("n_heads,n_kv", [(9, 3), (14, 2), (16, 8), (32, 8), (12, 12), (8, 1)])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_layout_covers_heads_ffn_vocab(n_heads: int, n_kv: int, world: int) -> None:
    cfg = config(n_heads, n_kv, hidden=64 * n_heads, ffn=1000, vocab=1001)
    if world > n_heads:
        with pytest.raises(SpecserveError, match=f"at most {n_heads} ranks"):
            ShardLayout.plan(cfg, 0, world)
        return
    layouts = [ShardLayout.plan(cfg, r, world) for r in range(world)]
    assert [h for lay in layouts for h in lay.q_heads] == list(range(n_heads))
    assert max(len(lay.q_heads) for lay in layouts) - min(len(lay.q_heads) for lay in layouts) <= 1
    assert [u for lay in layouts for u in lay.ffn] == list(range(1000))
    assert [t for lay in layouts for t in lay.vocab] == list(range(1001))
    group = n_heads // n_kv
    for lay in layouts:
        local = lay.local_config
        assert local.n_heads % local.n_kv_heads == 0
        g = local.n_heads // local.n_kv_heads
        # local query head j reads local KV head j // g, which must hold the global KV head of its query head
        assert all(lay.kv_heads[j // g] == h // group for j, h in enumerate(lay.q_heads))
        if n_kv % world == 0:  # the common case: each rank its own KV heads, no copies
            assert len(set(lay.kv_heads)) == len(lay.kv_heads) == n_kv // world


def test_layout_of_the_catalog_models() -> None:
    """The rule as the docs state it for the must-show models."""
    qwen = config(14, 2, hidden=896, ffn=4864, vocab=151936)
    assert [ShardLayout.plan(qwen, r, 4).kv_heads for r in range(4)] == [(0,), (0, 0, 0, 1), (1,), (1,)]
    assert [ShardLayout.plan(qwen, r, 2).kv_heads for r in range(2)] == [(0,), (1,)]
    smol = config(9, 3)
    assert [ShardLayout.plan(smol, r, 2).kv_heads for r in range(2)] == [(0, 0, 0, 1, 1), (1, 2, 2, 2)]
    assert [len(ShardLayout.plan(smol, r, 4).q_heads) for r in range(4)] == [3, 2, 2, 2]


def test_refusals(smollm_path: Path) -> None:
    with pytest.raises(SpecserveError, match="unknown weight format"):
        start_tensor_parallel(smollm_path, 2, weight_format="q5")
    with pytest.raises(SpecserveError, match="at most 9 ranks"):
        start_tensor_parallel(smollm_path, 10, device="cpu")
    moe = replace(config(8, 2), arch="qwen2moe")
    with pytest.raises(SpecserveError, match="mixture-of-experts"):
        check_tensor_parallel(moe, 2, {"blk.0.ffn_gate_exps.weight"})


def greedy_text(runner: LocalRunner, n: int, spec: SpecParams | None = None) -> str:
    session = GenerationSession(runner, Tokenizer.from_gguf(runner.gguf), SamplingParams(temperature=0.0),
                                spec or SpecParams())
    out = io.StringIO()
    session.run(PROMPT, n_predict=n, out=out)
    return out.getvalue().removesuffix("\n")  # (the session ends its output with a newline)


def last_logits(runner: LocalRunner, tokens: list[int], seq: int = 0) -> torch.Tensor:
    runner.kv_truncate(seq, 0)
    batch = Batch()
    batch.add_sequence(tokens, 0, seq, "last")
    return runner.forward(batch)[0]


def one_process_noise(ref: LocalRunner, tokens: list[int]) -> float:
    """How far one process's last-position logits move between evaluating the prompt at once and token by
    token (the module docstring says why this is the yardstick)."""
    at_once = last_logits(ref, tokens)
    ref.kv_truncate(0, 0)
    for i, t in enumerate(tokens):
        batch = Batch()
        batch.add(t, i, 0, logits=i == len(tokens) - 1)
        one_by_one = ref.forward(batch)
    return (at_once - one_by_one[0]).abs().max().item()


def assert_logits_close(tp: torch.Tensor, ref: torch.Tensor, noise: float) -> None:
    diff = (tp - ref).abs().max().item()
    print(f"max |logit diff| {diff:.3g} (one process against itself: {noise:.3g}; max |logit| "
          f"{ref.abs().max().item():.3g})")
    assert diff <= max(1e-5, 2 * noise)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def followers_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(running(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def reference(smollm_path: Path) -> LocalRunner:
    return LocalRunner(smollm_path, n_seqs=2, n_ctx=N_CTX, device="cpu", progress=False, weight_format="float")


@pytest.fixture(scope="module")
def tp2(smollm_path: Path) -> Iterator[TensorParallelRunner]:
    with pytest.MonkeyPatch.context() as mp:
        for k, v in KEPT_ENV.items():
            mp.setenv(k, v)
        runner = start_tensor_parallel(smollm_path, 2, n_seqs=2, n_ctx=N_CTX, device="cpu", progress=False,
                                       weight_format="float")
    yield runner
    runner.close()


def test_one_rank_is_one_process_bit_for_bit(smollm_path: Path, reference: LocalRunner) -> None:
    runner = start_tensor_parallel(smollm_path, 1, n_ctx=N_CTX, device="cpu", progress=False, weight_format="float")
    try:
        tokens = Tokenizer.from_gguf(reference.gguf).encode(PROMPT, add_special=True, parse_special=True)
        assert torch.equal(last_logits(runner, tokens), last_logits(reference, tokens))
    finally:
        runner.close()


def test_two_ranks_match_one_process(tp2: TensorParallelRunner, reference: LocalRunner) -> None:
    tokens = Tokenizer.from_gguf(reference.gguf).encode(PROMPT, add_special=True, parse_special=True)
    noise = one_process_noise(reference, tokens)
    assert_logits_close(last_logits(tp2, tokens), last_logits(reference, tokens), noise)
    assert greedy_text(tp2, 12) == greedy_text(reference, 12)


def test_speculation_truncates_in_step(tp2: TensorParallelRunner, reference: LocalRunner) -> None:
    """Drafts that are rejected truncate the KV of every rank alike (the text stays the one-process text)."""
    spec = SpecParams(type="ngram-simple", ngram_size_n=2, n_max=4)
    assert greedy_text(tp2, 12, spec) == greedy_text(reference, 12, spec)


def test_commands_fed_cache_attach_truncate(tp2: TensorParallelRunner, reference: LocalRunner) -> None:
    tokens = [1, 504, 3458, 282, 4849, 314, 7042, 30] * 3
    noise = one_process_noise(reference, tokens)
    outs = []
    for r in (tp2, reference):
        last_logits(r, tokens[:22], seq=0)
        names = content_hashes(tokens[:22])
        r.kv_cache(0, names)
        assert r.kv_attach(1, names) == 16
        r.kv_truncate(1, 12)  # into the shared block: sequence 1's write copies it first
        first = Batch()
        first.add_sequence(tokens[12:22], 12, 1, "last")
        step = r.launch(first)
        fed = Batch()
        fed.add(0, 22, 1, logits=True)  # its token: the argmax of row 9 of the step before, taken on the device
        outs.append((step.tokens(), r.launch(fed, fed=[9]).logits()[0].clone(), list(r.seq_len)))
    (tok_tp, logits_tp, len_tp), (tok_ref, logits_ref, len_ref) = outs
    assert tok_tp == tok_ref and len_tp == len_ref == [22, 23]
    assert_logits_close(logits_tp, logits_ref, noise)


def test_bad_batch_is_refused_before_any_rank_runs_it(tp2: TensorParallelRunner, reference: LocalRunner) -> None:
    bad = Batch()
    bad.add(5, 100, 0, logits=True)  # a gap after the cache's end
    with pytest.raises(SpecserveError, match="without gaps"):
        tp2.launch(bad)
    with pytest.raises(SpecserveError, match="out of range"):
        tp2.kv_truncate(7, 0)
    tokens = [1, 504, 3458, 282]
    noise = one_process_noise(reference, tokens)
    assert_logits_close(last_logits(tp2, tokens), last_logits(reference, tokens), noise)  # still in step


def test_followers_keep_the_environment(tp2: TensorParallelRunner) -> None:
    for p in tp2.group.followers:
        env = psutil.Process(p.pid).environ()
        assert {k: env.get(k) for k in KEPT_ENV} == KEPT_ENV
        assert env.get("OMP_WAIT_POLICY") == "PASSIVE"


def test_rank0_fails_cleanly_when_a_follower_dies(tp2: TensorParallelRunner) -> None:
    """(The last test on tp2.) A follower gone: rank 0 says which, on that call and every later one, and
    closes without waiting on it."""
    follower = tp2.group.followers[0]
    follower.kill()
    follower.wait()
    batch = Batch()
    batch.add_sequence([1, 2, 3], 0, 0, "last")
    with pytest.raises(SpecserveError, match=r"rank 1 \(exit code -9\) ended"):
        tp2.forward(batch)
    with pytest.raises(SpecserveError, match="rank 1"):
        tp2.kv_truncate(0, 0)
    t0 = time.monotonic()
    tp2.close()
    assert time.monotonic() - t0 < 10
    with pytest.raises(SpecserveError, match="closed"):
        tp2.forward(batch)


RANK0_THAT_DIES = textwrap.dedent("""
    import os, signal
    from specserve.engine.tp_launch import start_rank0
    group = start_rank0(2, "cpu")  # the follower now waits for rank 0's first message (the model to load)
    print(" ".join(str(p.pid) for p in group.followers), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no STOP: the follower must notice by itself
""")


def test_followers_end_when_rank0_is_killed() -> None:
    proc = subprocess.run([sys.executable, "-c", RANK0_THAT_DIES], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1
    assert followers_gone(pids, timeout=20), f"followers {pids} still running"


def test_server_with_two_ranks(smollm_path: Path, reference: LocalRunner) -> None:
    """A completion from `specserve serve --tensor-parallel 2` is the one-process completion; stopping the
    server ends its follower."""
    server = ServerProcess("-m", str(smollm_path), "--tensor-parallel", "2", "--device", "cpu", "-np", "1",
                           "-c", str(N_CTX)).wait_ready()
    try:
        # (the follower is a child of the engine core's process, itself a child of the server's)
        followers = [c.pid for c in psutil.Process(server.proc.pid).children(recursive=True)
                     if "specserve.engine.tp_worker" in " ".join(c.cmdline())]
        assert len(followers) == 1
        got = server.complete(PROMPT, n_predict=12)["content"]
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log()
    assert followers_gone(followers, timeout=15)
    assert "tensor-parallel rank 1:" not in server.log()  # (what a follower prints when it ends on an error)
    assert got == greedy_text(reference, 12)


@pytest.mark.parametrize("exact", [True, False])
def test_packed_ranks_keep_the_weight_format(smollm_path: Path, reference: LocalRunner,
                                            monkeypatch: pytest.MonkeyPatch, exact: bool) -> None:
    """The default weight format (packed on this CPU) is what each rank holds. With the exact products
    (SPECSERVE_CPU_EXACT=1, which the followers inherit) two ranks' logits are one process's within fp32's noise
    (the module docstring's yardstick, measured on the float reference: the exact packed products are
    batch-invariant, so one packed process never differs from itself): the cuts are right. With the int8
    products (the default) they write one process's text, but their logits move by the int8 rounding itself
    (1.09 where int8 and exact products are 0.63 apart here): a partial sum's last bit moves an activation across
    a rounding step in the next layer."""
    monkeypatch.setenv("SPECSERVE_CPU_EXACT", "1" if exact else "0")
    kernel_settings.reload()
    one = LocalRunner(smollm_path, n_seqs=1, n_ctx=N_CTX, device="cpu", progress=False, weight_format="gguf")
    runner = start_tensor_parallel(smollm_path, 2, n_ctx=N_CTX, device="cpu", progress=False)
    try:
        assert runner.weight_format == one.weight_format == "gguf"
        for layer in runner.model.layers:
            qkv, out, ffn = layer.ops()
            assert all(isinstance(w, QuantWeight) for w in (qkv.w, out.w, ffn.w_gate_up, ffn.w_down))
        assert isinstance(runner.model.head.head.w, QuantWeight) and runner.model.whole_layers is None
        tokens = Tokenizer.from_gguf(one.gguf).encode(PROMPT, add_special=True, parse_special=True)
        if exact:
            noise = one_process_noise(reference, tokens)
            assert_logits_close(last_logits(runner, tokens), last_logits(one, tokens), noise)
        assert greedy_text(runner, 16) == greedy_text(one, 16)
    finally:
        runner.close()
        monkeypatch.delenv("SPECSERVE_CPU_EXACT")
        kernel_settings.reload()


SLOW_CASES = [("smollm2-135m", 4), ("qwen2.5-coder-0.5b", 2), ("qwen2.5-coder-0.5b", 4)]


@pytest.fixture(scope="module")
def qwen_reference() -> LocalRunner:
    return LocalRunner(catalog.resolve("qwen2.5-coder-0.5b"), n_seqs=1, n_ctx=N_CTX, device="cpu", progress=False,
                       weight_format="float")


@pytest.mark.slow
@pytest.mark.parametrize("model,world", SLOW_CASES)
def test_ranks_match_one_process_slow(model: str, world: int, request: pytest.FixtureRequest) -> None:
    ref = request.getfixturevalue("reference" if model == "smollm2-135m" else "qwen_reference")
    runner = start_tensor_parallel(catalog.resolve(model), world, n_ctx=N_CTX, device="cpu", progress=False,
                                   weight_format="float")
    try:
        followers = list(runner.group.followers)
        tokens = Tokenizer.from_gguf(ref.gguf).encode(PROMPT, add_special=True, parse_special=True)
        noise = one_process_noise(ref, tokens)
        print(f"{model} x{world}:", end=" ")
        assert_logits_close(last_logits(runner, tokens), last_logits(ref, tokens), noise)
        assert greedy_text(runner, 16) == greedy_text(ref, 16)
    finally:
        runner.close()
    assert [p.returncode for p in followers] == [0] * (world - 1)


def test_no_follower_left() -> None:
    """(Last: every runner above is closed; no tp_worker child of this process remains.)"""
    def cmdline(child: psutil.Process) -> str:
        try:
            return " ".join(child.cmdline())
        except (psutil.ZombieProcess, psutil.NoSuchProcess):  # (an ended child: no follower)
            return ""

    workers = [c.pid for c in psutil.Process(os.getpid()).children(recursive=True)
               if "specserve.engine.tp_worker" in cmdline(c)]
    assert not [p for p in workers if running(p)]


@pytest.mark.slow
def test_torchrun_generate(smollm_path: Path, reference: LocalRunner) -> None:
    """torchrun's rendezvous (one node, standalone): rank 0 runs `generate`, rank 1 follows it."""
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "specserve.cli", "generate",
                           "-m", str(smollm_path), "-p", PROMPT, "-n", "12", "--temp", "0", "--device", "cpu",
                           "-c", str(N_CTX), "-tp", "2", "--weight-format", "float"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.removesuffix("\n") == greedy_text(reference, 12)
