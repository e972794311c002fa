"""`switchboard bench route`: what one routing decision (pick + lease) costs as the fleet grows.

    flock /tmp/sb-bench.lock switchboard bench route --sizes 10,100,1000,10000 --json /tmp/route.json

For each fleet size it builds a synthetic membership of that many shards (a view with
``subscribe``, like the registry and Consul watchers; `--zones` spreads them over zones and gives
the router its own zone) and drives the real :class:`~data_plane.routing.router.Router`: with
``--background`` requests held open per shard (so bounded loads have something to bound), it
times ``pick`` + ``lease`` enter/exit over ``--requests`` session ids, the median of
``--repeats`` passes (the sizes' passes interleaved, so drift lands on all), per policy: ``affinity`` (session hashing on the bounded-load ring),
``kv_aware`` (every session has a known holder) and ``no_session`` (power of two choices). It
also times the first decision (the ring built from scratch) and the decision right after one
shard joins (the ring patched in place). The ratio column is each size's cost over the smallest
size's, same policy, same run; the target is <= 2x from 10 to 10,000 shards.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from prometheus_client import CollectorRegistry

from data_plane.bench.common import format_table, machine_info, write_json
from data_plane.membership.view import Member
from data_plane.routing.router import Router, RouterMetrics

POLICIES = ("affinity", "kv_aware", "no_session")


class SyntheticFleet:
    """`n` shards ``shard-00000``... in `zones` zones; `join()` adds one and tells subscribers."""

    def __init__(self, n: int, zones: int) -> None:
        self.zones = zones
        self._members = [self._member(i) for i in range(n)]
        self._subscribers: list[Callable[[], None]] = []

    def _member(self, i: int) -> Member:
        return Member(f"shard-{i:05d}", "shard", f"http://10.0.{i // 250}.{i % 250}:8101",
                      meta={"zone": f"z{i % self.zones}"})

    def members(self, service: str) -> list[Member]:
        return self._members if service == "shard" else []

    def subscribe(self, callback: Callable[[], None]) -> None:
        self._subscribers.append(callback)

    def join(self) -> None:
        self._members = [*self._members, self._member(len(self._members))]
        for callback in self._subscribers:
            callback()


class Setup:
    """One router over a synthetic fleet of `n` shards, loaded and (kv_aware) with known holders."""

    def __init__(self, n: int, policy: str, args: argparse.Namespace) -> None:
        self.n, self.policy = n, policy
        self.fleet = SyntheticFleet(n, args.zones)
        self.router = Router(self.fleet, RouterMetrics(CollectorRegistry()),
                             policy="affinity" if policy == "no_session" else policy,
                             rng=random.Random(1), zone="z0" if args.zones > 1 else None)
        self.keys: list[str | None] = [None] * args.requests if policy == "no_session" else [
            f"sess-{i}" for i in range(args.requests)]
        t0 = time.perf_counter()
        self.router.pick(self.keys[0])
        self.build_ms = 1000 * (time.perf_counter() - t0)
        self.held = ExitStack()
        for i in range(min(n * args.background, args.max_background)):  # requests in flight elsewhere
            self.held.enter_context(self.router.lease(self.router.pick(f"bg-{i}")))
        if policy == "kv_aware":
            for k in self.keys:
                self.router.observe_kv(k, self.router.pick(k).id, 1500)
        self.passes: list[float] = []

    def timed_pass(self) -> None:
        router, keys = self.router, self.keys
        t0 = time.perf_counter()
        for k in keys:
            with router.lease(router.pick(k)):
                pass
        self.passes.append((time.perf_counter() - t0) / len(keys))

    def finish(self) -> dict[str, Any]:
        self.fleet.join()
        t0 = time.perf_counter()
        self.router.pick(self.keys[0])
        change_ms = 1000 * (time.perf_counter() - t0)
        self.held.close()
        fleet = self.router.fleet
        return {"shards": self.n, "policy": self.policy, "pick_lease_us": 1e6 * statistics.median(self.passes),
                "pick_lease_us_min": 1e6 * min(self.passes), "first_decision_ms": self.build_ms,
                "after_join_ms": change_ms, "ring_builds": fleet.ring.builds, "ring_patches": fleet.ring.patches,
                "membership_changes": fleet.changes}


def measure(policy: str, sizes: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every size's passes interleaved (10, 100, ..., 10, 100, ...), so machine drift lands on all."""
    setups = [Setup(n, policy, args) for n in sizes]
    for _ in range(args.repeats):
        for setup in setups:
            setup.timed_pass()
    return [setup.finish() for setup in setups]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="switchboard bench route", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10,100,1000,10000", help="fleet sizes (shards)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"of {', '.join(POLICIES)}")
    p.add_argument("--requests", type=int, default=20_000, help="decisions per timed pass")
    p.add_argument("--repeats", type=int, default=7, help="timed passes (the median is reported)")
    p.add_argument("--background", type=int, default=2, help="requests held open per shard while timing")
    p.add_argument("--max-background", type=int, default=20_000, help="cap on requests held open")
    p.add_argument("--zones", type=int, default=1, help="zones the shards are spread over (router in z0)")
    p.add_argument("--json", help="write the rows and the machine here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    load0 = os.getloadavg()
    rows = []
    for policy in policies:
        for row in measure(policy, sizes, args):
            rows.append(row)
            print(f"{policy:>10} {row['shards']:>6} shards: {row['pick_lease_us']:.1f} us", flush=True)
    base = {r["policy"]: r["pick_lease_us"] for r in rows if r["shards"] == min(sizes)}
    for r in rows:
        r["ratio_to_smallest"] = r["pick_lease_us"] / base[r["policy"]]
    print(format_table(
        ["policy", "shards", "pick+lease us", "ratio", "first decision ms", "after join ms"],
        [[r["policy"], str(r["shards"]), f"{r['pick_lease_us']:.1f}", f"{r['ratio_to_smallest']:.2f}x",
          f"{r['first_decision_ms']:.1f}", f"{r['after_join_ms']:.2f}"] for r in rows]))
    worst = max(r["ratio_to_smallest"] for r in rows)
    print(f"worst ratio to {min(sizes)} shards: {worst:.2f}x (target <= 2x); "
          f"load average {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    if args.json:
        write_json(args.json, {"rows": rows, "args": vars(args), "worst_ratio": worst,
                               "machine": {**machine_info(), "loadavg_start": list(load0),
                                           "loadavg_end": list(os.getloadavg())}})


if __name__ == "__main__":
    main()
