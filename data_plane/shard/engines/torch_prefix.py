"""The torch engine's side of prefix caching: a PrefixCache bound to the runner's slot KV cache.

    prefix = SlotPrefix.build(runner, model_id="/models/smollm2", dtype="float32", block_size=16,
                              budget_bytes=0, on_evict=listener.on_kv_evict)   # 0 = auto budget
    hashes = prefix.hashes(prompt_ids, salt="tenant:acme")          # when the request arrives
    prefix.take_offers()                                            # before each schedule(): the KV tier's blocks in
    hit = prefix.cached_tokens(hashes, len(prompt_ids))             # while admitting (no side effect)
    held = prefix.reserve(hashes, hit)                              # right after schedule(): blocks referenced
    prefix.load(held, slot)                                         # copy-in, after the plan's slot moves
    held += prefix.keep(hashes, hit, slot)                          # once the prompt is prefilled
    prefix.finish(tokens_in_slot, salt, public, slot, hit, held, req)  # when the sequence ends

    prefix.offer(hashes[k:n], kv, req.trace)   # any thread: blocks fetched from the cache nodes, [n-k, 2, L, H, bs, D]
    prefix.remote = tier               # data_plane/shard/kv_tier.py: a finished session's new blocks go out

All of it runs on the engine's scheduler thread (data_plane/shard/engines/torch_engine.py) except
`offer`, which queues (under a lock) what the next `take_offers` inserts; the engine takes them before
each schedule() and schedules only once none is left, so a request enqueued after its blocks were
offered always sees them. Nothing changes the cache between a lookup and its reservation: an insert
or a store may evict the least recently used unreferenced blocks, and a hit among them would be gone
by the time it is loaded. Offered blocks stay referenced until a
request loads them (or for OFFER_HOLD_S), so a busy cache cannot evict them in between. The cache
itself, its addressing and why slots + copy-in are in data_plane/shard/engines/kv_cache.py. With a
pipeline, each copy is repeated on the later stages (the cache's mirror, pipeline_kv.KVHops), as a
span: `load`, `keep`, `finish` and an offer's insert make the request's span (`GenerationRequest.trace`)
current around them, so those spans are children of its `shard.generate`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from opentelemetry import trace

from data_plane.shard.engines.kv_cache import (
    BlockHasher,
    CacheEvents,
    PrefixCache,
    auto_budget_bytes,
    copy_out_blocks,
    layout_seed,
)

if TYPE_CHECKING:
    from data_plane.shard.engines.base import GenerationRequest
    from data_plane.shard.engines.llama_runner import LlamaRunner

log = logging.getLogger(__name__)

OFFER_HOLD_S = 30.0
"""How long blocks fetched for a request stay referenced waiting for it to be admitted."""


def under(span_context: Any) -> contextlib.AbstractContextManager[Any]:
    """The request's span (an OTel SpanContext, or None) current on this thread inside `with`."""
    if span_context is None:
        return contextlib.nullcontext()
    return trace.use_span(trace.NonRecordingSpan(span_context), end_on_exit=False)


class RemoteTier(Protocol):
    """Where a finished session turn's new blocks go (data_plane/shard/kv_tier.py); called on the
    scheduler thread, so both return at once."""

    def stored_blocks(self, req: GenerationRequest, hashes: Sequence[bytes]) -> int | None:
        """Leading blocks of `hashes` the cache nodes already hold for the request's session; None:
        nothing goes out for this request."""
        ...

    def export(self, req: GenerationRequest, hashes: Sequence[bytes], first: int, kv: torch.Tensor) -> None:
        """Send blocks ``first..`` of `hashes`; `kv` is ``[n, 2, layers, kv_heads, bs, head_dim]``."""
        ...


class SlotPrefix:
    def __init__(self, runner: LlamaRunner, cache: PrefixCache, hasher: BlockHasher) -> None:
        self._runner = runner
        self.cache = cache
        self.hasher = hasher
        self.block_size = cache.block_size
        self.model_id = ""
        self.dtype = ""
        self.layout = ""
        self.remote: RemoteTier | None = None
        self._offers: list[tuple[list[bytes], torch.Tensor, Any]] = []
        self._offer_lock = threading.Lock()
        self._offered: dict[bytes, tuple[int, float]] = {}  # hash -> (pool index held, since)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One block's KV on the wire: (K/V, layers, kv_heads, block_size, head_dim), every layer of
        the model (a pipelined shard's blocks are whole too: stage 0 gathers and scatters the parts)."""
        r = self._runner
        return (2, getattr(r, "total_layers", r.num_layers), r.num_kv_heads, self.block_size, r.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block on the wire (every layer)."""
        return math.prod(self.block_shape) * self.torch_dtype.itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return self._runner.dtype

    @classmethod
    def build(cls, runner: LlamaRunner, *, model_id: str, dtype: str, block_size: int, budget_bytes: int,
              on_evict: Callable[[str, int], None],
              on_block_evicted: Callable[[float, float], None] | None = None,
              on_block_reused: Callable[[float], None] | None = None,
              total_layers: int | None = None) -> SlotPrefix:
        """`total_layers`: the model's (a pipeline's stage 0 holds fewer): blocks hash alike either way."""
        r = runner
        layout = f"llama.L{total_layers or r.num_layers}.kvh{r.num_kv_heads}.d{r.head_dim}.bs{block_size}"
        # Seeded with the weight format too: int4 KV never answers a bf16 lookup (nor the KV tier's).
        hasher = BlockHasher(layout_seed(model_id, dtype, layout, weights=getattr(r, "weight_format", "dense")),
                             block_size)
        cache = PrefixCache(num_layers=r.num_layers, kv_heads=r.num_kv_heads,
                            head_dim=r.head_dim, block_size=block_size,
                            dtype=r.dtype, budget_bytes=budget_bytes or auto_budget_bytes(),
                            events=CacheEvents(on_evict=on_evict))
        if on_block_evicted is not None:
            cache.events.on_block_evicted = on_block_evicted
        if on_block_reused is not None:
            cache.events.on_block_reused = on_block_reused
        log.info("prefix cache: %d blocks of %d tokens (%.0f MiB budget)", cache.num_blocks, block_size,
                 cache.capacity_bytes / 2**20)
        prefix = cls(runner, cache, hasher)
        prefix.model_id, prefix.dtype, prefix.layout = model_id, dtype, layout
        return prefix

    def hashes(self, ids: Sequence[int], salt: str | None, public_tokens: int) -> list[bytes]:
        return self.hasher.hashes(ids, salt, public_tokens)

    def cached_tokens(self, hashes: Sequence[bytes], prompt_len: int) -> int:
        """Prompt tokens the cache holds, leaving at least one to compute (its logits start the reply)."""
        bs = self.block_size
        return bs * self.cache.probe(hashes, (prompt_len - 1) // bs)

    def reserve(self, hashes: Sequence[bytes], hit_tokens: int) -> list[int]:
        """Reference the blocks of a hit `cached_tokens` just counted (nothing may have changed the
        cache since); returns them, for `load` and the sequence's release."""
        hit = hashes[: hit_tokens // self.block_size]
        held = self.cache.acquire(hit)
        if self._offered:  # the request's own references now keep what was offered for it
            for h in hit:
                got = self._offered.pop(h, None)
                if got is not None:
                    self.cache.release([got[0]])
        return held

    def load(self, held: Sequence[int], slot: int, trace_ctx: Any = None) -> None:
        """Copy reserved blocks into `slot` (after the plan's slot moves)."""
        with under(trace_ctx):
            self.cache.load(held, self._runner.k_cache, self._runner.v_cache, slot)

    def offer(self, hashes: list[bytes], kv: torch.Tensor, trace_ctx: Any = None) -> None:
        """Blocks from the cache nodes for a request about to be enqueued (any thread); `trace_ctx`: its span."""
        with self._offer_lock:
            self._offers.append((hashes, kv, trace_ctx))

    @property
    def has_offers(self) -> bool:
        """Offered blocks not inserted yet."""
        return bool(self._offers)

    def take_offers(self) -> None:
        """Insert the offered blocks (held for their request) and let go of holds past OFFER_HOLD_S;
        the scheduler thread, before it schedules (never between a lookup and its reservation)."""
        if not self._offers and not self._offered:
            return
        with self._offer_lock:
            offers, self._offers = self._offers, []
        now = time.monotonic()
        for hashes, kv, trace_ctx in offers:
            fresh = [j for j, h in enumerate(hashes) if not self.cache.has(h)]
            if not fresh:
                continue
            picked = [hashes[j] for j in fresh]
            with under(trace_ctx):
                idxs = self.cache.insert(picked, kv if len(fresh) == len(hashes) else kv[torch.tensor(fresh)])
            for h, idx in zip(picked, idxs):
                self._offered[h] = (idx, now)
        stale = [h for h, (_, since) in self._offered.items() if now - since > OFFER_HOLD_S]
        for h in stale:
            self.cache.release([self._offered.pop(h)[0]])

    def keep(self, hashes: Sequence[bytes], hit_tokens: int, slot: int, trace_ctx: Any = None) -> list[int]:
        """The prompt's new full blocks enter the cache, referenced (a concurrent request with the
        same prefix, e.g. a shared system prompt, hits them at once)."""
        with under(trace_ctx):
            return self.cache.store(hashes, self._runner.k_cache, self._runner.v_cache, slot,
                                    hit_tokens // self.block_size, hold=True)

    def finish(self, tokens: Sequence[int], salt: str | None, public_tokens: int, slot: int, hit_tokens: int,
               held: Sequence[int], req: Any = None) -> None:
        """Every full block of what the slot holds (prompt + output so far) is kept for the
        conversation's next turn, and (with a remote tier and a session) the ones the cache nodes
        lack are copied out for them; then the sequence's references are released."""
        if slot >= 0 and len(tokens) >= self.block_size:
            hashes = self.hashes(tokens, salt, public_tokens)
            with under(getattr(req, "trace", None)):
                self.cache.store(hashes, self._runner.k_cache, self._runner.v_cache, slot,
                                 hit_tokens // self.block_size)
                remote = self.remote
                if remote is not None and req is not None:
                    first = remote.stored_blocks(req, hashes)
                    if first is not None and first < len(hashes):
                        self._copy_out(slot, first, len(hashes), lambda kv: remote.export(req, hashes, first, kv))
        self.cache.release(held)

    def _copy_out(self, slot: int, first: int, end: int, then: Callable[[torch.Tensor], None]) -> None:
        """Blocks ``first..end`` of `slot` as ``[n, 2, layers, kv_heads, bs, head_dim]`` (a copy), every
        layer, handed to `then`: a pipeline's later stages send theirs (the cache's mirror,
        pipeline_kv.KVHops.gather), at once or, with passes in flight, when the newest is collected."""
        r = self._runner
        out = torch.empty((end - first, *self.block_shape), dtype=r.dtype)
        copy_out_blocks(r.k_cache, r.v_cache, slot, first, end, self.block_size, out)
        if self.cache.mirror is None:
            then(out)
        else:
            self.cache.mirror.gather(slot, first, end, out, lambda: then(out))
