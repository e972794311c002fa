"""JSON nested past Python's parser, where the body-level depth check does not look: inside a string
(a tool call's `arguments` in a client's history), and in the cache nodes' record APIs; and the
NaN/Infinity that parser takes though they are not JSON.

    .venv/bin/python -m pytest tests/reliability/test_nesting.py -q

`json.loads` raises RecursionError, not ValueError, for text nested ~1000 deep; a handler that caught
only ValueError answered 500 (and, outside the chat route, reset the keep-alive connection).
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.support.chat import assert_openai_error, chat
from tests.support.cluster import KEYS, Cluster
from tests.support.metrics import metric
from tests.support.procs import CLUSTER_HEADERS

DEEP = "[" * 100_000 + "]" * 100_000
"""200 KB of text no Python JSON parser can read (under the 1 MiB body bound)."""


def _post(c: Cluster, path: str, body: dict[str, Any]) -> httpx.Response:
    auth = {"Authorization": f"Bearer {KEYS['plus']}"}
    return httpx.post(c.gateway.url + path, json=body, headers=auth, timeout=60)


def _answered(r: httpx.Response) -> None:
    """Served, or refused in OpenAI's shape for what this cluster's synthetic shards do not do (tools)."""
    if r.status_code != 200:
        assert_openai_error(r, 400, "unsupported_parameter")


def test_deeply_nested_tool_call_arguments_in_history_are_no_500(cluster: Cluster) -> None:
    """A replayed assistant turn's `arguments` is any text the client kept (OpenAI does not parse it);
    one nested past the parser was a 500 on every route that renders history, chat and Responses."""
    before = metric(cluster.gateway.url, "switchboard_router_upstream_failures_total")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    for stream in (False, True):
        r = _post(cluster, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "stream": stream})
        _answered(r)
    items = [{"type": "message", "role": "user", "content": "x"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    routes: list[tuple[str, dict[str, Any]]] = [
        ("/v1/responses", {"model": "synthetic", "input": items, "max_output_tokens": 4}),
        ("/v1/responses/input_tokens", {"model": "synthetic", "input": items}),
        ("/v1/responses/compact", {"model": "synthetic", "input": items}),
        ("/v1/conversations", {"items": items}),
    ]
    for path, body in routes:
        _answered(_post(cluster, path, body))
    assert metric(cluster.gateway.url, "switchboard_router_upstream_failures_total") == before
    assert chat(cluster.gateway.url, "enterprise").status_code == 200


def test_cache_node_refuses_a_body_nested_too_deeply_with_a_400(cluster: Cluster) -> None:
    """The cache node's record PUTs parse their body whole: nested past the parser it was a 500 (with the
    cluster token, so only a member could send one, but a 500 all the same)."""
    node = cluster.caches[0].url
    headers = {**CLUSTER_HEADERS, "content-type": "application/json"}
    for path in ("/v1/sessions/sess_nesting", "/v1/response-cache/sess_nesting"):
        for body in (DEEP, '{"a":' * 50_000 + "1" + "}" * 50_000):
            r = httpx.put(node + path, content=body.encode(), headers=headers, timeout=30)
            assert_openai_error(r, 400, "invalid_json")
    ok = {"owner": "o", "version": 1, "messages": [{"role": "user", "content": json.dumps([[1]])}]}
    assert httpx.put(node + "/v1/sessions/sess_nesting", json=ok, headers=CLUSTER_HEADERS).status_code == 200


def test_cache_node_refuses_nan_and_infinity_so_no_record_is_poisoned(cluster: Cluster) -> None:
    """Python's parser takes NaN and Infinity; no JSON encoder writes them back. A record PUT with an
    `updated_at` of Infinity was stored (and its PUT answered 500), and every GET of it after was a 500."""
    node = cluster.caches[0].url
    headers = {**CLUSTER_HEADERS, "content-type": "application/json"}
    for constant in ("Infinity", "NaN", "-Infinity"):
        body = '{"owner": "o", "version": 1, "messages": [], "updated_at": ' + constant + "}"
        r = httpx.put(node + "/v1/sessions/sess_constant", content=body.encode(), headers=headers, timeout=30)
        assert_openai_error(r, 400, "invalid_json")
        assert_openai_error(httpx.get(node + "/v1/sessions/sess_constant", headers=CLUSTER_HEADERS), 404)


def test_cache_node_refuses_a_lone_surrogate_with_a_400(cluster: Cluster) -> None:
    """JSON may escape a lone surrogate; no UTF-8 encoder takes it: the node's store raised, a 500 (and a
    reset keep-alive connection)."""
    body = b'{"owner": "o", "version": 1, "messages": [{"role": "user", "content": "\\udfff"}]}'
    headers = {**CLUSTER_HEADERS, "content-type": "application/json"}
    for path in ("/v1/sessions/sess_surrogate", "/v1/response-cache/sess_surrogate"):
        r = httpx.put(cluster.caches[0].url + path, content=body, headers=headers, timeout=30)
        assert_openai_error(r, 400, "invalid_json")


def test_numbers_no_encoder_writes_back_are_a_400_on_the_public_routes(cluster: Cluster) -> None:
    """NaN, Infinity and 1e400 (which Python's parser reads as inf) were taken in a request body. A Responses
    request whose tool schema held one generated, was billed, and then answered 500: the response object echoes
    its tools, and no JSON encoder writes them. Each is now refused as the JSON it is not, before anything runs."""
    auth = {"Authorization": f"Bearer {KEYS['plus']}", "content-type": "application/json"}
    for number in ("NaN", "Infinity", "-Infinity", "1e400", "-1E+999"):
        tool = ('{"type": "function", "name": "f", "strict": false, "parameters": {"type": "object", '
                '"properties": {"a": {"type": "number", "default": ' + number + "}}}}")
        bodies = {"/v1/responses": '{"model": "synthetic", "input": "hi", "max_output_tokens": 2, "tool_choice": "none", '
                                   '"tools": [' + tool + "]}",
                  "/v1/chat/completions": '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                                          '"temperature": ' + number + "}",
                  "/v1/conversations": '{"metadata": {}, "items": [], "x": ' + number + "}"}
        for path, body in bodies.items():
            r = httpx.post(cluster.gateway.url + path, content=body.encode(), headers=auth, timeout=60)
            assert_openai_error(r, 400, "invalid_json")
    node = cluster.caches[0].url
    body = b'{"owner": "o", "version": 1, "messages": [], "updated_at": 1e400}'
    r = httpx.put(node + "/v1/sessions/sess_overflow", content=body, headers={**CLUSTER_HEADERS,
                  "content-type": "application/json"}, timeout=30)
    assert_openai_error(r, 400, "invalid_json")
    assert_openai_error(httpx.get(node + "/v1/sessions/sess_overflow", headers=CLUSTER_HEADERS), 404)
