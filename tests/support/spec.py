"""Deterministic speculation for engine tests: the verify-row price pinned, not learnt from wall-clock steps.

    pin_row_cost(engine)          # engine.spec drafts as if each verify row cost `cost` x a decode token

The engine learns what a draft row costs from its own step times (speculation.VerifyCost, an EWMA of
seconds). Under load (other processes on the cores, a compile beside the suite) one slow verify pass
prices rows at up to a whole token, drafting stops, and with no more verify passes the price is never
re-measured: a test asserting "it drafted" then depends on the machine's load, not on the engine's
logic. Tests that assert drafting pin the price at the prior measured on an idle CPU (0.02,
docs/BENCHMARKS.md); the learning itself is tested on its own (tests/data_plane/test_speculation.py).
"""

from __future__ import annotations

from typing import Any

from data_plane.shard.engines.speculation import VerifyCost


class PinnedCost(VerifyCost):
    """A VerifyCost that ignores observed step times: row_cost(batch) = prior x batch."""

    def plain(self, batch: int, seconds: float) -> None:
        return None

    def verify(self, batch: int, rows: int, seconds: float) -> None:
        return None


def pin_row_cost(engine: Any, cost: float = 0.02) -> None:
    """Pin `engine.spec`'s verify-row price (no-op when speculation is off)."""
    spec = getattr(engine, "spec", None)
    if spec is not None and hasattr(spec, "cost"):
        spec.cost = PinnedCost(prior=cost)
