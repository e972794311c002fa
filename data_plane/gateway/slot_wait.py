"""When a batch slot is likely free: the Retry-After admission sends with a shed request.

    holds = SlotHolds(min_s=1, max_s=60)
    holds.start(ticket_id, now, slots)          # at admission
    holds.end(ticket_id, now)                   # at release: the hold time joins the average
    holds.wait_s(needed=3, now=now)             # seconds until 3 more slots have freed

A fixed Retry-After (it was 2 s) is wrong both ways: in a burst whose requests held every slot
~23 s, a client retrying after 2 s queued again, was shed again at its deadline, and the openai
SDK gave up after its two retries (~21 s) while the slots were still busy. So the wait is estimated
from what admission sees:

- the hold time ``H`` of a slot: the larger of the recent completed holds' average (EWMA) and twice
  the mean age of the requests in flight. In a steady stream the requests in flight are on average
  half way through, so the two agree; in a burst whose requests all started together (or run longer
  than the history), the ages are the only evidence, and each is taken to last as long again.
- each request in flight frees its slots at ``H - age`` (at once when it is past ``H``);
- a shed request needs ``needed`` slots to free (the in-flight ones past its tier's cap, plus the
  slots of the waiters of its priority or better that go before a retry); the wait is when the
  ``needed``-th slot frees, a hold time more for each time round the slots in flight.

The result is bounded (1-60 s by default: the openai SDKs honour a Retry-After of at most 60 s);
with nothing in flight it is the minimum.
"""

from __future__ import annotations

from dataclasses import dataclass

EWMA_WEIGHT = 0.2
"""Weight of the newest completed hold in the average."""


@dataclass
class _Hold:
    started: float
    slots: int


class SlotHolds:
    """The slots held now (when each request started, how many slots) and the average hold time."""

    def __init__(self, min_s: float = 1.0, max_s: float = 60.0) -> None:
        self.min_s, self.max_s = min_s, max_s
        self.average_s: float | None = None
        """EWMA of completed holds (None until one completed)."""
        self._held: dict[int, _Hold] = {}

    def start(self, hold_id: int, now: float, slots: int) -> None:
        self._held[hold_id] = _Hold(now, slots)

    def end(self, hold_id: int, now: float) -> None:
        hold = self._held.pop(hold_id, None)
        if hold is None:
            return
        took = max(0.0, now - hold.started)
        self.average_s = took if self.average_s is None else \
            (1 - EWMA_WEIGHT) * self.average_s + EWMA_WEIGHT * took

    def hold_s(self, now: float) -> float:
        """The hold time ``H`` (module docstring); 0 when nothing was ever seen."""
        held = sum(h.slots for h in self._held.values())
        mean_age = sum((now - h.started) * h.slots for h in self._held.values()) / held if held else 0.0
        return max(self.average_s or 0.0, 2 * mean_age)

    def wait_s(self, needed: int, now: float) -> float:
        """Seconds until `needed` more slots have freed, bounded to [min_s, max_s]."""
        frees = sorted((h.started, h.slots) for h in self._held.values())  # oldest first: frees first
        in_flight = sum(slots for _, slots in frees)
        if needed <= 0 or not in_flight:
            return self.min_s
        hold = self.hold_s(now)
        rounds, nth = divmod(needed - 1, in_flight)  # the needed-th slot: `rounds` times round, then the nth
        count = 0
        for started, slots in frees:
            count += slots
            if count > nth:
                wait = max(0.0, hold - (now - started)) + rounds * hold
                return min(self.max_s, max(self.min_s, wait))
        raise AssertionError("unreachable: nth < in_flight")
