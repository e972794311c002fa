"""The abuse monitor on the wire: what gateways watch and report, what operators list, lift, confirm.

    app.include_router(build_abuse_router(monitor, admin_token, cluster_token))

    GET  /v1/abuse/state?index=N&wait=S      gateways (cluster token): the actions that change traffic,
                                             a blocking query like /v1/state
    POST /v1/abuse/reports                   gateways (cluster token): {"auth_failures": {"10.0.0.7": 3}}
    GET  /admin/v1/abuse                     operators (admin token): {"actions", "ended", "events", "config"}
    POST /admin/v1/abuse/actions/{id}/lift   end an action now (its rule counts afresh after one window)
    POST /admin/v1/abuse/actions/{id}/confirm    hold it confirm_hold_s

Per-key and per-address state travels here, never as metric labels (those stay bounded:
control_plane/abuse/monitor.py AbuseMetrics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, SecretStr

from control_plane.abuse.monitor import MAX_REPORTED_ADDRESSES, AbuseMonitor
from control_plane.admin.api import bearer_guard
from control_plane.state_api import INDEX_HEADER
from data_plane.common.errors import NotFound
from data_plane.common.hop_auth import require_cluster_token


class AuthFailureReport(BaseModel):
    """A gateway's authentication failures per source address since its last report."""

    auth_failures: dict[str, int] = Field(default_factory=dict, max_length=MAX_REPORTED_ADDRESSES)


class LiftBody(BaseModel):
    by: str = Field("operator", max_length=128, description="who lifts it (shown in the history)")


def build_abuse_router(monitor: AbuseMonitor, admin_token: SecretStr | None, cluster_token: str | None,
                       on_refused: Callable[[Request], None] | None = None) -> APIRouter:
    """The gateways' routes (the cluster token; refusals to `on_refused`: the control plane's
    switchboard_control_plane_refused_total{route="abuse"}) and the admin API's."""
    router = APIRouter(tags=["abuse"])
    members = [Depends(require_cluster_token(cluster_token, "the abuse state", on_refused))]
    admin = [Depends(bearer_guard(admin_token))]

    @router.get("/v1/abuse/state", dependencies=members, summary="Abuse actions in force (blocking query)")
    async def state(index_param: int = Query(0, ge=0, alias="index"),
                    wait: float = Query(5.0, ge=0.0, le=600.0, allow_inf_nan=False)) -> JSONResponse:
        await monitor.index.wait(index_param, wait)
        body = monitor.state_body()
        return JSONResponse(body, headers={INDEX_HEADER: str(body["index"])})

    @router.post("/v1/abuse/reports", dependencies=members, summary="A gateway's authentication failures")
    async def report(body: AuthFailureReport) -> JSONResponse:
        monitor.report_auth_failures({a[:64]: max(0, n) for a, n in body.auth_failures.items()})
        return JSONResponse({"accepted": len(body.auth_failures)})

    @router.get("/admin/v1/abuse", dependencies=admin, summary="Abuse actions, their history and the events")
    async def overview(events: int = Query(200, ge=0, le=1000)) -> JSONResponse:
        config: dict[str, Any] = asdict(monitor.config)
        return JSONResponse({"actions": [a.to_dict() for a in monitor.active()],
                             "ended": list(reversed(monitor.ended())),
                             "events": [e.to_dict() for e in reversed(monitor.events()[-events:] if events else [])],
                             "config": config})

    @router.post("/admin/v1/abuse/actions/{action_id}/lift", dependencies=admin, summary="Lift an abuse action")
    async def lift(action_id: int, body: LiftBody | None = None) -> JSONResponse:
        action = monitor.lift(action_id, by=(body.by if body else "operator"))
        if action is None:
            raise NotFound(f"no abuse action {action_id} in force", code="abuse_action_not_found")
        return JSONResponse({"lifted": action.to_dict()})

    @router.post("/admin/v1/abuse/actions/{action_id}/confirm", dependencies=admin, summary="Confirm an abuse action")
    async def confirm(action_id: int) -> JSONResponse:
        action = monitor.confirm(action_id)
        if action is None:
            raise NotFound(f"no abuse action {action_id} in force", code="abuse_action_not_found")
        return JSONResponse({"confirmed": action.to_dict()})

    return router


__all__ = ["AuthFailureReport", "build_abuse_router"]
