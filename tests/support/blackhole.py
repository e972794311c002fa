"""A TCP proxy that can be cut: a partition between its clients and its target, without root.

    with BlackholeProxy(target_port) as proxy:      # forwards 127.0.0.1:proxy.port -> 127.0.0.1:target_port
        proxy.cut()                                 # connections are accepted, nothing goes through either way
        proxy.heal()                                # new connections are forwarded again

While cut it behaves like a link that drops packets after the handshake: a caller's connect succeeds
(the kernel answers it) and its request is never answered, so the caller waits for its own timeout;
the connections opened during the cut stay silent after the heal (as TCP connections across a
partition usually die), new ones work. The target process itself keeps running and heartbeating.
"""

from __future__ import annotations

import select
import socket
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

    def cut(self) -> None:
        self._cut.set()

    def heal(self) -> None:
        self._cut.clear()

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
            if self._cut.is_set():
                self._held.append(client)  # held open, never read or answered
                continue
            threading.Thread(target=self._pipe, args=(client,), daemon=True, name="blackhole-pipe").start()

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
                    peers[sock].sendall(data)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()
