"""Which CUDA-graph buckets a warm-up captures (pure bookkeeping: runs anywhere)."""

from __future__ import annotations

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
