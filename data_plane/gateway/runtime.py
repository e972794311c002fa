"""What one gateway process holds: `Gateway` (built from the settings before serving) and `Runtime`
(the connections, membership and routing, built once in the lifespan, closed with it).

    gw = build_gateway(settings)                        # keys, tiers, safety, metrics, limiter, ledger
    async with contextlib.AsyncExitStack() as stack:
        rt = await open_runtime(gw, stack)              # every field set; the stack closes them in reverse
        ...                                             # serve: ChatHandler(gw, rt, request)

Called by data_plane/gateway/app.py (the lifespan and the app's routes); data_plane/gateway/chat.py
reads both per request. Nothing here is Optional-until-started: a `Runtime` exists only once
everything in it does.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from pydantic import AnyHttpUrl

from data_plane.cache.client import SessionStore
from data_plane.common.crypto import Keyring, SealMetrics, TranscriptSealer
from data_plane.common.hop_auth import cluster_headers, cluster_token_from_env
from data_plane.common.tls import TlsConfig
from data_plane.gateway.abuse import AbuseGuard, AbuseGuardMetrics
from data_plane.gateway.admission import Admission, AdmissionConfig, AdmissionMetrics, shard_capacity
from data_plane.gateway.auth import KeyStore, Principal
from data_plane.gateway.batched_edits import BatchedEdits
from data_plane.gateway.client_address import ClientAddress
from data_plane.gateway.cluster_state import ClusterStateView, HttpClusterState, StaticClusterState
from data_plane.gateway.context import TokenCounter
from data_plane.gateway.keys_file import KeysFileReload, checked_keys, hot_keys
from data_plane.gateway.memory import MemoryMetrics
from data_plane.gateway.metrics import GatewayMetrics
from data_plane.gateway.ratelimit.limiter import RateLimiter, RateLimitMetrics, build_limiter
from data_plane.gateway.record_locks import RecordLocks
from data_plane.gateway.response_cache import ResponseCache, ResponseCacheMetrics
from data_plane.gateway.responses_metrics import ResponsesMetrics
from data_plane.gateway.revocation import InFlightKeys
from data_plane.gateway.safety.pipeline import SafetyMetrics, SafetyPolicies
from data_plane.gateway.settings import GatewaySettings
from data_plane.gateway.tier_gate import TierGate
from data_plane.gateway.usage import ledger_from_settings
from data_plane.ledger.writer import UsageLedger
from data_plane.membership.embedded import HttpMembership
from data_plane.membership.factory import membership_from_url
from data_plane.membership.view import Member, MembershipView, StaticMembership
from data_plane.routing.hop_client import HOP_EVENTS, HopPool
from data_plane.routing.latency import LatencyConfig
from data_plane.routing.outliers import OutlierConfig
from data_plane.routing.router import Router, RouterMetrics
from data_plane.routing.upstream import Upstream, UpstreamConfig
from data_plane.tiers import SAFETY_META, Tier, TierPolicy

log = logging.getLogger(__name__)


@dataclass
class Gateway:
    """What the settings describe, built before serving (`build_gateway`)."""

    settings: GatewaySettings
    keys: KeyStore
    tiers: TierPolicy
    safety: SafetyPolicies
    counter: TokenCounter
    registry: CollectorRegistry
    metrics: GatewayMetrics = field(init=False)
    safety_metrics: SafetyMetrics = field(init=False)
    admission_metrics: AdmissionMetrics = field(init=False)
    router_metrics: RouterMetrics = field(init=False)
    limiter: RateLimiter = field(init=False)
    ledger: UsageLedger | None = field(init=False)
    """One usage record per request (data_plane/ledger/writer.py); None with --usage-db off."""
    guard: AbuseGuard = field(init=False)
    """The control plane's abuse actions, applied per request (data_plane/gateway/abuse.py)."""
    record_locks: RecordLocks = field(init=False)
    """One writer at a time per conversation / session (data_plane/gateway/record_locks.py)."""
    index_edits: BatchedEdits = field(init=False)
    """Concurrent edits of one index record, applied by one rewrite (data_plane/gateway/batched_edits.py)."""
    tier_gate: TierGate = field(init=False)
    """Refuses a key whose tier the policy in force lacks (data_plane/gateway/tier_gate.py)."""
    policy: Callable[[], TierPolicy] = field(init=False)
    """The tier policy in force: the control plane's hot one once `open_runtime` watches it, else `tiers`."""
    inflight: InFlightKeys = field(init=False)
    """Generation requests in flight by key digest: a key gone from the keys in force ends its own
    (data_plane/gateway/revocation.py)."""

    def __post_init__(self) -> None:
        s = self.settings
        self.metrics = GatewayMetrics(self.registry)
        self.safety_metrics = SafetyMetrics(self.registry)
        self.safety_metrics.show(self.safety)
        self.admission_metrics = AdmissionMetrics(self.registry)
        self.router_metrics = RouterMetrics(self.registry)
        self.reply_metrics = ResponseCacheMetrics(self.registry)
        self.memory_metrics = MemoryMetrics(self.registry)
        self.responses_metrics = ResponsesMetrics(self.registry)
        self.limiter = build_limiter(s.ratelimit_backend, RateLimitMetrics(self.registry), redis_url=s.redis_url,
                                     tier_rpm=s.tier_rpm, tier_tpm=s.tier_tpm, known_tiers=self.tiers.names())
        self.ledger = ledger_from_settings(s, self.registry)
        self.guard = AbuseGuard(AbuseGuardMetrics(self.registry), ClientAddress(s.trusted_proxies))
        self.record_locks = RecordLocks()
        self.index_edits = BatchedEdits()
        self.tier_gate = TierGate(self.registry)
        self.policy = lambda: self.tiers
        self.show_policy(self.tiers)
        self.inflight = InFlightKeys(self.metrics.revoked)

    def show_policy(self, policy: TierPolicy) -> None:
        """The tier policy in force changed (or was first read): its limits in /metrics, and each tier's
        counters at 0 from the start, so a panel of a calm system reads 0, not "No data"."""
        self.limiter.show_policy(policy)
        self.metrics.show_tiers(policy.names())
        self.admission_metrics.show_tiers(policy.names())

    def put_keys(self, keys: KeyStore) -> None:
        """Put `keys` in force (the keys file reloaded); requests of a key they lack end now."""
        old, self.keys = self.keys, keys
        self.inflight.reloaded(old, keys)

    def caller(self, request: Any) -> tuple[Principal, Tier]:
        """The principal of a request to a route other than a generation's, after the abuse guard (bans,
        blocked keys, throttles; 401s counted), and its tier in the policy in force (403 tier_removed)."""
        principal = self.guard.caller(self.keys, request)
        return principal, self.tier_gate.tier(principal, self.policy())


@dataclass(frozen=True)
class Runtime:
    """Everything the gateway opens to serve, built once in its lifespan (`open_runtime`)."""

    settings: GatewaySettings
    http: httpx.AsyncClient
    """For cache nodes, membership and the control plane; shards are called through `pool`."""
    pool: HopPool
    membership: MembershipView
    cluster: ClusterStateView
    """The degradation level and hot tier policy (a fixed level 0 without a control plane)."""
    router: Router
    upstream: Upstream
    sessions: SessionStore
    admission: Admission
    replies: ResponseCache | None = None
    """The response cache (None unless --response-cache)."""
    sealer: TranscriptSealer | None = None
    """Seals what leaves the gateway for a client or a cache node (transcripts, compaction items)."""

    def models(self) -> dict[str, int]:
        """Model id -> context window, from the shards' registration metadata."""
        found: dict[str, int] = {}
        for m in self.router.shards():
            name = m.meta.get("model") or self.settings.model_name
            ctx = int(m.meta.get("max_model_len") or self.settings.max_model_len)
            found[name] = min(found.get(name, ctx), ctx)
        return found or {self.settings.model_name: self.settings.max_model_len}


def _static_members(urls: list[AnyHttpUrl], service: str) -> list[Member]:
    return [Member(id=f"{service}-{i}", service=service, url=str(url).rstrip("/")) for i, url in enumerate(urls)]


async def open_runtime(gw: Gateway, stack: contextlib.AsyncExitStack) -> Runtime:
    """Open what the gateway serves with, in dependency order; `stack` closes it all in reverse
    (registration first, the HTTP client last)."""
    settings = gw.settings
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=settings.connect_timeout_s), limits=limits)
    stack.push_async_callback(http.aclose)
    stack.push_async_callback(gw.limiter.aclose)
    watcher = new_agent = None
    membership: MembershipView
    if settings.membership or settings.registry_url:
        watcher, new_agent = membership_from_url(settings.membership or settings.registry_url or "", http)
        await watcher.start()
        stack.push_async_callback(watcher.aclose)
        membership = watcher
    else:
        membership = StaticMembership(_static_members(settings.shard_urls, "shard")
                                      + _static_members(settings.cache_urls, "cache"))
    cluster: ClusterStateView = StaticClusterState()
    if settings.control_plane_url or settings.registry_url:
        watched = HttpClusterState(settings.control_plane_url or settings.registry_url or "", http,
                                   validate=lambda p: gw.safety.validate_names(p[n].safety for n in p),
                                   on_state_change=gw.metrics.control_plane_state_changes.inc)
        await watched.start()
        stack.push_async_callback(watched.aclose)
        cluster = watched
        gw.policy = lambda: watched.current().tiers or gw.tiers
        gw.show_policy(gw.policy())
        watched.subscribe(lambda: gw.show_policy(gw.policy()))  # an operator's PUT /tiers, in /metrics
        await gw.guard.connect(settings.control_plane_url or settings.registry_url or "", http,
                               cluster_headers(cluster_token_from_env()))
        stack.push_async_callback(gw.guard.aclose)
    if settings.keys_file:  # a key removed from the file stops working within a second (keys_file.py)
        hot = settings.control_plane_url or settings.registry_url  # its tiers come and go: hot_keys
        reload = KeysFileReload(settings.keys_file, (lambda: hot_keys(settings, gw.policy)) if hot else
                                (lambda: checked_keys(settings, gw.tiers)), gw.put_keys)
        reload.start()
        stack.push_async_callback(reload.aclose)
    if settings.trusted_proxies:
        log.info("client addresses: X-Forwarded-For believed from the trusted proxies %s only",
                 ", ".join(map(str, settings.trusted_proxies)))
    router = Router(membership, gw.router_metrics, policy=settings.routing_policy,
                    epsilon=settings.bounded_load_epsilon, eject_after=settings.eject_after,
                    eject_s=settings.eject_s, zone=settings.zone, zone_slack=settings.zone_spill_slack,
                    outliers=OutlierConfig(threshold=settings.outlier_failure_percent,
                                           request_volume=settings.outlier_request_volume,
                                           window_s=settings.outlier_window_s,
                                           max_ejection_percent=settings.outlier_max_ejection_percent),
                    latency=LatencyConfig(enabled=settings.latency_aware, decay_s=settings.latency_decay_s,
                                          spill_factor=settings.latency_spill_factor,
                                          spill_floor_s=settings.latency_spill_floor_s,
                                          min_slow_samples=settings.latency_spill_min_samples,
                                          slow_window_s=settings.latency_slow_window_s))
    hop_events = {event: gw.metrics.hop_connections.labels(event) for event in HOP_EVENTS}
    pool = HopPool(connect_timeout_s=settings.connect_timeout_s, on_event=lambda event: hop_events[event].inc())
    stack.push_async_callback(pool.aclose)
    upstream = Upstream(router, pool, UpstreamConfig(
        connect_timeout_s=settings.connect_timeout_s, first_token_timeout_s=settings.first_token_timeout_s,
        idle_timeout_s=settings.idle_timeout_s, silence_timeout_s=settings.silence_timeout_s,
        retries=settings.retries, resumes=settings.resumes, resume_wait_s=settings.resume_wait_s), headers=cluster_headers(cluster_token_from_env()))
    keys = Keyring.from_settings(keys_file=settings.session_keys_file, keys_env=settings.session_keys,
                                 cluster_token=cluster_token_from_env())
    log.info("session transcripts are encrypted at rest (AES-256-GCM, key %s, %s)", keys.current, keys.source)
    sealer = TranscriptSealer(keys, SealMetrics(gw.registry))
    sessions = SessionStore(membership, pool, registry=gw.registry, sealer=sealer,
                            headers=cluster_headers(cluster_token_from_env()), zone=settings.zone)
    stack.push_async_callback(sessions.aclose)
    if watcher is not None:
        watcher.subscribe(sessions.on_membership_change)  # a rejoining node is repaired at once
    if isinstance(watcher, HttpMembership):  # it knows every member's status, draining ones too
        known = watcher
        watcher.subscribe(lambda: upstream.drop_lost({m.id: m.status for m in known.all_members("shard")}))
    config = AdmissionConfig(max_inflight=settings.max_inflight, inflight_per_slot=settings.inflight_per_slot,
                             reserve=settings.admission_reserve, queue_size=settings.queue_size,
                             queue_timeout_s=settings.queue_timeout_s, queue_timeouts=settings.queue_timeouts,
                             tenant_headroom=settings.admission_tenant_headroom,
                             tenant_window_s=settings.admission_tenant_window_s)
    admission = Admission(gw.admission_metrics, config, capacity=lambda: shard_capacity(
        [m.meta.get("max_num_seqs") for m in router.shards()], config))
    if gw.ledger is not None:
        await gw.ledger.start()
        stack.push_async_callback(gw.ledger.aclose)
    if new_agent is not None:
        agent = new_agent(Member(
            id=settings.node_id or f"gateway-{settings.host}-{settings.port}", service="gateway",
            url=f"{TlsConfig.from_env().scheme}://{settings.host}:{settings.port}",
            # the safety policies it serves: the control plane refuses a tier policy naming another (SAFETY_META)
            meta={"zone": settings.zone, SAFETY_META: ",".join(gw.safety.names())}), 2.0)
        await agent.start()
        stack.push_async_callback(agent.aclose)
    # Everything built so far lives as long as the process: move it out of the cyclic GC's
    # sight, so a full collection walks per-request garbage only (p99, not just CPU).
    gc.collect()
    gc.freeze()
    replies = None
    if settings.response_cache:  # cached replies: their own route and byte budget on the cache nodes
        replies = ResponseCache(SessionStore(membership, pool, timeout_s=0.25, sealer=sealer,
                                             headers=cluster_headers(cluster_token_from_env()), zone=settings.zone,
                                             prefix="/v1/response-cache"),
                                gw.reply_metrics, settings.response_cache_ttl_s, settings.response_cache_local_bytes)
        stack.push_async_callback(replies.aclose)
    return Runtime(settings, http, pool, membership, cluster, router, upstream, sessions, admission, replies, sealer)
