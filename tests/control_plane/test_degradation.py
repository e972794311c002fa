"""The degradation ladder's automatic rule, pins and events, fed synthetic signals on a fake clock.

    .venv/bin/python -m pytest tests/control_plane/test_degradation.py -q
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from control_plane.degradation import (
    Clock,
    DegradationController,
    DegradationMetrics,
    LadderConfig,
    assess,
)
from control_plane.policy_store import PolicyStore
from control_plane.signals.model import Signals
from tests.support.clock import FakeClock

CONFIG = LadderConfig(ttft_slo_s=2.0, raise_dwell_s=10.0, lower_dwell_s=30.0, history=5)


def signals(*, ttft: float | None = 0.2, waiting: float | None = 0.0, errors: float | None = 0.0,
            kv: float | None = 0.1, complete: bool = True, missing: tuple[str, ...] = (),
            queue: float | None = 0.0, excess: float | None = 0.05, batch: float | None = 0.2) -> Signals:
    return Signals(at=0.0, shards=(), healthy_shards=2, waiting_per_shard=waiting, ttft_p95_s=ttft,
                   error_rate=errors, tokens_per_s=10.0, kv_usage=kv, demand_by_tier={"free": 1.0},
                   rejections_by_tier={}, complete=complete, missing=missing or (() if complete else ("shard-0",)),
                   load_per_shard=(waiting or 0.0) + 4.0 * (batch or 0.0), capacity_per_shard=4.0,
                   batch_usage=batch, queue_time_p95_s=queue, ttft_excess_p95_s=excess)


HOT = signals(ttft=3.0, queue=3.0, excess=2.8, waiting=1.0, batch=1.0)  # a queue: 3 s waiting for a slot
CALM = signals(ttft=0.3, waiting=0.5)
WARM = signals(ttft=1.5, excess=1.5)  # beyond prefill between the lower (1 s) and raise (2 s) thresholds
LONG_PROMPT = signals(ttft=2.6, excess=0.1, batch=0.06)  # prefill of one long conversation, nothing queued


class ListSource:
    """Feeds a fixed sequence of readings (the test's stand-in for ScrapeSignals)."""

    def __init__(self, readings: list[Any]) -> None:
        self.readings = list(readings)

    async def read(self) -> Signals:
        item = self.readings.pop(0)
        if isinstance(item, Exception):
            raise item
        return item


def make(tmp_path: Any = None, clock: FakeClock | None = None, source: Any = None,
         config: LadderConfig = CONFIG) -> tuple[DegradationController, PolicyStore, CollectorRegistry, FakeClock]:
    clock = clock or FakeClock(1_000.0)
    store = PolicyStore(tmp_path, clock=clock)
    registry = CollectorRegistry()
    controller = DegradationController(store, source, config=config, metrics=DegradationMetrics(registry),
                                       clock=Clock(wall=clock, monotonic=clock))
    return controller, store, registry, clock


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, f"{name}{labels} not exported"
    return value


def test_assess_classifies_with_hysteresis_band() -> None:
    assert assess(HOT, CONFIG).verdict == "hot"
    assert assess(HOT, CONFIG).causes == ("queue_time", "ttft_excess")
    assert assess(CALM, CONFIG).verdict == "calm"
    assert assess(WARM, CONFIG).verdict == "hold"
    assert assess(signals(waiting=9.0), CONFIG).verdict == "hot"
    assert assess(signals(errors=0.2, waiting=1.0), CONFIG).verdict == "hot"
    assert assess(signals(kv=0.99), CONFIG).verdict == "hot"
    assert assess(signals(complete=False), CONFIG).verdict == "incomplete"
    assert assess(None, CONFIG).verdict == "incomplete"
    # no data in a latency dimension (no requests in the window) is no pressure, not a zero
    assert assess(signals(ttft=None, excess=None, queue=None, errors=None), CONFIG).verdict == "calm"
    assert "queue_time_p95 3.00s > 2.00s" in assess(HOT, CONFIG).reasons[0]


def test_a_long_prompt_is_not_overload() -> None:
    """Raw TTFT over the SLO from prefill alone never moves the ladder; nor does any latency figure
    while there is no queue and the batches are not busy (the tail of a window, a slow prompt)."""
    assert assess(LONG_PROMPT, CONFIG).verdict == "calm"
    idle_but_slow = signals(ttft=4.0, excess=3.0, queue=2.5, errors=0.5, batch=0.1)
    a = assess(idle_but_slow, CONFIG)
    assert a.verdict == "hold" and "not overload" in a.reasons[0]
    # the same figures with a queue are overload
    assert assess(signals(ttft=4.0, excess=3.0, queue=2.5, waiting=0.5), CONFIG).verdict == "hot"
    assert assess(signals(ttft=4.0, excess=3.0, queue=0.0, batch=0.8), CONFIG).verdict == "hot"
    ladder, _, _, clock = make()
    for _ in range(60):  # 10 minutes of one long conversation
        clock.advance(10)
        assert ladder.observe(LONG_PROMPT) is None
    assert ladder.level == 0


def test_a_missing_required_figure_is_incomplete_never_calm() -> None:
    import dataclasses

    for name in ("waiting_per_shard", "batch_usage", "load_per_shard", "capacity_per_shard"):
        a = assess(dataclasses.replace(CALM, **{name: None}), CONFIG)
        assert a.verdict == "incomplete" and name in a.reasons[0], (name, a)
    # a renamed field is a type error at construction, not a silently absent figure
    with pytest.raises(TypeError):
        Signals(**{**dataclasses.asdict(CALM), "queue_p95_s": 1.0})  # type: ignore[arg-type]
    # and reading one that is not there fails loudly (mypy flags it before it runs)
    with pytest.raises(AttributeError):
        assess(object(), CONFIG)  # type: ignore[arg-type]


def test_calm_while_shedding_is_hold_when_the_shed_demand_would_not_fit() -> None:
    """Shedding makes the fleet look calm; stepping down would let the shed demand back in."""
    import dataclasses

    base = dataclasses.replace(CALM, load_per_shard=3.0, capacity_per_shard=4.0,
                               demand_by_tier={"free": 20.0, "enterprise": 2.0}, rejections_by_tier={"free": 18.0})
    # 2 shards x 4 slots; 6 busy serving 4 req/s; 18 req/s shed would need ~27 more slots.
    verdict = assess(dataclasses.replace(base, shed_per_s=18.0), CONFIG)
    assert verdict.verdict == "hold" and "shedding 18.0 req/s" in verdict.reasons[0]
    # A trickle of shedding that fits in the spare slots does not hold the ladder up.
    assert assess(dataclasses.replace(base, shed_per_s=0.1), CONFIG).verdict == "calm"
    assert assess(dataclasses.replace(base, load_per_shard=0.5, shed_per_s=1.0), CONFIG).verdict == "calm"


def test_config_needs_lower_below_raise() -> None:
    with pytest.raises(ValueError, match="hysteresis"):
        LadderConfig(raise_waiting_per_shard=2.0, lower_waiting_per_shard=2.0)


def test_the_ladder_the_autoscaler_and_the_settings_share_one_slo_default() -> None:
    from control_plane.degradation import ladder_config
    from control_plane.scaling.policy import PolicyConfig, policy_config
    from control_plane.settings import ControlPlaneSettings
    from control_plane.slo import TTFT_SLO_S

    settings = ControlPlaneSettings()
    assert settings.ttft_slo_s == LadderConfig().ttft_slo_s == PolicyConfig().ttft_slo_s == TTFT_SLO_S
    assert settings.degradation_raise_queue_time_s == LadderConfig().raise_queue_time_s == TTFT_SLO_S
    moved = ControlPlaneSettings(ttft_slo_s=5.0)  # one configured value reaches both rules
    assert ladder_config(moved).ttft_slo_s == policy_config(moved).ttft_slo_s == 5.0


def test_raises_one_step_at_a_time_after_the_dwell() -> None:
    ladder, _, registry, clock = make()
    clock.advance(10)
    event = ladder.observe(HOT)
    assert event is not None and (event.from_level, event.to, event.actor) == (0, 1, "auto")
    assert "queue_time_p95" in event.reason and event.signals["queue_time_p95_s"] == 3.0
    assert "shards" not in event.signals  # the summary, not the per-shard list
    # still hot, but the level was held only 9 s: no second step yet
    clock.advance(9)
    assert ladder.observe(HOT) is None and ladder.level == 1
    clock.advance(1)
    assert ladder.observe(HOT).to == 2
    for expected in (3, 4):
        clock.advance(10)
        assert ladder.observe(HOT).to == expected
    clock.advance(10)
    assert ladder.observe(HOT) is None and ladder.level == 4  # the top
    assert metric(registry, "switchboard_degradation_level") == 4
    assert metric(registry, "switchboard_degradation_changes_total", direction="up", actor="auto") == 4
    assert metric(registry, "switchboard_degradation_evaluations_total", outcome="raise") == 4


def test_lowers_only_after_unbroken_calm_and_one_step_per_dwell() -> None:
    ladder, _, registry, clock = make()
    for _ in range(2):
        clock.advance(10)
        ladder.observe(HOT)
    assert ladder.level == 2
    # in the band between the thresholds nothing moves, however long
    for _ in range(10):
        clock.advance(10)
        assert ladder.observe(WARM) is None
    assert ladder.level == 2
    clock.advance(1)
    ladder.observe(CALM)  # calm starts now
    clock.advance(29)
    assert ladder.observe(CALM) is None  # calm for 29 s < 30 s
    clock.advance(1)
    event = ladder.observe(CALM)
    assert event is not None and (event.from_level, event.to) == (2, 1)
    assert event.reason.startswith("calm for 30s")
    # the next step down needs another full calm period at the new level
    clock.advance(29)
    assert ladder.observe(CALM) is None
    clock.advance(1)
    assert ladder.observe(CALM).to == 0
    clock.advance(100)
    assert ladder.observe(CALM) is None and ladder.level == 0
    assert metric(registry, "switchboard_degradation_changes_total", direction="down", actor="auto") == 2


def test_recovery_dwell_matches_the_cause_that_raised_the_level() -> None:
    """A queue gauge (waiting) reflects a step's effect at once: 10 s of calm per step. A windowed
    figure (queue time p95) needs one window to show it: 30 s per step."""
    ladder, _, _, clock = make()
    clock.advance(10)
    assert ladder.observe(signals(waiting=9.0, batch=1.0)).to == 1
    assert ladder.snapshot()["automatic"]["cause"] == ["waiting"]
    ladder.observe(CALM)
    clock.advance(10)
    event = ladder.observe(CALM)
    assert event is not None and event.to == 0
    clock.advance(10)
    ladder.observe(signals(queue=2.5, waiting=1.0))  # raised by queue time p95
    assert ladder.level == 1 and ladder.snapshot()["automatic"]["lower_dwell_s"] == 30.0
    ladder.observe(CALM)
    clock.advance(29)
    assert ladder.observe(CALM) is None
    clock.advance(1)
    assert ladder.observe(CALM).to == 0


def test_a_windowed_figure_raises_again_only_once_its_window_has_seen_the_new_level() -> None:
    """A queue-time p95 over a 30 s window still shows, for 30 s, the load the level now sheds:
    raising again after the 10 s dwell would overshoot. A queue gauge raises after the dwell."""
    import dataclasses

    ladder, _, _, clock = make()
    windowed = dataclasses.replace(signals(queue=3.0, waiting=1.0, excess=0.1), window_s=30.0)
    clock.advance(30)
    assert ladder.observe(windowed).to == 1
    clock.advance(10)
    assert ladder.observe(windowed) is None  # held 10 s of the 30 s window
    clock.advance(20)
    assert ladder.observe(windowed).to == 2
    clock.advance(10)
    assert ladder.observe(dataclasses.replace(windowed, waiting_per_shard=9.0)).to == 3  # a gauge: 10 s


def test_a_warm_reading_breaks_the_calm_streak() -> None:
    ladder, _, _, clock = make()
    clock.advance(10)
    ladder.observe(HOT)
    clock.advance(30)
    ladder.observe(CALM)
    clock.advance(20)
    ladder.observe(WARM)  # breaks it
    clock.advance(1)
    ladder.observe(CALM)
    clock.advance(29)
    assert ladder.observe(CALM) is None
    clock.advance(1)
    assert ladder.observe(CALM).to == 0


def test_incomplete_signals_never_move_the_ladder() -> None:
    ladder, _, registry, clock = make()
    clock.advance(10)
    ladder.observe(HOT)
    hot_but_incomplete = signals(ttft=9.0, queue=9.0, waiting=50.0, complete=False)
    for _ in range(5):
        clock.advance(60)
        assert ladder.observe(hot_but_incomplete) is None
        assert ladder.observe(None) is None
    assert ladder.level == 1
    assert ladder.snapshot()["automatic"]["verdict"] == "incomplete"
    # and they break a calm streak: calm must be seen for the whole dwell
    ladder.observe(CALM)
    clock.advance(20)
    ladder.observe(signals(complete=False))
    clock.advance(1)
    ladder.observe(CALM)
    clock.advance(15)
    assert ladder.observe(CALM) is None and ladder.level == 1
    assert metric(registry, "switchboard_degradation_evaluations_total", outcome="incomplete") == 11


def test_pin_holds_the_level_and_release_hands_it_back() -> None:
    ladder, store, registry, clock = make()
    event = ladder.pin(3, "incident 42")
    assert (event.from_level, event.to, event.actor, event.pinned) == (0, 3, "operator", True)
    assert store.degradation.pinned and store.degradation.reason == "pinned: incident 42"
    assert metric(registry, "switchboard_degradation_pinned") == 1
    # while pinned, the rule is evaluated but not applied, whatever it sees
    for reading in (CALM, HOT, CALM):
        clock.advance(100)
        assert ladder.observe(reading) is None
    assert ladder.level == 3
    assert metric(registry, "switchboard_degradation_evaluations_total", outcome="pinned") == 3
    event = ladder.release("fixed")
    assert (event.from_level, event.to, event.pinned) == (3, 3, False)
    assert not ladder.pinned and ladder.level == 3
    assert ladder.release("again") is None  # not pinned: nothing to release
    # back to the rule: the pinned time and the calm seen while pinned count (here calm began with
    # the last reading), then one step per gauge dwell (10 s): a pin is no windowed signal
    clock.advance(9)
    assert ladder.observe(CALM) is None
    clock.advance(1)
    assert ladder.observe(CALM).to == 2
    clock.advance(9)
    assert ladder.observe(CALM) is None
    clock.advance(1)
    assert ladder.observe(CALM).to == 1
    clock.advance(10)
    assert ladder.observe(CALM).to == 0
    assert metric(registry, "switchboard_degradation_pinned") == 0
    assert metric(registry, "switchboard_degradation_changes_total", direction="up", actor="operator") == 1
    assert metric(registry, "switchboard_degradation_changes_total", direction="none", actor="operator") == 1
    with pytest.raises(ValueError):
        ladder.pin(5, "no such level")


def test_release_after_a_long_calm_pin_steps_down_at_once() -> None:
    ladder, _, _, clock = make()
    ladder.pin(4, "incident")
    ladder.observe(CALM)
    clock.advance(120)
    ladder.observe(CALM)
    ladder.release("fixed")
    assert ladder.observe(CALM).to == 3  # no dwell restarts at the release
    steps = 0
    while ladder.level:
        clock.advance(1)
        steps += 1
        ladder.observe(CALM)
    assert steps == 30  # 4 -> 0 in 3 gauge dwells after the release


def test_history_is_bounded_and_snapshot_reports_it() -> None:
    ladder, _, _, clock = make()
    for level in (1, 2, 3, 4, 0, 1, 2):
        clock.advance(1)
        ladder.pin(level, f"to {level}")
    snap = ladder.snapshot()
    assert [e["to"] for e in snap["history"]] == [3, 4, 0, 1, 2]  # the last 5 of 7
    assert snap["level"] == 2 and snap["pinned"] and snap["name"] == "cap_output_tokens"
    assert set(snap["history"][0]) >= {"at", "from", "to", "reason", "signals", "actor"}


def test_state_survives_a_restart(tmp_path: Any) -> None:
    ladder, _, _, clock = make(tmp_path)
    ladder.pin(3, "maintenance")
    ladder2, _, registry2, _ = make(tmp_path, clock)
    assert ladder2.level == 3 and ladder2.pinned
    assert metric(registry2, "switchboard_degradation_level") == 3
    assert [e["to"] for e in ladder2.snapshot()["history"]] == [3]
    # an automatic level is restored too, and held while the readings after the restart are not calm
    # (a control plane restarted mid-overload keeps shedding), then stepped down by the usual dwell
    ladder2.release("done")
    ladder3, _, _, clock3 = make(tmp_path, clock)
    assert ladder3.observe(None) is None and ladder3.level == 3  # incomplete: confirms nothing
    assert ladder3.observe(WARM) is None and ladder3.level == 3
    ladder3.observe(CALM)
    clock3.advance(29)
    assert ladder3.observe(CALM) is None and ladder3.level == 3
    clock3.advance(1)
    assert ladder3.observe(CALM).to == 2


def test_a_restored_automatic_level_that_the_first_reading_finds_calm_is_dropped_at_once(tmp_path: Any) -> None:
    """`up` stopped at level 3 after an overload and started again on an idle fleet: no shedding for
    dwell x level (it shed the free tier for over a minute), the first calm reading ends it."""
    ladder, _, _, clock = make(tmp_path)
    ladder.pin(3, "overload")
    ladder.release("auto")
    restarted, _, registry, _ = make(tmp_path, clock)
    assert restarted.level == 3
    assert restarted.observe(None) is None and restarted.level == 3
    event = restarted.observe(CALM)
    assert event is not None and event.to == 0 and "restored at start" in event.reason
    assert metric(registry, "switchboard_degradation_level") == 0
    # a pinned level is the operator's: restored and held whatever the readings say
    restarted.pin(2, "maintenance")
    again, _, _, _ = make(tmp_path, clock)
    assert again.observe(CALM) is None and again.level == 2 and again.pinned


async def test_task_reads_the_source_and_survives_failures() -> None:
    config = LadderConfig(raise_dwell_s=0.0, lower_dwell_s=0.0, interval_s=0.01)
    source = ListSource([RuntimeError("prometheus down"), HOT, HOT] + [CALM] * 200)
    ladder = DegradationController(PolicyStore(None), source, config=config)  # real clock: the task sleeps
    await ladder.start()
    try:
        for _ in range(200):
            if len(ladder.snapshot()["history"]) >= 3:
                break
            await asyncio.sleep(0.01)
    finally:
        await ladder.aclose()
    moves = [(e["from"], e["to"]) for e in ladder.snapshot()["history"]]
    assert moves[:3] == [(0, 1), (1, 2), (2, 1)]
    history = ladder.signal_history()
    assert history and history[0]["ttft_p95_s"] == 3.0 and "at" in history[0]


def test_one_pressure_definition_for_the_ladder_and_the_autoscaler() -> None:
    from control_plane.scaling.policy import PolicyConfig
    from control_plane.signals.model import Pressure

    assert LadderConfig().pressure == PolicyConfig().pressure == Pressure()
    kv_busy = signals(kv=0.9, waiting=0.0, batch=0.1, excess=3.0, queue=0.0)  # no queue, batches idle, KV full
    assert Pressure().on(kv_busy) and not Pressure(busy_kv_usage=0.95).on(kv_busy)
    assert assess(kv_busy, CONFIG).verdict == "hot"  # TTFT beyond prefill counts under KV pressure
    assert assess(kv_busy, dataclasses.replace(CONFIG, pressure=Pressure(busy_kv_usage=0.95))).verdict == "hold"


def test_a_level_and_a_change_keep_their_wire_form() -> None:
    from control_plane.ladder import Actor, LevelChange
    from data_plane.common.ladder import Level

    assert Level.parse("3") is Level.SHED_FREE_TIER and Level(4).label == "enterprise_only"
    with pytest.raises(ValueError, match="outside 0..4"):
        Level.parse(5)
    wire = {"at": 1.0, "from": 2, "to": 3, "reason": "r", "signals": {"kv_usage": 0.5}, "actor": "auto",
            "pinned": False}
    change = LevelChange.from_dict(wire)
    assert change.actor is Actor.AUTO and change.direction == "up" and change.to_dict() == wire
    with pytest.raises(ValueError):
        LevelChange.from_dict({**wire, "actor": "someone"})
