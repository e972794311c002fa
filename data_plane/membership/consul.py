"""Membership on Consul: the data plane's view and self-registration, over Consul's HTTP API.

Built by data_plane/membership/factory.py for a ``consul://`` membership URL, in place of the embedded
registry's client (data_plane/membership/embedded.py).

    view = ConsulMembership("consul://127.0.0.1:8500", http, services=("shard", "cache"))
    await view.start()                  # never raises; keeps the last list while Consul is unreachable
    view.members("shard")               # passing instances of `switchboard-shard`, sorted by id
    view.reachable                      # False while Consul cannot be reached
    await view.aclose()

    agent = ConsulRegistrationAgent("consul://127.0.0.1:8500", Member(...), http, ttl_s=2.0)
    await agent.start()                 # registers with a TTL check, then passes it every ttl_s / 3
    agent.set_meta(load="3")            # re-registers with the next heartbeat
    await agent.aclose()                # deregisters (best effort)

The same surface as :mod:`data_plane.membership.embedded` (``HttpMembership``, ``RegistrationAgent``), so
a process picks one by URL (:mod:`data_plane.membership.factory`). The wire, as in Consul's docs::

    PUT /v1/agent/service/register        {"ID", "Name": "switchboard-shard", "Address", "Port", "Meta",
                                           "Check": {"CheckID": "service:<id>", "TTL": "800ms",
                                                     "Status": "passing", "DeregisterCriticalServiceAfter": "60s"}}
    PUT /v1/agent/check/pass/service:<id>                           heartbeat
    PUT /v1/agent/service/deregister/<id>                           clean shutdown
    GET /v1/health/service/switchboard-shard?passing=true&index=N&wait=5s     blocking query, X-Consul-Index

A member's URL travels in ``Meta["url"]`` (``Address``/``Port`` are set too, for DNS and for services
registered by others, e.g. Nomad); it is not part of :attr:`Member.meta` on the way back. Consul
allows meta keys of ``[A-Za-z0-9_-]`` only, at most 64 of them. Heartbeats carry no note, so a pass
that changes nothing does not wake blocking queries. Registration agents talk to the Consul agent on
their own host; views may ask any agent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from data_plane.common.tasks import stop_tasks
from data_plane.membership.embedded import HeartbeatAgent
from data_plane.membership.view import Member, routable, routing_key

log = logging.getLogger(__name__)

SERVICE_PREFIX = "switchboard-"
"""Consul service name = prefix + Switchboard service (``switchboard-shard``, ``-cache``, ``-gateway``)."""
URL_META_KEY = "url"
"""Meta key that carries a member's base URL."""
ENV_CONSUL_TOKEN = "CONSUL_HTTP_TOKEN"
"""Consul's own variable for the ACL token; read once per process by :func:`token_from_env`."""
TOKEN_HEADER = "X-Consul-Token"
INDEX_HEADER = "X-Consul-Index"
MAINTENANCE_CHECK_PREFIXES = ("_service_maintenance:", "_node_maintenance")
"""Checks Consul adds for maintenance mode; a member in maintenance counts as draining."""
_SCHEMES = {"consul": "http", "consul+http": "http", "consul+https": "https", "http": "http", "https": "https"}
_META_KEY = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_MAX_META = 64
_BACKOFF_START_S = 0.1
_BACKOFF_MAX_S = 1.0
_MIN_REQUERY_S = 0.05
_DEREGISTER_TIMEOUT_S = 1.0


def consul_http_url(url: str) -> str:
    """Consul's HTTP address from ``consul://host:8500`` (or ``consul+https://``, ``http(s)://``,
    or a bare ``host:port`` as in ``CONSUL_HTTP_ADDR``)."""
    if "://" not in url:
        url = "consul://" + url
    parts = urlsplit(url)
    scheme = _SCHEMES.get(parts.scheme)
    if scheme is None or not parts.hostname:
        raise ValueError(f"not a Consul address: {url!r} (expected consul://host:8500)")
    port = parts.port or (8501 if scheme == "https" else 8500)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{scheme}://{host}:{port}"


def go_duration(seconds: float) -> str:
    """``0.8`` -> ``"800ms"``: Consul parses durations with Go's ``time.ParseDuration``."""
    return f"{max(1, round(seconds * 1000))}ms"


def check_meta(meta: Mapping[str, str]) -> None:
    """Raise ValueError unless Consul would accept `meta` as service meta (with our url key added)."""
    if len(meta) + 1 > _MAX_META:
        raise ValueError(f"Consul allows at most {_MAX_META} meta keys (one is {URL_META_KEY!r})")
    for key, value in meta.items():
        if not _META_KEY.match(key) or key.startswith("consul-") or key == URL_META_KEY:
            raise ValueError(f"meta key {key!r} is not allowed by Consul (want [A-Za-z0-9_-], no 'consul-')")
        if len(value) > 512:
            raise ValueError(f"meta value of {key!r} is longer than Consul's 512 characters")


def member_status(checks: Iterable[Mapping[str, Any]]) -> str:
    """One status from an instance's checks: critical > draining (maintenance) > warning > passing."""
    statuses = set()
    for check in checks:
        check_id = str(check.get("CheckID", ""))
        if check_id.startswith(MAINTENANCE_CHECK_PREFIXES):
            statuses.add("draining")
        else:
            statuses.add(str(check.get("Status", "critical")))
    for status in ("critical", "draining", "warning"):
        if status in statuses:
            return status
    return "passing"


def member_from_health(entry: Mapping[str, Any], prefix: str = SERVICE_PREFIX) -> Member | None:
    """A :class:`Member` from one ``/v1/health/service`` entry (None if not one of ours)."""
    svc = entry["Service"]
    name = str(svc["Service"])
    if not name.startswith(prefix):
        return None
    meta = {str(k): str(v) for k, v in (svc.get("Meta") or {}).items()}
    url = meta.pop(URL_META_KEY, None)
    if not url:
        host = svc.get("Address") or (entry.get("Node") or {}).get("Address") or "127.0.0.1"
        url = f"http://{f'[{host}]' if ':' in host else host}:{svc.get('Port') or 80}"
    return Member(id=str(svc["ID"]), service=name[len(prefix):], url=url.rstrip("/"), meta=meta,
                  status=member_status(entry.get("Checks") or ()))


def token_from_env() -> str | None:
    """The ACL token in ``CONSUL_HTTP_TOKEN`` (None when unset), as Consul's own clients read it."""
    return os.environ.get(ENV_CONSUL_TOKEN) or None


def consul_headers(token: str | None) -> dict[str, str]:
    return {TOKEN_HEADER: token} if token else {}


class ConsulMembership:
    """Watches Consul's health endpoint for each service with blocking queries; one named task per service.

    `members()` answers from memory. While Consul is unreachable (or answers with an error) the last
    list stays in force and ``reachable`` is False. With ``passing_only=False`` every instance is kept
    with its status (critical, warning, draining), as the control plane wants it; routing still sees
    only passing ones.
    """

    def __init__(
        self,
        consul_url: str,
        http: httpx.AsyncClient,
        services: Sequence[str] = ("shard", "cache"),
        wait_s: float = 5.0,
        *,
        passing_only: bool = True,
        service_prefix: str = SERVICE_PREFIX,
        token: str | None = None,
    ) -> None:
        self._base = consul_http_url(consul_url)
        self._http = http
        self._services = tuple(dict.fromkeys(services))
        self._wait_s = wait_s
        self._passing_only = passing_only
        self._prefix = service_prefix
        self._headers = consul_headers(token)
        self._lists: dict[str, tuple[Member, ...]] = {s: () for s in self._services}
        self._index: dict[str, int] = {s: 0 for s in self._services}
        self._ok: dict[str, bool] = {s: False for s in self._services}
        self._outage_logged = False
        self._last_sync = 0.0
        self._subscribers: list[Callable[[], None]] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """First sync of every service (best effort, short timeout), then one watch task each."""
        await asyncio.gather(*(self._sync(s, wait_s=None, timeout_s=2.0) for s in self._services))
        self._tasks = [asyncio.create_task(self._watch(s), name=f"consul-watch:{self._prefix}{s}")
                       for s in self._services]

    async def aclose(self) -> None:
        await stop_tasks(*self._tasks)
        self._tasks = []

    def members(self, service: str) -> list[Member]:
        return routable(self._lists.get(service, ()), service)

    def all_members(self, service: str | None = None) -> list[Member]:
        """Every known member (with passing_only=False: critical, warning and draining too), sorted by id."""
        found = (m for s in self._services if service in (None, s) for m in self._lists[s])
        return sorted(found, key=lambda m: m.id)

    @property
    def reachable(self) -> bool:
        """False while Consul cannot be reached for some watched service (or before the first sync)."""
        return all(self._ok.values())

    @property
    def last_sync(self) -> float:
        """Unix time of the last successful query; 0.0 if none yet."""
        return self._last_sync

    @property
    def index(self) -> int:
        """The highest Consul index seen across the watched services."""
        return max(self._index.values(), default=0)

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback()` (in the event loop) after each change of a member list."""
        self._subscribers.append(callback)

    async def _watch(self, service: str) -> None:
        backoff = _BACKOFF_START_S
        while True:
            before, started = self._index[service], time.monotonic()
            if await self._sync(service, wait_s=self._wait_s, timeout_s=self._wait_s * 1.1 + 5.0):
                backoff = _BACKOFF_START_S
                if self._index[service] == before and time.monotonic() - started < _MIN_REQUERY_S:
                    await asyncio.sleep(_MIN_REQUERY_S)  # Consul's advice: rate-limit queries that return early
            else:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _sync(self, service: str, *, wait_s: float | None, timeout_s: float) -> bool:
        url = f"{self._base}/v1/health/service/{quote(self._prefix + service, safe='')}"
        params: dict[str, str] = {}
        if self._passing_only:
            params["passing"] = "true"
        if wait_s is not None and self._index[service] > 0:
            params.update(index=str(self._index[service]), wait=go_duration(wait_s))
        try:
            resp = await self._http.get(url, params=params, headers=self._headers, timeout=timeout_s)
            resp.raise_for_status()
            fresh = [m for e in resp.json() if (m := member_from_health(e, self._prefix)) is not None]
            index = int(resp.headers.get(INDEX_HEADER, "0"))
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self._unreachable(service, exc)
            return False
        self._ok[service] = True
        if self._outage_logged and self.reachable:
            log.info("Consul at %s reachable again", self._base)
            self._outage_logged = False
        self._last_sync = time.time()
        # Consul's rules for blocking indexes: reset when it goes backwards, never use one below 1
        self._index[service] = 0 if index < self._index[service] else max(index, 1)
        self._apply(service, fresh)
        return True

    def _unreachable(self, service: str, exc: Exception) -> None:
        if not self._outage_logged:
            self._outage_logged = True
            known = sum(len(v) for v in self._lists.values())
            log.warning("Consul at %s unreachable (%s: %s); routing on the last %d members seen",
                        self._base, type(exc).__name__, exc, known)
        self._ok[service] = False
        self._index[service] = 0  # ask afresh next time: the agent may have restarted with new indexes

    def _apply(self, service: str, fresh: list[Member]) -> None:
        fresh = sorted((m for m in fresh if m.service == service), key=lambda m: m.id)
        changed = [routing_key(m) for m in fresh] != [routing_key(m) for m in self._lists[service]]
        self._lists[service] = tuple(fresh)
        if changed:
            for callback in list(self._subscribers):
                try:
                    callback()
                except Exception:  # a subscriber's bug must not stop the watch
                    log.exception("membership subscriber %r failed", callback)


class ConsulRegistrationAgent(HeartbeatAgent):
    """Registers one process as a Consul service with a TTL check and keeps the check passing.

    A heartbeat is ``PUT /v1/agent/check/pass/service:<id>``; when the agent no longer knows the
    check (agent wiped, or it deregistered us after ``deregister_critical_after_s`` critical) the next
    heartbeat registers again. Failures are logged once per outage and retried; nothing here raises
    because Consul is down.
    """

    backend = "Consul"

    def __init__(
        self,
        consul_url: str,
        member: Member,
        http: httpx.AsyncClient,
        ttl_s: float = 2.0,
        *,
        deregister_critical_after_s: float = 60.0,
        service_prefix: str = SERVICE_PREFIX,
        token: str | None = None,
    ) -> None:
        check_meta(member.meta)
        super().__init__(member, http, ttl_s)
        self._base = consul_http_url(consul_url)
        self._deregister_after_s = deregister_critical_after_s
        self._service_name = service_prefix + member.service
        self._check_id = f"service:{member.id}"
        self._headers = consul_headers(token)
        self._needs_register = True

    def set_meta(self, **meta: str) -> None:
        """Merge `meta` into the announced meta; the next heartbeat re-registers with it."""
        merged = {**self._meta, **{k: str(v) for k, v in meta.items()}}
        if merged != self._meta:
            check_meta(merged)
            self._meta, self._needs_register = merged, True

    async def _deregister(self) -> None:
        url = f"{self._base}/v1/agent/service/deregister/{quote(self._member.id, safe='')}"
        try:
            resp = await self._http.put(url, headers=self._headers, timeout=_DEREGISTER_TIMEOUT_S)
            if resp.status_code not in (200, 404):
                log.warning("deregistering %s: Consul answered %d", self._member.id, resp.status_code)
        except httpx.HTTPError as exc:
            log.warning("could not deregister %s from Consul (%s); its check will go critical",
                        self._member.id, type(exc).__name__)

    async def heartbeat(self) -> bool:
        """Register (first time, after a meta change, or when Consul forgot us) or pass the TTL check."""
        if self._needs_register:
            return await self._register()
        url = f"{self._base}/v1/agent/check/pass/{quote(self._check_id, safe='')}"
        try:
            resp = await self._http.put(url, headers=self._headers, timeout=self._timeout_s)
        except httpx.HTTPError as exc:
            return self._failed(f"{type(exc).__name__}: {exc}", logging.WARNING)
        if resp.status_code == 200:
            return self._ok("heartbeat accepted again")
        # 404 "Unknown check ID" (older agents: 500 "... does not have associated TTL"): re-register
        if resp.status_code == 404 or "does not have associated TTL" in resp.text:
            log.info("Consul forgot %s (%d: %s); registering again", self._member.id, resp.status_code,
                     resp.text[:200])
            return await self._register()
        return self._failed(f"Consul answered {resp.status_code}: {resp.text[:300]}", logging.WARNING)

    def _registration(self) -> dict[str, Any]:
        parts = urlsplit(self._member.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return {
            "ID": self._member.id,
            "Name": self._service_name,
            "Address": parts.hostname or "",
            "Port": port,
            "Meta": {**self._meta, URL_META_KEY: self._member.url},
            "Check": {
                "CheckID": self._check_id,
                "Name": f"{self._service_name} TTL",
                "TTL": go_duration(self._ttl_s),
                "Status": "passing",  # registering is proof of life; don't start critical
                "DeregisterCriticalServiceAfter": go_duration(self._deregister_after_s),
            },
        }

    async def _register(self) -> bool:
        url = f"{self._base}/v1/agent/service/register"
        try:
            resp = await self._http.put(url, json=self._registration(), headers=self._headers,
                                        timeout=self._timeout_s)
        except httpx.HTTPError as exc:
            return self._failed(f"{type(exc).__name__}: {exc}", logging.WARNING)
        if resp.status_code != 200:
            # a 4xx is our own misconfiguration (bad meta, ACL token): say so loudly
            level = logging.ERROR if 400 <= resp.status_code < 500 else logging.WARNING
            return self._failed(f"Consul answered {resp.status_code}: {resp.text[:300]}", level)
        self._needs_register = False
        log.info("registered %s as %s in Consul at %s (TTL %s)", self._member.id, self._service_name,
                 self._base, go_duration(self._ttl_s))
        return self._ok(None)


__all__ = [
    "ENV_CONSUL_TOKEN",
    "INDEX_HEADER",
    "SERVICE_PREFIX",
    "URL_META_KEY",
    "ConsulMembership",
    "ConsulRegistrationAgent",
    "check_meta",
    "consul_http_url",
    "go_duration",
    "member_from_health",
    "member_status",
    "token_from_env",
]
