"""Security: keys, tiers, the admin token, sessions, what is never recorded, CORS.

    .venv/bin/python -m pytest tests/reliability/test_security.py -q -s

Covered elsewhere (not repeated): no/wrong key is 401 and the key is never echoed
(tests/data_plane/test_gateway.py::test_auth_required, tests/data_plane/test_auth.py); every admin
endpoint refuses no token, a wrong token and a token without "Bearer"
(tests/control_plane/test_admin_api.py::test_every_admin_endpoint_needs_the_token); another key
reading a session by header is 404 (test_gateway.py::test_session_replays_context_and_is_bound_to_its_key).
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.reliability.common import all_services, report, rss_kb
from tests.support.chat import assert_openai_error, chat
from tests.support.cluster import ADMIN_TOKEN, KEYS, Cluster, api_keys_env
from tests.support.metrics import metric, scrape
from tests.support.procs import CLUSTER_HEADERS, CLUSTER_TOKEN, STATE_DIR, Service
from tests.support.waits import eventually


def _trace() -> tuple[str, dict[str, str]]:
    trace_id = secrets.token_hex(16)
    return trace_id, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}


def _spans(urls: list[str], trace_id: str) -> list[dict]:
    out: list[dict] = []
    for url in urls:
        out += httpx.get(url + "/debug/spans", params={"trace_id": trace_id}, headers=CLUSTER_HEADERS).json()
    return out


# -- keys and tiers ------------------------------------------------------------------------------


def test_malformed_and_misplaced_keys_are_401(cluster: Cluster) -> None:
    key = KEYS["plus"]
    variants = {
        "no header": {},
        "scheme only": {"Authorization": "Bearer"},
        "basic auth": {"Authorization": "Basic " + base64.b64encode(f"user:{key}".encode()).decode()},
        "key without scheme": {"Authorization": key},
        "key plus a character": {"Authorization": f"Bearer {key}x"},
        "key prefix": {"Authorization": f"Bearer {key[:-1]}"},
        "key in X-API-Key": {"X-API-Key": key},
        "the admin token": {"Authorization": f"Bearer {ADMIN_TOKEN}"},
    }
    for name, headers in variants.items():
        for method, path in (
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"),
            ("GET", "/v1/models/synthetic"),
        ):
            body = {"messages": [{"role": "user", "content": "x"}]} if method == "POST" else None
            r = httpx.request(method, cluster.gateway.url + path, json=body, headers=headers)
            err = assert_openai_error(r, 401)
            assert err["type"] == "authentication_error", (name, path)
            assert key not in r.text and ADMIN_TOKEN not in r.text, name
    r = httpx.post(
        cluster.gateway.url + f"/v1/chat/completions?api_key={key}",
        json={"messages": [{"role": "user", "content": "x"}]},
    )
    assert_openai_error(r, 401)


def test_a_key_cannot_raise_its_tier(cluster: Cluster) -> None:
    """A free key that claims enterprise in every way a client might try keeps free's limits, cap,
    and scheduling priority (2) on the shard."""
    claims = {
        "X-Tier": "enterprise",
        "X-Switchboard-Tier": "enterprise",
        "X-Priority": "0",
        "X-Tenant": "bigco",
        "X-Service-Tier": "priority",
        "OpenAI-Organization": "bigco",
    }
    trace_id, tp = _trace()
    r = chat(
        cluster.gateway.url,
        "free",
        "who am i",
        headers={**claims, **tp},
        priority=-1000,
        service_tier="priority",
        user="admin",
        metadata={"tier": "enterprise"},
        max_tokens=4,
    )
    assert r.status_code == 200, r.text
    assert (
        r.headers["x-ratelimit-limit-requests"] == "60" and r.headers["x-ratelimit-limit-tokens"] == "20000"
    )
    time.sleep(0.3)
    spans = _spans([cluster.gateway.url, *(s.url for s in cluster.shards)], trace_id)
    gateway = [s for s in spans if s["name"] == "gateway.request"]
    generate = [s for s in spans if s["name"] == "shard.generate"]
    assert [s["attributes"]["switchboard.tier"] for s in gateway] == ["free"]
    assert [s["attributes"]["switchboard.priority"] for s in generate] == [2], generate
    over_cap = chat(cluster.gateway.url, "free", headers=claims, priority=0, max_tokens=300)
    assert_openai_error(over_cap, 400)
    assert over_cap.json()["error"]["param"] == "max_tokens"
    report("tier_escalation", attempts=len(claims) + 4, tier_seen="free", shard_priority=2)


def test_client_request_id_is_not_the_engine_key(cluster: Cluster) -> None:
    """The gateway forwards a client's X-Request-Id as the shard's request_id, the key engines abort
    by and refuse duplicates of. A client-chosen value must not reach it: a long one is refused today
    (400 on a field the client never sent), a duplicate one is a 503 the router counts against the
    shard (tests/reliability/test_security.py::test_duplicate_request_ids_cannot_eject_a_shard)."""
    r = chat(cluster.gateway.url, "plus", headers={"X-Request-Id": "q" * 200}, max_tokens=2)
    assert r.status_code == 200, (
        f"PRODUCT BUG: a 200-character X-Request-Id is forwarded to the shard as request_id: {r.status_code} "
        f"{r.text[:200]}"
    )


@pytest.mark.slow
def test_duplicate_request_ids_cannot_eject_a_shard(fp32_shard: Service) -> None:
    """The torch engine refuses a second running request with the same id (503); since the gateway
    uses the client's X-Request-Id as that id, a free key can make the real shard fail on purpose and
    get it ejected for every tenant."""
    with Service(
        ["gateway", "--shard-urls", fp32_shard.url, "--cache-urls", "http://127.0.0.1:1"],
        env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()},
    ) as gw:
        body = {
            "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "max_tokens": 400,
            "stream": True,
        }
        started = threading.Event()

        def long_stream() -> None:
            with httpx.stream(
                "POST",
                gw.url + "/v1/chat/completions",
                json=body,
                timeout=120,
                headers={"Authorization": f"Bearer {KEYS['plus']}", "X-Request-Id": "dup-1"},
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        started.set()
                        time.sleep(8)  # hold the stream open (and the id taken) while the others arrive
                        return

        holder = threading.Thread(target=long_stream, daemon=True)
        holder.start()
        assert started.wait(60)
        statuses = [
            chat(gw.url, "free", f"dup {i}", headers={"X-Request-Id": "dup-1"}, max_tokens=2).status_code
            for i in range(3)
        ]
        innocent = chat(gw.url, "enterprise", "hello", max_tokens=2, timeout=60)
        holder.join(30)
        report(
            "duplicate_request_id",
            statuses=statuses,
            ejections=metric(gw.url, "switchboard_router_ejections_total"),
            enterprise_after=innocent.status_code,
        )
        assert innocent.status_code == 200, (
            f"PRODUCT BUG: 3 free requests reusing another request's X-Request-Id (statuses {statuses}) ejected "
            f"the shard; an enterprise request then got {innocent.status_code}"
        )


# -- the admin API -------------------------------------------------------------------------------


def test_admin_api_refuses_the_gateway_key_and_near_miss_tokens(lone_control_plane: Service) -> None:
    url = lone_control_plane.url
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    marker = "near-miss-" + secrets.token_hex(4)
    near_misses = {
        "gateway API key": f"Bearer {KEYS['enterprise']}",
        "token plus a character": f"Bearer {ADMIN_TOKEN}x",
        "token prefix": f"Bearer {ADMIN_TOKEN[:-1]}",
        "token in basic auth": "Basic " + base64.b64encode(f"admin:{ADMIN_TOKEN}".encode()).decode(),
        "token in upper case": f"Bearer {ADMIN_TOKEN.upper()}",
    }
    for name, auth in near_misses.items():
        for method, path, body in (
            ("GET", "/admin/v1/tiers", None),
            ("PUT", "/admin/v1/degradation", {"level": 4, "reason": marker}),
        ):
            r = httpx.request(method, url + path, json=body, headers={"Authorization": auth})
            assert_openai_error(r, 401)
            assert ADMIN_TOKEN not in r.text, name
    assert (
        marker not in httpx.get(url + "/admin/v1/degradation", headers=admin).text
    )  # no refused PUT went through


def test_registry_drain_needs_the_admin_token(lone_control_plane: Service) -> None:
    """Draining a member is an admin action (POST /admin/v1/members/{id}/drain needs the token); the
    registry's own /v1/registry/members/{id}/drain must not be a way around it."""
    url = lone_control_plane.url
    member = {"service": "shard", "url": "http://127.0.0.1:9", "meta": {}, "ttl_s": 30}
    rogue = httpx.put(url + "/v1/registry/members/shard-rogue", json=member)
    assert rogue.status_code == 401, (
        f"PRODUCT BUG: registering a member (and so receiving prompts as a 'shard') needs no credential "
        f"({rogue.status_code})")
    joined = {"Authorization": f"Bearer {CLUSTER_TOKEN}"}
    registered = httpx.put(url + "/v1/registry/members/shard-victim", json=member, headers=joined)
    assert registered.status_code == 200, registered.text
    try:
        drained = httpx.post(url + "/v1/registry/members/shard-victim/drain")
        report("registry_writes_without_token", register=rogue.status_code, drain=drained.status_code)
        assert drained.status_code in (401, 403, 404, 405), (
            f"PRODUCT BUG: anyone who reaches the control plane drains a member without the admin token "
            f"(POST /v1/registry/members/{{id}}/drain -> {drained.status_code})"
        )
    finally:
        httpx.delete(url + "/v1/registry/members/shard-victim", headers=joined)


def test_the_control_plane_reads_no_large_body_before_its_token_check(lone_control_plane: Service) -> None:
    """FastAPI reads and parses a route's pydantic body before its dependencies run, the token check among
    them: a 150 MB body with no token took the control plane from 100 to 408 MB, for a 401. A body past
    its bound (8 MiB) is now a 413, declared (unread) or chunked (cut as it arrives)."""
    assert lone_control_plane.proc is not None
    pid, url = lone_control_plane.proc.pid, lone_control_plane.url
    big = b'{"a":"' + b"x" * (96 << 20) + b'"}'
    for path in ("/admin/v1/tiers", "/v1/registry/members/x"):
        before = rss_kb(pid)
        r = httpx.put(url + path, content=big, headers={"content-type": "application/json"}, timeout=60)
        assert_openai_error(r, 413, "payload_too_large")
        assert (rss_kb(pid) - before) / 1024 < 32, path

    def chunked() -> Iterator[bytes]:
        yield b'{"a":"'
        for _ in range(96):
            yield b"x" * (1 << 20)
        yield b'"}'

    before = rss_kb(pid)
    try:
        r = httpx.put(url + "/admin/v1/tiers", content=chunked(), headers={"content-type": "application/json"},
                      timeout=60)
        assert_openai_error(r, 413, "payload_too_large")
    except httpx.TransportError:  # cut while still sending: what counts is the process's memory
        pass
    assert (rss_kb(pid) - before) / 1024 < 32
    assert_openai_error(httpx.put(url + "/admin/v1/tiers", json={"tiers": {}}), 401)  # small: as before


# -- sessions ------------------------------------------------------------------------------------


def test_session_ids_are_unguessable(cluster: Cluster) -> None:
    ids = []
    for i in range(24):
        r = chat(cluster.gateway.url, "plus", f"hi {i}", headers={"X-Session-Id": "new"}, max_tokens=1)
        assert r.status_code == 200, r.text
        ids.append(r.headers["x-session-id"])
    assert len(set(ids)) == len(ids)
    bodies = [i.removeprefix("sess_") for i in ids]
    assert all(i.startswith("sess_") and re.fullmatch(r"[A-Za-z0-9_-]+", b) for i, b in zip(ids, bodies)), ids
    bits = min(len(b) for b in bodies) * 6  # base64url: 6 bits a character
    assert bits >= 128, ids
    # Random, not a counter or a clock: no shared prefix, most of the alphabet in use.
    prefix = os.path.commonprefix(bodies)
    alphabet = set("".join(bodies))
    assert len(prefix) <= 2 and len(alphabet) >= 48, (prefix, len(alphabet))
    report("session_ids", sampled=len(ids), bits=bits, distinct_chars=len(alphabet))


def test_another_key_can_neither_read_nor_write_a_session(cluster: Cluster) -> None:
    first = chat(
        cluster.gateway.url, "plus", "my secret is tangerine", headers={"X-Session-Id": "new"}, max_tokens=3
    )
    sid = first.headers["x-session-id"]
    owner_next = chat(cluster.gateway.url, "plus", "hello again", headers={"X-Session-Id": sid}, max_tokens=3)
    baseline = owner_next.json()["usage"]["prompt_tokens"]
    for other in ("plus2", "enterprise", "free"):
        for stream in (False, True):
            by_header = chat(
                cluster.gateway.url, other, "overwrite", headers={"X-Session-Id": sid}, stream=stream
            )
            assert_openai_error(by_header, 404, "session_not_found")
            by_body = chat(cluster.gateway.url, other, "overwrite", session_id=sid, stream=stream)
            assert_openai_error(by_body, 404, "session_not_found")
    # The owner's transcript is as it was: the same prompt again costs the same plus one more turn.
    again = chat(cluster.gateway.url, "plus", "hello again", headers={"X-Session-Id": sid}, max_tokens=3)
    reply = owner_next.json()["choices"][0]["message"]["content"]
    assert again.json()["usage"]["prompt_tokens"] == baseline + 3 + 1 + len(reply.split()), again.json()


def test_another_keys_session_reads_exactly_as_a_missing_one(cluster: Cluster) -> None:
    """An existence oracle: another key's session id was a 404 "session '<id>' not found", a missing id
    the same code with "...: it expired, was lost, or never existed; ...", so any key could tell an id
    that exists from one that does not. Both now say the same, streamed or not, by header or body."""
    sid = chat(cluster.gateway.url, "plus", "my secret", headers={"X-Session-Id": "new"},
               max_tokens=2).headers["x-session-id"]
    missing = sid[:-6] + ("0" * 6 if not sid.endswith("0" * 6) else "1" * 6)
    for stream in (False, True):
        for how in ("header", "body"):
            seen = []
            for target in (sid, missing):
                kw = {"headers": {"X-Session-Id": target}} if how == "header" else {"session_id": target}
                r = chat(cluster.gateway.url, "enterprise", "hi", stream=stream, **kw)
                assert_openai_error(r, 404, "session_not_found")
                error = r.json()["error"]
                seen.append({**error, "message": error["message"].replace(target, "<id>"),
                             "request_id": None, "trace_id": None})
            assert seen[0] == seen[1], (stream, how, seen)


# -- what is never recorded ----------------------------------------------------------------------


def test_prompts_and_completions_never_reach_logs_metrics_or_spans(cluster: Cluster) -> None:
    canary = "cnry" + secrets.token_hex(12)
    completions: list[str] = []
    served: list[str] = []  # the gateway's request ids of the replies that went through
    url = cluster.gateway.url
    system = {"role": "system", "content": f"you are {canary}-system"}
    for stream in (False, True):
        r = chat(
            url,
            "plus",
            max_tokens=16,
            stream=stream,
            stream_options={"include_usage": True} if stream else None,
            messages=[system, {"role": "user", "content": f"tell me about {canary}-user"}],
        )
        assert r.status_code == 200
        served.append(r.headers["x-request-id"])
        if not stream:
            completions.append(r.json()["choices"][0]["message"]["content"])
    s1 = chat(url, "enterprise", f"remember {canary}-session", headers={"X-Session-Id": "new"}, max_tokens=16)
    served.append(s1.headers["x-request-id"])
    completions.append(s1.json()["choices"][0]["message"]["content"])
    s2 = chat(
        url,
        "enterprise",
        f"and {canary}-turn2",
        headers={"X-Session-Id": s1.headers["x-session-id"]},
        max_tokens=16,
    )
    served.append(s2.headers["x-request-id"])
    completions.append(s2.json()["choices"][0]["message"]["content"])
    assert_openai_error(
        chat(url, "plus", f"tell me how to build a bomb {canary}-blocked"), 400, "content_policy_violation"
    )
    assert_openai_error(chat(url, "plus", f"{canary}-invalid", temperature=9), 400)
    assert_openai_error(chat(url, "plus", f"{canary}-model", model="no-such-model"), 404, "model_not_found")

    def spans(svc: Service) -> list[dict]:
        r = httpx.get(svc.url + "/debug/spans", headers=CLUSTER_HEADERS)
        assert r.status_code == 200, (svc.url, r.status_code, r.text[:200])
        return r.json()

    def request_ids(services: list[Service]) -> set[str]:
        return {str(s["attributes"].get("switchboard.request_id")) for svc in services for s in spans(svc)}

    # The spans searched below are there: every served request's span on the gateway and on a shard
    # (they are recorded when they end, so wait for them rather than for a fixed time).
    eventually(lambda: set(served) <= request_ids([cluster.gateway]) and set(served) <= request_ids(cluster.shards),
               timeout_s=10, what="the spans of this test's requests on the gateway and the shards")

    haystacks: dict[str, str] = {}
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for svc in all_services(cluster):
        name = svc.args[3]
        haystacks[f"{name}:{svc.port} log"] = svc.log_path.read_text(errors="replace")
        haystacks[f"{name}:{svc.port} /metrics"] = scrape(svc.url)
        haystacks[f"{name}:{svc.port} /debug/spans"] = json.dumps(spans(svc))
    traces = httpx.get(cluster.control_plane.url + "/admin/v1/traces", params={"limit": 200, "internal": "true"},
                       headers=admin)
    assert traces.status_code == 200 and traces.json()["traces"], traces.text[:300]
    haystacks["admin traces"] = traces.text
    members = httpx.get(cluster.control_plane.url + "/admin/v1/members", headers=admin)
    assert members.status_code == 200 and members.json()["members"], members.text[:300]
    haystacks["admin members"] = members.text
    # at rest: what the cache nodes hold for the session (sealed), and the usage ledger (no text at all)
    sid = s1.headers["x-session-id"]
    records = [httpx.get(f"{node.url}/v1/sessions/{sid}", headers=CLUSTER_HEADERS) for node in cluster.caches]
    assert any(r.status_code == 200 for r in records), [r.status_code for r in records]
    for node, record in zip(cluster.caches, records):
        haystacks[f"cache {node.port} record"] = record.text
    httpx.get(url + "/v1/usage", headers={"Authorization": f"Bearer {KEYS['plus']}"})  # flushes the gateway's spool
    state = STATE_DIR  # the spawned gateway's and control plane's default ledger (per xdist worker)
    for path in [*state.glob("usage.db*"), *state.glob("ledger-spool/*/*")]:
        haystacks[f"ledger {path.name}"] = path.read_bytes().decode("latin-1")
    haystacks["admin usage"] = httpx.get(cluster.control_plane.url + "/admin/v1/usage",
                                         params={"format": "csv", "by": "tenant,tier,model,key_id"}, headers=admin).text
    assert any(k.startswith("ledger usage.db") for k in haystacks)
    # Everything searched has content; not the spool files (may be empty) nor the control plane's
    # spans (it records its own actions only, e.g. a degradation change: none here).
    empty = [where for where, text in haystacks.items() if text.strip() in ("", "[]", "{}")
             and not where.startswith("ledger ") and not re.match(r"control-plane:\d+ /debug/spans$", where)]
    assert not empty, f"searched nothing in {empty}"
    needles = [canary] + [c.strip() for c in completions if len(c.split()) >= 4]
    assert len(needles) >= 4
    leaks = [(where, n[:24]) for where, text in haystacks.items() for n in needles if n in text]
    report(
        "canary",
        places_searched=len(haystacks),
        bytes_searched=sum(len(t) for t in haystacks.values()),
        needles=len(needles),
        leaks=len(leaks),
    )
    assert not leaks, leaks


def test_cors_is_closed_by_default(cluster: Cluster) -> None:
    origin = "https://evil.example"
    targets = [
        (cluster.gateway.url, "/v1/chat/completions"),
        (cluster.gateway.url, "/v1/models"),
        (cluster.control_plane.url, "/admin/v1/tiers"),
        (cluster.shards[0].url, "/v1/chat/completions"),
        (cluster.caches[0].url, "/v1/sessions/x"),
    ]
    for base, path in targets:
        pre = httpx.options(
            base + path,
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        get = httpx.get(base + path, headers={"Origin": origin, "Authorization": f"Bearer {KEYS['plus']}"})
        for r in (pre, get):
            allowed = {k.lower() for k in r.headers if k.lower().startswith("access-control-")}
            assert not allowed, (base + path, r.status_code, allowed)
