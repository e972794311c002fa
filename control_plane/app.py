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

import argparse
import contextlib
import logging
import sys
from collections.abc import AsyncIterator

import httpx
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from control_plane.scaling.actuators.local import LocalActuator
from control_plane.admin.api import AdminContext, bearer_guard, build_admin_router
from control_plane.scaling.loop import add_autoscaler_flags, build_autoscaler
from control_plane.degradation import DegradationController, DegradationMetrics, ladder_config
from control_plane.registry.consul import ConsulMembers
from control_plane.policy_store import open_store
from control_plane.registry.embedded import Registry, RegistryMetrics, build_router
from control_plane.settings import ENV_ADMIN_TOKEN, ControlPlaneSettings
from control_plane.signals.source import build_signal_source
from control_plane.state_api import StateIndex, build_state_router, cluster_state_body
from control_plane.admin.usage import build_usage_router
from control_plane.zones import ZoneMetrics, ZoneWatch, build_zones_router
from data_plane.common.errors import install_error_handlers
from data_plane.common.hop_auth import cluster_headers, guarded
from data_plane.common.http_server import serve
from data_plane.ledger.store import default_usage_db
from data_plane.ledger.store import open_ledger_store
from data_plane.membership.consul import token_from_env
from data_plane.common.telemetry import configure_process, fastapi_options, metrics_endpoint, recent_spans_endpoint

log = logging.getLogger(__name__)

SERVICE_NAME = "switchboard-control-plane"


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
    )
    consul = None  # with --membership consul://…, members live in Consul: read there, not hosted here
    if settings.membership:
        consul = ConsulMembers(settings.membership, settings.services, token=token_from_env())
    members = consul or registry  # what the admin API and the signals read
    zones = ZoneWatch(members, ZoneMetrics(metrics_registry))
    autoscaler = build_autoscaler(settings, metrics_registry)  # None unless --autoscale
    store = open_store(settings)
    state_index = StateIndex(max_wait_s=settings.max_wait_s)
    store.subscribe(state_index.bump)
    ladder = DegradationController(store, None, config=ladder_config(settings),
                                   metrics=DegradationMetrics(metrics_registry))
    admin = AdminContext(registry=members, store=store, ladder=ladder, token=settings.admin_token,
                         prometheus_url=getattr(settings, "prometheus", None),
                         alertmanager_url=settings.alertmanager, state_index=state_index)
    admin.autoscaler = autoscaler
    cluster_token = settings.cluster_token.get_secret_value() if settings.cluster_token else None
    admin.hop_headers = cluster_headers(cluster_token)
    usage_db = settings.usage_db or default_usage_db(".switchboard")
    usage_store = None if usage_db == "off" else open_ledger_store(usage_db)  # connects on first read

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
            await ladder.aclose()
            if consul is not None:
                await consul.aclose()
            await registry.aclose()
            await http.aclose()
            if usage_store is not None:
                usage_store.close()

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

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    app.add_route("/metrics", metrics_endpoint(metrics_registry))
    app.add_route("/debug/spans", guarded(recent_spans_endpoint, cluster_token))

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
        state_index, store, retry_after_s=ladder.config.lower_dwell_s)))
    app.include_router(build_admin_router(admin))
    app.include_router(build_zones_router(zones, [Depends(bearer_guard(settings.admin_token))]))
    app.include_router(build_usage_router(usage_store, settings.admin_token))
    return app


def parse_settings(argv: list[str] | None) -> ControlPlaneSettings:
    parser = argparse.ArgumentParser(
        prog="switchboard control-plane",
        description="Run the control plane (membership registry, admin API). "
        "Every flag also reads SWITCHBOARD_CONTROL_PLANE_<NAME>; the token reads " + ENV_ADMIN_TOKEN + ".",
    )
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default 8300)")
    parser.add_argument("--admin-token", help="bearer token for /admin/v1 (prefer the env variable)")
    parser.add_argument("--cluster-token", help="bearer token members need to register (prefer "
                        "SWITCHBOARD_CLUSTER_TOKEN)")
    parser.add_argument("--services", help="comma-separated service names members may use")
    parser.add_argument("--membership", help="consul://host:8500: members live in Consul (default: embedded)")
    parser.add_argument("--reap-interval", dest="reap_interval_s", type=float, help="TTL check period, s")
    parser.add_argument(
        "--deregister-critical-after",
        dest="deregister_critical_after_s",
        type=float,
        help="remove members critical this long, s (default 60)",
    )
    parser.add_argument("--max-wait", dest="max_wait_s", type=float, help="cap on blocking-query wait, s")
    parser.add_argument("--warmup", dest="warmup_s", type=float, help="post-restart warm-up, s (default 3)")
    parser.add_argument("--default-ttl", dest="default_ttl_s", type=float, help="TTL when none is given, s")
    parser.add_argument("--shutdown-grace", dest="shutdown_grace_s", type=int, help="graceful shutdown, s")
    parser.add_argument("--access-log", action="store_true", default=None, help="log every request")
    parser.add_argument("--state-dir", help="persist tier policy and degradation level here (JSON)")
    parser.add_argument("--tiers-file", help="YAML tier policy used when the state dir holds none")
    parser.add_argument("--alertmanager", help="Alertmanager URL for /admin/v1/alerts")
    parser.add_argument("--usage-db", help="usage ledger database for /admin/v1/usage (sqlite:///path, "
                        "postgresql://..., off; default the gateway's default SQLite file)")
    parser.add_argument("--degradation-interval", dest="degradation_interval_s", type=float,
                        help="seconds between degradation-ladder evaluations (default 2)")
    parser.add_argument("--degradation-raise-dwell", dest="degradation_raise_dwell_s", type=float,
                        help="least seconds at a level before raising it (default 10)")
    parser.add_argument("--degradation-lower-dwell", dest="degradation_lower_dwell_s", type=float,
                        help="seconds of calm before lowering a level a windowed figure raised (default 30)")
    parser.add_argument("--degradation-lower-dwell-gauge", dest="degradation_lower_dwell_gauge_s", type=float,
                        help="seconds of calm before lowering a level a queue gauge or a pin raised (default 10)")
    parser.add_argument("--degradation-raise-queue-time", dest="degradation_raise_queue_time_s", type=float,
                        help="queue time p95 above which the ladder rises, with a queue (default 2)")
    add_autoscaler_flags(parser)
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    try:
        return ControlPlaneSettings(**overrides)
    except ValidationError as exc:
        parser.exit(2, f"switchboard control-plane: invalid settings\n{exc}\n")


def main(argv: list[str] | None = None) -> None:
    settings = parse_settings(argv)
    configure_process(SERVICE_NAME)
    app = create_app(settings)
    if settings.admin_token is None:
        log.warning("no admin token configured; /admin/v1 answers 401 (set %s)", ENV_ADMIN_TOKEN)
    log.info("control plane on http://%s:%d", settings.host, settings.port)
    # blocking queries (membership watches, the state index) answer at once when shutdown starts
    hooks = [app.state.registry.close_waiters]
    if app.state.state_index is not None:
        hooks.append(app.state.state_index.close_waiters)
    serve(app, host=settings.host, port=settings.port, graceful_s=settings.shutdown_grace_s,
          access_log=settings.access_log, on_shutdown=tuple(hooks))


if __name__ == "__main__":
    main(sys.argv[1:])
