"""Pipeline parallelism for the torch engine: one shard's layers split over N stage processes.

    ranges = split_layers(30, 2, head=8.0)              # [(0, 11), (11, 30)]; split_layers(30, 2, "10,20")
    group = PipelineGroup(spec, on_lost=engine.lose)    # stage 0 (the shard): spawns stages 1..N-1
    runner = LlamaRunner.from_pretrained(path, ..., layer_range=ranges[0])
    runner.downstream = group.start()                   # waits for every stage to load and join
    ...
    group.close()

    switchboard shard --pipeline-parallel-size 2 [--pipeline-layers 10]   # vLLM's flag name

Stage 0 is the shard process: it serves HTTP, owns the scheduler, the embedding, the final norm and
the LM head, and runs layers [0, k). Stage i (data_plane/shard/engines/pipeline_stage.py) holds its
layers' weights and the KV cache of its layers only. A forward pass (`LlamaRunner.forward`) embeds
and runs stage 0's layers, then `Hops.forward` sends a header (the items' slots, lengths, starts,
wanted rows) and the hidden states [T, H] to stage 1, which runs its layers and passes them on; the
last stage sends back only the rows whose logits are wanted (select_rows), and stage 0 applies the
norm and the LM head. Why the head stays on stage 0: SmolLM2 ties it to the embedding stage 0
holds anyway (no second copy), and the wanted rows' hidden states (576 floats a row) are 85x
smaller than their logits (49,152), so the return hop is one hidden state a sequence. Slot moves
(`LlamaRunner.move_slot`) travel the same chain, so every stage's KV stays where the scheduler put it.

Micro-batches in flight (vLLM v1 keeps as many batches in flight as stages): `LlamaRunner.forward`
splits a pass's items into up to `microbatches` (default N) contiguous runs of about equal tokens
(runner.micro_batches; decode and verify runs keep contiguous slots, so their attention stays
batched) and `Hops.submit`s each as soon as stage 0's layers are done, without waiting (isend):
while stage 1 runs micro-batch k, stage 0 runs k+1, and the head runs on k's returned rows while
later stages run k+1. Rows come back in the order sent (`Hops.collect`). A sequence is in exactly
one micro-batch of a pass. Across steps, the engine's batch queue (batch_queue.py, vLLM v1's
`step_with_batch_queue`) keeps up to B (default N) scheduler plans in flight: the decoding
sequences go in B contiguous groups, and stage 0 plans and sends the next group while the
previous one is still in the later stages; a sequence is in at most one plan in flight, and slot
moves and admissions wait until none is (scheduler.py). Prefix-cache copies for a slot not in
flight may be sent while passes are (every stage applies them in the order stage 0 sent them).

Everything above the runner is unchanged: the scheduler, chunked and beside prefill, priorities,
speculation (a verify pass is one forward through the stages), prefix caching: stage 0's PrefixCache
(kv_cache.py) decides which pool block holds what, and each copy between its pool and a slot is
repeated down the chain (LOAD, STORE: `Hops` is the cache's `mirror`), every stage keeping the same
number of blocks for its own layers at the same indices. The KV tier on the cache nodes
(data_plane/shard/kv_tier.py) sees whole blocks, every layer, as an unsharded shard's: stage 0
gathers the later stages' layers of a finished turn's blocks (GATHER: each stage sends its part
straight to stage 0) and scatters fetched blocks' layers to them (INSERT: the block indices and each
stage's part, sent straight to it), so the block hashes and frames are the same and a plain and a
pipelined shard fetch each other's conversations. Why stage 0 coordinates rather than each stage
storing its own part: one HTTP client, one sealing key, one session placement, and no cache-node
keys per layer range; its cost is one more copy of the later layers' KV over the hops, measured in
docs/SHARDING.md. These block ops, and how they ride among passes in flight (a
GATHER behind the batch queue's passes completes when the newest of them is collected), are in
pipeline_kv.py (`KVHops`, which Hops extends), each with its span.

The group's TCPStore (its rendezvous: arguments, link addresses, load reports, heartbeats) holds only
values sealed with a key derived from the cluster token (pipeline_store.py): a process without the
token can neither read nor forge them, and a stage with the wrong token exits on its first read.

Losing a stage: every stage beats a heartbeat counter into the group's TCPStore every
HEARTBEAT_S; stage 0's monitor thread declares a stage lost when its process exited (kill -9: the
next check) or its counter stood still for `timeout_s` (frozen: SIGSTOP, a hung host), and calls
`on_lost` once: the engine fails every open stream (an error event the gateway resumes elsewhere)
and the shard leaves membership and exits, so its supervisor replaces the whole group. Stages die
with stage 0 (data_plane/common/lifeline.py, and their links to it end when it goes: pipeline_links.py).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from data_plane.common.cores import SPIN_COUNT
from data_plane.common.lifeline import die_with_parent
from data_plane.shard.engines.base import StageSpan
from data_plane.shard.engines.pipeline_kv import KVHop, KVHops, TicketKV
from data_plane.shard.engines.pipeline_links import POLL_S, Links
from data_plane.shard.engines.pipeline_net import (
    HEADER_FIXED,
    HEARTBEAT_S,
    OP_FORWARD,
    OP_MOVE,
    OP_STOP,
    TIMING_COLS,
    Frames,
    header_size,
    wire,
)
from data_plane.shard.engines.pipeline_store import GroupStore

log = logging.getLogger(__name__)



def split_layers(total: int, stages: int, spec: str | None = None, head: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous layer ranges [first, end) for `stages` stages, or with `spec` "10,20" the layers
    where stages 1.. start.

    By default the split evens out each stage's work, counting what only stage 0 does as `head`
    layers' worth (`head_layers`: the LM head, which at a decode step is ~8 of SmolLM2's 30 layers
    in multiply-adds): stage 0 takes fewer layers, the rest are spread evenly (the first stages
    take the remainder). With head 0 it is an even split of the layers. The slowest stage sets a
    pipeline's pace when passes overlap: an even split of 30 layers put 15 layers and the head
    (~23 layers' worth) on stage 0 against 15 on stage 1."""
    if not 1 <= stages <= total:
        raise ValueError(f"pipeline_parallel_size must be in 1..{total} (the model has {total} layers)")
    if spec:
        cuts = [int(c) for c in spec.split(",") if c.strip()]
        if len(cuts) != stages - 1 or not all(a < b for a, b in zip([0, *cuts], [*cuts, total])):
            raise ValueError(f"pipeline_layers must be {stages - 1} increasing layer numbers in 1..{total - 1}")
        bounds = [0, *cuts, total]
    else:
        first = total if stages == 1 else min(total - stages + 1, max(1, round((total + head) / stages - head)))
        base, extra = divmod(total - first, stages - 1) if stages > 1 else (0, 0)
        bounds = [0, first]
        for i in range(stages - 1):
            bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return [(bounds[i], bounds[i + 1]) for i in range(stages)]


def head_layers(hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int) -> float:
    """Stage 0's LM head in layers' worth of multiply-adds a row: vocab x hidden against a layer's
    q, k, v, o and MLP projections (SmolLM2-135M: 28.3 M against 3.5 M, 8.0 layers)."""
    kv = hidden * kv_heads // heads
    layer = hidden * (2 * hidden + 2 * kv) + 3 * hidden * intermediate
    return vocab * hidden / layer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class PipelineSpec:
    model: str
    """The shard's --model ("" = the default model); each stage resolves it as stage 0 did."""
    dtype: str
    """The dtype stage 0 resolved (never auto)."""
    quantization: str
    """The weight format stage 0 resolved: none, int8 or int4 (never auto)."""
    max_num_seqs: int
    max_len: int
    ranges: tuple[tuple[int, int], ...]
    """Layer range [first, end) of each stage; stage 0 first."""
    timeout_s: float = 1.0
    """A stage whose heartbeat stood still this long is lost."""
    threads: int = 1
    """torch intra-op threads of each stage while passes overlap (stage 0's host: its threads over its stages)."""
    alone_threads: int = 0
    """Threads for a pass alone in the pipeline, on the stages of stage 0's host (0: always `threads`).

    One stream's passes go through the stages one after another: while stage 1 runs, stage 0 waits,
    so each stage may use every core the host's stages share. When passes overlap (the batch queue,
    micro-batches) every stage runs at once and each keeps its share (`threads`): more threads than
    cores make every parallel region wait at its barrier for a descheduled thread. `Hops.pace`
    picks per pass between this and `threads` (the thread tuner's choice: AloneThreads); the header
    carries the count down the chain (stages on other hosts keep theirs). Set only when threads adapt
    (float32 asked for keeps one count)."""
    kernel: str = "torch"
    """What computes stage 0's quantized projections (blockq or torch): every stage uses the same."""
    port: int = 0
    """TCPStore port (0: a free one)."""
    host: str = "127.0.0.1"
    """Stage 0's address for the group (its TCPStore and its pipeline links): every stage must reach it."""
    remote: tuple[int, ...] = ()
    """Stages stage 0 does not start: they join from another host (`switchboard stage --join`)."""
    prefix_blocks: int = 0
    """Blocks of stage 0's prefix cache (0: prefix caching off): each stage keeps as many for its layers."""
    block_size: int = 16
    microbatches: int = 0
    """Micro-batches a forward pass is split into, in flight at once (0: as many as stages, vLLM's
    batch queue depth; 1: one pass at a time)."""

    @property
    def size(self) -> int:
        return len(self.ranges)


@dataclass(frozen=True)
class PassTiming:
    """One forward pass through every stage, as stage 0 saw it (the shard's pipeline metrics).

    Times come from the stages' wall clocks (time.time): exact between processes of one host, as
    good as NTP across hosts (a negative hop reads 0)."""

    wall_s: float
    """From stage 0 starting its layers to the last stage's rows back."""
    step_s: tuple[float, ...]
    """Each stage's compute in this pass (stage 0: embedding and its layers)."""
    hop_s: tuple[float, ...]
    """Hop i: from stage i's send to stage i+1's receipt (the last: to stage 0's)."""
    hop_bytes: tuple[int, ...]
    """Bytes stage i sent on hop i."""
    spans: tuple[tuple[float, float], ...] = ()
    """Each stage's (start, end) of this pass, epoch seconds (stage 0: from its layers to its send)."""
    in_flight: int = 1
    """Passes in flight when stage 0 sent this one, itself included (micro-batches overlapping)."""
    active_s: float = 0.0
    """When this pass emptied the pipeline: the wall time since a pass last entered an empty one
    (the denominator of each stage's idle share; 0 while others are still in flight)."""
    threads: tuple[int, ...] = ()
    """The intra-op threads each stage ran this pass with."""
    alone: bool = False
    """Sent alone into the pipeline, so the stages of stage 0's host ran it at PipelineSpec.alone_threads."""


@dataclass
class _Ticket:
    """A pass stage 0 sent and has not collected yet (Hops.submit)."""

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    rows: int
    began: float
    in_flight: int
    threads: int  # the header's count (0: each stage its own)
    sent_bytes: int
    buffers: tuple[torch.Tensor, ...]  # alive until the isends completed
    works: list[Any]
    kv: TicketKV = field(default_factory=TicketKV)
    """KV gathers sent behind this pass, completed when it is collected (pipeline_kv.py)."""


class AloneThreads:
    """The intra-op threads a pass alone in the pipeline runs at on the stages of stage 0's host:
    between each stage's share and PipelineSpec.alone_threads. The engine's thread tuner
    (torch_threads.ThreadTuner, `set`) picks it from those passes' times, as it picks a plain
    shard's threads: every core when it measures faster, each stage's share when another process
    takes a core (the barrier collapse: 2-thread stages beside a busy process took 200-400 ms a
    token against ~20 at one thread each, measured under load)."""

    def __init__(self, count: int, most: int) -> None:
        self.count = count
        self.most = most
        """PipelineSpec.alone_threads: every core the host's stages hold."""

    def set(self, count: int) -> None:
        self.count = count


class Hops(KVHops):
    """Stage 0's side of the chain: sends passes and slot moves to stage 1, receives stage N-1's rows;
    several passes may be in flight (submit ... collect, in order).

    Each pass carries a small float64 [N, 4] timing table down the chain and back (every stage
    writes when the pass arrived, its compute, when it left, its threads): PassTiming for the metrics, and per
    slot each stage's part of the request (`take`) for the request's spans."""

    def __init__(self, dist: Any, spec: PipelineSpec, hidden: int, dtype: torch.dtype) -> None:
        self.dist, self.spec, self.hidden, self.dtype = dist, spec, hidden, dtype
        self.microbatches = spec.microbatches or spec.size
        self.header = torch.zeros(header_size(spec.max_num_seqs), dtype=torch.long)
        self.frames = Frames(spec.max_num_seqs, spec.size, hidden, dtype)
        self.on_pass: Callable[[PassTiming], None] = lambda timing: None
        self.on_kv: Callable[[KVHop, int, int, float], None] = lambda op, blocks, nbytes, seconds: None
        """A KV-tier transfer (gather, scatter) of `blocks` blocks, `nbytes` over the hops, in `seconds`."""
        self._slots: dict[int, list[list[float]]] = {}  # slot -> per stage [start, end, busy, passes]
        self._in_flight: deque[_Ticket] = deque()
        self._active_since = 0.0
        self.max_in_flight = 0
        """The most passes ever in flight at once (sent by stage 0, rows not yet back)."""
        self._pass_threads = 0  # the header's thread count for the pass being sent (pace)
        self._threads = spec.threads
        self.alone: AloneThreads | None = None
        """The count for a pass alone in the pipeline, set by the engine (torch_load.start_pipeline)."""
        self._loose: list[tuple[torch.Tensor, ...]] = []  # prefix copies sent while passes were in flight
        self._loose_works: list[Any] = []

    def pace(self, parts: int) -> None:
        """Before stage 0's layers of a pass split into `parts` micro-batches: its intra-op threads,
        and the count its header gives the stages of this host (PipelineSpec.alone_threads; the
        thread tuner picks between that and each stage's share, `alone`)."""
        if self.alone is None:
            return
        n = self.alone.count if parts == 1 and not self._in_flight else self._threads
        self._pass_threads = n
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def forward(self, slots: Sequence[int], lens: Sequence[int], starts: Sequence[int], wanted: Sequence[int],
                batched: bool, x: torch.Tensor, began: float | None = None) -> torch.Tensor:
        """One pass, waited for: `collect(submit(...))`."""
        return self.collect(self.submit(slots, lens, starts, wanted, batched, x, began))

    def submit(self, slots: Sequence[int], lens: Sequence[int], starts: Sequence[int], wanted: Sequence[int],
               batched: bool, x: torch.Tensor, began: float | None = None) -> _Ticket:
        """Send a pass to stage 1 without waiting (isend: stage 0 never blocks on a send, so the
        last stage's rows can always come back); its own buffers, kept until collected."""
        n, m = len(slots), self.spec.max_num_seqs
        h = torch.zeros(header_size(m), dtype=torch.long)
        h[:HEADER_FIXED] = torch.tensor([OP_FORWARD, n, int(batched), len(x), self._pass_threads])
        for k, values in enumerate((slots, lens, starts, wanted)):
            h[HEADER_FIXED + k * m: HEADER_FIXED + k * m + n] = torch.tensor(list(values))
        t = torch.zeros(self.spec.size, TIMING_COLS, dtype=torch.float64)
        leave = time.time()
        began = leave if began is None else began
        t[0] = torch.tensor([began, leave - began, leave, torch.get_num_threads()], dtype=torch.float64)
        if not self._in_flight:
            self._active_since = began
        frame, rest = self.frames.pack(h, t, x)  # one message (a long pass: its rows as a second)
        works = [self.dist.isend(frame, 1)] + ([self.dist.isend(wire(rest), 1)] if rest is not None else [])
        # Prefix copies sent without waiting before this pass: received once its rows are back.
        works[:0], self._loose_works = self._loose_works, []
        buffers, self._loose = (frame, *(() if rest is None else (rest,)), *(b for pair in self._loose for b in pair)), []
        ticket = _Ticket(tuple(slots), tuple(starts), sum(wanted), began, len(self._in_flight) + 1, self._pass_threads,
                         frame.numel() + (0 if rest is None else rest.numel() * rest.element_size()), buffers, works)
        self._in_flight.append(ticket)
        self.max_in_flight = max(self.max_in_flight, ticket.in_flight)
        return ticket

    def collect(self, ticket: _Ticket) -> torch.Tensor:
        """The submitted pass's wanted rows from the last stage (passes come back in the order sent)."""
        if not self._in_flight or self._in_flight[0] is not ticket:
            raise RuntimeError("pipeline passes are collected in the order they were submitted")
        size = self.spec.size
        frame = torch.empty(self.frames.back_size(ticket.rows), dtype=torch.uint8)
        self.dist.recv(frame, size - 1, POLL_S if ticket.threads > self._threads else 0.0)
        back = time.time()
        t, out = self.frames.unpack_back(frame, ticket.rows)
        for work in ticket.works:
            work.wait()
        self._in_flight.popleft()
        if self.alone is not None and not self._in_flight and torch.get_num_threads() != self.alone.count:
            torch.set_num_threads(self.alone.count)  # the head, with nothing else in flight
        active_s = 0.0 if self._in_flight else back - self._active_since
        rows = t.tolist()
        hop_s = tuple(max(0.0, (rows[i + 1][0] if i + 1 < size else back) - rows[i][2]) for i in range(size))
        hop_bytes = tuple([ticket.sent_bytes] * (size - 1) + [frame.numel()])
        self._account(ticket.slots, ticket.starts, rows)
        for gather in ticket.kv.gathers:  # the last stage sent their parts right after this pass's rows
            self.finish_gather(gather)
        self.on_pass(PassTiming(back - ticket.began, tuple(r[1] for r in rows), hop_s, hop_bytes,
                                tuple((r[0], r[2]) for r in rows), ticket.in_flight, active_s,
                                tuple(int(r[3]) for r in rows), ticket.threads > self._threads))
        return out

    def _account(self, slots: Sequence[int], starts: Sequence[int], rows: list[list[float]]) -> None:
        for slot, start in zip(slots, starts):
            stages = self._slots.get(slot)
            if stages is None or start == 0:  # a new sequence in this slot (its predecessor was taken)
                stages = self._slots[slot] = [[r[0], r[2], 0.0, 0] for r in rows]
            for mine, (arrive, busy, leave, _) in zip(stages, rows):
                mine[1] = leave
                mine[2] += busy
                mine[3] += 1

    def take(self, slot: int) -> tuple[StageSpan, ...]:
        """Each stage's part of the sequence in `slot` since it started there (then forgotten)."""
        stages = self._slots.pop(slot, None) or []
        return tuple(StageSpan(i, start, end, busy, int(passes)) for i, (start, end, busy, passes) in enumerate(stages))

    def move_slot(self, src: int, dst: int, length: int) -> None:
        assert not self._in_flight, "a slot moves between passes, never while one is in flight"
        h = self.header
        h.zero_()
        h[:HEADER_FIXED] = torch.tensor([OP_MOVE, src, dst, length, 0])
        self.dist.send(h, 1)
        moved = self._slots.pop(src, None)
        if moved is not None:
            self._slots[dst] = moved


def stage_env(spec: PipelineSpec) -> dict[str, str] | None:
    """A local stage's environment: the shard's, with cores.SPIN_COUNT unless one was set
    (None: inherit): its OpenMP workers must not spin through the other stages' turns."""
    if not spec.alone_threads or "GOMP_SPINCOUNT" in os.environ:
        return None
    return {**os.environ, "GOMP_SPINCOUNT": SPIN_COUNT}


class PipelineGroup:
    """Stage 0's view of the group: the stage processes, their links, the heartbeat monitor."""

    def __init__(self, spec: PipelineSpec, on_lost: Callable[[int, str], None],
                 on_stage: Callable[[int, bool], None] | None = None) -> None:
        self.spec = spec
        self.on_lost = on_lost
        self.on_stage = on_stage or (lambda stage, up: None)
        self.port = spec.port or free_port()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.lost: tuple[int, str] | None = None
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._store: Any = None
        self.links: Links | None = None
        self.stage_info: dict[int, dict[str, Any]] = {}
        """What each later stage reported once loaded: weight_bytes (resident), kv_bytes, host, load_s."""

    def stage_command(self, rank: int) -> list[str]:
        s = self.spec
        first, end = s.ranges[rank]
        return [sys.executable, "-m", "data_plane.shard.engines.pipeline_stage", "--rank", str(rank),
                "--world", str(s.size), "--port", str(self.port), "--host", s.host, "--model", s.model,
                "--dtype", s.dtype,
                "--quantization", s.quantization, "--quantization-kernel", s.kernel,
                "--max-num-seqs", str(s.max_num_seqs), "--max-len", str(s.max_len),
                "--layers", f"{first}:{end}", "--threads", str(s.threads),
                "--prefix-blocks", str(s.prefix_blocks), "--block-size", str(s.block_size), "--bind", s.host,
                *(["--follow-threads"] if s.alone_threads and rank not in s.remote else [])]

    def start(self, hidden: int, dtype: torch.dtype, load_timeout_s: float = 600.0) -> Hops:
        """Spawn stages 1..N-1 (but the remote ones, which join from their hosts), wait until all
        connected their links (they load their layers first)."""
        from data_plane.common.hop_auth import cluster_token_from_env

        token = cluster_token_from_env()
        if self.spec.remote and not self.spec.port:
            raise ValueError("stages joining from other hosts need a fixed pipeline port")
        if self.spec.remote and not token:  # pipeline_store.py: a group open to other hosts proves the token
            raise ValueError("stages joining from other hosts need the cluster token: set SWITCHBOARD_CLUSTER_TOKEN "
                             "here and on every stage")
        self._store = GroupStore.serve(self.spec.host, self.port, self.spec.size, token, load_timeout_s)
        for rank in range(1, self.spec.size):
            # What a joining stage runs with: the arguments stage 0 would have started it with.
            self._store.set(f"spec/{rank}", json.dumps(self.stage_command(rank)[3:]))
            if rank in self.spec.remote:
                log.info("pipeline: waiting for stage %d to join: switchboard stage --join %s:%d --rank %d",
                         rank, self.spec.host, self.port, rank)
                continue
            # Forked from the engine's scheduler thread, which lives as long as the shard (lifeline.py).
            self.procs[rank] = subprocess.Popen(self.stage_command(rank), env=stage_env(self.spec),
                                                preexec_fn=die_with_parent())  # noqa: PLW1509
        log.info("pipeline: %d stages, layers %s, store on %s:%d", self.spec.size, self.spec.ranges, self.spec.host,
                 self.port)
        self.links = Links.join(self._store, 0, self.spec.size, self.spec.host, timeout_s=load_timeout_s,
                                gone=self._exited)
        for rank in range(1, self.spec.size):
            self.stage_info[rank] = json.loads(self._store.get(f"info/{rank}"))
        for rank in range(self.spec.size):
            self.on_stage(rank, True)
        self._monitor = threading.Thread(target=self._watch, name="pipeline-monitor", daemon=True)
        self._monitor.start()
        hops = Hops(self.links, self.spec, hidden, dtype)
        hops.kv_token_bytes = sum(int(info.get("kv_token_bytes", 0)) for info in self.stage_info.values())
        return hops

    def _exited(self) -> str | None:
        """Why a local stage will never connect: it exited (a load error, a refused token)."""
        for rank, proc in sorted(self.procs.items()):
            if proc.poll() is not None:
                return f"stage {rank} exited ({proc.returncode}) before it connected"
        return None

    def _watch(self) -> None:
        store = self._store.another(5.0)
        seen: dict[int, tuple[int, float]] = {r: (-1, time.monotonic()) for r in range(1, self.spec.size)}
        while not self._stop.wait(HEARTBEAT_S / 2):
            now = time.monotonic()
            for rank, (last, since) in list(seen.items()):
                proc = self.procs.get(rank)
                if proc is not None and proc.poll() is not None:
                    return self._lose(rank, f"stage {rank} exited ({proc.returncode})")
                try:
                    beat = store.beat_count(rank)  # sealed and growing: a forged or replayed beat does not count
                except Exception as exc:  # noqa: BLE001 - the store is stage 0's own: treat as lost
                    return self._lose(rank, f"heartbeat store failed: {exc}")
                if beat != last:
                    seen[rank] = (beat, now)
                elif now - since > self.spec.timeout_s:
                    return self._lose(rank, f"stage {rank} silent for {now - since:.1f} s")

    def _lose(self, rank: int, why: str) -> None:
        if self.lost is not None or self._stop.is_set():
            return
        self.lost = (rank, why)
        log.error("pipeline: %s; the group fails its requests and exits", why)
        self.on_stage(rank, False)
        self.on_lost(rank, why)

    def close(self) -> None:
        self._stop.set()
        if self.links is not None:
            if self.lost is None:
                try:  # at most a second: a stage that stopped reading is killed below anyway
                    stop = torch.tensor([OP_STOP] + [0] * (header_size(self.spec.max_num_seqs) - 1))
                    self.links.isend(stop, 1).wait(1.0)
                except Exception as exc:  # noqa: BLE001 - a stage already gone: it is killed below anyway
                    log.debug("pipeline: stop not delivered: %s", exc)
            self.links.close()
            self.links = None
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
