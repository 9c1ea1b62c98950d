"""Draft-model vocabulary check and the draft speculator's cache reuse."""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest

from specserve.errors import SpecserveError
from specserve.gguf.vocab_check import check_vocab_compatible
from specserve.speculative.draft_model import DraftModelSpeculator


@pytest.fixture(scope="module")
def metadata(smollm_runner) -> dict:
    return smollm_runner.gguf.metadata


def test_same_vocabulary_is_accepted(metadata) -> None:
    check_vocab_compatible(metadata, copy.deepcopy(metadata))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.__setitem__("tokenizer.ggml.model", "llama"), "tokenizer type"),
        (lambda m: m.__setitem__("tokenizer.ggml.bos_token_id", 7), "bos_token_id"),
        (lambda m: m.__setitem__("tokenizer.ggml.tokens", m["tokenizer.ggml.tokens"][:-200]), "vocabulary sizes"),
        (lambda m: m["tokenizer.ggml.tokens"].__setitem__(100, "something else"), "token 100"),
    ],
)
def test_incompatible_draft_is_refused(metadata, edit, message: str) -> None:
    other = copy.deepcopy(metadata)
    edit(other)
    with pytest.raises(SpecserveError, match=message):
        check_vocab_compatible(metadata, other)


def test_small_size_difference_and_early_tokens_are_tolerated(metadata) -> None:
    """llama.cpp allows vocab sizes within 128 and ignores token texts below id 5: the edges exactly."""
    other = copy.deepcopy(metadata)
    other["tokenizer.ggml.tokens"] = other["tokenizer.ggml.tokens"][:-128]
    other["tokenizer.ggml.tokens"][4] = "<changed>"
    check_vocab_compatible(metadata, other)
    too_short = copy.deepcopy(other)
    too_short["tokenizer.ggml.tokens"] = too_short["tokenizer.ggml.tokens"][:-1]
    with pytest.raises(SpecserveError, match="vocabulary sizes"):
        check_vocab_compatible(metadata, too_short)
    other["tokenizer.ggml.tokens"][5] = "<changed>"
    with pytest.raises(SpecserveError, match="token 5"):
        check_vocab_compatible(metadata, other)


def test_draft_cache_is_reused(smollm_path) -> None:
    from specserve.engine.local_runner import LocalRunner

    runner = LocalRunner(smollm_path, n_ctx=256, device="cpu", progress=False)
    calls = []
    forward = runner.forward
    runner.forward = lambda batch: (calls.append(len(batch)), forward(batch))[1]  # type: ignore[method-assign]
    spec = DraftModelSpeculator(runner, p_min=0.0)
    history = [1, 504, 3458, 314, 4234, 28, 9175, 30]
    spec.begin(history)
    first = spec.draft(history[:-1], history[-1], n_max=3)
    assert len(first) == 3 and calls[0] == len(history)
    calls.clear()
    # The draft evaluated its first two tokens while drafting the third. With both accepted
    # and a new sampled token, only that token is new to the draft's cache: one row.
    spec.accept(2)
    second = spec.draft(history + first[:2], 42, n_max=2)
    assert len(second) == 2
    assert calls[0] == 1, calls
    # A rejection rolls the draft's cache back to the common prefix: again one new row.
    calls.clear()
    spec.accept(0)
    spec.draft(history + first[:2] + [42], 43, n_max=1)
    assert calls == [1], calls


def test_generate_prints_spec_statistics(smollm_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "specserve.cli", "generate", "-m", str(smollm_path), "--temp", "0", "-n", "24",
         "-p", "a b c d a b c d a b c d a b c d a b c", "--spec-type", "ngram-simple",
         "--spec-ngram-size-n", "3", "--spec-ngram-size-m", "4", "-md", str(smollm_path), "--draft-max", "4"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    err = result.stderr
    assert re.search(r"draft acceptance rate = [01]\.\d{5} \( *\d+ accepted / *\d+ generated\)", err), err
    for name in ("ngram_simple", "draft"):
        assert re.search(rf"statistics {name}: #calls = \d+, #gen drafts = \d+, #acc drafts = \d+, "
                         rf"#gen tokens = \d+, #acc tokens = \d+", err), err
    assert re.search(r"^\s*prompt eval time", err, re.M) and re.search(r"^\s+eval time", err, re.M), err


def test_drafting_together_gives_each_its_own_draft(smollm_path) -> None:
    """draft_together: several sequences' drafts in shared forwards (one per draft token) equal each drafted
    alone (the CPU kernels give a row the same bits in any batch), drafts of different lengths included."""
    from specserve.engine.local_runner import LocalRunner
    from specserve.speculative.draft_model import draft_together

    runner = LocalRunner(smollm_path, n_seqs=3, n_ctx=256, device="cpu", progress=False)
    histories = [[1, 504, 3458, 314, 4234, 28], [1, 1040, 282, 2114, 314], [1, 504, 3458, 314, 4234, 28, 9175]]
    specs = [DraftModelSpeculator(runner, p_min=0.3, seq=i) for i in range(3)]
    alone = [spec.draft(h[:-1], h[-1], n_max=6) for spec, h in zip(specs, histories, strict=True)]
    for spec in specs:  # start over: empty caches
        runner.kv_truncate(spec.seq, 0)
        spec.cached = []
    calls = []
    forward = runner.forward
    runner.forward = lambda batch: (calls.append(len(set(batch.seq_ids))), forward(batch))[1]  # type: ignore[method-assign]
    together = draft_together([(spec, h[:-1], h[-1], 6) for spec, h in zip(specs, histories, strict=True)])
    assert together == alone and len({len(d) for d in alone}) > 1, alone
    longest = max(len(d) for d in alone)  # one forward to catch up, then one per token drafted past the first,
    assert calls[0] == 3 and len(calls) == longest + (longest < 6)  # and one more where p_min ended the longest
