"""Pick the membership backend from a URL: the embedded registry or Consul.

    view, new_agent = membership_from_url("consul://127.0.0.1:8500", http, services=("shard", "cache"))
    await view.start()                              # watch shards and cache nodes
    agent = new_agent(Member("shard-0", "shard", "http://127.0.0.1:8101"), 0.8)
    await agent.start()                             # register with a 0.8 s TTL check
    ...
    await agent.aclose(); await view.aclose()

    membership_from_url("http://127.0.0.1:8300", http)  # the control plane's embedded registry

Nothing talks to the network until ``start()``. A process that only registers (a shard) ignores the
view; one that only watches never calls ``new_agent``. The Consul backend sends the ACL token in
``CONSUL_HTTP_TOKEN`` when that variable is set, as Consul's own clients do.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Protocol
from urllib.parse import urlsplit

import httpx

from data_plane.common.hop_auth import CLUSTER_TOKEN_ENV
from data_plane.membership.consul import ConsulMembership, ConsulRegistrationAgent, token_from_env
from data_plane.membership.embedded import HttpMembership, RegistrationAgent
from data_plane.membership.view import Member, MembershipView

MEMBERSHIP_URL_PATTERN = r"^(https?|consul|consul\+https?)://[^/\s]+/?$"
"""What a ``--membership`` flag accepts: ``consul://host:8500`` or the embedded ``http://host:8300``."""


class WatchedMembership(MembershipView, Protocol):
    """A :class:`MembershipView` that watches a registry: started and closed by its owner's lifespan."""

    async def start(self) -> None:
        """First sync (best effort), then the watch; never raises because the registry is down."""
        ...

    async def aclose(self) -> None: ...

    @property
    def reachable(self) -> bool:
        """False while the registry cannot be reached (routing goes on with the last list)."""
        ...

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback()` in the event loop after each change of the view."""
        ...


class Registrar(Protocol):
    """Keeps one process registered: ``start`` in the lifespan, ``aclose`` (deregister) on shutdown."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def leave_now(self) -> None:
        """Begin deregistering without waiting (a SIGTERM hook); `aclose` then waits for it."""

    def set_meta(self, **meta: str) -> None: ...

    @property
    def registered(self) -> bool: ...


AgentFactory = Callable[[Member, float], Registrar]
"""``new_agent(member, ttl_s)`` -> a not-yet-started :class:`Registrar`."""
Backend = Callable[[str, httpx.AsyncClient, Sequence[str]], tuple[WatchedMembership, AgentFactory]]


def _embedded(url: str, http: httpx.AsyncClient, services: Sequence[str]) -> tuple[WatchedMembership, AgentFactory]:
    token = os.environ.get(CLUSTER_TOKEN_ENV) or None

    def new_agent(member: Member, ttl_s: float) -> Registrar:
        return RegistrationAgent(url, member, http, ttl_s=ttl_s, token=token)

    return HttpMembership(url, http, services=services), new_agent


def _consul(url: str, http: httpx.AsyncClient, services: Sequence[str]) -> tuple[WatchedMembership, AgentFactory]:
    token = token_from_env()

    def new_agent(member: Member, ttl_s: float) -> Registrar:
        return ConsulRegistrationAgent(url, member, http, ttl_s=ttl_s, token=token)

    return ConsulMembership(url, http, services=services, token=token), new_agent


BACKENDS: dict[str, Backend] = {
    "http": _embedded,
    "https": _embedded,
    "consul": _consul,
    "consul+http": _consul,
    "consul+https": _consul,
}
"""URL scheme -> backend."""


def membership_from_url(
    url: str, http: httpx.AsyncClient, services: Sequence[str] = ("shard", "cache")
) -> tuple[WatchedMembership, AgentFactory]:
    """The view of `services` and an agent factory for the registry at `url`; ValueError if unknown."""
    scheme = urlsplit(url).scheme
    backend = BACKENDS.get(scheme)
    if backend is None:
        raise ValueError(f"unknown membership URL {url!r}: expected one of "
                         f"{', '.join(s + '://' for s in BACKENDS)}")
    return backend(url, http, tuple(services))


__all__ = [
    "BACKENDS",
    "MEMBERSHIP_URL_PATTERN",
    "AgentFactory",
    "Registrar",
    "WatchedMembership",
    "membership_from_url",
]
