"""The degradation ladder's levels: one enum, imported by both planes.

    from data_plane.common.ladder import Level
    Level(3)                                   # Level.SHED_FREE_TIER (ValueError outside 0..4)
    Level.parse("3")                           # the same, from a wire value
    Level.SHED_FREE_TIER.label                 # "shed_free_tier": the admin API's "name"
    Level.SHED_FREE_TIER.title                 # "Shed free tier": the console's wording
    level >= Level.CAP_OUTPUT_TOKENS           # an IntEnum: compares, sorts and serialises as its number

The control plane (control_plane/degradation.py) moves the ladder; the gateway
(data_plane/gateway/cluster_state.py) applies the level in force to each request; the console and the
alert checks name it. On the wire (admin API, ``/v1/state``, ``degradation.json``, the
``switchboard_degradation_level`` gauge) a level is its number, as before.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class Level(IntEnum):
    """How much the platform gives up, 0 (nothing) .. 4 (everything but the last tier in shed order)."""

    NORMAL = 0
    SHRINK_CONTEXT = 1
    """The prompt window shrinks to half the context."""
    CAP_OUTPUT_TOKENS = 2
    """max_tokens is capped."""
    SHED_FREE_TIER = 3
    """The first tier in shed order (free) gets 503."""
    ENTERPRISE_ONLY = 4
    """Every tier but the last in shed order (enterprise) gets 503."""

    @property
    def label(self) -> str:
        """The level's machine name (``normal`` .. ``enterprise_only``)."""
        return self.name.lower()

    @property
    def title(self) -> str:
        """The level as the design names the rung, for people."""
        return _TITLES[self]

    @classmethod
    def parse(cls, value: Any) -> Level:
        """A level from a wire value (int or numeric string); ValueError outside 0..4."""
        number = int(value)
        if not MIN_LEVEL <= number <= MAX_LEVEL:
            raise ValueError(f"degradation level {number} is outside {MIN_LEVEL}..{MAX_LEVEL}")
        return cls(number)


_TITLES = {
    Level.NORMAL: "Normal",
    Level.SHRINK_CONTEXT: "Shrink context window",
    Level.CAP_OUTPUT_TOKENS: "Cap output tokens",
    Level.SHED_FREE_TIER: "Shed free tier",
    Level.ENTERPRISE_ONLY: "Enterprise only",
}
MIN_LEVEL = int(min(Level))
MAX_LEVEL = int(max(Level))

__all__ = ["MAX_LEVEL", "MIN_LEVEL", "Level"]
