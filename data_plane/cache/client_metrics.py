"""The session store's metrics (data_plane/cache/client.py), registered once per gateway.

    metrics = SessionStoreMetrics(registry)
    metrics.ops.labels("load", "hit").inc()
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from data_plane.cache.model import SECONDS_BUCKETS

tracer = trace.get_tracer("data_plane.cache.client")


@dataclass
class Outcome:
    """What one store operation came to (its ``result`` label), set by the operation before it returns."""

    result: str = "error"


class SessionStoreMetrics:
    """The session store's metrics, registered in `registry`.

    ``result`` is one of: load hit|miss|away|deleted|denied|error (deleted: a tombstone; away: a miss while a
    node that held it is lately gone, answered 503); save ok|partial|stale|error;
    repair ok|stale|error; delete ok|error. Repairs that bring a record back from a node that held it while a
    replica was away count as repairs; that node's copy is then removed (``moved_copies``).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ops = Counter(
            "switchboard_session_store_ops_total",
            "Session store operations by outcome.",
            ["op", "result"],
            registry=registry,
        )
        self.repairs = Counter(
            "switchboard_session_replica_repairs_total",
            "Transcripts written back to a replica that was missing them (read-repair).",
            registry=registry,
        )
        self.moved_copies = Counter(
            "switchboard_session_moved_copies_total",
            "Copies of a record on a cache node that held it while one of its replicas was away, once the record "
            "was back on its replicas: removed; kept (the node holds another version now: a write since, left "
            "alone); gone (already); error. Left, such a copy was read again when that replica next went away.",
            ["result"],
            registry=registry,
        )
        for result in ("removed", "kept", "gone", "error"):
            self.moved_copies.labels(result)
        self.seconds = Histogram(
            "switchboard_session_store_seconds",
            "Session store operation latency, all replicas included.",
            ["op"],
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.nodes_skipped = Gauge(
            "switchboard_session_store_nodes_skipped",
            "Cache nodes this gateway skips now: their breaker opened after calls failed in a row (a partition "
            "between this gateway and a node membership still says passing); one call probes each after a hold.",
            registry=registry,
        )
        self.node_ejections = Counter(
            "switchboard_session_store_node_ejections_total",
            "Times a cache node's breaker opened in this gateway (calls to it failed in a row, or its probe did).",
            registry=registry,
        )

    def node_circuit(self, open_count: int, opened: bool) -> None:
        self.nodes_skipped.set(open_count)
        if opened:
            self.node_ejections.inc()

    @contextlib.contextmanager
    def op(self, op: str, span_name: str) -> Iterator[tuple[Outcome, trace.Span]]:
        """One store operation: its span, then its outcome counted and its time observed."""
        outcome = Outcome()
        started = time.perf_counter()
        with tracer.start_as_current_span(span_name) as span:
            try:
                yield outcome, span
            finally:
                span.set_attribute("switchboard.cache.result", outcome.result)
                self.ops.labels(op, outcome.result).inc()
                self.seconds.labels(op).observe(time.perf_counter() - started)
