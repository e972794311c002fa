"""A chat request's holdings (data_plane/gateway/exchange.py): released exactly once, whoever closes."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from data_plane.common.disconnect import CLIENT_DISCONNECTED, DisconnectWatch
from data_plane.common.outcome import OK, Outcome
from data_plane.gateway.exchange import Exchange
from data_plane.gateway.metrics import GatewayMetrics, RequestCode, request_code
from data_plane.protocol import PromptTokensDetails, Usage


class _Ticket:
    def __init__(self) -> None:
        self.released: list[int | None] = []

    def release(self, used_tokens: int | None = None) -> None:
        self.released.append(used_tokens)


class _Limiter:
    def __init__(self) -> None:
        self.settled: list[tuple[Any, int]] = []
        self.requests_back: list[bool] = []

    def settle_later(self, grant: Any, used: int, refund_request: bool = False) -> None:
        self.settled.append((grant, used))
        self.requests_back.append(refund_request)


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
    assert limiter.requests_back == [False]  # the client's 4xx still counts against its RPM


def test_a_5xx_before_any_shard_gives_the_request_back_one_after_work_does_not() -> None:
    limiter = _Limiter()
    shed = _exchange(CollectorRegistry(), limiter, _Span(), [])
    shed.grant = object()  # type: ignore[assignment]
    shed.close(503, "overloaded")  # shed by admission: the server's doing, retried as told
    served = _exchange(CollectorRegistry(), limiter, _Span(), [])
    served.grant = object()  # type: ignore[assignment]
    served.first_token_at, served.used_tokens = 1.0, 30
    served.close(503, "cache_unavailable")  # generated, then could not store: the work was done
    assert limiter.settled == [(shed.grant, 0), (served.grant, 30)] and limiter.requests_back == [True, False]


def test_a_server_cancel_releases_without_counting_the_request() -> None:
    registry, limiter, span, records = CollectorRegistry(), _Limiter(), _Span(), []
    x = _exchange(registry, limiter, span, records)
    ticket = _Ticket()
    x.admitted(ticket)  # type: ignore[arg-type]
    x.first_token_at = 1.0  # a stream broke before usage came: the estimate is kept (None)
    x.close(None)
    assert records == [] and ticket.released == [None] and span.ended == 1
    assert _value(registry, "switchboard_gateway_inflight_requests", tier="plus") == 0


def test_close_produces_one_frozen_outcome_with_what_the_phases_set() -> None:
    registry, limiter, span = CollectorRegistry(), _Limiter(), _Span()
    outcomes: list[Outcome] = []
    x = Exchange(GatewayMetrics(registry), limiter, span, "r1", DisconnectWatch(_receive),  # type: ignore[arg-type]
                 on_record=outcomes.append, t0=time.monotonic() - 1.0, level=2)
    x.tier_name, x.key_id, x.tenant, x.session_id, x.output_kind = "plus", "k1", "acme", "sess_1", "tools"
    x.model, x.shard, x.tool_calls, x.first_token_at = "m", "shard-0", 2, x.t0 + 0.25
    x.usage = Usage(prompt_tokens=7, completion_tokens=3, total_tokens=10,
                    prompt_tokens_details=PromptTokensDetails(cached_tokens=4))
    returned = x.close(200, OK)
    assert outcomes == [returned] and returned is not None
    o = returned
    assert (o.request_id, o.status, o.code, o.tier, o.key_id, o.tenant, o.model, o.shard) == \
        ("r1", 200, "ok", "plus", "k1", "acme", "m", "shard-0")
    assert (o.prompt_tokens, o.cached_tokens, o.completion_tokens, o.tool_calls) == (7, 4, 3, 2)
    assert o.ttft_s == 0.25 and o.latency_s >= 1.0 and o.degradation_level == 2 and o.session
    assert o.output_kind == "tools" and len(o.trace_id) == 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.status = 500  # type: ignore[misc]
    assert x.close(500, "internal_error") is None


def test_the_code_label_is_bounded_and_the_outcome_keeps_the_real_code() -> None:
    registry, limiter, span = CollectorRegistry(), _Limiter(), _Span()
    outcomes: list[Outcome] = []
    x = Exchange(GatewayMetrics(registry), limiter, span, "r1", DisconnectWatch(_receive),  # type: ignore[arg-type]
                 on_record=outcomes.append)
    x.tier_name = "plus"
    x.close(502, "a-remote-servers-own-code-123")
    assert _value(registry, "switchboard_gateway_requests_total", tier="plus", status="502", code="other") == 1
    assert outcomes[0].code == "a-remote-servers-own-code-123"  # the ledger's error_code is not a label
    assert request_code(CLIENT_DISCONNECTED) is RequestCode.CLIENT_DISCONNECTED


CODE_SOURCES = ("data_plane/common", "data_plane/gateway", "data_plane/routing", "data_plane/cache/client.py",
                "data_plane/cache/model.py", "data_plane/cache/storage.py", "data_plane/shard/app.py",
                "data_plane/shard/engines/grammar.py")
"""Where the codes a gateway answers with are written: its own errors, and those its shards and cache
nodes send it (passed through)."""


def test_every_code_the_gateway_can_answer_with_is_a_label_value() -> None:
    root = Path(__file__).resolve().parents[2]
    files = [f for src in CODE_SOURCES for f in ([root / src] if src.endswith(".py") else (root / src).rglob("*.py"))]
    written = {m for f in files for m in re.findall(r'\bcode\s*=\s*"([a-z_]+)"', f.read_text(encoding="utf-8"))}
    assert {"invalid_json", "rate_limit_exceeded", "session_not_found", "abuse_blocked"} <= written  # it read them
    assert {c for c in written if request_code(c) is RequestCode.OTHER} == set()


def test_every_code_the_request_checks_word_is_a_label_value() -> None:
    """The codes OpenAI's words for a refused value carry (request_checks.openai_words, metadata_bounds: returned
    beside the message, or a PydanticCustomError's context) are counted as invalid_value or as themselves, not
    as other: metadata with 17 pairs, invalid_value before it had OpenAI's words, was counted as other."""
    root = Path(__file__).resolve().parents[2]
    text = "\n".join((root / f).read_text(encoding="utf-8") for f in ("data_plane/request_checks.py",
                                                                      "data_plane/structured.py"))
    written = set(re.findall(r', "([a-z_]+)"\n', text)) | set(re.findall(r'"code": "([a-z_]+)"', text))
    assert {"object_above_max_properties", "missing_required_parameter", "empty_string"} <= written  # it read them
    assert {c for c in written if request_code(c) is RequestCode.OTHER} == set()


def test_every_grammar_code_is_a_label_value() -> None:
    """The structured-output codes a shard sends (its compiler's failures) and the gateway's own schema
    checks write (positional in a Clash): counted as themselves, not as other."""
    from data_plane.shard.choices import _GRAMMAR_CODES

    root = Path(__file__).resolve().parents[2]
    clashes = set(re.findall(r'Clash\([^)]*"([a-z_]+)"\)', (root / "data_plane/structured.py").read_text()))
    assert "grammar_too_large" in clashes  # it read them
    assert {request_code(c) for c in {*_GRAMMAR_CODES.values(), *clashes}} <= set(RequestCode) - {RequestCode.OTHER}
