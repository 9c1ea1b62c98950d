"""Token trees (model/token_tree.py): their layout, the attention mask, a runner's tree step against each branch
evaluated alone, and greedy text through the scheduler identical to plain decoding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.engine.draft_gate import ROW_COST, TREE_RETRY, TreeValue
from specserve.engine.generate import generate
from specserve.engine.sampling import SamplingParams
from specserve.engine.slot_results import Settler
from specserve.engine.step_plan import Entry
from specserve.gguf.chat_template import apply_chat_template
from specserve.kernels.attention import attention_ref
from specserve.kernels.cpu import build
from specserve.model.batch import Batch
from specserve.model.token_tree import MAX_TREE_NODES, TokenTree
from specserve.speculative.base import Chain, SpecParams
from specserve.speculative.ngram_suffix import NgramSuffix
from tests.helpers import ancestors, check_tree_step
from tests.test_draft_chains import Fixed
from tests.test_speculative_e2e import CODE_EDIT


def test_merge_shares_prefixes_and_keeps_the_first_path_first() -> None:
    tree = TokenTree.merge(7, [[1, 2, 3], [1, 4], [5, 6]])
    assert tree.tokens == (7, 1, 2, 3, 4, 5, 6)
    assert tree.parents == (-1, 0, 1, 2, 1, 0, 5)
    assert tree.depths() == [0, 1, 2, 3, 2, 1, 2]
    assert not tree.is_chain and TokenTree.merge(7, [[1, 2], [1, 2, 3]]).is_chain
    assert TokenTree.merge(7, [[1, 2, 3], [5, 6]], most=5).tokens == (7, 1, 2, 3, 5)
    assert tree.cut(3) == TokenTree((7, 1, 2), (-1, 0, 1))


def test_walk_follows_the_targets_choices() -> None:
    tree = TokenTree.merge(7, [[1, 2, 3], [1, 4], [5, 6]])
    # the target picks 1 after the root, then 4 (the second branch), then 9 (no node)
    picked = [1, 4, 0, 0, 9, 0, 0]
    assert tree.walk(picked) == ([0, 1, 4], [1, 4, 9])
    assert tree.walk([5, 0, 0, 0, 0, 6, 8]) == ([0, 5, 6], [5, 6, 8])
    assert tree.walk([3, 0, 0, 0, 0, 0, 0]) == ([0], [3])


def test_bad_trees_are_refused() -> None:
    with pytest.raises(ValueError):
        TokenTree((1, 2), (-1, 1))
    with pytest.raises(ValueError):
        TokenTree(tuple(range(MAX_TREE_NODES + 1)), (-1, *range(MAX_TREE_NODES)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=9), min_size=1, max_size=12))
def test_hidden_bits_hide_exactly_the_other_branches(candidates: list[list[int]]) -> None:
    tree = TokenTree.merge(9, candidates)
    for i, bits in enumerate(tree.hidden_bits()):
        seen = ancestors(tree, i)
        assert all((bits >> j & 1) == (i - j not in seen) for j in range(i + 1))
        assert bits >> (i + 1) == 0
    leaves = {i for i in range(len(tree)) if i not in tree.parents}
    for leaf in leaves:
        chain = sorted(ancestors(tree, leaf))
        picked = [-1] * len(tree)
        for a, b in zip(chain, chain[1:], strict=False):
            picked[a] = tree.tokens[b]
        assert tree.walk(picked)[0] == chain


def test_reference_attention_masks_other_branches() -> None:
    """Each tree row equals the same query over its path alone: the cache, then its ancestors."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 16, 16
    start = 21
    tree = TokenTree.merge(1, [[2, 3, 4], [2, 5], [6, 7, 8, 9]])
    n = start + len(tree)
    k_cache = torch.randn(4, kv_heads, block, dim)
    v_cache = torch.randn(4, kv_heads, block, dim)
    table = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
    q = torch.randn(len(tree), heads, dim)
    positions = torch.arange(start, n)
    layout = Batch()
    layout.add_tree(tree, start, 0)
    hidden = torch.tensor(layout.tree_layout()[1])
    out = attention_ref(q, k_cache, v_cache, positions, table, [(0, 0, len(tree), n)], 0.25, hidden)
    keys = k_cache[table[0].long()].transpose(0, 1).flatten(1, 2)  # [kv heads, positions, dim]
    values = v_cache[table[0].long()].transpose(0, 1).flatten(1, 2)
    for i in range(len(tree)):
        seen = list(range(start)) + [start + a for a in sorted(ancestors(tree, i))]
        k, v = keys[:, seen].repeat_interleave(2, 0), values[:, seen].repeat_interleave(2, 0)
        w = torch.softmax(torch.einsum("hd,hnd->hn", q[i], k) * 0.25, -1)
        torch.testing.assert_close(out[i], torch.einsum("hn,hnd->hd", w, v), rtol=1e-5, atol=1e-5)


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit where the C kernels run the step (a tree row sums its softmax as its path alone would); within
    fp32's noise on the torch path."""
    if build.has("cpu_attention"):
        assert torch.equal(got, want), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_runner_tree_step_matches_each_branch_alone(smollm_runner, smollm_tokenizer) -> None:
    """A tree step's logits per node are those of its path evaluated as a plain draft after the same cache, and
    once the accepted path's K/V are compacted the next step continues as if only that path had been decoded."""
    tok = smollm_tokenizer
    prompt = tok.encode("def add(a, b):\n    return", add_special=False)
    check_tree_step(smollm_runner, prompt, tok.encode(" a + b + c d e", add_special=False)[:5], same)


@pytest.mark.parametrize("wrong_first", [True, False])
def test_greedy_text_with_trees_is_plain_greedy(smollm_runner, smollm_tokenizer, wrong_first: bool,
                                                 monkeypatch) -> None:
    tok = smollm_tokenizer
    walked: list[int] = []  # the accepted path's length of each tree verified
    after_tree = Settler._after_tree

    def counting(self: Settler, e: Entry, tree: TokenTree, picked: list[int]) -> None:
        walked.append(len(tree.walk(picked)[0]))
        after_tree(self, e, tree, picked)

    monkeypatch.setattr(Settler, "_after_tree", counting)
    prompt = tok.encode(apply_chat_template(tok, CODE_EDIT), add_special=False)
    greedy = SamplingParams(temperature=0)
    plain = generate(smollm_runner, tok, prompt, 64, greedy, None)
    spec = SpecParams(type="ngram-suffix", n_max=8, tree_nodes=24)
    wrong = tok.encode(" cat sat on the mat again and", add_special=False)

    def chain(params: SpecParams, slot: int) -> Chain:
        own = NgramSuffix(params)
        return Chain([Fixed(wrong), own] if wrong_first else [own, Fixed(wrong)])

    gen = generate(smollm_runner, tok, prompt, 64, greedy, spec, chain_factory=chain)
    assert gen.tokens == plain.tokens
    assert gen.result.n_steps < plain.result.n_steps
    assert gen.result.draft_sources["ngram_suffix"][1] > 0 and gen.result.draft_sources["fixed"][0] > 0
    assert walked and (not wrong_first or max(walked) > 1)  # trees were verified; off the wrong first branch too


def test_token_trees_through_the_server() -> None:
    """`speculative.tree_nodes` on a request: the plain greedy text, drafted from the prediction and the request's
    own history at once; a tree too big for a step's mask is a 400."""
    from tests import app_engine

    http = app_engine.client()
    client = app_engine.openai_client(http)
    messages = [{"role": "user", "content": "List the months of the year, one a line, then list them again."}]
    plain = app_engine.greedy_chat(client, messages, 48, extra_body={"speculative.n_max": 0})
    text = plain.choices[0].message.content
    assert text
    edited = text.replace("March", "Mar", 1) if "March" in text else "Sure: " + text
    got = app_engine.greedy_chat(client, messages, 48, prediction={"type": "content", "content": edited},
                                 extra_body={"speculative.type": "ngram-suffix", "speculative.tree_nodes": 16})
    assert got.choices[0].message.content == text
    sources = got.timings["draft_sources"]  # type: ignore[attr-defined]
    assert sources["prediction"]["accepted"] > 0, sources
    bad = http.post("/completion", json={"prompt": "hi", "speculative.tree_nodes": 65})
    assert bad.status_code == 400 and "tree_nodes" in bad.text


def test_suffix_alternatives_come_from_shorter_matches() -> None:
    """ngram-suffix drafts what followed the longest match, and for a tree also what followed the latest shorter
    one where that went another way; each member is told the most of its candidates' tokens accepted."""
    history = [10, 11, 12, 20, 21, 11, 12, 30, 31, 10, 11]
    suffix = NgramSuffix(SpecParams(type="ngram-suffix"))
    suffix.prepare(history)
    first = suffix.draft(history, 12, 8)
    assert first[:2] == [20, 21]
    assert suffix.alternatives(history, 12, 8, first) == [[30, 31, 10, 11]]
    chain = Chain([suffix])
    chain.tree = [(suffix, first), (suffix, [30, 31, 10, 11])]
    chain.accept_path([30, 31, 10])
    assert suffix.stats.acc_tokens == 3 and suffix.stats.gen_tokens == len(first) + 4  # (alternatives count too)


def test_trees_that_do_not_pay_for_their_rows_give_way_to_chains() -> None:
    value = TreeValue()
    assert value.wanted(ROW_COST["cpu"])  # (nothing known yet)
    for _ in range(12):
        value.note(0, 10)  # the other branches never won a token: ten rows for nothing
    assert value.gain == 0 and value.rows > 9
    skipped = [value.wanted(ROW_COST["cpu"]) for _ in range(TREE_RETRY + 1)]
    assert skipped == [False] * TREE_RETRY + [True]  # a chain each time, then a tree again to look
    for _ in range(2):
        value.note(8, 10)  # trees that won eight tokens over their first candidate: worth ten CPU rows (two steps)
    assert value.wanted(ROW_COST["cpu"])
