"""Admin-API answers -> tables and tiles: unknown stays unknown, edits round-trip."""

from __future__ import annotations

import math

import pandas as pd

from admin_ui.views.abuse import RESPONSES, action_rows
from admin_ui.views.alerts import alert_rows
from admin_ui.views.cluster import idle_caption, members_frame
from admin_ui.views.signals import SignalsView, overview_tiles, split_signals
from admin_ui.views.tiers import (
    frame_problems,
    local_policy_problems,
    policy_from_frame,
    tier_history_frame,
    tiers_frame,
)
from admin_ui.views.traces import traces_frame, waterfall_frames

POLICY = {"tiers": {
    "free": {"priority": 2, "rpm": 60, "tpm": 20000, "max_context_tokens": 2048, "max_output_tokens": 256,
             "replication": 1, "shed_order": 0, "safety": "default"},
    "enterprise": {"priority": 0, "rpm": 6000, "tpm": 2000000, "max_context_tokens": 32768,
                   "max_output_tokens": 2048, "replication": 2, "shed_order": 2, "safety": "strict"},
}}


def test_tier_table_round_trips_to_the_put_body():
    frame = tiers_frame(POLICY)
    assert list(frame["tier"]) == ["enterprise", "free"]  # highest priority first
    assert policy_from_frame(frame) == POLICY


def test_blank_cells_are_left_out_and_unnamed_or_duplicate_rows_are_flagged():
    frame = tiers_frame(POLICY)
    frame.loc[0, "rpm"] = math.nan
    assert "rpm" not in policy_from_frame(frame)["tiers"]["enterprise"]
    frame.loc[1, "tier"] = "enterprise"
    assert any("duplicate" in p for p in frame_problems(frame))
    assert local_policy_problems({"tiers": {"x": {"rpm": 0, "replication": 9}}}) == [
        "x.rpm must be > 0 (got 0)", "x.replication must be 1..5 (got 9)"]


def test_a_shard_never_scraped_shows_unknown_not_zero():
    members = [{"id": "shard-0", "service": "shard", "status": "passing", "last_heartbeat": 100.0, "meta": {}}]
    latest = {"shards": [{"member_id": "shard-0", "running": None, "waiting": None, "kv_usage": None,
                          "error": "scrape failed"}]}
    row = members_frame(members, latest, now=101.5).iloc[0]
    assert row["running"] is None and row["utilisation"] is None and row["problem"] == "scrape failed"
    assert row["heartbeat_s"] == 1.5


def test_a_shards_kv_reuse_and_bytes_in_the_cluster_table():
    members = [{"id": "shard-0", "service": "shard", "status": "passing", "meta": {}}]
    latest = {"shards": [{"member_id": "shard-0", "prefix_hit_rate": 0.85, "prefix_cache_bytes": 3 * 2**20}]}
    row = members_frame(members, latest, now=1.0).iloc[0]
    assert row["prefix_hit_rate"] == 0.85 and row["prefix_cache_mib"] == 3.0
    never = members_frame(members, {"shards": [{"member_id": "shard-0"}]}, now=1.0).iloc[0]
    assert never["prefix_hit_rate"] is None and never["prefix_cache_mib"] is None


def test_prometheus_signals_name_a_shard_by_its_scrape_target_and_still_fill_its_row():
    # under `up --prometheus` the signals name a shard by Prometheus' `instance` (host:port), not its
    # member id: the Cluster table showed every shard's Running / Waiting / Batch load / KV cache empty
    members = [{"id": "shard-0", "service": "shard", "status": "passing", "url": "http://127.0.0.1:9320", "meta": {}},
               {"id": "gateway-1", "service": "gateway", "status": "passing", "url": "http://127.0.0.1:9310"}]
    latest = {"shards": [{"member_id": "127.0.0.1:9320", "running": 2.0, "waiting": 1.0, "kv_usage": 0.25,
                          "max_num_seqs": 4.0, "ttft_p95_s": 0.05, "prefix_hit_rate": 0.5}]}
    rows = members_frame(members, latest, now=1.0).set_index("member")
    shard = rows.loc["shard-0"]
    assert (shard["running"], shard["waiting"], shard["utilisation"], shard["kv_usage"]) == (2.0, 1.0, 0.75, 0.25)
    assert shard["ttft_p95_ms"] == 50.0 and shard["prefix_hit_rate"] == 0.5
    assert pd.isna(rows.loc["gateway-1", "running"])


def test_a_tier_missing_from_a_reading_counts_zero_in_the_history_charts():
    # the rejections chart started at the first rejection (beside a requests chart over the whole history)
    # and its line ended at the last rejection rate, as if rejections went on
    history = [{"at": 1.0, "rejections_by_tier": {}}, {"at": 2.0, "rejections_by_tier": {"free": 4.0}},
               {"at": 3.0, "rejections_by_tier": {}}, {"at": 4.0}]
    frame = tier_history_frame(history, "rejections_by_tier")
    assert list(frame["value"]) == [0.0, 4.0, 0.0] and set(frame["tier"]) == {"free"}
    assert tier_history_frame([{"at": 1.0, "rejections_by_tier": {}}], "rejections_by_tier").empty


def test_a_cache_nodes_kv_bytes_in_the_cluster_table():
    members = [{"id": "cache-0", "service": "cache", "status": "passing", "meta": {"kv_bytes": str(5 * 2**20)}},
               {"id": "cache-1", "service": "cache", "status": "passing", "meta": {}}]
    rows = members_frame(members, None, now=1.0)
    assert rows["prefix_cache_mib"][0] == 5.0 and pd.isna(rows["prefix_cache_mib"][1])


def test_signals_split_and_tiles():
    payload = {"latest": {"at": 2.0, "healthy_shards": 1, "shards": [{}, {}], "demand_by_tier": {"free": 1.5,
                                                                                               "plus": 0.5},
                          "ttft_p95_s": 0.25, "error_rate": 0.0, "tokens_per_s": 40.0, "complete": True},
               "history": [{"at": 2.0, "healthy_shards": 1}, {"at": 1.0, "healthy_shards": 2}]}
    latest, history = split_signals(payload)
    assert [h["at"] for h in history] == [1.0, 2.0]
    tiles = {t.label: t for t in overview_tiles(latest, history, {"level": 3, "pinned": True})}
    assert tiles["Requests / s"].value == "2.0 req/s"
    assert tiles["TTFT p95"].value == "250 ms" and tiles["TTFT p95"].status == "ok"
    assert tiles["TTFT p50"].status == "absent"  # not in these signals at all
    assert tiles["Healthy shards"].value == "1 / 2" and tiles["Healthy shards"].status == "warn"
    assert tiles["Healthy shards"].series == [2.0, 1.0]
    assert tiles["Degradation"].value == "L3 (pinned)" and tiles["Degradation"].status == "bad"


def test_alert_rows_put_firing_first():
    rows = alert_rows({"source": "alertmanager", "alerts": [
        {"name": "A", "state": "resolved", "severity": "info", "summary": "", "active_at": 5},
        {"name": "B", "state": "active", "severity": "critical", "summary": "down", "labels": {"job": "x"}}]})
    assert [(r["name"], r["state"]) for r in rows] == [("B", "firing"), ("A", "resolved")]
    assert rows[0]["labels"] == "job=x"


def test_waterfall_puts_children_under_parents_with_offsets():
    span = lambda sid, parent, name, start, end, service="switchboard-gateway": {
        "span_id": sid, "parent_span_id": parent, "name": name, "service": service, "start_ns": start,
        "end_ns": end, "status": "OK", "attributes": {}, "events": []}
    trace = {"spans": [span("c", "a", "router.route", 3_000_000, 9_000_000),
                       span("a", "x", "gateway.request", 1_000_000, 10_000_000),
                       span("d", "c", "shard.generate", 4_000_000, 8_000_000, "switchboard-shard"),
                       span("b", "a", "ratelimit", 1_500_000, 1_600_000)]}
    spans, events = waterfall_frames(trace)
    assert list(spans["name"]) == ["gateway.request", "ratelimit", "router.route", "shard.generate"]
    assert spans.iloc[0]["start_ms"] == 0 and spans.iloc[3]["duration_ms"] == 4.0
    assert list(spans["service"]) == ["gateway", "gateway", "gateway", "shard"]
    assert events.empty


def test_trace_list_says_a_recovered_request_was_ok_and_why_it_has_a_failed_span():
    base = {"start": 0, "tier": "plus", "root": "gateway.request", "duration_ms": 6411.0, "span_count": 4}
    frame = traces_frame([{**base, "trace_id": "a", "status": "ok", "failed_spans": 1},
                          {**base, "trace_id": "b", "status": "ok", "failed_spans": 0},
                          {**base, "trace_id": "c", "status": "error", "failed_spans": 2},
                          {**base, "trace_id": "d", "status": "ok"}])  # an older control plane: no count
    assert list(frame["status"]) == ["ok (1 leg failed)", "ok", "error", "ok"]
    limited = {**base, "trace_id": "e", "status": "error", "spans": [
        {"name": "ratelimit", "attributes": {"switchboard.ratelimit.allowed": False}},
        {"name": "gateway.request", "attributes": {"error.type": "rate_limit_exceeded"}}]}
    assert list(traces_frame([limited])["status"]) == ["error (rate_limit_exceeded)"]  # why, without opening it


def test_signals_view_reads_fields_by_attribute_and_a_missing_field_is_incomplete() -> None:
    reading = {"complete": True, "missing": [], "healthy_shards": 2, "waiting_per_shard": 0.0,
               "load_per_shard": 1.0, "capacity_per_shard": 16, "batch_usage": 0.06, "kv_usage": 0.1,
               "queue_time_p95_s": 0.0, "ttft_excess_p95_s": 0.02, "prefill_p95_s": 2.4, "ttft_p95_s": 2.42}
    sig = SignalsView.from_api(reading)
    assert sig.complete and sig.missing == () and sig.ttft_excess_p95_s == 0.02
    renamed = {k: v for k, v in reading.items() if k != "queue_time_p95_s"} | {"queue_p95_s": 0.0}
    sig = SignalsView.from_api(renamed)
    assert not sig.complete and sig.queue_time_p95_s is None
    assert sig.missing == ("field 'queue_time_p95_s' absent from the signals",)
    assert not SignalsView.from_api(None).complete


def test_a_pipelined_shards_stages_hosts_and_layers():
    from admin_ui.views.cluster import stages_frame

    members = [{"id": "shard-pp", "service": "shard", "status": "passing",
                "meta": {"pipeline_parallel_size": "3", "pipeline_stages": "0@10.0.0.5:0-10,1@10.0.0.6:10-20,2@h7:20-30"}},
               {"id": "shard-1", "service": "shard", "status": "passing", "meta": {"pipeline_parallel_size": "1"}},
               {"id": "bad", "service": "shard", "status": "passing", "meta": {"pipeline_stages": "x,@:,1@:3"}}]
    frame = stages_frame(members)
    assert list(frame["member"]) == ["shard-pp"] * 3
    assert list(frame["stage"]) == ["1 of 3", "2 of 3", "3 of 3"]
    assert list(frame["host"]) == ["10.0.0.5", "10.0.0.6", "h7"]
    assert list(frame["layers"]) == ["0..9", "10..19", "20..29"]
    assert "3 pipeline stages" in members_frame(members, None, now=1.0).set_index("member").loc["shard-pp", "detail"]
    assert stages_frame(members[1:2]).empty


def test_the_overview_names_a_shard_that_is_down_instead_of_calling_it_idle() -> None:
    """With one of two shards frozen (critical, no load figures) the Overview said "All 2 shards idle"."""
    members = [{"id": "shard-0", "service": "shard", "status": "critical"},
               {"id": "shard-1", "service": "shard", "status": "passing"}]
    latest = {"shards": [{"member_id": "shard-1", "running": 0, "waiting": 0}]}
    assert idle_caption(members_frame(members, latest, now=1.0)) == (
        "1 passing shard idle: nothing running or waiting; not passing: shard-0 (critical).")
    members[0]["status"] = "passing"
    assert idle_caption(members_frame(members, latest, now=1.0)) == "All 2 shards idle: nothing running or waiting."
    busy = {"shards": [{"member_id": "shard-1", "running": 2, "waiting": 0}]}
    assert idle_caption(members_frame(members, busy, now=1.0)) is None
    for m in members:
        m["status"] = "critical"
    assert idle_caption(members_frame(members, None, now=1.0)) == (
        "No shard passing; not passing: shard-0 (critical), shard-1 (critical).")


def test_abuse_rows_say_what_the_gateways_do_a_ban_serves_valid_keys():
    # The page named a ban without saying what it does, and the code's own description was out of date
    # ("403 before the key is even looked up"): a ban refuses only requests without a valid key.
    actions = [{"id": i, "response": r, "subject_kind": "key", "subject": f"s{i}", "tenant": "t", "rule": "burst",
                "reason": "why", "created_at": 0.0, "expires_at": 60.0, "review": "pending"}
               for i, r in enumerate(RESPONSES)]
    rows = {r["response"]: r for r in action_rows(actions, 0.0, {"throttle_rpm": 6, "strict_max_output_tokens": 128})}
    ban = rows["ban"]["effect"]
    assert "without a valid API key" in ban and "valid keys are served" in ban and "403 address_banned" in ban
    assert "6 requests a minute" in rows["throttle"]["effect"] and "128 tokens" in rows["strict"]["effect"]
    assert "429 abuse_blocked" in rows["block"]["effect"] and "untouched" in rows["flag"]["effect"]
    assert "?" in action_rows(actions[2:3], 0.0)[0]["effect"]  # a payload without its config: unknown, not made up


def test_a_shards_fingerprint_is_in_its_detail():
    """Which numerics each shard serves (its `system_fingerprint`): shards of two formats tell apart."""
    members = [{"id": f"shard-{i}", "service": "shard", "status": "passing",
                "meta": {"model": "m", "engine": "torch", "fingerprint": fp}} for i, fp in enumerate(["fp_a", "fp_b"])]
    detail = members_frame(members, None, now=1.0).set_index("member")["detail"]
    assert detail["shard-0"] == "model=m, engine=torch, fingerprint=fp_a" and "fingerprint=fp_b" in detail["shard-1"]
