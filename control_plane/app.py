"""The control-plane process: embedded membership registry + admin API.

    switchboard control-plane --port 8300 --admin-token "$TOKEN"
    SWITCHBOARD_ADMIN_TOKEN=... switchboard control-plane

    app = create_app(ControlPlaneSettings(admin_token="t"))   # in tests or another server

Serves ``/health``, ``/metrics``, ``/debug/spans``, the registry API under ``/v1/registry``
(see :mod:`control_plane.registry`) and the bearer-protected admin API under ``/admin/v1``.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Path, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from pydantic import SecretStr, ValidationError

from control_plane.registry import MEMBER_ID_PATTERN, Registry, RegistryMetrics, build_router
from control_plane.settings import ENV_ADMIN_TOKEN, ControlPlaneSettings
from data_plane.errors import AuthenticationError, install_error_handlers
from data_plane.telemetry import configure_process, metrics_endpoint, recent_spans_endpoint

log = logging.getLogger(__name__)

SERVICE_NAME = "switchboard-control-plane"


def bearer_guard(token: SecretStr | None) -> Any:
    """A FastAPI dependency that lets a request through only with ``Authorization: Bearer <token>``."""
    expected = token.get_secret_value().encode() if token is not None else None

    async def _guard(request: Request) -> None:
        if not expected:
            raise AuthenticationError(
                f"the admin API is disabled: no admin token configured (--admin-token or {ENV_ADMIN_TOKEN})",
                headers={"WWW-Authenticate": "Bearer"},
            )
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            raise AuthenticationError(
                "missing or invalid admin token (Authorization: Bearer <token>)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return _guard


def build_admin_router(registry: Registry, token: SecretStr | None) -> APIRouter:
    router = APIRouter(prefix="/admin/v1", tags=["admin"], dependencies=[Depends(bearer_guard(token))])
    member_id_path = Path(pattern=MEMBER_ID_PATTERN)

    @router.get("/members")
    async def members() -> dict[str, Any]:
        index, listed = registry.snapshot()
        return {"index": index, "warming_up": registry.warming_up, "members": listed}

    @router.post("/members/{member_id}/drain")
    async def drain(member_id: str = member_id_path) -> dict[str, Any]:
        return registry.set_draining(member_id, True)

    @router.post("/members/{member_id}/undrain")
    async def undrain(member_id: str = member_id_path) -> dict[str, Any]:
        return registry.set_draining(member_id, False)

    return router


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

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await registry.start()
        try:
            yield
        finally:
            await registry.aclose()

    app = FastAPI(title="Switchboard control plane", lifespan=lifespan)
    app.state.settings = settings
    app.state.registry = registry
    app.state.metrics_registry = metrics_registry
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    app.add_route("/metrics", metrics_endpoint(metrics_registry))
    app.add_route("/debug/spans", recent_spans_endpoint)
    app.include_router(build_router(registry))
    app.include_router(build_admin_router(registry, settings.admin_token))
    return app


class _Server(uvicorn.Server):
    """uvicorn, plus: blocking queries are answered at once when shutdown starts."""

    def __init__(self, config: uvicorn.Config, registry: Registry) -> None:
        super().__init__(config)
        self._registry = registry

    async def shutdown(self, sockets: Any = None) -> None:
        self._registry.close_waiters()
        await super().shutdown(sockets)


def parse_settings(argv: list[str] | None) -> ControlPlaneSettings:
    parser = argparse.ArgumentParser(
        prog="switchboard control-plane",
        description="Run the control plane (membership registry, admin API). "
        "Every flag also reads SWITCHBOARD_CONTROL_PLANE_<NAME>; the token reads " + ENV_ADMIN_TOKEN + ".",
    )
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default 8300)")
    parser.add_argument("--admin-token", help="bearer token for /admin/v1 (prefer the env variable)")
    parser.add_argument("--services", help="comma-separated service names members may use")
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
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        access_log=settings.access_log,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        log_config=None,  # keep the process's logging setup
    )
    server = _Server(config, app.state.registry)
    if settings.admin_token is None:
        log.warning("no admin token configured; /admin/v1 answers 401 (set %s)", ENV_ADMIN_TOKEN)
    log.info("control plane on http://%s:%d", settings.host, settings.port)
    server.run()


if __name__ == "__main__":
    main(sys.argv[1:])
