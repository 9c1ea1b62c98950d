"""Batched multi-sequence forward and KV-cache editing give the logits of the plain path."""

from __future__ import annotations

import pytest
import torch

from specserve.errors import SpecserveError
from specserve.model.batch import Batch
from specserve.model.kv_blocks import content_hashes
from tests.helpers import prefill

SEQS = [
    [1, 504, 3458, 314, 4234, 28, 9175, 30],
    [1, 2193, 253, 655, 28],
    [1, 17, 28, 198, 1209, 6012, 1008, 442, 253, 1616, 3112, 30],
]


def alone(runner, tokens: list[int]) -> torch.Tensor:
    runner.kv_truncate(0, 0)
    batch = Batch()
    batch.add_sequence(tokens, 0, 0, "all")
    return runner.forward(batch)


def test_batched_sequences_match_single(smollm_runner) -> None:
    refs = [alone(smollm_runner, s) for s in SEQS]
    batch = Batch()
    for seq, tokens in enumerate(SEQS):
        smollm_runner.kv_truncate(seq, 0)
        batch.add_sequence(tokens, 0, seq, "all")
    logits = smollm_runner.forward(batch)
    offset = 0
    for tokens, ref in zip(SEQS, refs, strict=True):
        got = logits[offset:offset + len(tokens)]
        offset += len(tokens)
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), (got - ref).abs().max()


def test_mixed_prefill_and_decode_rows(smollm_runner) -> None:
    """One sequence decoding while another reads its prompt, in one forward."""
    a, b = SEQS[0], SEQS[2]
    ref_a = alone(smollm_runner, a)[-1]
    ref_b = alone(smollm_runner, b)[-1]
    smollm_runner.kv_truncate(1, 0)
    prefill(smollm_runner, 1, a[:-1], n_batch=64)
    smollm_runner.kv_truncate(2, 0)
    batch = Batch()
    batch.add(a[-1], len(a) - 1, 1, logits=True)
    batch.add_sequence(b, 0, 2, "last")
    logits = smollm_runner.forward(batch)
    assert torch.allclose(logits[0], ref_a, rtol=1e-4, atol=1e-4)
    assert torch.allclose(logits[1], ref_b, rtol=1e-4, atol=1e-4)


def test_truncate_and_reevaluate(smollm_runner) -> None:
    tokens = SEQS[2]
    ref = alone(smollm_runner, tokens)
    for k in (1, 3, 5):
        smollm_runner.kv_truncate(0, len(tokens) - k)
        batch = Batch()
        batch.add_sequence(tokens[-k:], len(tokens) - k, 0, "all")
        again = smollm_runner.forward(batch)
        assert torch.allclose(again, ref[-k:], rtol=1e-4, atol=1e-4)


def test_truncate_then_different_tokens_forgets_old_ones(smollm_runner) -> None:
    """Rejected draft positions leave no trace: overwrite with other tokens, compare."""
    base = SEQS[0]
    alone(smollm_runner, base + [555, 666, 777])
    smollm_runner.kv_truncate(0, len(base))
    batch = Batch()
    batch.add_sequence([888, 999], len(base), 0, "all")
    got = smollm_runner.forward(batch)
    ref = alone(smollm_runner, base + [888, 999])[-2:]
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_kv_cache_and_attach(smollm_runner) -> None:
    """Another sequence takes the cached full blocks of a prompt's start and reads only the rest: the same logits."""
    tokens = (SEQS[1] * 8)[:40]
    ref = alone(smollm_runner, tokens + [42])[-1]
    smollm_runner.kv_truncate(0, len(tokens))
    names = content_hashes(tokens)
    smollm_runner.kv_cache(0, names)
    assert smollm_runner.kv_attach(3, names + content_hashes(tokens + [1] * 16)[len(names):]) == 32
    batch = Batch()
    batch.add_sequence(tokens[32:] + [42], 32, 3, "last")
    assert torch.allclose(smollm_runner.forward(batch)[0], ref, rtol=1e-4, atol=1e-4)
    assert smollm_runner.seq_len[0] == len(tokens)  # (the holder is unchanged)


def test_launch_argmax_and_fed_tokens_and_checks(smollm_runner) -> None:
    """launch() gives each row's argmax as forward()'s logits pick it; a row fed from the previous step's
    argmax computes what the same token given by the host computes; a bad step is a SpecserveError that
    leaves the cache as it was."""
    prompt = [1, 5, 9, 14, 3, 7]
    smollm_runner.kv_truncate(0, 0)
    b = Batch()
    b.add_sequence(prompt, 0, 0, "none")
    smollm_runner.forward(b)
    step = Batch()
    step.add_sequence([4, 8, 15], len(prompt), 0, "all")
    logits = smollm_runner.forward(step)
    expected = logits.argmax(dim=-1).tolist()
    host_next = Batch()
    host_next.add(expected[-1], len(prompt) + 3, 0, logits=True)
    reference = smollm_runner.forward(host_next)[0].clone()
    smollm_runner.kv_truncate(0, len(prompt))
    assert smollm_runner.launch(step).tokens() == expected
    fed_next = Batch()
    fed_next.add(0, len(prompt) + 3, 0, logits=True)  # token 0 is a placeholder: row 2's argmax is fed
    assert torch.equal(smollm_runner.launch(fed_next, fed=[2]).logits()[0], reference)
    smollm_runner.kv_truncate(0, len(prompt) + 3)
    for seq, tokens, position in ((0, [4], len(prompt) + 5), (0, [smollm_runner.vocab_size], 2), (0, [-1], 2),
                                  (smollm_runner.n_seqs, [4], 0),
                                  (0, [4] * (smollm_runner.n_ctx - len(prompt) - 2), len(prompt) + 3)):  # past n_ctx
        bad = Batch()
        bad.add_sequence(tokens, position, seq, "all")
        with pytest.raises(SpecserveError):
            smollm_runner.launch(bad)
        assert smollm_runner.seq_len[0] == len(prompt) + 3
    with pytest.raises(SpecserveError):
        smollm_runner.launch(Batch())
    with pytest.raises(SpecserveError):  # fed rows must name rows of the step before
        smollm_runner.launch(host_next, fed=[5])
