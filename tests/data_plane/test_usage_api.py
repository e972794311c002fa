"""A key's own usage, `GET /v1/usage` (and `/v1/organization/usage/completions`, the openai SDK's path), in
the shape and with the parameters of OpenAI's usage API, on a real gateway reading a real ledger (SQLite and
PostgreSQL), and what the ledger records of requests that failed or were left.

    .venv/bin/python -m pytest tests/data_plane/test_usage_api.py -q

PostgreSQL cases start a throwaway server (tests/support/postgres.py) and skip when it is not installed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.admin.organization.usage_completions_response import (
    DataResultOrganizationUsageCompletionsResult as CompletionsResult,
)

from data_plane.gateway.auth import KEY_ID_LENGTH, key_digest
from data_plane.ledger.store import open_ledger_store
from tests.support.cluster import KEYS, Cluster, api_keys_env, cache_node
from tests.support.ledger import usage_record
from tests.support.metrics import metric
from tests.support.postgres import PostgresServer
from tests.support.procs import Service

HOUR, DAY = 3600, 86400
MINE, OTHER = (key_digest(KEYS[k])[:KEY_ID_LENGTH] for k in ("plus", "plus2"))
D = DAY * (int(time.time()) // DAY - 3)
"""A UTC day three days back: every record below is in the past."""
RECORDS = [
    usage_record(1, started_at=D + 60, key_id=MINE, model="m1", prompt_tokens=10, cached_tokens=2,
                 completion_tokens=5),
    usage_record(2, started_at=D + HOUR + 10, key_id=MINE, model="m2", prompt_tokens=20, cached_tokens=0,
                 completion_tokens=7),
    usage_record(3, started_at=D + 2 * HOUR, key_id=MINE, model="m1", prompt_tokens=3, cached_tokens=0,
                 completion_tokens=4),  # exactly on a bucket's (and an end_time's) boundary
    usage_record(4, started_at=D + 3 * HOUR, key_id=MINE, model="m1", prompt_tokens=0, cached_tokens=0,
                 completion_tokens=0, status=429, error_code="rate_limit_exceeded", shard=""),  # no model answered
    usage_record(5, started_at=D + 4 * HOUR, key_id=MINE, model="m1", prompt_tokens=0, cached_tokens=0,
                 completion_tokens=0, status=503, error_code="cache_unavailable"),  # the server failed it
    usage_record(6, started_at=D + 5 * HOUR, key_id=OTHER, model="m1", prompt_tokens=100, cached_tokens=0,
                 completion_tokens=100),  # another key of the same tenant
    usage_record(7, started_at=D + DAY + 5, key_id=MINE, model="m1", prompt_tokens=1, cached_tokens=0,
                 completion_tokens=1),
]


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def usage_gw(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A gateway (no shard needed) whose ledger holds RECORDS."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('usage') / 'usage.db'}"
        pg = None
    else:
        pg = PostgresServer().start()
        url = pg.create_database("usage")
    try:
        store = open_ledger_store(url)
        store.migrate()
        store.insert_many([r.as_row() for r in RECORDS])
        store.close()
        with Service(["gateway", "--cache-urls", "http://127.0.0.1:1", "--usage-db", url,
                      "--state-dir", str(tmp_path_factory.mktemp("gw"))],
                     env={"SWITCHBOARD_GATEWAY_API_KEYS": api_keys_env()}) as gw:
            yield gw
    finally:
        if pg is not None:
            pg.stop()


def _get(gw: Service, params: Any, key: str = "plus", path: str = "/v1/usage") -> httpx.Response:
    return httpx.get(gw.url + path, params=params, headers={"Authorization": f"Bearer {KEYS[key]}"}, timeout=30)


def _page(gw: Service, params: Any, key: str = "plus") -> dict[str, Any]:
    r = _get(gw, params, key)
    assert r.status_code == 200, r.text
    return r.json()


def _results(page: dict[str, Any]) -> list[dict[str, Any]]:
    return [x for b in page["data"] for x in b["results"]]


def test_pages_hold_limit_buckets_every_one_and_continue_exactly(usage_gw: Service) -> None:
    """`limit` and `page` were ignored: one page of every bucket with data, has_more always false, no
    empty bucket. Now `limit` buckets a page, each of them (empty ones with results []), and next_page
    continues where the page ended until has_more is false."""
    params: dict[str, Any] = {"start_time": D, "end_time": D + 6 * HOUR, "bucket_width": "1h", "limit": 2}
    pages = [_page(usage_gw, params)]
    while pages[-1]["has_more"]:
        assert len(pages) < 5
        pages.append(_page(usage_gw, {**params, "page": pages[-1]["next_page"]}))
    assert [len(p["data"]) for p in pages] == [2, 2, 2] and pages[-1]["next_page"] is None
    starts = [b["start_time"] for p in pages for b in p["data"]]
    assert starts == [D + i * HOUR for i in range(6)]
    assert all(b["end_time"] == b["start_time"] + HOUR and b["object"] == "bucket" for p in pages for b in p["data"])
    per_bucket = [[(x["input_tokens"], x["output_tokens"], x["num_model_requests"]) for x in b["results"]]
                  for p in pages for b in p["data"]]
    # the 429 (no model answered), the 503 (billed nothing) and the other key's request count nowhere
    assert per_bucket == [[(10, 5, 1)], [(20, 7, 1)], [(3, 4, 1)], [], [], []]
    first = _results(pages[0])[0]
    assert first["object"] == "organization.usage.completions.result"
    assert (first["input_cached_tokens"], first["input_uncached_tokens"]) == (2, 8)
    assert first["model"] is None and first["api_key_id"] is None and first["project_id"] is None
    # the defaults: 7 day buckets from start_time (the 8th, today, on the next page)
    days = _page(usage_gw, {"start_time": D - 4 * DAY})
    assert [b["start_time"] for b in days["data"]] == [D + (i - 4) * DAY for i in range(7)] and days["has_more"]
    assert sum(x["num_model_requests"] for x in _results(days)) == 4
    rest = _page(usage_gw, {"start_time": D - 4 * DAY, "page": days["next_page"]})
    assert [b["start_time"] for b in rest["data"]] == [D + 3 * DAY] and not rest["has_more"]  # today's


def test_end_time_is_exclusive_and_start_time_inclusive(usage_gw: Service) -> None:
    before = _page(usage_gw, {"start_time": D, "end_time": D + 2 * HOUR, "bucket_width": "1h"})
    assert [b["start_time"] for b in before["data"]] == [D, D + HOUR] and not before["has_more"]
    assert sum(x["num_model_requests"] for x in _results(before)) == 2  # not record 3, at end_time
    after = _page(usage_gw, {"start_time": D + 2 * HOUR, "end_time": D + 2 * HOUR + 1, "bucket_width": "1m"})
    assert [(b["start_time"], len(b["results"])) for b in after["data"]] == [(D + 2 * HOUR, 1)]
    # a start_time inside a bucket: the bucket is the UTC-aligned one, holding only what started from start_time
    inside = _page(usage_gw, {"start_time": D + 30, "end_time": D + HOUR, "bucket_width": "1h"})
    assert [b["start_time"] for b in inside["data"]] == [D] and _results(inside)[0]["input_tokens"] == 10
    assert _results(_page(usage_gw, {"start_time": D + 61, "end_time": D + HOUR, "bucket_width": "1h"})) == []


def test_models_filter_and_group_by(usage_gw: Service) -> None:
    window = {"start_time": D, "end_time": D + 3 * HOUR, "bucket_width": "1h"}
    only_m2 = _results(_page(usage_gw, {**window, "models": "m2"}))
    assert [(x["input_tokens"], x["model"]) for x in only_m2] == [(20, None)]
    both = [("models", "m1"), ("models", "m2"), *window.items()]  # the openai SDK repeats an array parameter
    assert sum(x["input_tokens"] for x in _results(_page(usage_gw, both))) == 33
    assert sum(x["input_tokens"] for x in _results(_page(usage_gw, {**window, "models[]": "m1"}))) == 13
    assert _results(_page(usage_gw, {**window, "models": "nope"})) == []
    grouped = _page(usage_gw, [*window.items(), ("group_by", "model"), ("group_by", "api_key_id")])
    assert [(x["model"], x["api_key_id"], x["input_tokens"]) for x in _results(grouped)] == [
        ("m1", MINE, 10), ("m2", MINE, 20), ("m1", MINE, 3)]
    day = _page(usage_gw, {"start_time": D, "end_time": D + DAY, "group_by": "model,batch"})
    assert sorted((x["model"], x["batch"], x["input_tokens"]) for x in _results(day)) == [
        ("m1", False, 13), ("m2", False, 20)]
    assert _results(_page(usage_gw, {**window, "batch": "true"})) == []  # no Batch API: no batch usage
    assert len(_results(_page(usage_gw, {**window, "batch": "false"}))) == 3


def test_a_key_never_sees_another_keys_usage(usage_gw: Service) -> None:
    window = {"start_time": D, "end_time": D + 6 * HOUR, "bucket_width": "1h"}
    mine = _page(usage_gw, window)
    assert _page(usage_gw, {**window, "api_key_ids": MINE}) == mine
    for ids in (OTHER, [OTHER, "key_unknown"]):
        other = _page(usage_gw, {**window, "api_key_ids": ids})
        assert len(other["data"]) == 6 and _results(other) == []  # as for an id that does not exist
    theirs = _results(_page(usage_gw, window, key="plus2"))
    assert [(x["input_tokens"], x["num_model_requests"]) for x in theirs] == [(100, 1)]
    assert _results(_page(usage_gw, {**window, "api_key_ids": MINE}, key="plus2")) == []


@pytest.mark.parametrize("params, param", [
    ({"bucket_width": "1h", "limit": 169}, "limit"), ({"limit": 32}, "limit"), ({"bucket_width": "1m", "limit": 1441},
                                                                                 "limit"),
    ({"limit": 0}, "limit"), ({"limit": "ten"}, "limit"), ({"bucket_width": "2h"}, "bucket_width"),
    ({"group_by": "project_id"}, "group_by"), ({"group_by": "model,colour"}, "group_by"),
    ({"project_ids": "proj_1"}, "project_ids"), ({"user_ids[]": "user_1"}, "user_ids"),
    ({"start_time": D, "end_time": D}, "start_time"), ({"start_time": "yesterday"}, "start_time"),
    ({"start_time": D, "page": "page_bm9wZQ"}, "page"), ({"start_time": D, "page": "whatever"}, "page"),
    ({"start_time": D, "bucket_width": "1h", "page": "page_" + "MTIz"}, "page"), ({"batch": "maybe"}, "batch"),
    # a time no float holds was a 500 (OverflowError)
    ({"start_time": "1" + "0" * 400}, "start_time"), ({"end_time": "9" * 30}, "end_time"),
    ({"start_time": "-5"}, "start_time"), ({"start_time": "１２"}, "start_time"),
    ({"page": "page_" + "MTAwMDAwMDAwMDAwMDAwMDAwMDAwMA"}, "page"),
])
def test_what_cannot_be_honoured_is_a_400(usage_gw: Service, params: dict[str, Any], param: str) -> None:
    r = _get(usage_gw, {"start_time": D, **params})
    assert r.status_code == 400, (params, r.status_code, r.text)
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param


def test_the_openai_sdk_reads_it_and_pages_through(usage_gw: Service) -> None:
    client = openai.OpenAI(base_url=usage_gw.url + "/v1", api_key=KEYS["plus"], admin_api_key=KEYS["plus"],
                           max_retries=0)
    usage = client.admin.organization.usage
    page = usage.completions(start_time=D, end_time=D + 6 * HOUR, bucket_width="1h", limit=4, models=["m1", "m2"],
                             group_by=["model"])
    assert len(page.data) == 4 and page.has_more and page.next_page
    more = usage.completions(start_time=D, end_time=D + 6 * HOUR, bucket_width="1h", limit=4, models=["m1", "m2"],
                             group_by=["model"], page=page.next_page)
    assert [b.start_time for b in more.data] == [D + 4 * HOUR, D + 5 * HOUR] and not more.has_more
    results = [r for b in page.data for r in b.results]
    assert all(isinstance(r, CompletionsResult) for r in results)  # parsed as the completions result it is
    assert [(r.model, r.input_tokens) for r in results if isinstance(r, CompletionsResult)] == [
        ("m1", 10), ("m2", 20), ("m1", 3)]


# -- what the ledger records of requests that failed or were left ----------------------------------------------


def _rows(db: Path, *request_ids: str) -> dict[str, tuple[Any, ...]]:
    deadline = time.monotonic() + 20
    while True:
        store = open_ledger_store(f"sqlite:///{db}")
        try:
            rows = {r[0]: r[1:] for r in store._run(lambda conn: conn.execute(  # type: ignore[attr-defined]
                "SELECT request_id, status, error_code, prompt_tokens, cached_tokens, completion_tokens, shard "
                "FROM usage_records").fetchall()) if r[0] in request_ids}
        except Exception:  # noqa: BLE001 -- not migrated yet
            rows = {}
        finally:
            store.close()
        if len(rows) == len(request_ids) or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_a_stored_response_the_cache_could_not_keep_is_not_billed(tmp_path: Path) -> None:
    """A Responses create (store: true) whose cache node was down when its turn was stored: the client got
    503 cache_unavailable and no output, but the ledger charged the tokens the shard produced (the gateway's
    token counter did not count them), and /v1/usage showed them. Now its record says 503 cache_unavailable
    with no tokens, as the counters do. A streamed one is stored in_progress before its first event, so with
    no cache node it is refused the same way before it generates."""
    db = tmp_path / "usage.db"
    with Cluster(shards=1, caches=1, gateway_args=["--usage-db", f"sqlite:///{db}", "--usage-flush-interval-s", "0.2",
                                                   "--state-dir", str(tmp_path)]) as c:
        c.caches[0].kill()
        c.wait_members(shards=1, caches=0, timeout=15)
        headers = {"Authorization": f"Bearer {KEYS['plus']}"}
        body = {"model": "synthetic", "input": "hello there", "max_output_tokens": 5}
        failed = httpx.post(c.gateway.url + "/v1/responses", json=body, headers=headers, timeout=30)
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "cache_unavailable"
        streamed = httpx.post(c.gateway.url + "/v1/responses", json={**body, "stream": True}, headers=headers,
                              timeout=30)
        assert streamed.status_code == 503 and streamed.json()["error"]["code"] == "cache_unavailable", streamed.text
        rows = _rows(db, failed.headers["x-request-id"], streamed.headers["x-request-id"])
        assert rows[failed.headers["x-request-id"]][:5] == (503, "cache_unavailable", 0, 0, 0)
        assert rows[streamed.headers["x-request-id"]][:5] == (503, "cache_unavailable", 0, 0, 0)
        served = sum(metric(c.gateway.url, "switchboard_gateway_tokens_total", tier="plus", kind=k)
                     for k in ("prompt", "completion"))
        assert served == 0
        results = _results(_page(c.gateway, {"start_time": int(time.time()) - 600}))
        assert [(x["num_model_requests"], x["input_tokens"], x["output_tokens"]) for x in results] == []


def test_a_client_that_leaves_is_recorded_with_its_prefix_cache_hit(fp32_shard: Service, tmp_path: Path) -> None:
    """A stream the client left mid-way was recorded with cached_tokens 0 though its prompt hit the shard's
    prefix cache (the count came only with the final usage): what was served from the cache was billed as
    computed. The shard's running usage says it from the first token; the record keeps it."""
    cache = cache_node().start()
    db = tmp_path / "usage.db"
    gw = Service(["gateway", "--shard-urls", fp32_shard.url, "--cache-urls", cache.url, "--state-dir", str(tmp_path),
                  "--usage-db", f"sqlite:///{db}", "--usage-flush-interval-s", "0.2", "--silence-timeout-s", "60"],
                 env={"SWITCHBOARD_GATEWAY_API_KEYS": f"{KEYS['plus']}:acme:plus"}, ready_timeout=240)
    headers = {"Authorization": f"Bearer {KEYS['plus']}"}
    system = ("You are a storyteller for a bicycle shop's newsletter. Write warmly, at length, about riders, "
              "roads and the weather, and never invent prices. ") * 2
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Tell me a long story about a ride along the coast."}],
            "max_tokens": 120, "temperature": 0}
    try:
        with gw:
            whole = httpx.post(gw.url + "/v1/chat/completions", json={**body, "max_tokens": 2}, headers=headers,
                               timeout=180).json()["usage"]  # fills the prefix cache
            chunks = 0
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**body, "stream": True},
                              headers=headers, timeout=180) as r:
                assert r.status_code == 200
                left = r.headers["x-request-id"]
                for line in r.iter_lines():
                    chunks += '"content":"' in line and '"content":""' not in line
                    if chunks >= 3:
                        break  # leaving closes the connection mid-stream
            again = httpx.post(gw.url + "/v1/chat/completions", json={**body, "max_tokens": 1}, headers=headers,
                               timeout=180).json()["usage"]
            row = _rows(db, left)[left]
    finally:
        cache.stop()
    hit = again["prompt_tokens_details"]["cached_tokens"]
    assert hit > 0 and again["prompt_tokens"] == whole["prompt_tokens"]
    status, code, prompt, cached, completion, _shard = row
    assert (status, code) == (499, "client_disconnected")
    assert prompt == whole["prompt_tokens"] and cached == hit, row
    assert 3 <= completion < 120


def test_no_bucket_starts_before_the_epoch(usage_gw: Service) -> None:
    """With no start_time, the `limit` buckets ending with `end_time`: end_time=10 gave buckets from -518400."""
    page = _page(usage_gw, {"end_time": 10, "bucket_width": "1d"})
    assert [b["start_time"] for b in page["data"]] == [0], page["data"]
