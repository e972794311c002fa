"""The autoscaling rule: target tracking on waiting requests per shard, queue time and TTFT beyond prefill.

    policy = TargetTracking(PolicyConfig(min_replicas=1, max_replicas=4, ttft_slo_s=2.0))
    proposal = policy.decide(signals, current=2, now=time.monotonic())    # pure rule + its memory

A pure decision, no I/O and no clock of its own: the control loop (control_plane/scaling/loop.py)
calls ``decide`` on every tick, the simulator (control_plane/scaling/simulate.py) replays a load
trace through it with its own clock, and the tests drive it directly.

The rule (:meth:`TargetTracking.decide`), in order:

1. bounds first: fewer than ``min_replicas`` → scale up to it; more than ``max_replicas`` →
   down to it. These need no metrics.
2. never on incomplete signals: ``hold`` with ``missing: ...``.
3. recommend a replica count:

   - *up* when waiting per shard > target x (1 + ``tolerance``): enough shards that the queue
     spread over them is back at the target, given each shard's batch slots:
     ``ceil(load / (slots + target))`` with load = running + waiting over the fleet;
   - *up* when the queue time p95 (admission wait + shard queue) > ``target_queue_time_s`` x (1 +
     ``tolerance``), or TTFT *beyond prefill* p95 > SLO x (1 + ``tolerance``): enough shards for the
     load without a queue, ``max(current + 1, ceil(load / slots))`` — but only under pressure
     (:class:`~control_plane.signals.model.Pressure`, the degradation ladder's definition too: a
     queue now, or batches >= 75 % full, or KV >= 85 %) and once a whole window has passed since the fleet
     settled (every shard asked for serving), so the p95 is about the current fleet. Raw TTFT
     never scales: it grows with the prompt (one long conversation is not load);
   - *down* only when every shard asked for is serving and all are well inside the band: waiting
     per shard <= target x (1 - tolerance), queue time p95 <= its target x ``scale_down_below``,
     TTFT beyond prefill <= SLO x ``scale_down_below`` (None: nothing in the window counts as
     low), and the load would fill at most ``scale_down_below`` of the remaining shards' slots:
     ``ceil(load / (slots x scale_down_below))``. Between the up and down thresholds nothing
     moves (hysteresis).
4. fast up: at most ``max(max_scale_up_step, current)`` more at once, after
   ``scale_up_cooldown_s`` since the last scaling.
5. slow down: one shard at a time (``max_scale_down_step``), after ``scale_down_cooldown_s``
   since the last scaling (and since start), to the *highest* recommendation seen over that
   window, so a dip has to last the whole window.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Protocol

from control_plane.signals.model import Pressure, Signals
from control_plane.slo import TTFT_SLO_S

SHEDDING_HOLD_PER_S = 0.2
"""Deliberate sheds per second above which the autoscaler never scales in."""


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of :class:`TargetTracking`; validated on construction."""

    min_replicas: int = 1
    """Never fewer shards than this (0 allows scaling to zero)."""
    max_replicas: int = 4
    """Never more shards than this."""
    target_waiting_per_shard: float = 2.0
    """Requests waiting for a batch slot per shard that the fleet is sized for."""
    ttft_slo_s: float = TTFT_SLO_S
    """Time-to-first-token p95 objective, seconds, held against TTFT beyond prefill."""
    target_queue_time_s: float = 1.0
    """Queue time p95 (admission wait + shard queue), seconds, that the fleet is sized for."""
    pressure: Pressure = field(default_factory=Pressure)
    """When latency figures may scale up at all (shared with the degradation ladder)."""
    scale_up_cooldown_s: float = 15.0
    """Seconds after any scaling before scaling up again (fast up)."""
    scale_down_cooldown_s: float = 120.0
    """Seconds after any scaling (and after start) before scaling down; also the window whose
    highest recommendation a scale-down goes to (slow down)."""
    tolerance: float = 0.1
    """Relative band around the targets inside which nothing scales up."""
    scale_down_below: float = 0.6
    """Scale down only when the load would fill at most this share of the remaining shards' slots
    and TTFT p95 is under this share of the SLO."""
    max_scale_up_step: int = 4
    """Shards added at once: at most max(this, current) (i.e. at least doubling is allowed)."""
    max_scale_down_step: int = 1
    """Shards removed at once."""

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.min_replicas <= self.max_replicas, "need 0 <= min_replicas <= max_replicas"),
            (1 <= self.max_replicas <= 1000, "max_replicas must be in 1..1000"),
            (0 < self.target_waiting_per_shard <= 10_000, "target_waiting_per_shard must be in (0, 10000]"),
            (0 < self.ttft_slo_s <= 3600, "ttft_slo_s must be in (0, 3600]"),
            (0 < self.target_queue_time_s <= 600, "target_queue_time_s must be in (0, 600]"),
            (self.scale_up_cooldown_s >= 0 and self.scale_down_cooldown_s >= 0, "cooldowns must be >= 0"),
            (0 <= self.tolerance < 1, "tolerance must be in [0, 1)"),
            (0 < self.scale_down_below < 1, "scale_down_below must be in (0, 1)"),
            (self.max_scale_up_step >= 1 and self.max_scale_down_step >= 1, "steps must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True)
class Proposal:
    """What the rule wants this tick."""

    action: str
    """``scale_up | scale_down | hold | steady``."""
    current: int
    desired: int
    reason: str
    code: str
    """Short machine-readable reason (``waiting``, ``ttft``, ``cooldown_up``, ``missing``, ...)."""


class TargetTracking:
    """The scaling rule (see the module docstring). Time is passed in, so the simulator and
    the tests drive it with their own clock; it remembers when it last proposed a scaling
    and its recent recommendations, and assumes every proposal it makes is carried out."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._started_at: float | None = None
        self._last_scale_at = -math.inf
        self._settled_at: float | None = None
        self._recs: collections.deque[tuple[float, int]] = collections.deque()

    def decide(self, signals: Signals, current: int, now: float) -> Proposal:
        cfg = self.config
        if self._started_at is None:
            self._started_at = now
        if current < cfg.min_replicas:
            return self._scaled(
                now,
                "scale_up",
                current,
                cfg.min_replicas,
                "bounds",
                f"below min_replicas ({current} < {cfg.min_replicas})",
            )
        if current > cfg.max_replicas:
            return self._scaled(
                now,
                "scale_down",
                current,
                cfg.max_replicas,
                "bounds",
                f"above max_replicas ({current} > {cfg.max_replicas})",
            )
        if not signals.complete:
            return Proposal("hold", current, current, "missing: " + "; ".join(signals.missing), "missing")
        want, why, code = self._recommend(signals, current, now)
        self._recs.append((now, want))
        while self._recs and self._recs[0][0] < now - cfg.scale_down_cooldown_s:
            self._recs.popleft()
        if want > current:
            return self._up(now, current, want, why, code)
        if want < current:
            return self._down(now, current, why)
        return Proposal("steady", current, current, why, code)

    def _up(self, now: float, current: int, want: int, why: str, code: str) -> Proposal:
        cfg = self.config
        target = min(want, current + max(cfg.max_scale_up_step, current), cfg.max_replicas)
        if target <= current:
            return Proposal(
                "hold", current, current, f"{why}; at max_replicas ({cfg.max_replicas})", "at_max"
            )
        left = cfg.scale_up_cooldown_s - (now - self._last_scale_at)
        if left > 0:
            return Proposal(
                "hold", current, current, f"{why}; scale-up cooldown, {math.ceil(left)}s left", "cooldown_up"
            )
        return self._scaled(now, "scale_up", current, target, code, why)

    def _down(self, now: float, current: int, why: str) -> Proposal:
        cfg = self.config
        assert self._started_at is not None
        left = cfg.scale_down_cooldown_s - (now - max(self._last_scale_at, self._started_at))
        if left > 0:
            return Proposal(
                "hold",
                current,
                current,
                f"{why}; scale-down cooldown, {math.ceil(left)}s left",
                "cooldown_down",
            )
        stable = max(w for _, w in self._recs)  # the highest recommendation over the down window
        target = max(stable, current - cfg.max_scale_down_step, cfg.min_replicas)
        if target >= current:
            return Proposal(
                "hold",
                current,
                current,
                f"{why}; not low for the whole {cfg.scale_down_cooldown_s:.0f}s window yet",
                "stabilizing",
            )
        return self._scaled(now, "scale_down", current, target, "low_load", why)

    def _scaled(self, now: float, action: str, current: int, target: int, code: str, why: str) -> Proposal:
        self._last_scale_at = now
        if action == "scale_up":
            self._settled_at = None
        self._recs.clear()  # recommendations made for the old fleet size say nothing about the new
        return Proposal(action, current, target, why, code)

    def _recommend(self, s: Signals, current: int, now: float) -> tuple[int, str, str]:
        """(replicas wanted, why, code) from the signals, before cooldowns and steps."""
        cfg = self.config
        wps = s.waiting_per_shard if s.waiting_per_shard is not None else 0.0
        n = max(s.healthy_shards, 1)
        slots = s.capacity_per_shard if s.capacity_per_shard and math.isfinite(s.capacity_per_shard) else None
        load = (s.load_per_shard or 0.0) * n
        target = cfg.target_waiting_per_shard
        slo, queue_target = cfg.ttft_slo_s, cfg.target_queue_time_s
        queue, excess = s.queue_time_p95_s, s.ttft_excess_p95_s
        figures = (
            f"waiting/shard {wps:.1f} (target {target:g}), queue p95 {_secs(queue)} (target {queue_target:g}s), "
            f"TTFT beyond prefill p95 {_secs(excess)} (SLO {slo:g}s; raw TTFT p95 {_secs(s.ttft_p95_s)}), "
            f"batches {_pct(s.batch_usage)} full, load {load:.0f}"
            f"{'' if slots is None else f' on {n}x{slots:.0f} slots'}"
        )
        wants: list[tuple[int, str, str]] = []
        starting = s.healthy_shards < current  # asked-for shards not serving yet: their capacity is coming
        if wps > target * (1 + cfg.tolerance):
            want = math.ceil(load / (slots + target)) if slots else math.ceil(current * wps / target)
            wants.append((want if starting else max(want, current + 1), "waiting above target", "waiting"))
        # p95s lag by their window: only a window that started after the fleet last settled
        # (every asked-for shard serving) says anything about the current fleet
        if starting:
            self._settled_at = None
        elif self._settled_at is None:
            self._settled_at = now
        fresh = self._settled_at is not None and now - self._settled_at >= s.window_s
        pressure = cfg.pressure.on(s)
        sized = max(current + 1, math.ceil(load / slots) if slots else current + 1)
        if fresh and pressure and queue is not None and queue > queue_target * (1 + cfg.tolerance):
            wants.append((sized, "queue time p95 above target", "queue_time"))
        if fresh and pressure and excess is not None and excess > slo * (1 + cfg.tolerance):
            wants.append((sized, "TTFT beyond prefill above SLO", "ttft_excess"))
        if wants:
            want, why, code = max(wants)
            return want, f"{why}: {figures}", code
        calm_latency = ((queue is None or queue <= queue_target * cfg.scale_down_below)
                        and (excess is None or excess <= slo * cfg.scale_down_below))
        if s.shed_per_s > SHEDDING_HOLD_PER_S:
            # Demand is being turned away (degradation or admission): admitted load is low
            # because of the shedding, not because the fleet is too big.
            return current, f"within band: shedding {s.shed_per_s:.1f} req/s; {figures}", "steady"
        if wps <= target * (1 - cfg.tolerance) and calm_latency and not starting:
            fits = math.ceil(load / (slots * cfg.scale_down_below)) if slots else current - (wps == 0)
            want = max(fits, cfg.min_replicas)
            if want < current:
                return want, f"low load: {figures}", "low_load"
        lagging = [name for name, value, limit in (("queue p95", queue, queue_target), ("TTFT beyond prefill p95", excess, slo))
                   if value is not None and value > limit * (1 + cfg.tolerance)]
        if lagging and pressure and not fresh:  # not "within band": the figures say otherwise, and why they wait
            since = ("asked-for shards still starting" if self._settled_at is None
                     else f"{max(0.0, s.window_s - (now - self._settled_at)):.0f}s to go")
            return current, (f"settling: {' and '.join(lagging)} above target, but measured over a "
                             f"{s.window_s:.0f}s window that began before the fleet's last change ({since}); "
                             f"{figures}"), "settling"
        if lagging and not pressure:  # the p95 is from load that has gone: no queue, batches not busy now
            return current, (f"within band: {' and '.join(lagging)} above target, but no pressure now (no queue, "
                             f"batches not busy); {figures}"), "steady"
        return current, f"within band: {figures}", "steady"


def _secs(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}s"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


class PolicyKnobs(Protocol):
    """The settings a :class:`PolicyConfig` is made from: the control plane's
    (:class:`~control_plane.settings.ControlPlaneSettings`) and the simulator's
    (:class:`~control_plane.scaling.cli.SimulateSettings`)."""

    min_replicas: int
    max_replicas: int
    target_waiting_per_shard: float
    ttft_slo_s: float
    target_queue_time_s: float
    scale_up_cooldown_s: float
    scale_down_cooldown_s: float


def policy_config(settings: PolicyKnobs) -> PolicyConfig:
    """A :class:`PolicyConfig` from the control plane's or the simulator's settings (ValueError when
    they do not make a valid one)."""
    return PolicyConfig(
        min_replicas=settings.min_replicas,
        max_replicas=settings.max_replicas,
        target_waiting_per_shard=settings.target_waiting_per_shard,
        ttft_slo_s=settings.ttft_slo_s,
        target_queue_time_s=settings.target_queue_time_s,
        scale_up_cooldown_s=settings.scale_up_cooldown_s,
        scale_down_cooldown_s=settings.scale_down_cooldown_s,
    )


__all__ = ["PolicyConfig", "PolicyKnobs", "Proposal", "TargetTracking", "policy_config"]
