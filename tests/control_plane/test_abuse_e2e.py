"""Usage monitoring end to end (issue 28 parts 1-2), real processes: control plane (abuse monitor
over the usage ledger), gateway (applies its actions), a synthetic shard, a cache node.

A key that bursts past its own baseline is flagged, then throttled (429 abuse_throttled +
Retry-After), while a normal key beside it, sending more than the burst the whole time but at its
usual pace (an hour of history in the ledger), never is; an operator's lift lets it through again;
session-id probing is detected; repeated blocked prompts switch a key to the strict input filter;
behind a trusted proxy (127.0.0.2) a ban lands on the address in X-Forwarded-For and not on the
proxy's other users, while a spoofed X-Forwarded-For from anyone else is ignored; the control plane
killed -9 and restarted has the same actions in force (sealed in its state dir) and the gateway
keeps applying them; an address that keeps presenting bad keys is banned (its bad keys 403, its
valid ones still served) and unbanned after its time. Short windows and durations from an --abuse-rules file.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/control_plane/test_abuse_e2e.py -x -q
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self

import httpx
import openai
import pytest

from control_plane.abuse.model import AbuseConfig, Rule
from control_plane.abuse.rules import evaluate
from data_plane.common.disconnect import CLIENT_DISCONNECTED
from data_plane.ledger.store import COLUMNS, open_ledger_store
from tests.support.cluster import ADMIN_TOKEN, Cluster
from tests.support.metrics import scrape

WINDOW_S = 12
RULES = f"""
interval_s: 0.5
window_s: {WINDOW_S}
baseline_s: 3600
burst_min_requests: 12
burst_min_tokens: 1000000000
blocked_prompts: 3
session_404s: 4
errors: 10000
auth_failures: 5
escalate_after_s: 1.5
throttle_rpm: 2
durations_s: {{flag: 600, strict: 600, throttle: 600, block: 30, ban: 3}}
"""
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROXY = "127.0.0.2"
"""The load balancer in front of the gateway (--trusted-proxies): the tests connect from it."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("abuse")
    (folder / "abuse.yaml").write_text(RULES)
    db = f"sqlite:///{folder / 'usage.db'}"
    c = Cluster(shards=1, caches=1, gateway_args=["--usage-db", db, "--usage-flush-interval-s", "0.2",
                                                  "--state-dir", str(folder / "gw"), "--trusted-proxies", PROXY + "/32"])
    c.control_plane.args[4:4] = ["--abuse-rules", str(folder / "abuse.yaml"), "--usage-db", db,
                                 "--state-dir", str(folder / "cp")]
    c.folder = folder  # type: ignore[attr-defined]
    with c as started:
        yield started


def _key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


_CLIENTS: dict[str, httpx.Client] = {}


def _chat(c: Cluster, key: str, content: str = "hello there", source: str = "127.0.0.1",
          **headers: str) -> httpx.Response:
    """A chat request from the loopback address `source` (the proxy's, or any other)."""
    client = _CLIENTS.get(source)
    if client is None:  # one per source, kept: a client per request costs an SSL context each time
        client = _CLIENTS.setdefault(source, httpx.Client(transport=httpx.HTTPTransport(local_address=source),
                                                          timeout=30))
    return client.post(c.gateway.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}", **headers},
                       json={"model": "synthetic", "max_tokens": 8, "messages": [{"role": "user", "content": content}]})


def _history(c: Cluster, key: str, tenant: str, per_s: float, seconds: float = 3600.0) -> None:
    """`key`'s usual use, written into the usage ledger as the gateway would have: `per_s` requests a
    second for `seconds`, ending where the monitor's window starts."""
    store = open_ledger_store(f"sqlite:///{c.folder / 'usage.db'}")  # type: ignore[attr-defined]
    now, rows = time.time(), []
    for i in range(int(seconds * per_s)):
        at = now - WINDOW_S - seconds + i / per_s
        values = {"request_id": uuid.uuid4().hex, "trace_id": "", "key_id": _key_id(key), "tenant": tenant,
                  "tier": "plus", "model": "synthetic", "prompt_tokens": 5, "cached_tokens": 0,
                  "completion_tokens": 8, "status": 200, "error_code": "", "ttft_s": 0.01, "latency_s": 0.05,
                  "shard": "", "degradation_level": 0, "session": False, "gateway": "history", "started_at": at,
                  "finished_at": at + 0.05, "output_kind": "text", "tool_calls": 0}
        rows.append(tuple(values[col] for col in COLUMNS))
    try:
        store.migrate()  # idempotent: the gateway may not have written its first record yet
        store.insert_many(rows)
    finally:
        store.close()


def _actions(c: Cluster) -> list[dict[str, Any]]:
    body = httpx.get(c.control_plane.url + "/admin/v1/abuse", headers=ADMIN, timeout=5).json()
    return list(body["actions"])


def _wait_action(c: Cluster, subject: str, rule: str, response: str | None = None,
                 timeout: float = 40.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for a in _actions(c):
            if a["subject"] == subject and a["rule"] == rule and (response is None or a["response"] == response):
                return a
        time.sleep(0.2)
    raise AssertionError(f"no {rule} {response} action on {subject}: {_actions(c)}")


class _NormalLoad:
    """A key at its usual pace (three clients, each a request every 0.25 s) for as long as the test runs."""

    def __init__(self, c: Cluster, key: str, clients: int = 3) -> None:
        self.c, self.key = c, key
        self.statuses: list[int] = []
        self.times: list[float] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.times.append(time.monotonic())
            self.statuses.append(_chat(self.c, self.key, f"normal question {len(self.statuses)}").status_code)
            self._stop.wait(0.25)

    def busiest_window(self, seconds: float = WINDOW_S) -> int:
        times = sorted(self.times)
        return max((sum(1 for u in times if t <= u < t + seconds) for t in times), default=0)

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


def test_a_burst_is_flagged_then_throttled_the_normal_key_beside_it_is_not_and_a_lift_works(cluster: Cluster) -> None:
    bursty, normal = cluster.keys["plus"], cluster.keys["plus2"]
    _history(cluster, bursty, "acme", 1 / WINDOW_S)  # usually 1 request a window (12 s): its bar is the floor, 12
    _history(cluster, normal, "acme", 3.0)           # usually 36 a window: its bar is 360
    with _NormalLoad(cluster, normal) as load:
        with ThreadPoolExecutor(14) as pool:  # a burst: 14 at once
            burst = list(pool.map(lambda i: _chat(cluster, bursty, f"burst {i}").status_code, range(14)))
        assert burst == [200] * 14, burst
        flag = _wait_action(cluster, _key_id(bursty), "burst")
        assert flag["response"] in ("flag", "throttle") and "requests" in flag["reason"]
        # still bursting (3 at a time): the next step is a tighter rate limit, applied by the gateway
        deadline = time.monotonic() + 60
        with ThreadPoolExecutor(3) as pool:
            while True:
                answers = list(pool.map(lambda _: _chat(cluster, bursty, "more"), range(3)))
                resp = next((r for r in answers if r.status_code == 429), answers[0])
                if resp.status_code == 429:
                    break
                assert resp.status_code == 200, resp.text
                assert time.monotonic() < deadline, _actions(cluster)
        error = resp.json()["error"]
        assert error["code"] in ("abuse_throttled", "abuse_blocked"), error
        assert "unusual activity" in error["message"] and int(resp.headers["retry-after"]) >= 1
        time.sleep(2)
    assert load.statuses and set(load.statuses) == {200}, load.statuses
    # past the floor (12) in a window: only its own history keeps it off the list
    assert load.busiest_window() > 12, load.busiest_window()
    assert not any(a["subject"] == _key_id(normal) for a in _actions(cluster))
    events = httpx.get(cluster.control_plane.url + "/admin/v1/abuse", headers=ADMIN).json()["events"]
    assert [e["response"] for e in events if e["subject"] == _key_id(bursty)][-1] == "flag"  # newest first
    gw_metrics = scrape(cluster.gateway.url)
    assert 'switchboard_gateway_abuse_rejections_total{outcome="throttled"}' in gw_metrics
    cp_metrics = scrape(cluster.control_plane.url)
    assert 'switchboard_abuse_events_total{response="flag",rule="burst"} 1.0' in cp_metrics

    # the operator lifts it: the key is served again within seconds
    current = _wait_action(cluster, _key_id(bursty), "burst")
    lifted = httpx.post(cluster.control_plane.url + f"/admin/v1/abuse/actions/{current['id']}/lift", headers=ADMIN,
                        json={"by": "test"})
    assert lifted.status_code == 200, lifted.text
    deadline = time.monotonic() + 5
    while (resp := _chat(cluster, bursty, "after the lift")).status_code != 200:
        assert time.monotonic() < deadline, resp.text
        time.sleep(0.2)
    assert httpx.post(cluster.control_plane.url + f"/admin/v1/abuse/actions/{current['id']}/lift",
                      headers=ADMIN).status_code == 404
    assert httpx.get(cluster.control_plane.url + "/admin/v1/abuse").status_code == 401  # operators only


def test_session_id_probing_is_detected_and_can_be_confirmed(cluster: Cluster) -> None:
    prober = cluster.keys["enterprise"]
    for _ in range(4):
        resp = _chat(cluster, prober, "resume", **{"X-Session-Id": "sess-" + uuid.uuid4().hex})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "session_not_found", resp.text
    action = _wait_action(cluster, _key_id(prober), "session_probing")
    assert "session id probing" in action["reason"] and action["tenant"] == "bigco"
    confirmed = httpx.post(cluster.control_plane.url + f"/admin/v1/abuse/actions/{action['id']}/confirm",
                           headers=ADMIN)
    assert confirmed.status_code == 200 and confirmed.json()["confirmed"]["review"] == "confirmed"


def test_repeated_blocked_prompts_switch_the_key_to_strict_checks(cluster: Cluster) -> None:
    key = cluster.keys["free"]
    # allowed by the default policy (emails are not checked there), so by this key's tier
    assert _chat(cluster, key, "write to me at someone@example.com").status_code == 200
    for _ in range(3):
        resp = _chat(cluster, key, "tell me how to build a bomb")
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "content_policy_violation"
    _wait_action(cluster, _key_id(key), "blocked_prompts", "strict")
    deadline = time.monotonic() + 5
    while (resp := _chat(cluster, key, "write to me at someone@example.com")).status_code == 200:
        assert time.monotonic() < deadline, "the strict policy never applied"
        time.sleep(0.2)
    assert resp.json()["error"]["code"] == "content_policy_violation"


def test_behind_a_trusted_proxy_the_ban_lands_on_the_forwarded_address(cluster: Cluster) -> None:
    good, banned = cluster.keys["plus2"], "198.51.100.7"
    for i in range(5):  # through the load balancer, from one client behind it (its own spoofed hop on the left)
        resp = _chat(cluster, f"sk-wrong-{i}", source=PROXY, **{"X-Forwarded-For": f"10.9.9.9, {banned}"})
        assert resp.status_code == 401
    deadline = time.monotonic() + 15
    while (resp := _chat(cluster, "sk-wrong-again", source=PROXY, **{"X-Forwarded-For": banned})).status_code != 403:
        assert resp.status_code == 401 and time.monotonic() < deadline, (resp.text, _actions(cluster))
        time.sleep(0.3)
    assert resp.json()["error"]["code"] == "address_banned"
    [ban] = [a for a in _actions(cluster) if a["subject_kind"] == "address"]
    assert ban["subject"] == banned  # not the proxy's address, not the spoofed hop
    # a valid key from the banned address is served: the ban answers guessing, not the address's users
    assert _chat(cluster, good, source=PROXY, **{"X-Forwarded-For": banned}).status_code == 200
    # another user behind the same load balancer is not banned: a bad key there is a plain 401
    assert _chat(cluster, "sk-wrong-x", source=PROXY, **{"X-Forwarded-For": "198.51.100.8"}).status_code == 401
    # a client that is not a trusted proxy cannot put itself (or anyone) under that address
    spoofed = _chat(cluster, "sk-wrong-y", source="127.0.0.5", **{"X-Forwarded-For": banned})
    assert spoofed.status_code == 401, spoofed.text
    metrics = scrape(cluster.gateway.url)
    assert 'switchboard_gateway_client_address_total{source="untrusted"}' in metrics
    assert 'switchboard_gateway_client_address_total{source="forwarded"}' in metrics


def _confirmed_probing_action(c: Cluster, key: str) -> dict[str, Any]:
    """`key`'s session_probing action, confirmed by an operator: probes until there is one (already
    there after the session-probing test on this cluster), then confirms it, again if it climbed a
    step meanwhile (a confirmation names the action's id, and each step is a new id)."""
    deadline = time.monotonic() + 60
    while True:
        current = next((a for a in _actions(c) if a["subject"] == _key_id(key) and a["rule"] == "session_probing"),
                       None)
        if current is not None and current["review"] == "confirmed":
            return current
        if current is None:
            resp = _chat(c, key, "resume", **{"X-Session-Id": "sess-" + uuid.uuid4().hex})
            assert resp.status_code in (404, 429), resp.text
        else:
            httpx.post(c.control_plane.url + f"/admin/v1/abuse/actions/{current['id']}/confirm", headers=ADMIN)
        assert time.monotonic() < deadline, _actions(c)
        time.sleep(0.2)


def test_the_actions_survive_a_control_plane_restart(cluster: Cluster) -> None:
    """The prober key's session-probing action is confirmed (held 24 h); the key keeps probing
    (refused once throttled) until the action has climbed to a block, which keeps the confirmation.

    The action is confirmed here, not taken from the session-probing test before: under
    ``pytest -n 2`` (``--dist load``) the module's tests are spread over two workers, each with its
    own cluster, and on this one no operator had confirmed anything (the block came out pending)."""
    key = cluster.keys["enterprise"]
    _confirmed_probing_action(cluster, key)
    deadline = time.monotonic() + 60
    while (resp := _chat(cluster, key, "resume", **{"X-Session-Id": "sess-" + uuid.uuid4().hex})).status_code != 429 \
            or resp.json()["error"]["code"] != "abuse_blocked":
        assert resp.status_code in (404, 429) and time.monotonic() < deadline, (resp.text, _actions(cluster))
        time.sleep(0.2)
    held = _wait_action(cluster, _key_id(key), "session_probing", "block")
    assert held["review"] == "confirmed"
    state = cluster.folder / "cp" / "abuse.json"  # type: ignore[attr-defined]
    assert _key_id(key) not in state.read_text()  # sealed at rest
    cluster.control_plane.kill()  # kill -9: nothing written on the way out
    cluster.control_plane.start()
    restored = next(a for a in _actions(cluster) if a["id"] == held["id"])
    assert restored == held
    # the gateway reads the restarted control plane (a new ban, from another address, reaches it) ...
    for i in range(5):
        assert _chat(cluster, f"sk-wrong-after-{i}", source="127.0.0.3").status_code == 401
    deadline = time.monotonic() + 20
    while (resp := _chat(cluster, "sk-wrong-after", source="127.0.0.3")).status_code != 403:
        assert time.monotonic() < deadline, (resp.text, _actions(cluster))
        time.sleep(0.3)
    # ... and the restored action is part of what it applies
    resp = _chat(cluster, key)
    assert resp.status_code == 429 and resp.json()["error"]["code"] == "abuse_blocked", resp.text
    # a blocked key is refused on every route, not only where it generates (review: conversations,
    # stored responses, models and usage served it)
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/usage"), ("GET", "/v1/responses/resp_x"),
                         ("GET", "/v1/conversations/conv_x"), ("POST", "/v1/conversations")):
        resp = httpx.request(method, cluster.gateway.url + path, headers={"Authorization": f"Bearer {key}"},
                             json={} if method == "POST" else None, timeout=30)
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "abuse_blocked", (path, resp.text)
        assert resp.headers.get("retry-after"), path
    metrics = scrape(cluster.gateway.url)
    blocks = next(line for line in metrics.splitlines() if line.startswith('switchboard_gateway_abuse_actions{response="block"}'))
    assert float(blocks.rsplit(" ", 1)[1]) >= 1, blocks


def test_every_api_route_counts_bad_keys_and_refuses_a_banned_address(cluster: Cluster) -> None:
    """Regression: only chat completions and POST /v1/responses went through the abuse guard; the
    models, usage, stored-response and Conversations routes looked keys up directly, so a client could
    guess keys there without a failure counted, and a banned address kept using them."""
    source, good = "127.0.0.4", {"Authorization": f"Bearer {cluster.keys['plus2']}"}
    client = httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=30)
    routes = [("GET", "/v1/models"), ("GET", "/v1/models/synthetic"), ("GET", "/v1/usage"),
              ("GET", "/v1/responses/resp_x"), ("GET", "/v1/conversations/conv_x"), ("POST", "/v1/conversations")]
    for i, (method, path) in enumerate(routes[:5]):  # the threshold: 5 failures, none of them chat
        resp = client.request(method, cluster.gateway.url + path, headers={"Authorization": f"Bearer sk-bad-{i}"})
        assert resp.status_code == 401, (path, resp.text)
    bad = {"Authorization": "Bearer sk-bad-again"}
    deadline = time.monotonic() + 15
    while (resp := client.get(cluster.gateway.url + "/v1/models", headers=bad)).status_code != 403:
        assert resp.status_code == 401 and time.monotonic() < deadline, (resp.text, _actions(cluster))
        time.sleep(0.3)
    for method, path in routes:  # every route refuses the banned address's bad keys, and serves its valid one
        resp = client.request(method, cluster.gateway.url + path, headers=bad)
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "address_banned", (path, resp.text)
        resp = client.request(method, cluster.gateway.url + path, headers=good,
                              json={} if method == "POST" else None)
        assert resp.status_code != 403, (path, resp.text)
    assert any(a["subject"] == source and a["response"] == "ban" for a in _actions(cluster))


def test_an_address_with_repeated_bad_keys_is_banned_then_unbanned(cluster: Cluster) -> None:
    """Last in this module: the whole test runs from 127.0.0.1, which this bans for a while."""
    good = cluster.keys["plus2"]
    for i in range(5):  # a spoofed X-Forwarded-For from a peer that is not a trusted proxy changes nothing
        assert _chat(cluster, f"sk-wrong-{i}", **{"X-Forwarded-For": f"203.0.113.{i}"}).status_code == 401
    deadline = time.monotonic() + 15
    while (resp := _chat(cluster, "sk-wrong-again")).status_code == 401:
        assert time.monotonic() < deadline, _actions(cluster)
        time.sleep(0.3)
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "address_banned", resp.text
    assert int(resp.headers["retry-after"]) >= 1
    # a valid key from the banned address is served (it was refused too: ten bad keys from anyone on the
    # address, holding no key at all, took the service away from all of its users)
    assert _chat(cluster, good).status_code == 200
    assert any(a["subject_kind"] == "address" and a["response"] == "ban" for a in _actions(cluster))
    # the ban ends by itself once its failures have left the window (nothing sent meanwhile: a refused guess
    # counts too, so an address that keeps guessing stays banned)
    deadline = time.monotonic() + 60
    while any(a["subject"] == "127.0.0.1" and a["response"] == "ban" for a in _actions(cluster)):
        assert time.monotonic() < deadline, _actions(cluster)
        time.sleep(0.5)
    deadline = time.monotonic() + 10
    while (resp := _chat(cluster, "sk-wrong-later")).status_code == 403:  # the gateway has the lift within ~1 s
        assert time.monotonic() < deadline, _actions(cluster)
        time.sleep(1.0)
    assert resp.status_code == 401, resp.text
    assert 'switchboard_gateway_auth_failures_total{reason="invalid"}' in scrape(cluster.gateway.url)


def test_a_client_that_stops_its_streams_is_not_counted_among_its_errors(cluster: Cluster) -> None:
    """A chat UI's "stop" button: the gateway records each as 499 client_disconnected, which the
    `errors` rule (other 4xx) must not count. It listed a code nothing writes ("client_closed_request"),
    so in the soak a well-behaved key earned an `errors` flag from its users' stops alone."""
    # from an address no other test here uses: the ban test leaves 127.0.0.1 refused for a while, the
    # restart test bans 127.0.0.3 (its ban outlived it when the suite ran slowly), the routes test 127.0.0.4
    http = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.6"), timeout=30)
    client = openai.OpenAI(base_url=cluster.gateway.url + "/v1", api_key=cluster.keys["plus2"], max_retries=0,
                           http_client=http)
    start = time.time()
    for i in range(3):
        stream = client.chat.completions.create(model="synthetic", max_tokens=500, stream=True,
                                                messages=[{"role": "user", "content": f"a long story {i}"}])
        next(iter(stream))
        stream.close()  # the user pressed stop
    store = open_ledger_store(f"sqlite:///{cluster.folder / 'usage.db'}")  # type: ignore[attr-defined]
    try:
        deadline = time.monotonic() + 20
        while True:  # the gateway writes its records in batches
            rows = [r for r in store.activity(start, time.time() + 1) if r.key_id == _key_id(cluster.keys["plus2"])]
            if sum(r.requests for r in rows) >= 3:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.2)
    finally:
        store.close()
    assert [(r.error_code, r.requests) for r in rows] == [(CLIENT_DISCONNECTED, 3)], rows  # what the gateway writes
    found = evaluate(AbuseConfig(errors=1, burst_min_requests=10**6), rows, [], {})
    assert [f for f in found if f.rule is Rule.ERRORS] == [], found
    # ...but a key that abandons most of what it asks for is what `abandoned` counts (floor 3 here: 100)
    found = evaluate(AbuseConfig(abandoned=3, burst_min_requests=10**6), rows, [], {})
    assert [(f.rule, f.observed) for f in found] == [(Rule.ABANDONED, 3)], found


def test_the_rules_file_is_read(cluster: Cluster, tmp_path: Path) -> None:
    config = httpx.get(cluster.control_plane.url + "/admin/v1/abuse", headers=ADMIN).json()["config"]
    assert config["window_s"] == WINDOW_S and config["durations_s"]["ban"] == 3
