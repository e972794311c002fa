"""Background responses (`background: true` on `POST /v1/responses`): what this gateway holds of each
while it runs, and the bounds on it.

    client.responses.create(model=..., input="...", background=True)        # status "queued", at once
    client.responses.retrieve(r.id)                                         # poll: in_progress, completed
    client.responses.cancel(r.id)                                           # status "cancelled"
    client.responses.create(..., background=True, stream=True)              # the events, each numbered
    client.responses.retrieve(r.id, stream=True, starting_after=41)         # the events after 41 again

A background response is an ordinary Responses request (data_plane/gateway/responses.py, its routing,
resumable shard stream, usage, ledger, key binding) run by a task of this gateway instead of the
client's connection (data_plane/gateway/responses_detached.py): the connection only waits until the
request passed its checks (a 4xx or 429 is still answered at once), then returns the stored
``queued`` response, or, with ``stream: true``, follows the run's events (``response.created`` and
``response.queued`` with the queued response as soon as it is accepted, so the client has its id while it
waits for a slot; ``response.in_progress`` and the rest once it runs). A `Run` here is the task,
its events (``sequence_number`` = index; held up to ``--background-event-bytes``, oldest dropped)
and the latest response object; `BackgroundRuns` keeps them (at most ``--background-held``, finished
ones dropped first and after ``--background-keep-s``) and counts each tenant's unfinished ones
(``--background-per-tenant``: 429 with Retry-After beyond). The record on the cache nodes is the
truth for any gateway: ``queued`` with a deadline when accepted, then what the run ended as.

How a run can end: completed/incomplete (the reply), ``failed`` (an error after it was accepted: no
shard, shed by admission, every shard gone past the resumes; ``--background-max-s`` reached; the
gateway shutting down: its runs get the shutdown grace, then are stopped and stored ``failed`` with
``server_error``), ``cancelled`` (`POST /v1/responses/{id}/cancel`: the shard's work is aborted as
for a client that leaves). A gateway that dies without shutting down (SIGKILL, a lost host) cannot
write anything: its record stays ``queued`` until its deadline (accepted + ``--background-max-s``),
after which any gateway that reads it reports and stores it ``failed`` (`expired`). Nothing is left
``in_progress`` forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.types import Message

from data_plane.common.errors import InvalidRequest, Overloaded, RateLimited, SwitchboardError, from_openai_body

log = logging.getLogger(__name__)

TERMINAL = frozenset({"completed", "incomplete", "failed", "cancelled"})
"""Statuses a response never leaves."""
SHUTDOWN, CANCELLED, TIMED_OUT = "shutdown", "cancelled", "timed_out"
"""Why a run was stopped (`Run.stop`); the bounded `reason` of its outcome metric."""
STOP_MESSAGES = {
    SHUTDOWN: "the gateway shut down before this background response finished; create it again",
    TIMED_OUT: "the background response ran past this gateway's limit (--background-max-s)",
}
STOPPED_AS = {SHUTDOWN: (200, "server_shutting_down"), TIMED_OUT: (200, "request_timeout")}
"""How a run the server stopped is counted and billed (status, code): as a stream the shutdown cut (its create
was answered 200 and its record keeps what it produced, billed as that stream's is), not as a client that left
(a cancel is the client's own doing, and stays 499 ``client_disconnected``); a run stopped at
--background-max-s is ``request_timeout`` the same way."""
EXPIRED_MESSAGE = ("the gateway running this response stopped before it finished "
                   "(it was not seen again before its deadline); create it again")
_SNAPSHOT_EVENTS = (b"event: response.created\n", b"event: response.queued\n", b"event: response.in_progress\n",
                    b"event: response.completed\n", b"event: response.incomplete\n", b"event: response.failed\n")


class Detach(BaseException):
    """Raised out of a Responses request's handler once its body says ``background: true``: the
    gateway's app then serves it as a background response (a BaseException, so the handler's error
    path does not answer it as a failure)."""

    def __init__(self, raw: bytes) -> None:
        super().__init__("background")
        self.raw = raw


class BackgroundMetrics:
    """The gateway's background-response metrics (bounded labels: outcome, result)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.active = Gauge("switchboard_background_responses_active",
                            "Background responses queued or in progress on this gateway.", registry=registry)
        self.ended = Counter("switchboard_background_responses_total",
                             "Background responses by how they ended: completed, incomplete, failed, cancelled; "
                             "refused: over the tenant's cap (429); rejected: an error before they were accepted.",
                             ["outcome"], registry=registry)
        self.held_bytes = Gauge("switchboard_background_event_bytes",
                                "Bytes of streamed events held for background responses (resumable streams).",
                                registry=registry)
        self.resumes = Counter("switchboard_background_stream_resumes_total",
                               "Streams of a background response read again (GET ?stream=true), by result.",
                               ["result"], registry=registry)
        for outcome in (*sorted(TERMINAL), "refused", "rejected"):
            self.ended.labels(outcome)


class Run:
    """One background response on this gateway: its task, its events and its latest response object."""

    def __init__(self, response_id: str, owner: str, tenant: str, raw: bytes, max_bytes: int,
                 metrics: BackgroundMetrics) -> None:
        self.id, self.owner, self.tenant = response_id, owner, tenant
        self.started = time.monotonic()
        self.finished_at: float | None = None
        self.response: dict[str, Any] | None = None
        """The response as it stands (queued once accepted, then as the events tell)."""
        self.stop_reason: str | None = None
        self.early: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None
        """An HTTP error the request ended with before it was accepted: status, headers, body."""
        self.error: SwitchboardError | None = None
        """An HTTP error after it was accepted (shed, no shard): the run failed with it."""
        self.task: asyncio.Task[None] | None = None
        self.followers = 0
        """Streams following it now (GET ?stream=true: data_plane/gateway/responses_detached.py)."""
        self._raw: bytes | None = raw
        self._max_bytes = max_bytes
        self._metrics = metrics
        self._events: list[bytes] = []
        self._held = 0
        self.first_seq = 0
        """The sequence number of the oldest event still held."""
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._accepted = asyncio.get_running_loop().create_future()
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()

    # -- the detached request's ASGI side -------------------------------------------------------

    async def receive(self) -> Message:
        """The body once, then nothing until the run is stopped: then a disconnect, which the chat
        path answers as for a client that left (the shard's work aborted, data_plane/common/disconnect.py)."""
        if self._raw is not None:
            raw, self._raw = self._raw, None
            return {"type": "http.request", "body": raw, "more_body": False}
        await self._stopping.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._status = message["status"]
            self._headers = list(message.get("headers") or [])
            return
        body = message.get("body", b"")
        if self._status != 200:
            self._body.append(body)
            if not message.get("more_body"):
                self._errored(b"".join(self._body))
            return
        for block in body.split(b"\n\n"):
            if block.startswith(b"event: "):
                self._append(block + b"\n\n")
        self._notify()

    def _errored(self, raw: bytes) -> None:
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        if not self._accepted.done():
            self.early = (self._status, self._headers, raw)
            self._accepted.set_result(None)
        else:
            self.error = from_openai_body(self._status, parsed)

    def _append(self, event: bytes) -> None:
        if event.startswith(_SNAPSHOT_EVENTS):
            data = event.partition(b"\ndata: ")[2]
            self.response = json.loads(data)["response"]
        self._events.append(event)
        self._held += len(event)
        self._metrics.held_bytes.inc(len(event))
        if self._held > self._max_bytes:  # down to 3/4 at once: a list indexes in O(1), drops amortized
            dropped = freed = 0
            while self._held - freed > self._max_bytes * 3 // 4 and dropped < len(self._events) - 1:
                freed += len(self._events[dropped])
                dropped += 1
            del self._events[:dropped]
            self._held -= freed
            self._metrics.held_bytes.dec(freed)
            self.first_seq += dropped

    def tell(self, kind: str, **fields: Any) -> None:
        """Add one event of the gateway's own, numbered next: the ``queued`` response once accepted, or the end
        of a run that ended without its stream telling why."""
        body = json.dumps({"type": kind, "sequence_number": self.next_seq, **fields}, ensure_ascii=False)
        self._append(f"event: {kind}\ndata: {body}\n\n".encode())
        self._notify()

    def _notify(self) -> None:
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    # -- what the routes read -------------------------------------------------------------------

    def accept(self, response: dict[str, Any]) -> None:
        """The request passed every check and is stored ``queued``: the client may have its id."""
        self.response = response
        if not self._accepted.done():
            self._accepted.set_result(None)

    async def accepted(self) -> None:
        """Until accepted, or ended before it (`early`), whichever comes first."""
        assert self.task is not None
        await asyncio.wait([self._accepted, self.task], return_when=asyncio.FIRST_COMPLETED)

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self._events)

    def ended(self, response: dict[str, Any] | None) -> None:
        """The task is over; `response` as it was stored last."""
        if response is not None:
            self.response = response
        self.finished_at = time.monotonic()
        self._notify()

    def stop(self, reason: str) -> bool:
        """Stop the run (cancelled, shutdown, timed out): False when it already ended."""
        if self.done or self._stopping.is_set():
            return False
        self.stop_reason = reason
        self._stopping.set()
        return True

    def check_after(self, after: int) -> None:
        """400 when the events after `after` are no longer all held."""
        if after + 1 < self.first_seq:
            self._metrics.resumes.labels("dropped").inc()
            raise InvalidRequest(f"events up to sequence_number {self.first_seq - 1} are no longer held; "
                                 f"resume with starting_after >= {self.first_seq - 1} or retrieve the response",
                                 param="starting_after")

    async def events(self, after: int = -1) -> AsyncIterator[bytes]:
        """The SSE events after sequence number `after`, as they come, until the run ended."""
        seq = after + 1
        while True:
            if seq < self.first_seq:  # this reader fell behind the bound: end it, as a failed stream does
                err = {"type": "error", "sequence_number": seq, "code": "events_dropped",
                       "message": "this stream fell behind and its events were dropped; resume it", "param": None}
                yield b"event: error\ndata: " + json.dumps(err).encode() + b"\n\n"
                return
            if seq < self.next_seq:
                event = self._events[seq - self.first_seq]
                seq += 1
                yield event
                continue
            if self.done:
                return
            await self._wake.wait()

    def release(self) -> None:
        self._metrics.held_bytes.dec(self._held)
        self._held = 0
        self._events.clear()


class BackgroundRuns:
    """This gateway's background responses (see the module docstring)."""

    def __init__(self, per_tenant: int, max_s: float, keep_s: float, event_bytes: int, held: int,
                 metrics: BackgroundMetrics) -> None:
        self.per_tenant, self.max_s, self.keep_s = per_tenant, max_s, keep_s
        self.event_bytes, self.held = event_bytes, held
        self.metrics = metrics
        self._runs: dict[str, Run] = {}
        self._closing = False

    def get(self, response_id: str, owner: str) -> Run | None:
        """The run of `response_id` if this gateway holds it and `owner` made it (else None: the
        stored record answers, with its 404 for another key)."""
        run = self._runs.get(response_id)
        return run if run is not None and run.owner == owner else None

    def admit(self, response_id: str, owner: str, tenant: str, raw: bytes) -> Run:
        """A new run of `tenant`'s, or 429 (its cap) / 503 (shutting down)."""
        if self._closing:
            raise Overloaded("the gateway is shutting down", retry_after=1, code="not_ready")
        self._evict()
        if not self.per_tenant:
            raise InvalidRequest("background responses are turned off on this server", param="background")
        active = [r for r in self._runs.values() if r.tenant == tenant and not r.done]
        if len(active) >= self.per_tenant:
            self.metrics.ended.labels("refused").inc()
            oldest = min((r.started for r in active), default=time.monotonic())
            wait = max(1.0, min(60.0, (time.monotonic() - oldest) / 2 or 1.0))
            raise RateLimited(f"this organization has {len(active)} background responses queued or in progress, "
                              "the most allowed at once; retry once one finishes", param="background",
                              retry_after=wait)
        run = Run(response_id, owner, tenant, raw, self.event_bytes, self.metrics)
        self._runs[response_id] = run
        self.metrics.active.inc()
        return run

    def finished(self, run: Run) -> None:
        """`run`'s task ended (counted once by what it came to)."""
        self.metrics.active.dec()
        status = (run.response or {}).get("status")
        if run.early is not None:
            self.metrics.ended.labels("rejected").inc()
            self._runs.pop(run.id, None)
            run.release()
        elif status in TERMINAL:
            self.metrics.ended.labels(status).inc()
        self._evict()

    def _evict(self) -> None:
        now = time.monotonic()
        for run in [r for r in self._runs.values() if r.done and now - (r.finished_at or now) > self.keep_s]:
            self._drop(run)
        if len(self._runs) >= self.held:
            for run in sorted((r for r in self._runs.values() if r.done), key=lambda r: r.finished_at or 0):
                if len(self._runs) < self.held:
                    break
                self._drop(run)

    def _drop(self, run: Run) -> None:
        self._runs.pop(run.id, None)
        run.release()

    async def aclose(self, wait_s: float = 10.0) -> None:
        """Shutdown: every run still going is stopped and stores itself failed (its handler writes
        the record while the cache nodes are still open: this runs before the runtime closes)."""
        self._closing = True
        going = [r for r in self._runs.values() if not r.done]
        for run in going:
            run.stop(SHUTDOWN)
        tasks = [r.task for r in going if r.task is not None]
        if tasks:
            log.warning("shutdown: stopping %d background response(s)", len(tasks))
            _, pending = await asyncio.wait(tasks, timeout=wait_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for run in list(self._runs.values()):
            self._drop(run)


def expired(response: dict[str, Any] | None, deadline: float, now: float | None = None) -> bool:
    """A stored background response that is unfinished past its deadline: its gateway is gone."""
    status = (response or {}).get("status")
    return bool(deadline) and status not in TERMINAL and (now or time.time()) > deadline
