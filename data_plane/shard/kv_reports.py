"""What a shard tells routers about its prefix cache, on the headers of every chat response.

    reports = KVReports(lambda: getattr(engine, "prefix", None))    # torch engine: its SlotPrefix
    headers.update(reports.headers(gen_req, request.headers.get(SINCE_HEADER)))
    # x-switchboard-kv-chain: 9f1c2a7b03de4411:1536      this prompt's last full block, its tokens
    # x-switchboard-kv-evicted: 44;0a1b2c3d4e5f6071       chain ids announced earlier, evicted since 41

The wire is data_plane/common/kv_report.py; the gateway's reader is data_plane/routing/kv_routing.py
(it forgets the shard as that session's KV holder). A chain id names the prompt's whole cached
prefix (its last block's digest, salt included), so no session id is needed here.

Cheap and bounded: nothing at all unless the caller is a kv_aware router (it sends
``x-switchboard-kv-since``); then one chain digest per request (the prompt's block hashes, ~0.06 ms at 1.5k
tokens), at most ``max_announced`` chains remembered (oldest dropped), ``max_events`` evictions
kept for late readers, and a sweep that checks at most ``sweep_batch`` remembered chains against
the cache no more than every ``sweep_s`` seconds (``probe`` is a dict lookup; nothing in the
engine's scheduler thread changes). A chain counts as evicted once it was seen cached and is not
any more; one never seen cached within ``unseen_ttl_s`` (never stored: no space) is dropped
silently. Counted in ``switchboard_shard_kv_evictions_reported_total`` (:class:`KVReportMetrics`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from data_plane.common.kv_report import (
    CHAIN_HEADER,
    EVICTED_HEADER,
    MAX_REPORTED,
    chain_id,
    format_chain,
    format_evicted,
)
from data_plane.shard.engines.base import GenerationRequest

log = logging.getLogger(__name__)


class KVReportMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.evictions_reported = Counter(
            "switchboard_shard_kv_evictions_reported",
            "Prompt prefixes this shard announced to routers (x-switchboard-kv-chain) and has since evicted "
            "from its prefix cache; routers read them off later responses.", ["model_name"], registry=registry)
        self.model_name = model_name

    def counting(self) -> Callable[[int], None]:
        """An `on_evicted` callback for :class:`KVReports`."""
        return self.evictions_reported.labels(self.model_name).inc


class KVReports:
    def __init__(self, prefix: Callable[[], Any], *, max_announced: int = 16_384, max_events: int = 4_096,
                 sweep_s: float = 0.5, sweep_batch: int = 2_048, unseen_ttl_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_evicted: Callable[[int], None] = lambda n: None) -> None:
        self._prefix = prefix
        self.max_announced = max_announced
        self.sweep_s = sweep_s
        self.sweep_batch = sweep_batch
        self.unseen_ttl_s = unseen_ttl_s
        self.clock = clock
        self.on_evicted = on_evicted
        self._announced: OrderedDict[str, list[Any]] = OrderedDict()  # chain -> [digest, seen cached, since]
        self._events: deque[tuple[int, str]] = deque(maxlen=max_events)
        self._seq = 0
        self._next_sweep = 0.0
        self._lock = threading.Lock()

    def headers(self, req: GenerationRequest, since: str | None) -> dict[str, str]:
        """The response headers for `req` (none on an engine without a prefix cache, nor for a caller
        that does not read them: only a kv_aware router sends `since`)."""
        prefix = self._prefix()
        if prefix is None or since is None:
            return {}
        out: dict[str, str] = {}
        hashes = prefix.hashes(req.prompt_ids, req.cache_salt, req.public_prefix_tokens)
        with self._lock:
            if hashes:
                chain = chain_id(hashes[-1])
                self._announced[chain] = [hashes[-1], False, self.clock()]
                self._announced.move_to_end(chain)
                while len(self._announced) > self.max_announced:
                    self._announced.popitem(last=False)
                out[CHAIN_HEADER] = format_chain(chain, len(req.prompt_ids))
            self._sweep(prefix.cache)
            if since.isdigit():
                evicted = self.since(int(since))
                if evicted:
                    out[EVICTED_HEADER] = format_evicted(self._seq, evicted)
        return out

    def since(self, seq: int) -> list[str]:
        """Chain ids evicted after report number `seq` (the newest MAX_REPORTED); all kept ones if
        `seq` is ahead of ours (this shard restarted)."""
        if seq > self._seq:
            seq = 0
        if seq == self._seq:
            return []
        return [chain for n, chain in self._events if n > seq][-MAX_REPORTED:]

    def _sweep(self, cache: Any) -> None:
        now = self.clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.sweep_s
        evicted = 0
        for chain in list(self._announced)[: self.sweep_batch]:  # oldest first, then rotated to the end
            entry = self._announced[chain]
            cached = cache.probe([entry[0]], 1) == 1
            if cached:
                entry[1] = True
                self._announced.move_to_end(chain)
            elif entry[1]:
                del self._announced[chain]
                self._seq += 1
                self._events.append((self._seq, chain))
                evicted += 1
            elif now - entry[2] > self.unseen_ttl_s:
                del self._announced[chain]
            else:
                self._announced.move_to_end(chain)
        if evicted:
            self.on_evicted(evicted)
            log.info("prefix cache: %d announced prompt prefix(es) evicted; reported to routers as #%d",
                     evicted, self._seq)
