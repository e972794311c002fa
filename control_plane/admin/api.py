"""The operators' API on the control plane: ``/admin/v1/...``, bearer-token protected.

    admin = AdminContext(registry=registry, store=store, ladder=ladder, token=settings.admin_token)
    app.include_router(build_admin_router(admin))
    admin.http = httpx.AsyncClient()         # in the lifespan: traces and alerts fetch with it
    admin.autoscaler = autoscaler            # optional: anything with decisions() -> list[dict]

    curl -H "Authorization: Bearer $SWITCHBOARD_ADMIN_TOKEN" http://127.0.0.1:8300/admin/v1/degradation

Routes (the console uses nothing else; shapes are the response models below, in ``/docs``)::

    GET    /members                     registry members, every status
    POST   /members/{id}/drain|undrain  stop / resume routing to a member
    GET    /signals                     latest Signals + a short history for sparklines
    GET    /decisions?limit=            autoscaler decisions, newest last ([] without an autoscaler)
    GET    /degradation                 level, pinned, reason, the automatic rule's view, history
    PUT    /degradation                 {"level": N, "reason": "..."} pins a level
    DELETE /degradation                 releases the pin (the level stays; the rule takes over)
    GET    /tiers  |  PUT /tiers        the tier policy ({"tiers": {...}}); PUT validates and persists
    GET    /traces?limit=&tier=&status=&min_ms=&trace_id=&internal=   recent traces across processes
    GET    /alerts                      firing alerts (Alertmanager / Prometheus, else built-in checks)
    GET    /usage?tenant=&key=&tier=&model=&start=&end=&group_by=hour|day&by=&format=csv
                                        the usage ledger (control_plane/admin/usage.py)

Every error is OpenAI-shaped (``{"error": {...}}``); 401 without the right token.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

import httpx
from fastapi import APIRouter, Body, Depends, Path, Query
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from control_plane.admin.alerting import builtin_alerts, fetch_alerts
from control_plane.admin.processes import ProcessTable
from control_plane.admin.traces import assemble_traces, collect_spans, is_housekeeping
from control_plane.degradation import DegradationController, signals_dict
from control_plane.ladder import Actor, Verdict
from control_plane.policy_store import PolicyStore
from control_plane.registry.embedded import MEMBER_ID_PATTERN
from control_plane.settings import ENV_ADMIN_TOKEN
from control_plane.state_api import StateIndex
from data_plane.common.errors import InvalidRequest, SwitchboardError
from data_plane.common.hop_auth import RequireBearer
from data_plane.common.ladder import MAX_LEVEL, Level
from data_plane.tiers import TierPolicy, unserved_safety

log = logging.getLogger(__name__)

_EXAMPLE_POLICY = TierPolicy.default().to_dict()


def bearer_guard(token: SecretStr | None) -> RequireBearer:
    """The admin API's dependency: ``Authorization: Bearer <admin token>``, and closed (401 for
    everyone) while no admin token is configured (data_plane/common/hop_auth.py)."""
    return RequireBearer(
        token.get_secret_value() if token is not None else None, "the admin API",
        refused="missing or invalid admin token (Authorization: Bearer <token>)",
        closed_without_token=f"the admin API is disabled: no admin token configured (--admin-token or "
                             f"{ENV_ADMIN_TOKEN})")


class MemberDirectory(Protocol):
    """What the admin API needs of membership: the embedded :class:`~control_plane.registry.embedded.Registry`
    or Consul (``control_plane.registry.consul.ConsulMembers``)."""

    @property
    def warming_up(self) -> bool: ...

    def snapshot(self, service: str | None = None) -> tuple[int, list[dict[str, Any]]]: ...

    def set_draining(self, member_id: str, draining: bool) -> dict[str, Any]: ...


class DecisionLog(Protocol):
    """What the admin API needs of the autoscaler."""

    def decisions(self) -> list[dict[str, Any]]: ...


@dataclass
class AdminContext:
    """What the admin routes read and steer; `http` and `autoscaler` may be set after building."""

    registry: MemberDirectory
    store: PolicyStore
    ladder: DegradationController
    token: SecretStr | None
    http: httpx.AsyncClient | None = None
    """The process's client (opened in the lifespan); traces and alerts fetch with it."""
    autoscaler: DecisionLog | None = None
    prometheus_url: str | None = None
    """With it, ``/alerts`` proxies Prometheus' firing alerts."""
    alertmanager_url: str | None = None
    """With it, ``/alerts`` lists Alertmanager's active, unsilenced alerts (preferred)."""
    state_index: StateIndex | None = None
    processes: ProcessTable | None = None
    """`switchboard up`'s process table (control_plane/admin/processes.py), when this runs under it."""
    hop_headers: dict[str, str] = field(default_factory=dict)
    """The cluster token members' ``/debug/spans`` require (data_plane/common/hop_auth.py cluster_headers)."""
    """The ``/v1/state`` index, reported by ``/tiers`` so an operator can see the push went out."""


# -- response models (the OpenAPI contract) -----------------------------------------------------


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class MemberModel(_Open):
    id: str
    service: str
    url: str
    meta: dict[str, str]
    status: str = Field(description="passing | critical | draining")
    last_heartbeat: float = Field(description="unix seconds")
    ttl_s: float
    draining: bool


class AbsentMemberModel(_Open):
    """An undrain of a member that is not registered now: its drain mark was cleared, so the next
    process under its id is routed to."""
    id: str
    status: str = Field(description="absent")
    draining: bool


class MembersResponse(BaseModel):
    index: int = Field(description="registry change index")
    warming_up: bool = Field(description="true right after a restart, while members re-register")
    members: list[MemberModel]


class SignalsResponse(BaseModel):
    latest: dict[str, Any] | None = Field(description="the last Signals read (control_plane.signals.model.Signals), "
                                          "or null before the first read")
    history: list[dict[str, Any]] = Field(description="recent readings without per-shard detail, oldest first, "
                                          "each with 'at' (unix s)")
    interval_s: float = Field(description="seconds between readings")


class DecisionsResponse(BaseModel):
    autoscaler: bool = Field(description="false when this control plane runs no autoscaler")
    decisions: list[dict[str, Any]] = Field(description="decisions with inputs, reason and outcome, oldest first")


class DegradationEvent(_Open):
    at: float = Field(description="unix seconds")
    from_: int = Field(alias="from", ge=0, le=MAX_LEVEL)
    to: int = Field(ge=0, le=MAX_LEVEL)
    reason: str
    signals: dict[str, Any] = Field(description="the signals at the time (summary)")
    actor: Actor = Field(description="who changed the level")
    pinned: bool = Field(default=False, description="whether the level is pinned after this change")


class AutomaticView(_Open):
    verdict: Verdict = Field(description="the automatic rule's reading of the last signals")
    reasons: list[str]
    calm_for_s: float
    held_for_s: float


class DegradationResponse(BaseModel):
    level: int = Field(ge=0, le=MAX_LEVEL)
    name: str = Field(description=", ".join(f"{int(level)} {level.label}" for level in Level))
    pinned: bool
    reason: str
    since: float = Field(description="unix seconds of the last change")
    automatic: AutomaticView
    history: list[DegradationEvent] = Field(description="recent changes, oldest first")


class PinRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "3" is not a level (the tier policy is strict too)

    level: int = Field(ge=0, le=MAX_LEVEL, description="level to hold until released")
    reason: str = Field(min_length=1, max_length=500, description="why (kept in the history)")


class TierModel(BaseModel):
    priority: int
    rpm: int
    tpm: int
    max_context_tokens: int
    max_output_tokens: int
    replication: int
    shed_order: int
    safety: str


class TiersResponse(BaseModel):
    tiers: dict[str, TierModel]
    source: str = Field(description="default | file | state (restored) | admin")
    updated_at: float = Field(description="unix seconds")
    state_index: int = Field(description="the /v1/state index gateways watch")


class SpanModel(_Open):
    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int | None
    status: str = Field(description="UNSET | OK | ERROR")
    attributes: dict[str, Any]
    events: list[dict[str, Any]]


class TraceModel(BaseModel):
    trace_id: str
    root: str = Field(description="name of the root span")
    services: list[str]
    start: float = Field(description="unix seconds")
    duration_ms: float = Field(description="the root span's (what the client saw)")
    status: str = Field(description="ok | error: the root span's")
    failed_spans: int = Field(default=0, description="spans that ended in error (a leg recovered from, too)")
    tier: str | None
    span_count: int
    spans: list[SpanModel] = Field(description="sorted by start")


class TracesResponse(BaseModel):
    traces: list[TraceModel] = Field(description="most recent first")
    sources: dict[str, str] = Field(description="process -> 'ok' or why its spans are missing")


class AlertModel(_Open):
    name: str
    severity: str = Field(description="critical | warning | info")
    state: str = Field(description="firing (built-in and Prometheus) or active (Alertmanager)")
    summary: str
    labels: dict[str, str] = Field(default_factory=dict)
    active_at: float | None = Field(default=None, description="unix seconds")


class ProcessModel(_Open):
    name: str
    pid: int | None
    url: str | None = None
    log: str | None = None
    running: bool
    started_at: float | None = Field(default=None, description="unix seconds: its current run's start")
    restarts: int = Field(description="restarts by `switchboard up` since the launcher started")
    last_exit_code: int | None = Field(default=None, description="negative: the signal that killed it (-9 SIGKILL)")
    last_exit_at: float | None = Field(default=None, description="unix seconds")
    last_exit_reason: str | None = Field(
        default=None, description="why `up` killed its last run itself (a hang), null when it died on its own")


class ProcessesResponse(BaseModel):
    supervisor: bool = Field(description="false: not run by `switchboard up` (no process table)")
    launcher_pid: int | None
    updated_at: float | None
    processes: list[ProcessModel]


class AlertsResponse(BaseModel):
    source: str = Field(description="alertmanager | prometheus | builtin")
    alerts: list[AlertModel]
    error: str | None = Field(default=None, description="why the configured source was not used")


# -- the router -----------------------------------------------------------------------------------


def build_admin_router(ctx: AdminContext) -> APIRouter:
    router = APIRouter(prefix="/admin/v1", tags=["admin"], dependencies=[Depends(bearer_guard(ctx.token))])
    member_id_path = Path(pattern=MEMBER_ID_PATTERN, description="member id, e.g. shard-127.0.0.1-8101")

    @router.get("/members", response_model=MembersResponse, summary="Cluster members and their health")
    async def members() -> dict[str, Any]:
        index, listed = ctx.registry.snapshot()
        return {"index": index, "warming_up": ctx.registry.warming_up, "members": listed}

    @router.post("/members/{member_id}/drain", response_model=MemberModel, summary="Stop routing to a member")
    async def drain(member_id: str = member_id_path) -> dict[str, Any]:
        return ctx.registry.set_draining(member_id, True)

    @router.post("/members/{member_id}/undrain", response_model=MemberModel | AbsentMemberModel,
                 summary="Resume routing to a member (or clear an absent one's drain)")
    async def undrain(member_id: str = member_id_path) -> dict[str, Any]:
        return ctx.registry.set_draining(member_id, False)

    @router.get("/processes", response_model=ProcessesResponse,
                summary="The processes `switchboard up` supervises: pids, starts, restarts, last exits")
    async def processes() -> dict[str, Any]:
        if ctx.processes is None:
            return {"supervisor": False, "launcher_pid": None, "updated_at": None, "processes": []}
        return await asyncio.to_thread(ctx.processes.read)

    @router.get("/signals", response_model=SignalsResponse, summary="Latest signals and a short history")
    async def signals() -> dict[str, Any]:
        latest = ctx.ladder.latest_signals
        return {
            "latest": signals_dict(latest, full=True) if latest is not None else None,
            "history": ctx.ladder.signal_history(),
            "interval_s": ctx.ladder.config.interval_s,
        }

    @router.get("/decisions", response_model=DecisionsResponse, summary="Autoscaler decisions")
    async def decisions(limit: int = Query(default=100, ge=1, le=1000)) -> dict[str, Any]:
        if ctx.autoscaler is None:
            return {"autoscaler": False, "decisions": []}
        return {"autoscaler": True, "decisions": list(ctx.autoscaler.decisions())[-limit:]}

    @router.get("/degradation", response_model=DegradationResponse, summary="Degradation level and history")
    async def degradation() -> dict[str, Any]:
        return ctx.ladder.snapshot()

    @router.put(
        "/degradation",
        response_model=DegradationResponse,
        summary="Pin a degradation level",
        description="Holds the level (0 normal .. 4 enterprise only) until DELETE; takes effect in every "
        "gateway within a second; persisted across control-plane restarts.",
    )
    async def pin(body: PinRequest) -> dict[str, Any]:
        ctx.ladder.pin(body.level, body.reason)
        return ctx.ladder.snapshot()

    @router.delete(
        "/degradation",
        response_model=DegradationResponse,
        summary="Release a pinned level",
        description="The level in force stays; the automatic rule takes over from it, one step at a time.",
    )
    async def release(reason: str = Query(default="released by operator", max_length=500)) -> dict[str, Any]:
        ctx.ladder.release(reason)
        return ctx.ladder.snapshot()

    @router.get("/tiers", response_model=TiersResponse, summary="The tier policy in force")
    async def tiers() -> dict[str, Any]:
        return _tiers_body(ctx)

    @router.put(
        "/tiers",
        response_model=TiersResponse,
        summary="Replace the tier policy",
        description="Body: {\"tiers\": {name: {priority, rpm, tpm, max_context_tokens, max_output_tokens, "
        "replication, shed_order, safety?}}}. Validated as a whole (400 names the bad field), persisted, "
        "and pushed to every gateway through /v1/state.",
    )
    async def put_tiers(body: Annotated[dict[str, Any], Body(examples=[_EXAMPLE_POLICY])]) -> dict[str, Any]:
        try:
            policy = TierPolicy.from_dict(body)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="tiers", code="invalid_tier_policy") from None
        gateways = [(m["id"], m.get("meta") or {}) for m in ctx.registry.snapshot("gateway")[1]
                    if m.get("status", "passing") == "passing"]
        if (unserved := unserved_safety(policy, gateways)) is not None:  # a 200 they would all have refused
            raise InvalidRequest(unserved, param="tiers", code="invalid_tier_policy")
        try:
            ctx.store.set_tiers(policy, actor="admin")
        except OSError as exc:
            log.error("could not persist the tier policy: %s", exc)
            raise SwitchboardError(f"could not persist the tier policy ({type(exc).__name__})") from None
        return _tiers_body(ctx)

    @router.get("/traces", response_model=TracesResponse, summary="Recent traces across processes")
    async def traces(
        limit: int = Query(default=20, ge=1, le=200),
        tier: str | None = Query(default=None, max_length=64),
        status: str | None = Query(default=None, pattern="^(ok|error)$"),
        min_ms: float = Query(default=0.0, ge=0.0, allow_inf_nan=False),
        trace_id: str | None = Query(default=None, pattern="^[0-9a-f]{32}$"),
        internal: bool = Query(default=False, description="include health checks, scrapes, heartbeats, polls"),
    ) -> dict[str, Any]:
        spans, sources = await collect_spans(ctx.registry.snapshot()[1], ctx.http, trace_id, ctx.hop_headers)
        assembled = assemble_traces(spans)
        picked = [
            t for t in assembled
            if (internal or trace_id is not None or not is_housekeeping(t["root"]))
            and (tier is None or t["tier"] == tier)
            and (status is None or t["status"] == status)
            and t["duration_ms"] >= min_ms
        ]
        return {"traces": picked[:limit], "sources": sources}

    @router.get("/alerts", response_model=AlertsResponse, summary="Firing alerts")
    async def alerts() -> dict[str, Any]:
        source, fetched, error = "builtin", None, None
        if ctx.http is not None:
            source, fetched, error = await fetch_alerts(
                ctx.http, alertmanager_url=ctx.alertmanager_url, prometheus_url=ctx.prometheus_url)
        if fetched is None:
            fetched = builtin_alerts(ctx.registry.snapshot()[1], warming_up=ctx.registry.warming_up,
                                     degradation=ctx.store.degradation, signals=ctx.ladder.latest_signals)
        return {"source": source, "alerts": fetched, "error": error}

    return router


def _tiers_body(ctx: AdminContext) -> dict[str, Any]:
    return {
        **ctx.store.tiers.to_dict(),
        "source": ctx.store.tiers_source,
        "updated_at": ctx.store.tiers_updated_at,
        "state_index": ctx.state_index.index if ctx.state_index is not None else 0,
    }
