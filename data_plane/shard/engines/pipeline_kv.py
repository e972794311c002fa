"""Stage 0's KV-block ops on a pipeline's later stages: the prefix cache's mirror and the KV tier's hops.

    class Hops(KVHops): ...                         # pipeline.py: the chain's passes; this, its KV side
    cache.mirror = hops                              # kv_cache.KVMirror: LOAD, STORE, INSERT, GATHER
    hops.gather(slot, 0, 3, out, then=send)          # send() once `out` holds every layer

Every op goes down the chain in the order stage 0 sent it (one link a pair of stages, in order), so each
stage applies it after the passes sent before it and before those sent after. LOAD / STORE repeat a
prefix-cache copy between the pool and a slot (block indices only cross the hops); INSERT (a
*scatter*) sends each later stage its layers of blocks fetched from the cache nodes; GATHER brings a
finished turn's blocks' later layers back to stage 0 for the cache nodes (each stage sends its part
straight to stage 0).

With passes in flight (the batch queue, N plans in flight) nothing here blocks: a blocking send
would wait for stage 1 to receive it while stage 1 waits for stage 0 to take an earlier pass's
rows (a deadlock). LOAD, STORE and INSERT go as isends whose buffers ride on the next pass
submitted (its rows coming back prove them received). A GATHER's header goes the same way, and its
parts are collected with the newest pass in flight: the middle stages' parts by irecvs posted at
once (nothing else comes to stage 0 from them), the last stage's right after that pass's rows
(it runs the GATHER after that pass, before any later one, and sends on the same pair as the
rows). So the turn's `then` (the KV tier's export) runs when that pass is collected, at most one
pass later than it would have alone; the decode loop never waits for it. The slot is safe in
between: stage 0 copied its own layers out at once, no pass in flight holds the finished sequence,
and anything later that writes the slot (an admission, a move) reaches each stage after the GATHER.

Each op is a span (`shard.pipeline_kv_{gather,scatter,load,store}`, a child of the request's
`shard.generate` when the caller made it current: torch_prefix.under) with `switchboard.kv.blocks`
and `switchboard.kv.bytes` (the KV the op moves on the later stages' layers: over the hops for
gather and scatter, between pool and slot for load and store, where only indices cross the hops).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch
from opentelemetry import trace

from data_plane.shard.engines.pipeline_net import (
    HEADER_FIXED,
    OP_GATHER,
    OP_INSERT,
    OP_LOAD,
    OP_STORE,
    header_size,
    wire,
)

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


class KVHop(str, Enum):
    """A KV-tier transfer between stage 0 and the later stages (the `op` of the pipeline KV metrics)."""

    GATHER = "gather"
    """A finished turn's blocks going to the cache nodes: each later stage sends stage 0 its layers."""
    SCATTER = "scatter"
    """Blocks fetched from the cache nodes: stage 0 sends each later stage its layers."""


class GroupShape(Protocol):
    """What the KV ops need of the group (pipeline.PipelineSpec)."""

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]: ...

    @property
    def size(self) -> int: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def block_size(self) -> int: ...


@dataclass
class PendingGather:
    """A GATHER sent while passes were in flight: completed when `Hops.collect` takes the pass it
    follows (`ticket.gathers`)."""

    first: int
    end: int
    out: torch.Tensor
    then: Callable[[], None]
    parts: list[torch.Tensor]
    """Each later stage's layers of the blocks, stage 1 first."""
    recvs: list[Any]
    """The middle stages' irecvs (the last stage's part is received after the pass's rows)."""
    sends: list[Any]
    header: torch.Tensor  # alive until its isend completed
    span: Any
    t0: float
    blocked_s: float = 0.0
    """Stage 0's own time in it (posting it; taking the last part after the pass's rows): the rest overlaps."""


@dataclass
class TicketKV:
    """What rides on a pass in flight besides its rows: gathers completed when it is collected."""

    gathers: list[PendingGather] = field(default_factory=list)


class KVHops:
    """The KV side of pipeline.Hops (the prefix cache's `mirror`); Hops sets these attributes."""

    dist: Any
    spec: GroupShape
    _in_flight: deque[Any]  # pipeline._Ticket, oldest first; each has `kv: TicketKV`
    _loose: list[tuple[torch.Tensor, ...]]
    _loose_works: list[Any]
    on_kv: Callable[[KVHop, int, int, float], None]
    kv_token_bytes: int = 0
    """K and V of one token on the later stages' layers (what they reported), for the load/store spans."""

    # The prefix cache's mirror (kv_cache.KVMirror): each stage repeats stage 0's copies on its layers.

    def load(self, idxs: Sequence[int], slot: int) -> None:
        self._blocks(OP_LOAD, slot, len(idxs), torch.tensor(list(idxs), dtype=torch.long))

    def store(self, pairs: Sequence[tuple[int, int]], slot: int) -> None:
        self._blocks(OP_STORE, slot, len(pairs), torch.tensor([list(p) for p in pairs], dtype=torch.long).reshape(-1))

    # The KV tier's side: blocks on the cache nodes hold every layer; each stage has its own.

    def insert(self, idxs: Sequence[int], kv: torch.Tensor) -> None:
        """Scatter: each later stage keeps its layers of fetched blocks `kv` in pool blocks `idxs`. With
        passes in flight it is sent without waiting, like a prefix copy (`_blocks`): each stage applies
        it after them, in order, and no pass in flight reads these new blocks."""
        t0 = time.perf_counter()
        h = self._header(OP_INSERT, len(idxs), 0, 0)
        index = torch.tensor(list(idxs), dtype=torch.long)
        parts = [wire(kv[:, :, first:end].contiguous()) for first, end in self.spec.ranges[1:]]
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        with self._span(KVHop.SCATTER.value, len(idxs), nbytes):
            # Without waiting in between: stage 1 passes the header on before it takes its part.
            works = [self.dist.isend(h, 1)]
            for rank, part in enumerate(parts, 1):
                works += [self.dist.isend(index, rank), self.dist.isend(part, rank)]
            if self._in_flight:  # the buffers ride on the next pass submitted (see _blocks)
                self._loose.append((h, index, *parts))
                self._loose_works += works
            else:
                for work in works:
                    work.wait()
        self._kv_done(KVHop.SCATTER, len(idxs), nbytes, time.perf_counter() - t0)

    def gather(self, slot: int, first: int, end: int, out: torch.Tensor, then: Callable[[], None]) -> None:
        """Gather: blocks ``first..end`` of `slot` from each later stage's layers into `out` (every
        layer; stage 0's already there), then `then()`: at once when no pass is in flight, else when
        the newest pass in flight is collected (module docstring)."""
        assert slot not in {s for t in self._in_flight for s in t.slots}, "a gather of a slot in flight"
        t0 = time.perf_counter()
        parts = [torch.empty((end - first, 2, hi - lo, *out.shape[3:]), dtype=out.dtype)
                 for lo, hi in self.spec.ranges[1:]]
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        deferred = bool(self._in_flight)
        span = tracer.start_span("shard.pipeline_kv_gather", attributes=self._attrs(end - first, nbytes, deferred))
        h = self._header(OP_GATHER, slot, first, end)
        if not deferred:
            self.dist.send(h, 1)
            for rank, part in enumerate(parts, 1):
                self.dist.recv(wire(part), rank)
            self.finish_gather(PendingGather(first, end, out, then, parts, [], [], h, span, t0), received=True)
            return
        sends = [self.dist.isend(h, 1)]
        recvs = [self.dist.irecv(wire(part), rank) for rank, part in enumerate(parts[:-1], 1)]
        g = PendingGather(first, end, out, then, parts, recvs, sends, h, span, t0)
        g.blocked_s = time.perf_counter() - t0
        self._in_flight[-1].kv.gathers.append(g)
        log.debug("pipeline KV gather of %d blocks deferred behind %d passes in flight", end - first,
                  len(self._in_flight))

    def finish_gather(self, g: PendingGather, received: bool = False) -> None:
        """A gather's parts into its `out`, then its `then` (for a deferred one: called by Hops.collect
        right after its pass's rows, before anything else is received from the last stage)."""
        t1 = time.perf_counter()
        if not received:
            self.dist.recv(wire(g.parts[-1]), self.spec.size - 1)
            for work in (*g.recvs, *g.sends):
                work.wait()
        for (lo, hi), part in zip(self.spec.ranges[1:], g.parts):
            g.out[:, :, lo:hi].copy_(part)
        nbytes = sum(p.numel() * p.element_size() for p in g.parts)
        if not received:
            g.blocked_s += time.perf_counter() - t1
            g.span.set_attribute("switchboard.pipeline.blocked_s", round(g.blocked_s, 6))
            log.info("pipeline KV gather behind passes in flight: stage 0 blocked %.1f ms of it", 1000 * g.blocked_s)
        g.span.end()
        self._kv_done(KVHop.GATHER, g.end - g.first, nbytes, time.perf_counter() - g.t0)
        try:
            g.then()
        except Exception:  # the export is best effort; the pass's rows must still be served
            log.exception("pipeline KV gather: handing the turn's blocks on failed")

    def _kv_done(self, op: KVHop, blocks: int, nbytes: int, seconds: float) -> None:
        log.info("pipeline KV %s: %d blocks, %.1f MiB over the hops in %.1f ms", op.value, blocks, nbytes / 2**20,
                 1000 * seconds)
        self.on_kv(op, blocks, nbytes, seconds)

    def _header(self, op: int, a: int, b: int, c: int) -> torch.Tensor:
        h = torch.zeros(header_size(self.spec.max_num_seqs), dtype=torch.long)
        h[:HEADER_FIXED] = torch.tensor([op, a, b, c, 0])
        return h

    def _span(self, op: str, blocks: int, nbytes: int, deferred: bool | None = None) -> Any:
        """The span of one KV op, current inside `with` (ended on exit)."""
        return tracer.start_as_current_span(f"shard.pipeline_kv_{op}", attributes=self._attrs(blocks, nbytes, deferred))

    def _attrs(self, blocks: int, nbytes: int, deferred: bool | None = None) -> dict[str, Any]:
        return {"switchboard.kv.blocks": blocks, "switchboard.kv.bytes": nbytes,
                "switchboard.pipeline.stages": self.spec.size,
                "switchboard.pipeline.deferred": bool(self._in_flight) if deferred is None else deferred}

    def _blocks(self, op: int, slot: int, count: int, values: torch.Tensor) -> None:
        """A LOAD (`count` pool indices) or STORE (`count` (block number, pool index) pairs) for `slot`.
        May run while passes are in flight (the batch queue: a finished sequence's blocks kept): every
        stage applies it after them, in the order stage 0 sent everything (one link a pair of stages, in
        order), and no pass in flight touches `slot` (a sequence is in at most one plan in flight).
        With passes in flight it is sent without waiting (isend), like a pass: a blocking send would
        wait for stage 1 to receive it while stage 1 waits for stage 0 to take an earlier pass's rows
        (a deadlock); its buffers ride on the next pass submitted, whose rows coming back prove it
        was received."""
        assert slot not in {s for t in self._in_flight for s in t.slots}, "a prefix copy for a slot in flight"
        h = self._header(op, slot, count, 0)
        name = "load" if op == OP_LOAD else "store"
        with self._span(name, count, count * self.spec.block_size * self.kv_token_bytes):
            if not self._in_flight:
                self.dist.send(h, 1)
                self.dist.send(values, 1)
                return
            self._loose.append((h, values))
            self._loose_works += [self.dist.isend(h, 1), self.dist.isend(values, 1)]
