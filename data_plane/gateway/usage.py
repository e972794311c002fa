"""The gateway's side of the usage ledger: building it from the settings, and `GET /v1/usage`,
an API key's own usage in the shape of OpenAI's usage API (`GET /v1/organization/usage/completions`,
also served under that path, so the openai SDK's `client.admin.organization.usage.completions(...)` with
the key as its `admin_api_key` reads it).

    gw.ledger = ledger_from_settings(settings, registry)       # None with --usage-db off
    app.add_api_route("/v1/usage", usage_route(gw.keys, gw.ledger), methods=["GET"])

    curl -H "Authorization: Bearer $KEY" "http://127.0.0.1:8000/v1/usage?start_time=1767225600&bucket_width=1h"
    {"object": "page", "data": [{"object": "bucket", "start_time": 1767225600, "end_time": 1767229200,
      "results": [{"object": "organization.usage.completions.result", "input_tokens": 120,
                   "output_tokens": 64, "input_cached_tokens": 0, "num_model_requests": 3, "model": null, ...}]},
      {"object": "bucket", "start_time": 1767229200, "end_time": 1767232800, "results": []}, ...],
     "has_more": true, "next_page": "page_MTc2NzMxMjAwMA"}

As OpenAI's: buckets are UTC-aligned windows of `bucket_width` (1m, 1h, 1d), every one of them from the one
holding `start_time` (inclusive) to `end_time` (exclusive; default now), an empty one with `results: []`;
only requests that started in [start_time, end_time) count, so the first and last bucket may hold part of
their window. `limit` buckets a page (1d: 7 by default, at most 31; 1h: 24, 168; 1m: 60, 1440; beyond: 400);
`has_more` with `next_page`, passed back as `page` with the same parameters, continues exactly where the page
ended. `models` (repeated, `models[]=`, or comma-separated) filters, `group_by` model / api_key_id (batch,
service_tier and api_source split nothing here: every request is a non-batch one of the `default` tier,
unlabeled) groups, `batch=true` is empty (there is no Batch API). `num_model_requests` counts requests a model
answered and the server did not fail (a 400 or 429 before any model, and a 5xx, billed nothing, stay out).

A key sees only its own records (filtered by its digest, never by a parameter it sends): `api_key_ids` that
leaves its own id out reads as an empty page, as an id that does not exist would. What this gateway cannot
honour (`project_ids`, `user_ids`, group_by project_id / user_id: it has no projects or users) is a 400.
`start_time` may be left out (OpenAI requires it): the page then ends with the bucket holding `end_time`.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from starlette.datastructures import QueryParams

from data_plane.common.errors import InvalidRequest, NotFound, Overloaded
from data_plane.ledger.store import UsageQuery, default_usage_db, open_ledger_store
from data_plane.ledger.writer import UsageLedger, open_ledger
from data_plane.protocol import SERVICE_TIER

if TYPE_CHECKING:
    from data_plane.gateway.auth import Principal
    from data_plane.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

BUCKET_WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
"""OpenAI's bucket_width values -> seconds."""
DEFAULT_BUCKETS = {"1m": 60, "1h": 24, "1d": 7}
"""Buckets a page holds when `limit` is not given (OpenAI's defaults)."""
MAX_BUCKETS = {"1m": 1440, "1h": 168, "1d": 31}
"""The most `limit` may ask for (OpenAI's maxima; more is a 400)."""
GROUPS = ("model", "api_key_id", "batch", "service_tier", "api_source")
"""What group_by may name here; OpenAI's project_id and user_id are refused (no projects or users)."""
UNSUPPORTED_GROUPS = ("project_id", "user_id")
PAGE_PREFIX = "page_"
MAX_TIME = 253402300799
"""The last second of the year 9999: the largest time (or number) a parameter may give."""
DISABLED = "off"


def ledger_from_settings(settings: GatewaySettings, registry: CollectorRegistry) -> UsageLedger | None:
    url = settings.usage_db or default_usage_db(settings.state_dir)
    if url == DISABLED:
        return None
    return open_ledger(open_ledger_store(url), registry,
                       gateway=settings.node_id or f"gateway-{settings.host}-{settings.port}",
                       state_dir=Path(settings.state_dir),
                       spool_dir=Path(settings.usage_spool_dir) if settings.usage_spool_dir else None,
                       flush_interval_s=settings.usage_flush_interval_s,
                       retention_days=settings.usage_retention_days)


@dataclass(frozen=True)
class UsagePage:
    """One page of a usage read: which buckets, which records."""

    width: int
    first: int
    """The first bucket's start (unix s, aligned to `width`)."""
    count: int
    """Buckets on this page."""
    start: float
    end: float
    """Records that started in [start, end) count (the request's range, within this page's buckets)."""
    until: float
    """The request's end_time (exclusive): where the last page ends."""
    models: tuple[str, ...]
    group_by: tuple[str, ...]
    nothing: bool
    """The filters leave nothing (another key's id, batch=true): every bucket empty."""

    @property
    def after(self) -> int:
        """The start of the bucket after this page's last."""
        return self.first + self.count * self.width

    def next_page(self) -> str | None:
        if self.after >= self.until:
            return None
        return PAGE_PREFIX + base64.urlsafe_b64encode(str(self.after).encode()).decode().rstrip("=")


def _values(params: QueryParams, name: str) -> list[str]:
    """An array parameter as the openai SDK sends it (`models=a&models=b`), as `models[]=a`, or `models=a,b`."""
    raw = params.getlist(name) + params.getlist(name + "[]")
    return [v.strip() for item in raw for v in item.split(",") if v.strip()]


def _one(params: QueryParams, name: str) -> str | None:
    values = params.getlist(name)
    if len(values) > 1:
        raise InvalidRequest(f"{name} was given {len(values)} times; give it once", param=name)
    return values[0] if values else None


def _int(params: QueryParams, name: str) -> int | None:
    value = _one(params, name)
    if value is None:
        return None
    digits = value.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()):
        raise InvalidRequest(f"{name} must be an integer (unix seconds for times), not {value[:40]!r}", param=name)
    if value.startswith("-"):
        raise InvalidRequest(f"{name} must not be negative", param=name)
    digits = digits.lstrip("0") or "0"
    if len(digits) > 12 or int(digits) > MAX_TIME:  # (int() of thousands of digits is slow)
        raise InvalidRequest(f"{name} must be at most {MAX_TIME}", param=name)
    return int(digits)


def _bool(params: QueryParams, name: str) -> bool | None:
    value = _one(params, name)
    if value is None:
        return None
    lowered = value.strip().lower()
    if lowered not in ("true", "false", "1", "0"):
        raise InvalidRequest(f"{name} must be true or false, not {value[:40]!r}", param=name)
    return lowered in ("true", "1")


def _cursor(page: str) -> int:
    try:
        if not page.startswith(PAGE_PREFIX):
            raise ValueError(page)
        text = page[len(PAGE_PREFIX):]
        if len(text) > 24:
            raise ValueError(page)
        cursor = int(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode())
        if not 0 <= cursor <= MAX_TIME:
            raise ValueError(page)
        return cursor
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise InvalidRequest("page is not a cursor this API gave: pass the previous response's next_page",
                             param="page") from None


def parse_usage_query(params: QueryParams, key_id: str, now: float) -> UsagePage:
    """The page a request's query parameters ask for (400 for what OpenAI refuses or this gateway cannot honour)."""
    for name in ("project_ids", "user_ids"):
        if _values(params, name):
            raise InvalidRequest(f"{name} cannot be honoured: this gateway has no projects or users; usage is "
                                 "per API key (api_key_ids)", param=name)
    bucket_width = _one(params, "bucket_width") or "1d"
    if bucket_width not in BUCKET_WIDTHS:
        raise InvalidRequest(f"bucket_width must be one of 1m, 1h, 1d, not {bucket_width[:40]!r}",
                             param="bucket_width")
    width = BUCKET_WIDTHS[bucket_width]
    limit = _int(params, "limit")
    if limit is None:
        limit = DEFAULT_BUCKETS[bucket_width]
    elif not 1 <= limit <= MAX_BUCKETS[bucket_width]:
        raise InvalidRequest(f"limit must be between 1 and {MAX_BUCKETS[bucket_width]} with bucket_width "
                             f"{bucket_width}, not {limit}", param="limit")
    group_by = tuple(dict.fromkeys(_values(params, "group_by")))
    for name in group_by:
        if name in UNSUPPORTED_GROUPS:
            raise InvalidRequest(f"group_by {name} cannot be honoured: this gateway has no projects or users",
                                 param="group_by")
        if name not in GROUPS:
            raise InvalidRequest(f"group_by must name some of {', '.join(GROUPS)}, not {name[:40]!r}",
                                 param="group_by")
    start_time, end_time = _int(params, "start_time"), _int(params, "end_time")
    page = _one(params, "page")
    cursor = _cursor(page) if page is not None else None
    end = float(end_time) if end_time is not None else now
    if start_time is not None:
        start = float(start_time)
    elif cursor is not None:
        start = float(cursor)
    else:  # the `limit` buckets that end with the one holding `end` (none before the epoch)
        start = float(max(0, (math.ceil(end / width) - limit) * width))
    if start >= end:
        raise InvalidRequest("start_time must be before end_time" if end_time is not None
                             else "start_time is in the future", param="start_time")
    first = int(start // width) * width
    if cursor is not None:
        if cursor % width or not first <= cursor < end:
            raise InvalidRequest("page does not continue this query: pass the previous response's next_page with "
                                 "the same start_time, end_time and bucket_width", param="page")
        first = cursor
    count = min(limit, math.ceil((end - first) / width))
    ids = _values(params, "api_key_ids")
    batch = _bool(params, "batch")
    return UsagePage(width=width, first=first, count=count, start=max(start, first),
                     end=min(end, first + count * width), until=end, models=tuple(dict.fromkeys(_values(params, "models"))),
                     group_by=group_by, nothing=bool(ids and key_id not in ids) or batch is True)


def openai_usage_page(page: UsagePage, rows: list[dict[str, Any]], key_id: str) -> dict[str, Any]:
    """Ledger rows -> OpenAI's usage page: every bucket of the page, one result per group in each."""
    by_bucket: dict[int, list[dict[str, Any]]] = {}
    grouped = page.group_by
    for row in rows:
        input_tokens, cached = row["prompt_tokens"], row["cached_tokens"]
        by_bucket.setdefault(int(row["start"]), []).append({
            "object": "organization.usage.completions.result",
            "input_tokens": input_tokens, "output_tokens": row["completion_tokens"],
            "input_cached_tokens": cached, "input_uncached_tokens": input_tokens - cached,
            "input_text_tokens": input_tokens - cached, "input_cached_text_tokens": cached,
            "output_text_tokens": row["completion_tokens"], "input_audio_tokens": 0, "output_audio_tokens": 0,
            "num_model_requests": row["requests"], "project_id": None, "user_id": None,
            "api_key_id": key_id if "api_key_id" in grouped else None,
            "model": row.get("model") if "model" in grouped else None,
            "batch": False if "batch" in grouped else None,
            "service_tier": SERVICE_TIER if "service_tier" in grouped else None,
            "api_source": "unlabeled" if "api_source" in grouped else None,
        })
    w = page.width
    data = [{"object": "bucket", "start_time": b, "end_time": b + w, "results": by_bucket.get(b, [])}
            for b in range(page.first, page.after, w)]
    following = page.next_page()
    return {"object": "page", "data": data, "has_more": following is not None, "next_page": following}


def usage_route(authenticate: Callable[[Request], Principal], ledger: UsageLedger | None) -> Any:
    """GET /v1/usage; `authenticate` is the gateway's (the abuse guard's: a banned address is refused
    and every 401 counted, as on the chat path)."""
    async def usage(request: Request) -> JSONResponse:
        """This API key's own usage (tokens and requests per time bucket), from the usage ledger, as OpenAI's
        `GET /v1/organization/usage/completions` answers it: start_time, end_time, bucket_width, limit, page,
        models, group_by, api_key_ids, batch (the module docstring of data_plane/gateway/usage.py)."""
        principal = authenticate(request)
        if ledger is None:
            raise NotFound("the usage ledger is off on this gateway (--usage-db off)", code="usage_disabled")
        page = parse_usage_query(request.query_params, principal.key_id, time.time())
        rows: list[dict[str, Any]] = []
        if not page.nothing:
            query = UsageQuery(start=page.start, end=page.end, key_id=principal.key_id, bucket_s=page.width,
                               models=page.models, model_requests_only=True,
                               group_by=("model",) if "model" in page.group_by else (), limit=1_000_000)
            try:
                rows = (await ledger.usage(query))["rows"]
            except Exception as exc:  # the database down or unreachable: the key's records stay spooled
                log.warning("usage ledger read failed: %s: %s", type(exc).__name__, exc)
                raise Overloaded("the usage database is unreachable", code="usage_db_unavailable",
                                 retry_after=5) from exc
        return JSONResponse(openai_usage_page(page, rows, principal.key_id))

    return usage
