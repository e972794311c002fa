"""The client's address behind trusted proxies: X-Forwarded-For is believed only from them.

    resolve = ClientAddress(["10.0.0.0/8"])            # the load balancers' networks (--trusted-proxies)
    resolve.of("10.0.0.5", ["203.0.113.7, 10.0.0.9"])   # ("203.0.113.7", Source.FORWARDED)
    resolve.of("198.51.100.1", ["203.0.113.7"])         # ("198.51.100.1", Source.UNTRUSTED): a spoof, ignored

As nginx's ``real_ip_header X-Forwarded-For; real_ip_recursive on`` and Envoy's trusted hops: when
the TCP peer is a trusted proxy, the X-Forwarded-For hops (every header, in order) are walked from
the right, skipping trusted proxies; the first hop that is not one is the client. A hop that is not
an IP address stops the walk at the last trusted hop (garbage is never believed); if every hop is
trusted, the leftmost is the client. When the peer is not trusted, or nothing is trusted (the
default), the peer is the client and X-Forwarded-For is ignored: any client can write it. (The
servers run uvicorn with ``proxy_headers`` off, data_plane/common/http_server.py: its default would
believe X-Forwarded-For from 127.0.0.1 before this sees the peer.)

Used by the abuse guard (data_plane/gateway/abuse.py), which bans addresses after repeated bad
keys: without this, every user behind one load balancer or NAT would share its ban.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable, Sequence

FORWARDED_FOR = "x-forwarded-for"

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class Source(enum.Enum):
    """Where a request's client address came from (the metric's label, a span attribute)."""

    PEER = "peer"
    """The TCP peer, with no X-Forwarded-For (or from a trusted peer with an empty one)."""
    FORWARDED = "forwarded"
    """X-Forwarded-For, through trusted proxies."""
    UNTRUSTED = "untrusted"
    """The TCP peer: it sent X-Forwarded-For but is not a trusted proxy, so the header was ignored."""
    INVALID = "invalid"
    """A trusted proxy's X-Forwarded-For held a hop that is not an address: the last trusted hop."""


def _address(text: str) -> _Address | None:
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class ClientAddress:
    """See the module docstring."""

    def __init__(self, trusted: Iterable[str | _Network]) -> None:
        self.trusted: tuple[_Network, ...] = tuple(ipaddress.ip_network(n, strict=False) if isinstance(n, str) else n
                                                    for n in trusted)

    def is_trusted(self, address: _Address | None) -> bool:
        return address is not None and any(address.version == n.version and address in n for n in self.trusted)

    def of(self, peer: str, forwarded_for: Sequence[str]) -> tuple[str, Source]:
        """The client's address (as text) and where it came from."""
        hops = [h.strip() for value in forwarded_for for h in value.split(",") if h.strip()]
        if not hops:
            return peer, Source.PEER
        last = _address(peer)
        if not self.trusted or not self.is_trusted(last):
            return peer, Source.UNTRUSTED
        assert last is not None
        for hop in reversed(hops):
            address = _address(hop)
            if address is None:
                return str(last), Source.INVALID
            if not self.is_trusted(address):
                return str(address), Source.FORWARDED
            last = address
        return str(last), Source.FORWARDED  # every hop a trusted proxy: the leftmost


__all__ = ["FORWARDED_FOR", "ClientAddress", "Source"]
