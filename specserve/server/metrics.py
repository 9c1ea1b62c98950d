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


class SchedulerCollector(Collector):
    def __init__(self, counters: Callable[[], SchedulerCounters | None]):
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        c = self._counters()
        if c is None:  # still loading: no series yet
            return

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(PREFIX + name, doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, value=value)

        yield counter("prompt_tokens", "Number of prompt tokens processed, excluding cached tokens.", c.prompt_tokens)
        yield counter("prompt_tokens_cached", "Number of prompt tokens reused from a slot's cache.",
                      c.prompt_tokens_cached)
        yield counter("prompt_seconds", "Prompt process time.", c.prompt_seconds)
        yield counter("prompt_tokens_shared", "Prompt tokens taken from another slot's cache or a held prefix "
                      "(shared blocks) instead of evaluated.", c.prompt_tokens_shared)
        yield counter("tokens_predicted", "Number of generation tokens processed.", c.tokens_predicted)
        yield counter("tokens_predicted_seconds", "Predict process time.", c.predicted_seconds)
        yield counter("n_decode", "Number of forward passes (all slots together).", c.n_decode)
        yield counter("requests_finished", "Requests that finished (incl. stopped by the client).",
                      c.requests_done)
        yield counter("requests_failed", "Requests that failed inside the engine.", c.requests_failed)
        yield gauge("n_busy_slots_per_decode", "Average number of busy slots per forward pass.",
                    c.n_busy_slots / c.n_decode if c.n_decode else 0.0)
        yield gauge("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                    c.prompt_tokens / c.prompt_seconds if c.prompt_seconds else 0.0)
        yield gauge("predicted_tokens_seconds", "Average generation throughput in tokens/s (per request).",
                    c.tokens_predicted / c.predicted_seconds if c.predicted_seconds else 0.0)
        yield gauge("requests_processing", "Number of requests processing.", c.requests_processing)
        yield gauge("requests_deferred", "Number of requests deferred (waiting for a slot).",
                    c.requests_deferred)
        yield gauge("n_tokens_max", "Largest observed n_tokens in a slot.", c.n_tokens_max)
        yield gauge("kv_cache_tokens", "KV pool positions in use (whole blocks, shared ones once).", c.kv_tokens)
        yield gauge("kv_cache_usage_ratio", "KV pool positions in use / all positions.",
                    c.kv_tokens / c.kv_capacity if c.kv_capacity else 0.0)
        seen = c.prompt_tokens + c.prompt_tokens_cached
        yield gauge("prompt_cache_hit_ratio", "Prompt tokens reused (from the slot's own cache or another's shared "
                    "prefix) / all prompt tokens, since start.", c.prompt_tokens_cached / seen if seen else 0.0)
        yield gauge("process_start_time_seconds", "Start time of the server process (Unix seconds).",
                    PROCESS_START)
        # llama-server's speculative series, over every speculative type (the per-type ones follow).
        yield counter("spec_decode_num_drafts", "Verification steps that carried a draft.", c.spec_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified by the target.", c.spec_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.", c.spec_accepted)
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
        yield counter("kv_preemptions", "Running requests that gave back their KV for others and read their tokens "
                      "again later (a full pool: engine/kv_room.py).", c.kv_preemptions)
        yield counter("context_shifts", "Generations that filled their context and went on without their oldest "
                      "tokens (--context-shift).", c.context_shifts)
        yield counter("prompt_tokens_host", "Prompt tokens read back from the host prompt cache (--cache-ram) "
                      "instead of evaluated (part of the cached).", c.prompt_tokens_host)
        yield counter("host_cache_kept", "Prompt caches the KV pool gave up that the host cache kept.",
                      c.host_cache_kept)
        yield gauge("host_cache_bytes", "Bytes the host prompt cache holds.", c.host_cache_bytes)
        yield gauge("shared_suffix_requests", "Earlier requests ngram-suffix may draft from, all scopes "
                    "(--spec-shared-tokens).", c.shared_requests)
        yield gauge("shared_suffix_tokens", "Their tokens (prompts and outputs).", c.shared_tokens)


def make_registry(counters: Callable[[], SchedulerCounters | None]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SchedulerCollector(counters))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
