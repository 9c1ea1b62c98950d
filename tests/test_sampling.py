"""Sampler: llama.cpp chain semantics, seeding, and exactness of sample-and-compare verification."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch

from specserve.engine.sampling import Sampler, SamplingParams
from specserve.errors import SpecserveError


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only add OpenMP hand-offs (milliseconds each on a busy shared CPU)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Chain stages switched off, so one stage at a time can be checked.
PLAIN = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def sampler(prompt: list[int] | None = None, **kw: object) -> Sampler:
    s = Sampler(SamplingParams(**kw))  # type: ignore[arg-type]
    s.reset(prompt or [])
    return s


def kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


# -- greedy -----------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    s = sampler(temperature=0.0)
    for _ in range(20):
        row = torch.randn(100, generator=gen)
        assert s.sample(row) == int(row.argmax())
    assert s.n_sampled == 20
    assert SamplingParams(temperature=-1.0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy


def test_greedy_accepts_bf16_logits() -> None:
    row = torch.tensor([0.1, 2.0, -3.0, 1.5], dtype=torch.bfloat16)
    assert sampler(temperature=0.0).sample(row) == 1


def test_verify_greedy_prefix_and_correction() -> None:
    rows = torch.full((4, 10), -1.0)
    for i, best in enumerate([5, 2, 7, 1]):
        rows[i, best] = 3.0
    s = sampler(temperature=0.0)
    assert s.sample_and_verify(rows, [5, 2, 3]) == [5, 2, 7]  # mismatch at 2: 7 replaces 3
    assert s.sample_and_verify(rows, [5, 2, 7]) == [5, 2, 7, 1]  # all accepted + bonus token
    assert s.sample_and_verify(rows, [4, 2, 7]) == [5]  # first rejected
    assert s.sample_and_verify(rows[:1], []) == [5]
    assert s.n_sampled == 3 + 4 + 1 + 1
    with pytest.raises(ValueError):
        s.sample_and_verify(rows, [5, 2])


def test_verify_greedy_sees_accepted_tokens_in_penalties() -> None:
    rows = torch.zeros(3, 8)
    rows[:, 5], rows[:, 6] = 3.0, 2.9
    s = sampler(temperature=0.0, repeat_penalty=1.5)
    # Row 0 has no 5 in its history; row 1 does (accepted draft[0]) and 3.0/1.5 < 2.9.
    assert s.sample_and_verify(rows, [5, 5]) == [5, 6]
    # The history now holds 5 and 6: both penalized alike, so 5 (2.0) beats 6 (1.93) again.
    assert s.sample(rows[0]) == 5


# -- each stage on hand-made logits -----------------------------------------------------------


def test_top_k_keeps_exactly_k() -> None:
    row = torch.arange(8, dtype=torch.float32)
    s = sampler(**{**PLAIN, "top_k": 3})
    probs = s.distribution(row)
    assert kept(probs) == {5, 6, 7}
    torch.testing.assert_close(probs[5:], torch.softmax(row[5:], 0))
    seen = {s.sample(row) for _ in range(200)}
    assert seen == {5, 6, 7}


def test_top_p_includes_crossing_token() -> None:
    row = logits_of([0.5, 0.3, 0.15, 0.05])
    for top_p, want in ((0.0, {0}), (0.45, {0}), (0.7, {0, 1}), (0.81, {0, 1, 2}), (0.99, {0, 1, 2, 3})):
        probs = sampler(**{**PLAIN, "top_p": top_p}).distribution(row)
        assert kept(probs) == want, top_p
    probs = sampler(**{**PLAIN, "top_p": 0.7}).distribution(row)
    torch.testing.assert_close(probs[:2], torch.tensor([0.5, 0.3]) / 0.8)


def test_top_p_runs_after_top_k() -> None:
    row = logits_of([0.5, 0.3, 0.15, 0.05])
    # Alone, 0.5 < 0.6 keeps two; after top_k=2 the head renormalizes to 0.625 >= 0.6 and keeps one.
    assert kept(sampler(**{**PLAIN, "top_p": 0.6}).distribution(row)) == {0, 1}
    assert kept(sampler(**{**PLAIN, "top_p": 0.6, "top_k": 2}).distribution(row)) == {0}


def test_min_p_is_relative_to_max() -> None:
    row = logits_of([0.15, 0.5, 0.05, 0.3])
    assert kept(sampler(**{**PLAIN, "min_p": 0.2}).distribution(row)) == {0, 1, 3}  # cut below 0.1
    assert kept(sampler(**{**PLAIN, "min_p": 0.5}).distribution(row)) == {1, 3}  # cut below 0.25
    assert kept(sampler(**{**PLAIN, "min_p": 1.0}).distribution(row)) == {1}


def test_temperature_scales_logits() -> None:
    row = torch.tensor([1.0, 2.0, 0.5, -1.0])
    probs = sampler(**{**PLAIN, "temperature": 0.5}).distribution(row)
    torch.testing.assert_close(probs, torch.softmax(row / 0.5, 0))


def penalized_logits(s: Sampler, row: torch.Tensor) -> torch.Tensor:
    """The logits after penalties, up to a constant, read back through the plain chain."""
    return s.distribution(row).log()


def test_penalties_change_exactly_the_expected_logits() -> None:
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    pen = dict(PLAIN, repeat_penalty=2.0, frequency_penalty=0.1, presence_penalty=0.5)
    # Token 0 once (positive: divided), 1 twice (negative: multiplied), 4 once (0 counts as <= 0).
    want = torch.tensor([2.0 / 2 - 0.1 - 0.5, -1.0 * 2 - 0.2 - 0.5, 0.5, 3.0, 0.0 - 0.1 - 0.5])
    got = penalized_logits(sampler([0, 1, 1, 4], **pen), row)
    torch.testing.assert_close(got, torch.log_softmax(want, 0))
    # repeat_last_n=2 sees only [1, 4]: token 1 once, token 0 untouched.
    want2 = torch.tensor([2.0, -1.0 * 2 - 0.1 - 0.5, 0.5, 3.0, -0.6])
    got2 = penalized_logits(sampler([0, 1, 1, 4], **pen, repeat_last_n=2), row)
    torch.testing.assert_close(got2, torch.log_softmax(want2, 0))
    # -1 = whole history; 0 = off.
    got3 = penalized_logits(sampler([0] * 100 + [1, 1, 4], **pen, repeat_last_n=-1), row)
    want3 = want.clone()
    want3[0] = 2.0 / 2 - 10.0 - 0.5
    torch.testing.assert_close(got3, torch.log_softmax(want3, 0))
    off = penalized_logits(sampler([0, 1], **pen, repeat_last_n=0), row)
    torch.testing.assert_close(off, torch.log_softmax(row, 0))


def test_penalties_count_sampled_tokens() -> None:
    s = sampler(temperature=0.0, repeat_penalty=1.5, repeat_last_n=2)
    row = torch.tensor([3.0, 2.5, 2.2, 0.0])
    # 3 -> 2 after use, so the argmax rotates through the three; the window of 2 lets the oldest return.
    assert [s.sample(row) for _ in range(4)] == [0, 1, 2, 0]


def test_greedy_penalty_flips_argmax() -> None:
    row = torch.tensor([3.0, 2.9])
    assert sampler(temperature=0.0).sample(row) == 0
    assert sampler([0], temperature=0.0, repeat_penalty=1.1).sample(row) == 1


# -- seeding ----------------------------------------------------------------------------------


def run(seed: int, rows: torch.Tensor) -> list[int]:
    s = sampler(seed=seed, temperature=1.0)
    return [s.sample(r) for r in rows]


def test_same_seed_same_tokens_different_seed_different() -> None:
    rows = torch.randn(40, 50, generator=torch.Generator().manual_seed(1))
    assert run(7, rows) == run(7, rows)
    assert run(7, rows) != run(8, rows)
    assert run(-1, rows) != run(-1, rows)  # random seeds (a collision here is ~impossible)
    s = sampler(seed=7, temperature=1.0)
    first = [s.sample(r) for r in rows]
    s.reset([])
    assert [s.sample(r) for r in rows] == first  # reset replays a fixed seed


def test_speculation_does_not_change_seeded_text() -> None:
    """Same seed -> same text with or without drafts, at temperature > 0 and with penalties."""
    vocab = 12
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(3)) * 2
    params = dict(seed=11, temperature=0.9, top_k=6, top_p=0.9, min_p=0.02, repeat_penalty=1.3, repeat_last_n=4)
    prompt = [1, 2, 3]

    plain = sampler(prompt, **params)
    ref = [prompt[-1]]
    for _ in range(40):
        ref.append(plain.sample(table[ref[-1]]))

    spec = sampler(prompt, **params)
    out = [prompt[-1]]
    gen = torch.Generator().manual_seed(4)
    accepted = 0
    while len(out) < len(ref):
        pos = len(out)
        # Draft: the true continuation with a random corruption, so some accept and some reject.
        draft = ref[pos : pos + 4]
        if draft and torch.rand(1, generator=gen).item() < 0.5:
            j = int(torch.randint(len(draft), (1,), generator=gen))
            draft[j] = (draft[j] + 1) % vocab
        rows = table[torch.tensor([out[-1], *draft])]
        got = spec.sample_and_verify(rows, draft)
        accepted += len(got) - 1
        out.extend(got)
    assert out[: len(ref)] == ref
    assert accepted > 10  # the drafts did real work


# -- the verifier keeps the target distribution ----------------------------------------------


def chi_square_p(observed: Counter, expected: dict[tuple[int, ...], float], n: int) -> tuple[float, float]:
    """Pearson chi-square over outcomes (bins with expected count < 5 merged) -> (statistic, p-value)."""
    big = [k for k, p in expected.items() if p * n >= 5]
    small_p = sum(p for k, p in expected.items() if k not in big)
    small_o = sum(c for k, c in observed.items() if k not in big)
    if any(k not in expected for k in observed):
        return math.inf, 0.0  # an outcome the chain gives probability 0
    pairs = [(observed[k], expected[k] * n) for k in big] + ([(small_o, small_p * n)] if small_p * n > 0 else [])
    stat = sum((o - e) ** 2 / e for o, e in pairs)
    df = len(pairs) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    return stat, p


def biased_verify(s: Sampler, rows: torch.Tensor, draft: list[int], eps: float, seed: int) -> list[int]:
    """A wrong verifier: with probability eps it accepts a draft token in the top-k without sampling."""
    coin = random.Random(seed)
    out: list[int] = []
    for i, d in enumerate(draft):
        if coin.random() < eps and d in torch.topk(rows[i], s.params.top_k).indices.tolist():
            out.append(d)
            s._record([d])  # keep the penalty history and position in step with what was emitted
            continue
        out.append(s.sample(rows[i]))
        if out[-1] != d:
            return out
    out.append(s.sample(rows[len(draft)]))
    return out


def test_verify_matches_plain_sampling_distribution() -> None:
    vocab, n = 8, 1000
    rows = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1)) * 0.8
    params = dict(temperature=0.9, top_k=5, top_p=0.95, min_p=0.05, repeat_penalty=1.5, repeat_last_n=8)
    prompt = [0, 1]
    # Draft = each row's most likely token (given the accepted prefix): accepted ~40% of the time.
    draft: list[int] = []
    for i in range(3):
        draft.append(int(sampler(prompt + draft, **params).distribution(rows[i]).argmax()))

    # Exact outcome probabilities from the chain: the emitted list is draft[:m] + [t], t != draft[m].
    expected: dict[tuple[int, ...], float] = {}
    reach = 1.0
    for m in range(len(draft) + 1):
        probs = sampler(prompt + draft[:m], **params).distribution(rows[m]).tolist()
        for t, p in enumerate(probs):
            if p > 0 and (m == len(draft) or t != draft[m]):
                expected[(*draft[:m], t)] = reach * p
        if m < len(draft):
            reach *= probs[draft[m]]
    assert math.isclose(sum(expected.values()), 1.0, rel_tol=1e-5)
    assert reach * n > 20  # the full-acceptance outcome gets real counts

    def plain(seed: int) -> tuple[int, ...]:
        s = sampler(prompt, seed=seed, **params)
        out: list[int] = []
        for m in range(len(draft) + 1):
            out.append(s.sample(rows[m]))
            if m == len(draft) or out[-1] != draft[m]:
                break
        return tuple(out)

    def fair(seed: int) -> tuple[int, ...]:
        return tuple(sampler(prompt, seed=seed, **params).sample_and_verify(rows, draft))

    def biased(eps: float) -> Callable[[int], tuple[int, ...]]:
        return lambda seed: tuple(biased_verify(sampler(prompt, seed=seed, **params), rows, draft, eps, seed))

    # Disjoint seed ranges: fair and plain are equal per seed by design, so they share none.
    verifiers = {"plain": plain, "fair": fair, "biased eps=1": biased(1.0), "biased eps=0.1": biased(0.1)}
    stats = {
        name: chi_square_p(Counter(fn(k * 10**6 + i) for i in range(n)), expected, n)
        for k, (name, fn) in enumerate(verifiers.items())
    }
    print({name: (round(stat, 1), f"p={p:.2g}") for name, (stat, p) in stats.items()})
    assert stats["plain"][1] > 1e-3
    assert stats["fair"][1] > 1e-3
    # The same test must catch verifiers that skew the output, even one wrong 10% of the time.
    assert stats["biased eps=1"][1] < 1e-12
    assert stats["biased eps=0.1"][1] < 1e-4


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 1.5),
        ("top_p", -0.1),
        ("min_p", 2.0),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", float("inf")),
        ("repeat_last_n", -2),
        ("presence_penalty", None),
        ("frequency_penalty", float("-inf")),
        ("seed", -5),
        ("seed", 1 << 64),
        ("seed", "42"),
    ],
)
def test_validate_names_the_field(field: str, value: object) -> None:
    with pytest.raises(SpecserveError, match=field):
        SamplingParams(**{field: value}).validate()  # type: ignore[arg-type]
    with pytest.raises(SpecserveError, match=field):
        Sampler(SamplingParams(**{field: value}))  # type: ignore[arg-type]


def test_validate_accepts_edges() -> None:
    for kw in (
        dict(temperature=0),
        dict(temperature=-1),
        dict(top_k=0),
        dict(top_k=-1),
        dict(top_p=0.0),
        dict(top_p=1),
        dict(min_p=0),
        dict(repeat_last_n=-1),
        dict(seed=0),
        dict(seed=(1 << 64) - 1),
        dict(presence_penalty=-2.0, frequency_penalty=2),
    ):
        params = SamplingParams(**kw)  # type: ignore[arg-type]
        assert params.validate() is params


def test_cuda_verify_equals_sequential_sampling() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rows = torch.randn(5, 32000, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    params = dict(seed=3, temperature=1.0, top_k=0, top_p=0.95, min_p=0.0, repeat_penalty=1.1)
    seq = sampler([1, 2], **params)
    ref = [seq.sample(row) for row in rows]
    # Row i of one verify call is what sequential sampling saw at step i, so all 4 drafts accept.
    assert sampler([1, 2], **params).sample_and_verify(rows, ref[:4]) == ref
