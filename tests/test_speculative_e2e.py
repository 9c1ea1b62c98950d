"""Speculative decoding end to end on smollm2-135m: identical output, fewer target passes.

Every type must reproduce plain greedy decoding token for token; the draft-free types must
also accept drafted tokens on a code-edit prompt and so need fewer target forward passes
than tokens generated. With a fixed seed at temperature > 0 the text is identical too (the
sampler's randomness is tied to the position, not to how many passes produced it).
"""

from __future__ import annotations

import pytest

from specserve.engine.generate import Generation, generate
from specserve.engine.local_runner import LocalRunner
from specserve.engine.sampling import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.gguf.chat_template import apply_chat_template
from specserve.gguf.tokenizer import Tokenizer
from specserve.speculative.base import SpecParams
from specserve.speculative.factory import build_chain

N_PREDICT = 64
# A code edit of our own (the tests do not depend on the benchmark workloads beside the checkout):
# a small model copies most of the code back, which is what the draft-free types exploit.
CODE_EDIT = [{"role": "user", "content": """Rename the variable `total` to `running_sum` in this function and \
return the whole function.

```python
def summarize(values):
    total = 0
    count = 0
    for value in values:
        if value is None:
            continue
        total = total + value
        count = count + 1
    average = total / count if count else 0.0
    return {"total": total, "count": count, "average": average}
```"""}]
NGRAM_TYPES = {
    "ngram-simple": SpecParams(type="ngram-simple", ngram_size_n=4, ngram_size_m=8),
    "ngram-map-k": SpecParams(type="ngram-map-k", ngram_size_n=4, ngram_size_m=8),
    "ngram-map-k4v": SpecParams(type="ngram-map-k4v", ngram_size_n=2, ngram_size_m=4),
    "ngram-cache": SpecParams(type="ngram-cache"),
    "ngram-suffix": SpecParams(type="ngram-suffix"),
}


@pytest.fixture(scope="module")
def tokenizer(smollm_runner: LocalRunner) -> Tokenizer:
    return Tokenizer.from_gguf(smollm_runner.gguf)


@pytest.fixture(scope="module")
def code_edit_prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(apply_chat_template(tokenizer, CODE_EDIT), add_special=False)


@pytest.fixture(scope="module")
def draft_runner(smollm_path) -> LocalRunner:
    return LocalRunner(smollm_path, n_ctx=1024, device="cpu", progress=False)


def run(runner: LocalRunner, prompt: list[int], tokenizer: Tokenizer, spec: SpecParams | None,
        sampling: SamplingParams, draft: LocalRunner | None = None, overlap: bool = True) -> Generation:
    """Through the scheduler, as the server runs it (overlap=False: every step settled before the next)."""
    return generate(runner, tokenizer, prompt, N_PREDICT, sampling, spec, overlap=overlap,
                    chain_factory=lambda s, slot: build_chain(s, draft, seq=slot))


@pytest.fixture(scope="module")
def plain_greedy(smollm_runner, code_edit_prompt, tokenizer) -> Generation:
    return run(smollm_runner, code_edit_prompt, tokenizer, None, SamplingParams(temperature=0))


@pytest.mark.parametrize("name", list(NGRAM_TYPES))
def test_ngram_types_identical_and_fewer_passes(name, smollm_runner, code_edit_prompt, tokenizer,
                                                 plain_greedy) -> None:
    for overlap in (True, False):
        gen = run(smollm_runner, code_edit_prompt, tokenizer, NGRAM_TYPES[name], SamplingParams(temperature=0),
                  overlap=overlap)
        assert gen.tokens == plain_greedy.tokens
        assert gen.result.draft_n_accepted > 0, f"{name} accepted no drafted token"
        assert gen.result.n_steps < plain_greedy.result.n_steps
        if not overlap:  # (overlapped, a right guess at the token in flight is accepted but saves no step)
            assert gen.result.n_steps + gen.result.draft_n_accepted == plain_greedy.result.n_steps


def test_draft_model_identical(smollm_runner, draft_runner, code_edit_prompt, tokenizer, plain_greedy) -> None:
    """The model as its own draft: every confident draft token is the target's own choice."""
    spec = SpecParams(type="none", n_max=8, p_min=0.5)
    gen = run(smollm_runner, code_edit_prompt, tokenizer, spec, SamplingParams(temperature=0), draft_runner)
    assert gen.tokens == plain_greedy.tokens
    assert gen.result.draft_n > 0
    assert gen.result.draft_n_accepted >= 0.9 * gen.result.draft_n
    assert gen.result.n_steps < plain_greedy.result.n_steps


def test_ngram_then_draft_chain(smollm_runner, draft_runner, code_edit_prompt, tokenizer, plain_greedy) -> None:
    spec = SpecParams(type="ngram-simple", ngram_size_n=4, ngram_size_m=8, n_max=8)
    scheduler = Scheduler(smollm_runner, tokenizer,
                          chain_factory=lambda s, slot: build_chain(s, draft_runner, seq=slot))
    gen = generate(smollm_runner, tokenizer, code_edit_prompt, N_PREDICT, SamplingParams(temperature=0), spec,
                   scheduler=scheduler)
    assert gen.tokens == plain_greedy.tokens
    chain = scheduler.slots[gen.result.slot].chain
    assert chain is not None and [m.name for m in chain.members] == ["ngram_simple", "draft"]
    ngram, draft = chain.members
    assert ngram.stats.acc_tokens > 0 and draft.stats.calls > 0
    # The draft model runs only where the n-gram lookup found nothing.
    assert draft.stats.calls == ngram.stats.calls - ngram.stats.gen_drafts


def test_seeded_sampling_identical_with_speculation(smollm_runner, code_edit_prompt, tokenizer) -> None:
    sampling = SamplingParams(temperature=0.8, seed=1234)
    plain = run(smollm_runner, code_edit_prompt, tokenizer, None, sampling)
    spec = run(smollm_runner, code_edit_prompt, tokenizer, NGRAM_TYPES["ngram-simple"], sampling)
    assert spec.result.draft_n_accepted > 0  # drafts were really accepted, not only verified away
    assert spec.tokens == plain.tokens


def test_drafts_fit_one_pass_steps(smollm_runner, code_edit_prompt, tokenizer, plain_greedy, monkeypatch) -> None:
    """Where the runner evaluates at most R rows per pass (packed weights on CUDA: 16), every
    verify step keeps to R rows, and the text is still plain greedy's."""
    assert smollm_runner.max_step_rows is None  # float weights on the CPU: no limit
    assert smollm_runner.draft_limit(16) == 16
    monkeypatch.setattr(smollm_runner, "max_step_rows", 4)
    assert smollm_runner.draft_limit(16) == 3 and smollm_runner.draft_limit(2) == 2
    step_rows = []
    launch = LocalRunner.launch

    def counting_launch(self, batch, fed=None, **kw):
        step_rows.append(len(batch))
        return launch(self, batch, fed, **kw)

    monkeypatch.setattr(LocalRunner, "launch", counting_launch)
    spec = SpecParams(type="ngram-simple", ngram_size_n=4, ngram_size_m=8)
    gen = run(smollm_runner, code_edit_prompt, tokenizer, spec, SamplingParams(temperature=0))
    assert gen.tokens == plain_greedy.tokens
    verify_rows = step_rows[1:]  # after the prompt's one chunk
    assert max(verify_rows) == 4 and gen.result.draft_n_accepted > 0  # drafts of 8 cut to 3, never past
