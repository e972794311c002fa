"""Routing's failure taxonomy: why a shard call failed, and what that did to the shard's circuit.

    reason = FailureReason.for_status(503)     # FailureReason.STATUS_503
    router.report_failure(member, FailureReason.CONNECT)
    circuit = Circuit()
    circuit.transition_to(CircuitState.OPEN, now=t, hold_s=5.0)   # the one place a state changes

Every ``reason`` label of ``switchboard_router_{upstream_failures,retries,resumes}_total`` and every
``reason`` attribute of the ``router.*`` span events is a :class:`FailureReason`, so the label set is
bounded by construction: a shard's HTTP status is mapped into it (:meth:`FailureReason.for_status`), a
shard's own error code never becomes a label.

A shard's health is a :class:`Circuit` (Envoy-style outlier detection, SGLang's ``CircuitState``)::

    CLOSED --(eject_after consecutive failures)--> OPEN --(hold expired, picked as the probe)--> HALF_OPEN
      ^                                             ^                                             |
      |                                             +----------------(the probe fails)------------+
      +------------------------------------------------(the probe succeeds)------------------------+

CLOSED also goes to OPEN when the shard's failure percentage over a sliding window passes its threshold
(data_plane/routing/outliers.py). The hold doubles with each opening (capped by the router); a failure
reported while OPEN (a call routed before the ejection) restarts the hold at its length, not doubled; a
success reported while OPEN (the same) changes nothing: only the probe brings the shard back.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from data_plane.common.errors import PipelineStageLost


class FailureReason(StrEnum):
    """Why one call to a shard failed. Before the first token (retried on another shard):"""

    CONNECT = "connect"
    """No TCP (or TLS) connection."""
    TIMEOUT = "timeout"
    """No response headers within ``headers_timeout_s``."""
    STATUS_429 = "status_429"
    STATUS_500 = "status_500"
    STATUS_502 = "status_502"
    STATUS_503 = "status_503"
    STATUS_504 = "status_504"
    STATUS_5XX = "status_5xx"
    """Any other 5xx status."""
    REFUSED = "refused"
    """401: the shard refused the gateway's cluster token (the two run with different tokens)."""
    SILENT = "silent"
    """A shard that announces keep-alives sent nothing for ``silence_timeout_s``."""
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    EMPTY_STREAM = "empty_stream"
    """The stream ended before any token."""
    STREAM_ERROR_BEFORE_FIRST_TOKEN = "stream_error_before_first_token"
    """The shard sent an error event before any token."""
    TRANSPORT = "transport"
    """The connection broke before the first token."""
    # After the first token (the stream resumes on another shard):
    STREAM_IDLE = "stream_idle"
    """Nothing for ``idle_timeout_s`` (or the silence timeout) mid-stream."""
    STREAM_BROKEN = "stream_broken"
    """The connection broke mid-stream."""
    MEMBERSHIP_LOST = "membership_lost"
    """The shard left membership (critical or gone) mid-stream."""
    STREAM_ERROR = "stream_error"
    """The shard sent an error event mid-stream (a resume reason; not held against the shard)."""
    PIPELINE_STAGE_LOST = "pipeline_stage_lost"
    """The shard's error event said it lost a pipeline stage, before the first token (a retry, held against
    the shard) or after it (a resume, as stream_error): counted apart so the loss is seen from the
    gateway, which Prometheus scrapes whatever becomes of the shard."""

    @classmethod
    def for_stream_error(cls, code: str | None, first_token: bool = True) -> FailureReason:
        """The reason for a shard's error event, after the first token or before it: the shard's code when
        it names a stage loss."""
        if code == PipelineStageLost.code:
            return cls.PIPELINE_STAGE_LOST
        return cls.STREAM_ERROR if first_token else cls.STREAM_ERROR_BEFORE_FIRST_TOKEN

    @classmethod
    def for_status(cls, status: int) -> FailureReason:
        """The reason for a retryable HTTP status (429 or 5xx)."""
        return _BY_STATUS.get(status, cls.STATUS_5XX)


_BY_STATUS = {
    429: FailureReason.STATUS_429,
    500: FailureReason.STATUS_500,
    502: FailureReason.STATUS_502,
    503: FailureReason.STATUS_503,
    504: FailureReason.STATUS_504,
}


class CircuitState(StrEnum):
    """A shard's place in routing."""

    CLOSED = "closed"
    """In routing (possibly with a few recent failures)."""
    OPEN = "open"
    """Ejected until ``open_until``; then the next decision may send it one probe."""
    HALF_OPEN = "half_open"
    """One probe request in flight; nothing else is sent to it."""


@dataclass
class Circuit:
    """One shard's breaker. The router keeps one per shard with recent failures (none: CLOSED)."""

    state: CircuitState = CircuitState.CLOSED
    failures: int = 0
    """Consecutive failures."""
    openings: int = 0
    """Times opened since it was last CLOSED (the hold doubles with each)."""
    open_until: float = 0.0
    """Clock time at which an OPEN circuit may be probed."""

    def ignores_success(self) -> bool:
        """A success reported while OPEN came from a call routed before the ejection: only the probe after the
        hold closes the circuit (closing on it ended ejections within milliseconds under concurrent traffic)."""
        return self.state is CircuitState.OPEN

    def probe_due(self, now: float) -> bool:
        return self.state is CircuitState.OPEN and now >= self.open_until

    def transition_to(self, state: CircuitState, *, now: float = 0.0, hold_s: float = 0.0) -> None:
        """The one place the state changes: OPEN holds for `hold_s` from `now`; CLOSED forgets."""
        if state is CircuitState.OPEN:
            self.openings += 1
            self.open_until = now + hold_s
        elif state is CircuitState.CLOSED:
            self.failures = self.openings = 0
            self.open_until = 0.0
        self.state = state


__all__ = ["Circuit", "CircuitState", "FailureReason"]
