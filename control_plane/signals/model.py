"""The signal model: what the autoscaler and the degradation controller decide on, from either source.

Used by both readers (control_plane/signals/scrape.py, prometheus.py), by the autoscaler's policy
and loop, the degradation ladder, the simulator and the admin API (``Signals.to_dict``).

    source = ScrapeSignals.from_registry(registry, http)            # embedded: scrapes /metrics
    source = PrometheusSignals("http://127.0.0.1:9090", http)       # --prometheus URL (signals/prometheus.py)
    signals = await source.read()
    if not signals.complete:
        log.info("holding: missing %s", ", ".join(signals.missing))
    signals.waiting_per_shard, signals.ttft_p95_s, signals.demand_by_tier["free"]

Both sources yield the same :class:`Signals`. Missing or stale metrics are a signal in
themselves, never a zero: an unscrapable shard makes ``complete`` False and is named in
``missing``; a value that cannot be known is ``None``. Rates and percentiles are taken over a
window (``window_s``), from counter and histogram-bucket deltas (``ScrapeSignals`` (signals/scrape.py) keeps the
scrapes of the last window per member; ``PrometheusSignals`` asks PromQL ``rate()``).

What counts:

- shards: members of service ``shard``. ``passing`` ones are the routable fleet: their
  running/waiting/KV gauges make the per-shard figures, and a failed scrape of one of them
  makes the signals incomplete. ``draining`` and ``critical`` ones are listed (not averaged):
  the routers already ignore them.
- waiting counts every request that waits for a batch slot: the shards' own queues
  (``vllm:num_requests_waiting``) plus the gateways' admission queues
  (``switchboard_admission_queue_depth``), where the gateways hold requests once the shards'
  slots are taken. ``waiting_per_shard`` is that sum over the passing shards.
- gateways: members of service ``gateway`` give TTFT (``switchboard_gateway_ttft_seconds``),
  error rate, tokens/s and per-tier demand and rejections (429 and 503). Without any gateway,
  TTFT and tokens/s come from the shards (``vllm:time_to_first_token_seconds``,
  ``vllm:generation_tokens``) and the per-tier figures are empty.

Overload is a queue, not a long prompt: TTFT grows with prefill, which grows with the prompt and
not with load. So next to raw TTFT (kept for operators and the SLO) the signals carry what does
mean overload, and only these drive the ladder and the autoscaler:

- ``queue_time_p95_s``: time waiting for a batch slot, p95 over the window: the gateways' admission
  wait (``switchboard_admission_wait_seconds``) plus the shards' own queue
  (``vllm:request_queue_time_seconds``);
- ``ttft_excess_p95_s``: TTFT beyond what the prompt explains: the shards' TTFT p95 minus their
  prefill-time p95 (``vllm:request_prefill_time_seconds``; same buckets, so one long prompt cancels
  out), plus the admission wait p95;
- ``batch_usage``: running / batch slots, mean over passing shards (with ``kv_usage`` and
  ``waiting_per_shard``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from prometheus_client.parser import text_string_to_metric_families

QUANTILE = 0.95
REJECTED_STATUSES = frozenset({"429", "503"})
SHED_CODES = ("overloaded",)
"""Error codes of deliberate load shedding, left out of the error rate."""
STORE_DOWN_CODES = ("cache_unavailable", "cache_backend_unavailable")
"""5xx codes that say a session store is down (a cache node, Redis), not that the fleet is overloaded:
left out of the error rate the ladder and the autoscaler read, since shedding load cannot bring a store
back. Counted, a Redis outage (every session turn a 503) took the ladder to its top level and shed the
whole free tier, sessionless requests included. The SLO's error budget (alerts/) still counts them."""
NOT_OVERLOAD_CODES = SHED_CODES + STORE_DOWN_CODES

# metric names (sample names, as exposed)
M_RUNNING = "vllm:num_requests_running"
M_WAITING = "vllm:num_requests_waiting"
M_KV = "vllm:kv_cache_usage_perc"
M_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
M_PREFIX_HITS = "vllm:prefix_cache_hits_total"
M_PREFIX_BYTES = "switchboard_shard_prefix_cache_bytes"
M_MAX_SEQS = "switchboard_shard_max_num_seqs"
M_SHARD_TTFT = "vllm:time_to_first_token_seconds_bucket"
M_SHARD_TOKENS = "vllm:generation_tokens_total"
M_GW_TTFT = "switchboard_gateway_ttft_seconds_bucket"
M_SHARD_ITL = "vllm:inter_token_latency_seconds_bucket"
M_GW_REQUESTS = "switchboard_gateway_requests_total"
M_GW_TOKENS = "switchboard_gateway_tokens_total"
M_GW_QUEUE = "switchboard_admission_queue_depth"
M_GW_WAIT = "switchboard_admission_wait_seconds_bucket"
M_SHARD_QUEUE = "vllm:request_queue_time_seconds_bucket"
M_SHARD_PREFILL = "vllm:request_prefill_time_seconds_bucket"
M_SHARD_E2E = "vllm:e2e_request_latency_seconds_bucket"


@dataclass(frozen=True)
class ShardSignal:
    """One shard as last read. Values of a shard never read are NaN (never 0)."""

    member_id: str
    running: float
    waiting: float
    kv_usage: float
    max_num_seqs: float
    ttft_p95_s: float | None
    """Over the window, from the shard's own histogram; None without first tokens in it."""
    error: str | None
    """Why the last scrape failed; None when it worked."""
    stale: bool
    """True when the values are not from this read (scrape failed, member not passing)."""
    status: str = "passing"
    """The member's registry status: passing | draining | critical."""
    url: str = ""
    prefix_hit_rate: float | None = None
    """Prompt tokens found in its prefix cache / looked up, over the window (either reader);
    None without lookups."""
    prefix_cache_bytes: float | None = None
    """KV bytes its prefix cache holds (None: not exported, e.g. another engine)."""


@dataclass(frozen=True)
class Signals:
    """One reading of the cluster. ``None`` means unknown; see ``missing`` for why."""

    at: float
    """Unix time of the read."""
    shards: tuple[ShardSignal, ...]
    healthy_shards: int
    """Passing shards (the routable fleet)."""
    waiting_per_shard: float | None
    """(Shards' waiting + gateways' admission queues) / passing shards; None if any part is unknown
    or no shard passes."""
    ttft_p95_s: float | None
    """Over the window, gateway-observed (or shard-observed without gateways); None: no first token."""
    error_rate: float | None
    """5xx share of gateway requests over the window; None without requests."""
    tokens_per_s: float | None
    """Completion tokens per second over the window."""
    kv_usage: float | None
    """Mean KV-cache usage (0..1) over passing shards."""
    demand_by_tier: Mapping[str, float]
    """Chat requests per second arriving at gateways, by tier (all outcomes)."""
    rejections_by_tier: Mapping[str, float]
    """429 + 503 answers per second, by tier."""
    complete: bool
    """False if any needed source was missing or stale: act on nothing then."""
    missing: tuple[str, ...]
    """What was missing, in words, for the decision log."""
    load_per_shard: float | None = None
    """(Running + waiting, as in ``waiting_per_shard``) / passing shards."""
    capacity_per_shard: float | None = None
    """Mean batch slots (``switchboard_shard_max_num_seqs``) over passing shards."""
    window_s: float = 0.0
    """The span the rates and percentiles cover (shorter than configured right after start)."""
    source: str = ""
    """``scrape`` | ``prometheus``."""
    gateway_queue: float | None = None
    """Requests waiting in the gateways' admission queues (0 without gateways); None if unknown."""
    ttft_p50_s: float | None = None
    """Median time to first token over the window (same source as ``ttft_p95_s``); display only."""
    tpot_s: float | None = None
    """Median inter-token latency over the window, from the shards; display only."""
    shed_per_s: float = 0.0
    """Requests per second the gateways shed on purpose (503 `overloaded`): demand the fleet is
    not serving, so low admitted load then does not mean the fleet is too big."""
    batch_usage: float | None = None
    """Mean running / batch slots (0..1) over passing shards; None when unknown."""
    admission_wait_p95_s: float | None = None
    """p95 of the gateways' admission wait over the window; None: nothing admitted in it."""
    shard_queue_p95_s: float | None = None
    """p95 of the shards' queue time (``vllm:request_queue_time_seconds``); None: nothing admitted."""
    prefill_p95_s: float | None = None
    """p95 of the shards' prefill time (``vllm:request_prefill_time_seconds``); grows with prompts."""
    shard_ttft_p95_s: float | None = None
    """p95 of the shards' own TTFT (arrival at the engine to first token), same buckets as prefill."""
    queue_time_p95_s: float | None = None
    """Admission wait p95 + shard queue p95 (None when neither is known): waiting for a slot."""
    ttft_excess_p95_s: float | None = None
    """TTFT beyond what the prompt explains: max(0, shard TTFT p95 - prefill p95) + admission wait
    p95; None without first tokens in the window. Unlike raw TTFT, one long prompt leaves it ~0."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (NaN becomes None), for the admin API and the decision log."""
        out: dict[str, Any] = _json_safe(asdict(self))
        return out

    def summary(self) -> dict[str, Any]:
        """The aggregate inputs without the per-shard list (decision-log sized)."""
        out = self.to_dict()
        out.pop("shards")
        return out


class SignalSource(Protocol):
    """Where signals come from. `read` is called by the autoscaler and the degradation
    controller on their ticks (possibly both); it never raises for a broken member or source:
    that is reported in ``Signals.missing``."""

    async def read(self) -> Signals: ...


# -- shared math ------------------------------------------------------------------------------


Sample = tuple[str, tuple[tuple[str, str], ...], float]  # (name, sorted labels, value)


def parse_exposition(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition, label sets sorted."""
    out: list[Sample] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.append((s.name, tuple(sorted(s.labels.items())), float(s.value)))
    return out


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """PromQL's ``histogram_quantile`` over cumulative bucket counts ``{le: count}``; None when
    empty. Linear within the bucket; a rank in the +Inf bucket answers the highest finite bound."""
    les = sorted(buckets)
    if not les or buckets[les[-1]] <= 0:
        return None
    total = buckets[les[-1]]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le in les:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return les[-1] if not math.isinf(les[-1]) else prev_le


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value



@dataclass(frozen=True)
class Pressure:
    """The one definition of *under pressure*: a queue now, or busy batches, or a nearly full KV cache.
    The only state in which latency means overload (one long prompt on an idle fleet has a high TTFT
    but none of these). The degradation rule and the autoscaler both hold one (``config.pressure``).

        Pressure().on(signals)          # True / False
        Pressure(busy_kv_usage=0.9)     # validated: thresholds in (0, 1]
    """

    busy_batch_usage: float = 0.75
    """Batch usage (running / slots, mean over passing shards) from which the fleet is busy without a queue."""
    busy_kv_usage: float = 0.85
    """KV-cache usage (0..1) from which the fleet is busy without a queue."""

    def __post_init__(self) -> None:
        if not (0 < self.busy_batch_usage <= 1 and 0 < self.busy_kv_usage <= 1):
            raise ValueError("pressure thresholds busy_batch_usage and busy_kv_usage must be in (0, 1]")

    def on(self, s: Signals) -> bool:
        """Whether `s` shows pressure (a missing figure counts as none)."""
        return ((s.waiting_per_shard or 0.0) > 0.0 or (s.batch_usage or 0.0) >= self.busy_batch_usage
                or (s.kv_usage or 0.0) >= self.busy_kv_usage)

def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def aggregate(
    *,
    at: float,
    shards: Sequence[ShardSignal],
    missing: list[str],
    ttft_p95_s: float | None,
    error_rate: float | None,
    tokens_per_s: float | None,
    demand: Mapping[str, float],
    rejections: Mapping[str, float],
    window_s: float,
    source: str,
    gateway_queue: float | None = 0.0,
    shed_per_s: float = 0.0,
    ttft_p50_s: float | None = None,
    tpot_s: float | None = None,
    admission_wait_p95_s: float | None = None,
    shard_queue_p95_s: float | None = None,
    prefill_p95_s: float | None = None,
    shard_ttft_p95_s: float | None = None,
) -> Signals:
    """Per-shard readings → fleet figures; any passing shard that is stale poisons the means."""
    passing = [s for s in shards if s.status == "passing"]
    fresh = [s for s in passing if not s.stale]
    for s in passing:
        if s.stale:
            missing.append(f"{s.member_id}: {s.error or 'stale'}")
    if not passing:
        missing.append("shards: none passing")
    known = bool(passing) and len(fresh) == len(passing) and gateway_queue is not None
    queued = gateway_queue or 0.0
    n = len(passing)
    usage = [s.running / s.max_num_seqs for s in fresh if s.max_num_seqs > 0]
    return Signals(
        at=at,
        shards=tuple(shards),
        healthy_shards=len(passing),
        waiting_per_shard=(sum(s.waiting for s in fresh) + queued) / n if known else None,
        ttft_p95_s=ttft_p95_s,
        error_rate=error_rate,
        tokens_per_s=tokens_per_s,
        kv_usage=_mean([s.kv_usage for s in fresh]) if known else None,
        demand_by_tier=dict(demand),
        rejections_by_tier=dict(rejections),
        complete=not missing,
        missing=tuple(missing),
        load_per_shard=(sum(s.running + s.waiting for s in fresh) + queued) / n if known else None,
        capacity_per_shard=_mean([s.max_num_seqs for s in fresh]) if known else None,
        window_s=window_s,
        source=source,
        gateway_queue=gateway_queue,
        shed_per_s=shed_per_s,
        ttft_p50_s=ttft_p50_s,
        tpot_s=tpot_s,
        batch_usage=_mean(usage) if known and usage else None,
        admission_wait_p95_s=admission_wait_p95_s,
        shard_queue_p95_s=shard_queue_p95_s,
        prefill_p95_s=prefill_p95_s,
        shard_ttft_p95_s=shard_ttft_p95_s,
        queue_time_p95_s=_sum_known(admission_wait_p95_s, shard_queue_p95_s),
        ttft_excess_p95_s=ttft_excess(shard_ttft_p95_s, prefill_p95_s, admission_wait_p95_s),
    )


OVERLOAD_HISTOGRAMS = (M_SHARD_QUEUE, M_SHARD_PREFILL)
"""What a shard that has finished requests must also export, or the overload figures go blind."""


def overload_histograms_missing(names: set[str]) -> str | None:
    """Why a shard's exposition (sample names) leaves the overload figures blind, or None: it has
    finished requests (``vllm:e2e_request_latency_seconds``, observed with prefill time at the end
    of each) but lacks the queue or prefill histogram (renamed, an engine that does not export
    it). Incomplete, never a silent zero."""
    if M_SHARD_E2E not in names:
        return None
    lacking = [m.removesuffix("_bucket") for m in OVERLOAD_HISTOGRAMS if m not in names]
    return f"exports no {', '.join(lacking)} (overload signals would be blind)" if lacking else None


def _sum_known(*values: float | None) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def ttft_excess(shard_ttft_s: float | None, prefill_s: float | None, admission_wait_s: float | None) -> float | None:
    """TTFT beyond what the prompt explains (see ``Signals.ttft_excess_p95_s``); None without TTFT."""
    if shard_ttft_s is None:
        return admission_wait_s
    beyond = max(0.0, shard_ttft_s - (prefill_s or 0.0))
    return beyond + (admission_wait_s or 0.0)


__all__ = [
    "ShardSignal",
    "SignalSource",
    "Signals",
    "aggregate",
    "histogram_quantile",
    "overload_histograms_missing",
    "parse_exposition",
    "ttft_excess",
]
