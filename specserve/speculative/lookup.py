"""The lookup tools as library functions: build a static cache, merge caches, measure a text.

Mirrors llama.cpp's lookup-create, lookup-merge and lookup-stats (examples/lookup/).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from specserve.speculative.ngram_cache import (
    NGRAM_MAX,
    NGRAM_MIN,
    NGRAM_STATIC,
    NgramCache,
    count_ngrams,
    draft_from_caches,
    load_cache,
    merge_cache,
    update_cache,
)

_PROGRESS_STEP = 1 << 16  # tokens counted between progress-bar updates


def build_static_cache(tokens: Sequence[int], progress: bool = False) -> NgramCache:
    """A static cache from a corpus: 2-grams only, as llama.cpp's lookup-create."""
    cache: NgramCache = {}
    with tqdm(total=len(tokens), desc="building lookup cache", unit="tok", disable=not progress) as bar:
        for start in range(0, len(tokens), _PROGRESS_STEP):
            stop = min(start + _PROGRESS_STEP, len(tokens))
            count_ngrams(cache, tokens, NGRAM_STATIC, start, stop)
            bar.update(stop - start)
    return cache


def merge_cache_files(paths: Sequence[str | os.PathLike[str]], progress: bool = False) -> NgramCache:
    """Load every file and add their counts together."""
    merged: NgramCache = {}
    for path in tqdm(paths, desc="merging lookup caches", unit="file", disable=not progress):
        merge_cache(merged, load_cache(path))
    return merged


@dataclass
class LookupStats:
    """What lookup-stats reports: how much of a text the caches would have drafted correctly."""

    n_draft: int  # most tokens per draft
    n_predict: int  # tokens of the text replayed
    n_drafted: int  # drafted tokens
    n_accept: int  # drafted tokens that matched the text

    @property
    def accept_rate(self) -> float:
        return self.n_accept / self.n_drafted if self.n_drafted else 0.0

    def lines(self) -> list[str]:
        return [
            f"n_draft   = {self.n_draft}",
            f"n_predict = {self.n_predict}",
            f"n_drafted = {self.n_drafted}",
            f"n_accept  = {self.n_accept}",
            f"accept    = {100.0 * self.accept_rate:.3f}%",
        ]


def lookup_stats(tokens: Sequence[int], n_draft: int, n_ctx: int, static: NgramCache | None = None,
                 dynamic: NgramCache | None = None, progress: bool = False) -> LookupStats:
    """Replay `tokens` as if generated, drafting with the n-gram caches at every step.

    The text is cut into chunks of n_ctx tokens, each replayed as one generation: starting from
    its first token, draft from (context, dynamic, static), accept drafted tokens while they equal
    the text, then take the next text token as the "sampled" one. The context cache grows with
    each token and after each chunk is merged into the dynamic cache (which `dynamic` receives).
    Unlike llama.cpp, a last partial chunk is replayed too instead of skipped.
    """
    if n_draft < 1:
        raise ValueError("n_draft must be at least 1")
    if n_ctx < 2:
        raise ValueError("n_ctx must be at least 2")
    static = static if static is not None else {}
    dynamic = dynamic if dynamic is not None else {}
    stats = LookupStats(n_draft=n_draft, n_predict=0, n_drafted=0, n_accept=0)
    bar = tqdm(total=len(tokens), desc="lookup stats", unit="tok", disable=not progress)
    for chunk_start in range(0, len(tokens), n_ctx):
        chunk = tokens[chunk_start:chunk_start + n_ctx]
        if len(chunk) < 2:
            bar.update(len(chunk))
            break
        context: NgramCache = {}
        output = [chunk[0]]
        while len(output) < len(chunk):
            draft = draft_from_caches(output, n_draft, context, dynamic, static)
            stats.n_drafted += len(draft)
            for drafted in draft:
                if len(output) >= len(chunk) or chunk[len(output)] != drafted:
                    break
                stats.n_accept += 1
                output.append(drafted)
                update_cache(context, output, NGRAM_MIN, NGRAM_MAX, n_new=1)
            if len(output) < len(chunk):  # the token the target would have sampled
                output.append(chunk[len(output)])
                update_cache(context, output, NGRAM_MIN, NGRAM_MAX, n_new=1)
        stats.n_predict += len(chunk)
        bar.update(len(chunk))
        merge_cache(dynamic, context)
    bar.close()
    return stats
