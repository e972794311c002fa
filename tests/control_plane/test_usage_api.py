"""GET /admin/v1/usage on a real control plane reading a ledger (SQLite file written here).

    .venv/bin/python -m pytest tests/control_plane/test_usage_api.py -q
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from data_plane.ledger.store import open_ledger_store
from tests.support.cluster import ADMIN_TOKEN
from tests.support.ledger import usage_record
from tests.support.procs import Service

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
DAY = 86400


@pytest.fixture(scope="module")
def usage_cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, float]]:
    db = tmp_path_factory.mktemp("usage") / "usage.db"
    store = open_ledger_store(f"sqlite:///{db}")
    store.migrate()
    # the day whose hour 1 is past: run between 00:00 and 01:01 UTC, today's 01:01 record was in the future,
    # outside the API's default range (ending now), and two tests failed (CI at 00:05 UTC)
    today = DAY * ((int(time.time()) - 2 * 3600) // DAY)
    records = [
        usage_record(1, started_at=today + 60, tenant="acme", tier="plus", key_id="ka", prompt_tokens=10),
        usage_record(2, started_at=today + 3600 + 60, tenant="acme", tier="free", key_id="kb", prompt_tokens=20,
                status=429, error_code="rate_limit_exceeded"),
        usage_record(3, started_at=today - DAY + 60, tenant="bigco", tier="enterprise", key_id="kc", prompt_tokens=40,
                model="other"),
    ]
    store.insert_many([r.as_row() for r in records])
    store.close()
    with Service(["control-plane", "--admin-token", ADMIN_TOKEN, "--usage-db", f"sqlite:///{db}"]) as cp:
        yield cp, today


def test_usage_needs_the_admin_token(usage_cp: tuple[Service, float]) -> None:
    cp, _ = usage_cp
    for headers in ({}, {"Authorization": "Bearer nope"}):
        assert httpx.get(cp.url + "/admin/v1/usage", headers=headers).status_code == 401


def test_usage_groups_filters_and_totals(usage_cp: tuple[Service, float]) -> None:
    cp, today = usage_cp
    get = lambda **p: httpx.get(cp.url + "/admin/v1/usage", params=p, headers=AUTH)
    body = get(group_by="day").json()
    assert body["totals"]["requests"] == 3 and body["totals"]["errors"] == 1
    assert body["totals"]["prompt_tokens"] == 70
    assert next((r["start"], r["tenant"], r["tier"]) for r in body["rows"]) == (today - DAY, "bigco", "enterprise")
    hours = get(group_by="hour", tenant="acme", by="tier").json()
    assert [(r["start"] - today, r["tier"]) for r in hours["rows"]] == [(0, "plus"), (3600, "free")]
    assert get(key="kc").json()["totals"]["prompt_tokens"] == 40
    assert get(model="other", group_by="none", by="").json()["rows"][0]["requests"] == 1
    assert get(start=today, end=today + 3600).json()["totals"]["requests"] == 1
    assert get(tier="nope").json()["totals"]["requests"] == 0
    assert get(by="prompt").status_code == 400
    assert get(group_by="week").status_code in (400, 422)


def test_a_time_that_is_not_a_number_is_a_400(usage_cp: tuple[Service, float]) -> None:
    # start=nan passed every check (nan >= end is false) and the JSON answer could not hold it: a 500
    cp, _today = usage_cp
    for params in ({"start": "nan"}, {"start": "-inf"}, {"end": "nan"}, {"start": "0", "end": "inf"}):
        r = httpx.get(cp.url + "/admin/v1/usage", params=params, headers=AUTH)
        assert r.status_code == 400, (params, r.status_code, r.text)
        assert r.json()["error"]["param"] in ("start", "end")


def test_usage_as_csv(usage_cp: tuple[Service, float]) -> None:
    cp, _today = usage_cp
    r = httpx.get(cp.url + "/admin/v1/usage", params={"format": "csv", "group_by": "day"}, headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert {row["tenant"] for row in rows} == {"acme", "bigco"}
    assert sum(int(row["prompt_tokens"]) for row in rows) == 70
    assert rows[0]["start"].endswith("Z")


def test_a_ledger_no_gateway_wrote_yet_reads_empty(tmp_path: Path) -> None:
    with Service(["control-plane", "--admin-token", ADMIN_TOKEN, "--usage-db",
                  f"sqlite:///{tmp_path / 'fresh.db'}"]) as cp:
        r = httpx.get(cp.url + "/admin/v1/usage", headers=AUTH)
        assert r.status_code == 200 and r.json()["totals"]["requests"] == 0


def test_rows_the_limit_cuts_are_said_and_never_half_a_bucket(usage_cp: tuple[Service, float]) -> None:
    """`limit` kept the newest rows and dropped the rest without a word (the totals, whole, disagreed with the
    rows; a month of hourly rows per key past 10,000 lost its first days in the CSV an operator bills from),
    and a bucket it cut through lost some of its groups. Now the answer says `truncated` (the CSV in a header)
    and a bucket is kept whole or not at all."""
    cp, today = usage_cp
    get = lambda **p: httpx.get(cp.url + "/admin/v1/usage", params={"group_by": "day", **p}, headers=AUTH)
    whole = get(limit=3).json()
    assert whole["truncated"] is False and len(whole["rows"]) == 3
    newest = get(limit=2).json()
    assert newest["truncated"] is True and newest["totals"] == whole["totals"]
    assert [(r["start"], r["tier"]) for r in newest["rows"]] in ([(today, "plus"), (today, "free")],
                                                                 [(today, "free"), (today, "plus")])
    cut = get(limit=1).json()  # today's two groups do not fit in one row: today is left out, not halved
    assert cut["truncated"] is True and cut["rows"] == []
    csv_answer = get(limit=2, format="csv")
    assert csv_answer.headers["x-switchboard-truncated"] == "true"
    assert get(limit=3, format="csv").headers["x-switchboard-truncated"] == "false"
