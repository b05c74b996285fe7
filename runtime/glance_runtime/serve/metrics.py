"""Prometheus metrics of one server, on its own registry (two servers in one process never share counts).

prometheus-client is the exposition format's reference implementation: the text it writes is what every
scraper parses, so the server does not format it by hand."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("glance_requests", "Chat-completion requests by HTTP status", ["status"], registry=r)
        self.queue_depth = Gauge("glance_queue_depth", "Requests waiting for the runner", registry=r)
        self.busy = Gauge("glance_decoding", "1 while the runner decodes a request", registry=r)
        self.in_flight = Gauge("glance_requests_in_flight", "Chat-completion requests being read or answered",
                               registry=r)
        self.prompt_tokens = Counter("glance_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.completion_tokens = Counter("glance_completion_tokens", "Tokens generated", registry=r)
        self.tau = Histogram("glance_tau", "Tokens committed per round, per request",
                             buckets=(1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12, 16), registry=r)
        self.latency = Histogram("glance_request_latency_seconds", "Arrival to last byte",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("glance_queue_wait_seconds", "Queued (request parsed) to the start of decoding",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.batch_slots = Gauge("glance_batch_slots", "Requests the runner decodes together at most (--max-batch)",
                                 registry=r)
        self.batch_slots.set(1)
        self.batch_active = Gauge("glance_batch_active", "Requests in the batch now", registry=r)
        self.batch_sequences = Histogram("glance_batch_sequences", "Sequences decoded per round",
                                         buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.batch_prefill = Histogram("glance_batch_prefill_seconds", "Prefills that held a running batch up",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.cancelled = Counter("glance_cancelled", "Decodes stopped early", ["reason"], registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)
