"""A chat request's holdings (data_plane/gateway/exchange.py): released exactly once, whoever closes."""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from prometheus_client import CollectorRegistry

from data_plane.common.disconnect import DisconnectWatch
from data_plane.gateway.exchange import Exchange
from data_plane.gateway.metrics import GatewayMetrics


class _Ticket:
    def __init__(self) -> None:
        self.released: list[int | None] = []

    def release(self, used_tokens: int | None = None) -> None:
        self.released.append(used_tokens)


class _Limiter:
    def __init__(self) -> None:
        self.settled: list[tuple[Any, int]] = []

    def settle_later(self, grant: Any, used: int) -> None:
        self.settled.append((grant, used))


class _Span(trace.NonRecordingSpan):
    def __init__(self) -> None:
        super().__init__(trace.INVALID_SPAN_CONTEXT)
        self.ended = 0

    def end(self, end_time: int | None = None) -> None:
        self.ended += 1


async def _receive() -> dict[str, str]:
    return {"type": "http.request"}


def _exchange(registry: CollectorRegistry, limiter: _Limiter, span: _Span, records: list) -> Exchange:
    x = Exchange(GatewayMetrics(registry), limiter, span, "r1", DisconnectWatch(_receive),  # type: ignore[arg-type]
                 on_record=lambda o: records.append((o.status, o.code)))
    x.tier_name = "plus"
    return x


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_close_releases_everything_once() -> None:
    registry, limiter, span, records = CollectorRegistry(), _Limiter(), _Span(), []
    x = _exchange(registry, limiter, span, records)
    ticket, grant = _Ticket(), object()
    x.grant = grant  # type: ignore[assignment]
    x.admitted(ticket)  # type: ignore[arg-type]
    assert _value(registry, "switchboard_gateway_inflight_requests", tier="plus") == 1
    x.first_token_at, x.used_tokens = 1.0, 42
    x.close(200, "ok")
    x.close(499, "client_disconnected")  # a second exit path: nothing more happens
    assert _value(registry, "switchboard_gateway_inflight_requests", tier="plus") == 0
    assert _value(registry, "switchboard_gateway_requests_total", tier="plus", status="200", code="ok") == 1
    assert _value(registry, "switchboard_gateway_requests_total", tier="plus", status="499",
                  code="client_disconnected") == 0
    assert records == [(200, "ok")] and ticket.released == [42] and limiter.settled == [(grant, 42)]
    assert span.ended == 1 and x.closed


def test_before_any_shard_the_estimate_is_refunded_and_no_gauge_moves() -> None:
    registry, limiter, span, records = CollectorRegistry(), _Limiter(), _Span(), []
    x = _exchange(registry, limiter, span, records)
    x.grant = object()  # type: ignore[assignment]
    x.close(429, "rate_limit_exceeded")
    assert limiter.settled[0][1] == 0 and records == [(429, "rate_limit_exceeded")]
    assert _value(registry, "switchboard_gateway_inflight_requests", tier="plus") == 0


def test_a_server_cancel_releases_without_counting_the_request() -> None:
    registry, limiter, span, records = CollectorRegistry(), _Limiter(), _Span(), []
    x = _exchange(registry, limiter, span, records)
    ticket = _Ticket()
    x.admitted(ticket)  # type: ignore[arg-type]
    x.first_token_at = 1.0  # a stream broke before usage came: the estimate is kept (None)
    x.close(None)
    assert records == [] and ticket.released == [None] and span.ended == 1
    assert _value(registry, "switchboard_gateway_inflight_requests", tier="plus") == 0
