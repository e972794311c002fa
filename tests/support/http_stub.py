"""An ASGI app on a free loopback port, in a thread: how tests serve their stubs of outside APIs
(Nomad, the Kubernetes API server) to the real HTTP clients under test.

    with serve_app(stub.app) as url:
        await NomadActuator(http, addr=url).current()
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from tests.support.procs import free_port


@contextlib.contextmanager
def serve_app(app: FastAPI) -> Iterator[str]:
    """`app` on a free loopback port, in a thread, for the duration; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="api-stub", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "stub did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)
