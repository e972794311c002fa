"""A throwaway redis-server on a free loopback port (no persistence), for the Redis-backed tests.

    with RedisServer() as redis_server:         # or the `redis_server` fixture (tests/conftest.py)
        node = cache_node("--redis", redis_server.url)
        redis_server.flush()

The fixture skips, saying how to install it, when redis-server is not on PATH.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from typing import Self

from tests.support.procs import free_port


def have_redis() -> bool:
    return shutil.which("redis-server") is not None


class RedisServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        import redis

        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=0.2).ping()
                return self
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not come up in 20 s")

    def flush(self) -> None:
        import redis

        redis.Redis(port=self.port).flushall()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
