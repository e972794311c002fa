"""The embedded registry's client side: watching it (HttpMembership) and registering in it (RegistrationAgent).

    view = HttpMembership("http://127.0.0.1:8300", http)     # watches the embedded registry
    await view.start()                          # never raises; keeps the last list if unreachable
    view.subscribe(router.on_membership_change)
    ...
    await view.aclose()

    agent = RegistrationAgent("http://127.0.0.1:8300", Member(...), http, ttl_s=2.0)
    await agent.start()                         # registers, then heartbeats every ttl_s / 3
    agent.set_meta(load="3")                    # goes out with the next heartbeat
    await agent.aclose()                        # deregisters (best effort)

Built by data_plane/membership/factory.py for every process that joins a cluster without Consul
(gateway, shard, cache node). :class:`BlockingWatcher` (long-polling one endpoint) is also the base
of the gateway's cluster-state watch (data_plane/gateway/cluster_state.py); :class:`HeartbeatAgent`
(the heartbeat loop) also the base of the Consul agent (data_plane/membership/consul.py).

The control plane hosts the registry these clients talk to (``control_plane/registry/embedded.py``),
over HTTP only, so this module never imports the control plane. The wire protocol:
``PUT/DELETE /v1/registry/members/{id}`` and the blocking query
``GET /v1/registry/members?index=N&wait=S``, which answers once the registry's index differs from N
or after S seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import httpx

from data_plane.common.hop_auth import CLUSTER_TOKEN_ENV
from data_plane.common.tasks import stop_tasks
from data_plane.membership.view import Member, routable, routing_key

log = logging.getLogger(__name__)

_BACKOFF_START_S = 0.1
_BACKOFF_MAX_S = 1.0
_DEREGISTER_TIMEOUT_S = 1.0


class BlockingWatcher:
    """A view kept fresh by long-polling one HTTP endpoint ("blocking queries").

    Owns one named watch task: `start` does a first sync (best effort, short timeout) and starts
    it; `aclose` stops it. While the endpoint is unreachable the last view stays in force
    (``reachable`` is False), the outage is logged once, and the poll backs off up to 1 s.
    Subclasses implement :meth:`_sync` and call :meth:`_synced` / :meth:`_unreachable` /
    :meth:`_notify` from it.
    """

    what = "endpoint"
    """Named in log lines ("membership registry", "control plane")."""

    def __init__(self, url: str, http: httpx.AsyncClient, wait_s: float, task_name: str) -> None:
        self._url = url
        self._http = http
        self._wait_s = wait_s
        self._task_name = task_name
        self._reachable = False
        self._outage_logged = False
        self._last_sync = 0.0
        self._subscribers: list[Callable[[], None]] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """First sync (best effort, short timeout), then the watch task."""
        await self._sync(wait_s=0.0, timeout_s=2.0)
        self._task = asyncio.create_task(self._watch(), name=self._task_name)

    async def aclose(self) -> None:
        await stop_tasks(self._task)
        self._task = None

    @property
    def reachable(self) -> bool:
        """False while the endpoint cannot be reached (or before the first sync)."""
        return self._reachable

    @property
    def last_sync(self) -> float:
        """Unix time of the last successful sync; 0.0 if none yet."""
        return self._last_sync

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback()` (in the event loop) after each change of the view."""
        self._subscribers.append(callback)

    async def _sync(self, *, wait_s: float, timeout_s: float) -> bool:
        """One (blocking) query; True when it answered. Never raises for a network failure."""
        raise NotImplementedError

    async def _watch(self) -> None:
        backoff = _BACKOFF_START_S
        while True:
            if await self._sync(wait_s=self._wait_s, timeout_s=self._wait_s + 5.0):
                backoff = _BACKOFF_START_S
            else:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)

    def _synced(self, index: int) -> None:
        if self._outage_logged:
            log.info("%s at %s reachable again (index %d)", self.what, self._url, index)
        self._reachable, self._outage_logged = True, False
        self._last_sync = time.time()

    def _unreachable(self, exc: Exception, keeping: str) -> None:
        if not self._outage_logged:
            self._outage_logged = True
            log.warning("%s at %s unreachable (%s: %s); %s", self.what, self._url, type(exc).__name__, exc, keeping)
        self._reachable = False

    def _notify(self) -> None:
        for callback in list(self._subscribers):
            try:
                callback()
            except Exception:  # a subscriber's bug must not stop the watch
                log.exception("%s subscriber %r failed", self.what, callback)


class HttpMembership(BlockingWatcher):
    """Watches the embedded registry with blocking queries; one named task per instance.

    `members()` answers from the last list seen. While the registry is unreachable that list
    stays in force (``reachable`` is False); right after a registry restart, while it reports
    ``warming_up``, members it has not heard from again yet are kept too, so a restarted
    registry does not empty the routing table before every member's next heartbeat.
    """

    what = "membership registry"

    def __init__(
        self,
        registry_url: str,
        http: httpx.AsyncClient,
        services: Sequence[str] = ("shard", "cache"),
        wait_s: float = 5.0,
    ) -> None:
        super().__init__(registry_url.rstrip("/") + "/v1/registry/members", http, wait_s, "membership-watch")
        self._services = frozenset(services)
        self._all: tuple[Member, ...] = ()
        self._index = 0

    def members(self, service: str) -> list[Member]:
        return routable(self._all, service)

    def all_members(self, service: str | None = None) -> list[Member]:
        """Every known member (critical and draining too), sorted by id."""
        return sorted((m for m in self._all if service is None or m.service == service), key=lambda m: m.id)

    async def _sync(self, *, wait_s: float, timeout_s: float) -> bool:
        params = {"index": self._index, "wait": wait_s}
        try:
            resp = await self._http.get(self._url, params=params, timeout=timeout_s)
            resp.raise_for_status()
            body = resp.json()
            index = int(body["index"])
            fresh = [Member.from_dict(d) for d in body["members"]]
            warming_up = bool(body.get("warming_up", False))
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self._unreachable(exc, f"routing on the last {len(self._all)} members seen")
            self._index = 0  # ask afresh next time: the registry may have restarted with a new index
            return False
        self._synced(index)
        self._index = index
        self._apply([m for m in fresh if m.service in self._services], warming_up)
        return True

    def _apply(self, fresh: list[Member], warming_up: bool) -> None:
        if warming_up:
            known = {m.id for m in fresh}
            fresh += [m for m in self._all if m.id not in known]
        fresh.sort(key=lambda m: m.id)
        changed = [routing_key(m) for m in fresh] != [routing_key(m) for m in self._all]
        self._all = tuple(fresh)
        if changed:
            self._notify()


class HeartbeatAgent:
    """What every registration backend shares: the announced member, the heartbeat loop (every
    ``ttl_s / 3``, skipping beats it fell behind on), one log line per outage, and
    deregistration on close. Backends implement :meth:`heartbeat` and :meth:`_deregister`."""

    backend = "registry"

    def __init__(self, member: Member, http: httpx.AsyncClient, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self._member = member
        self._meta = dict(member.meta)
        self._http = http
        self._ttl_s = ttl_s
        self._interval_s = ttl_s / 3
        self._timeout_s = max(self._interval_s, 0.25)
        self._registered = False
        self._failing = False
        self._task: asyncio.Task[None] | None = None
        self._leaving: asyncio.Task[None] | None = None

    @property
    def member(self) -> Member:
        """The member as it is announced (current meta)."""
        return replace(self._member, meta=dict(self._meta))

    @property
    def registered(self) -> bool:
        """True when the last heartbeat was accepted."""
        return self._registered

    def set_meta(self, **meta: str) -> None:
        """Merge `meta` into the announced meta; it goes out with the next heartbeat."""
        self._meta.update({k: str(v) for k, v in meta.items()})

    async def heartbeat(self) -> bool:
        """Send one register/heartbeat now; True when it was accepted."""
        raise NotImplementedError

    async def _deregister(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        self._leaving = None
        await self.heartbeat()
        self._task = asyncio.create_task(self._run(), name=f"{self.backend}-registration:{self._member.id}")

    def leave_now(self) -> None:
        """Begin `aclose` without waiting (a SIGTERM hook: out of routing while the grace finishes the
        running requests); a later `aclose` waits for it instead of deregistering twice."""
        if self._leaving is None:
            self._leaving = asyncio.get_running_loop().create_task(self._leave(), name=f"leave:{self._member.id}")

    async def aclose(self) -> None:
        """Stop heartbeating and deregister (best effort, short timeout)."""
        self.leave_now()
        if self._leaving is not None:
            await asyncio.shield(self._leaving)

    async def _leave(self) -> None:
        if self._task is None:
            return
        await stop_tasks(self._task)
        self._task = None
        await self._deregister()
        self._registered = False

    def _ok(self, again: str | None = None) -> bool:
        if self._failing and again:
            log.info("%s: %s for %s", self.backend, again, self._member.id)
        self._registered, self._failing = True, False
        return True

    def _failed(self, why: str, level: int) -> bool:
        if not self._failing:
            log.log(level, "registering %s in the %s failed (%s); retrying every %.2fs",
                    self._member.id, self.backend, why, self._interval_s)
        self._registered, self._failing = False, True
        return False

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self._interval_s
            now = loop.time()
            next_at = max(next_at, now)  # fell behind (slow registry): skip missed beats
            await asyncio.sleep(next_at - now)
            await self.heartbeat()


class RegistrationAgent(HeartbeatAgent):
    """Registers one process in the embedded registry and keeps it alive with heartbeats.

    A heartbeat is the same idempotent ``PUT`` as registration, so a registry that forgot the
    member (restart, expiry) learns it again from the next heartbeat. Failures are logged once
    per outage and retried; nothing here raises because the registry is down.
    """

    def __init__(
        self, registry_url: str, member: Member, http: httpx.AsyncClient, ttl_s: float = 2.0,
        token: str | None = None,
    ) -> None:
        super().__init__(member, http, ttl_s)
        self._url = f"{registry_url.rstrip('/')}/v1/registry/members/{member.id}"
        self._headers = {"authorization": f"Bearer {token}"} if token else {}

    async def _deregister(self) -> None:
        try:
            resp = await self._http.delete(self._url, headers=self._headers, timeout=_DEREGISTER_TIMEOUT_S)
            if resp.status_code not in (200, 404):
                log.warning("deregistering %s: registry answered %d", self._member.id, resp.status_code)
        except httpx.HTTPError as exc:
            log.warning("could not deregister %s (%s); it will expire", self._member.id, type(exc).__name__)

    async def heartbeat(self) -> bool:
        """Send one register/heartbeat now; True when the registry accepted it."""
        body = {
            "service": self._member.service,
            "url": self._member.url,
            "meta": dict(self._meta),
            "ttl_s": self._ttl_s,
        }
        try:
            resp = await self._http.put(self._url, json=body, headers=self._headers, timeout=self._timeout_s)
        except httpx.HTTPError as exc:
            return self._failed(f"{type(exc).__name__}: {exc}", logging.WARNING)
        if resp.status_code != 200:
            # a 4xx is our own misconfiguration (bad service name, url): say so loudly
            level = logging.ERROR if 400 <= resp.status_code < 500 else logging.WARNING
            hint = f" (set {CLUSTER_TOKEN_ENV} to the control plane's)" if resp.status_code == 401 else ""
            return self._failed(f"registry answered {resp.status_code}: {resp.text[:300]}{hint}", level)
        if resp.headers.get("X-Registry-Created") == "true" or self._failing:
            log.info("registered %s (%s) at %s", self._member.id, self._member.service, self._url)
        return self._ok()


__all__ = ["BlockingWatcher", "HeartbeatAgent", "HttpMembership", "RegistrationAgent"]
