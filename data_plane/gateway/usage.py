"""The gateway's side of the usage ledger: building it from the settings, and `GET /v1/usage`,
an API key's own usage in the shape of OpenAI's usage API (`/v1/organization/usage/completions`).

    gw.ledger = ledger_from_settings(settings, registry)       # None with --usage-db off
    app.add_api_route("/v1/usage", usage_route(gw.keys, gw.ledger), methods=["GET"])

    curl -H "Authorization: Bearer $KEY" "http://127.0.0.1:8000/v1/usage?start_time=1767225600&bucket_width=1h"
    {"object": "page", "data": [{"object": "bucket", "start_time": ..., "end_time": ...,
      "results": [{"object": "organization.usage.completions.result", "input_tokens": 120,
                   "output_tokens": 64, "input_cached_tokens": 0, "num_model_requests": 3, "model": null, ...}]}],
     "has_more": false, "next_page": null}

A key sees only its own records (filtered by its digest, never by a parameter it sends).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Query, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry

from data_plane.common.errors import InvalidRequest, NotFound, Overloaded
from data_plane.ledger.store import UsageQuery, default_usage_db, open_ledger_store
from data_plane.ledger.writer import UsageLedger, open_ledger

if TYPE_CHECKING:
    from data_plane.gateway.auth import Principal
    from data_plane.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

BUCKET_WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
"""OpenAI's bucket_width values -> seconds."""
DEFAULT_BUCKETS = {"1m": 60, "1h": 24, "1d": 7}
"""Buckets returned when end_time is not given (OpenAI's defaults)."""
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


def openai_usage_page(result: dict[str, Any], width: int, group_by: tuple[str, ...]) -> dict[str, Any]:
    """Ledger rows -> OpenAI's usage page: one bucket per time window, one result per group."""
    buckets: dict[float, list[dict[str, Any]]] = {}
    for row in result["rows"]:
        buckets.setdefault(row["start"], []).append({
            "object": "organization.usage.completions.result",
            "input_tokens": row["prompt_tokens"], "output_tokens": row["completion_tokens"],
            "input_cached_tokens": row["cached_tokens"], "input_audio_tokens": 0, "output_audio_tokens": 0,
            "num_model_requests": row["requests"], "project_id": None, "user_id": None, "batch": None,
            "api_key_id": None, "model": row.get("model") if "model" in group_by else None,
        })
    return {"object": "page", "has_more": False, "next_page": None, "data": [
        {"object": "bucket", "start_time": int(start), "end_time": int(start) + width, "results": results}
        for start, results in sorted(buckets.items())]}


def usage_route(authenticate: Callable[[Request], Principal], ledger: UsageLedger | None) -> Any:
    """GET /v1/usage; `authenticate` is the gateway's (the abuse guard's: a banned address is refused
    and every 401 counted, as on the chat path)."""
    async def usage(request: Request,
                    start_time: int | None = Query(None, description="unix seconds (inclusive); default: "
                                                   "as many buckets back as OpenAI's default"),
                    end_time: int | None = Query(None, description="unix seconds (exclusive); default now"),
                    bucket_width: str = Query("1d", pattern="^(1m|1h|1d)$"),
                    group_by: str | None = Query(None, description="'model' splits each bucket by model")
                    ) -> JSONResponse:
        """This API key's own usage (tokens and requests per time bucket), from the usage ledger."""
        principal = authenticate(request)
        if ledger is None:
            raise NotFound("the usage ledger is off on this gateway (--usage-db off)", code="usage_disabled")
        groups = tuple(g for g in (group_by or "").split(",") if g)
        if any(g != "model" for g in groups):
            raise InvalidRequest("group_by supports 'model' only", param="group_by")
        width = BUCKET_WIDTHS[bucket_width]
        end = float(end_time) if end_time is not None else time.time()
        start = float(start_time) if start_time is not None else end - width * DEFAULT_BUCKETS[bucket_width]
        if start >= end:
            raise InvalidRequest("start_time must be before end_time", param="start_time")
        try:
            result = await ledger.usage(UsageQuery(start=start, end=end, key_id=principal.key_id, bucket_s=width,
                                                      group_by=groups))
        except Exception as exc:  # the database down or unreachable: the key's records stay spooled
            log.warning("usage ledger read failed: %s: %s", type(exc).__name__, exc)
            raise Overloaded("the usage database is unreachable", code="usage_db_unavailable",
                             retry_after=5) from exc
        return JSONResponse(openai_usage_page(result, width, groups))

    return usage
