"""`switchboard bench ttft` (data_plane/bench/ttft_breakdown.py): a request's spans split into parts."""

from __future__ import annotations

import httpx
import pytest

from data_plane.bench.ttft_breakdown import PARTS, breakdown, recent_spans
from tests.support.procs import CLUSTER_TOKEN, Service


def span(trace: str, name: str, start_ms: float, end_ms: float, attributes: dict | None = None,
         events: list | None = None) -> dict:
    return {"trace_id": trace, "name": name, "start_ns": int(start_ms * 1e6), "end_ns": int(end_ms * 1e6),
            "attributes": attributes or {}, "events": events or []}


def test_the_parts_of_one_request_add_up() -> None:
    spans = [
        span("t1", "gateway.request", 0, 900, {"switchboard.gateway.ttft_s": 0.262, "switchboard.gateway.holdback_s": 0.001}),
        span("t1", "router.route", 5, 850, events=[{"name": "first_token", "time_ns": 261_000_000, "attributes": {}}]),
        span("t1", "shard.generate", 7, 800, {"gen_ai.usage.input_tokens": 1500},
             [{"name": "queue", "attributes": {"duration_s": 0.030}},
              {"name": "prefill", "attributes": {"duration_s": 0.200}}]),
        span("t2", "gateway.request", 0, 10),   # no shard span: left out
        span("t3", "gateway.request", 0, 10), span("t3", "router.route", 1, 9),
        span("t3", "shard.generate", 2, 9, {"gen_ai.usage.input_tokens": 20},
             [{"name": "queue", "attributes": {"duration_s": 0}}, {"name": "prefill", "attributes": {"duration_s": 0}}]),
    ]
    (row,) = breakdown(spans, min_prompt=1400)
    assert set(row) == set(PARTS)
    assert round(row["gateway before routing"], 3) == 5 and round(row["hop to the shard"], 3) == 2
    assert round(row["shard queue"], 3) == 30 and round(row["shard copy-in + prefill"], 3) == 200
    assert round(row["prefill done -> first token at the gateway"], 3) == 24
    assert round(row["gateway TTFT"], 3) == 262 and round(row["gateway hold-back"], 3) == 1


def test_the_spans_are_read_with_the_cluster_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's processes inherit the shell's SWITCHBOARD_CLUSTER_TOKEN (exported as the README's pipeline
    example does): their /debug/spans then need it, and the bench read them without it (a 401 body, then a
    TypeError adding two dicts)."""
    monkeypatch.setenv("SWITCHBOARD_CLUSTER_TOKEN", CLUSTER_TOKEN)
    with Service(["shard", "--engine", "synthetic"]).start() as shard:  # it holds CLUSTER_TOKEN
        assert httpx.get(shard.url + "/debug/spans").status_code == 401
        assert isinstance(recent_spans(shard.url), list)
