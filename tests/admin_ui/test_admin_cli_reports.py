"""`switchboard admin usage` and `switchboard admin abuse` (admin_ui/cli_reports.py) against the package's
real cluster: the gateway writes the ledger the control plane reads, the monitor bans an address that a
"gateway" reports; each failure is one line and a non-zero exit."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import time

import httpx
import pytest

from admin_ui.cli_reports import format_usage
from tests.admin_ui.test_admin_cli import run
from tests.support.cluster import ADMIN_TOKEN
from tests.support.procs import CLUSTER_HEADERS, free_port, switchboard

ADDRESS = "203.0.113.77"  # TEST-NET-3: never a real client (test_abuse_page bans .9)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, cluster, tmp_path):
    monkeypatch.setenv("SWITCHBOARD_CONTROL_PLANE_URL", cluster.control_plane.url)
    monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("SWITCHBOARD_CREDENTIALS_FILE", str(tmp_path / "credentials.json"))
    return cluster


def _requests(admin: httpx.Client, **params: str) -> int:
    return int(admin.get("/admin/v1/usage", params=params).json()["totals"]["requests"])


def test_usage_shows_a_keys_requests_per_tenant_and_tier_as_a_table_csv_and_json(env, admin, capsys) -> None:
    key_id = hashlib.sha256(env.keys["enterprise"].encode()).hexdigest()[:12]
    since = str(int(time.time()) - 1)  # this test's requests only (the ledger outlives earlier runs)
    for _ in range(2):
        r = httpx.post(env.gateway.url + "/v1/chat/completions", timeout=30,
                       headers={"Authorization": f"Bearer {env.keys['enterprise']}"},
                       json={"messages": [{"role": "user", "content": "count me"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 15  # the gateway writes the ledger in batches
    while _requests(admin, key=key_id, start=since) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    code, out, err = run(capsys, "usage", "--start", since, "--bucket", "none", "--key", key_id, "--by",
                         "tenant,tier,key_id")
    assert code == 0, err
    head, row = out.splitlines()[:2]
    assert head.split() == ["START", "(UTC)", "TENANT", "TIER", "KEY", "ID", "REQUESTS", "ERRORS", "PROMPT",
                            "CACHED", "COMPLETION"]
    assert row.split()[:6] == ["-", "bigco", "enterprise", key_id, "2", "0"], out
    assert "total: 2 requests, 0 errors" in out
    code, out, _ = run(capsys, "usage", "--start", since, "--bucket", "none", "--key", key_id, "--json")
    assert code == 0 and json.loads(out)["totals"]["requests"] == 2
    code, out, _ = run(capsys, "usage", "--start", since, "--bucket", "none", "--key", key_id, "--csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and [(r["tenant"], r["tier"], r["requests"]) for r in rows] == [("bigco", "enterprise", "2")]
    code, out, _ = run(capsys, "usage", "--since", "1h", "--tenant", "no-such-tenant")
    assert code == 0 and out.startswith("no usage recorded from ")


def test_usage_says_when_the_limit_cut_rows() -> None:
    body = {"bucket": "hour", "by": ["tenant"], "start": 0, "end": 7200, "truncated": True,
            "rows": [{"start": 3600, "tenant": "", "requests": 3}], "totals": {"requests": 9}}
    shown = format_usage(body)
    assert "(no valid key)" in shown and "1970-01-01 01:00" in shown and "total: 9 requests" in shown
    assert "truncated: more rows than --limit" in shown


def test_abuse_lists_a_ban_with_its_effect_then_confirms_and_lifts_it(env, admin, capsys) -> None:
    r = httpx.post(env.control_plane.url + "/v1/abuse/reports", headers=CLUSTER_HEADERS,
                   json={"auth_failures": {ADDRESS: 50}})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60  # the monitor evaluates every 5 s
    while not any(a["subject"] == ADDRESS for a in admin.get("/admin/v1/abuse").json()["actions"]):
        assert time.monotonic() < deadline
        time.sleep(0.3)
    action = next(a for a in admin.get("/admin/v1/abuse").json()["actions"] if a["subject"] == ADDRESS)
    code, out, err = run(capsys, "abuse", "--events", "5")
    assert code == 0, err
    line = next(x for x in out.splitlines() if f"address {ADDRESS}" in x)
    assert line.split()[:2] == [str(action["id"]), "ban"] and "pending" in line
    assert "ban: requests without a valid API key from this address: 403 address_banned" in out
    assert "events, newest first:" in out
    code, out, _ = run(capsys, "abuse", "confirm", str(action["id"]))
    assert (code, out.split(":")[0]) == (0, f"confirmed action {action['id']}")
    code, out, _ = run(capsys, "abuse", "lift", str(action["id"]), "--by", "oncall")
    assert code == 0 and out.startswith(f"lifted action {action['id']}: ban on address {ADDRESS}")
    body = admin.get("/admin/v1/abuse").json()
    assert not any(a["subject"] == ADDRESS for a in body["actions"])
    assert body["ended"][0]["subject"] == ADDRESS and body["ended"][0]["ended_by"] == "oncall"
    code, out, _ = run(capsys, "abuse", "--ended")
    assert code == 0 and "lifted by oncall" in out
    code, _, err = run(capsys, "abuse", "lift", str(action["id"]))  # no longer in force
    assert code == 1 and f"answered 404: no abuse action {action['id']} in force" in err


def test_misuse_is_one_line_and_a_non_zero_exit(env, monkeypatch, capsys) -> None:
    for argv, expected in (
            (("usage", "--since", "yesterday"), "argument --since: expected a duration such as 30m"),
            (("usage", "--start", "2026-13-01"), "argument --start: expected unix seconds or an ISO 8601 time"),
            (("usage", "--by", "tenant,colour"), "argument --by: group by one or more of tenant, tier"),
            (("usage", "--since", "1h", "--start", "0"), "give --since or --start, not both"),
            (("abuse", "lift"), "lift and confirm take an action ID"),
            (("abuse", "lift", "seven"), "an action id is a whole number"),
            (("abuse", "--events", "5000"), "argument --events: must be 0 to 1000")):
        code, _, err = run(capsys, *argv)
        assert code == 2 and expected in err and f"usage: switchboard admin {argv[0]}" in err, (argv, err)
    code, _, err = run(capsys, "usage", "--start", "2999-01-01")
    assert code == 1 and "answered 400: start must be before end" in err
    monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", "not-the-token")
    for command in ("usage", "abuse"):
        code, _, err = run(capsys, command)
        assert code == 1 and "refused the admin token" in err, err
    code, _, err = run(capsys, "abuse", "--control-plane-url", f"http://127.0.0.1:{free_port()}")
    assert code == 1 and "cannot reach the control plane" in err


def test_they_are_listed_in_switchboard_admin_help() -> None:
    shown = switchboard("admin", "--help", timeout=60)
    assert shown.returncode == 0 and "usage" in shown.stdout and "abuse" in shown.stdout
    for command in ("usage", "abuse"):
        assert switchboard("admin", command, "--help", timeout=60).returncode == 0
