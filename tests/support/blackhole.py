"""A TCP proxy that can be cut: a partition between its clients and its target, without root.

    with BlackholeProxy(target_port) as proxy:      # forwards 127.0.0.1:proxy.port -> 127.0.0.1:target_port
        proxy.cut()                                 # connections are accepted, nothing goes through either way
        proxy.heal()                                # new connections are forwarded again
        proxy.flaky(every=2)                        # a lossy link: every 2nd new connection fails
        proxy.heal()                                # ... and every one is forwarded again

While cut it behaves like a link that drops packets after the handshake: a caller's connect succeeds
(the kernel answers it) and its request is never answered, so the caller waits for its own timeout;
the connections opened during the cut stay silent after the heal (as TCP connections across a
partition usually die), new ones work. The target process itself keeps running and heartbeating.

Flaky (a lossy or overloaded link, where calls fail now and then, not in a row): every `every`-th new
connection is reset as soon as its request arrives (``stall=True``: held silent, so the caller waits
for its own timeout), the others are forwarded; a forwarded connection is closed after its first
chunked response ends, so each call takes a new connection and the failures are spread over the
calls (a pooled connection would otherwise carry every later call). ``failed`` counts those cut.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from typing import Self


class BlackholeProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(256)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._cut = threading.Event()
        self._closed = threading.Event()
        self._held: list[socket.socket] = []
        self._every = 0
        self._stall = False
        self.connections = 0
        """Connections accepted so far."""
        self.failed = 0
        """Connections the flaky mode failed."""
        self.requests = 0
        """HTTP requests forwarded (writes from a client that start with a method)."""

    def cut(self) -> None:
        self._cut.set()

    def flaky(self, every: int = 2, stall: bool = False) -> None:
        """Fail every `every`-th new connection from now on: reset (or held silent with `stall`)."""
        self._every, self._stall = every, stall

    def heal(self) -> None:
        self._cut.clear()
        self._every = 0

    def __enter__(self) -> Self:
        threading.Thread(target=self._accept, daemon=True, name="blackhole-accept").start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        self._listener.close()
        for sock in self._held:
            sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            if self._cut.is_set():
                self._held.append(client)  # held open, never read or answered
                continue
            every = self._every
            if every and self.connections % every == 0:
                self.failed += 1
                if self._stall:
                    self._held.append(client)
                else:
                    threading.Thread(target=self._reset, args=(client,), daemon=True, name="blackhole-reset").start()
                continue
            threading.Thread(target=self._pipe, args=(client,), daemon=True, name="blackhole-pipe").start()

    @staticmethod
    def _reset(client: socket.socket) -> None:
        """Read the request, answer it with a TCP reset."""
        try:
            client.settimeout(5)
            client.recv(65536)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        finally:
            client.close()

    def _pipe(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        peers = {client: upstream, upstream: client}
        try:
            while not self._closed.is_set():
                readable, _, _ = select.select(list(peers), [], [], 0.2)
                if self._cut.is_set():
                    continue  # bytes wait unread on both sides: nothing goes through
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is client and data[:5] in (b"POST ", b"GET /"):
                        self.requests += 1
                    peers[sock].sendall(data)
                    if sock is upstream and self._every and data.endswith(b"0\r\n\r\n"):
                        return  # flaky: one call per connection
        except OSError:
            return
        finally:
            client.close()
            upstream.close()
