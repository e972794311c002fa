"""What one request through the gateway came to: one frozen record, produced once as the request ends.

    outcome = exchange.close(200, "ok")      # data_plane/gateway/exchange.py builds it, once
    ledger.record_request(outcome)           # data_plane/ledger/writer.py writes it (no text in it)

Here, in common, so the gateway that produces it and the ledger that writes it share one type without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

OK = "ok"
"""The code of a request that succeeded."""


@dataclass(frozen=True)
class Outcome:
    """A request's status, code, tokens and where it ran; durations are seconds from its arrival."""

    request_id: str
    trace_id: str
    status: int
    code: str
    """"ok", or the error code it ended with (an OpenAI error code, or client_disconnected)."""
    tier: str
    key_id: str
    """The key's short digest; "" when the request was never authenticated."""
    tenant: str
    model: str
    """The model it was served by; "" when no stream opened."""
    shard: str
    """The shard (or the response cache's replay) its stream came from; "" when none opened."""
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    """Arrival to the shard's first token; None when none came."""
    latency_s: float
    degradation_level: int
    session: bool
    output_kind: str
    """What the output followed: text, json_object, json_schema, regex, choice, grammar or tools."""
    tool_calls: int
