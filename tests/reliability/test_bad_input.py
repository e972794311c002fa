"""Bad input: schemathesis against both OpenAPI documents, a handcrafted table, slow and vanishing
clients.

    .venv/bin/python -m pytest tests/reliability/test_bad_input.py -q -s
    .venv/bin/python -m pytest tests/reliability/test_bad_input.py -q -m slow     # the 30 s timeouts

Every answer to a bad input must be a 4xx in the OpenAI error shape (a 503 with Retry-After where
capacity is the reason), never a 5xx, never a stack trace, and never count as a shard failure:
the router ejects shards after consecutive failures, so an input that makes a shard fail is a
denial of service for every tenant, not just an error for its sender.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from data_plane.common.http_body import BODY_TIMEOUT_S
from data_plane.protocol import ChatCompletionRequest
from tests.reliability.common import report, rss_kb
from tests.reliability.inputs import CASES
from tests.support.chat import assert_no_leak, assert_openai_error, chat
from tests.support.cluster import ADMIN_TOKEN, KEYS, Cluster, api_keys_env
from tests.support.metrics import metric
from tests.support.procs import CLUSTER_HEADERS, Service
from tests.support.waits import eventually

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
MAX_EXAMPLES = 25
"""Per operation and phase; keeps each schemathesis run to ~10-20 s here."""


def _failures(c: Cluster) -> float:
    return metric(c.gateway.url, "switchboard_router_upstream_failures_total")


# -- schemathesis ------------------------------------------------------------------------------


def _chat_schema(spec: dict[str, Any], model: str) -> dict[str, Any]:
    """The gateway's OpenAPI with the chat body described (the route reads the raw request, so
    FastAPI documents no body): the wire schema minus parameters accepted only at neutral values,
    with the served model and the tiers' output cap, so most generated requests are valid."""
    schema = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    spec.setdefault("components", {}).setdefault("schemas", {}).update(schema.pop("$defs", {}))
    from data_plane.protocol import _NEUTRAL  # the parameters accepted only at a neutral value

    for name in _NEUTRAL:
        schema["properties"].pop(name, None)
    schema["properties"]["model"] = {"type": "string", "enum": [model, ""]}
    schema["properties"]["max_tokens"] = {
        "anyOf": [{"type": "integer", "minimum": 1, "maximum": 64}, {"type": "null"}]
    }
    schema["properties"].pop("max_completion_tokens", None)
    spec["components"]["schemas"]["ChatCompletionRequest"] = schema
    op = spec["paths"]["/v1/chat/completions"]["post"]
    op["requestBody"] = {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}},
    }
    op.setdefault("parameters", []).append(
        {
            "name": "X-Session-Id",
            "in": "header",
            "required": False,
            "schema": {"type": "string", "pattern": "^(new|[A-Za-z0-9_.:-]{1,128})$"},
        }
    )
    return spec


def _schemathesis(location: str, base_url: str, token: str, workdir: Path, *extra: str) -> tuple[int, str]:
    """Run the schemathesis CLI bounded (examples per operation, request timeout, wall clock); its
    cache goes to `workdir`, not the repository."""
    if not SCHEMATHESIS.exists():
        pytest.skip("schemathesis is not installed (pip install schemathesis; it is in the test extra)")
    args = [
        str(SCHEMATHESIS),
        "run",
        location,
        "--url",
        base_url,
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        "7",
        "--generation-database",
        "none",
        "--phases",
        "examples,coverage,fuzzing",
        "--request-timeout",
        "20",
        "--workers",
        "1",
        "--no-color",
        "-H",
        f"Authorization: Bearer {token}",
        *extra,
    ]
    proc = subprocess.run(args, check=False, capture_output=True, text=True, timeout=300, cwd=workdir)
    return proc.returncode, proc.stdout + proc.stderr


def _cases(out: str) -> str:
    m = re.search(r"Test cases:\s*\n\s*(.+)", out)
    return m.group(1).strip() if m else "?"


def test_schemathesis_gateway_no_server_errors(cluster: Cluster, tmp_path: Path) -> None:
    spec = _chat_schema(httpx.get(cluster.gateway.url + "/openapi.json").json(), "synthetic")
    path = tmp_path / "gateway-openapi.json"
    path.write_text(json.dumps(spec))
    before = _failures(cluster)
    rc, out = _schemathesis(str(path), cluster.gateway.url, KEYS["enterprise"], tmp_path)
    report("schemathesis_gateway", cases=_cases(out), exit_code=rc)
    assert rc == 0, out[-6000:]
    assert _failures(cluster) == before, "a generated request made a shard fail"
    assert chat(cluster.gateway.url, "enterprise").status_code == 200


def test_schemathesis_admin_api_no_server_errors(lone_control_plane: Service, tmp_path: Path) -> None:
    # The blocking queries (GET /v1/state, GET /v1/registry/members wait up to 600 s) and the
    # registry's writes (which would let the fuzzer point the control plane at any URL) are left out.
    rc, out = _schemathesis(
        lone_control_plane.url + "/openapi.json",
        lone_control_plane.url,
        ADMIN_TOKEN,
        tmp_path,
        "--include-path-regex",
        "^/(admin/v1/|health$|v1/sd/)",
    )
    report("schemathesis_admin_api", cases=_cases(out), exit_code=rc)
    assert rc == 0, out[-6000:]
    assert httpx.get(lone_control_plane.url + "/health").status_code == 200


# -- the handcrafted table ---------------------------------------------------------------------


@pytest.mark.parametrize("name,body,headers,allowed", CASES, ids=[c[0] for c in CASES])
def test_handcrafted_input(
    cluster: Cluster, name: str, body: Any, headers: dict[str, str], allowed: set[int]
) -> None:
    h = {"Authorization": f"Bearer {KEYS['enterprise']}", "content-type": "application/json", **headers}
    h = {k: v for k, v in h.items() if v != ""}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    before = _failures(cluster)
    r = httpx.post(cluster.gateway.url + "/v1/chat/completions", content=raw, headers=h, timeout=30)
    assert r.status_code in allowed, (name, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code)
    assert _failures(cluster) == before, f"{name}: the input made a shard fail"


def test_unknown_model_by_id_is_404_model_not_found(cluster: Cluster) -> None:
    auth = {"Authorization": f"Bearer {KEYS['plus']}"}
    for model_id in ("gpt-7", "synthetic%00", "..%2F..%2Fadmin", "x" * 2000):
        r = httpx.get(f"{cluster.gateway.url}/v1/models/{model_id}", headers=auth)
        assert_openai_error(r, 404, "model_not_found" if "%2F" not in model_id else None)


def test_wrong_methods_and_paths_are_openai_errors(cluster: Cluster) -> None:
    auth = {"Authorization": f"Bearer {KEYS['plus']}"}
    for method, path, status in [
        ("PUT", "/v1/chat/completions", 405),  # GET lists stored completions (chat_store.py)
        ("PATCH", "/v1/chat/completions/chatcmpl-x", 405),
        ("PUT", "/v1/models", 405),
        ("GET", "/v1/completions", 405),  # POST is the legacy Completions API (completions.py)
        ("POST", "/v1/../admin/v1/tiers", 404),
        ("GET", "/v1/embeddings", 404),
    ]:
        r = httpx.request(method, cluster.gateway.url + path, headers=auth)
        assert_openai_error(r, status)


def test_every_route_that_reads_a_body_bounds_it(cluster: Cluster) -> None:
    """A body past the gateway's --max-body-bytes (1 MiB) is a 413 on every route that reads one, read no
    further than that. The Conversations routes, a stored chat completion's update and /v1/responses/compact
    read it whole: a 200 MB body took the gateway from 116 to 477 MB of RSS, to answer a 400."""
    assert cluster.gateway.proc is not None
    auth = {"Authorization": f"Bearer {KEYS['plus']}", "content-type": "application/json"}
    big = b'{"metadata":{"a":"' + b"x" * (48 << 20) + b'"}}'
    for path in ("/v1/conversations", "/v1/conversations/conv_x", "/v1/conversations/conv_x/items",
                 "/v1/chat/completions/chatcmpl-x", "/v1/responses/compact"):
        before = rss_kb(cluster.gateway.proc.pid)
        r = httpx.post(cluster.gateway.url + path, content=big, headers=auth, timeout=60)
        grew_mb = (rss_kb(cluster.gateway.proc.pid) - before) / 1024
        assert_openai_error(r, 413, "payload_too_large")
        assert grew_mb < 24, (path, grew_mb)


def test_lone_surrogate_is_a_400_not_a_shard_failure() -> None:
    """A JSON string may spell an unpaired UTF-16 surrogate (``"\\ud800"``); Python decodes it to a
    str that cannot be encoded to UTF-8. It must be refused as a bad request, not crash the shard's
    tokenizer: a crash is a 500, the router counts it against the shard, retries on the next one,
    and three such requests eject every shard for everyone."""
    shards = [Service(["shard", "--engine", "synthetic"]) for _ in range(2)]
    for s in shards:
        s.start(wait=False)
    try:
        for s in shards:
            s.wait_healthy()
        with Service(
            [
                "gateway",
                "--shard-urls",
                ",".join(s.url for s in shards),
                "--tokenizer",
                "whitespace",
                "--model-name",
                "synthetic",
            ],
            env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()},
        ) as gw:
            poison = b'{"messages":[{"role":"user","content":"hi \\ud800 there"}],"max_tokens":2}'
            statuses = []
            for _ in range(3):
                r = httpx.post(
                    gw.url + "/v1/chat/completions",
                    content=poison,
                    timeout=30,
                    headers={"Authorization": f"Bearer {KEYS['free']}", "content-type": "application/json"},
                )
                statuses.append(r.status_code)
            innocent = chat(gw.url, "enterprise")
            report(
                "lone_surrogate",
                poison_statuses=statuses,
                ejections=metric(gw.url, "switchboard_router_ejections_total"),
                enterprise_after=innocent.status_code,
            )
            assert innocent.status_code == 200, (
                f"PRODUCT BUG: 3 free-tier requests with a lone surrogate (statuses {statuses}) ejected every shard; "
                f"an enterprise request then got {innocent.status_code}: {innocent.text[:200]}"
            )
            assert statuses == [400] * 3, statuses
    finally:
        for s in shards:
            s.stop()


# -- clients that stall, vanish or walk away -----------------------------------------------------


def _raw_request_head(port: int, key: str, length: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
        ).encode()
    )
    return s


def _read_response(s: socket.socket) -> bytes:
    """One HTTP response off a raw socket: the head, then Content-Length bytes (or until closed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            return data
        data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    length = int(re.search(r"content-length:\s*(\d+)", head).group(1)) if "content-length" in head else None
    while length is not None and len(data.split(b"\r\n\r\n", 1)[1]) < length:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_idle_and_half_open_connections_do_not_hurt_serving(cluster: Cluster) -> None:
    """200 connections that send nothing and 50 that send headers but no body: the gateway keeps
    serving everyone else."""
    idle = [socket.create_connection(("127.0.0.1", cluster.gateway.port), timeout=5) for _ in range(200)]
    heads = [_raw_request_head(cluster.gateway.port, KEYS["plus"], 100) for _ in range(50)]
    try:
        t0 = time.monotonic()
        for i in range(10):
            assert chat(cluster.gateway.url, "enterprise", f"still there {i}").status_code == 200
        assert httpx.get(cluster.gateway.url + "/health").status_code == 200
        report(
            "idle_connections",
            idle=len(idle),
            headers_only=len(heads),
            ten_requests_s=round(time.monotonic() - t0, 2),
        )
    finally:
        for s in idle + heads:
            s.close()
    assert chat(cluster.gateway.url, "enterprise").status_code == 200


@pytest.mark.slow
def test_headers_without_body_get_408_after_the_body_timeout(cluster: Cluster) -> None:
    """No flag shortens the gateway's body timeout (data_plane/common/http_body.py BODY_TIMEOUT_S = 30 s)."""
    s = _raw_request_head(cluster.gateway.port, KEYS["plus"], 100)
    s.settimeout(BODY_TIMEOUT_S + 15)
    t0 = time.monotonic()
    try:
        data = _read_response(s)
    finally:
        s.close()
    waited = time.monotonic() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data[:300]
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert BODY_TIMEOUT_S - 1 <= waited <= BODY_TIMEOUT_S + 10
    report("headers_without_body", status=408, after_s=round(waited, 1))
    assert chat(cluster.gateway.url, "enterprise").status_code == 200


@pytest.mark.slow
def test_a_connection_that_sends_nothing_is_eventually_closed(cluster: Cluster) -> None:
    s = socket.create_connection(("127.0.0.1", cluster.gateway.port), timeout=5)
    bound = BODY_TIMEOUT_S + 5
    s.settimeout(bound)
    t0 = time.monotonic()
    try:
        data = s.recv(4096)
        closed = True
    except TimeoutError:
        data, closed = b"", False
    finally:
        s.close()
    report("connection_sending_nothing", closed_by_server=closed, waited_s=round(time.monotonic() - t0, 1))
    assert httpx.get(cluster.gateway.url + "/health").status_code == 200
    assert closed, (
        f"PRODUCT BUG: a connection that never sends a byte is still open after {bound:.0f} s "
        "(uvicorn starts its keep-alive timer only after a first response): slowloris"
    )
    assert data == b"" or data.startswith(b"HTTP/1.1 408")


@pytest.fixture(scope="module")
def slow_stack() -> Iterator[tuple[Service, Service]]:
    """One synthetic shard at 250 ms a token (16 tokens: 4 s a reply) behind a static gateway."""
    shard = Service(["shard", "--engine", "synthetic", "--synthetic-token-delay-ms", "250"])
    shard.start()
    gw = Service(
        ["gateway", "--shard-urls", shard.url, "--tokenizer", "whitespace", "--model-name", "synthetic"],
        env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()},
    )
    try:
        gw.start()
        yield shard, gw
    finally:
        gw.stop()
        shard.stop()


def _slot_freed(shard: Service, gw: Service) -> bool:
    return (
        httpx.get(shard.url + "/health").json()["running"] == 0
        and metric(gw.url, "switchboard_gateway_inflight_requests") == 0
        and metric(gw.url, "switchboard_router_outstanding_requests") == 0
    )


def test_client_disconnect_mid_stream_aborts_the_generation(slow_stack: tuple[Service, Service]) -> None:
    shard, gw = slow_stack
    aborted = metric(shard.url, "vllm:request_success_total", finished_reason="abort")
    body = {
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 16,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        gw.url + "/v1/chat/completions",
        json=body,
        timeout=30,
        headers={"Authorization": f"Bearer {KEYS['plus']}"},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):  # the first chunk is out; the reply needs ~3.75 s more
                break  # walk away: dropping the line iterator closes the connection
    # aborted, not finished: the shard counts it as an abort (a natural finish would count "length")
    freed_s = eventually(lambda: _slot_freed(shard, gw), 10.0, what="slot freed after the client left")
    eventually(lambda: metric(shard.url, "vllm:request_success_total", finished_reason="abort") == aborted + 1,
               10.0, what="the shard counted the abort")
    assert metric(gw.url, "switchboard_gateway_requests_total", code="client_disconnected") >= 1
    report("disconnect_mid_stream", slot_freed_after_s=round(freed_s, 2), natural_finish_s=3.75)


def test_client_disconnect_without_streaming_aborts_the_generation(
    slow_stack: tuple[Service, Service],
) -> None:
    """The shard aborts a non-streaming request whose client left (tests/data_plane/test_shard.py);
    through the gateway the same must hold, or clients that give up keep shards busy."""
    shard, gw = slow_stack
    eventually(lambda: _slot_freed(shard, gw), 5.0)
    aborted = metric(shard.url, "vllm:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            gw.url + "/v1/chat/completions",
            timeout=1.0,
            headers={"Authorization": f"Bearer {KEYS['plus']}"},
            json={"messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 16},
        )
    t0 = time.monotonic()
    try:
        freed_s = eventually(lambda: _slot_freed(shard, gw), 1.5)
    except AssertionError:
        freed_s = None
    report("disconnect_non_streaming", slot_freed_after_s=freed_s and round(freed_s, 2), natural_finish_s=3.0)
    if freed_s is None:
        eventually(lambda: _slot_freed(shard, gw), 6.0)  # leave the stack clean for whoever is next
        pytest.fail(
            f"PRODUCT BUG: a non-streaming client that disconnected kept its generation running to the "
            f"end ({time.monotonic() - t0:.1f} s after it left); the gateway must abort it"
        )
    assert metric(shard.url, "vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_error_bodies_never_leak_stack_traces(cluster: Cluster, lone_control_plane: Service) -> None:
    """One bad request per process and kind; schemathesis and the table above check the rest."""
    probes = [
        ("POST", cluster.gateway.url + "/v1/chat/completions", b"{", {"content-type": "application/json"}),
        ("GET", cluster.gateway.url + "/nope", None, {}),
        ("GET", cluster.shards[0].url + "/v1/models/nope", None, {}),
        (
            "POST",
            cluster.shards[0].url + "/v1/chat/completions",
            b'{"messages":[{"role":"x"}]}',
            {"content-type": "application/json", **CLUSTER_HEADERS},
        ),
        ("GET", cluster.caches[0].url + "/v1/sessions/bad%20id", None, {}),
        ("PUT", cluster.caches[0].url + "/v1/sessions/s1", b"[", {"content-type": "application/json"}),
        ("GET", lone_control_plane.url + "/v1/registry/members?wait=abc", None, {}),
        (
            "PUT",
            lone_control_plane.url + "/v1/registry/members/bad%20id",
            b"{}",
            {"content-type": "application/json"},
        ),
        (
            "GET",
            lone_control_plane.url + "/admin/v1/traces?limit=-1",
            None,
            {"Authorization": f"Bearer {ADMIN_TOKEN}"},
        ),
        (
            "PUT",
            lone_control_plane.url + "/admin/v1/tiers",
            b'{"tiers": 1}',
            {"Authorization": f"Bearer {ADMIN_TOKEN}", "content-type": "application/json"},
        ),
    ]
    for method, url, content, headers in probes:
        r = httpx.request(method, url, content=content, headers=headers, timeout=10)
        assert 400 <= r.status_code < 500, (method, url, r.status_code, r.text[:300])
        assert "error" in r.json(), (url, r.text[:300])
        assert_no_leak(r.text)
