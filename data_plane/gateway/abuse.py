"""The gateway's half of abuse handling: applies the control plane's actions, reports bad keys.

    guard = AbuseGuard(AbuseGuardMetrics(registry), ClientAddress(settings.trusted_proxies))
    await guard.connect(control_plane_url, http, headers)   # watch /v1/abuse/state, report every 2 s
    principal = guard.authenticate(keys, request, span)     # 401; 403 for a banned address's bad keys
    measures = guard.admit(principal, tier)                 # 429 blocked / throttled; else what to tighten
    max_tokens = measures.max_tokens(max_tokens)            # strict: a lower output cap
    policy = safety.get(measures.safety(tier.safety, safety.names()))   # strict: the strict input filter
    await guard.aclose()

The actions (control_plane/abuse/: rules, thresholds, the ladder) arrive by a blocking query, so a
new one is in force here within about a second of the monitor's decision; each carries its expiry
and is dropped at it even if the control plane is unreachable. Without a control plane the guard
allows everything and still counts failures. Answers: a blocked key 429 ``abuse_blocked`` and a
throttled one past its ``throttle_rpm`` 429 ``abuse_throttled``, both with Retry-After and a message
saying why and what to do; a banned address's requests without a valid key 403 ``address_banned``
with Retry-After (its valid keys are served: whoever shares an address keeps the service). Authentication
failures are counted per source address here (bounded) and posted to the control plane; the
address is the TCP peer's, or X-Forwarded-For's when the peer is one of ``--trusted-proxies``
(data_plane/gateway/client_address.py). The metrics carry reasons only, never a key or an address.
Nothing here reads a prompt.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from data_plane.common.errors import AuthenticationError, PermissionDenied, RateLimited
from data_plane.common.tasks import stop_tasks
from data_plane.gateway.client_address import FORWARDED_FOR, ClientAddress, Source
from data_plane.membership.embedded import BlockingWatcher

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 2.0
"""Seconds between the gateway's reports of authentication failures."""
MAX_ADDRESSES = 4096
"""Addresses counted between two reports (the rest are dropped, and counted as dropped)."""
STRICT_POLICY = "strict"
"""The safety policy strict checks switch to (data_plane/gateway/safety/pipeline.py), else ``default``."""


class Response(enum.Enum):
    """What the control plane asks of the gateway (control_plane/abuse/model.py Response)."""

    STRICT = "strict"
    THROTTLE = "throttle"
    BLOCK = "block"
    BAN = "ban"


class Outcome(enum.Enum):
    """Why the guard answered a request itself (the metric's label)."""

    BANNED = "banned"
    BLOCKED = "blocked"
    THROTTLED = "throttled"


class _Keys(Protocol):
    def authenticate(self, authorization: str | None) -> Any: ...


class _Request(Protocol):
    @property
    def headers(self) -> Any: ...

    @property
    def client(self) -> Any: ...


@dataclass(frozen=True)
class Measures:
    """What stricter checks mean for one request (nothing, unless the key is under STRICT)."""

    strict: bool = False
    max_output_tokens: int = 0

    def max_tokens(self, requested: int) -> int:
        return min(requested, self.max_output_tokens) if self.strict and self.max_output_tokens else requested

    def safety(self, policy: str, known: Iterable[str]) -> str:
        if not self.strict:
            return policy
        names = set(known)
        return STRICT_POLICY if STRICT_POLICY in names else ("default" if "default" in names else policy)


NONE = Measures()


@dataclass(frozen=True)
class _InForce:
    response: Response
    expires_at: float
    reason: str


class AbuseGuardMetrics:
    """``switchboard_gateway_auth_failures_total{reason}``, ``switchboard_gateway_abuse_rejections_total{outcome}``,
    ``switchboard_gateway_abuse_actions{response}``: reasons only, never a key or an address."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.auth_failures = Counter("switchboard_gateway_auth_failures", "Failed authentications by reason "
                                     "(missing|invalid).", ["reason"], registry=registry)
        self.rejections = Counter("switchboard_gateway_abuse_rejections", "Requests the abuse guard answered "
                                  "itself (banned|blocked|throttled).", ["outcome"], registry=registry)
        self.actions = Gauge("switchboard_gateway_abuse_actions", "Abuse actions in force here, by response.",
                             ["response"], registry=registry)
        self.addresses = Counter("switchboard_gateway_client_address", "Where authenticated requests' client "
                                 "address came from (peer|forwarded|untrusted|invalid: data_plane/gateway/"
                                 "client_address.py).", ["source"], registry=registry)
        self.dropped = Counter("switchboard_gateway_auth_failure_addresses_dropped",
                               "Addresses not counted because the report was full.", registry=registry)
        for reason in ("missing", "invalid"):
            self.auth_failures.labels(reason)
        for outcome in Outcome:
            self.rejections.labels(outcome.value)
        for source in Source:
            self.addresses.labels(source.value)
        for response in Response:
            self.actions.labels(response.value)


class AbuseGuard:
    """See the module docstring. `clock` is wall time (the actions' expiries are unix seconds)."""

    def __init__(self, metrics: AbuseGuardMetrics, addresses: ClientAddress | None = None,
                 clock: Any = time.time) -> None:
        self._metrics = metrics
        self._resolve = addresses or ClientAddress([])
        self._clock = clock
        self._keys: dict[str, _InForce] = {}
        self._addresses: dict[str, _InForce] = {}
        self._throttle_rpm = 6
        self._strict_cap = 256
        self._recent: dict[str, collections.deque[float]] = {}
        self._failures: collections.Counter[str] = collections.Counter()
        self._watch: _AbuseStateWatch | None = None
        self._reporter: asyncio.Task[None] | None = None

    # -- wiring ---------------------------------------------------------------------------------

    async def connect(self, url: str, http: httpx.AsyncClient, headers: dict[str, str]) -> None:
        self._watch = _AbuseStateWatch(url, http, headers, self)
        await self._watch.start()
        self._reporter = asyncio.create_task(self._report_loop(url.rstrip("/") + "/v1/abuse/reports", http, headers),
                                             name="abuse-reports")

    async def aclose(self) -> None:
        await stop_tasks(self._reporter)
        if self._watch is not None:
            await self._watch.aclose()

    def apply(self, body: dict[str, Any]) -> None:
        """Put the control plane's actions in force (replacing the previous set)."""
        keys: dict[str, _InForce] = {}
        addresses: dict[str, _InForce] = {}
        for a in body.get("actions", []):
            try:
                response = Response(a["response"])
                entry = _InForce(response, float(a["expires_at"]), str(a.get("reason", "")))
            except (KeyError, ValueError, TypeError):
                continue  # a response this gateway does not know (yet): flag-like, nothing to do
            table = {"address": addresses, "key": keys}.get(str(a.get("subject_kind")))
            if table is None:
                continue  # a tenant's action is a flag for review: nothing to apply here
            held = table.get(str(a["subject"]))
            if held is None or _RANK[response] > _RANK[held.response]:
                table[str(a["subject"])] = entry
        self._keys, self._addresses = keys, addresses
        # the throttle's per-key request times: only for keys still throttled (it grew with every key ever throttled)
        self._recent = {k: v for k, v in self._recent.items() if k in keys and keys[k].response is Response.THROTTLE}
        self._throttle_rpm = max(1, int(body.get("throttle_rpm") or self._throttle_rpm))
        self._strict_cap = max(1, int(body.get("strict_max_output_tokens") or self._strict_cap))
        for response in Response:
            self._metrics.actions.labels(response.value).set(
                sum(1 for e in (*keys.values(), *addresses.values()) if e.response is response))

    # -- the request path -----------------------------------------------------------------------

    def client_address(self, request: _Request) -> tuple[str, Source]:
        """The request's client address (behind trusted proxies) and where it came from."""
        peer = request.client.host if request.client is not None else ""
        return self._resolve.of(peer, request.headers.getlist(FORWARDED_FOR))

    def authenticate(self, keys: _Keys, request: _Request, span: Any = None) -> Any:
        """The principal of `request`; every 401 counted against the request's client address, and
        403 for a banned address's requests without a valid key. A valid key is served from a banned
        address: the ban answers guessing, and whoever shares the address (a NAT, a proxy the gateway
        does not trust, every client of `switchboard up` on loopback) must not lose the service to ten
        bad keys sent by someone holding none."""
        address, source = self.client_address(request)
        self._metrics.addresses.labels(source.value).inc()
        if span is not None:
            span.set_attribute("switchboard.client_address.source", source.value)
        header = request.headers.get("authorization")
        try:
            return keys.authenticate(header)
        except AuthenticationError:
            self._metrics.auth_failures.labels("missing" if not header else "invalid").inc()
            if address:  # counted during a ban too: an address that keeps guessing stays banned
                if address in self._failures or len(self._failures) < MAX_ADDRESSES:
                    self._failures[address] += 1
                else:
                    self._metrics.dropped.inc()
            ban = self._in_force(self._addresses, address)
            if ban is not None:
                self._metrics.rejections.labels(Outcome.BANNED.value).inc()
                raise PermissionDenied(
                    f"requests without a valid API key from this address are refused for a while after repeated "
                    f"invalid API keys ({ban.reason}) until the time in Retry-After has passed (an operator can "
                    "lift the ban on the console's Abuse page)", code="address_banned",
                    retry_after=self._retry_after(ban)) from None
            raise

    def caller(self, keys: _Keys, request: _Request) -> Any:
        """`authenticate`, then `admit`: the principal of a request to any route other than a
        generation's (models, usage, stored responses, conversations), so a blocked key is refused
        there too and a throttled one counts those requests toward its rate."""
        principal = self.authenticate(keys, request)
        self.admit(principal)
        return principal

    def admit(self, principal: Any) -> Measures:
        """429 for a blocked key, or a throttled one past its rate; else the measures for it."""
        held = self._in_force(self._keys, principal.key_id)
        if held is None:
            return NONE
        if held.response is Response.BLOCK:
            self._metrics.rejections.labels(Outcome.BLOCKED.value).inc()
            raise RateLimited(
                f"this API key is temporarily blocked after unusual activity ({held.reason}); retry after the "
                "time in Retry-After, or ask the platform's operators to review it", code="abuse_blocked",
                retry_after=self._retry_after(held))
        if held.response is Response.THROTTLE:
            self._throttle(principal.key_id)
        return Measures(strict=True, max_output_tokens=self._strict_cap)

    def _throttle(self, key_id: str) -> None:
        now = self._clock()
        window = self._recent.setdefault(key_id, collections.deque())
        while window and window[0] <= now - 60.0:
            window.popleft()
        if len(window) >= self._throttle_rpm:
            self._metrics.rejections.labels(Outcome.THROTTLED.value).inc()
            raise RateLimited(
                f"this API key is limited to {self._throttle_rpm} requests per minute for a while after unusual "
                "activity; retry after the time in Retry-After", code="abuse_throttled",
                retry_after=max(1.0, window[0] + 60.0 - now))
        window.append(now)

    def _in_force(self, table: dict[str, _InForce], subject: str) -> _InForce | None:
        held = table.get(subject)
        if held is not None and held.expires_at <= self._clock():
            table.pop(subject, None)  # expired here even if the control plane is out of reach
            return None
        return held

    def _retry_after(self, held: _InForce) -> float:
        return max(1.0, math.ceil(held.expires_at - self._clock()))

    # -- reports --------------------------------------------------------------------------------

    def take_failures(self) -> dict[str, int]:
        """The failures counted since the last call (and forget them)."""
        out, self._failures = dict(self._failures), collections.Counter()
        return out

    async def _report_loop(self, url: str, http: httpx.AsyncClient, headers: dict[str, str]) -> None:
        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            counts = self.take_failures()
            if not counts:
                continue
            with contextlib.suppress(httpx.HTTPError):  # best effort: the next report carries on
                await http.post(url, json={"auth_failures": counts}, headers=headers, timeout=2.0)


_RANK = {Response.STRICT: 0, Response.THROTTLE: 1, Response.BLOCK: 2, Response.BAN: 3}


class _AbuseStateWatch(BlockingWatcher):
    """``GET /v1/abuse/state`` by blocking queries; each answer replaces the guard's actions."""

    what = "control plane (abuse state)"

    def __init__(self, url: str, http: httpx.AsyncClient, headers: dict[str, str], guard: AbuseGuard) -> None:
        super().__init__(url.rstrip("/") + "/v1/abuse/state", http, 5.0, "abuse-state-watch")
        self._headers = headers
        self._guard = guard
        self._index = 0
        self._instance = ""

    async def _sync(self, *, wait_s: float, timeout_s: float) -> bool:
        try:
            resp = await self._http.get(self._url, params={"index": self._index if self._reachable else 0,
                                                           "wait": wait_s}, headers=self._headers, timeout=timeout_s)
            resp.raise_for_status()
            body = resp.json()
            index = int(body["index"])
            instance = str(body.get("instance_id", ""))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self._unreachable(exc, "keeping the abuse actions in force until they expire")
            return False
        self._synced(index)
        if (instance, index) != (self._instance, self._index):  # a restarted control plane counts afresh
            self._index, self._instance = index, instance
            self._guard.apply(body)
            self._notify()
        return True


__all__ = ["MAX_ADDRESSES", "NONE", "REPORT_INTERVAL_S", "AbuseGuard", "AbuseGuardMetrics", "Measures", "Outcome",
           "Response"]
