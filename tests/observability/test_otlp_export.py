"""Spans leave over OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT is set: a real shard process
exports to a real HTTP receiver on loopback (a stand-in collector that decodes the protobuf).

Also: the lean tracer honours the caller's traceparent and the standard sampler variables.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from data_plane.common.tracing import LeanSpan, LeanTracerProvider, Sampler
from tests.support.procs import CLUSTER_HEADERS, Service

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


class Collector:
    """An OTLP/HTTP (protobuf) trace receiver on a free loopback port."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []  # (service.name, span)
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                for rs in request.resource_spans:
                    service = next((a.value.string_value for a in rs.resource.attributes
                                    if a.key == "service.name"), "")
                    for ss in rs.scope_spans:
                        collector.spans.extend((service, s) for s in ss.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.close()


def test_a_shard_exports_its_spans_over_otlp(collector: Collector) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with Service(["shard", "--engine", "synthetic"], env=env) as shard:
        r = httpx.post(shard.url + "/v1/chat/completions", timeout=10.0,
                       headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01", **CLUSTER_HEADERS},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(s.name == "shard.generate" for _, s in collector.spans):
            time.sleep(0.1)
    generate = [(svc, s) for svc, s in collector.spans if s.name == "shard.generate"]
    assert generate, f"no shard.generate span exported; got {[s.name for _, s in collector.spans]}"
    service, span = generate[0]
    assert service == "switchboard-shard"
    assert span.trace_id.hex() == TRACE_ID  # continues the caller's trace
    assert span.parent_span_id.hex() == "00f067aa0ba902b7"
    attributes = {a.key for a in span.attributes}
    assert {"gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"} <= attributes
    assert span.end_time_unix_nano > span.start_time_unix_nano > 0


def test_sampler_variables_are_honoured() -> None:
    ended: list[LeanSpan] = []
    none = LeanTracerProvider(ended.append, Sampler.from_env({"OTEL_TRACES_SAMPLER": "always_off"}))
    span = none.get_tracer("t").start_span("x")
    assert not span.is_recording() and span.get_span_context().is_valid  # still propagates an id
    span.end()
    half = LeanTracerProvider(ended.append, Sampler.from_env({"OTEL_TRACES_SAMPLER": "traceidratio",
                                                               "OTEL_TRACES_SAMPLER_ARG": "0.5"}))
    recorded = sum(half.get_tracer("t").start_span("y").is_recording() for _ in range(4000))
    assert 1700 < recorded < 2300
    assert Sampler.from_env({}) == Sampler(1.0, True)
    assert Sampler.from_env({"OTEL_TRACES_SAMPLER": "bogus"}) == Sampler(1.0, True)


def test_a_refused_request_is_recorded_by_its_code_not_its_words() -> None:
    """A client error's message quotes what the client sent (a schema's type, a regex, pydantic's whole
    body): a span recorded it as `exception.message`/`stacktrace` and in its status, so a canary in a
    refused structured-output regex reached the gateway's router.route span, and a transcript a cache node
    refused reached its cache_node.put span (and any OTLP collector). A server error keeps its words."""
    from pydantic import BaseModel, ValidationError

    from data_plane.common.errors import InvalidRequest

    class Body(BaseModel):
        owner: str

    canary = "CANARY-4f2a"
    ended: list[LeanSpan] = []
    tracer = LeanTracerProvider(ended.append, Sampler(1.0, True)).get_tracer("t")
    try:
        Body.model_validate({"owner": 5, "messages": [{"content": canary}]})
    except ValidationError as exc:
        invalid_body: Exception = exc
    for refused in (InvalidRequest(f"the regex is not valid: {canary}(", code="invalid_regex"), invalid_body):
        with pytest.raises(type(refused)), tracer.start_as_current_span("router.route"):
            raise refused
    with pytest.raises(RuntimeError), tracer.start_as_current_span("shard.generate"):
        raise RuntimeError(f"engine failed at {canary}")
    refused_regex, refused_body, failed = ended
    for span in (refused_regex, refused_body):
        (event,) = span.events
        assert canary not in repr(event.attributes) + repr(span.status), span
        assert event.attributes["exception.type"] in ("InvalidRequest", "ValidationError")
    assert refused_regex.events[0].attributes["error.type"] == "invalid_regex"
    assert canary in failed.events[0].attributes["exception.message"]  # a 5xx's words are the operator's to read
