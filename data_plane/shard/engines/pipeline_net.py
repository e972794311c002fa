"""How a pipeline group's processes reach each other: addresses, interfaces and heartbeats.

    use_interface_of("10.0.0.2")                 # gloo (bench hops) listens on that address's interface
    threading.Thread(target=heartbeat, args=(store, rank, stop), daemon=True).start()   # a later stage

Stage 0 (data_plane/shard/engines/pipeline.py) watches each later stage's heartbeat counter in its
TCPStore (sealed: pipeline_store.py); a stage (pipeline_stage.py) beats it every HEARTBEAT_S and leaves when its beats stop
getting through. A stage on another host joins with `switchboard stage --join`. The chain's wire
format: a header of `header_size(max_num_seqs)` longs (op first), then the op's tensors; 2-byte
floats travel as int16 views (`wire`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

OP_FORWARD, OP_MOVE, OP_STOP, OP_LOAD, OP_STORE, OP_INSERT, OP_GATHER = 1, 2, 3, 4, 5, 6, 7
HEADER_FIXED = 5  # op, items, batched, rows, threads (FORWARD) / op, src, dst, length, 0 (MOVE)
H_THREADS = 4
"""A FORWARD header's intra-op threads for this pass on a stage of stage 0's host (0: its own count)."""

HEARTBEAT_S = 0.2
"""How often a stage beats its heartbeat counter."""
STAGE_GIVE_UP_S = 5.0
"""A later stage whose heartbeat has not reached stage 0 for this long exits (stage 0 is gone or cut off)."""
STORE_WAIT_S = 600.0
"""How long a joining stage waits for stage 0's store (and its published arguments)."""


TIMING_COLS = 4  # arrive, busy, leave (epoch seconds; busy in seconds), intra-op threads
INLINE_ROWS = 64
"""A FORWARD hop's hidden states travel inside its frame up to this many rows (every decode step of
up to 64 sequences); a longer pass (a prompt chunk) sends them as a second message."""


def header_size(max_num_seqs: int) -> int:
    return HEADER_FIXED + 4 * max_num_seqs


class Frames:
    """A FORWARD hop as one message: the header (longs), the pass's timing table (float64
    [stages, TIMING_COLS]) and, up to INLINE_ROWS rows, its hidden states, packed in one byte frame;
    the rows back to stage 0 likewise (the timing table, then the rows: stage 0 knows how many).

    Why: each message costs a wake-up on each side. Header, states and timing as three gloo
    messages made a 1-row round trip between two local processes 841 µs against 208 µs as one
    (2 cores, idle, AMD EPYC; a ping-pong of the same tensors, isend then recv), on the critical
    path of every pipelined token. A link (pipeline_links.py), like gloo, receives a shorter message
    into a larger buffer, so a stage receives every op into one frame-sized buffer and the other ops
    still send a bare header."""

    def __init__(self, max_num_seqs: int, stages: int, hidden: int, dtype: torch.dtype) -> None:
        import torch

        self.dtype = dtype
        self.h_bytes = 8 * header_size(max_num_seqs)
        self.t_bytes = 8 * stages * TIMING_COLS
        self.stages = stages
        self.row_bytes = hidden * torch.empty(0, dtype=dtype).element_size()
        self.hidden = hidden
        self.capacity = self.h_bytes + self.t_bytes + INLINE_ROWS * self.row_bytes

    def receiver(self) -> torch.Tensor:
        """A buffer any op's first message fits in."""
        import torch

        return torch.empty(self.capacity, dtype=torch.uint8)

    def pack(self, header: torch.Tensor, timing: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(frame, the rows to send as a second message or None)."""
        import torch

        rows = len(x)
        inline = rows <= INLINE_ROWS
        frame = torch.empty(self.h_bytes + self.t_bytes + (rows * self.row_bytes if inline else 0), dtype=torch.uint8)
        frame[: self.h_bytes].view(torch.long).copy_(header)
        frame[self.h_bytes : self.h_bytes + self.t_bytes].view(torch.float64).copy_(timing.reshape(-1))
        if inline:
            frame[self.h_bytes + self.t_bytes :].view(self.dtype).copy_(x.reshape(-1))
            return frame, None
        return frame, x.contiguous()

    def header(self, buf: torch.Tensor) -> torch.Tensor:
        import torch

        return buf[: self.h_bytes].view(torch.long)

    def unpack(self, buf: torch.Tensor, rows: int, recv: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A received FORWARD frame's (timing [stages, TIMING_COLS], x [rows, hidden]), both copies;
        `recv(tensor)` receives the rows of a pass too long to travel inline."""
        import torch

        timing = buf[self.h_bytes : self.h_bytes + self.t_bytes].view(torch.float64).view(self.stages, TIMING_COLS).clone()
        if rows <= INLINE_ROWS:
            start = self.h_bytes + self.t_bytes
            x = buf[start : start + rows * self.row_bytes].view(self.dtype).view(rows, self.hidden).clone()
        else:
            x = torch.empty(rows, self.hidden, dtype=self.dtype)
            recv(wire(x))
        return timing, x

    def pack_back(self, timing: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The last stage's rows to stage 0: the timing table, then the rows."""
        import torch

        frame = torch.empty(self.t_bytes + len(out) * self.row_bytes, dtype=torch.uint8)
        frame[: self.t_bytes].view(torch.float64).copy_(timing.reshape(-1))
        frame[self.t_bytes :].view(self.dtype).copy_(out.reshape(-1))
        return frame

    def unpack_back(self, frame: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        timing = frame[: self.t_bytes].view(torch.float64).view(self.stages, TIMING_COLS)
        return timing, frame[self.t_bytes :].view(self.dtype).view(rows, self.hidden)

    def back_size(self, rows: int) -> int:
        return self.t_bytes + rows * self.row_bytes


def wire(x: torch.Tensor) -> torch.Tensor:
    """`x` as a link carries it, bit for bit: 2-byte floats travel as int16 views (numpy has no bf16)."""
    import torch

    return x.view(torch.int16) if x.element_size() == 2 and x.is_floating_point() else x


def interface_of(addr: str) -> str | None:
    """The network interface holding IPv4 address `addr` (None: none here, or not Linux)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(got[20:24]) == addr:
                return name
    return None


def use_interface_of(addr: str) -> None:
    """Make this process's gloo device listen on (and advertise) `addr`'s interface, so a stage on
    another host can reach it; loopback keeps gloo's default."""
    if addr.startswith("127.") or addr in ("", "localhost"):
        return
    name = interface_of(addr)
    if name is None:
        raise ValueError(f"no network interface here has address {addr}")
    os.environ["GLOO_SOCKET_IFNAME"] = name


def heartbeat(store: Any, rank: int, stop: threading.Event, give_up_s: float = STAGE_GIVE_UP_S) -> None:
    """A stage's beat (its own thread): the counter stage 0 watches. A beat that fails, or that has
    not gone through for `give_up_s` (a cut link drops packets: a send can hang rather than fail),
    means stage 0 is gone or unreachable, and the stage exits: stage 0 has declared it lost by then."""
    last = [time.monotonic()]

    def watchdog() -> None:
        while not stop.wait(HEARTBEAT_S):
            if time.monotonic() - last[0] > give_up_s:
                log.warning("stage %d: no heartbeat through to stage 0 for %.0f s; leaving", rank, give_up_s)
                os._exit(1)

    threading.Thread(target=watchdog, name="heartbeat-watchdog", daemon=True).start()
    count = 0
    while not stop.wait(HEARTBEAT_S):
        count += 1
        try:
            store.beat(rank, count)  # pipeline_store.GroupStore: sealed, so only a stage with the token beats
        except Exception:  # noqa: BLE001 - stage 0 is gone: the stage exits with it
            os._exit(1)
        last[0] = time.monotonic()
