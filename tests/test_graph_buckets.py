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


def test_large_batches_compute_only_the_logits_they_want() -> None:
    from specserve.engine.cuda_graphs import GraphCache

    graphs = GraphCache.__new__(GraphCache)  # graph_key reads only the row limits
    graphs.max_rows, graphs.max_prompt_rows = 256, 512
    key = graphs.graph_key
    assert key(16, 1) == (16, 0) and key(17, 17) == (24, 0)  # steps and verify steps: every row's logits
    assert key(512, 1) == (512, 1) and key(17, 0) == (24, 1)  # prompt chunks: their last row's, or none
    assert key(512, 64) == (512, 64) and key(512, 65) == (512, 256)  # a chunk beside 63 / 64 decode rows
    assert key(40, 2) == (48, 16) and key(40, 40) == (48, 0)  # picks in coarse buckets; all wanted: every row
    assert key(300, 300) == (384, 384) and key(512, 400) == (512, 512)  # past the every-row graphs: all picked
    assert key(600, 1) is None  # past the graphs: the eager path
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
    assert {(48, 1, 0, False), (48, 1, 1, False)} <= runners[0].graphs.graphs.keys()  # warm-up: bucket 48 holds 40 rows
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
    torch.testing.assert_close(runners[0].kv_read(0), runners[1].kv_read(0), rtol=0, atol=0)


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
        for seq in (0, 1):
            torch.testing.assert_close(runners[0].kv_read(seq), runners[1].kv_read(seq), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs: GPU only")
@pytest.mark.parametrize("weight_format", ["float", "gguf"])
def test_a_chunk_beside_decode_rows_matches_eager(weight_format: str) -> None:
    """A prompt chunk read in the same batch as other sequences' decode rows (the picked graphs: logits of
    the wanted rows only) gives the eager pass's logits, argmax and KV entries."""
    import dataclasses

    from specserve.engine.local_runner import LocalRunner
    from specserve.model.batch import Batch
    from specserve.model.random_init import SHAPES, random_weights

    cfg = dataclasses.replace(SHAPES["qwen2.5-coder-0.5b"], n_layers=2, hidden=256, n_heads=4, n_kv_heads=2,
                              head_dim=64, ffn=512, vocab_size=300)
    runners = [LocalRunner.from_weights(cfg, random_weights(cfg, torch.bfloat16, torch.device("cuda"), seed=3),
                                        n_seqs=3, n_ctx=1024, weight_format=weight_format, cuda_graphs=graphs)
               for graphs in (True, False)]
    runners[0].warmup(1, prompt_rows=128)
    assert (128, 16, 0, False) in runners[0].graphs.graphs  # warm-up: a chunk beside a decode row of each other slot
    results = []
    for runner in runners:
        for seq in (0, 1):
            b = Batch()
            b.add_sequence([(3 * i + seq) % cfg.vocab_size for i in range(50)], 0, seq, "none")
            runner.forward(b)
        b = Batch()
        b.add(7, 50, 0, logits=True)
        b.add(8, 50, 1, logits=True)
        b.add_sequence([(5 * i + 1) % cfg.vocab_size for i in range(90)], 0, 2, "last")
        step = runner.launch(b)
        results.append((step.logits().clone(), step.tokens()))
    assert results[0][0].shape == (3, cfg.vocab_size)
    # (the head's product over 16 picked rows, not 3: its sums may round differently in the last bits)
    torch.testing.assert_close(results[0][0], results[1][0], rtol=2e-2, atol=2e-2)
    assert results[0][1] == results[1][1] == results[1][0].argmax(-1).tolist()
    for seq in range(3):
        torch.testing.assert_close(runners[0].kv_read(seq), runners[1].kv_read(seq), rtol=0, atol=0)
