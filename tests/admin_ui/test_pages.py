"""Every console page, run by Streamlit's AppTest against a real control plane and cluster."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from tests.support.chat import chat
from tests.support.console import PAGES, require, texts

TITLES = {"overview": "Overview", "cluster": "Cluster", "traffic": "Traffic & tiers", "autoscaler": "Autoscaler",
          "degradation": "Degradation", "traces": "Traces", "alerts": "Alerts", "playground": "Playground",
          "usage": "Usage"}


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_live_data(console, page):
    at = console.page(page)
    assert at.title[0].value == TITLES[page]
    shown = texts(at)
    assert "unreachable" not in shown.lower()
    assert not at.error, [e.value for e in at.error]


@pytest.mark.parametrize("page", PAGES)
def test_unreachable_control_plane_is_said_on_every_page(bare_console, page):
    at = bare_console.page(page)
    assert "Control plane unreachable" in texts(at)


@pytest.mark.parametrize("page", [p for p in PAGES if p != "playground"])
def test_wrong_admin_token_is_one_banner_and_no_fake_empty_cluster(console, cluster, page):
    """A refused token used to give one red box per admin call (four on the Overview) above tiles that
    read "shards 0/0 passing" and "No shards registered", and named `.switchboard/credentials.json`
    whatever file the console was given."""
    console.point_at(cluster.control_plane.url, token="not-the-token")
    at = console.page(page)
    [error] = [e.value for e in at.error]
    assert "Admin token refused" in error and "SWITCHBOARD_ADMIN_TOKEN" in error
    shown = texts(at)
    assert "0/0 passing" not in shown and "No shards registered" not in shown and not at.metric


def test_a_wrong_token_in_the_credentials_file_names_that_file(console, cluster, monkeypatch):
    monkeypatch.delenv("SWITCHBOARD_ADMIN_TOKEN")  # the token comes from the file alone
    console.credentials.write_text(json.dumps({"keys": {}, "admin_token": "sb-admin-stale"}))
    [error] = [e.value for e in console.page("cluster").error]
    assert "Admin token refused" in error and str(console.credentials) in error
    console.credentials.write_text(json.dumps({"keys": {}}))  # no token at all: nobody can log in, and it says why
    at = console.page("overview", log_in=False)
    [error] = [e.value for e in at.error]
    assert "has no admin token" in error and str(console.credentials) in error
    assert not at.text_input and not at.metric


def test_missing_endpoints_say_not_available(console, cluster):
    # The gateway answers /health but has no /admin/v1: every admin call is a 404 route.
    console.point_at(cluster.gateway.url)
    for page in ("overview", "autoscaler", "degradation", "traces", "alerts"):
        at = console.page(page)
        assert "not available yet" in texts(at), page
        assert not at.exception


def test_overview_tiles_show_the_cluster(console, admin):
    require(admin, "/admin/v1/signals")
    deadline = time.monotonic() + 10
    while True:  # the control plane's first signal reading comes a moment after start
        at = console.page("overview")
        tiles = {m.label: m.value for m in at.metric}
        if tiles.get("Healthy shards") == "2 / 2" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(tiles) >= {"Requests / s", "TTFT p50", "TTFT p95", "TPOT", "Error rate", "Tokens / s", "Degradation",
                          "Healthy shards"}
    assert tiles["Healthy shards"] == "2 / 2"
    assert tiles["Degradation"].startswith("L")
    assert "shards 2/2 passing" in texts(at)
    # idle shards are said in words (an all-zero bar chart drew an empty plot with a "0.000000" tick)
    while "All 2 shards idle: nothing running or waiting." not in texts(at):
        assert time.monotonic() < deadline + 10, texts(at)
        time.sleep(0.5)
        at = console.page("overview")


def test_cluster_page_lists_the_shards_that_are_up(console, admin):
    at = console.page("cluster")
    listed = at.dataframe[0].value
    live = {m["id"] for m in admin.get("/admin/v1/members").json()["members"]}
    assert {"shard-0", "shard-1", "cache-0"} <= set(listed["member"]) == live
    assert {b.key for b in at.button} >= {"drain-shard-0", "drain-shard-1"}


def test_drain_and_undrain_from_the_ui_change_the_registry(console, admin):
    def status(member: str) -> str:
        return next(m["status"] for m in admin.get("/admin/v1/members").json()["members"] if m["id"] == member)

    at = console.page("cluster")
    try:
        at.button(key="drain-shard-1").click().run()
        assert status("shard-1") == "draining"
        assert "Drain shard-1: done." in texts(at)
        at.button(key="undrain-shard-1").click().run()
        assert status("shard-1") == "passing"
    finally:
        admin.post("/admin/v1/members/shard-1/undrain")


def test_an_actions_outcome_outlives_the_next_refresh_on_its_own_page(console, admin, monkeypatch):
    """The outcome used to be shown once and dropped: the page's live region re-runs every 3 s, so a
    "done" or a refusal vanished from the browser within 3 s of the click."""
    import admin_ui.ui

    at = console.page("degradation")
    at.button[0].click().run()  # "Pin level" without a reason: refused
    assert "Say why" in texts(at)
    at.run()  # the next refresh
    assert "Say why" in texts(at)
    at.switch_page("screens/cluster.py").run()  # another page does not show it
    assert "Say why" not in texts(at)
    at.switch_page("screens/degradation.py").run()
    assert "Say why" in texts(at)
    monkeypatch.setattr(admin_ui.ui, "FLASH_S", 0.0)  # and it does expire
    at.run()
    assert "Say why" not in texts(at)
    assert admin.get("/admin/v1/degradation").json()["pinned"] is False


def test_pin_and_release_a_degradation_level(console, admin):
    require(admin, "/admin/v1/degradation")
    at = console.page("degradation")
    try:
        at.selectbox(key="pin_level").set_value(3)
        at.text_input(key="pin_reason").input("console test: load test")
        at.button[0].click().run()  # "Pin level"
        state = admin.get("/admin/v1/degradation").json()
        assert (state["level"], state["pinned"]) == (3, True)
        assert "console test: load test" in state["reason"]
        assert "Level 3" in texts(at) and "pinned by operator" in texts(at)

        alerts = console.page("alerts")  # level >= 3 fires the built-in degradation alert
        firing = alerts.dataframe[0].value if alerts.dataframe else None
        if admin.get("/admin/v1/alerts").json().get("source") == "builtin":
            assert firing is not None and "SwitchboardDegraded" in set(firing["alert"])

        at.button[1].click().run()  # "Release pin"
        assert admin.get("/admin/v1/degradation").json()["pinned"] is False
    finally:
        admin.put("/admin/v1/degradation", json={"level": 0, "reason": "test cleanup"})
        admin.delete("/admin/v1/degradation")


def test_pin_without_a_reason_is_refused_in_the_ui(console, admin):
    require(admin, "/admin/v1/degradation")
    before = admin.get("/admin/v1/degradation").json()
    at = console.page("degradation")
    at.selectbox(key="pin_level").set_value(2)
    at.button[0].click().run()
    assert "Say why" in texts(at)
    after = admin.get("/admin/v1/degradation").json()
    assert (after["level"], after["pinned"]) == (before["level"], before["pinned"])


def test_a_pin_that_works_replaces_the_refusal_before_it(console, admin):
    """A refused pin (no reason) stayed on the page, red, for 20 s beside the pin that then worked."""
    require(admin, "/admin/v1/degradation")
    at = console.page("degradation")
    try:
        at.selectbox(key="pin_level").set_value(2)
        at.button[0].click().run()  # no reason: refused
        assert "Say why" in texts(at)
        at.text_input(key="pin_reason").input("console test: after a refusal")
        at.button[0].click().run()
        assert admin.get("/admin/v1/degradation").json()["pinned"] is True
        assert "Pin level 2: done." in texts(at) and "Say why" not in texts(at)
    finally:
        admin.put("/admin/v1/degradation", json={"level": 0, "reason": "test cleanup"})
        admin.delete("/admin/v1/degradation")


def test_tier_policy_save_shows_the_servers_error_and_saves_valid_edits(console, admin):
    require(admin, "/admin/v1/tiers")
    original = admin.get("/admin/v1/tiers").json()
    at = console.page("traffic")
    editor = at.dataframe[-1].value  # the st.data_editor (AppTest can read it, not type into it)
    assert set(editor["tier"]) == set(original["tiers"])
    area = at.text_area[0]
    policy = yaml.safe_load(area.value)
    assert set(policy["tiers"]) == set(original["tiers"])
    try:
        bad = {"tiers": {**policy["tiers"], "free": {**policy["tiers"]["free"], "bogus_field": 1}}}
        area.set_value(yaml.safe_dump(bad)).run()
        next(b for b in at.button if b.label == "Save YAML").click().run()
        shown = texts(at)
        assert "refused the policy" in shown and "bogus_field" in shown
        assert admin.get("/admin/v1/tiers").json()["tiers"] == original["tiers"]

        good = {"tiers": {**policy["tiers"], "free": {**policy["tiers"]["free"], "rpm": 61}}}
        at.text_area[0].set_value(yaml.safe_dump(good)).run()
        next(b for b in at.button if b.label == "Save YAML").click().run()
        assert admin.get("/admin/v1/tiers").json()["tiers"]["free"]["rpm"] == 61
        assert "Tier policy saved" in texts(at)
    finally:
        admin.put("/admin/v1/tiers", json={"tiers": original["tiers"]})


def test_autoscaler_page_without_an_autoscaler(console, admin):
    require(admin, "/admin/v1/decisions")
    at = console.page("autoscaler")
    if admin.get("/admin/v1/decisions").json().get("autoscaler") is False:
        assert "No autoscaler runs" in texts(at)
    assert {m.label for m in at.metric} >= {"Healthy shards", "Desired", "Waiting / shard", "TTFT p95"}


def test_playground_holds_a_conversation_through_the_responses_api(console):
    at = console.page("playground")
    at.selectbox(key="pg_tier").set_value("plus")
    at.radio(key="pg_api").set_value("Responses")
    at.text_area(key="pg_prompt").input("first message")
    next(b for b in at.button if b.label == "Send").click().run()
    assert not at.exception
    first = at.session_state["pg_response_id"]
    at.text_area(key="pg_prompt").input("second message")
    next(b for b in at.button if b.label == "Send").click().run()
    assert not at.exception and at.session_state["pg_response_id"] != first
    assert {m.label: m.value for m in at.metric}["HTTP status"] == "200"
    assert len(at.session_state["pg_history"]) == 4


def test_the_traces_tier_filter_offers_a_tier_added_in_the_console(console, admin):
    """The filter was a fixed free/plus/enterprise list: a tier the operator added could not be picked."""
    require(admin, "/admin/v1/tiers")
    original = admin.get("/admin/v1/tiers").json()
    policy = {"tiers": dict(original["tiers"], gold=dict(original["tiers"]["plus"]))}
    try:
        assert admin.put("/admin/v1/tiers", json=policy).status_code == 200
        at = console.page("traces")
        assert {"any", "free", "plus", "enterprise", "gold"} <= set(at.selectbox(key="trace_tier").options)
    finally:
        admin.put("/admin/v1/tiers", json={"tiers": original["tiers"]})


def test_playground_streams_a_chat_and_links_its_trace(console, admin):
    at = console.page("playground")
    at.selectbox(key="pg_tier").set_value("plus")
    at.text_area(key="pg_prompt").input("hello from the console test")
    next(b for b in at.button if b.label == "Send").click().run()
    assert not at.exception
    answer = at.chat_message[-1].markdown[0].value
    assert answer.strip()
    assert {m.label: m.value for m in at.metric}["HTTP status"] == "200"
    links = at.get("page_link")
    assert links, "no link to the trace"
    trace_id = links[0].proto.label.rsplit(" ", 1)[-1]
    assert len(trace_id) == 32

    require(admin, "/admin/v1/traces")
    deadline = time.monotonic() + 5
    services: set[str] = set()
    while time.monotonic() < deadline and not {"switchboard-gateway", "switchboard-shard"} <= services:
        traces = admin.get("/admin/v1/traces", params={"trace_id": trace_id}).json()["traces"]
        services = set(traces[0]["services"]) if traces else set()
        time.sleep(0.2)
    assert {"switchboard-gateway", "switchboard-shard"} <= services

    # the Traces page opened from that link shows the trace's waterfall
    traces_page = console.page("traces")
    traces_page.query_params["trace"] = trace_id
    traces_page.run()
    assert trace_id in texts(traces_page)
    assert traces_page.get("vega_lite_chart") or traces_page.get("arrow_vega_lite_chart")


def _time_axes(at) -> list[dict]:
    """The x axis of every time chart on a rendered page (from the Vega-Lite specs it sent)."""
    specs = [json.loads(e.proto.spec) for kind in ("arrow_vega_lite_chart", "vega_lite_chart") for e in at.get(kind)]
    layers = [layer for spec in specs for layer in (spec.get("layer") or [spec])]
    return [x.get("axis") or {} for layer in layers
            if (x := (layer.get("encoding") or {}).get("x") or {}).get("type") == "temporal"]


def test_time_axes_read_24_hour_time_as_the_rest_of_the_console(console, cluster):
    """Vega's default axis labelled 19:30 "07:30" (12-hour, no am/pm) beside "Updated 19:30:47" and the
    tables' 24-hour times: an operator read the demand charts twelve hours off."""
    for tier in ("free", "plus"):
        assert chat(cluster.gateway.url, tier, "hello", max_tokens=2).status_code == 200
    deadline = time.monotonic() + 20
    for page in ("overview", "traffic", "autoscaler"):
        while not (axes := _time_axes(console.page(page))):  # demand reaches the signal history in seconds
            assert time.monotonic() < deadline, f"no time chart on {page}"
            time.sleep(0.5)
        for axis in axes:
            assert "%H:%M" in axis.get("labelExpr", ""), (page, axis)
