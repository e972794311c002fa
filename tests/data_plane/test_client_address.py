"""X-Forwarded-For is believed only from trusted proxies, walked from the right (nginx real_ip_recursive,
Envoy's trusted hops); a spoofed one from any other peer is ignored. The real-process version (a
proxy on 127.0.0.2, a ban that lands on the address behind it) is in tests/control_plane/test_abuse_e2e.py."""

from __future__ import annotations

import pytest

from data_plane.gateway.client_address import ClientAddress, Source
from data_plane.gateway.settings import GatewaySettings

LB = ClientAddress(["10.0.0.0/8", "2001:db8::/32"])


def test_from_a_trusted_proxy_the_rightmost_untrusted_hop_is_the_client() -> None:
    assert LB.of("10.0.0.5", ["203.0.113.7"]) == ("203.0.113.7", Source.FORWARDED)
    # the client's own spoofed hops sit on the left: never reached past the first untrusted one
    assert LB.of("10.0.0.5", ["1.2.3.4, 203.0.113.7, 10.1.1.1"]) == ("203.0.113.7", Source.FORWARDED)
    # several headers are one list, in order
    assert LB.of("10.0.0.5", ["1.2.3.4", "203.0.113.7, 10.1.1.1"]) == ("203.0.113.7", Source.FORWARDED)
    assert LB.of("2001:db8::1", ["[2001:db8::2]", "198.51.100.3"]) == ("198.51.100.3", Source.FORWARDED)
    assert LB.of("::ffff:10.0.0.5", ["198.51.100.3"]) == ("198.51.100.3", Source.FORWARDED)
    assert LB.of("10.0.0.5", ["10.9.9.9, 10.0.0.7"]) == ("10.9.9.9", Source.FORWARDED)  # all trusted: leftmost
    assert LB.of("10.0.0.5", []) == ("10.0.0.5", Source.PEER)
    assert LB.of("10.0.0.5", [" , "]) == ("10.0.0.5", Source.PEER)


def test_garbage_in_the_header_stops_at_the_last_trusted_hop() -> None:
    assert LB.of("10.0.0.5", ["203.0.113.7, unknown"]) == ("10.0.0.5", Source.INVALID)
    assert LB.of("10.0.0.5", ["not-an-ip, 10.0.0.9"]) == ("10.0.0.9", Source.INVALID)


def test_from_an_untrusted_peer_the_header_is_ignored() -> None:
    assert LB.of("198.51.100.9", ["10.0.0.5"]) == ("198.51.100.9", Source.UNTRUSTED)
    assert LB.of("198.51.100.9", []) == ("198.51.100.9", Source.PEER)
    nobody = ClientAddress([])  # the default: nothing is trusted, not even loopback
    assert nobody.of("127.0.0.1", ["203.0.113.7"]) == ("127.0.0.1", Source.UNTRUSTED)


def test_the_flag_takes_networks_and_refuses_garbage() -> None:
    s = GatewaySettings.model_validate({"trusted_proxies": "10.0.0.0/8,127.0.0.2/32,2001:db8::/32"})
    assert ClientAddress(s.trusted_proxies).of("127.0.0.2", ["203.0.113.7"])[0] == "203.0.113.7"
    with pytest.raises(ValueError, match="trusted_proxies"):
        GatewaySettings.model_validate({"trusted_proxies": "10.0.0.0/8,example.com"})
