"""The abuse monitor over a real SQLite usage ledger, on a clock the test moves: a bursting key is
flagged, then throttled, then blocked, while a normal key beside it never is; actions expire; a
lift holds for one window; a confirmation holds; an address with repeated bad keys is banned and
the ban ends by itself; and the rules never see text (the ledger has none to give)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from control_plane.abuse.model import AbuseConfig, Response, Review, Rule, Subject
from control_plane.abuse.monitor import AbuseMetrics, AbuseMonitor
from control_plane.abuse.rules import evaluate
from data_plane.ledger.store import COLUMNS, KeyActivity, open_ledger_store

CONFIG = AbuseConfig(interval_s=1, window_s=60, baseline_s=3600, burst_factor=10, burst_min_requests=30,
                     burst_min_tokens=10**9, blocked_prompts=3, session_404s=5, errors=1000, auth_failures=5,
                     escalate_after_s=10, durations_s={"flag": 600, "throttle": 120, "block": 60, "ban": 30,
                                                       "strict": 300})


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _row(key: str, at: float, code: str = "", tokens: int = 10, tenant: str = "acme") -> tuple[object, ...]:
    values = {"request_id": uuid.uuid4().hex, "trace_id": "", "key_id": key, "tenant": tenant, "tier": "plus",
              "model": "m", "prompt_tokens": tokens, "cached_tokens": 0, "completion_tokens": 0,
              "status": 200 if not code else 400, "error_code": code, "ttft_s": None, "latency_s": 0.1, "shard": "",
              "degradation_level": 0, "session": False, "gateway": "gw", "started_at": at, "finished_at": at}
    values.update(output_kind="text", tool_calls=0)  # columns added later, at their defaults
    return tuple(values[c] for c in COLUMNS)


@pytest.fixture()
def ledger(tmp_path: Path):  # type: ignore[no-untyped-def]
    store = open_ledger_store(f"sqlite:///{tmp_path / 'usage.db'}")
    store.migrate()
    yield store
    store.close()


def _monitor(store: object, clock: Clock, config: AbuseConfig = CONFIG) -> tuple[AbuseMonitor, CollectorRegistry]:
    registry = CollectorRegistry()
    return AbuseMonitor(config, store, AbuseMetrics(registry), clock=clock), registry  # type: ignore[arg-type]


def _steady(key: str, per_min: float, start: float, end: float, tenant: str = "acme") -> list[tuple[object, ...]]:
    step = 60.0 / per_min
    return [_row(key, start + i * step, tenant=tenant) for i in range(int((end - start) / step))]


def test_each_key_is_measured_against_its_own_baseline_under_a_mixed_load(ledger) -> None:  # type: ignore[no-untyped-def]
    """The bursting key sends far less than the steady ones: only its departure from its own usual
    rate flags it, then throttles it; no key at its usual pace (a big old one, a big one that
    started 5 minutes ago, a new small one) and not the tenant they all belong to is ever listed."""
    config = replace(CONFIG, tenant_burst_min_requests=200)
    clock = Clock()
    t = clock.t
    ledger.insert_many(_steady("big_old", 100, t - 3600, t + 60)        # 100 a minute for the whole hour
                       + _steady("big_new", 300, t - 360, t + 60)       # 300 a minute, only for 6 minutes
                       + _steady("quiet", 2, t - 3600, t - 60)          # 2 a minute ...
                       + _steady("quiet", 60, t - 60, t)                # ... then 60 in the window (30x)
                       + _steady("newbie", 20, t - 60, t + 60))         # no history, below the floor (30)
    monitor, _ = _monitor(ledger, clock, config)
    findings = asyncio.run(monitor.evaluate())
    assert [(f.rule, f.subject) for f in findings] == [(Rule.BURST, "quiet")], findings
    [flag] = monitor.active()
    assert (flag.subject, flag.response) == ("quiet", Response.FLAG)
    assert flag.reason == "60 requests in the window, usually 2 (threshold 30)", flag.reason
    for _ in range(3):  # the burst goes on while everyone else keeps their pace
        clock.t += 6
        ledger.insert_many(_steady("quiet", 60, clock.t - 6, clock.t))
        assert [f.subject for f in asyncio.run(monitor.evaluate())] == ["quiet"]
    [throttle] = monitor.active()
    assert (throttle.subject, throttle.response) == ("quiet", Response.THROTTLE)
    assert [a["subject"] for a in monitor.state_body()["actions"]] == ["quiet"]
    # what the flat floor alone (the old rule) would have made of the same minute: every big key flagged
    flat = replace(config, baseline_s=0)
    recent = ledger.activity(clock.t - 60, clock.t)
    assert {f.subject for f in evaluate(flat, recent, [], {}) if f.rule is Rule.BURST} >= {"big_old", "big_new"}


def test_tenant_aggregates_catch_what_is_spread_over_its_keys(ledger) -> None:  # type: ignore[no-untyped-def]
    config = replace(CONFIG, tenant_burst_min_requests=100, tenant_session_404s=10)
    clock = Clock()
    t = clock.t
    rows: list[tuple[object, ...]] = []
    for i in range(6):  # six keys, each 1 a minute for an hour, then 20 in the window (below the key floor 30)
        rows += _steady(f"g{i}", 1, t - 3600, t - 60, tenant="globex") + _steady(f"g{i}", 20, t - 60, t, "globex")
    for i in range(4):  # four keys, 3 unknown session ids each (below the key floor 5): 12 for the tenant
        rows += [_row(f"i{i}", t - 30 - j, "session_not_found", tenant="initech") for j in range(3)]
    rows += _steady("big", 200, t - 3600, t, tenant="acme")  # a tenant above the floor, at its usual pace
    ledger.insert_many(rows)
    monitor, _ = _monitor(ledger, clock, config)
    asyncio.run(monitor.evaluate())
    found = {(a.subject_kind, a.subject, a.rule, a.response) for a in monitor.active()}
    assert found == {(Subject.TENANT, "globex", Rule.TENANT_BURST, Response.FLAG),
                     (Subject.TENANT, "initech", Rule.TENANT_SESSION_PROBING, Response.FLAG)}, found
    burst = next(a for a in monitor.active() if a.subject == "globex")
    assert burst.reason.startswith("120 requests from all the tenant's keys in the window, usually 6")
    assert monitor.state_body()["actions"] == []  # flags for review: no gateway acts on a whole tenant


def test_session_404s_are_measured_against_the_keys_usual_count(ledger) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    t = clock.t
    # a client that always asks for a few expired sessions (5 a minute for an hour) is not probing
    ledger.insert_many([_row("stale", t - 3600 + i * 12, "session_not_found") for i in range(300)]
                       + [_row("stale", t - 59 + i * 12, "session_not_found") for i in range(5)]
                       + [_row("prober", t - 20 - i, "session_not_found") for i in range(5)])
    monitor, _ = _monitor(ledger, clock)
    asyncio.run(monitor.evaluate())
    [probe] = monitor.active()
    assert (probe.subject, probe.rule) == ("prober", Rule.SESSION_PROBING)
    assert "session id probing" in probe.reason and "usually 0" in probe.reason


def test_a_burst_is_flagged_then_throttled_then_blocked_and_the_normal_key_never(ledger) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    t = clock.t
    # a day of history: the normal key's usual rate is 20 a minute (it may send 199 in the window
    # before its baseline bar, 10 x 20, is reached); the bursting key's is 1 an hour
    ledger.insert_many([_row("normal", t - 3600 + i * 3) for i in range(1200)] + [_row("bursty", t - 1800)])
    # the window: the normal key at its usual pace, the bursting one at 50 a minute
    ledger.insert_many([_row("normal", t - 59 + i * 3) for i in range(20)] + [_row("bursty", t - 50 + i) for i in range(50)])
    monitor, registry = _monitor(ledger, clock)
    asyncio.run(monitor.evaluate())
    [flag] = monitor.active()
    assert (flag.subject, flag.rule, flag.response) == ("bursty", Rule.BURST, Response.FLAG)
    assert "50 requests" in flag.reason and flag.review is Review.PENDING
    assert monitor.state_body()["actions"] == []  # a flag is for review: no gateway acts on it

    clock.t += 5  # still bursting, too soon to escalate
    ledger.insert_many([_row("bursty", clock.t - 5 + i * 0.5) for i in range(10)])
    asyncio.run(monitor.evaluate())
    assert [a.response for a in monitor.active()] == [Response.FLAG]
    clock.t += 6
    ledger.insert_many([_row("bursty", clock.t - 6 + i * 0.5) for i in range(12)])
    asyncio.run(monitor.evaluate())
    [throttle] = monitor.active()
    assert throttle.response is Response.THROTTLE
    assert monitor.state_body()["actions"][0]["subject"] == "bursty"
    clock.t += 11
    ledger.insert_many([_row("bursty", clock.t - 1 - i * 0.1) for i in range(20)])
    asyncio.run(monitor.evaluate())
    [block] = monitor.active()
    assert block.response is Response.BLOCK and block.expires_at == clock.t + 60
    assert not any(a.subject == "normal" for a in monitor.active())
    assert registry.get_sample_value("switchboard_abuse_events_total", {"rule": "burst", "response": "block"}) == 1
    assert registry.get_sample_value("switchboard_abuse_actions_active", {"response": "block"}) == 1
    assert [e.response for e in monitor.events()] == [Response.FLAG, Response.THROTTLE, Response.BLOCK]

    # the top of the ladder holds while the burst is still in the window ...
    clock.t += 11
    asyncio.run(monitor.evaluate())
    assert [a.response for a in monitor.active()] == [Response.BLOCK]
    # ... and the block expires by itself once the burst is over (the window has moved past it)
    clock.t += 50
    asyncio.run(monitor.evaluate())
    assert monitor.active() == []
    assert monitor.ended()[-1]["ended"] == "expired"


def test_a_key_that_stopped_is_not_escalated_for_what_is_still_in_the_window(ledger) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    ledger.insert_many([_row("once", clock.t - 30 + i * 0.5) for i in range(40)]
                       + [_row("refused", clock.t - 20, "content_policy_violation") for _ in range(3)])
    monitor, _ = _monitor(ledger, clock)
    asyncio.run(monitor.evaluate())
    assert {(a.subject, a.response) for a in monitor.active()} == {("once", Response.FLAG), ("refused", Response.STRICT)}
    clock.t += 11  # both rules still fire (the window holds it all), but neither key did anything since
    asyncio.run(monitor.evaluate())
    assert {(a.subject, a.response) for a in monitor.active()} == {("once", Response.FLAG), ("refused", Response.STRICT)}
    # a key that keeps trying under its action is keeping at it: refused requests count
    ledger.insert_many([_row("refused", clock.t - 1, "abuse_throttled")])
    asyncio.run(monitor.evaluate())
    assert ("refused", Response.BLOCK) in {(a.subject, a.response) for a in monitor.active()}


def test_lift_holds_for_a_window_and_confirm_holds_the_action(ledger) -> None:  # type: ignore[no-untyped-def]
    clock = Clock()
    ledger.insert_many([_row("bursty", clock.t - 30 + i * 0.5) for i in range(40)]
                       + [_row("prober", clock.t - 10 - i, "session_not_found") for i in range(6)])
    monitor, _ = _monitor(ledger, clock)
    asyncio.run(monitor.evaluate())
    by_rule = {a.rule: a for a in monitor.active()}
    assert set(by_rule) == {Rule.BURST, Rule.SESSION_PROBING}
    index = monitor.index.index
    lifted = monitor.lift(by_rule[Rule.BURST].id, by="alice")
    assert lifted is not None and monitor.index.index == index + 1
    assert monitor.ended()[-1]["ended_by"] == "alice"
    clock.t += 20  # the burst is still in the window: no new action within the window after a lift
    ledger.insert_many([_row("prober", clock.t - 1, "session_not_found")])  # still probing
    asyncio.run(monitor.evaluate())
    assert {a.rule for a in monitor.active()} == {Rule.SESSION_PROBING}
    probing = next(a for a in monitor.active() if a.rule is Rule.SESSION_PROBING)  # escalated by now
    assert probing.response is Response.THROTTLE
    confirmed = monitor.confirm(probing.id)
    assert confirmed is not None and confirmed.review is Review.CONFIRMED
    assert confirmed.expires_at >= clock.t + CONFIG.confirm_hold_s
    assert monitor.lift(999_999) is None and monitor.confirm(999_999) is None


def test_an_address_with_repeated_bad_keys_is_banned_then_unbanned() -> None:
    clock = Clock()
    monitor, _ = _monitor(None, clock)
    monitor.report_auth_failures({"10.0.0.7": 3, "10.0.0.8": 1})
    asyncio.run(monitor.evaluate())
    assert monitor.active() == []
    monitor.report_auth_failures({"10.0.0.7": 2})
    asyncio.run(monitor.evaluate())
    [ban] = monitor.active()
    assert (ban.subject_kind, ban.subject, ban.response) == (Subject.ADDRESS, "10.0.0.7", Response.BAN)
    assert monitor.state_body()["actions"][0]["subject_kind"] == "address"
    clock.t += 31  # the ban's time is up, but its failures are still in the window (60 s): banned again
    asyncio.run(monitor.evaluate())
    assert [a.response for a in monitor.active()] == [Response.BAN]
    clock.t += 31  # no failure since (a banned address never reaches the key lookup): unbanned
    asyncio.run(monitor.evaluate())
    assert monitor.active() == []


def test_rules_count_codes_not_text() -> None:
    rows = [KeyActivity("k", "acme", "content_policy_violation", 3, 0), KeyActivity("k", "acme", "", 2, 50),
            KeyActivity("k", "acme", "overloaded", 4, 0), KeyActivity("k", "acme", "model_loading", 4, 0),
            KeyActivity("k", "acme", "grammar_compiler_busy", 4, 0), KeyActivity("k", "acme", "cache_backend_unavailable", 4, 0)]
    found = evaluate(replace(CONFIG, errors=1), rows, [], {})
    assert [(f.rule, f.observed) for f in found] == [(Rule.BLOCKED_PROMPTS, 3)]  # 5xx codes are not the client's errors
    assert found[0].reason == "3 prompts refused by the input filter (threshold 3)"


def test_a_key_that_abandons_most_of_its_requests_is_flagged_and_a_chat_app_whose_users_press_stop_is_not() -> None:
    """The soak's abusive tenant: long prompts, streams dropped after the first token, a few errors; the
    polite one: many more requests, some stopped. Only the first is `abandoned` (count and share)."""
    rows = [KeyActivity("rogue", "r", "client_disconnected", 150, 200_000), KeyActivity("rogue", "r", "", 40, 9_000),
            KeyActivity("acme", "a", "client_disconnected", 150, 30_000), KeyActivity("acme", "a", "", 350, 90_000)]
    found = evaluate(AbuseConfig(), rows, [], {})
    assert [(f.rule, f.subject, f.observed) for f in found] == [(Rule.ABANDONED, "rogue", 150)]
    assert found[0].reason.startswith("150 requests abandoned before their answer ended")
    assert Rule.ABANDONED.ladder == (Response.FLAG, Response.THROTTLE)
    # measured against the key's own usual count, as the other rules are: an app that always drops most
    # of its streams (a prefetcher) at 150 a window is not flagged for 150 now
    usual = [KeyActivity("rogue", "r", "client_disconnected", 150 * 288, 0, first_at=0.0)]
    assert evaluate(AbuseConfig(), rows, usual, {}, baseline_end=86400.0) == []


def test_config_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "abuse.yaml"
    path.write_text("window_s: 30\ndurations_s: {ban: 5}\n")
    config = AbuseConfig.from_file(path)
    assert config.window_s == 30 and config.duration(Response.BAN) == 5 and config.duration(Response.BLOCK) == 300
    path.write_text("windw_s: 30\n")
    with pytest.raises(ValueError, match="unknown abuse settings"):
        AbuseConfig.from_file(path)
