"""Build the speculator chain for one sequence from SpecParams."""

from __future__ import annotations

from specserve.speculative.base import Chain, SpecParams, Speculator
from specserve.speculative.draft_model import DraftModelSpeculator, DraftRunner
from specserve.speculative.ngram_cache import NgramCacheSpeculator
from specserve.speculative.ngram_map import NgramMap
from specserve.speculative.ngram_simple import NgramSimple
from specserve.speculative.ngram_suffix import NgramSuffix
from specserve.speculative.shared_suffix import SharedSuffix, SuffixStore


def build_chain(params: SpecParams, draft_runner: DraftRunner | None = None, seq: int = 0,
                shared: SuffixStore | None = None) -> Chain | None:
    """Draft-free type first (ngram-suffix: long matches in the earlier requests of its scope in `shared`, then
    the sequence's own history), then the draft model; None when neither is configured."""
    members: list[Speculator] = []
    if params.type == "ngram-simple":
        members.append(NgramSimple(params))
    elif params.type in ("ngram-map-k", "ngram-map-k4v"):
        members.append(NgramMap(params, key_only=params.type == "ngram-map-k"))
    elif params.type == "ngram-cache":
        members.append(NgramCacheSpeculator(params))
    elif params.type == "ngram-suffix":
        own = NgramSuffix(params)
        if shared is not None:
            members.append(SharedSuffix(params, shared, own))
        members.append(own)
    if draft_runner is not None:
        members.append(DraftModelSpeculator(draft_runner, params.p_min, seq))
    return Chain(members) if members else None
