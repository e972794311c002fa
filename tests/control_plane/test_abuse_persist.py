"""The abuse monitor's state at rest (control_plane/abuse/persist.py), on a clock the test moves:
a restarted monitor has the same actions with the same expiries, one whose time ran out while it
was down ends as expired at once, a ban's failures still count, a lift still holds its window; the
file is sealed (no key id, address or reason readable in it), opens only with its key, and a
tampered one is moved aside. The real restart (kill -9, gateways applying the restored state) is in
tests/control_plane/test_abuse_e2e.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from prometheus_client import CollectorRegistry

from control_plane.abuse.model import AbuseConfig, Response, Rule, Subject
from control_plane.abuse.monitor import AbuseMetrics, AbuseMonitor
from control_plane.abuse.persist import STATE_FILE, open_state_file

CONFIG = AbuseConfig(interval_s=1, window_s=60, auth_failures=5, session_404s=5,
                     durations_s={"ban": 30, "flag": 600, "throttle": 120, "block": 60, "strict": 300})
TOKEN = "sb-cluster-test"


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _monitor(state_dir: Path, clock: Clock, token: str = TOKEN) -> AbuseMonitor:
    registry = CollectorRegistry()
    store = open_state_file(state_dir, keys_file=None, cluster_token=token, registry=registry)
    return AbuseMonitor(CONFIG, None, AbuseMetrics(registry), clock=clock, store=store)


def test_actions_survive_a_restart_and_expire_on_time(tmp_path: Path) -> None:
    clock = Clock()
    first = _monitor(tmp_path, clock)
    first.report_auth_failures({"203.0.113.7": 5, "203.0.113.8": 5})
    asyncio.run(first.evaluate())
    bans = {a.subject: a for a in first.active()}
    assert set(bans) == {"203.0.113.7", "203.0.113.8"}
    confirmed = first.confirm(bans["203.0.113.8"].id)
    assert confirmed is not None
    lifted = first.lift(bans["203.0.113.7"].id, by="alice")
    assert lifted is not None

    raw = (tmp_path / STATE_FILE).read_text()
    assert "203.0.113" not in raw and "auth_failures" not in raw and "alice" not in raw  # sealed
    assert json.loads(raw)["sealed"].startswith("sb1.")

    clock.t += 10  # down for 10 s, then a new process on the same state dir
    second = _monitor(tmp_path, clock)
    [held] = second.active()
    assert held == confirmed  # same id, same expiry, still confirmed
    assert second.ended()[-1]["ended_by"] == "alice"
    assert [e.response for e in second.events()] == [Response.BAN, Response.BAN]
    asyncio.run(second.evaluate())  # the lifted address's failures are still in the window: the lift holds
    assert [a.subject for a in second.active()] == ["203.0.113.8"]
    assert second.state_body()["actions"][0]["subject_kind"] == "address"
    # the confirmed ban ends at its time, counted from before the restart
    clock.t = confirmed.expires_at
    asyncio.run(second.evaluate())
    assert second.active() == [] and second.ended()[-1]["ended"] == "expired"


def test_an_action_whose_time_ran_out_while_down_ends_at_start(tmp_path: Path) -> None:
    clock = Clock()
    first = _monitor(tmp_path, clock)
    first.report_auth_failures({"198.51.100.7": 5})
    asyncio.run(first.evaluate())
    [ban] = first.active()
    clock.t += 31  # past the ban's 30 s while no process ran
    second = _monitor(tmp_path, clock)
    assert second.active() == []
    assert second.ended()[-1]["id"] == ban.id and second.ended()[-1]["ended"] == "expired"
    # its failures are still in the window (60 s), as before the restart: the same step again
    asyncio.run(second.evaluate())
    [again] = second.active()
    assert (again.subject, again.rule, again.subject_kind) == ("198.51.100.7", Rule.AUTH_FAILURES, Subject.ADDRESS)
    assert again.id > ban.id  # ids never repeat across restarts


def test_the_file_opens_only_with_its_key_and_a_tampered_one_is_set_aside(tmp_path: Path) -> None:
    clock = Clock()
    first = _monitor(tmp_path, clock)
    first.report_auth_failures({"198.51.100.9": 5})
    asyncio.run(first.evaluate())
    assert len(first.active()) == 1
    other = _monitor(tmp_path, clock, token="another-cluster")  # a different key: not opened, set aside
    assert other.active() == [] and (tmp_path / (STATE_FILE + ".corrupt")).exists()

    again = _monitor(tmp_path, clock)  # the other one saved nothing yet (nothing changed): fresh start
    assert again.active() == []
    again.report_auth_failures({"198.51.100.9": 5})
    asyncio.run(again.evaluate())
    data = json.loads((tmp_path / STATE_FILE).read_text())
    envelope = data["sealed"]
    data["sealed"] = envelope[:-4] + ("AAAA" if envelope[-4:] != "AAAA" else "BBBB")
    (tmp_path / STATE_FILE).write_text(json.dumps(data))
    assert _monitor(tmp_path, clock).active() == []


def test_without_a_key_nothing_is_written(tmp_path: Path) -> None:
    assert open_state_file(tmp_path, keys_file=None, cluster_token=None) is None
    assert open_state_file(None, keys_file=None, cluster_token=TOKEN) is None
