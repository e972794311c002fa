"""The degradation ladder's vocabulary: what the rule concludes, why, what the controller did, and
the one record of a level change (controller, policy store and admin API all use it).

    a = assess(signals, config)        # Assessment(verdict=Verdict.HOT, causes=(Cause.QUEUE_TIME,), ...)
    change = controller.observe(s)     # LevelChange | None
    change.to_dict()                   # {"at", "from", "to", "reason", "signals", "actor", "pinned"}
    LevelChange.from_dict(json_obj)    # validated (degradation.json, written by PolicyStore)

Every enum here is a StrEnum: its value is what the admin API, the metrics' labels and the persisted
history carry, so the wire formats are the strings they always were.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from data_plane.common.ladder import Level


class Verdict(StrEnum):
    """The automatic rule's reading of one set of signals."""

    HOT = "hot"
    """An overload figure above its raise threshold: step up."""
    CALM = "calm"
    """Every figure below its lower threshold: may step down after the dwell."""
    HOLD = "hold"
    """In between (hysteresis), or calm only because demand is being shed."""
    INCOMPLETE = "incomplete"
    """Signals missing: the ladder never moves on them."""


class Cause(StrEnum):
    """What raised the level in force."""

    WAITING = "waiting"
    QUEUE_TIME = "queue_time"
    TTFT_EXCESS = "ttft_excess"
    ERROR_RATE = "error_rate"
    KV_USAGE = "kv_usage"
    OPERATOR = "operator"

    @property
    def windowed(self) -> bool:
        """Read over the signals' window (p95s, rates), so it lags a step by up to one window."""
        return self in WINDOWED_CAUSES


WINDOWED_CAUSES = frozenset({Cause.QUEUE_TIME, Cause.TTFT_EXCESS, Cause.ERROR_RATE})


class Outcome(StrEnum):
    """What the controller did with one evaluation (``switchboard_degradation_evaluations{outcome}``)."""

    RAISE = "raise"
    LOWER = "lower"
    HOLD = "hold"
    INCOMPLETE = "incomplete"
    PINNED = "pinned"


class Actor(StrEnum):
    """Who changed the level."""

    AUTO = "auto"
    OPERATOR = "operator"


class Direction(StrEnum):
    """Which way a change went (``switchboard_degradation_changes{direction}``)."""

    UP = "up"
    DOWN = "down"
    NONE = "none"


@dataclass(frozen=True)
class LevelChange:
    """One change of the ladder (a pin, a release, a step of the rule), as kept in the history."""

    at: float
    """Unix time of the change."""
    from_level: Level
    to: Level
    reason: str
    actor: Actor
    pinned: bool
    """Whether the level is pinned after this change."""
    signals: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """The signals' JSON-ready summary at the time (empty when none had been read)."""

    @property
    def direction(self) -> Direction:
        if self.to > self.from_level:
            return Direction.UP
        return Direction.DOWN if self.to < self.from_level else Direction.NONE

    def to_dict(self) -> dict[str, Any]:
        """The wire form (admin API, degradation.json)."""
        return {
            "at": self.at,
            "from": int(self.from_level),
            "to": int(self.to),
            "reason": self.reason,
            "signals": dict(self.signals),
            "actor": self.actor.value,
            "pinned": self.pinned,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LevelChange:
        """Parse the wire form; ValueError (or KeyError) when it is not one."""
        signals = data.get("signals") or {}
        if not isinstance(signals, Mapping):
            raise ValueError("a level change's signals must be an object")
        return cls(
            at=float(data["at"]),
            from_level=Level.parse(data["from"]),
            to=Level.parse(data["to"]),
            reason=str(data.get("reason") or ""),
            actor=Actor(data.get("actor") or Actor.AUTO),
            pinned=bool(data.get("pinned", False)),
            signals=dict(signals),
        )


__all__ = ["WINDOWED_CAUSES", "Actor", "Cause", "Direction", "LevelChange", "Outcome", "Verdict"]
