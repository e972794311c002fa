"""Network-namespace "hosts" for tests: each host a netns with one veth link to the root namespace.

    hosts = Hosts("sbz", [1, 2])          # names sbz-h1, sbz-h2; addresses ADDR.1.2, ADDR.2.2
    with hosts.up():                      # skips where netns cannot be made; torn down afterwards
        ...
    hosts.cut(1); hosts.restore(1)        # NIC down / up inside host 1: a silent partition
    hosts.wrap(1, args)                   # ["ip", "netns", "exec", "sbz-h1", *args]

The layout (ADDR is a 10.X/16 block no route or address on this machine uses, X from the pid so
concurrent runs do not collide)::

    root namespace                                    netns <prefix>-h1 / -h2 ("hosts")
      veth  <p>cp   ADDR.0.1/32   control plane         <p>h1n  ADDR.1.2/30   processes bind here
      veth  <p>h1r  ADDR.1.1/30  <----------------->    <p>h2n  ADDR.2.2/30
      veth  <p>h2r  ADDR.2.1/30  <----------------->    route ADDR.0.1/32 via ADDR.N.1 (nothing else)
      route "unreachable ADDR.0.0/16", so nothing for these addresses can leave the machine by the
      default route, even while a link is down

Cutting a host is ``ip link set <p>hNn down`` inside its namespace: its NIC goes down, packets to
and from it are dropped (not refused). Hosts reach the control plane's address only; processes in
the root namespace (gateways, the test) reach every host.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterable, Iterator

import pytest


def free_block(seed: int) -> str:
    """A 10.X/16 block (X in 200..249, starting from `seed`) that no route or address here uses."""
    if shutil.which("ip") is None:
        return ""
    used = ""
    for cmd in (["ip", "-4", "route", "show", "table", "all"], ["ip", "-4", "addr"]):
        used += subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=10).stdout
    for i in range(50):
        block = f"10.{200 + (seed + i) % 50}"
        if f" {block}." not in used and f"\n{block}." not in used and not used.startswith(block + "."):
            return block
    return ""


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=10)


class Hosts:
    def __init__(self, prefix: str, numbers: Iterable[int], seed: int | None = None) -> None:
        self.p = prefix  # interface names stay under 15 characters: keep it short
        self.numbers = list(numbers)
        self.addr = free_block(os.getpid() if seed is None else seed)
        self.netns = {n: f"{prefix}-h{n}" for n in self.numbers}

    @property
    def cp_addr(self) -> str:
        return f"{self.addr}.0.1"

    def host_addr(self, n: int) -> str:
        return f"{self.addr}.{n}.2"

    def wrap(self, n: int, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns[n], *args]

    def unavailable(self) -> str | None:
        """Why hosts cannot be made here (None: they can)."""
        if os.geteuid() != 0:
            return "needs root (ip netns)"
        if shutil.which("ip") is None:
            return "no `ip` command"
        if not self.addr:
            return "no free 10.200-249.0.0/16 block for the test hosts"
        probe = f"{self.p}-probe"
        if ip("netns", "add", probe, check=False).returncode != 0:
            return "ip netns add failed (no CAP_SYS_ADMIN / netns support)"
        ip("netns", "del", probe, check=False)
        return None

    @contextlib.contextmanager
    def up(self) -> Iterator[None]:
        """The hosts for the length of a test (a fixture's body); the test skips where they cannot be made."""
        why = self.unavailable()
        if why:
            pytest.skip(why)
        try:
            self.setup()
            yield
        finally:
            self.teardown()

    def setup(self) -> None:
        self.teardown()  # leftovers of an interrupted run with the same prefix
        p, a = self.p, self.addr
        ip("route", "add", "unreachable", f"{a}.0.0/16")
        # The control plane's address lives on a veth pair kept in the root namespace (a stand-in for a
        # dummy device, whose module this kernel may lack), so no host's link carries it.
        ip("link", "add", f"{p}cp", "type", "veth", "peer", "name", f"{p}cq")
        ip("addr", "add", f"{a}.0.1/32", "dev", f"{p}cp")
        ip("link", "set", f"{p}cp", "up")
        ip("link", "set", f"{p}cq", "up")
        for n, ns in self.netns.items():
            root_end, host_end = f"{p}h{n}r", f"{p}h{n}n"
            ip("netns", "add", ns)
            ip("link", "add", root_end, "type", "veth", "peer", "name", host_end)
            ip("link", "set", host_end, "netns", ns)
            ip("addr", "add", f"{a}.{n}.1/30", "dev", root_end)
            ip("link", "set", root_end, "up")
            ip("link", "set", "lo", "up", ns=ns)
            ip("addr", "add", f"{a}.{n}.2/30", "dev", host_end, ns=ns)
            ip("link", "set", host_end, "up", ns=ns)
            self._route(n)

    def _route(self, n: int) -> None:
        ip("route", "replace", f"{self.addr}.0.1/32", "via", f"{self.addr}.{n}.1", ns=self.netns[n])

    def cut(self, n: int) -> None:
        ip("link", "set", f"{self.p}h{n}n", "down", ns=self.netns[n])

    def restore(self, n: int) -> None:
        ip("link", "set", f"{self.p}h{n}n", "up", ns=self.netns[n])
        self._route(n)  # a link that goes down takes its routes with it

    def teardown(self) -> None:
        for ns in self.netns.values():
            ip("netns", "del", ns, check=False)  # takes its veth ends, and so their peers, with it
        ip("link", "del", f"{self.p}cp", check=False)
        for n in self.numbers:
            ip("link", "del", f"{self.p}h{n}r", check=False)
        if self.addr:
            ip("route", "del", "unreachable", f"{self.addr}.0.0/16", check=False)
