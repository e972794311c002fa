"""The embedded membership registry: members with TTL health checks, blocking queries.

Built by the control plane (control_plane/app.py) unless ``--membership consul://``; members register
through data_plane/membership/embedded.py.

    registry = Registry(services=("shard", "cache"), metrics=RegistryMetrics(CollectorRegistry()))
    await registry.start()                       # starts the reaper task
    registry.upsert("shard-1", service="shard", url="http://127.0.0.1:8101", meta={}, ttl_s=2.0)
    index, members = await registry.query("shard", index=0, wait_s=5.0)   # returns at once
    index, members = await registry.query("shard", index=index, wait_s=5.0)  # waits for a change
    app.include_router(build_router(registry))
    await registry.aclose()

The HTTP API (:func:`build_router`), the wire side of ``data_plane.membership.embedded``::

    PUT    /v1/registry/members/{id}          {"service", "url", "meta", "ttl_s"}  register / heartbeat
    DELETE /v1/registry/members/{id}                                              deregister
    (both with "Authorization: Bearer <cluster token>" when the control plane has one)
    GET    /v1/registry/members?service=&index=&wait=                             blocking query
    (drain / undrain: POST /admin/v1/members/{id}/drain | /undrain, with the admin token)

A member's life::

    PUT ──> passing ──(no PUT for ttl_s)──> critical ──(deregister_critical_after_s)──> removed
              ^  └──drain──> draining            │
              └───────────────(PUT)──────────────┘

Heartbeats that change nothing do not bump the change index, so blocking queries wake only on
changes that matter for routing (register, url/meta change, status change, removal).
The index a query reports is per service (the registry-wide index of the last change that
touched that service), as in Consul; it starts at 1, so ``index=0`` never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, field_validator

from control_plane.registry.drains import DrainMarks
from data_plane.common.errors import InvalidRequest, NotFound
from data_plane.common.hop_auth import require_cluster_token
from data_plane.common.tasks import every, stop_tasks
from data_plane.membership.placement import DEFAULT_ZONE

log = logging.getLogger(__name__)

STATUSES = ("passing", "critical", "draining")
EVENTS = ("registered", "deregistered", "expired", "drained", "undrained")
INDEX_HEADER = "X-Registry-Index"
MEMBER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,199}$"
MAX_META_KEYS = 64
MAX_META_KEY_LEN = 128
MAX_META_VALUE_LEN = 1024


class RegistryMetrics:
    """Prometheus view of the registry; takes its own `registry` so tests can read it back.

    metrics = RegistryMetrics(CollectorRegistry(), services=("shard",))
    metrics.changed("shard", "registered")
    """

    def __init__(self, registry: CollectorRegistry, services: Iterable[str] = ()) -> None:
        self.members = Gauge(
            "switchboard_membership_members",
            "Members in the registry by service and status.",
            ["service", "status"],
            registry=registry,
        )
        self.changes = Counter(
            "switchboard_membership_changes",
            "Membership changes by service and event.",
            ["service", "event"],
            registry=registry,
        )
        self.index = Gauge(
            "switchboard_membership_index", "The registry's current change index.", registry=registry
        )
        self.refused = Counter(
            "switchboard_membership_refused",
            "Registry writes refused for a missing or wrong cluster token, by HTTP method.",
            ["method"],
            registry=registry,
        )
        for method in ("PUT", "DELETE"):
            self.refused.labels(method)
        for service in services:  # every series exists from the start, at 0
            for status in STATUSES:
                self.members.labels(service, status).set(0)
            for event in EVENTS:
                self.changes.labels(service, event)

    def changed(self, service: str, event: str) -> None:
        self.changes.labels(service, event).inc()

    def counts(self, service: str, counts: Mapping[str, int], index: int) -> None:
        for status in STATUSES:
            self.members.labels(service, status).set(counts.get(status, 0))
        self.index.set(index)


@dataclass
class _Entry:
    id: str
    service: str
    url: str
    meta: dict[str, str]
    ttl_s: float
    last_heartbeat: float  # unix seconds, for people
    deadline: float  # monotonic seconds, for the reaper
    draining: bool = False
    critical_since: float | None = None  # monotonic

    @property
    def status(self) -> str:
        if self.critical_since is not None:
            return "critical"
        return "draining" if self.draining else "passing"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "service": self.service,
            "url": self.url,
            "meta": dict(self.meta),
            "zone": self.meta.get("zone") or DEFAULT_ZONE,
            "status": self.status,
            "last_heartbeat": self.last_heartbeat,
            "ttl_s": self.ttl_s,
            "draining": self.draining,
        }


@dataclass
class _Clock:
    wall: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic


class Registry:
    """In-memory members with TTL checks; one per control-plane process.

    `upsert`, `remove` and `set_draining` are called by the HTTP handlers; `query` by blocking
    queries; the reaper task (started by `start`, cancelled by `aclose`) expires silent members.
    `drains` keeps the operator's drains across a restart (control_plane/registry/drains.py): a
    member that registers under a drained id starts out draining.
    """

    def __init__(
        self,
        *,
        services: Iterable[str],
        metrics: RegistryMetrics | None = None,
        reap_interval_s: float = 0.2,
        deregister_critical_after_s: float = 60.0,
        max_wait_s: float = 60.0,
        warmup_s: float = 0.0,
        default_ttl_s: float = 10.0,
        clock: _Clock | None = None,
        drains: DrainMarks | None = None,
    ) -> None:
        self.services = tuple(services)
        self.drains = drains if drains is not None else DrainMarks(None)
        self.default_ttl_s = default_ttl_s
        self.instance_id = uuid.uuid4().hex
        self._metrics = metrics
        self.metrics = metrics
        self._reap_interval_s = reap_interval_s
        self._deregister_after_s = deregister_critical_after_s
        self._max_wait_s = max_wait_s
        self._clock = clock or _Clock()
        self._warm_at = self._clock.monotonic() + warmup_s
        self._entries: dict[str, _Entry] = {}
        self._index = 1
        self._service_index: dict[str, int] = {}
        self._changed = asyncio.Event()
        self._closed = False
        self._reaper: asyncio.Task[None] | None = None
        self._last_tick = self._clock.monotonic()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._last_tick = self._clock.monotonic()
        self._reaper = asyncio.create_task(every(self._reap_interval_s, self._tick, "registry reaper", log),
                                           name="registry-reaper")

    def close_waiters(self) -> None:
        """Answer every blocking query now, and future ones at once (server shutting down)."""
        self._closed = True
        self._changed.set()

    async def aclose(self) -> None:
        self.close_waiters()
        await stop_tasks(self._reaper)
        self._reaper = None

    # -- reads -----------------------------------------------------------------------------

    @property
    def index(self) -> int:
        return self._index

    @property
    def warming_up(self) -> bool:
        """True while members that knew a previous instance may not have re-registered yet."""
        return self._clock.monotonic() < self._warm_at

    def index_of(self, service: str | None) -> int:
        if service is None:
            return self._index
        return self._service_index.get(service, 1)

    def snapshot(self, service: str | None = None) -> tuple[int, list[dict[str, Any]]]:
        entries = (e for e in self._entries.values() if service is None or e.service == service)
        return self.index_of(service), [e.to_dict() for e in sorted(entries, key=lambda e: e.id)]

    async def query(self, service: str | None, index: int, wait_s: float) -> tuple[int, list[dict[str, Any]]]:
        """Members of `service` (all when None); waits up to `wait_s` while the index equals `index`."""
        self._check_service(service, param="service")
        now = self._clock.monotonic()
        deadline = now + min(wait_s, self._max_wait_s)
        if now < self._warm_at:  # answer when warm-up ends, so clients learn the list is complete
            deadline = min(deadline, self._warm_at)
        while not self._closed and self.index_of(service) == index:
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                break
            # on timeout, loop: asyncio may fire a timer up to its clock resolution early, and a
            # warm-up-capped query must not answer "warming_up" a hair before warm-up ends
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return self.snapshot(service)

    def get(self, member_id: str) -> dict[str, Any]:
        entry = self._entries.get(member_id)
        if entry is None:
            raise NotFound(f"no member {member_id!r} in the registry", param="id")
        return entry.to_dict()

    # -- writes ----------------------------------------------------------------------------

    def upsert(
        self, member_id: str, *, service: str, url: str, meta: Mapping[str, str], ttl_s: float | None
    ) -> tuple[dict[str, Any], bool]:
        """Register or heartbeat `member_id`; returns (member, created)."""
        self._check_service(service, param="service")
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        wall, mono = self._clock.wall(), self._clock.monotonic()
        entry = self._entries.get(member_id)
        if entry is not None and entry.service != service:
            self._remove(entry, reason=f"re-registering as {service}")
            entry = None
        if entry is None:
            entry = _Entry(member_id, service, url, dict(meta), ttl, wall, mono + ttl,
                           draining=member_id in self.drains)
            self._entries[member_id] = entry
            log.info("registered %s (%s) at %s ttl=%.1fs meta=%s%s", member_id, service, url, ttl, dict(meta),
                     " (draining: an operator drained it)" if entry.draining else "")
            self._bump(service, "registered")
            return entry.to_dict(), True
        changed = entry.url != url or entry.meta != meta or entry.critical_since is not None
        if entry.critical_since is not None:
            log.info("member %s (%s) is passing again", member_id, service)
            self._event(service, "registered")
        elif changed:
            log.info("member %s (%s) updated: url=%s meta=%s", member_id, service, url, dict(meta))
        entry.url, entry.meta, entry.ttl_s = url, dict(meta), ttl
        entry.last_heartbeat, entry.deadline, entry.critical_since = wall, mono + ttl, None
        if changed:
            self._bump(service)
        return entry.to_dict(), False

    def remove(self, member_id: str) -> dict[str, Any]:
        entry = self._entries.get(member_id)
        if entry is None:
            raise NotFound(f"no member {member_id!r} in the registry", param="id")
        self._remove(entry, reason="deregistered")
        self.drains.set(member_id, False)  # it left on its own: a new member under this id starts fresh
        return entry.to_dict()

    def set_draining(self, member_id: str, draining: bool) -> dict[str, Any]:
        entry = self._entries.get(member_id)
        if entry is None and not draining and member_id in self.drains:
            # a drained member that died without deregistering (kill -9, expiry) keeps its mark, so
            # the next process under its id would be born drained: undrain clears it while it is away
            self.drains.set(member_id, False)
            log.info("drain mark of absent member %s cleared", member_id)
            return {"id": member_id, "status": "absent", "draining": False}
        if entry is None:
            raise NotFound(f"no member {member_id!r} in the registry", param="id")
        self.drains.set(member_id, draining)
        if entry.draining != draining:
            entry.draining = draining
            event = "drained" if draining else "undrained"
            log.info("member %s (%s) %s", member_id, entry.service, event)
            self._bump(entry.service, event)
        return entry.to_dict()

    def _tick(self) -> None:
        """The reaper's tick: time this process did not run (stopped, its host paused, its loop blocked) is
        not counted against members, then `reap`. When it runs again, the reaper's timer is due before the
        heartbeats queued meanwhile are read: every member would read critical at once (seen: the control
        plane SIGSTOPped 37 s marked every shard, cache node and gateway critical and its zone DOWN), and
        the first zone-down or scaling decision would act on a fleet that never stopped."""
        now = self._clock.monotonic()
        asleep = now - self._last_tick - self._reap_interval_s
        self._last_tick = now
        if asleep > self._reap_interval_s:
            for entry in self._entries.values():
                entry.deadline += asleep
                if entry.critical_since is not None:
                    entry.critical_since += asleep
            log.log(logging.WARNING if asleep >= 1.0 else logging.DEBUG,
                    "the registry did not run for %.1f s (process stopped, host paused or loop blocked): "
                    "members' TTLs count from now", asleep)
        self.reap()

    def reap(self) -> None:
        """Expire members past their TTL and remove long-critical ones (called by the reaper)."""
        now = self._clock.monotonic()
        for entry in list(self._entries.values()):
            if entry.critical_since is None and now > entry.deadline:
                entry.critical_since = now
                log.warning(
                    "member %s (%s) missed its %.1fs TTL; critical", entry.id, entry.service, entry.ttl_s
                )
                self._bump(entry.service, "expired")
            elif entry.critical_since is not None and now - entry.critical_since >= self._deregister_after_s:
                self._remove(entry, reason=f"critical for {self._deregister_after_s:.0f}s")

    # -- internals -------------------------------------------------------------------------

    def _check_service(self, service: str | None, *, param: str) -> None:
        if service is not None and service not in self.services:
            raise InvalidRequest(
                f"unknown service {service!r}; expected one of {', '.join(self.services)}", param=param
            )

    def _remove(self, entry: _Entry, *, reason: str) -> None:
        del self._entries[entry.id]
        log.info("deregistered %s (%s): %s", entry.id, entry.service, reason)
        self._bump(entry.service, "deregistered")

    def _event(self, service: str, event: str) -> None:
        if self._metrics is not None:
            self._metrics.changed(service, event)

    def _bump(self, service: str, event: str | None = None) -> None:
        self._index += 1
        self._service_index[service] = self._index
        if event is not None:
            self._event(service, event)
        if self._metrics is not None:
            counts: dict[str, int] = {}
            for e in self._entries.values():
                if e.service == service:
                    counts[e.status] = counts.get(e.status, 0) + 1
            self._metrics.counts(service, counts, self._index)
        # wake every waiter; each re-checks its own service's index
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        if self._closed:
            self._changed.set()


# -- HTTP ------------------------------------------------------------------------------------


class RegisterBody(BaseModel):
    """Body of ``PUT /v1/registry/members/{id}``."""

    model_config = ConfigDict(extra="forbid")

    service: str = Field(min_length=1, max_length=64)
    url: str = Field(min_length=1, max_length=2048)
    meta: dict[str, str] = Field(default_factory=dict)
    ttl_s: float | None = Field(default=None, ge=0.1, le=3600.0, allow_inf_nan=False)

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an absolute http(s) URL, e.g. http://127.0.0.1:8101")
        try:
            parts.port  # noqa: B018 -- raises on a malformed port
        except ValueError as exc:
            raise ValueError(f"bad port in URL: {exc}") from None
        return value.rstrip("/")

    @field_validator("meta")
    @classmethod
    def _check_meta(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > MAX_META_KEYS:
            raise ValueError(f"at most {MAX_META_KEYS} keys")
        for key, item in value.items():
            if not key or len(key) > MAX_META_KEY_LEN or len(item) > MAX_META_VALUE_LEN:
                raise ValueError(
                    f"keys must be 1-{MAX_META_KEY_LEN} chars and values at most {MAX_META_VALUE_LEN}"
                )
        return value


def _member_response(member: dict[str, Any], registry: Registry) -> JSONResponse:
    return JSONResponse(member, headers={INDEX_HEADER: str(registry.index)})


def build_router(registry: Registry, cluster_token: str | None = None) -> APIRouter:
    """The registry's HTTP API over `registry` (see the module docstring). Writes need
    `cluster_token` when one is given; reads are open (membership is no secret to a member)."""
    router = APIRouter(prefix="/v1/registry", tags=["registry"])
    metrics = registry.metrics
    count = None if metrics is None else lambda request: metrics.refused.labels(request.method).inc()
    writes = [Depends(require_cluster_token(cluster_token, "registering", count))]
    MemberId = Path(pattern=MEMBER_ID_PATTERN, description="unique member id, e.g. shard-127.0.0.1-8101")

    @router.put("/members/{member_id}", dependencies=writes)
    async def register(body: RegisterBody, member_id: str = MemberId) -> JSONResponse:
        member, created = registry.upsert(
            member_id, service=body.service, url=body.url, meta=body.meta, ttl_s=body.ttl_s
        )
        response = _member_response(member, registry)
        response.headers["X-Registry-Created"] = "true" if created else "false"
        return response

    @router.delete("/members/{member_id}", dependencies=writes)
    async def deregister(member_id: str = MemberId) -> JSONResponse:
        return _member_response(registry.remove(member_id), registry)

    @router.get("/members")
    async def list_members(
        service: str | None = Query(default=None, max_length=64),
        index: int = Query(default=0, ge=0),
        wait: float = Query(default=5.0, ge=0.0, le=600.0, allow_inf_nan=False),
    ) -> JSONResponse:
        index_now, members = await registry.query(service, index, wait)
        body = {
            "index": index_now,
            "members": members,
            "registry_id": registry.instance_id,
            "warming_up": registry.warming_up,
        }
        return JSONResponse(body, headers={INDEX_HEADER: str(index_now)})

    @router.get("/members/{member_id}")
    async def get_member(member_id: str = MemberId) -> JSONResponse:
        return _member_response(registry.get(member_id), registry)

    # Drain/undrain are operator actions: only under /admin/v1 (admin token), never here.
    return router


__all__ = [
    "EVENTS",
    "INDEX_HEADER",
    "STATUSES",
    "RegisterBody",
    "Registry",
    "RegistryMetrics",
    "build_router",
]
