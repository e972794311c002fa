"""A fork server for the tests' services: a process that has imported the platform once and forks a
child per service, which then runs `python -m MODULE ARGS` as a fresh interpreter would.

    server = ForkServer.start()                       # once per test process, on the first service
    proc = server.spawn("control_plane.cli", ["gateway", "--port", "8000"], env=env, cwd=ROOT, log=log)
    proc.poll(); proc.send_signal(signal.SIGTERM); proc.wait(15)   # subprocess.Popen's, for a Service

Why: a suite starts ~300 gateways, control planes, shards and cache nodes, and nearly all the CPU a
non-model one spends before /health is importing fastapi, pydantic, httpx and our modules: ~0.6 CPU-s a
process on a quiet Zen 4, 1-1.5 s on a loaded AVX2 host, where `make test` is bound by CPU. A forked
child starts with those imports done and pays only for what is its own (its settings, its app, its
port). It is still a real process on a loopback port, killed, stopped and frozen by its pid; `switchboard
up` and the CLI's own tests still start fresh interpreters (tests/test_startup_imports.py checks what a
fresh one imports).

What a fork keeps from the server, and why that is safe here:
- the server imports no torch and starts no thread and no event loop, so a fork copies one thread and
  no locks held by another (it refuses to fork, and the service starts the usual way, if a Python thread
  is running); a model shard's child imports torch itself, after the fork. The one native pool the
  imports start is numpy's OpenBLAS, which stops its workers around a fork itself (`pthread_atfork`);
- environment variables are read when settings are built, never at import (a child's environment is
  replaced before its module runs); a request whose interpreter-level variables (`PYTHON*`) differ from
  the server's is not forked: :meth:`ForkServer.spawn` returns None and the caller starts a process;
- `random` reseeds itself in a forked child (it registers `os.register_at_fork`); `secrets` and
  `uuid4` read the kernel. The string hash seed is the server's, as in any forked worker.

The server is the children's parent: it reaps each and sends its exit status back over the socket
(negative for a signal, as Popen reports it). It exits when the test process does (end of file on its
socket); children still running then are left as a Popen'd child would be.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

PRELOAD = ("control_plane.cli", "control_plane.app", "data_plane.gateway.app", "data_plane.shard.app",
           "data_plane.shard.engines.synthetic", "data_plane.cache.node", "data_plane.common.tracing",
           "data_plane.model_store", "uvicorn", "uvicorn.lifespan.on", "uvicorn.loops.uvloop",
           "uvicorn.protocols.websockets.auto", "httpcore", "h2.connection", "tokenizers", "pydantic.v1",
           "fastapi.telemetry._runtime")
"""What the server imports before it forks: the modules behind `switchboard gateway`, `control-plane`,
`shard` (not its torch engine: `torch` is imported by the engine, after the fork) and `cache-node`, and
what their start imports lazily (uvicorn's loop and protocols, httpx's HTTP/2, the tokenizer). None of
them starts a thread at import."""

MAX_MESSAGE = 1 << 20
INTERPRETER_ENV = "PYTHON"
"""Variables the interpreter reads at its own start (PYTHONPATH, PYTHONHASHSEED, ...): a child cannot
change them after the fork, so a request that changes one is started the usual way. PYTHONUNBUFFERED
is the exception: a child builds its own stdout and stderr (`_fresh_stdio`), as that variable asks."""
UNBUFFERED = "PYTHONUNBUFFERED"
LOST = -255
"""The exit code read for a child whose end the server could not report (the server itself was gone)."""
ENV_DISABLE = "SWITCHBOARD_TEST_FORKSERVER"
"""Set to 0 to start every service as a fresh interpreter (how the suite ran before this server)."""


class ForkedProcess:
    """The part of `subprocess.Popen` the tests use, for a child of the fork server."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        try:  # signals go through it: once the server has reaped the child, its pid may be reused
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd = None  # already ended and reaped: its status is on the way
        self._finalizer = weakref.finalize(self, _close, self._pidfd)

    def poll(self) -> int | None:
        return self._ended(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._ended(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def _ended(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self._server.exit_code(self.pid, timeout=timeout)
            except (OSError, RuntimeError):  # the server is gone: its children were handed to init
                if self._pidfd is None or select.select([self._pidfd], [], [], timeout)[0]:
                    self.returncode = LOST
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass  # exited, its status not yet read

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


class ForkServer:
    """The test process's end of the server: one socket, one request at a time (a lock), exit codes kept
    as they arrive."""

    _instance: ForkServer | None = None
    _tried = False
    _lock = threading.Lock()

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, env: dict[str, str]) -> None:
        self._proc = proc
        self._sock = sock
        self._env = env
        self._exits: dict[int, int] = {}
        self._io = threading.Lock()

    @classmethod
    def shared(cls, cwd: Path) -> ForkServer | None:
        """This process's server, started on first use; None where forking is off or unavailable."""
        if os.environ.get(ENV_DISABLE, "1") == "0" or not hasattr(os, "pidfd_open") or sys.platform != "linux":
            return None
        with cls._lock:
            if not cls._tried or (cls._instance is not None and cls._instance._proc.poll() is not None):
                cls._tried = True
                cls._instance = cls._start(cwd)
            return cls._instance

    @classmethod
    def _start(cls, cwd: Path) -> ForkServer | None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())], cwd=cwd, env=env,
                                pass_fds=(theirs.fileno(),))
        theirs.close()
        server = cls(proc, ours, env)
        atexit.register(server.close)
        # its imports done, the first fork is as fast as the rest; a kernel without pidfds gets no forks,
        # nor a server that died at its start (a module it imports failing): services start as before
        try:
            usable = server._request({"op": "ping"}, []).get("pidfd")
        except (OSError, RuntimeError):
            usable = False
        if not usable:
            server.close()
            return None
        return server

    def close(self) -> None:
        """End the server (end of file on its socket) and reap it, so its CPU time and its children's count
        towards this process's (`time make test` reads the whole suite)."""
        self._sock.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()

    def spawn(self, module: str, argv: list[str], *, env: dict[str, str], cwd: Path, log: int) -> ForkedProcess | None:
        """`python -m MODULE ARGV` as a fork with this environment, cwd and output (a file descriptor);
        None if the environment changes what the interpreter reads at its start."""
        if any(k.startswith(INTERPRETER_ENV) and k != UNBUFFERED and env.get(k) != self._env.get(k)
               for k in {*env, *self._env}):
            return None
        try:
            reply = self._request({"op": "spawn", "module": module, "argv": argv, "env": env, "cwd": str(cwd)},
                                  [log])
        except (OSError, RuntimeError):  # the server is gone: this one starts as a fresh interpreter
            return None
        if reply["pid"] is None:  # the server holds a thread: a fork could inherit a held lock
            return None
        return ForkedProcess(self, int(reply["pid"]), [sys.executable, "-m", module, *argv])

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """PID's exit status once the server has reaped it; None if it is still running after TIMEOUT."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._io:
            while pid not in self._exits:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._sock.settimeout(left)
                try:
                    self._read_one()
                except (TimeoutError, BlockingIOError):
                    return None
            return self._exits[pid]

    def _request(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        with self._io:
            self._sock.settimeout(None)
            socket.send_fds(self._sock, [json.dumps(message).encode()], fds)
            while True:
                reply = self._read_one()
                if reply["op"] != "exit":
                    return reply

    def _read_one(self) -> dict[str, Any]:
        data = self._sock.recv(MAX_MESSAGE)
        if not data:
            raise RuntimeError("the tests' fork server exited")
        message: dict[str, Any] = json.loads(data)
        if message["op"] == "exit":
            self._exits[int(message["pid"])] = int(message["code"])
        return message


def _pidfds() -> bool:
    """Whether this kernel gives out pidfds (Linux 5.3 and later, unless a sandbox refuses the call)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


def _serve(sock: socket.socket) -> dict[str, Any]:
    """The server's loop: fork on each request, reap each child. Returns (in the child only) the request
    that child is to run."""
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is sock:
                try:
                    data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
                except ConnectionResetError:
                    data = b""
                if not data:
                    sys.exit(0)  # the test process is gone
                request = json.loads(data)
                if request["op"] == "ping":
                    sock.send(json.dumps({"op": "pong", "pidfd": _pidfds()}).encode())
                    continue
                if threading.active_count() != 1:  # a Python thread (an import started one): no forks
                    for fd in fds:
                        os.close(fd)
                    sock.send(json.dumps({"op": "spawned", "pid": None}).encode())
                    continue
                pid = os.fork()
                if pid == 0:
                    for fd in [k.fd for k in selector.get_map().values() if k.fileobj is not sock]:
                        os.close(fd)  # the other children's pidfds
                    selector.close()
                    sock.close()
                    request["log"] = fds[0]
                    return request  # type: ignore[no-any-return]
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                selector.register(pidfd, selectors.EVENT_READ, pid)
                sock.send(json.dumps({"op": "spawned", "pid": pid}).encode())
            else:
                pid = key.data
                selector.unregister(key.fileobj)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                sock.send(json.dumps({"op": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _fresh_stdio(unbuffered: bool) -> None:
    """sys.stdout and sys.stderr as a fresh interpreter makes them over a file (the server's were made for
    its own output, a terminal perhaps): stdout block-buffered, stderr line-buffered; with
    PYTHONUNBUFFERED, both write through to the file."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=old.encoding,
                                  errors=old.errors, line_buffering=name == "stderr" and not unbuffered,
                                  write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _run(request: dict[str, Any]) -> None:
    """In a forked child: become `python -m MODULE ARGV` in its environment, cwd and output."""
    import runpy

    if sys.path and sys.path[0] == os.getcwd():  # `python -m` puts its cwd first on the path
        sys.path[0] = request["cwd"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    log = request["log"]
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    _fresh_stdio(bool(os.environ.get(UNBUFFERED)))
    sys.argv = [request["module"], *request["argv"]]
    sys.modules.pop(request["module"], None)  # run as `python -m` would: the module's code as __main__ only
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    _run(_serve(socket.socket(fileno=int(sys.argv[1]))))
