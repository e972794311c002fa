"""The console's Abuse page against a real cluster: an address banned by the monitor (reported by
"a gateway" straight to the control plane, so 127.0.0.1 stays usable) shows with its reason, and
the page's Lift button ends it."""

from __future__ import annotations

import time

import httpx

from tests.support.console import require, texts
from tests.support.procs import CLUSTER_HEADERS

ADDRESS = "203.0.113.9"  # TEST-NET-3: never a real client


def test_abuse_page_shows_a_ban_and_lifts_it(console, cluster, admin):
    require(admin, "/admin/v1/abuse")
    r = httpx.post(cluster.control_plane.url + "/v1/abuse/reports", headers=CLUSTER_HEADERS,
                   json={"auth_failures": {ADDRESS: 50}})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60  # the monitor evaluates every 5 s by default (a cold first run took > 20 s)
    while not any(a["subject"] == ADDRESS for a in admin.get("/admin/v1/abuse").json()["actions"]):
        assert time.monotonic() < deadline, admin.get("/admin/v1/abuse").json()
        time.sleep(0.3)
    action = next(a for a in admin.get("/admin/v1/abuse").json()["actions"] if a["subject"] == ADDRESS)
    at = console.page("abuse")
    assert not at.error, [e.value for e in at.error]
    page = texts(at)
    assert f"address {ADDRESS}" in page and "BAN" in page and "failed authentications" in page
    # what the ban does, as the gateways do it now: only requests without a valid key are refused
    assert "without a valid API key from this address: 403 address_banned" in page
    assert "its valid keys are served" in page
    tiles = {m.label: m.value for m in at.metric}
    assert int(tiles["Ban"]) >= 1 and int(tiles["Awaiting review"]) >= 1
    at.button(key=f"lift-{action['id']}").click().run()
    assert not any(a["subject"] == ADDRESS for a in admin.get("/admin/v1/abuse").json()["actions"])
    ended = admin.get("/admin/v1/abuse").json()["ended"]
    assert ended[0]["subject"] == ADDRESS and ended[0]["ended"] == "lifted" and ended[0]["ended_by"] == "console"
