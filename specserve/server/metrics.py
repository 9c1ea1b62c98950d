"""Prometheus metrics with llama-server's names, read from the scheduler's counters at scrape time.

A collector (instead of instruments updated from the scheduler thread) keeps the engine free
of any Prometheus dependency and every scrape consistent with one counters snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.engine.scheduler import SchedulerCounters

PREFIX = "llamacpp:"
# Sent as llama-server's Process-Start-Time-Unix header (and as a gauge): a scraper that sees it change
# knows the counters restarted from zero. (Taken when the server code is imported, at start-up.)
PROCESS_START = int(time.time())


# The series read straight from a counters field: (kind, series, field, help), in llama-server's names where it
# has one; spec_decode_* count every speculative type (the per-type series below are labelled).
Counter, Gauge = CounterMetricFamily, GaugeMetricFamily
_SERIES: tuple[tuple[Callable[..., Metric], str, str, str], ...] = (
    (Counter, "prompt_tokens", "prompt_tokens",
     "Number of prompt tokens processed, excluding cached tokens."),
    (Counter, "prompt_tokens_cached", "prompt_tokens_cached",
     "Number of prompt tokens reused from a slot's cache."),
    (Counter, "prompt_seconds", "prompt_seconds",
     "Prompt process time."),
    (Counter, "prompt_tokens_shared", "prompt_tokens_shared",
     "Prompt tokens taken from blocks cached by content (other slots' prompts, earlier turns) instead of evaluated."),
    (Counter, "tokens_predicted", "tokens_predicted",
     "Number of generation tokens processed."),
    (Counter, "tokens_predicted_seconds", "predicted_seconds",
     "Predict process time."),
    (Counter, "n_decode", "n_decode",
     "Number of forward passes (all slots together)."),
    (Counter, "requests_finished", "requests_done",
     "Requests that finished (incl. stopped by the client)."),
    (Counter, "requests_failed", "requests_failed",
     "Requests that failed inside the engine."),
    (Counter, "spec_decode_num_drafts", "spec_drafts",
     "Verification steps that carried a draft."),
    (Counter, "spec_decode_num_draft_tokens", "spec_draft_tokens",
     "Draft tokens verified by the target."),
    (Counter, "spec_decode_num_accepted_tokens", "spec_accepted",
     "Draft tokens accepted by the target."),
    (Counter, "kv_preemptions", "kv_preemptions",
     "Running requests that gave back their KV for others and read their tokens again later."),
    (Counter, "context_shifts", "context_shifts",
     "Generations that filled their context and went on without their oldest tokens."),
    (Counter, "prompt_tokens_host", "prompt_tokens_host",
     "Prompt tokens read back from the host prompt cache (--cache-ram) instead of evaluated."),
    (Counter, "host_cache_kept", "host_cache_kept",
     "Prompt caches the KV pool gave up that the host cache kept."),
    (Gauge, "requests_processing", "requests_processing",
     "Number of requests processing."),
    (Gauge, "requests_deferred", "requests_deferred",
     "Number of requests deferred (waiting for a slot)."),
    (Gauge, "n_tokens_max", "n_tokens_max",
     "Largest observed n_tokens in a slot."),
    (Gauge, "kv_cache_tokens", "kv_tokens",
     "KV pool positions in use (whole blocks, shared ones once)."),
    (Gauge, "kv_cache_prefix_tokens", "kv_cached_tokens",
     "KV pool positions in blocks cached by content for later prompts (held by a slot or among the free blocks)."),
    (Gauge, "host_cache_bytes", "host_cache_bytes",
     "Bytes the host prompt cache holds."),
    (Gauge, "shared_suffix_requests", "shared_requests",
     "Earlier requests ngram-suffix may draft from, all scopes (--spec-shared-tokens)."),
    (Gauge, "shared_suffix_tokens", "shared_tokens",
     "Their tokens (prompts and outputs)."),
)
# Gauges that are one field over another (0 while the second is 0): (series, numerator, denominator, help).
_RATIOS = (
    ("n_busy_slots_per_decode", "n_busy_slots", "n_decode", "Average number of busy slots per forward pass."),
    ("prompt_tokens_seconds", "prompt_tokens", "prompt_seconds", "Average prompt throughput in tokens/s."),
    ("predicted_tokens_seconds", "tokens_predicted", "predicted_seconds",
     "Average generation throughput in tokens/s (per request)."),
    ("kv_cache_usage_ratio", "kv_tokens", "kv_capacity", "KV pool positions in use / all positions."),
)


class SchedulerCollector(Collector):
    def __init__(self, counters: Callable[[], SchedulerCounters | None]):
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        c = self._counters()
        if c is None:  # still loading: no series yet
            return
        for kind, name, field, doc in _SERIES:
            yield kind(PREFIX + name, doc, value=getattr(c, field))
        for name, top, bottom, doc in _RATIOS:
            below = getattr(c, bottom)
            yield GaugeMetricFamily(PREFIX + name, doc, value=getattr(c, top) / below if below else 0.0)
        seen = c.prompt_tokens + c.prompt_tokens_cached
        yield GaugeMetricFamily(PREFIX + "prompt_cache_hit_ratio", "Prompt tokens reused (from the slot's own cache "
                                "or blocks cached by content) / all prompt tokens, since start.",
                                value=c.prompt_tokens_cached / seen if seen else 0.0)
        yield GaugeMetricFamily(PREFIX + "process_start_time_seconds", "Start time of the server process (Unix "
                                "seconds).", value=PROCESS_START)
        turns = CounterMetricFamily(PREFIX + "draft_gate_turns", "Turns with two or more generating slots, by "
                                    "whether the draft gate let them draft.", labels=["choice"])
        turns.add_metric(["draft"], c.turns_drafting)
        turns.add_metric(["plain"], c.turns_plain)
        yield turns
        generated = CounterMetricFamily(PREFIX + "draft_tokens", "Draft tokens generated, per speculative type.",
                                        labels=["type"])
        accepted = CounterMetricFamily(PREFIX + "draft_tokens_accepted",
                                       "Draft tokens accepted by the target, per speculative type.", labels=["type"])
        for name in sorted(c.draft_generated):
            generated.add_metric([name], c.draft_generated[name])
            accepted.add_metric([name], c.draft_accepted.get(name, 0))
        yield generated
        yield accepted


def make_registry(counters: Callable[[], SchedulerCounters | None]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SchedulerCollector(counters))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
