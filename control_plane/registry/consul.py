"""The control plane on Consul: every member with its health, and desired state / policies in KV.

Built by the control plane (control_plane/app.py) with ``--membership consul://...``, in place of the
embedded registry.

    members = ConsulMembers("consul://127.0.0.1:8500")           # owns an httpx client unless given one
    await members.start()                                         # watches switchboard-{shard,cache,gateway}
    index, listed = members.snapshot()                            # same dicts as the embedded Registry's
    await members.maintenance("shard-0", True)                    # drain: Consul maintenance mode
    await members.aclose()

    kv = ConsulKV("consul://127.0.0.1:8500", http)                # keys live under ``switchboard/``
    await kv.put_json("desired/shards", {"replicas": 3})
    entry = await kv.get("desired/shards")                        # KVEntry | None
    entry.json()                                                  # {"replicas": 3}
    await kv.put_json("desired/shards", {"replicas": 4}, cas=entry.modify_index)  # False if someone wrote first
    index, entry = await kv.watch("desired/shards", index, wait_s=30)    # blocks until it changes
    await kv.list("desired/")                                     # {"desired/shards": KVEntry, ...}

Only the embedded backend is hosted here; with Consul the control plane is a client like any other.
Both classes speak Consul's HTTP API with httpx (no blocking calls in the event loop). Errors talking
to Consul surface as :class:`data_plane.common.errors.UpstreamError` (502, code ``consul_unavailable``),
mapped once in :func:`_request`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from data_plane.common.errors import NotFound, UpstreamError
from data_plane.membership.consul import (
    INDEX_HEADER,
    SERVICE_PREFIX,
    ConsulMembership,
    consul_headers,
    consul_http_url,
    go_duration,
)
from data_plane.membership.view import Member

log = logging.getLogger(__name__)

CONSUL_URL_PATTERN = r"^consul(\+https?)?://[^/\s]+/?$"
"""What the control plane's ``--membership`` takes: ``consul://host:8500`` (no flag: embedded registry)."""
KV_PREFIX = "switchboard/"
"""Every key Switchboard writes in Consul KV lives under this prefix."""
DEFAULT_SERVICES = ("shard", "cache", "gateway")
_TIMEOUT_S = 5.0


async def _request(
    http: httpx.AsyncClient, method: str, url: str, *, ok: Sequence[int] = (200,), **kwargs: Any
) -> httpx.Response:
    """One call to Consul; transport errors and unexpected statuses become UpstreamError."""
    kwargs.setdefault("timeout", _TIMEOUT_S)
    try:
        resp = await http.request(method, url, **kwargs)
    except httpx.HTTPError as exc:
        raise UpstreamError(f"Consul unreachable ({type(exc).__name__}: {exc})", code="consul_unavailable") from exc
    if resp.status_code not in ok:
        raise UpstreamError(f"Consul answered {resp.status_code} to {method} {url}: {resp.text[:300]}",
                            code="consul_unavailable")
    return resp


def _member_dict(member: Member) -> dict[str, Any]:
    """The embedded Registry's member shape. Consul's health API tells neither the last heartbeat nor
    a TTL check's TTL, so both read 0.0 (unknown)."""
    return {
        "id": member.id,
        "service": member.service,
        "url": member.url,
        "meta": dict(member.meta),
        "zone": member.zone,
        "status": member.status,
        "last_heartbeat": 0.0,
        "ttl_s": 0.0,
        "draining": member.status == "draining",
    }


class ConsulMembers:
    """Every Switchboard member in Consul, whatever its health, for the admin API.

    `snapshot()` and `warming_up` answer from memory, like the embedded Registry's, so the admin
    API serves either; `set_draining` puts a service in (or out of) Consul maintenance mode, which
    takes it out of ``?passing`` health queries and so out of routing.
    """

    def __init__(
        self,
        consul_url: str,
        services: Sequence[str] = DEFAULT_SERVICES,
        http: httpx.AsyncClient | None = None,
        *,
        wait_s: float = 5.0,
        service_prefix: str = SERVICE_PREFIX,
        token: str | None = None,
    ) -> None:
        self._base = consul_http_url(consul_url)
        self._consul_url = consul_url
        self._own_http = http is None
        self._http = http or httpx.AsyncClient(timeout=_TIMEOUT_S)
        self._headers = consul_headers(token)
        self._view = ConsulMembership(consul_url, self._http, services, wait_s, passing_only=False,
                                      service_prefix=service_prefix, token=token)
        self._pending: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self._view.start()

    async def aclose(self) -> None:
        await self._view.aclose()
        for task in list(self._pending):  # let a drain in flight reach Consul
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, _TIMEOUT_S)
        if self._own_http:
            await self._http.aclose()

    @property
    def reachable(self) -> bool:
        return self._view.reachable

    @property
    def warming_up(self) -> bool:
        """True until every service has been read from Consul once."""
        return self._view.last_sync == 0.0 or not self._view.reachable

    def members(self, service: str | None = None) -> list[Member]:
        """Every known member (any status), sorted by id."""
        return self._view.all_members(service)

    def snapshot(self, service: str | None = None) -> tuple[int, list[dict[str, Any]]]:
        return self._view.index, [_member_dict(m) for m in self._view.all_members(service)]

    def set_draining(self, member_id: str, draining: bool) -> dict[str, Any]:
        """The embedded Registry's call, for the admin API: checks the member, then puts it in (out of)
        maintenance in the background and returns it as it will be; the watch confirms it shortly.
        Callers that can await should use :meth:`maintenance`, which reports Consul's answer."""
        member = self._member(member_id)
        if not self._view.reachable:
            raise UpstreamError(f"Consul at {self._base} is unreachable", code="consul_unavailable")
        task = asyncio.create_task(self._maintenance_logged(member_id, draining), name=f"consul-maint:{member_id}")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return self._as_drained(member, draining)

    async def maintenance(self, member_id: str, enable: bool, reason: str = "drained by the control plane") -> dict[str, Any]:
        """Enable/disable Consul maintenance mode for `member_id` on the configured agent.

        Maintenance is an agent-local call: it works for services registered with this agent;
        for others run ``consul maint -enable -service=<id>`` on the member's host (NotFound says so).
        """
        member = self._member(member_id)
        url = f"{self._base}/v1/agent/service/maintenance/{quote(member_id, safe='')}"
        params = {"enable": "true" if enable else "false", "reason": reason}
        resp = await _request(self._http, "PUT", url, ok=(200, 404), params=params, headers=self._headers)
        if resp.status_code == 404:
            raise NotFound(f"member {member_id!r} is not registered with the Consul agent at {self._base}; "
                           f"run `consul maint -enable -service={member_id}` on its host", param="id")
        log.info("member %s (%s) %s via Consul maintenance mode", member_id, member.service,
                 "drained" if enable else "undrained")
        return self._as_drained(member, enable)

    async def _maintenance_logged(self, member_id: str, enable: bool) -> None:
        try:
            await self.maintenance(member_id, enable)
        except (NotFound, UpstreamError) as exc:
            log.error("could not %s %s: %s", "drain" if enable else "undrain", member_id, exc)

    def _member(self, member_id: str) -> Member:
        member = next((m for m in self._view.all_members() if m.id == member_id), None)
        if member is None:
            raise NotFound(f"no member {member_id!r} in Consul", param="id")
        return member

    @staticmethod
    def _as_drained(member: Member, draining: bool) -> dict[str, Any]:
        status = "draining" if draining else ("passing" if member.status == "draining" else member.status)
        return _member_dict(Member(member.id, member.service, member.url, member.meta, status))


@dataclass(frozen=True)
class KVEntry:
    """One key as Consul stores it (key without the Switchboard prefix)."""

    key: str
    value: bytes
    modify_index: int
    """Pass it as ``cas=`` to write only if nobody wrote since."""
    flags: int = 0

    def text(self) -> str:
        return self.value.decode()

    def json(self) -> Any:
        return json.loads(self.value)


class ConsulKV:
    """Consul KV under :data:`KV_PREFIX`: desired state (replicas per host) and policies (tiers)."""

    def __init__(
        self, consul_url: str, http: httpx.AsyncClient, *, prefix: str = KV_PREFIX, token: str | None = None
    ) -> None:
        if prefix and not prefix.endswith("/"):
            raise ValueError("prefix must end with '/'")
        self._base = consul_http_url(consul_url)
        self._http = http
        self._prefix = prefix
        self._headers = consul_headers(token)

    def _url(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"bad key {key!r}")
        return f"{self._base}/v1/kv/{quote(self._prefix + key, safe='/')}"

    def _entry(self, raw: dict[str, Any]) -> KVEntry:
        value = base64.b64decode(raw["Value"]) if raw.get("Value") else b""
        return KVEntry(str(raw["Key"])[len(self._prefix):], value, int(raw["ModifyIndex"]), int(raw.get("Flags", 0)))

    async def get(self, key: str) -> KVEntry | None:
        """The entry at `key`, or None when there is none."""
        return (await self._get(key, {}))[1]

    async def watch(self, key: str, index: int = 0, wait_s: float = 30.0) -> tuple[int, KVEntry | None]:
        """Blocking read: (index, entry) once `key` changes past `index`, or after about `wait_s`.

        Start with ``index=0`` (answers at once) and pass the returned index back in; an index that
        went backwards (Consul restored from a snapshot) is reset to 0, as Consul advises.
        """
        params = {"index": str(index), "wait": go_duration(wait_s)} if index > 0 else {}
        new_index, entry = await self._get(key, params, timeout=wait_s * 1.1 + 5.0)
        return (0 if new_index < index else max(new_index, 1)), entry

    async def _get(self, key: str, params: dict[str, str], timeout: float = _TIMEOUT_S) -> tuple[int, KVEntry | None]:
        resp = await _request(self._http, "GET", self._url(key), ok=(200, 404), params=params,
                              headers=self._headers, timeout=timeout)
        index = int(resp.headers.get(INDEX_HEADER, "0"))
        if resp.status_code == 404:
            return index, None
        return index, self._entry(resp.json()[0])

    async def list(self, prefix: str = "") -> dict[str, KVEntry]:
        """Every entry whose key starts with `prefix`, by key."""
        resp = await _request(self._http, "GET", self._url(prefix), ok=(200, 404), params={"recurse": "true"},
                              headers=self._headers)
        if resp.status_code == 404:
            return {}
        return {e.key: e for e in (self._entry(raw) for raw in resp.json())}

    async def put(self, key: str, value: bytes | str, *, cas: int | None = None, flags: int = 0) -> bool:
        """Store `value` at `key`; with `cas`, only if its modify index still equals `cas` (0: only if absent)."""
        params = {"flags": str(flags)} if flags else {}
        if cas is not None:
            params["cas"] = str(cas)
        data = value.encode() if isinstance(value, str) else value
        resp = await _request(self._http, "PUT", self._url(key), params=params, content=data, headers=self._headers)
        return bool(resp.json())

    async def put_json(self, key: str, value: Any, *, cas: int | None = None) -> bool:
        return await self.put(key, json.dumps(value, separators=(",", ":"), sort_keys=True), cas=cas)

    async def delete(self, key: str, *, recurse: bool = False) -> bool:
        params = {"recurse": "true"} if recurse else {}
        resp = await _request(self._http, "DELETE", self._url(key), params=params, headers=self._headers)
        return bool(resp.json())


__all__ = ["DEFAULT_SERVICES", "KV_PREFIX", "ConsulKV", "ConsulMembers", "KVEntry"]
