"""How a pipeline group's processes reach each other: addresses, interfaces and heartbeats.

    use_interface_of("10.0.0.2")                 # gloo listens on (and advertises) that address's interface
    threading.Thread(target=heartbeat, args=(store, rank, stop), daemon=True).start()   # a later stage

Stage 0 (data_plane/shard/engines/pipeline.py) watches each later stage's heartbeat counter in its
TCPStore; a stage (pipeline_stage.py) beats it every HEARTBEAT_S and leaves when its beats stop
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


def header_size(max_num_seqs: int) -> int:
    return HEADER_FIXED + 4 * max_num_seqs


def wire(x: torch.Tensor) -> torch.Tensor:
    """`x` as gloo carries it, bit for bit: 2-byte floats travel as int16 views."""
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
    while not stop.wait(HEARTBEAT_S):
        try:
            store.add(f"hb/{rank}", 1)
        except Exception:  # noqa: BLE001 - stage 0 is gone: the stage exits with it
            os._exit(1)
        last[0] = time.monotonic()
