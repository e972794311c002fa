"""The one fake clock: time that moves only when the test says so.

    clock = FakeClock(1000.0)          # a callable: pass it wherever code takes `clock=`
    clock()                            # 1000.0
    clock.advance(5)                   # or: clock.now += 5
    Router(view, metrics, clock=clock)

    ticks = FakeClock(1_800_000_000 * S, per_second=S)   # integer ticks (e.g. microseconds)
    ticks.advance(0.5)                                   # adds round(0.5 * S), stays an int

Code that takes separate wall and monotonic clocks gets this one for both (its readings then agree,
which is what a test wants).
"""

from __future__ import annotations


class FakeClock:
    """A clock reading `now` (seconds, or ticks of 1/`per_second` s); tests move it forward."""

    def __init__(self, start: float = 0.0, *, per_second: int | None = None) -> None:
        self.now = start
        self.per_second = per_second

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move forward `seconds` (rounded to whole ticks when the clock counts ticks)."""
        if self.per_second is None:
            self.now += seconds
        else:
            self.now += round(seconds * self.per_second)
