"""What `GET /metrics` shows, in Prometheus' text format (prometheus_client): how full the queue
and the rows are, tokens generated and prefilled, prompt tokens kept in the rows (prefix reuse),
tokens drafted and accepted (speculative decoding), how each request ended, time to first token
and between tokens. Each scheduler has its own registry, so servers in one process (tests) never
mix counts."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from a few ms (a decode step of a tiny model) to a minute (a queue behind long prompts)
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue = Gauge("staticrt_queue_length", "requests waiting for a free row", registry=r)
        self.busy = Gauge("staticrt_busy_rows", "cache rows holding a request", registry=r)
        self.rows = Gauge("staticrt_rows", "cache rows (the batch size of the step)", registry=r)
        self.tokens = Counter("staticrt_generated_tokens", "tokens generated", registry=r)
        self.prefilled_tokens = Counter(
            "staticrt_prefilled_tokens", "prompt tokens prefilled (not kept in a row's cache)", registry=r
        )
        self.prefix_hits = Counter(
            "staticrt_prefix_hits", "requests that kept a prefix of their prompt in their row's cache", registry=r
        )
        self.reused_tokens = Counter(
            "staticrt_prefix_reused_tokens", "prompt tokens kept in a row's cache rather than prefilled", registry=r
        )
        self.pool_restores = Counter(
            "staticrt_prefix_pool_restores", "requests seated in a row restored from the host pool", registry=r
        )
        self.pool_bytes = Gauge("staticrt_prefix_pool_bytes", "bytes of rows held in the host pool", registry=r)
        self.drafted_tokens = Counter(
            "staticrt_draft_tokens", "tokens drafted and checked in verify steps (speculative decoding)", registry=r
        )
        self.accepted_tokens = Counter(
            "staticrt_draft_accepted_tokens", "of the drafted tokens, those the model chose too", registry=r
        )
        self.finished = Counter(
            "staticrt_requests_finished", "requests that left their row, by outcome", ["outcome"], registry=r
        )
        self.first_token = Histogram(
            "staticrt_time_to_first_token_seconds", "from submission to the first token", buckets=BUCKETS, registry=r
        )
        self.inter_token = Histogram(
            "staticrt_inter_token_latency_seconds", "between a request's tokens", buckets=BUCKETS, registry=r
        )

    def observe_token(self, job: Any) -> None:
        """A token for `job` (serve/job.py's Job) now: the latency metrics (tokens of one verify
        step come 0 s apart), and at its first the prompt tokens it prefilled or kept."""
        now = time.perf_counter()
        self.tokens.inc()
        if job.tokens:
            self.inter_token.observe(now - job.last_at)
        else:
            self.first_token.observe(now - job.created_at)
            self.prefilled_tokens.inc(len(job.request.prompt) - job.kept)
            if job.kept:
                self.prefix_hits.inc()
                self.reused_tokens.inc(job.kept)
        job.last_at = now

    def text(self) -> bytes:
        return generate_latest(self.registry)
