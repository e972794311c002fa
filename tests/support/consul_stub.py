"""An HTTP STUB of a Consul agent: the slice of its HTTP API that Switchboard uses.

    with ConsulStub() as stub:                         # a real process on a free loopback port
        httpx.put(stub.url + "/v1/agent/service/register", json={"Name": "switchboard-shard", ...})

    .venv/bin/python -m tests.support.consul_stub --port 8500  # by hand

This is not Consul: no agent can be installed on our machines (docs/FACTS.md), so the Consul
backend's tests run against this stub, and against a live agent when ``CONSUL_HTTP_ADDR`` is set.
It answers with the request/response shapes of Consul's API docs (agent services and TTL checks,
health, KV) for a single node, ``consul-stub``, in datacenter ``dc1``::

    PUT  /v1/agent/service/register               {"ID","Name","Tags","Address","Port","Meta","Check"|"Checks"}
    PUT  /v1/agent/service/deregister/<id>
    PUT  /v1/agent/service/maintenance/<id>?enable=true|false&reason=
    PUT  /v1/agent/check/pass|warn|fail/<check-id>?note=
    PUT  /v1/agent/check/update/<check-id>        {"Status","Output"}
    GET  /v1/agent/services | /v1/agent/checks
    GET  /v1/health/service/<name>?passing&tag=&index=&wait=      blocking query, X-Consul-Index
    GET  /v1/catalog/services
    GET  /v1/kv/<key>?recurse&keys&raw&index&wait  PUT ?cas=&flags=  DELETE ?recurse&cas=
    GET  /v1/status/leader

Known differences from a real agent, on purpose: only TTL checks; ``DeregisterCriticalServiceAfter``
is honoured to the 0.1 s (Consul's minimum is one minute, reaped every 30 s); state is in memory only
(a restarted stub has forgotten every service, as a wiped agent would); indexes start at 1 per run;
no ACLs (``X-Consul-Token`` is accepted and ignored); no sessions or locks. On SIGTERM it answers
blocking queries at once and stops expiring checks, so "Consul went away" is not mistaken for
"every member went critical".
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from data_plane.membership.consul import consul_headers, consul_http_url, token_from_env
from tests.support.procs import Service

ENV_LIVE_CONSUL = "CONSUL_HTTP_ADDR"
"""Set (e.g. ``127.0.0.1:8500``) to run the Consul tests against that live agent as well."""

NODE = "consul-stub"
NODE_ADDRESS = "127.0.0.1"
DATACENTER = "dc1"
CHECK_STATUSES = ("passing", "warning", "critical")
MAINTENANCE_PREFIX = "_service_maintenance:"
REAP_INTERVAL_S = 0.05
MAX_WAIT_S = 600.0
DEFAULT_WAIT_S = 300.0
_META_KEY = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class StubError(Exception):
    """Answered as Consul does: a status code and a plain-text body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_duration(text: Any) -> float:
    """Go's ``time.ParseDuration`` for the forms Consul accepts (``"800ms"``, ``"1m30s"``), or seconds."""
    if isinstance(text, (int, float)):
        return float(text) / 1e9  # a bare JSON number is nanoseconds in Consul's Go structs
    s = str(text).strip()
    if s in ("", "0"):
        return 0.0
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(s):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos != len(s):
        raise StubError(400, f"time: invalid duration {s!r}")
    return total


@dataclass
class _Check:
    id: str
    name: str
    service_id: str
    service_name: str
    status: str
    ttl_s: float
    deregister_after_s: float
    notes: str = ""
    output: str = ""
    deadline: float = 0.0  # monotonic
    critical_since: float | None = None  # monotonic
    create_index: int = 0
    modify_index: int = 0

    def to_json(self, tags: list[str]) -> dict[str, Any]:
        return {
            "Node": NODE, "CheckID": self.id, "Name": self.name, "Status": self.status,
            "Notes": self.notes, "Output": self.output, "ServiceID": self.service_id,
            "ServiceName": self.service_name, "ServiceTags": list(tags), "Type": "ttl" if self.ttl_s else "",
            "Definition": {}, "CreateIndex": self.create_index, "ModifyIndex": self.modify_index,
        }


@dataclass
class _Service:
    id: str
    name: str
    tags: list[str]
    address: str
    port: int
    meta: dict[str, str]
    create_index: int = 0
    modify_index: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "ID": self.id, "Service": self.name, "Tags": list(self.tags), "Address": self.address,
            "Meta": dict(self.meta), "Port": self.port, "Weights": {"Passing": 1, "Warning": 1},
            "EnableTagOverride": False, "Datacenter": DATACENTER,
            "CreateIndex": self.create_index, "ModifyIndex": self.modify_index,
        }


@dataclass
class _KV:
    key: str
    value: bytes
    flags: int
    create_index: int
    modify_index: int

    def to_json(self) -> dict[str, Any]:
        return {
            "LockIndex": 0, "Key": self.key, "Flags": self.flags,
            "Value": base64.b64encode(self.value).decode() if self.value else None,
            "CreateIndex": self.create_index, "ModifyIndex": self.modify_index,
        }


@dataclass
class ConsulState:
    """One node's services, checks and KV, with Consul-style modify indexes."""

    clock: Callable[[], float] = time.monotonic
    index: int = 1
    services: dict[str, _Service] = field(default_factory=dict)
    checks: dict[str, _Check] = field(default_factory=dict)
    kv: dict[str, _KV] = field(default_factory=dict)
    service_index: dict[str, int] = field(default_factory=dict)
    kv_tombstones: dict[str, int] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False

    def close(self) -> None:
        """Shutting down: answer blocking queries now and stop expiring checks (nobody can heartbeat)."""
        self.closed = True
        self.changed.set()

    def bump(self, service_name: str | None = None) -> int:
        self.index += 1
        if service_name is not None:
            self.service_index[service_name] = self.index
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()  # every blocking query re-checks its own index
        return self.index

    async def block(self, current: Callable[[], int], index: int, wait_s: float) -> None:
        """Consul's blocking query: wait while the result's index is still <= `index`."""
        if index <= 0:
            return
        deadline = self.clock() + min(wait_s, MAX_WAIT_S)
        while current() <= index and not self.closed:
            remaining = deadline - self.clock()
            if remaining <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)

    # -- services and checks -----------------------------------------------------------------

    def register(self, body: dict[str, Any]) -> None:
        name = body.get("Name")
        if not isinstance(name, str) or not name:
            raise StubError(400, "Missing service name")
        sid = str(body.get("ID") or name)
        meta = body.get("Meta") or {}
        if len(meta) > 64:
            raise StubError(400, "Invalid Service Meta: Node metadata cannot contain more than 64 key/value pairs")
        for key, value in meta.items():
            if not _META_KEY.match(str(key)) or str(key).startswith("consul-"):
                raise StubError(400, f"Invalid Service Meta: Key contains invalid characters: {key!r}")
            if len(str(value)) > 512:
                raise StubError(400, "Invalid Service Meta: Value is too long (limit: 512 characters)")
        defs = ([body["Check"]] if body.get("Check") else []) + list(body.get("Checks") or [])
        parsed = [self._parse_check(d, sid, name, i, len(defs)) for i, d in enumerate(defs)]
        old = self.services.get(sid)
        if old is not None and old.name != name:
            self.deregister(sid)
            old = None
        index = self.bump(name)
        svc = _Service(sid, name, list(body.get("Tags") or []), str(body.get("Address") or ""),
                       int(body.get("Port") or 0), {str(k): str(v) for k, v in meta.items()},
                       create_index=old.create_index if old else index, modify_index=index)
        self.services[sid] = svc
        for check in parsed:
            prev = self.checks.get(check.id)
            check.create_index = prev.create_index if prev else index
            check.modify_index = index
            self.checks[check.id] = check

    def _parse_check(self, d: dict[str, Any], sid: str, name: str, i: int, n: int) -> _Check:
        if not d.get("TTL"):
            raise StubError(400, "stub: only TTL checks are implemented (Check.TTL)")
        ttl = parse_duration(d["TTL"])
        if ttl <= 0:
            raise StubError(400, "Invalid check: TTL must be > 0")
        status = str(d.get("Status") or "critical")
        if status not in CHECK_STATUSES:
            raise StubError(400, f"Invalid check status: {status!r}")
        cid = str(d.get("CheckID") or d.get("ID") or (f"service:{sid}" if n == 1 else f"service:{sid}:{i + 1}"))
        return _Check(cid, str(d.get("Name") or f"Service '{name}' check"), sid, name, status, ttl,
                      parse_duration(d.get("DeregisterCriticalServiceAfter") or 0), str(d.get("Notes") or ""),
                      deadline=self.clock() + ttl, critical_since=self.clock() if status == "critical" else None)

    def deregister(self, sid: str) -> None:
        svc = self.services.pop(sid, None)
        if svc is None:
            raise StubError(404, f'Unknown service ID "{sid}". Ensure that the service ID is passed, not the service name.')
        for cid in [c.id for c in self.checks.values() if c.service_id == sid]:
            del self.checks[cid]
        self.bump(svc.name)

    def update_check(self, cid: str, status: str, output: str | None) -> None:
        check = self.checks.get(cid)
        if check is None:
            raise StubError(404, f'Unknown check ID "{cid}". Ensure that the check ID is passed, not the check name.')
        if not check.ttl_s:
            raise StubError(500, f'CheckID "{cid}" does not have associated TTL')
        if status not in CHECK_STATUSES:
            raise StubError(400, f"Invalid check status: {status!r}")
        check.deadline = self.clock() + check.ttl_s
        output = check.output if output is None else output
        if status != check.status or output != check.output:  # a heartbeat that changes nothing wakes nobody
            check.status, check.output = status, output
            check.critical_since = self.clock() if status == "critical" else None
            check.modify_index = self.bump(check.service_name)

    def maintenance(self, sid: str, enable: bool, reason: str) -> None:
        svc = self.services.get(sid)
        if svc is None:
            raise StubError(404, f'Unknown service ID "{sid}"')
        cid = MAINTENANCE_PREFIX + sid
        if enable and cid not in self.checks:
            index = self.bump(svc.name)
            self.checks[cid] = _Check(cid, "Service Maintenance Mode", sid, svc.name, "critical", 0.0, 0.0,
                                      notes=reason or "Maintenance mode is enabled for this service, "
                                      "but no reason was provided. This is a default message.",
                                      create_index=index, modify_index=index)
        elif not enable and cid in self.checks:
            del self.checks[cid]
            self.bump(svc.name)

    def reap(self) -> None:
        if self.closed:
            return
        now = self.clock()
        for check in list(self.checks.values()):
            if not check.ttl_s or check.id not in self.checks:
                continue
            if check.status != "critical" and now > check.deadline:
                check.status, check.critical_since = "critical", now
                check.output = "TTL expired"
                check.modify_index = self.bump(check.service_name)
            if (check.status == "critical" and check.deregister_after_s and check.critical_since is not None
                    and now - check.critical_since >= check.deregister_after_s
                    and check.service_id in self.services):
                self.deregister(check.service_id)

    def health(self, name: str, passing: bool, tag: str | None) -> list[dict[str, Any]]:
        serf = {"Node": NODE, "CheckID": "serfHealth", "Name": "Serf Health Status", "Status": "passing",
                "Notes": "", "Output": "Agent alive and reachable", "ServiceID": "", "ServiceName": "",
                "ServiceTags": [], "Type": "", "CreateIndex": 1, "ModifyIndex": 1}
        out = []
        for svc in sorted(self.services.values(), key=lambda s: s.id):
            if svc.name != name or (tag is not None and tag not in svc.tags):
                continue
            checks = [c.to_json(svc.tags) for c in self.checks.values() if c.service_id == svc.id]
            if passing and any(c["Status"] != "passing" for c in checks):
                continue
            node = {"ID": "00000000-0000-0000-0000-000000000001", "Node": NODE, "Address": NODE_ADDRESS,
                    "Datacenter": DATACENTER, "TaggedAddresses": {"lan": NODE_ADDRESS, "wan": NODE_ADDRESS},
                    "Meta": {}, "CreateIndex": 1, "ModifyIndex": 1}
            out.append({"Node": node, "Service": svc.to_json(), "Checks": [serf, *checks]})
        return out

    # -- KV ----------------------------------------------------------------------------------

    def kv_index(self, key: str, recurse: bool) -> int:
        def under(k: str) -> bool:
            return k.startswith(key) if recurse else k == key

        found = [e.modify_index for k, e in self.kv.items() if under(k)]
        found += [i for k, i in self.kv_tombstones.items() if under(k)]
        return max(found, default=1)

    def kv_put(self, key: str, value: bytes, flags: int, cas: int | None) -> bool:
        old = self.kv.get(key)
        if cas is not None and (old.modify_index if old else 0) != cas:
            return False
        index = self.bump()
        self.kv[key] = _KV(key, value, flags, old.create_index if old else index, index)
        self.kv_tombstones.pop(key, None)
        return True

    def kv_delete(self, key: str, recurse: bool, cas: int | None) -> bool:
        keys = [k for k in self.kv if (k.startswith(key) if recurse else k == key)]
        if cas is not None and not recurse:
            old = self.kv.get(key)
            if old is None or old.modify_index != cas:
                return cas == 0 and old is None  # Consul: cas=0 on a missing key succeeds trivially
        if not keys:
            return True
        index = self.bump()
        for k in keys:
            del self.kv[k]
            self.kv_tombstones[k] = index
        return True


def _flag(request: Request, name: str) -> bool:
    """Consul's boolean query flags: present (``?passing``) or true-ish (``?passing=true``)."""
    if name not in request.query_params:
        return False
    return request.query_params[name].lower() not in ("false", "0")


def _blocking_args(request: Request) -> tuple[int, float]:
    try:
        index = int(request.query_params.get("index", "0"))
    except ValueError:
        raise StubError(400, "Invalid index") from None
    wait = request.query_params.get("wait")
    return index, min(parse_duration(wait), MAX_WAIT_S) if wait else DEFAULT_WAIT_S


def _json(body: Any, index: int | None = None, status: int = 200) -> JSONResponse:
    headers = {"X-Consul-Effective-Consistency": "leader", "X-Consul-KnownLeader": "true",
               "X-Consul-LastContact": "0"}
    if index is not None:
        headers["X-Consul-Index"] = str(index)
    return JSONResponse(body, status_code=status, headers=headers)


def create_app() -> FastAPI:
    """The stub's ASGI app; its state lives in ``app.state.consul`` and dies with the process."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def reaper() -> None:
            while True:
                await asyncio.sleep(REAP_INTERVAL_S)
                state.reap()

        task = asyncio.create_task(reaper(), name="consul-stub-reaper")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    state = ConsulState()
    app = FastAPI(title="Consul HTTP API stub (not Consul)", lifespan=lifespan)
    app.state.consul = state

    @app.exception_handler(StubError)
    async def _stub_error(request: Request, exc: StubError) -> Response:
        return PlainTextResponse(str(exc), status_code=exc.status)

    async def _json_body(request: Request) -> Any:
        raw = await request.body()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise StubError(400, f"Request decode failed: {exc}") from None

    @app.get("/v1/status/leader")
    async def leader() -> JSONResponse:
        return _json(f"{NODE_ADDRESS}:8300")

    @app.get("/v1/agent/self")
    async def agent_self() -> JSONResponse:
        return _json({"Config": {"Datacenter": DATACENTER, "NodeName": NODE, "Version": "stub"},
                      "Member": {"Name": NODE, "Addr": NODE_ADDRESS, "Status": 1}})

    @app.put("/v1/agent/service/register")
    async def register(request: Request) -> Response:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise StubError(400, "Request decode failed: expected an object")
        state.register(body)
        return Response(status_code=200)

    @app.put("/v1/agent/service/deregister/{sid:path}")
    async def deregister(sid: str) -> Response:
        state.deregister(sid)
        return Response(status_code=200)

    @app.put("/v1/agent/service/maintenance/{sid:path}")
    async def maintenance(sid: str, request: Request) -> Response:
        enable = request.query_params.get("enable")
        if enable not in ("true", "false"):
            raise StubError(400, "Missing value for enable")
        state.maintenance(sid, enable == "true", request.query_params.get("reason", ""))
        return Response(status_code=200)

    @app.put("/v1/agent/check/{verb}/{cid:path}")
    async def check(verb: str, cid: str, request: Request) -> Response:
        statuses = {"pass": "passing", "warn": "warning", "fail": "critical"}
        if verb in statuses:
            state.update_check(cid, statuses[verb], request.query_params.get("note"))
        elif verb == "update":
            body = await _json_body(request)
            state.update_check(cid, str(body.get("Status") or ""), body.get("Output"))
        else:
            raise StubError(404, f"unknown check verb {verb!r}")
        return Response(status_code=200)

    @app.get("/v1/agent/services")
    async def agent_services() -> JSONResponse:
        return _json({s.id: s.to_json() for s in state.services.values()})

    @app.get("/v1/agent/checks")
    async def agent_checks() -> JSONResponse:
        tags = {s.id: s.tags for s in state.services.values()}
        return _json({c.id: c.to_json(tags.get(c.service_id, [])) for c in state.checks.values()})

    @app.get("/v1/health/service/{name}")
    async def health_service(name: str, request: Request) -> JSONResponse:
        index, wait_s = _blocking_args(request)
        await state.block(lambda: state.service_index.get(name, 1), index, wait_s)
        body = state.health(name, _flag(request, "passing"), request.query_params.get("tag"))
        return _json(body, state.service_index.get(name, 1))

    @app.get("/v1/catalog/services")
    async def catalog_services() -> JSONResponse:
        names: dict[str, set[str]] = {}
        for s in state.services.values():
            names.setdefault(s.name, set()).update(s.tags)
        return _json({n: sorted(t) for n, t in names.items()}, state.index)

    @app.get("/v1/kv/{key:path}")
    async def kv_get(key: str, request: Request) -> Response:
        recurse = _flag(request, "recurse") or _flag(request, "keys")
        index, wait_s = _blocking_args(request)
        await state.block(lambda: state.kv_index(key, recurse), index, wait_s)
        now_index = state.kv_index(key, recurse)
        entries = sorted((e for k, e in state.kv.items() if (k.startswith(key) if recurse else k == key)),
                         key=lambda e: e.key)
        if not entries:
            return Response(status_code=404, headers={"X-Consul-Index": str(now_index)})
        if _flag(request, "keys"):
            return _json([e.key for e in entries], now_index)
        if _flag(request, "raw"):
            return Response(entries[0].value, media_type="application/octet-stream",
                            headers={"X-Consul-Index": str(now_index)})
        return _json([e.to_json() for e in entries], now_index)

    @app.put("/v1/kv/{key:path}")
    async def kv_put(key: str, request: Request) -> JSONResponse:
        if not key:
            raise StubError(400, "Missing key name")
        cas = request.query_params.get("cas")
        stored = state.kv_put(key, await request.body(), int(request.query_params.get("flags", "0")),
                              int(cas) if cas is not None else None)
        return _json(stored)

    @app.delete("/v1/kv/{key:path}")
    async def kv_delete(key: str, request: Request) -> JSONResponse:
        cas = request.query_params.get("cas")
        return _json(state.kv_delete(key, _flag(request, "recurse"), int(cas) if cas is not None else None))

    return app


class ConsulStub(Service):
    """The stub as a real process on a free loopback port (``url`` is its HTTP address)."""

    def __init__(self, port: int | None = None) -> None:
        super().__init__([], port=port, ready_timeout=30.0, health="/v1/status/leader")
        self.args = [sys.executable, "-m", "tests.support.consul_stub", "--port", str(self.port)]

    @property
    def membership_url(self) -> str:
        """What ``--membership`` takes: ``consul://127.0.0.1:PORT``."""
        return f"consul://127.0.0.1:{self.port}"


@contextlib.contextmanager
def consul_agent(kind: str) -> Iterator[str]:
    """``http://host:port`` of a Consul HTTP API for a test: ``"stub"`` starts this stub as a process;
    ``"live"`` is the agent in ``CONSUL_HTTP_ADDR``, and skips the test when that is unset."""
    if kind == "live":
        addr = os.environ.get(ENV_LIVE_CONSUL)
        if not addr:
            pytest.skip(f"no live Consul agent: set {ENV_LIVE_CONSUL}=host:8500 to test against one")
        yield consul_http_url(addr)
        return
    with ConsulStub() as stub:
        yield stub.url


def consul_client() -> httpx.AsyncClient:
    """An httpx client for tests' own calls to Consul (sends ``CONSUL_HTTP_TOKEN`` when set)."""
    return httpx.AsyncClient(headers=consul_headers(token_from_env()), timeout=10.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="consul_stub", description="An HTTP stub of Consul's agent/health/KV API.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8500)
    args = parser.parse_args(argv)
    app = create_app()
    _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"), app.state.consul).run()


class _Server(uvicorn.Server):
    """uvicorn, plus: on SIGTERM, blocking queries answer at once and checks stop expiring."""

    def __init__(self, config: uvicorn.Config, state: ConsulState) -> None:
        super().__init__(config)
        self._state = state

    async def shutdown(self, sockets: Any = None) -> None:
        self._state.close()
        await super().shutdown(sockets)


if __name__ == "__main__":
    main(sys.argv[1:])
