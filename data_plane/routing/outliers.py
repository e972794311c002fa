"""Failure-percentage outlier detection (Envoy's ``failure_percentage_*``): a shard whose calls fail
too often is ejected even when successes in between keep its consecutive-failure count low.

    outliers = FailurePercentage(OutlierConfig(threshold=40, request_volume=20, window_s=30))
    outliers.record("shard-1", failed=False, now=t)        # every call's outcome
    if outliers.record("shard-1", failed=True, now=t):     # True: its window is past the threshold
        ...                                                # the router ejects it if max_ejection allows
    outliers.forget("shard-1")                             # on ejection, or when it leaves membership

Why: a shard behind a lossy link (or a 48 kbit/s one) failed about every other call with a connect
error or a timeout, each costing its request 2.5-3 s before the retry elsewhere, and the successes in
between reset the consecutive count, so it was never ejected (RELIABILITY.md, B22).

Only failures that are the shard's (or its link's) fault count, :data:`COUNTED`: connect errors,
timeouts, 5xx but 503, broken or silent streams. Not a 503 or a 429: a shard answers 503 ``overloaded``
when its queue is full (its backpressure: load, not a fault; ejecting a hot shard of an overloaded fleet
by percentage would pile its load on the rest; consecutive 503s still eject, as before). Not
a 401 cluster-token refusal (a configuration error, consecutive ejection handles it), not a shard
leaving membership; a request's own error (4xx) is the shard answering, a success here, and the
gateway's own EMFILE never reaches the router (B21). Outcomes are counted per shard in a sliding window
of ``BUCKETS`` buckets over ``window_s``; a shard is judged only with at least ``request_volume``
calls in the window (no load, no ejection) and only when the fleet has ``minimum_hosts`` shards.
Judging happens on a counted failure, O(1) per call, so it costs nothing per decision.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from data_plane.routing.failures import FailureReason

BUCKETS = 10
"""Buckets of a shard's window: outcomes older than ``window_s`` leave it a tenth at a time."""

COUNTED = frozenset({
    FailureReason.CONNECT, FailureReason.TIMEOUT, FailureReason.STATUS_500, FailureReason.STATUS_502,
    FailureReason.STATUS_504, FailureReason.STATUS_5XX, FailureReason.SILENT,
    FailureReason.FIRST_TOKEN_TIMEOUT, FailureReason.EMPTY_STREAM, FailureReason.STREAM_ERROR_BEFORE_FIRST_TOKEN,
    FailureReason.TRANSPORT, FailureReason.STREAM_IDLE, FailureReason.STREAM_BROKEN,
    FailureReason.PIPELINE_STAGE_LOST,
})
"""The failures held against a shard's failure percentage (see the module docstring for the rest)."""


@dataclass(frozen=True)
class OutlierConfig:
    threshold: float = 40.0
    """Failure percentage (of the calls in the window) at or above which a shard is ejected; 0: off."""
    request_volume: int = 20
    """Calls a shard needs in the window before its percentage is judged."""
    window_s: float = 30.0
    """The sliding window's length."""
    minimum_hosts: int = 2
    """Shards the fleet needs for failure-percentage ejection (one shard has nowhere else to go)."""
    max_ejection_percent: float = 50.0
    """Most shards (percent of the fleet, at least one) out of routing at once through this detection;
    it never ejects the last shard in routing."""


class _Window:
    __slots__ = ("calls", "epochs", "failures")

    def __init__(self) -> None:
        self.epochs = [-1] * BUCKETS
        self.calls = [0] * BUCKETS
        self.failures = [0] * BUCKETS

    def add(self, epoch: int, failed: bool) -> None:
        i = epoch % BUCKETS
        if self.epochs[i] != epoch:
            self.epochs[i], self.calls[i], self.failures[i] = epoch, 0, 0
        self.calls[i] += 1
        self.failures[i] += failed

    def totals(self, epoch: int) -> tuple[int, int]:
        calls = failures = 0
        for i in range(BUCKETS):
            if epoch - self.epochs[i] < BUCKETS:
                calls += self.calls[i]
                failures += self.failures[i]
        return calls, failures


class FailurePercentage:
    """Per-shard sliding windows of call outcomes (see the module docstring)."""

    def __init__(self, config: OutlierConfig) -> None:
        self.config = config
        self._bucket_s = config.window_s / BUCKETS
        self._windows: dict[str, _Window] = {}

    @property
    def enabled(self) -> bool:
        return self.config.threshold > 0

    def record(self, shard: str, failed: bool, now: float) -> bool:
        """Count one call's outcome; True when `failed` and the shard's window is past the threshold."""
        if not self.enabled:
            return False
        epoch = int(now // self._bucket_s)
        window = self._windows.get(shard)
        if window is None:
            window = self._windows[shard] = _Window()
        window.add(epoch, failed)
        if not failed:
            return False
        calls, failures = window.totals(epoch)
        return calls >= self.config.request_volume and 100.0 * failures >= self.config.threshold * calls

    def rate(self, shard: str, now: float) -> tuple[int, int]:
        """(calls, failures) in `shard`'s window."""
        window = self._windows.get(shard)
        return (0, 0) if window is None else window.totals(int(now // self._bucket_s))

    def may_eject(self, fleet_size: int, out_of_routing: int) -> bool:
        """Whether one more shard may go: enough shards, under the max ejection percent, one left in routing."""
        cfg = self.config
        if fleet_size < cfg.minimum_hosts or out_of_routing + 1 >= fleet_size:
            return False
        most = max(1, int(fleet_size * cfg.max_ejection_percent / 100.0))
        return out_of_routing + 1 <= most

    def forget(self, shard: str) -> None:
        """A fresh window (the shard was ejected: it is judged anew once back, or it left)."""
        self._windows.pop(shard, None)

    def keep_only(self, shards: Container[str]) -> None:
        """Drop the windows of shards not in `shards` (they left membership)."""
        for gone in [s for s in self._windows if s not in shards]:
            del self._windows[gone]


__all__ = ["BUCKETS", "COUNTED", "FailurePercentage", "OutlierConfig"]
