"""Which CUDA-graph buckets a warm-up captures (pure bookkeeping: runs anywhere)."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.cuda_graphs import bucket_for, buckets_up_to


def test_warmup_covers_the_bucket_that_holds_the_longest_step() -> None:
    # a verify step of 16 drafts + 1 has 17 rows: it runs in the 24-row graph, which warm-up must capture
    assert bucket_for(17, 256) == 24
    assert buckets_up_to(17, 256) == [*range(1, 17), 24]
    assert buckets_up_to(16, 256) == list(range(1, 17))
    assert buckets_up_to(1, 256) == [1]
    for n in range(1, 300):
        covered = buckets_up_to(n, 256)
        assert all(bucket_for(rows, 256) in covered for rows in range(1, min(n, 256) + 1))
    assert buckets_up_to(300, 256)[-1] == 256
    assert buckets_up_to(40, 32) == [*range(1, 17), 24, 32]  # never past max_rows


def test_prompt_chunks_take_the_one_row_graphs() -> None:
    from specserve.engine.cuda_graphs import GraphCache

    one_row = GraphCache.one_logit_row
    assert one_row(512, 1) and one_row(17, 0)  # prompt chunks: the last one wants its last row's logits
    assert not one_row(16, 1)  # steps keep the every-row graphs
    assert not one_row(40, 40) and not one_row(40, 2)  # a verify of many rows, two sequences' last rows
    assert buckets_up_to(512, 512)[-2:] == [384, 512] and bucket_for(513, 512) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: GPU only")
@pytest.mark.parametrize("weight_format", ["float", "gguf"])
def test_prompt_graphs_match_eager(weight_format: str) -> None:
    """Prompt chunks replayed from the one-row graphs give the eager pass's logits and KV entries."""
    import dataclasses

    from specserve.engine.local_runner import LocalRunner
    from specserve.model.batch import Batch
    from specserve.model.random_init import SHAPES, random_weights

    cfg = dataclasses.replace(SHAPES["qwen2.5-coder-0.5b"], n_layers=2, hidden=256, n_heads=4, n_kv_heads=2,
                              head_dim=64, ffn=512, vocab_size=300)
    runners = [LocalRunner.from_weights(cfg, random_weights(cfg, torch.bfloat16, torch.device("cuda"), seed=5),
                                        n_ctx=1024, weight_format=weight_format, cuda_graphs=graphs)
               for graphs in (True, False)]
    assert runners[0].max_step_rows == (16 if weight_format == "gguf" else None)  # drafts fit one kernel pass
    runners[0].warmup(1, prompt_rows=40)
    assert {(48, True, 0), (48, True, 1)} <= runners[0].graphs.graphs.keys()  # warm-up: bucket 48 holds 40 rows
    prompt = [(11 * i + 5) % cfg.vocab_size for i in range(700)]
    logits = []
    for runner in runners:
        for start, end, want in ((0, 512, "none"), (512, 700, "last")):
            b = Batch()
            b.add_sequence(prompt[start:end], start, 0, want)
            out = runner.forward(b)
        logits.append(out.clone())
    assert logits[0].shape == (1, cfg.vocab_size)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    torch.testing.assert_close(runners[0].kv[:, :, 0, :, :700], runners[1].kv[:, :, 0, :, :700], rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: GPU only")
@pytest.mark.parametrize("weight_format", ["float", "gguf"])
def test_graph_steps_feed_tokens_like_the_eager_path(weight_format: str) -> None:
    """Steps of 1..40 rows, each followed by steps whose first token is fed from the one before on the
    device (both parities, two sequences, some rows wanting no logits), give through graphs the tokens and
    KV entries of the eager path."""
    import dataclasses

    from specserve.engine.local_runner import LocalRunner
    from specserve.model.batch import Batch
    from specserve.model.random_init import SHAPES, random_weights

    cfg = dataclasses.replace(SHAPES["qwen2.5-coder-0.5b"], n_layers=2, hidden=256, n_heads=4, n_kv_heads=2,
                              head_dim=64, ffn=512, vocab_size=300)
    runners = [LocalRunner.from_weights(cfg, random_weights(cfg, torch.bfloat16, torch.device("cuda"), seed=7),
                                        n_seqs=2, n_ctx=1024, weight_format=weight_format, cuda_graphs=graphs)
               for graphs in (True, False)]
    prompt = [(13 * i + 2) % cfg.vocab_size for i in range(100)]
    for rows in (1, 5, 16, 17, 32, 40):
        picked = []
        for runner in runners:
            out: list[list[int]] = []
            for seq in (0, 1):
                runner.kv_truncate(seq, 0)
                b = Batch()
                b.add_sequence(prompt, 0, seq, "none")
                runner.forward(b)
            first = Batch()
            first.add_sequence([(7 * i + 1) % cfg.vocab_size for i in range(rows)], len(prompt), 0, "all")
            first.add_sequence([5, 6], len(prompt), 1, "none")
            previous = runner.launch(first)
            position = len(prompt) + rows
            for k in range(5):  # seq 0 fed from the step before; seq 1 from the host, its rows wanting logits or not
                b = Batch()
                b.add(0, position + k, 0, logits=True)
                b.add_sequence([9 + k, 10 + k], len(prompt) + 2 + 2 * k, 1, "all" if k % 2 else "none")
                fed_row = rows - 1 if k == 0 else 0
                step = runner.launch(b, fed=[fed_row, -1, -1])
                out.append(previous.tokens())  # a step's results hold until the launch after the next
                previous = step
            out.append(previous.tokens())
            picked.append(out)
            assert runner.seq_len[0] == position + 5
        assert picked[0] == picked[1]
        assert len(picked[0][0]) == rows and all(len(t) in (1, 3) for t in picked[0][1:])
        torch.testing.assert_close(runners[0].kv[:, :, :2, :, :position + 5], runners[1].kv[:, :, :2, :, :position + 5],
                                   rtol=0, atol=0)
