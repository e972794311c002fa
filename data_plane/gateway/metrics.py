"""Gateway metrics: `switchboard_gateway_*`, labelled by tier and outcome (bounded labels only).

Built once by the gateway (data_plane/gateway/app.py); the chat handler and the stream record into it.

    metrics = GatewayMetrics(CollectorRegistry())
    metrics.requests.labels(tier="free", status="200", code=request_code("ok")).inc()

`code` is bounded: `RequestCode`, the codes the gateway answers with (its own errors' and the ones its
shards and cache nodes may pass through); any other code (a remote server's own) is counted as "other".
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from data_plane.common.telemetry import E2E_BUCKETS, LATENCY_BUCKETS
from data_plane.routing.hop_client import HOP_EVENTS


class RequestCode(enum.StrEnum):
    """The `code` label of switchboard_gateway_requests_total (docs/metrics.md, "Label values")."""

    OK = "ok"
    CLIENT_DISCONNECTED = "client_disconnected"
    ERROR = "error"
    """An error without a code (a remote one that gave none)."""
    INTERNAL_ERROR = "internal_error"
    HTTP_ERROR = "http_error"
    INVALID_VALUE = "invalid_value"
    INVALID_JSON = "invalid_json"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
    MUTUALLY_EXCLUSIVE_PARAMETERS = "mutually_exclusive_parameters"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    CONTENT_POLICY_VIOLATION = "content_policy_violation"
    INVALID_ENCRYPTED_CONTENT = "invalid_encrypted_content"
    INVALID_SESSION_ID = "invalid_session_id"
    INVALID_API_KEY = "invalid_api_key"
    INVALID_CLUSTER_TOKEN = "invalid_cluster_token"
    INVALID_METRICS_TOKEN = "invalid_metrics_token"
    """A /metrics scrape without the metrics or the cluster token (data_plane/common/hop_auth.py)."""
    PERMISSION_DENIED = "permission_denied"
    TIER_REMOVED = "tier_removed"
    """The key's tier is not in the hot tier policy (data_plane/gateway/tier_gate.py)."""
    ADDRESS_BANNED = "address_banned"
    ABUSE_BLOCKED = "abuse_blocked"
    ABUSE_THROTTLED = "abuse_throttled"
    NOT_FOUND = "not_found"
    MODEL_NOT_FOUND = "model_not_found"
    SESSION_NOT_FOUND = "session_not_found"
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"
    SESSION_VERSION_CONFLICT = "session_version_conflict"
    CONVERSATION_LOCKED = "conversation_locked"
    """A second writer on a stored conversation or chat session (data_plane/gateway/record_locks.py)."""
    DUPLICATE_REQUEST_ID = "duplicate_request_id"
    GRAMMAR_COMPILER_BUSY = "grammar_compiler_busy"
    GRAMMAR_TOO_LARGE = "grammar_too_large"
    GRAMMAR_TIMEOUT = "grammar_timeout"
    INVALID_GRAMMAR = "invalid_grammar"
    UNSUPPORTED_SCHEMA = "unsupported_schema"
    UNKNOWN_PARAMETER = "unknown_parameter"
    """A key an input item or content part does not define (data_plane/gateway/responses_input.py)."""
    INVALID_RESUME = "invalid_resume"
    INVALID_JSON_SCHEMA = "invalid_json_schema"
    INVALID_FUNCTION_PARAMETERS = "invalid_function_parameters"
    REQUEST_TIMEOUT = "request_timeout"
    REQUEST_HEADER_FIELDS_TOO_LARGE = "request_header_fields_too_large"
    """A request head past SWITCHBOARD_HTTP_MAX_HEAD_BYTES, refused by the protocol (data_plane/common/http_server.py)."""
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    OVERLOADED = "overloaded"
    NOT_READY = "not_ready"
    NO_HEALTHY_BACKEND = "no_healthy_backend"
    SERVER_SHUTTING_DOWN = "server_shutting_down"
    """A stream the gateway's shutdown cut past its grace (data_plane/gateway/stream.py), or a background
    response it stopped (data_plane/gateway/responses_background.py STOPPED_AS)."""
    PIPELINE_STAGE_LOST = "pipeline_stage_lost"
    CACHE_UNAVAILABLE = "cache_unavailable"
    CACHE_BACKEND_UNAVAILABLE = "cache_backend_unavailable"
    RECORD_TOO_LARGE = "record_too_large"
    USAGE_DISABLED = "usage_disabled"
    USAGE_DB_UNAVAILABLE = "usage_db_unavailable"
    MODEL_UNAVAILABLE = "model_unavailable"
    MODEL_LOADING = "model_loading"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    OTHER = "other"
    """Any code not listed above."""


_CODES = {c.value: c for c in RequestCode}
_CODES.update(dict.fromkeys((f"{number}_{side}_value" for number in ("integer", "decimal")
                             for side in ("above_max", "below_min")), RequestCode.INVALID_VALUE))
_CODES.update(dict.fromkeys(("invalid_type", "string_above_max_length", "array_above_max_length", "empty_array", "unsupported_value",
                             "empty_string", "object_above_max_properties"),
                            RequestCode.INVALID_VALUE))
"""OpenAI's finer codes for a value the request checks refuse (data_plane/request_checks.py openai_words):
counted as invalid_value, as they were before they had words of their own."""


def request_code(code: str) -> RequestCode:
    """`code` as the label's bounded value: itself when the gateway knows it (OpenAI's finer codes for a bad
    value as invalid_value), else OTHER."""
    return _CODES.get(code, RequestCode.OTHER)


REFUSED_ROUTES = ("debug_spans", "metrics")
"""``switchboard_gateway_refused_total``'s route label: the gateway's token-guarded routes (data_plane/common/
hop_auth.py RefusalMetrics). A bad API key on the chat API is a user's 401, counted in
switchboard_gateway_requests_total{code="invalid_api_key"}, not here."""

HOLDBACK_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("switchboard_gateway_requests", "Chat requests by tier, HTTP status and code (bounded: "
                                "RequestCode; an unknown code is other).",
                                ["tier", "status", "code"], registry=registry)
        self.endpoint_requests = Counter(
            "switchboard_gateway_endpoint_requests",
            "Requests of the APIs served over the chat path beside chat completions, by endpoint (completions: "
            "POST /v1/completions), HTTP status and code (bounded as switchboard_gateway_requests_total's, where each "
            "is counted too).", ["endpoint", "status", "code"], registry=registry)
        self.endpoint_requests.labels("completions", "200", RequestCode.OK.value)  # 0 from the start, not missing
        self.ttft = Histogram("switchboard_gateway_ttft_seconds",
                              "Time to first token as the client sees it: request received to the first content "
                              "byte written (after the output filter).", ["tier"], buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.holdback = Histogram("switchboard_gateway_output_holdback_seconds",
                                  "Shard's first token to the client's first content byte: what the output filter "
                                  "(and the gateway) add to TTFT.", ["tier"], buckets=HOLDBACK_BUCKETS,
                                  registry=registry)
        self.e2e = Histogram("switchboard_gateway_e2e_seconds", "Gateway-observed end-to-end request latency.",
                             ["tier"], buckets=E2E_BUCKETS, registry=registry)
        self.inflight = Gauge("switchboard_gateway_inflight_requests", "Chat requests in progress.", ["tier"],
                              registry=registry)
        self.tokens = Counter("switchboard_gateway_tokens", "Tokens served by tier and kind (prompt|completion).",
                              ["tier", "kind"], registry=registry)
        self.context_dropped = Counter("switchboard_gateway_context_dropped_messages",
                                       "Older session messages left out to fit the context window.", ["tier"],
                                       registry=registry)
        self.context_slides = Counter("switchboard_gateway_context_slides",
                                      "Requests whose window dropped older messages, by cut: moved (the first kept "
                                      "message is not the conversation's previous turn's: the prompt's start "
                                      "changed, the shard re-prefills it, no prefix-cache hit) | kept (the same cut "
                                      "as the previous turn: its prefix cache serves the history).",
                                      ["tier", "cut"], registry=registry)
        self.sessions = Counter("switchboard_gateway_sessions", "Session requests by result (new|resumed).",
                                ["tier", "result"], registry=registry)
        self.membership_reachable = Gauge("switchboard_membership_reachable",
                                          "1 while the membership registry answers; 0 = routing on last view.",
                                          registry=registry)
        self.membership_members = Gauge("switchboard_gateway_members", "Routable members seen by this gateway.",
                                        ["service"], registry=registry)
        self.control_plane_state_changes = Counter(
            "switchboard_gateway_control_plane_state_changes",
            "Times the control plane this gateway follows began serving another state (its state id changed: "
            "started with another state dir), its pin, tiers and abuse actions replacing the ones in force.",
            registry=registry)
        self.hop_connections = Counter(
            "switchboard_gateway_hop_connections",
            "Connections to shards and cache nodes by event: opened, reused (keep-alive), stale_retry "
            "(a kept-alive one the server had closed; sent again fresh), timeout, connect_error.",
            ["event"], registry=registry)
        for event in HOP_EVENTS:
            self.hop_connections.labels(event)
        self.revoked = Counter("switchboard_gateway_requests_revoked",
                               "Requests ended because their API key was revoked (or its tenant removed) while they "
                               "ran, by stage: opening (before the reply began: 401) | replying (mid-reply: an SSE "
                               "error event, or 401 before a JSON body).", ["stage"], registry=registry)

    def show_tiers(self, tiers: Iterable[str]) -> None:
        """Each tier's series of events a calm system may never see, at 0 from the start: a panel of an idle
        fleet reads 0, not "No data", and increase() sees the first event."""
        for tier in tiers:
            self.context_dropped.labels(tier)
