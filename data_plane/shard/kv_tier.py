"""KV blocks on the cache nodes, the shard's side: offload after a turn, fetch-or-recompute before one.

    tier = KVTier(KVRemote(membership, http, zone=zone, headers=auth), metrics.kv_tier, FetchPolicy())
    tier.bind(engine.prefix, asyncio.get_running_loop())    # once the model is loaded
    await tier.prepare(gen_req, span)                       # before engine.generate(gen_req)
    tier.observe_prefill(tokens_computed, prefill_s)        # after each request (learns prefill speed)
    await tier.aclose()

After a session turn ends, the engine copies the blocks the cache nodes lack for that session out of
its slot (data_plane/shard/engines/torch_prefix.py) and hands them here; a worker task turns them into
frames (data_plane/kv_wire.py) and stores them on the session's replicas (data_plane/shard/kv_remote.py),
off the request path. A bounded queue (``max_pending_bytes``) drops what it cannot take: offload is
best effort, counted.

Before a session turn is enqueued, the blocks of its prompt the local prefix cache lacks are priced
two ways from what this shard has measured (:class:`FetchPolicy`): fetching them (bytes over the
learned transfer rate, plus a round trip) or prefilling them (tokens over the learned prefill speed).
The cheaper wins; each decision is logged and counted. Fetched frames are verified one by one
(checksum, hash, model, dtype, layout, shape): the first bad one ends the run, its reason is
counted, and its tokens are recomputed. Frames are sealed before they leave (AES-256-GCM,
data_plane/shard/kv_seal.py) and opened after a fetch: one that does not open counts as ``sealed``
and is recomputed like a checksum failure. Verified blocks are offered to the engine, which inserts
them before the request's admission. A cache node that is down or slow means recompute, never an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context

from data_plane.kv_wire import (
    REJECT_SEALED,
    BlockHeader,
    KVWireError,
    decode_frame,
    encode_frame,
    split_frames,
)
from data_plane.shard.kv_metrics import KVTierMetrics
from data_plane.shard.kv_remote import KVRemote
from data_plane.shard.kv_seal import KVSealer, block_scopes

if TYPE_CHECKING:
    import httpx
    import torch

    from data_plane.membership.view import MembershipView
    from data_plane.shard.engines.base import GenerationRequest, KVSessionRef
    from data_plane.shard.engines.torch_prefix import SlotPrefix

log = logging.getLogger(__name__)

CHUNK_BLOCKS = 32
"""Blocks per store request (32 fp32 SmolLM2 blocks are ~24 MB, under a node's 64 MiB body limit)."""
MAX_SESSIONS = 10_000
"""Sessions whose stored run this shard remembers (LRU)."""
MIN_PREFILL_SAMPLE = 32
"""Requests computing fewer prompt tokens say little about prefill speed: not learned from."""


class FetchPolicy:
    """Fetch or recompute, from what was measured here (EWMA), with priors until then."""

    def __init__(self, *, prior_bytes_per_s: float = 200e6, prior_prefill_tok_s: float = 500.0,
                 round_trip_s: float = 0.005, alpha: float = 0.3) -> None:
        self.bytes_per_s = prior_bytes_per_s
        self.prefill_tok_s = prior_prefill_tok_s
        self.round_trip_s = round_trip_s
        self.alpha = alpha

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 20 and seconds > 0:
            self.bytes_per_s += self.alpha * (nbytes / seconds - self.bytes_per_s)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_SAMPLE and seconds > 0:
            self.prefill_tok_s += self.alpha * (tokens / seconds - self.prefill_tok_s)

    def estimate(self, tokens: int, nbytes: int) -> tuple[float, float]:
        """(seconds to fetch, seconds to recompute) for `tokens` whose KV is `nbytes`."""
        return self.round_trip_s + nbytes / self.bytes_per_s, tokens / self.prefill_tok_s


@dataclass
class _Export:
    ref: KVSessionRef
    hashes: list[bytes]
    first: int
    kv: torch.Tensor
    salt: str | None = None
    public_tokens: int = 0


class KVTier:
    def __init__(self, remote: KVRemote, metrics: KVTierMetrics, policy: FetchPolicy | None = None, *,
                 max_pending_bytes: int = 256 << 20, max_concurrent_fetches: int = 1,
                 sealer: KVSealer | None = None, tracer: trace.Tracer | None = None) -> None:
        self.remote = remote
        self.tracer = tracer or trace.get_tracer(__name__)
        self.sealer = sealer
        """Seals frames before they leave and opens fetched ones (None: plaintext frames, --kv-seal off)."""
        self.metrics = metrics
        self.policy = policy or FetchPolicy()
        self.max_pending_bytes = max_pending_bytes
        self.prefix: SlotPrefix | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[_Export] = asyncio.Queue()
        self._pending_bytes = 0
        self._worker: asyncio.Task[None] | None = None
        self._fetch_gate = asyncio.Semaphore(max_concurrent_fetches)
        """Fetches are CPU-bound on both ends here (Python HTTP, checksums, copies): run side by side
        they all finish late, one after another the first turn starts prefilling early."""
        self._stored: OrderedDict[str, tuple[int, bytes]] = OrderedDict()
        """session -> (leading blocks the cache nodes hold, the last of those blocks' hash)."""
        self._publish()

    # -- lifecycle ---------------------------------------------------------------------------

    def bind(self, prefix: SlotPrefix | None, loop: asyncio.AbstractEventLoop) -> None:
        """Attach to the engine's prefix cache (None: prefix caching off, the tier stays idle). A
        pipelined shard's blocks travel whole too: stage 0 gathers its stages' layers for a store and
        hands each stage its layers of a fetched block (pipeline.Hops), so blocks are the same as an
        unsharded shard's and either kind of shard can fetch what the other stored."""
        self.prefix, self._loop = prefix, loop
        if prefix is not None:
            prefix.remote = self
            self._worker = loop.create_task(self._offload_loop(), name="shard-kv-offload")

    async def aclose(self) -> None:
        if self.prefix is not None:
            self.prefix.remote = None
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)

    async def drain(self) -> None:
        """Wait until every queued offload has been sent (tests, benchmarks)."""
        while self._pending_bytes:
            await asyncio.sleep(0.01)

    def _header(self, block_hash: bytes) -> BlockHeader:
        p = self.prefix
        assert p is not None
        return BlockHeader(block_hash, p.model_id, p.dtype, p.layout, p.block_shape)

    def _publish(self) -> None:
        m = self.metrics
        m.fetch_bandwidth.labels(m.model_name).set(self.policy.bytes_per_s)
        m.prefill_rate.labels(m.model_name).set(self.policy.prefill_tok_s)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.policy.observe_prefill(tokens, seconds)
        self._publish()

    # -- after a turn (RemoteTier, called on the engine's scheduler thread) ------------------

    def stored_blocks(self, req: GenerationRequest, hashes: Sequence[bytes]) -> int | None:
        ref = req.kv_session
        if ref is None:
            return None
        run, tail = self._stored.get(ref.session_id, (0, b""))
        return run if 0 < run <= len(hashes) and hashes[run - 1] == tail else 0

    def export(self, req: GenerationRequest, hashes: Sequence[bytes], first: int, kv: torch.Tensor) -> None:
        assert self._loop is not None and req.kv_session is not None
        job = _Export(req.kv_session, list(hashes), first, kv, req.cache_salt, req.public_prefix_tokens)
        self._loop.call_soon_threadsafe(self._enqueue, job)

    def _enqueue(self, job: _Export) -> None:
        m = self.metrics
        size = job.kv.numel() * job.kv.element_size()
        if self._pending_bytes + size > self.max_pending_bytes:
            m.offloaded.labels(m.model_name, "dropped").inc(len(job.hashes) - job.first)
            log.warning("KV offload queue full (%d bytes pending): %d blocks of a session turn dropped",
                        self._pending_bytes, len(job.hashes) - job.first)
            return
        self._pending_bytes += size
        self._queue.put_nowait(job)

    async def _offload_loop(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                await self._offload(job)
            except Exception:
                log.exception("KV offload failed")
            finally:
                self._pending_bytes -= job.kv.numel() * job.kv.element_size()

    async def _offload(self, job: _Export) -> None:
        """Stores `job` in a trace of its own (background work after the turn: OpenTelemetry's guidance), its
        span linked to the turn's; the cache nodes' kv_put spans are its children."""
        origin = job.ref.origin
        links = [trace.Link(origin)] if origin is not None and origin.is_valid else None
        with self.tracer.start_as_current_span("shard.kv_offload", context=Context(), links=links,
                                               attributes={"switchboard.kv.blocks": len(job.hashes) - job.first}):
            await self._store(job)

    async def _store(self, job: _Export) -> None:
        m, name = self.metrics, self.metrics.model_name
        new = job.hashes[job.first:]
        frames = await asyncio.to_thread(self._frames, new, job.kv,
                                         self._scopes(len(job.hashes), job.salt, job.public_tokens)[job.first:])
        sent = acked_blocks = 0
        started = time.perf_counter()
        for i in range(0, len(frames), CHUNK_BLOCKS):
            chunk = frames[i : i + CHUNK_BLOCKS]
            links = job.hashes[: job.first + i]
            acks = await self.remote.store(job.ref.session_id, job.ref.replicas, links, chunk, job.ref.ttl_s)
            nbytes = sum(len(f) for f in chunk)
            sent += nbytes * max(1, acks)
            m.offloaded.labels(name, "stored" if acks else "failed").inc(len(chunk))
            if not acks:
                break
            acked_blocks = i + len(chunk)
        seconds = time.perf_counter() - started
        m.store_bytes.labels(name).inc(sent)
        if sent:
            m.store_size.labels(name).observe(sent)
        m.store_time.labels(name).inc(seconds)
        self.policy.observe_transfer(sent, seconds)
        self._publish()
        if acked_blocks:
            self._remember(job.ref.session_id, job.hashes[: job.first + acked_blocks])
        log.debug("KV offload: %d of %d new blocks stored in %.3f s", acked_blocks, len(new), seconds)

    def _scopes(self, n: int, salt: str | None, public_tokens: int) -> list[str]:
        assert self.prefix is not None
        return block_scopes(n, self.prefix.block_size, salt, public_tokens)

    def _frames(self, hashes: list[bytes], kv: torch.Tensor, scopes: Sequence[str]) -> list[bytes | bytearray]:
        import torch  # lazy: a synthetic shard (no tier) must not pay torch's import at start-up

        raw = kv.contiguous().view(torch.uint8).reshape(len(hashes), -1).numpy()
        if self.sealer is not None:
            return [self.sealer.seal_frame(self._header(h), memoryview(raw[j]), scopes[j])
                    for j, h in enumerate(hashes)]
        return [encode_frame(self._header(h), memoryview(raw[j])) for j, h in enumerate(hashes)]

    def _remember(self, session_id: str, run: Sequence[bytes]) -> None:
        if run:
            self._stored[session_id] = (len(run), run[-1])
            self._stored.move_to_end(session_id)
            if len(self._stored) > MAX_SESSIONS:
                self._stored.popitem(last=False)

    # -- before a turn ----------------------------------------------------------------------

    async def prepare(self, req: GenerationRequest, span: Any) -> int:
        """Fetch the prompt's blocks missing locally from the cache nodes when that is cheaper than
        recomputing them; they are offered to the engine before `req` is enqueued. Returns the prompt
        tokens whose KV was fetched and offered (0: none). Never raises."""
        p, ref = self.prefix, req.kv_session
        if p is None or ref is None:
            return 0
        req.kv_session = ref = replace(ref, origin=span.get_span_context())  # its offload's span links here
        m, name, bs = self.metrics, self.metrics.model_name, p.block_size
        hashes = p.hashes(req.prompt_ids, req.cache_salt, req.public_prefix_tokens)
        usable = (len(req.prompt_ids) - 1) // bs
        local = p.cache.probe(hashes, usable)
        known, tail = self._stored.get(ref.session_id, (0, b""))
        if local >= usable or (known and known <= local and known <= len(hashes) and hashes[known - 1] == tail):
            return 0  # nothing missing, or the nodes hold nothing this shard lacks (it stored them itself)
        missing = usable - local
        tokens, nbytes = missing * bs, missing * p.block_bytes
        m.queries.labels(name).inc(tokens)
        if not self.remote.replicas_for(ref.session_id, ref.replicas):
            m.decisions.labels(name, "no_cache_nodes").inc()
            span.add_event("kv_fetch", {"decision": "no_cache_nodes", "tokens_missing": tokens})
            return 0
        fetch_s, prefill_s = self.policy.estimate(tokens, nbytes)
        decision = "fetch" if fetch_s < prefill_s else "recompute"
        m.decisions.labels(name, decision).inc()
        log.info("KV for %d missing prompt tokens: %s (estimated fetch %.3f s vs prefill %.3f s)", tokens,
                 decision, fetch_s, prefill_s)
        if decision != "fetch":
            span.add_event("kv_fetch", {"decision": decision, "tokens_missing": tokens,
                                        "estimated_fetch_s": fetch_s, "estimated_prefill_s": prefill_s})
            return 0
        queued = time.perf_counter()
        async with self._fetch_gate:  # one at a time: the first resumes (prefills) while the next arrives
            started = time.perf_counter()
            # the turn's span current: the nodes' kv_fetch spans join its trace (it is not current here)
            with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                got = await self.remote.fetch(ref.session_id, ref.replicas, hashes[:usable], skip=local)
            if got is not None:
                scopes = self._scopes(usable, req.cache_salt, req.public_prefix_tokens)
                kv, used, reason = await asyncio.to_thread(self._verify, got.body,
                                                           hashes[local : min(got.run, usable)], scopes[local:])
            seconds = time.perf_counter() - started
        if got is None:
            m.fetches.labels(name, "unavailable").inc()
            span.add_event("kv_fetch", {"decision": decision, "result": "unavailable", "tokens_missing": tokens})
            log.warning("KV fetch: no cache node answered; recomputing %d tokens", tokens)
            return 0
        m.load_bytes.labels(name).inc(len(got.body))
        m.load_size.labels(name).observe(len(got.body))
        m.load_time.labels(name).inc(seconds)
        self.policy.observe_transfer(len(got.body), seconds)
        self._publish()
        if reason is not None:
            m.rejected.labels(name, reason).inc()
            log.warning("KV fetch from %s: block %d of the run failed verification (%s); it and the rest of the "
                        "run are recomputed", got.node, local + used, reason)
        if used:
            assert kv is not None
            p.offer(hashes[local : local + used], kv, req.trace)
            m.hits.labels(name).inc(used * bs)
        if got.run and reason is None:
            self._remember(ref.session_id, hashes[: got.run])
        m.fetches.labels(name, "hit" if used else "miss").inc()
        span.add_event("kv_fetch", {"decision": decision, "result": "hit" if used else "miss",
                                    "tokens_cached": local * bs, "tokens_fetched": used * bs,
                                    "tokens_missing": tokens, "bytes": len(got.body), "seconds": seconds,
                                    "queued_s": started - queued,
                                    "node": got.node, **({"rejected": reason} if reason else {})})
        return used * bs if used else 0

    def _verify(self, body: bytes, expected: Sequence[bytes],
                scopes: Sequence[str]) -> tuple[torch.Tensor | None, int, str | None]:
        """(KV of the leading good blocks, how many, why the run ended early or None). Sealed frames
        are opened straight into the result (no copy beyond the decryption's)."""
        p = self.prefix
        assert p is not None
        frames: list[tuple[BlockHeader, memoryview]] = []
        reason: str | None = None
        try:
            for j, frame in enumerate(split_frames(body)):
                if j >= len(expected):
                    break
                header, payload = decode_frame(frame, verify=True)
                if header.block_hash != expected[j] or not header.same_kind(self._header(expected[j])):
                    raise KVWireError("layout", "another block, model, dtype or layout than asked for")
                if header.sealed and self.sealer is None:
                    raise KVWireError(REJECT_SEALED, "a sealed KV frame and no keys (--kv-seal off)")
                frames.append((header, payload))
        except KVWireError as exc:
            reason = exc.reason
        if not frames:
            return None, 0, reason
        import numpy as np
        import torch

        kv = torch.empty((len(frames), *p.block_shape), dtype=p.torch_dtype)
        flat = kv.view(torch.uint8).reshape(len(frames), -1).numpy()
        for j, (header, payload) in enumerate(frames):
            if self.sealer is not None:
                try:
                    self.sealer.open_into(header, payload, scopes[j], memoryview(flat[j]))
                except KVWireError as exc:
                    log.warning("KV frame %s does not open: %s; recomputed", header.block_hash.hex()[:12], exc)
                    return (kv[:j] if j else None), j, exc.reason
            elif len(payload) != flat.shape[1]:
                return (kv[:j] if j else None), j, "layout"
            else:
                flat[j] = np.frombuffer(payload, dtype=np.uint8)
        return kv, len(frames), reason


def start_kv_tier(engine: Any, metrics: KVTierMetrics, membership: MembershipView, http: httpx.AsyncClient, *,
                  zone: str, headers: dict[str, str], prior_mbps: float, prior_prefill_tok_s: float,
                  max_pending_bytes: int, sealer: KVSealer | None = None) -> KVTier | None:
    """The tier for a loaded engine (the shard's lifespan calls it); None when the engine keeps no
    prefix cache (the synthetic engine, or --prefix-caching off)."""
    prefix = getattr(engine, "prefix", None)
    if prefix is None:
        return None
    tier = KVTier(KVRemote(membership, http, zone=zone, headers=headers), metrics,
                  FetchPolicy(prior_bytes_per_s=prior_mbps * 1e6, prior_prefill_tok_s=prior_prefill_tok_s),
                  max_pending_bytes=max_pending_bytes, sealer=sealer)
    tier.bind(prefix, asyncio.get_running_loop())
    log.info("KV tier on: session blocks go to the cache nodes (%s); missing prefixes fetched when cheaper",
             f"sealed, AES-256-GCM, key {sealer.keys.current}, {sealer.keys.source}" if sealer is not None
             else "NOT sealed: --kv-seal off")
    return tier
