"""The console's Usage page against a real cluster whose gateway writes the ledger the control
plane reads (both on the default SQLite file)."""

from __future__ import annotations

import json
import time

import httpx

from tests.support.console import require, texts


def test_usage_page_shows_the_ledger_per_tenant_and_tier_with_a_csv(console, cluster, admin):
    require(admin, "/admin/v1/usage")
    before = admin.get("/admin/v1/usage").json()["totals"]["requests"]
    refused = httpx.post(cluster.gateway.url + "/v1/chat/completions", timeout=30,
                         headers={"Authorization": "Bearer sk-not-a-key"}, json={"messages": []})
    assert refused.status_code == 401  # in the ledger with no tenant: it had no valid key
    before += 1
    for tier in ("plus", "enterprise"):
        r = httpx.post(cluster.gateway.url + "/v1/chat/completions", timeout=30,
                       headers={"Authorization": f"Bearer {cluster.keys[tier]}"},
                       json={"messages": [{"role": "user", "content": "count me"}], "max_tokens": 4})
        assert r.status_code == 200
    deadline = time.monotonic() + 10
    while admin.get("/admin/v1/usage").json()["totals"]["requests"] < before + 2 and time.monotonic() < deadline:
        time.sleep(0.3)
    at = console.page("usage")
    assert not at.error, [e.value for e in at.error]
    tiles = {m.label: m.value for m in at.metric}
    assert int(tiles["Requests"].replace(",", "")) >= before + 2
    assert len(at.get("arrow_vega_lite_chart")) + len(at.get("vega_lite_chart")) >= 2  # per tenant, per tier
    assert "No usage recorded" not in texts(at)
    headers = {c.get("label") for c in json.loads(at.dataframe[-1].proto.columns).values()}
    assert {"Tenant", "Prompt tokens", "Cached tokens"} <= headers, headers  # not the ledger's snake_case
    tenants = set(at.dataframe[-1].value["tenant"])
    assert {"acme", "bigco", "(no valid key)"} <= tenants and "" not in tenants
    csv = admin.get("/admin/v1/usage", params={"format": "csv", "by": "tenant,tier"}).text
    assert csv.splitlines()[0].startswith("start,end,start_unix,end_unix,tenant,tier,requests")


def test_the_tier_filter_offers_the_policys_tiers_and_unknown(console, admin):
    """The Tier filter was a fixed free/plus/enterprise: an operator's own tier (PUT /admin/v1/tiers) could
    not be chosen, nor "unknown", the ledger's tier for requests refused before their key was known."""
    from admin_ui.views.tiers import tier_filter_choices

    assert tier_filter_choices({"tiers": {"free": {}, "gold": {}}}, "any") == ["any", "free", "gold", "unknown"]
    assert tier_filter_choices(None, "gone") == ["any", "free", "plus", "enterprise", "unknown", "gone"]
    at = console.page("usage")
    policy = list(admin.get("/admin/v1/tiers").json()["tiers"])
    assert at.selectbox(key="usage_tier").options == ["any", *policy, "unknown"]


def test_a_newest_bucket_over_the_row_limit_is_not_called_empty(console, cluster, admin):
    """The API keeps whole buckets: when the newest one alone has more rows than `limit`, it answers no rows,
    `truncated` and the whole range's totals. The page said "No usage recorded in this range" under tiles
    counting the requests (the truncation warning came after that early return)."""
    require(admin, "/admin/v1/usage")
    for key in ("sk-not-a-key", cluster.keys["plus"]):  # two groups (no tenant/unknown, a tenant/plus) this hour
        httpx.post(cluster.gateway.url + "/v1/chat/completions", timeout=30, headers={"Authorization": f"Bearer {key}"},
                   json={"messages": [{"role": "user", "content": "count me"}], "max_tokens": 4})
    params = {"group_by": "hour", "by": "tenant,tier", "limit": 1}
    deadline = time.monotonic() + 10
    while (body := admin.get("/admin/v1/usage", params=params).json())["rows"] or not body["truncated"]:
        assert time.monotonic() < deadline, body
        time.sleep(0.3)
    at = console.page("usage", log_in=True)
    at.session_state["usage_row_limit"] = 1
    at.run()
    assert not at.error, [e.value for e in at.error]
    page = texts(at)
    assert "No usage recorded" not in page
    assert any("the newest bucket alone has more rows than one answer holds" in w.value for w in at.warning)
    assert int({m.label: m.value for m in at.metric}["Requests"].replace(",", "")) >= 2
