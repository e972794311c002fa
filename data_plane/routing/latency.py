"""Per-shard latency estimates (peak-EWMA of time to first token) for latency-aware routing.

    latency = ShardLatency(LatencyConfig(), clock=time.monotonic)
    latency.observe("shard-1", 0.12)        # a first token after 0.12 s (the router calls this)
    latency.estimate("shard-1")             # seconds now; None while unmeasured
    latency.cost("shard-1", outstanding=3)  # estimate x (outstanding + 1): power of two choices compares this
    latency.outlier("shard-1")              # a Slowness when far slower than the median of the others, else None
    latency.keep_only(fleet.by_id)          # shards out of membership: out of the median, forgotten after forget_s

Why: a shard that answers, but slowly (a noisy neighbour, CPU throttling, a host swapping), never fails,
so ejection (failures.py, outliers.py) never touches it and it kept its share of requests and all its
sessions: first tokens up to 18 s late while the other shards idled.

The estimate is Finagle's / Linkerd's peak-EWMA: a sample slower than the estimate replaces it at once;
a faster one is blended in with weight ``1 - exp(-dt / decay_s)`` (dt: time since the last sample), so
the estimate falls back over about ``decay_s`` of fast answers. Read, it decays with the time since its
last sample toward :data:`DECAY_FLOOR` x the lower of its own value and the median of the other shards'
last measured values: a shard nobody
sends to any more comes to look cheaper than the shards in use, gets a request again, and so is measured
anew. That is the probe of a shard routing avoids; no timer is involved. Not toward 0 as in Linkerd's
``PeakEwma``: there two equally fast shards idle for a minute came out of it e^(dt/decay_s) apart in cost
(dt: between their last samples), and the whole next burst, up to a first token, went to the one measured
longer ago; with the floor they stay within 1 / DECAY_FLOOR of each other.

Sessionless requests compare ``estimate x (outstanding + 1)`` of two random shards (Linkerd's cost);
an unmeasured shard counts as the fleet's median, so a new shard gets its share at once. Sessions keep
their shard unless it is a clear outlier (:meth:`ShardLatency.outlier`): its estimate above
``spill_factor`` x the median of the other measured shards and above ``spill_floor_s``, with
``min_slow_samples`` samples that slow within ``slow_window_s`` (one long prefill does not move a
shard's sessions away from their KV; a shard slow again after a probe is left again at once).
If every shard is slow none is an outlier: the median moves with them.

Memory: one small record per measured shard, forgotten ``forget_s`` after the shard left membership. Per decision
the cost is O(1): the median is a snapshot refreshed at most every ``refresh_s`` (O(n log n) then).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass

DECAY_FLOOR = 0.5
"""An estimate read without samples decays toward this fraction of min(its value, the median of the other
shards' last measured values), not toward 0."""

MAX_DEPARTED = 1024
"""Most estimates kept for shards out of membership (the oldest departures forgotten first beyond)."""


@dataclass(frozen=True)
class LatencyConfig:
    enabled: bool = True
    """Weigh shards by their latency estimate at all (off: outstanding requests alone, as before)."""
    decay_s: float = 10.0
    """Time constant of the peak-EWMA: how fast an estimate forgets a slow sample (Linkerd/Finagle: 10 s)."""
    spill_factor: float = 3.0
    """A session leaves its shard when that shard's estimate is above this many times the median of the
    others (0: sessions never leave for latency). The gateway's `--latency-spill-factor` defaults to 0: time to
    first token includes prefill, so a shard that holds the long-prompt sessions looks slow as well, and moving
    them costs their KV locality; an operator whose prompts are short turns it on."""
    spill_floor_s: float = 1.0
    """... and above this many seconds (fast fleets' jitter never moves sessions)."""
    min_slow_samples: int = 2
    """... and the shard answered that slowly at least this many times within ``slow_window_s``."""
    slow_window_s: float = 30.0
    """Window of those slow samples."""
    refresh_s: float = 0.5
    """Longest age of the fleet median a decision reads."""
    forget_s: float = 60.0
    """A shard out of membership this long is forgotten. Not at once: a slow shard whose heartbeats lapse
    (a stop past its membership TTL) flaps out and back in, and forgotten it came back unmeasured (the
    median) and got its share again after every flap."""


@dataclass(frozen=True)
class Slowness:
    """Why a shard is a latency outlier: its estimate against the median of the other shards."""

    estimate_s: float
    median_s: float


class _Estimate:
    __slots__ = ("slow", "stamp", "value")

    def __init__(self, value: float, stamp: float, slow_samples: int) -> None:
        self.value, self.stamp = value, stamp
        self.slow: deque[float] = deque(maxlen=max(1, slow_samples))
        """When the last few slow samples came (bounded)."""


class ShardLatency:
    """Peak-EWMA estimates of the shards' time to first token (see the module docstring)."""

    def __init__(self, config: LatencyConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or LatencyConfig()
        self.clock = clock
        self._est: dict[str, _Estimate] = {}
        self._departed: dict[str, float] = {}
        """Shards out of membership -> since when (their estimates kept ``forget_s``)."""
        self._snap_at = -math.inf
        self._snap_values: list[float] = []
        self._snap_of: dict[str, float] = {}
        self._snap_median: float | None = None
        self._floors: dict[str, float] = {}
        """What each estimate decays toward, as of the last snapshot (module docstring)."""

    def __len__(self) -> int:
        return len(self._est)

    def observe(self, shard_id: str, seconds: float) -> None:
        """One sample: `shard_id` took `seconds` to its first token."""
        now, cfg = self.clock(), self.config
        seconds = max(0.0, seconds)
        e = self._est.get(shard_id)
        if e is None:
            e = self._est[shard_id] = _Estimate(seconds, now, cfg.min_slow_samples)
        else:
            w = math.exp(-max(0.0, now - e.stamp) / cfg.decay_s)
            e.value = seconds if seconds > e.value * w else e.value * w + seconds * (1.0 - w)
            e.stamp = now
        if cfg.spill_factor > 0 and seconds > cfg.spill_floor_s:  # slow samples matter to session spills only
            others = self._median(shard_id, now)
            if others is not None and seconds > cfg.spill_factor * others:
                e.slow.append(now)

    def estimate(self, shard_id: str, now: float | None = None) -> float | None:
        """Seconds now (decayed since the last sample toward its floor: module docstring); None for a shard
        never measured."""
        e = self._est.get(shard_id)
        if e is None:
            return None
        floor = self._floors.get(shard_id)
        if floor is None or floor > e.value:  # measured since the snapshot, or faster than then
            floor = DECAY_FLOOR * e.value
        t = self.clock() if now is None else now
        return floor + (e.value - floor) * math.exp(-max(0.0, t - e.stamp) / self.config.decay_s)

    def cost(self, shard_id: str, outstanding: int) -> float:
        """Linkerd's ``estimate x (outstanding + 1)``; an unmeasured shard counts as the fleet's median."""
        now = self.clock()
        self._refresh(now)
        est = self.estimate(shard_id, now)
        if est is None:
            est = 1.0 if self._snap_median is None else self._snap_median
        return est * (outstanding + 1)

    def median(self) -> float:
        """The median estimate of the measured shards (1.0 before any: then every shard costs alike)."""
        m = self._median(None, self.clock())
        return 1.0 if m is None else m

    def outlier(self, shard_id: str) -> Slowness | None:
        """A :class:`Slowness` when `shard_id` is a clear latency outlier (module docstring), else None."""
        cfg = self.config
        e = self._est.get(shard_id)
        if cfg.spill_factor <= 0 or e is None or len(e.slow) < cfg.min_slow_samples:
            return None
        now = self.clock()
        if now - e.slow[0] > cfg.slow_window_s:
            return None
        est = self.estimate(shard_id, now)
        others = self._median(shard_id, now)
        if est is None or others is None or est <= cfg.spill_floor_s or est <= cfg.spill_factor * others:
            return None
        return Slowness(est, others)

    def keep_only(self, shard_ids: Container[str]) -> list[str]:
        """The shards in membership are `shard_ids`: the others' estimates leave the median now and are
        forgotten after ``forget_s`` out (or at once past :data:`MAX_DEPARTED`); returns those that left now."""
        now = self.clock()
        left = [sid for sid in self._est if sid not in shard_ids and sid not in self._departed]
        for sid in [sid for sid in self._departed if sid in shard_ids]:
            del self._departed[sid]  # back
        for sid in left:
            self._departed[sid] = now
        self._snap_at = -math.inf
        self._expire(now)
        return left

    def _expire(self, now: float) -> None:
        while self._departed:
            sid, since = next(iter(self._departed.items()))  # oldest first (insertion order)
            if now - since < self.config.forget_s and len(self._departed) <= MAX_DEPARTED:
                break
            del self._departed[sid]
            self._est.pop(sid, None)

    def snapshot(self) -> dict[str, float]:
        """Every measured shard's estimate as of the last refresh (for the gauges)."""
        self._refresh(self.clock())
        return dict(self._snap_of)

    def _refresh(self, now: float) -> None:
        if now - self._snap_at < self.config.refresh_s:
            return
        self._snap_at = now
        self._expire(now)
        live = [sid for sid in self._est if sid not in self._departed]
        raw = sorted(self._est[sid].value for sid in live)  # last measured, undecayed: no feedback loop
        floors = {}
        for sid in live:
            value = self._est[sid].value
            others = _median_of(raw, bisect.bisect_left(raw, value))
            floors[sid] = DECAY_FLOOR * (value if others is None else min(value, others))
        self._floors = floors
        self._snap_of = {sid: self.estimate(sid, now) or 0.0 for sid in live}
        self._snap_values = sorted(self._snap_of.values())
        self._snap_median = _median_of(self._snap_values, -1)

    def _median(self, without: str | None, now: float) -> float | None:
        """The median of the snapshot's estimates, leaving out `without`'s (None when none is left)."""
        self._refresh(now)
        values = self._snap_values
        skip = -1
        if without is not None and without in self._snap_of:
            skip = bisect.bisect_left(values, self._snap_of[without])
        return _median_of(values, skip)


def _median_of(values: list[float], skip: int) -> float | None:
    """The median of sorted `values` leaving out index `skip` (-1: none); None when none is left."""
    n = len(values) - (skip >= 0)
    if n <= 0:
        return None

    def at(k: int) -> float:
        return values[k + 1 if 0 <= skip <= k else k]

    mid = n // 2
    return at(mid) if n % 2 else (at(mid - 1) + at(mid)) / 2.0
