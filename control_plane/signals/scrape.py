"""The embedded signal reader: scrapes every shard's and gateway's ``/metrics`` itself.

    source = ScrapeSignals.from_registry(registry, http, window_s=30)   # signals/source.py, at start-up
    signals = await source.read()                                      # autoscaler, ladder: each tick

Built by :func:`control_plane.signals.source.build_signal_source` when the control plane runs
without ``--prometheus``. It keeps the scrapes of the last window per member and turns counter and
bucket deltas into the same :class:`~control_plane.signals.model.Signals` the Prometheus reader
yields (what counts, and why missing is never zero: control_plane/signals/model.py).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from control_plane.signals.model import (
    M_GW_QUEUE,
    M_GW_REQUESTS,
    M_GW_TOKENS,
    M_GW_TTFT,
    M_GW_WAIT,
    M_KV,
    M_MAX_SEQS,
    M_PREFIX_BYTES,
    M_PREFIX_HITS,
    M_PREFIX_QUERIES,
    M_RUNNING,
    M_SHARD_ITL,
    M_SHARD_PREFILL,
    M_SHARD_QUEUE,
    M_SHARD_TOKENS,
    M_SHARD_TTFT,
    M_WAITING,
    NOT_OVERLOAD_CODES,
    QUANTILE,
    REJECTED_STATUSES,
    SHED_CODES,
    Sample,
    ShardSignal,
    Signals,
    aggregate,
    histogram_quantile,
    overload_histograms_missing,
    parse_exposition,
)
from data_plane.membership.view import Member


@dataclass
class _Scrape:
    t: float  # monotonic
    samples: list[Sample]

    def total(self, name: str, match: Callable[[dict[str, str]], bool] | None = None) -> float | None:
        """Sum of the samples named `name` (optionally filtered by labels); None if none exist."""
        found = False
        acc = 0.0
        for n, labels, value in self.samples:
            if n == name and (match is None or match(dict(labels))):
                found, acc = True, acc + value
        return acc if found else None

    def by_label(
        self, name: str, key: str, match: Callable[[dict[str, str]], bool] | None = None
    ) -> dict[str, float]:
        out: dict[str, float] = {}
        for n, labels, value in self.samples:
            if n == name:
                d = dict(labels)
                if match is None or match(d):
                    out[d.get(key, "")] = out.get(d.get(key, ""), 0.0) + value
        return out


@dataclass
class _History:
    url: str
    scrapes: deque[_Scrape] = field(default_factory=deque)
    error: str | None = None

    @property
    def last(self) -> _Scrape | None:
        return self.scrapes[-1] if self.scrapes else None


def _counter_delta(new: float | None, old: float | None) -> float:
    if new is None:
        return 0.0
    if old is None or new < old:  # appeared, or the process restarted: count from zero
        return new
    return new - old


class ScrapeSignals:
    """Scrapes every shard's and gateway's ``/metrics`` on each read (embedded mode).

        source = ScrapeSignals.from_registry(app.state.registry, http, window_s=30)
        signals = await source.read()

    `members(service)` lists members of a service in any status (``Member.status`` says which);
    `headers` go with every scrape (/metrics is guarded: signals/source.py sends the cluster token).
    Reads closer together than `min_interval_s` share one scrape, so the autoscaler and the
    degradation controller can both read on their own ticks.
    """

    def __init__(
        self,
        members: Callable[[str], Iterable[Member]],
        http: httpx.AsyncClient,
        *,
        window_s: float = 30.0,
        scrape_timeout_s: float = 1.0,
        min_interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self._members = members
        self._http = http
        self._headers = dict(headers or {})  # members' /metrics take the metrics or the cluster token
        self.window_s = window_s
        self._timeout_s = scrape_timeout_s
        self._min_interval_s = min_interval_s
        self._clock, self._wall = clock, wall
        self._history: dict[str, _History] = {}
        self._lock = asyncio.Lock()
        self._last: tuple[float, Signals] | None = None

    @classmethod
    def from_registry(cls, registry: Any, http: httpx.AsyncClient, **kwargs: Any) -> ScrapeSignals:
        """Members from the control plane's own :class:`~control_plane.registry.embedded.Registry`."""

        def members(service: str) -> list[Member]:
            return [Member.from_dict(d) for d in registry.snapshot(service)[1]]

        return cls(members, http, **kwargs)

    async def read(self) -> Signals:
        async with self._lock:
            if self._last is not None and self._clock() - self._last[0] < self._min_interval_s:
                return self._last[1]
            signals = await self._read()
            self._last = (self._clock(), signals)
            return signals

    async def _read(self) -> Signals:
        shards = list(self._members("shard"))
        gateways = [m for m in self._members("gateway") if m.status == "passing"]
        scraped = [m for m in shards if m.status != "critical"] + gateways
        self._forget({m.id for m in scraped})
        now = self._clock()
        await asyncio.gather(*(self._scrape(m, now) for m in scraped))
        missing: list[str] = []
        shard_signals = [self._shard_signal(m) for m in shards]

        gw_hist = [self._history[m.id] for m in gateways]
        for m, h in zip(gateways, gw_hist, strict=True):
            if h.error is not None:
                missing.append(f"{m.id}: {h.error}")
        if gateways:
            window_sources = [h for h in gw_hist if h.error is None]
            ttft = self._quantile(window_sources, M_GW_TTFT)
            ttft_p50 = self._quantile(window_sources, M_GW_TTFT, 0.5)
            tokens = self._rate(window_sources, M_GW_TOKENS, lambda d: d.get("kind") == "completion")
            demand = self._rates_by(window_sources, M_GW_REQUESTS, "tier")
            rejected = self._rates_by(
                window_sources, M_GW_REQUESTS, "tier", lambda d: d.get("status") in REJECTED_STATUSES
            )
            total = sum(demand.values())
            # Deliberate shedding (503 `overloaded` from admission or the ladder) is the remedy, not
            # a failure: counting it would let shedding keep the ladder raised by itself.
            errors = self._rate(window_sources, M_GW_REQUESTS, lambda d: d.get("status", "").startswith("5")
                                and d.get("code") not in NOT_OVERLOAD_CODES)
            error_rate = (errors or 0.0) / total if total > 0 else None
            shed = self._rate(window_sources, M_GW_REQUESTS, lambda d: d.get("status") == "503"
                              and d.get("code") in SHED_CODES) or 0.0
            # a gateway without the series has never queued a request: 0, not unknown
            queue: float | None = sum(h.last.total(M_GW_QUEUE) or 0.0 for h in window_sources if h.last)
            if len(window_sources) < len(gw_hist):
                queue = None
            admission_wait = self._quantile(window_sources, M_GW_WAIT)
        else:
            window_sources = [self._history[m.id] for m in shards if m.id in self._history]
            window_sources = [h for h in window_sources if h.error is None]
            ttft = self._quantile(window_sources, M_SHARD_TTFT)
            ttft_p50 = self._quantile(window_sources, M_SHARD_TTFT, 0.5)
            tokens = self._rate(window_sources, M_SHARD_TOKENS)
            demand, rejected, error_rate = {}, {}, None
            queue = 0.0
            shed = 0.0
            admission_wait = None
        shard_sources = [self._history[m.id] for m in shards
                         if m.id in self._history and self._history[m.id].error is None]
        spans = [h.scrapes[-1].t - h.scrapes[0].t for h in window_sources if len(h.scrapes) > 1]
        span = max(spans, default=0.0)
        if window_sources and span == 0.0:
            missing.append("history: one scrape so far, no rates yet")
            tokens = None
        return aggregate(
            at=self._wall(),
            shards=shard_signals,
            missing=missing,
            ttft_p95_s=ttft,
            error_rate=error_rate,
            tokens_per_s=tokens,
            demand=demand,
            rejections=rejected,
            window_s=span,
            source="scrape",
            gateway_queue=queue,
            shed_per_s=shed,
            ttft_p50_s=ttft_p50,
            tpot_s=self._quantile(shard_sources, M_SHARD_ITL, 0.5),
            admission_wait_p95_s=admission_wait,
            shard_queue_p95_s=self._quantile(shard_sources, M_SHARD_QUEUE),
            prefill_p95_s=self._quantile(shard_sources, M_SHARD_PREFILL),
            shard_ttft_p95_s=self._quantile(shard_sources, M_SHARD_TTFT),
        )

    def _forget(self, keep: set[str]) -> None:
        for member_id in list(self._history):
            if member_id not in keep:
                del self._history[member_id]

    async def _scrape(self, member: Member, now: float) -> None:
        h = self._history.get(member.id)
        if h is None or h.url != member.url:
            h = self._history[member.id] = _History(member.url)
        try:
            resp = await self._http.get(member.url + "/metrics", timeout=self._timeout_s, headers=self._headers)
            resp.raise_for_status()
            samples = parse_exposition(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            h.error = f"scrape failed ({type(exc).__name__}: {str(exc)[:120] or 'no detail'})"
            return
        h.error = None
        h.scrapes.append(_Scrape(now, samples))
        while len(h.scrapes) > 2 and h.scrapes[1].t <= now - self.window_s:
            h.scrapes.popleft()

    def _shard_signal(self, member: Member) -> ShardSignal:
        h = self._history.get(member.id)
        last = h.last if h else None
        nan = math.nan
        values = {"running": nan, "waiting": nan, "kv_usage": nan, "max_num_seqs": nan}
        if last is not None:
            for key, name in (
                ("running", M_RUNNING),
                ("waiting", M_WAITING),
                ("kv_usage", M_KV),
                ("max_num_seqs", M_MAX_SEQS),
            ):
                v = last.total(name)
                values[key] = nan if v is None else v
        error = h.error if h else None
        if member.status == "critical":
            error = "member critical (heartbeat missed)"
        gauges_missing = any(math.isnan(v) for k, v in values.items() if k != "kv_usage")
        stale = error is not None or last is None or gauges_missing
        if error is None and stale:
            error = "no engine gauges in /metrics (still loading?)"
        if not stale and last is not None:
            blind = overload_histograms_missing({n for n, _, _ in last.samples})
            if blind:
                stale, error = True, blind
        ttft = self._quantile([h], M_SHARD_TTFT) if h and h.error is None else None
        hit_rate = None
        if h is not None and h.error is None:
            increase, _ = self._increase(h, lambda s: {k: v for k, v in (("q", s.total(M_PREFIX_QUERIES)),
                                                                         ("h", s.total(M_PREFIX_HITS)))
                                                       if v is not None})
            if increase.get("q"):
                hit_rate = increase.get("h", 0.0) / increase["q"]
        return ShardSignal(
            member.id,
            ttft_p95_s=ttft,
            error=error,
            stale=stale,
            status=member.status,
            url=member.url,
            prefix_hit_rate=hit_rate,
            prefix_cache_bytes=last.total(M_PREFIX_BYTES) if last is not None else None,
            **values,
        )

    @staticmethod
    def _increase(
        h: _History, extract: Callable[[_Scrape], dict[str, float]]
    ) -> tuple[dict[str, float], float]:
        """Per-key counter increase over the window and the seconds it spans; a value that went
        down (the process restarted) counts from zero, as PromQL's ``increase`` does."""
        out: dict[str, float] = {}
        if len(h.scrapes) < 2:
            return out, 0.0
        prev = extract(h.scrapes[0])
        for scrape in itertools.islice(h.scrapes, 1, None):
            cur = extract(scrape)
            for key, value in cur.items():
                out[key] = out.get(key, 0.0) + _counter_delta(value, prev.get(key))
            prev = cur
        return out, h.scrapes[-1].t - h.scrapes[0].t

    def _rates_by(
        self,
        hs: Sequence[_History],
        name: str,
        key: str,
        match: Callable[[dict[str, str]], bool] | None = None,
    ) -> dict[str, float]:
        out: dict[str, float] = {}
        for h in hs:
            increase, span = self._increase(h, lambda scrape: scrape.by_label(name, key, match))
            for label, value in increase.items():
                out[label] = out.get(label, 0.0) + value / span
        return out

    def _rate(
        self, hs: Sequence[_History], name: str, match: Callable[[dict[str, str]], bool] | None = None
    ) -> float | None:
        if not any(len(h.scrapes) > 1 for h in hs):
            return None
        return sum(self._rates_by(hs, name, "", match).values())

    def _quantile(self, hs: Sequence[_History], bucket_name: str, q: float = QUANTILE) -> float | None:
        """Quantile `q` (p95) of the observations inside the window, summed over members (bucket increases)."""
        buckets: dict[float, float] = {}
        for h in hs:
            increase, _ = self._increase(h, lambda scrape: scrape.by_label(bucket_name, "le"))
            for le, value in increase.items():
                buckets[float(le)] = buckets.get(float(le), 0.0) + value
        return histogram_quantile(q, buckets)


__all__ = ["ScrapeSignals"]
