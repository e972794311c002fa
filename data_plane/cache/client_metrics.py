"""The session store's metrics (data_plane/cache/client.py), registered once per gateway.

    metrics = SessionStoreMetrics(registry)
    metrics.ops.labels("load", "hit").inc()
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from data_plane.cache.model import SECONDS_BUCKETS


class SessionStoreMetrics:
    """The session store's metrics, registered in `registry`.

    ``result`` is one of: load hit|miss|away|deleted|denied|error (deleted: a tombstone; away: a miss while a
    node that held it is lately gone, answered 503); save ok|partial|stale|error;
    repair ok|stale|error; delete ok|error.
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
        self.seconds = Histogram(
            "switchboard_session_store_seconds",
            "Session store operation latency, all replicas included.",
            ["op"],
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
