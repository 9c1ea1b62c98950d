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

    from specserve.model.batch import Batch
    from specserve.engine.local_runner import LocalRunner
    from specserve.model.random_init import SHAPES, random_weights

    cfg = dataclasses.replace(SHAPES["qwen2.5-coder-0.5b"], n_layers=2, hidden=256, n_heads=4, n_kv_heads=2,
                              head_dim=64, ffn=512, vocab_size=300)
    runners = [LocalRunner.from_weights(cfg, random_weights(cfg, torch.bfloat16, torch.device("cuda"), seed=5),
                                        n_ctx=1024, weight_format=weight_format, cuda_graphs=graphs)
               for graphs in (True, False)]
    assert runners[0].max_step_rows == (16 if weight_format == "gguf" else None)  # drafts fit one kernel pass
    runners[0].warmup(1, prompt_rows=40)
    assert (48, True) in runners[0].graphs.graphs  # captured by the warm-up (bucket 48 holds 40 rows)
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
def test_step_graphs_take_each_rows_argmax(weight_format: str) -> None:
    """step_argmax() of steps of 1..40 rows (graphs with the argmax up to ARGMAX_ROWS, past it the
    logits' argmax) gives the argmax of the eager pass's logits, and the same KV entries."""
    import dataclasses

    from specserve.model.batch import Batch
    from specserve.engine.cuda_graphs import ARGMAX_ROWS
    from specserve.engine.local_runner import LocalRunner
    from specserve.model.random_init import SHAPES, random_weights

    cfg = dataclasses.replace(SHAPES["qwen2.5-coder-0.5b"], n_layers=2, hidden=256, n_heads=4, n_kv_heads=2,
                              head_dim=64, ffn=512, vocab_size=300)
    runners = [LocalRunner.from_weights(cfg, random_weights(cfg, torch.bfloat16, torch.device("cuda"), seed=7),
                                        n_ctx=1024, weight_format=weight_format, cuda_graphs=graphs)
               for graphs in (True, False)]
    prompt = [(13 * i + 2) % cfg.vocab_size for i in range(100)]
    for rows in (1, 5, 16, 17, ARGMAX_ROWS, 40):
        picked = []
        for runner in runners:
            runner.kv_truncate(0, 0)
            b = Batch()
            b.add_sequence(prompt, 0, 0, "none")
            runner.forward(b)
            step_tokens = [(7 * i + 1) % cfg.vocab_size for i in range(rows)]
            picked.append(runner.step_argmax(0, step_tokens, len(prompt)).read())
            assert runner.seq_len[0] == len(prompt) + rows
        step = Batch()
        step.add_sequence(step_tokens, len(prompt), 0, "all")
        eager_logits = runners[1].forward(step)  # the same rows again, eagerly
        assert picked[0] == picked[1] == eager_logits.argmax(dim=-1).tolist()
        assert (bucket_for(rows, 256), False) in runners[0].graphs.graphs and len(picked[0]) == rows
        torch.testing.assert_close(runners[0].kv[:, :, 0, :, :100 + rows], runners[1].kv[:, :, 0, :, :100 + rows],
                                   rtol=0, atol=0)
