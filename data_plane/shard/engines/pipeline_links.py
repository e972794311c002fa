"""The pipeline group's wire: one TCP connection per pair of stages that talk, tensors sent as
length-prefixed byte frames, with torch.distributed's point-to-point calls.

    links = Links.join(store, rank=0, world=3, bind="127.0.0.1")   # every stage, once
    links.send(header, 1); links.recv(frame, 2)                     # blocking, in order per pair
    work = links.isend(frame, 1); ...; work.wait()                  # never blocks the caller
    work = links.irecv(part, 2); ...; work.wait()                   # received when waited for (or earlier)

Why not gloo: one hop is on the critical path of every pipelined token, and gloo pays two thread
wake-ups a message on the receiving side (its device thread reads the socket, then signals the
waiting thread) plus its own pair protocol. A ping-pong of a 1,600-byte frame (one decode row)
between two idle local processes took a 202 µs round trip over gloo and 20 µs over a TCP socket
on loopback (AMD EPYC Zen 4, 2 cores: `switchboard bench hops`). A socket also fails the way a
link does: a dead peer is an end of stream at once, not a timeout.

Who talks to whom (the only connections made): stage 0 with every stage (passes go out to stage
1, rows come back from the last; the KV tier's parts go straight between stage 0 and each
stage), and each stage with the next. For a pair i < j, j connects to i: every stage listens on
its `bind` address (port 0) and publishes ``links/<rank>`` = "host:port" in stage 0's TCPStore,
which a stage on another host already reaches.

Who may connect, both ways: the acceptor sends a random nonce; the connector answers with its rank,
a nonce of its own and an HMAC-SHA256 over the acceptor's nonce and both ranks keyed by the cluster
token (SWITCHBOARD_CLUSTER_TOKEN, every process of a cluster has it; a stage on another host needs it
too); the acceptor's verdict carries its own HMAC over the connector's nonce. The two proofs are
labelled apart, so neither can be reflected as the other. A process without the token can neither
join the chain as a stage by connecting to one nor pose as one to a connecting stage: the addresses
come from torch's TCPStore, which takes no token, and a party that rewrites ``links/<rank>`` there
gets a refused connection, not hidden states. What is left to such a party is denial of service.
It is not a secure channel: frames are neither encrypted nor authenticated after the handshake, so
a party on the path could still read or relay them. Run the group on a private network
(docs/SHARDING.md). A failed proof either way is logged and its connection dropped; the acceptor
keeps waiting for the real stage. Without a token (a single-machine setup) the HMAC's key is empty:
ranks are still checked, nothing is secret.

Semantics are gloo's where the pipeline relies on them: messages between two stages arrive in the
order sent, a receive takes a message no longer than its buffer (a shorter one fills its front:
a stage receives every op into one frame-sized buffer), `isend` returns at once (a pass sent while
the last stage is sending rows back must not wait for stage 1 to receive it: a deadlock) and its
buffer must stay alive until `wait()`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

LENGTH = struct.Struct("<q")
CONNECT_TIMEOUT_S = 60.0
HANDSHAKE_S = 5.0
"""How long a connecting peer has to answer the nonce (one slow or silent client cannot stall a join);
the connecting side waits for its nonce and verdict as long as its join may take."""
LINK_DEAD_S = 10.0
"""Unacknowledged data or failed keepalives for this long fail a link (TCP_USER_TIMEOUT)."""
NONCE_BYTES = 16
MAC = hashlib.sha256
MAC_BYTES = 32
ACCEPTED, REFUSED = b"\x01", b"\x00"
"""The handshake (module docstring): nonce from the acceptor; rank, nonce and proof from the
connector; the acceptor's verdict, with its own proof when it accepts (a refused stage says why and
exits at once, not at the first op)."""
CONNECTOR, ACCEPTOR = b"switchboard pipeline link/connector", b"switchboard pipeline link/acceptor"
"""Each side's proof is labelled with its role, so an acceptor's proof is never a valid connector's."""
ANSWER = LENGTH.size + NONCE_BYTES + MAC_BYTES
"""The connector's answer: its rank, its nonce, its proof."""
POLL_S = 0.010
"""How long a stage polls its link before sleeping in it, while passes alone in the pipeline run on
every core of the host (pipeline.AloneThreads above each stage's share). A thread asleep in a socket
lets its core halt, and in a VM without halt-polling (Firecracker: guest_halt_poll_ns 0) waking a
halted vCPU costs the next stage's turn its first fraction of a millisecond, twice a token, and the
other stage's OpenMP worker on that core the same again. Polling, yielding between polls, keeps the core
awake for both. One stream through N=2 on a 2-core AMD EPYC Zen 4: TPOT 1.27-1.53x N=1 sleeping, 1.13x
polling (docs/SHARDING.md). 10 ms is above a lone pass's round trip for this model here (~7-9 ms) and
bounds what a group burns after its last pass. Passes at each stage's share (the tuner's choice
beside a busy process, overlapping passes) do not poll."""


def proof(token: str | None, nonce: bytes, rank: int, peer: int, role: bytes = CONNECTOR) -> bytes:
    """HMAC(token, role | the other side's nonce | the prover's rank | the other side's rank)."""
    msg = role + nonce + LENGTH.pack(rank) + LENGTH.pack(peer)
    return hmac.new((token or "").encode(), msg, MAC).digest()


def byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, in place (2-byte floats: pass their int16 view, pipeline_net.wire)."""
    if not t.is_contiguous():
        raise ValueError("only contiguous tensors travel on a pipeline link")
    # flat first: memoryview.cast refuses a zero-size multi-dimensional shape
    return memoryview(t.reshape(-1).numpy()).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer


def peers_of(rank: int, world: int) -> list[int]:
    """The stages `rank` exchanges messages with (module docstring)."""
    if rank == 0:
        return list(range(1, world))
    return sorted({0, rank - 1, *([rank + 1] if rank + 1 < world else [])} - {rank})


class Work:
    """An isend or irecv: `wait()` returns once its bytes left (isend) or arrived (irecv)."""

    def __init__(self, done: bool = False) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        if done:
            self._done.set()

    def finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"pipeline link: not done in {timeout} s")
        if self._error is not None:
            raise ConnectionError(f"pipeline link: {self._error}") from self._error


class Link:
    """One connected peer: ordered sends (a background thread takes over a send the socket's
    buffer cannot take at once) and ordered receives (irecvs are read by a background thread as
    soon as they are posted, as gloo reads them: a stage sending a large part to stage 0 is not held
    until stage 0 waits for it; a blocking recv first waits for the irecvs posted before it)."""

    def __init__(self, sock: socket.socket, peer: int) -> None:
        self.sock, self.peer = sock, peer
        self._send_lock = threading.Lock()
        self._queue: deque[tuple[list[memoryview], Work]] = deque()
        self._wake = threading.Condition(self._send_lock)
        self._sender: threading.Thread | None = None
        self._closed = False
        self._recv_lock = threading.Lock()  # one reader of the socket at a time
        self._posted = threading.Condition()
        self._pending: deque[tuple[memoryview, Work]] = deque()  # irecvs posted and not yet received, in order
        self._receiver: threading.Thread | None = None

    def isend(self, t: torch.Tensor) -> Work:
        data = byte_view(t)
        parts = [memoryview(LENGTH.pack(len(data))), data]
        with self._send_lock:
            if not self._queue:  # nothing ahead of it: try the socket's buffer without blocking
                try:
                    sent = self.sock.sendmsg(parts, [], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                parts = _advance(parts, sent)
                if not parts:
                    return Work(done=True)
            work = Work()
            self._queue.append((parts, work))
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_loop, name=f"pipeline-send-{self.peer}",
                                                daemon=True)
                self._sender.start()
            self._wake.notify()
        return work

    def send(self, t: torch.Tensor) -> None:
        self.isend(t).wait()

    def _send_loop(self) -> None:
        while True:
            with self._send_lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed and not self._queue:
                    return
                parts, work = self._queue[0]
            try:
                while parts:
                    parts = _advance(parts, self.sock.sendmsg(parts))
                error = None
            except OSError as exc:
                error = exc
            with self._send_lock:
                self._queue.popleft()
            work.finish(error)

    def recv(self, t: torch.Tensor, poll_s: float = 0.0) -> None:
        """Blocking. With `poll_s` > 0 the socket is polled for up to that long before the thread
        sleeps in it, so the core does not halt while the peer's turn is short (POLL_S)."""
        view = byte_view(t)
        with self._posted:  # earlier irecvs first: messages are taken in the order sent
            while self._pending:
                self._posted.wait()
        with self._recv_lock:
            if poll_s > 0:
                self._poll(poll_s)
            self._recv_into(view)

    def _poll(self, poll_s: float) -> None:
        """Until the next message's first byte is there or `poll_s` passed, yielding the core between
        polls (a thread that wants it, another stage's OpenMP worker, runs at once)."""
        peek = bytearray(1)
        deadline = time.perf_counter() + poll_s
        while True:
            try:
                self.sock.recv_into(peek, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                return  # a byte (or the end of the stream: the read says so)
            except BlockingIOError:
                if time.perf_counter() >= deadline:
                    return
                os.sched_yield()

    def irecv(self, t: torch.Tensor) -> Work:
        work = Work()
        with self._posted:
            self._pending.append((byte_view(t), work))
            if self._receiver is None:
                self._receiver = threading.Thread(target=self._recv_loop, name=f"pipeline-recv-{self.peer}",
                                                  daemon=True)
                self._receiver.start()
            self._posted.notify_all()
        return work

    def _recv_loop(self) -> None:
        error: BaseException | None = None
        while True:
            with self._posted:
                while not self._pending and not self._closed:
                    self._posted.wait()
                if not self._pending:
                    return
                view, work = self._pending[0]
            if error is None:  # after a failure every later irecv fails too: the stream is out of step
                try:
                    with self._recv_lock:
                        self._recv_into(view)
                except OSError as exc:
                    error = exc
            work.finish(error)
            with self._posted:
                self._pending.popleft()
                self._posted.notify_all()

    def _recv_into(self, view: memoryview) -> None:
        head = bytearray(LENGTH.size)
        self._read(memoryview(head))
        (n,) = LENGTH.unpack(head)
        if not 0 <= n <= len(view):
            raise ConnectionError(f"pipeline link: a {n}-byte message from stage {self.peer} for a "
                                  f"{len(view)}-byte buffer")
        self._read(view[:n])

    def _read(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
            if n == 0:
                raise ConnectionError(f"pipeline link: stage {self.peer} closed the connection")
            got += n

    def close(self) -> None:
        with self._send_lock:
            self._closed = True
            self._wake.notify()
        with self._posted:
            self._posted.notify_all()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a sender or receiver thread blocked on it
        for thread in (self._sender, self._receiver):
            if thread is not None and thread is not threading.current_thread():
                thread.join(2.0)
        self.sock.close()


def _advance(parts: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of `parts` after `sent` bytes went out."""
    while parts and sent >= len(parts[0]):
        sent -= len(parts[0])
        parts = parts[1:]
    if parts and sent:
        parts = [parts[0][sent:], *parts[1:]]
    return parts


def _read_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; with a `deadline` (time.monotonic()), all of them by then (a peer that trickles
    bytes cannot hold the handshake open), else socket.timeout."""
    buf = bytearray(n)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("pipeline link: the handshake took too long")
            sock.settimeout(left)
        k = sock.recv_into(memoryview(buf)[got:])
        if k == 0:
            raise ConnectionError("pipeline link: the peer left during the handshake")
        got += k
    return bytes(buf)


def _tune(sock: socket.socket) -> None:
    """No Nagle delay; keepalives and a user timeout, so a link cut between two later stages (which
    stage 0's heartbeats do not cross) fails its sockets in ~LINK_DEAD_S instead of TCP's ~15 min of
    retransmissions. The kernel's buffer autotuning is left on (a fixed SO_SNDBUF caps it at wmem_max)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", int(LINK_DEAD_S * 1000))):
        opt = getattr(socket, name, None)
        if opt is not None:  # Linux; elsewhere the defaults
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)


class Links:
    """This stage's links to the stages it talks to, with torch.distributed's send/recv/isend/irecv
    (`peer` is a rank)."""

    def __init__(self, links: dict[int, Link]) -> None:
        self.links = links

    @classmethod
    def join(cls, store: Any, rank: int, world: int, bind: str, timeout_s: float = CONNECT_TIMEOUT_S,
             token: str | None = None, gone: Callable[[], str | None] = lambda: None) -> Links:
        """Listen, publish, connect to the lower peers and accept the higher ones (module docstring);
        `token`: the cluster token (default: the environment's); `gone()`, asked twice a second while
        waiting for peers: why to stop waiting (a stage process that exited), or None."""
        if token is None:
            from data_plane.common.hop_auth import cluster_token_from_env

            token = cluster_token_from_env()
        wanted = peers_of(rank, world)
        lower = [p for p in wanted if p < rank]
        higher = {p for p in wanted if p > rank}
        listener = socket.create_server((bind, 0), backlog=max(4, len(higher)))
        listener.settimeout(0.5)
        deadline = time.monotonic() + timeout_s
        links: dict[int, Link] = {}
        done = False
        try:
            port = listener.getsockname()[1]
            store.set(f"links/{rank}", f"{bind}:{port}")
            for p in lower:
                host, _, at = store.get(f"links/{p}").decode().rpartition(":")
                sock = socket.create_connection((host, int(at)), timeout=timeout_s)
                try:
                    # the acceptor may be busy with another client's handshake first: the join's own time
                    nonce, ours = _read_exactly(sock, NONCE_BYTES, deadline), os.urandom(NONCE_BYTES)
                    sock.sendall(LENGTH.pack(rank) + ours + proof(token, nonce, rank, p))
                    verdict = _read_exactly(sock, 1, deadline)
                    theirs = _read_exactly(sock, MAC_BYTES, deadline) if verdict == ACCEPTED else b""
                except OSError:
                    sock.close()
                    raise
                if verdict != ACCEPTED:
                    sock.close()
                    raise ConnectionError(f"pipeline link: stage {p} refused stage {rank} (is SWITCHBOARD_CLUSTER_TOKEN "
                                          "the same on every stage?)")
                if not hmac.compare_digest(theirs, proof(token, ours, p, rank, ACCEPTOR)):
                    sock.close()
                    log.warning("pipeline link: %s:%s, published as stage %d, failed the cluster-token check", host, at, p)
                    raise ConnectionError(f"pipeline link: the listener at {host}:{at} published as stage {p} could not "
                                          "prove the cluster token (a rewritten store address, or a different "
                                          "SWITCHBOARD_CLUSTER_TOKEN on that stage)")
                links[p] = cls._ready(sock, p)
            while higher - set(links):
                why = gone()
                if why is not None or time.monotonic() > deadline:
                    raise ConnectionError(f"pipeline link: stage {rank} gave up waiting for stages "
                                          f"{sorted(higher - set(links))}: {why or f'none connected in {timeout_s:.0f} s'}")
                try:
                    sock, addr = listener.accept()
                except OSError:  # the 0.5 s poll, or a connection aborted before it was taken
                    continue
                peer, theirs = cls._admit(sock, rank, token)
                if peer is None or peer not in higher or peer in links:
                    log.warning("pipeline link: a connection to stage %d from %s refused (%s)", rank, addr[0],
                                "failed the cluster-token check (is SWITCHBOARD_CLUSTER_TOKEN the same on every "
                                "stage?), or did not answer in time" if peer is None
                                else f"claims stage {peer}, not one stage {rank} waits for")
                    with contextlib.suppress(OSError):
                        sock.sendall(REFUSED)
                    sock.close()
                    continue
                try:
                    sock.sendall(ACCEPTED + proof(token, theirs, rank, peer, ACCEPTOR))
                except OSError:  # it left: the real one may still come
                    sock.close()
                    continue
                links[peer] = cls._ready(sock, peer)
            done = True
        finally:
            listener.close()
            if not done:
                for link in links.values():
                    link.close()
        log.info("pipeline links of stage %d: %s", rank, sorted(links))
        return cls(links)

    @staticmethod
    def _admit(sock: socket.socket, rank: int, token: str | None) -> tuple[int | None, bytes]:
        """The rank a connecting peer proves within HANDSHAKE_S (None: a wrong proof, too slow, or it
        left) and the nonce it wants this side's proof over."""
        deadline = time.monotonic() + HANDSHAKE_S
        sock.settimeout(HANDSHAKE_S)
        nonce = os.urandom(NONCE_BYTES)
        try:
            sock.sendall(nonce)
            answer = _read_exactly(sock, ANSWER, deadline)
        except OSError:
            return None, b""
        (peer,) = LENGTH.unpack(answer[: LENGTH.size])
        theirs, mac = answer[LENGTH.size : LENGTH.size + NONCE_BYTES], answer[LENGTH.size + NONCE_BYTES :]
        return (peer if hmac.compare_digest(mac, proof(token, nonce, peer, rank)) else None), theirs

    @staticmethod
    def _ready(sock: socket.socket, peer: int) -> Link:
        sock.settimeout(None)  # blocking: a silent peer is the heartbeat monitor's call, not a timeout's
        _tune(sock)
        return Link(sock, peer)

    def _link(self, peer: int) -> Link:
        try:
            return self.links[peer]
        except KeyError:
            raise ConnectionError(f"pipeline link: no connection to stage {peer}") from None

    def send(self, t: torch.Tensor, peer: int) -> None:
        self._link(peer).send(t)

    def isend(self, t: torch.Tensor, peer: int) -> Work:
        return self._link(peer).isend(t)

    def recv(self, t: torch.Tensor, peer: int, poll_s: float = 0.0) -> None:
        """Blocking; `poll_s` > 0: poll the socket for up to that long first (Link.recv, POLL_S)."""
        self._link(peer).recv(t, poll_s)

    def irecv(self, t: torch.Tensor, peer: int) -> Work:
        return self._link(peer).irecv(t)

    def close(self) -> None:
        for link in self.links.values():
            link.close()
