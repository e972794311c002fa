"""The usage ledger's reader on the control plane: ``GET /admin/v1/usage`` (bearer-protected).

    app.include_router(build_usage_router(open_ledger_store(settings.usage_db), settings.admin_token))

    curl -H "Authorization: Bearer $SWITCHBOARD_ADMIN_TOKEN" \
      "http://127.0.0.1:8300/admin/v1/usage?tenant=acme&group_by=hour&by=tenant,tier&start=1767225600"
    {"bucket": "hour", "by": ["tenant", "tier"], "rows": [{"start": ..., "end": ..., "tenant": "acme",
      "tier": "plus", "requests": 12, "errors": 1, "prompt_tokens": 480, "cached_tokens": 0,
      "completion_tokens": 640}], "totals": {...}}
    ...&format=csv                    # the same rows as CSV (start/end also as ISO 8601, UTC)

Reads the same database the gateways write (``--usage-db``, default the SQLite file in
``.switchboard/``). Records are written in batches, so the newest second or so may not show yet.
"""

from __future__ import annotations

import asyncio
import csv
import io
import logging
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse, Response
from pydantic import SecretStr

from control_plane.admin.api import bearer_guard
from data_plane.common.errors import InvalidRequest, NotFound, Overloaded
from data_plane.ledger.store import GROUP_FIELDS, SUMS, LedgerStore, UsageQuery

log = logging.getLogger(__name__)

BUCKETS = {"hour": 3600, "day": 86400, "none": None}
DEFAULT_RANGE_S = 7 * 86400
TRUNCATED_HEADER = "X-Switchboard-Truncated"
"""On a CSV answer: "true" when `limit` left the oldest rows out (the JSON answer says `truncated`)."""


def build_usage_router(store: LedgerStore | None, token: SecretStr | None) -> APIRouter:
    router = APIRouter(prefix="/admin/v1", tags=["admin"], dependencies=[Depends(bearer_guard(token))])
    lock = asyncio.Lock()  # one read at a time on the store's connection
    migrated = False

    @router.get("/usage", summary="Usage from the ledger: requests and tokens per time bucket and group")
    async def usage(
        tenant: str | None = Query(None, max_length=128),
        key: str | None = Query(None, max_length=64, description="a key id (its short SHA-256 digest)"),
        tier: str | None = Query(None, max_length=64),
        model: str | None = Query(None, max_length=256),
        start: float | None = Query(None, allow_inf_nan=False,  # nan passed the checks below: a 500
                                    description="unix seconds, inclusive (default: 7 days ago)"),
        end: float | None = Query(None, allow_inf_nan=False, description="unix seconds, exclusive (default: now)"),
        group_by: str = Query("day", pattern="^(hour|day|none)$", description="time bucket"),
        by: str = Query("tenant,tier", description="comma-separated: " + ", ".join(GROUP_FIELDS)),
        format: str = Query("json", pattern="^(json|csv)$"),
        limit: int = Query(10000, ge=1, le=100000),
    ) -> Response:
        if store is None:
            raise NotFound("no usage ledger on this control plane (--usage-db off)", code="usage_disabled")
        fields = tuple(f for f in by.split(",") if f)
        bad = [f for f in fields if f not in GROUP_FIELDS]
        if bad:
            raise InvalidRequest(f"cannot group by {bad[0]!r}; choose from {', '.join(GROUP_FIELDS)}", param="by")
        stop = end if end is not None else time.time()
        begin = start if start is not None else stop - DEFAULT_RANGE_S
        if begin >= stop:
            raise InvalidRequest("start must be before end", param="start")
        query = UsageQuery(start=begin, end=stop, tenant=tenant, key_id=key, tier=tier, model=model,
                           bucket_s=BUCKETS[group_by], group_by=fields, limit=limit)
        nonlocal migrated
        async with lock:
            try:
                if not migrated:  # a ledger no gateway has written yet reads as empty, not as an error
                    await asyncio.to_thread(store.migrate)
                    migrated = True
                result = await asyncio.to_thread(store.usage, query)
            except Exception as exc:
                log.warning("usage ledger read failed: %s: %s", type(exc).__name__, exc)
                raise Overloaded("the usage database is unreachable", code="usage_db_unavailable",
                                 retry_after=5) from exc
        if format == "csv":  # rows cut by `limit` (the oldest left out; totals whole) are said in a header
            return Response(usage_csv(result["rows"], fields), media_type="text/csv; charset=utf-8",
                            headers={"Content-Disposition": 'attachment; filename="switchboard-usage.csv"',
                                     TRUNCATED_HEADER: str(result["truncated"]).lower()})
        return JSONResponse({"bucket": group_by, "by": list(fields), "start": begin, "end": stop, **result})

    return router


def usage_csv(rows: list[dict[str, Any]], fields: tuple[str, ...]) -> str:
    """Rows as CSV: start and end as ISO 8601 (UTC) and unix seconds, the group fields, the sums."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["start", "end", "start_unix", "end_unix", *fields, *SUMS])
    for row in rows:
        writer.writerow([_iso(row["start"]), _iso(row["end"]), int(row["start"]), int(row["end"]),
                         *(row.get(f, "") for f in fields), *(row[s] for s in SUMS)])
    return out.getvalue()


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
