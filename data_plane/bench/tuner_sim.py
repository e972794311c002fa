"""`switchboard bench tuner`: the adaptive thread tuner on a modelled noisy host, no model loaded.

    switchboard bench tuner                                   # the default host and burst rates
    switchboard bench tuner --rates 0,0.3,1,2 --burst-s 0.15 --seeds 40 --json /tmp/tuner.json

Why a model of the host and not the engine: the question is the tuner's *rule* under a host's noise,
and a real host's noise cannot be replayed (two runs of the same bench on a Firecracker VM read
70-159 tok/s at one stream, minute to minute), so an A/B on it needs more rounds than a session has.
Here every policy meets the same seeded noise.

The host (`Host`): a decode step takes `--step-ms` at every thread (2) and `--one-ms` at one thread,
+-10 % jitter; the first step at 2 threads after steps at 1 pays 1.5x (waking the other vCPU). Bursts
arrive as a Poisson process (`--rates`, a second) and last an exponential `--burst-s`: the host has
taken one vCPU, so a step at 2 threads waits for it at a barrier (4-8x), and a step at 1 thread does
only when its own vCPU was the one taken (half the time). The burst figures read on the 2-vCPU VM
(docs/BENCHMARKS.md): runs of three 40-60 ms steps against 10-13 ms. `--contention` instead holds a
core with another process the whole run (2 threads: 300 ms a step, 1 thread 12 ms), the case the
tuner exists for.

Policies, each on the same seeds: the tuner (torch_threads.ThreadTuner, starting at 2 threads), and
2 or 1 thread held. Reported: tokens a second (median and 10th percentile over the seeds) and the
share of steps run at 2 threads.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable
from typing import Any

from data_plane.bench.common import format_table, write_json
from data_plane.shard.engines.torch_threads import ThreadTuner


class Host:
    def __init__(self, seed: int, rate: float, burst_s: float, seconds: float, step_s: float, one_s: float,
                 contention: bool = False) -> None:
        self.rng = random.Random(seed)
        self.step_s, self.one_s, self.contention = step_s, one_s, contention
        self.bursts: list[tuple[float, float]] = []
        at = 0.0
        while rate > 0 and at < seconds:
            at += self.rng.expovariate(rate)
            self.bursts.append((at, at + self.rng.expovariate(1 / burst_s)))
        self.threads = 2
        self._last = 2

    def set(self, n: int) -> None:
        self.threads = n

    def step(self, now: float) -> float:
        n = self.threads
        if self.contention:
            seconds = 0.300 if n == 2 else 0.012
        else:
            seconds = (self.step_s if n == 2 else self.one_s) * self.rng.uniform(0.9, 1.1)
            if n == 2 and self._last == 1:
                seconds *= 1.5
            if any(a <= now < b for a, b in self.bursts) and (n == 2 or self.rng.random() < 0.5):
                seconds *= self.rng.uniform(4, 8)
        self._last = n
        return seconds


class Held:
    """A policy that holds one count (the tuner's interface, doing nothing)."""

    def __init__(self, count: int, set_threads: Callable[[int], None]) -> None:
        self.count, self.set_threads = count, set_threads

    def start(self) -> None:
        self.set_threads(self.count)

    def for_decode(self) -> None:
        pass

    def observe(self, batch: int, seconds: float) -> None:
        pass


def run(policy: str, host: Host, seconds: float) -> tuple[float, float]:
    """(tokens a second, share of steps at 2 threads) of one stream decoding for `seconds`."""
    tuner: Any = (ThreadTuner(2, host.set, initial=2) if policy == "tuner"
                  else Held(int(policy[-1]), host.set))
    tuner.start()
    now, steps, at_two = 0.0, 0, 0
    while now < seconds:
        tuner.for_decode()
        at_two += host.threads == 2
        took = host.step(now)
        tuner.observe(1, took)
        now += took
        steps += 1
    return steps / now, at_two / steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="switchboard bench tuner", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="0,0.3,1,2", help="bursts a second, comma-separated")
    ap.add_argument("--burst-s", type=float, default=0.15, help="mean burst length, seconds")
    ap.add_argument("--seconds", type=float, default=12.0, help="decode time a run (a bench round: ~12 s)")
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--step-ms", type=float, default=7.0, help="a step at 2 threads, quiet")
    ap.add_argument("--one-ms", type=float, default=10.0, help="a step at 1 thread, quiet")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows: list[list[str]] = []
    report: list[dict[str, Any]] = []
    cases = [(float(r), False) for r in args.rates.split(",")] + [(0.0, True)]
    for rate, contention in cases:
        for policy in ("tuner", "held 2", "held 1"):
            runs = [run(policy, Host(seed, rate, args.burst_s, args.seconds, args.step_ms / 1000,
                                     args.one_ms / 1000, contention), args.seconds) for seed in range(args.seeds)]
            rates = sorted(r for r, _ in runs)
            entry = {"host": "contention" if contention else f"{rate:g} bursts/s", "policy": policy,
                     "tok_s_median": statistics.median(rates), "tok_s_p10": rates[len(rates) // 10],
                     "share_at_2": statistics.median(s for _, s in runs)}
            report.append(entry)
            rows.append([f"{entry['host']}", policy, f"{entry['tok_s_median']:.1f}", f"{entry['tok_s_p10']:.1f}",
                         f"{entry['share_at_2']:.2f}"])
    print(format_table(["host", "policy", "tok/s median", "tok/s p10", "steps at 2 threads"], rows))
    if args.json:
        write_json(args.json, {"args": vars(args), "results": report})
