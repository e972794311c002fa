"""The cache nodes a gateway's session store stops calling for a while: one breaker per node.

    hops = CircuitHops(HopPool(), NodeCircuits(metrics))   # what SessionStore calls its nodes through
    resp = await hops.request("GET", node_url, path, timeout=1.0)   # SkippedNode at once while it is open

A node can be *passing* in membership (its heartbeats reach the registry) and still be unreachable
from this gateway: a partition between the two, a firewall rule, a link that drops only this way.
Every read then waited for that replica's timeout before asking the next one, and every save waited
for it beside the others, so each paid session request took ~5 s for as long as the partition
lasted, and each free one on that node ~2 s before its 503. After ``EJECT_AFTER`` failures in a row
(no connection, a timeout, a 5xx) a node's calls fail at once as :class:`SkippedNode` (a
:class:`HopConnectError`, so callers treat it as unreachable: reads go to the other replica, a save
counts it as missed and the next read repairs it); after the hold, one call probes it (HALF_OPEN),
and its answer closes or reopens the breaker, the hold doubling up to ``MAX_HOLD_S``. The same
:class:`~data_plane.routing.failures.Circuit` the router keeps per shard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection

from data_plane.routing.failures import Circuit, CircuitState
from data_plane.routing.hop_client import HopConnectError, HopError, HopLocalError, HopPool, HopResponse

log = logging.getLogger(__name__)

EJECT_AFTER = 2
"""Consecutive failed calls that open a node's breaker."""
HOLD_S = 2.0
"""How long an opened breaker skips its node before one call probes it (doubles per reopening)."""
MAX_HOLD_S = 10.0
"""The longest hold: a node back from a partition is probed, and used again, within it."""


class SkippedNode(HopConnectError):
    """Not called: the node's breaker is open (it failed its last calls from this gateway)."""


class NodeCircuits:
    """One :class:`Circuit` per node URL that failed lately (none: CLOSED). `on_change(open_count, opened)`
    hears of every transition (the metrics)."""

    def __init__(self, on_change: Callable[[int, bool], None] | None = None, *, eject_after: int | None = None,
                 hold_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._circuits: dict[str, Circuit] = {}
        self._on_change = on_change or (lambda count, opened: None)
        self._eject_after = EJECT_AFTER if eject_after is None else eject_after
        self._hold_s = HOLD_S if hold_s is None else hold_s
        self._clock = clock

    def allow(self, node: str) -> bool:
        """Whether to call `node` now: CLOSED, or the one probe of an OPEN breaker whose hold is over (a probe
        that never reported back is replaced after another hold)."""
        circuit = self._circuits.get(node)
        if circuit is None or circuit.state is CircuitState.CLOSED:
            return True
        now = self._clock()
        if now < circuit.open_until:
            return False
        circuit.transition_to(CircuitState.HALF_OPEN)
        circuit.open_until = now + self._hold_s
        return True

    def succeeded(self, node: str) -> None:
        circuit = self._circuits.get(node)
        if circuit is None or circuit.ignores_success():
            return
        del self._circuits[node]
        if circuit.state is not CircuitState.CLOSED:
            log.warning("cache node %s answers again: back in use", node)
            self._on_change(self.open_count(), False)

    def failed(self, node: str) -> None:
        circuit = self._circuits.setdefault(node, Circuit())
        circuit.failures += 1
        if circuit.state is CircuitState.HALF_OPEN or (
                circuit.state is CircuitState.CLOSED and circuit.failures >= self._eject_after):
            hold = min(self._hold_s * 2 ** circuit.openings, MAX_HOLD_S)
            circuit.transition_to(CircuitState.OPEN, now=self._clock(), hold_s=hold)
            log.warning("cache node %s failed %d calls in a row from this gateway: skipped for %.0f s, then probed",
                        node, circuit.failures, hold)
            self._on_change(self.open_count(), True)

    def membership_changed(self, joined: Collection[str], present: Collection[str]) -> None:
        """The nodes membership lists changed: the breakers of nodes that (re)joined are forgotten (a node
        restarted is used at once: skipped for what was left of its hold, up to MAX_HOLD_S, a free session
        kept on it alone answered 503 and the repair of its records on rejoining was skipped), and so are
        those of nodes no longer listed (nothing would ever probe them: the skipped-nodes gauge, and the
        alert on it, stayed up for good, and the table grew with every node that left after failing)."""
        was = self.open_count()
        for node in list(self._circuits):
            if node in joined or node not in present:
                del self._circuits[node]
        if self.open_count() != was:
            self._on_change(self.open_count(), False)

    def open_count(self) -> int:
        return sum(1 for c in self._circuits.values() if c.state is not CircuitState.CLOSED)


class CircuitHops:
    """A :class:`HopPool` whose calls skip a node while its breaker is open (``request`` only)."""

    def __init__(self, pool: HopPool, circuits: NodeCircuits) -> None:
        self.pool, self.circuits = pool, circuits

    async def request(self, method: str, base_url: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None, timeout: float = 0.0) -> HopResponse:
        if not self.circuits.allow(base_url):
            raise SkippedNode(f"{base_url}: skipped while its breaker is open")
        try:
            resp = await self.pool.request(method, base_url, path, body, headers=headers, timeout=timeout)
        except HopLocalError:
            raise  # this gateway's own shortage (EMFILE): not the node's failure
        except HopError:
            self.circuits.failed(base_url)
            raise
        if resp.status >= 500:
            self.circuits.failed(base_url)
        else:
            self.circuits.succeeded(base_url)
        return resp


__all__ = ["EJECT_AFTER", "HOLD_S", "CircuitHops", "NodeCircuits", "SkippedNode"]
