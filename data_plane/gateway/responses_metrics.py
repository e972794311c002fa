"""Metrics and spans of the Responses and Conversations APIs and of stored chat completions (their generations are also counted as
chat requests are: switchboard_gateway_*, the same TTFT, tokens and ledger).

    metrics = ResponsesMetrics(registry)
    with observed(metrics, Op.RETRIEVE, request):   # span responses.retrieve, a count by op and status, a latency
        ...
    metrics.requests.labels(Op.CREATE.value, "200").inc()
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.requests import Request

from data_plane.common.errors import SwitchboardError, name_request
from data_plane.common.telemetry import LATENCY_BUCKETS

tracer = trace.get_tracer(__name__)


class Op(str, enum.Enum):
    """One Responses/Conversations/stored Chat Completions operation (the metric's `op` label)."""

    CREATE = "create"
    RETRIEVE = "retrieve"
    DELETE = "delete"
    INPUT_ITEMS = "input_items"
    COMPACT = "compact"
    INPUT_TOKENS = "input_tokens"
    CANCEL = "cancel"
    BACKGROUND = "background"
    """A background response's own run (its create is counted as CREATE, answered at once)."""
    CONVERSATION_CREATE = "conversation_create"
    CONVERSATION_RETRIEVE = "conversation_retrieve"
    CONVERSATION_UPDATE = "conversation_update"
    CONVERSATION_DELETE = "conversation_delete"
    ITEMS_LIST = "items_list"
    ITEMS_CREATE = "items_create"
    ITEM_RETRIEVE = "item_retrieve"
    ITEM_DELETE = "item_delete"
    CHAT_STORE = "chat_store"
    """A chat completion kept because of `store: true` (its generation is counted as a chat request)."""
    CHAT_RETRIEVE = "chat_retrieve"
    CHAT_LIST = "chat_list"
    CHAT_UPDATE = "chat_update"
    CHAT_DELETE = "chat_delete"
    CHAT_MESSAGES = "chat_messages"


STATUSES = ("200", "400", "401", "404", "409", "429", "499", "500", "503")
"""Statuses counted by their own value; any other is counted as "other"."""


class ResponsesMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("switchboard_responses_requests_total",
                                "Responses, Conversations and stored Chat Completions API requests by operation and HTTP "
                                "status.",
                                ["op", "status"], registry=registry)
        self.seconds = Histogram("switchboard_responses_op_seconds",
                                 "Time to serve a stored-state operation (retrieve, delete, lists, conversations, "
                                 "compact, stored chat completions and their store on create); creating a response "
                                 "is timed like a chat request.", ["op"],
                                 buckets=LATENCY_BUCKETS, registry=registry)
        for op in Op:
            self.requests.labels(op.value, "200")

    def count(self, op: Op, status: int) -> None:
        label = str(status) if str(status) in STATUSES else "other"
        self.requests.labels(op.value, label).inc()


@contextmanager
def observed(metrics: ResponsesMetrics, op: Op, request: Request) -> Iterator[trace.Span]:
    """The operation's span, count and latency. Its error (rendered by the app's handler,
    data_plane/common/errors.py `render`) carries a request id and the trace id, in the body and the
    X-Request-Id / X-Trace-Id headers, as the chat path's errors do: a complaint leads to the trace."""
    started = time.perf_counter()
    status = 500
    with tracer.start_as_current_span(f"responses.{op.value}") as span:
        span.set_attribute("gen_ai.operation.name", f"responses.{op.value}")
        name_request(request, span)
        try:
            yield span
            status = 200
        except SwitchboardError as exc:
            status = exc.status
            span.set_attribute("error.type", exc.code or "error")
            raise
        finally:
            span.set_attribute("http.response.status_code", status)
            metrics.count(op, status)
            metrics.seconds.labels(op.value).observe(time.perf_counter() - started)
