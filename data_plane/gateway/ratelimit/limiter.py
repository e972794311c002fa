"""Exact rate limits: requests and tokens per minute, per API key and per tier, across gateways.

    limiter = RateLimiter(LocalBackend(), RateLimitMetrics(registry), tier_rpm={"free": 600})
    grant = await limiter.admit(principal.key_id, tier, tokens=prompt_tokens + max_tokens)  # or RateLimited
    response.headers.update(grant.headers)       # x-ratelimit-{limit,remaining,reset}-{requests,tokens}
    limiter.settle_later(grant, usage.total_tokens)   # charge or refund the estimate's difference

What is limited. Each API key gets its tier's ``rpm`` and ``tpm`` (:mod:`data_plane.tiers`).
Optionally a whole tier also has an aggregate allowance over all its keys (gateway settings
``--tier-rpm free=600`` / ``--tier-tpm free=200000``); a request must fit every bucket that
applies, and takes from all of them or from none. Tokens are taken at admission as an
estimate (the gateway's prompt count + ``max_tokens``) and settled after the completion with
the real ``usage.total_tokens``: the difference is refunded or charged. A request the server
itself failed before any generation (shed by admission, no shard: a 5xx) also gets its request
back (``settle(..., refund_request=True)``): a client that honours ``Retry-After`` through an
overload is not then refused with 429s for the retries it was told to make.

A request that needs more than a whole minute's allowance (``max_tokens`` plus the prompt above the
TPM) can never fit: it is refused at once with 429 "Request too large" (as OpenAI does) and
``x-should-retry: false``, so the openai SDKs raise it instead of retrying it after ``Retry-After``.
A request without ``max_tokens`` is not counted with its tier's whole output cap when that cap does not
fit: the gateway lowers its default cap to what :meth:`RateLimiter.token_allowance` leaves after the
prompt (data_plane/gateway/phases.py, ``Checked.within_tpm``), so only a prompt too large by itself is refused.

The algorithm is a token bucket (equivalently GCRA): a bucket of ``limit`` per minute
refills continuously at ``limit``/60 s and holds at most ``limit``, so any interval of *t*
seconds admits at most ``limit * (1 + t/60)`` units, and a burst of exactly ``limit`` from a
full bucket. It is exact, not sampled or approximated: the state is two integers (the fill
in units x microseconds, and when) and all arithmetic is integer, here and in the Redis
script, so e.g. 7 RPM admits a burst of exactly 7. This is the OpenAI semantics: after one
request at 60 RPM, ``remaining-requests`` is 59 and ``reset-requests`` is ``1s`` (the time
until the bucket is full again).

Backends (by name, :data:`~data_plane.gateway.ratelimit.buckets.BACKENDS`), behind the
:class:`~data_plane.gateway.ratelimit.buckets.Backend` protocol (data_plane/gateway/ratelimit/buckets.py):

- ``local``: this process's memory. Exact for one gateway; with N gateways each limits
  alone (an N-fold overshoot), so use it only for one gateway.
- ``redis``: one Lua script per request takes from every bucket atomically on one Redis
  server (a single server or a failover pair, not Redis Cluster: a request's buckets live
  in different hash slots), timed by the server's clock, so any number of gateways share
  one exact limit.

When Redis is unreachable the limiter **fails open to local**: each gateway goes on
limiting alone until Redis answers again (checked at most every ``retry_s``), so service
stays up and a key can get at most N times its limit from N gateways meanwhile, never an
unlimited amount. The gauge ``switchboard_ratelimit_backend_up`` drops to 0, errors count in
``switchboard_ratelimit_backend_errors_total`` and a warning is logged on each change.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge

from data_plane.common.errors import RateLimited
from data_plane.gateway.ratelimit.buckets import (
    BACKENDS,
    Backend,
    BackendUnavailable,
    Bucket,
    BucketState,
    LocalBackend,
    RedisBackend,
)
from data_plane.tiers import Tier, TierPolicy

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

KINDS = ("requests", "tokens")
BACKEND_OPS = ("take", "adjust", "peek")
"""switchboard_ratelimit_backend_errors_total's op label: the Backend calls `_mark_down` counts."""
NO_RETRY_HEADER = "x-should-retry"
"""Set to ``false`` on a request that can never fit its limit (the openai SDKs' own retry switch)."""


class RateLimitMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.rejections = Counter(
            "switchboard_ratelimit_rejections",
            "Requests refused with 429, by the kind of limit that refused them (requests|tokens).",
            ["tier", "kind"], registry=registry)
        self.backend_up = Gauge(
            "switchboard_ratelimit_backend_up",
            "1 while the shared limiter backend answers; 0 = failed open to this gateway's own local limits.",
            registry=registry)
        self.backend_errors = Counter(
            "switchboard_ratelimit_backend_errors",
            "Limiter backend calls that failed, by operation (take|adjust|peek).", ["op"], registry=registry)
        self.limit = Gauge(
            "switchboard_ratelimit_limit",
            "The per-minute limits this gateway enforces now, from the tier policy in force (a PUT /admin/v1/tiers "
            "shows here once the gateway applied it): by tier, kind (requests|tokens) and scope (key: each API key "
            "of the tier; tier: all its keys together, --tier-rpm/--tier-tpm).",
            ["tier", "kind", "scope"], registry=registry)
        self.backend_up.set(1)
        for op in BACKEND_OPS:  # at 0 from the start: a calm system's panel reads 0, not "No data"
            self.backend_errors.labels(op)

    def show_policy(self, policy: TierPolicy, tier_rpm: Mapping[str, int] | None = None,
                    tier_tpm: Mapping[str, int] | None = None) -> None:
        """Put the limits of `policy` (and the per-tier aggregates) in the `limit` gauge; a tier no longer
        in the policy leaves it."""
        self.limit.clear()
        for tier in map(policy.get, policy.names()):
            for kind in KINDS:  # at 0 from the start: a tier never refused reads 0, not "No data"
                self.rejections.labels(tier.name, kind)
            self.limit.labels(tier.name, "requests", "key").set(tier.rpm)
            self.limit.labels(tier.name, "tokens", "key").set(tier.tpm)
        for kind, aggregate in (("requests", tier_rpm or {}), ("tokens", tier_tpm or {})):
            for name, value in aggregate.items():
                self.limit.labels(name, kind, "tier").set(value)


# -- the limiter the gateway uses -----------------------------------------------------------


def format_reset(us: int) -> str:
    """OpenAI's (Go's) duration format: ``17ms``, ``1s``, ``1.5s``, ``6m0s``, ``1h0m0s``."""
    if us <= 0:
        return "0s"
    ms = -(-us // 1000)
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    out = f"{hours}h" if hours else ""
    if hours or minutes:
        out += f"{minutes}m"
    return out + f"{seconds}s"


@dataclass
class Grant:
    """An admitted request's standing: its response headers and the estimate to settle."""

    headers: dict[str, str]
    tokens: int
    token_buckets: list[Bucket]
    backend: Backend
    settled: bool = field(default=False)
    request_buckets: list[Bucket] = field(default_factory=list)


class RateLimiter:
    """Per-key and per-tier RPM/TPM for the gateway; see the module docstring."""

    def __init__(self, backend: Backend, metrics: RateLimitMetrics, *,
                 tier_rpm: Mapping[str, int] | None = None, tier_tpm: Mapping[str, int] | None = None,
                 fallback: Backend | None = None, retry_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.metrics = metrics
        self.tier_rpm = dict(tier_rpm or {})
        self.tier_tpm = dict(tier_tpm or {})
        self.fallback = fallback
        self.retry_s = retry_s
        self._clock = clock
        self._down_until = 0.0
        self._pending: set[asyncio.Task[None]] = set()

    def show_policy(self, policy: TierPolicy) -> None:
        """The tier policy in force changed (or was first read): show its limits in /metrics."""
        self.metrics.show_policy(policy, self.tier_rpm, self.tier_tpm)

    def buckets(self, key_id: str, tier: Tier, tokens: int) -> list[Bucket]:
        out = [Bucket(f"key:{key_id}", "requests", tier.rpm, 1),
               Bucket(f"key:{key_id}", "tokens", tier.tpm, tokens)]
        if tier.name in self.tier_rpm:
            out.append(Bucket(f"tier:{tier.name}", "requests", self.tier_rpm[tier.name], 1))
        if tier.name in self.tier_tpm:
            out.append(Bucket(f"tier:{tier.name}", "tokens", self.tier_tpm[tier.name], tokens))
        return out

    def token_allowance(self, tier: Tier) -> int:
        """The most tokens one request of `tier` can ever take: the tightest TPM that applies to it."""
        return min(tier.tpm, self.tier_tpm.get(tier.name, tier.tpm))

    async def admit(self, key_id: str, tier: Tier, tokens: int, too_large_hint: str = "") -> Grant:
        """Take one request and `tokens` from every bucket of this key and tier, or raise
        :class:`RateLimited` (429, ``Retry-After``) carrying the same ``x-ratelimit-*`` headers
        (`too_large_hint` ends the message when `tokens` can never fit)."""
        tokens = max(0, int(tokens))
        with tracer.start_as_current_span("ratelimit") as span:
            buckets = self.buckets(key_id, tier, tokens)
            states, backend = await self._take(buckets)
            headers = _headers(buckets, states)
            span.set_attribute("switchboard.ratelimit.tokens_estimate", tokens)
            span.set_attribute("switchboard.ratelimit.remaining_requests",
                               int(headers["x-ratelimit-remaining-requests"]))
            span.set_attribute("switchboard.ratelimit.remaining_tokens",
                               int(headers["x-ratelimit-remaining-tokens"]))
            if all(s.allowed for s in states):
                span.set_attribute("switchboard.ratelimit.allowed", True)
                return Grant(headers, tokens, [b for b in buckets if b.kind == "tokens"], backend,
                             request_buckets=[b for b in buckets if b.kind == "requests"])
            span.set_attribute("switchboard.ratelimit.allowed", False)
            raise self._refusal(tier, buckets, states, headers, span, too_large_hint)

    async def peek(self, key_id: str, tier: Tier) -> dict[str, str]:
        """The ``x-ratelimit-*`` headers of this key and tier as they stand, taking nothing: for a response
        refused before the limiter (the degradation ladder's 503s), which must cost no quota. Empty when
        no backend answers (the headers are then left out, the refusal is not delayed or failed)."""
        buckets = [Bucket(b.scope, b.kind, b.limit, 0, b.period_us) for b in self.buckets(key_id, tier, 0)]
        backend = self.backend
        if self.fallback is not None and self._clock() < self._down_until:
            backend = self.fallback
        try:
            return _headers(buckets, await backend.peek(buckets))
        except BackendUnavailable as exc:
            if self.fallback is None or backend is self.fallback:
                return {}
            self._mark_down("peek", exc)
            return _headers(buckets, await self.fallback.peek(buckets))

    def _refusal(self, tier: Tier, buckets: list[Bucket], states: list[BucketState], headers: dict[str, str],
                 span: trace.Span, too_large_hint: str = "") -> RateLimited:
        refused = [(b, s) for b, s in zip(buckets, states) if not s.allowed]
        # The binding limit is the one that keeps the request out longest (never = longest of all).
        b, s = max(refused, key=lambda bs: math.inf if bs[1].retry_us < 0 else bs[1].retry_us)
        self.metrics.rejections.labels(tier.name, b.kind).inc()
        span.set_attribute("switchboard.ratelimit.kind", b.kind)
        whose = "this API key" if b.scope.startswith("key:") else f"the {tier.name} tier (all keys together)"
        extra: dict[str, str] = {}
        if s.retry_us < 0:
            wait_us = b.period_us
            message = (f"Request too large for {whose}: it needs {b.cost} {b.kind} but the limit is "
                       f"{b.limit} {b.kind} per minute. Shorten the prompt or lower max_tokens."
                       + (f" {too_large_hint}" if too_large_hint and b.kind == "tokens" else ""))
            # Retrying the same request can never succeed: the openai SDKs obey this header before the status,
            # so they raise at once; without it they waited out Retry-After twice (2 minutes) for the same 429.
            extra[NO_RETRY_HEADER] = "false"
        else:
            wait_us = s.retry_us
            message = (f"Rate limit reached for {b.kind} per minute on {whose} ({tier.name} tier): limit "
                       f"{b.limit}, remaining {s.remaining}, requested {b.cost}. "
                       f"Please try again in {format_reset(wait_us)}.")
        retry_s = max(1, math.ceil(wait_us / 1_000_000))
        return RateLimited(message, limit=b.kind, retry_after=retry_s,
                           headers={**headers, "retry-after-ms": str(max(1, -(-wait_us // 1000))), **extra})

    async def _take(self, buckets: list[Bucket]) -> tuple[list[BucketState], Backend]:
        if self.fallback is None:
            return await self.backend.take(buckets), self.backend
        if self._clock() >= self._down_until:
            try:
                states = await self.backend.take(buckets)
            except BackendUnavailable as exc:
                self._mark_down("take", exc)
            else:
                self._mark_up()
                return states, self.backend
        return await self.fallback.take(buckets), self.fallback

    def _mark_down(self, op: str, exc: Exception) -> None:
        self.metrics.backend_errors.labels(op).inc()
        if self._down_until == 0.0:
            log.warning("rate-limit backend unreachable (%s); failing open to per-gateway local limits "
                        "until it answers again", exc)
        self._down_until = self._clock() + self.retry_s
        self.metrics.backend_up.set(0)

    def _mark_up(self) -> None:
        if self._down_until != 0.0:
            log.warning("rate-limit backend answers again; limits are shared across gateways again")
            self._down_until = 0.0
            self.metrics.backend_up.set(1)

    async def settle(self, grant: Grant, used_tokens: int, refund_request: bool = False) -> None:
        """Charge or refund ``used_tokens - grant.tokens`` on the token buckets (once per grant), and
        give the request back when `refund_request` (the server failed it before any work)."""
        adjusted = _settlement(grant, used_tokens, refund_request)
        if adjusted is None:
            return
        try:
            await grant.backend.adjust(adjusted)
        except BackendUnavailable as exc:
            self._mark_down("adjust", exc)

    def settle_later(self, grant: Grant, used_tokens: int, refund_request: bool = False) -> None:
        """:meth:`settle` in a task of its own: never delays a response, never dies with a client.
        In-process buckets involve no I/O: settled right here (a task per request costs more)."""
        if grant.settled:
            return
        if isinstance(grant.backend, LocalBackend):
            adjusted = _settlement(grant, used_tokens, refund_request)
            if adjusted is not None:
                grant.backend.adjust_now(adjusted)
            return
        loop = asyncio.get_running_loop()
        task = loop.create_task(self.settle(grant, used_tokens, refund_request), name="ratelimit.settle")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def aclose(self) -> None:
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=2.0)
        await self.backend.aclose()
        if self.fallback is not None:
            await self.fallback.aclose()


def _settlement(grant: Grant, used_tokens: int, refund_request: bool = False) -> list[Bucket] | None:
    """Mark `grant` settled; the bucket adjustments still to apply (None: nothing to do)."""
    if grant.settled:
        return None
    grant.settled = True
    delta = int(used_tokens) - grant.tokens
    out = [Bucket(b.scope, b.kind, b.limit, delta, b.period_us) for b in grant.token_buckets] if delta else []
    if refund_request:
        out += [Bucket(b.scope, b.kind, b.limit, -b.cost, b.period_us) for b in grant.request_buckets]
    return out or None


def _headers(buckets: Sequence[Bucket], states: Sequence[BucketState]) -> dict[str, str]:
    """The OpenAI trio per kind, from the bucket that binds: refused first, then least remaining."""
    headers: dict[str, str] = {}
    for kind in KINDS:
        pairs = [(b, s) for b, s in zip(buckets, states) if b.kind == kind]
        b, s = min(pairs, key=lambda bs: (bs[1].allowed, bs[1].remaining))
        headers[f"x-ratelimit-limit-{kind}"] = str(b.limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(s.remaining)
        headers[f"x-ratelimit-reset-{kind}"] = format_reset(s.reset_us)
    return headers


def build_limiter(backend: str, metrics: RateLimitMetrics, *, redis_url: str | None = None,
                  tier_rpm: Mapping[str, int] | None = None, tier_tpm: Mapping[str, int] | None = None,
                  known_tiers: Iterable[str] = ()) -> RateLimiter:
    """The gateway's limiter from its settings: ``local``, or ``redis`` failing open to local."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown rate-limit backend {backend!r}; choose from {sorted(BACKENDS)}")
    known = set(known_tiers)
    unknown = sorted((set(tier_rpm or {}) | set(tier_tpm or {})) - known) if known else []
    if unknown:  # the control plane's hot policy may still bring them
        log.warning("per-tier rate limits name tiers the local policy lacks: %s", ", ".join(unknown))
    if backend == "redis":
        if not redis_url:
            raise ValueError("the redis rate-limit backend needs --redis-url (e.g. redis://127.0.0.1:6379/0)")
        return RateLimiter(RedisBackend(redis_url), metrics, tier_rpm=tier_rpm, tier_tpm=tier_tpm,
                           fallback=LocalBackend())
    return RateLimiter(LocalBackend(), metrics, tier_rpm=tier_rpm, tier_tpm=tier_tpm)
