"""The control-plane process: embedded membership registry + admin API.

    switchboard control-plane --port 8300 --admin-token "$TOKEN"
    SWITCHBOARD_ADMIN_TOKEN=... switchboard control-plane

    app = create_app(ControlPlaneSettings(admin_token="t"))   # in tests or another server

Serves ``/health``, ``/metrics``, ``/debug/spans``, the registry API under ``/v1/registry``
(see :mod:`control_plane.registry.embedded`), the gateways' ``/v1/state`` (degradation level + tier policy,
:mod:`control_plane.state_api`) and the bearer-protected admin API under ``/admin/v1``
(:mod:`control_plane.admin.api`). The degradation ladder (:mod:`control_plane.degradation`) runs
in the lifespan; ``--state-dir`` persists the tier policy and the ladder across restarts.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import AsyncIterator

import httpx
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry

from control_plane.abuse import build_abuse
from control_plane.admin.api import AdminContext, bearer_guard, build_admin_router
from control_plane.admin.processes import ProcessTable
from control_plane.admin.usage import build_usage_router
from control_plane.degradation import DegradationController, DegradationMetrics, ladder_config
from control_plane.policy_store import open_store
from control_plane.registry.consul import ConsulMembers
from control_plane.registry.drains import DrainMarks
from control_plane.registry.embedded import Registry, RegistryMetrics, build_router
from control_plane.scaling.actuators.local import LocalActuator
from control_plane.scaling.loop import build_autoscaler
from control_plane.settings import ENV_ADMIN_TOKEN, ControlPlaneSettings
from control_plane.signals.source import build_signal_source
from control_plane.state_api import StateIndex, build_state_router, cluster_state_body, load_state_id
from control_plane.zones import ZoneMetrics, ZoneWatch, build_zones_router
from data_plane.common.errors import install_error_handlers
from data_plane.common.hop_auth import RefusalMetrics, cluster_headers, guarded, guarded_metrics
from data_plane.common.http_body import BodyLimit
from data_plane.common.http_server import serve
from data_plane.common.settings_cli import parse_settings as cli_settings
from data_plane.common.telemetry import (
    configure_process,
    fastapi_options,
    metrics_endpoint,
    recent_spans_endpoint,
)
from data_plane.ledger.store import default_usage_db, open_ledger_store
from data_plane.membership.consul import token_from_env

log = logging.getLogger(__name__)

SERVICE_NAME = "switchboard-control-plane"
MAX_BODY_BYTES = 8 << 20
"""The largest request body the control plane reads (413 beyond, before any token check): its largest are a
tier policy and a gateway's report of failed authentications (at most 4,096 addresses), well under 1 MiB."""
REFUSED_ROUTES = ("abuse", "debug_spans", "metrics")
"""``switchboard_control_plane_refused_total``'s route label (data_plane/common/hop_auth.py RefusalMetrics):
``abuse`` is the gateways' hop to the abuse state (/v1/abuse/state, /v1/abuse/reports); refused registry
writes are switchboard_membership_refused_total{method}, admin API 401s are not counted."""


def create_app(settings: ControlPlaneSettings) -> FastAPI:
    """The control-plane ASGI app; owns its registry, metrics registry and reaper task."""
    metrics_registry = CollectorRegistry()
    registry = Registry(
        services=settings.services,
        metrics=RegistryMetrics(metrics_registry, settings.services),
        reap_interval_s=settings.reap_interval_s,
        deregister_critical_after_s=settings.deregister_critical_after_s,
        max_wait_s=settings.max_wait_s,
        warmup_s=settings.warmup_s,
        default_ttl_s=settings.default_ttl_s,
        drains=DrainMarks(settings.state_dir),  # an operator's drain outlives a restart of this process
    )
    consul = None  # with --membership consul://…, members live in Consul: read there, not hosted here
    if settings.membership:
        consul = ConsulMembers(settings.membership, settings.services, token=token_from_env())
    members = consul or registry  # what the admin API and the signals read
    zones = ZoneWatch(members, ZoneMetrics(metrics_registry),
                      expected=tuple(z.strip() for z in settings.shard_zones.split(",") if z.strip()))
    autoscaler = build_autoscaler(settings, metrics_registry)  # None unless --autoscale
    store = open_store(settings, metrics_registry)
    state_index = StateIndex(max_wait_s=settings.max_wait_s, state_id=load_state_id(settings.state_dir))
    store.subscribe(state_index.bump)
    ladder = DegradationController(store, None, config=ladder_config(settings),
                                   metrics=DegradationMetrics(metrics_registry))
    admin = AdminContext(registry=members, store=store, ladder=ladder, token=settings.admin_token,
                         prometheus_url=getattr(settings, "prometheus", None),
                         alertmanager_url=settings.alertmanager, state_index=state_index)
    admin.autoscaler = autoscaler
    if settings.processes_file is not None:  # run by `switchboard up`: its supervisor's table
        admin.processes = ProcessTable(settings.processes_file, metrics_registry)
    cluster_token = settings.cluster_token.get_secret_value() if settings.cluster_token else None
    admin.hop_headers = cluster_headers(cluster_token)
    usage_db = settings.usage_db or default_usage_db(".switchboard")
    usage_store = None if usage_db == "off" else open_ledger_store(usage_db)  # connects on first read
    refusals = RefusalMetrics(metrics_registry, "control_plane", REFUSED_ROUTES)  # every route at 0
    abuse, abuse_routes = build_abuse(settings, usage_store, metrics_registry, cluster_token,
                                      on_refused=refusals.on("abuse"))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        http = httpx.AsyncClient(timeout=5.0)
        app.state.http = admin.http = http
        app.state.signal_source = build_signal_source(settings, members, http)
        await registry.start()
        if consul is not None:
            await consul.start()
        await ladder.start(app.state.signal_source)
        await zones.start()
        await abuse.start()
        if autoscaler is not None:
            await autoscaler.start(app.state.signal_source, http)
            zones.on_down(autoscaler.replace_lost)  # replacements in the surviving zones
            if isinstance(autoscaler.actuator, LocalActuator):  # it tags the shards it starts with a zone
                autoscaler.actuator.zone_for_new = zones.zone_for_new_shard
        try:
            yield
        finally:
            if autoscaler is not None:
                await autoscaler.aclose()  # the local actuator stops its shards here
            await zones.aclose()
            await abuse.aclose()
            await ladder.aclose()
            if consul is not None:
                await consul.aclose()
            await registry.aclose()
            await http.aclose()
            if usage_store is not None:
                usage_store.close()
            abuse.index.close_waiters()

    app = FastAPI(title="Switchboard control plane", lifespan=lifespan, **fastapi_options())
    app.state.settings = settings
    app.state.registry = registry
    app.state.store = store
    app.state.state_index = state_index
    app.state.ladder = ladder
    app.state.autoscaler = autoscaler
    app.state.admin = admin
    app.state.metrics_registry = metrics_registry
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    metrics_token = settings.metrics_token.get_secret_value() if settings.metrics_token else None
    app.add_route("/metrics", guarded_metrics(metrics_endpoint(metrics_registry), cluster_token, metrics_token,
                                              refusals=refusals))
    app.add_route("/debug/spans", guarded(recent_spans_endpoint, cluster_token, refusals=refusals))

    @app.get("/v1/sd/prometheus")
    async def prometheus_sd(service: str) -> JSONResponse:
        """Prometheus HTTP service discovery: the live members of `service` as scrape targets,
        so autoscaled shards are scraped without editing the Prometheus config."""
        _, members = (consul or registry).snapshot(service)
        targets = [m["url"].split("://", 1)[-1].rstrip("/") for m in members if m.get("status") != "critical"]
        return JSONResponse([{"targets": targets, "labels": {"switchboard_service": service}}] if targets else [])

    if consul is None:
        cluster_token = settings.cluster_token.get_secret_value() if settings.cluster_token else None
        if cluster_token is None:
            log.warning("no cluster token (SWITCHBOARD_CLUSTER_TOKEN): any process that reaches port %d can "
                        "register as a shard and be sent user prompts", settings.port)
        app.include_router(build_router(registry, cluster_token))
    app.include_router(build_state_router(state_index, lambda: cluster_state_body(
        state_index, store, retry_after_s=ladder.retry_after_s())))
    app.include_router(build_admin_router(admin))
    app.include_router(build_zones_router(zones, [Depends(bearer_guard(settings.admin_token))]))
    app.include_router(build_usage_router(usage_store, settings.admin_token))
    app.include_router(abuse_routes)
    app.state.abuse = abuse
    return app


def parse_settings(argv: list[str] | None) -> ControlPlaneSettings:
    """Flags, then ``SWITCHBOARD_CONTROL_PLANE_*`` (the tokens: SWITCHBOARD_ADMIN_TOKEN,
    SWITCHBOARD_CLUSTER_TOKEN), then defaults (data_plane/common/settings_cli.py)."""
    return cli_settings(ControlPlaneSettings, argv, prog="switchboard control-plane")


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    configure_process(SERVICE_NAME)
    try:  # a tier policy or abuse rules file that does not parse or does not fit: one line, not a traceback
        app = create_app(settings)
    except ValueError as exc:
        raise SystemExit(f"switchboard control-plane: {exc}") from None
    except OSError as exc:  # --state-dir under a file, on a read-only disk, another user's folder
        raise SystemExit(f"switchboard control-plane: {exc.filename or settings.state_dir}: "
                         f"{exc.strerror or exc}") from None
    if settings.admin_token is None:
        log.warning("no admin token configured; /admin/v1 answers 401 (set %s)", ENV_ADMIN_TOKEN)
    log.info("control plane on http://%s:%d", settings.host, settings.port)
    # blocking queries (membership watches, the state index) answer at once when shutdown starts
    hooks = [app.state.registry.close_waiters]
    if app.state.state_index is not None:
        hooks.append(app.state.state_index.close_waiters)
    hooks.append(app.state.abuse.index.close_waiters)
    serve(app, host=settings.host, port=settings.port, graceful_s=settings.shutdown_grace_s,
          access_log=settings.access_log, on_shutdown=tuple(hooks), registry=app.state.metrics_registry,
          process="control_plane")


if __name__ == "__main__":
    main(sys.argv[1:])
