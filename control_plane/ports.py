"""Ports of `switchboard up`'s children, checked before anything starts (control_plane/launcher.py).

    if clash := shared_ports(children): ...     # two children given one port by the flags
    busy = busy_ports(children, "127.0.0.1")    # ports something else already holds
"""

from __future__ import annotations

import errno
import socket
from urllib.parse import urlsplit

from control_plane.supervisor import Child

PORT_FLAGS = (("control-plane", "--control-plane-port"), ("gateway", "--gateway-port"), ("console", "--console-port"),
              ("prometheus", "--prometheus-port"), ("shard-", "--shard-base-port"), ("cache-", "--cache-base-port"))
"""Child name prefix -> the flag that moves its port."""


def _flag(child: Child) -> str:
    return next((f for prefix, f in PORT_FLAGS if child.name.startswith(prefix)), "")


def shared_ports(children: list[Child]) -> list[str]:
    """Ports given to two children, as "control-plane and gateway on port 8300 (--control-plane-port,
    --gateway-port)". `--gateway-port` equal to `--control-plane-port` (or a zone's gateway, on
    --gateway-port +1, on the console's port) used to start: the one that bound first answered the
    other's health check, up printed "Switchboard is up" with the control plane's URL as the chat API,
    and restarted the gateway forever."""
    owners: dict[int, list[Child]] = {}
    for child in children:
        if (port := urlsplit(child.url).port) is not None:
            owners.setdefault(port, []).append(child)
    return [f"{' and '.join(c.name for c in same)} on port {port} "
            f"({', '.join(dict.fromkeys(f for f in map(_flag, same) if f))})"
            for port, same in owners.items() if len(same) > 1]


def busy_ports(children: list[Child], host: str) -> list[str]:
    """The children whose port something else already holds, as "gateway port 8000 (--gateway-port)".

    Why before anything starts: a child that cannot bind exits only after its start-up, and by then
    whatever holds the port (often another `switchboard up`) has answered its health check. The
    launcher then printed "Switchboard is up" with the other platform's URL beside this one's keys
    (every request a 401), and restarted the gateway forever."""
    busy = []
    for child in children:
        port = urlsplit(child.url).port
        if port is not None and _port_taken(host, port):
            flag = _flag(child)
            busy.append(f"{child.name} port {port}" + (f" ({flag})" if flag else ""))
    return busy


def _port_taken(host: str, port: int) -> bool:
    """Whether something holds `port` on `host`. Only "in use" counts: a host that does not resolve,
    or an address this machine lacks (localhost's ::1 without IPv6), is left to the child's own
    start-up error rather than reported as a busy port."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError:
        return False
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is free
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False
