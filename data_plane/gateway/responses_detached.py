"""A background response's request, run by a task of the gateway, and its routes: create (the
client's side), `GET /v1/responses/{id}` (poll, or `?stream=true&starting_after=N` to follow its
events again) and `POST /v1/responses/{id}/cancel`. What a run holds and its bounds:
data_plane/gateway/responses_background.py.

`BackgroundHandler` is the Responses handler (data_plane/gateway/responses.py) on a request of its
own: the same scope and body, a `receive` that only ever says "disconnected" when the run is
stopped, and a `send` that is the run's event log. So the whole chat path runs unchanged (auth, rate
limit, safety, window, admission, KV-aware routing, the resumable shard stream, output filter,
usage, the ledger row, the stored turn) and a stop is the chat path's client-left abort: the shard's
work ends at its next step. It always streams (its events are what `?stream=true` replays) and
stores every state it reaches under one id, each write a higher version than the last (`PinnedStore`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace
from starlette.types import Receive, Scope, Send

from data_plane.cache.model import VersionConflict
from data_plane.common.disconnect import DisconnectWatch
from data_plane.common.errors import InvalidRequest, NotFound, RateLimited, SwitchboardError, render
from data_plane.gateway.chat import Opened
from data_plane.gateway.phases import Caller, Checked, Prepared
from data_plane.gateway.response_store import ConversationStore, Kind, Record
from data_plane.gateway.responses import RESPONSE_ERROR_CODES, ResponsesHandler, record_caller
from data_plane.gateway.responses_background import (
    CANCELLED,
    EXPIRED_MESSAGE,
    STOP_MESSAGES,
    STOPPED_AS,
    TERMINAL,
    BackgroundRuns,
    Run,
    expired,
)
from data_plane.gateway.responses_input import new_id
from data_plane.gateway.responses_items import ResponsesRequest, check_include, response_usage
from data_plane.gateway.responses_metrics import Op, observed
from data_plane.gateway.runtime import Gateway, Runtime
from data_plane.gateway.stream import EventSource

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

DEADLINE_GRACE_S = 60.0
"""Past `--background-max-s` (or that long, if shorter), how long a reader waits before it calls an
unfinished record expired (the running gateway stops its own run at the limit and stores it; this
covers that write)."""
CANCEL_WAIT_S = 10.0
"""How long a cancel waits for the run to store what it came to."""
CANCEL_POLL_S = 2.0
"""How often a run reads its record for a cancel sent to another gateway (one cache read)."""
MAX_FOLLOWERS = 4
"""Streams that may follow one run at once (a client and its reconnect, with room to spare); beyond, 429.
Unbounded, one key held 300 streams on one run (none metered: not a generation), and a few runs of a
tenant's could hold every connection the gateway has for `--background-max-s`."""
UNTOLD = ("failed", "cancelled")
"""How a stopped run ends without its stream saying so (the chat path's stream just stops): `settle` tells it."""
NOT_BACKGROUND = "Only responses created with background=true can be cancelled; this response was not."
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class PinnedStore(ConversationStore):
    """The conversation store for one background response: each save of its record carries a higher
    version than the one before (the nodes keep the highest), and once a final state is stored no
    progress write can cover it."""

    def __init__(self, store: ConversationStore, response_id: str) -> None:
        super().__init__(store.sessions, store.ttl_s)
        self._store = store
        self._id = response_id
        self._version = 0
        self._lock = asyncio.Lock()
        self.last: dict[str, Any] | None = None
        """The response as last stored."""
        self.on_cancelled: Callable[[], Any] | None = None
        """Called when a write finds the record cancelled or deleted by another gateway."""

    def later(self, work: Any, name: str) -> None:
        self._store.later(work, name)  # tracked by the app's store, closed with it

    async def save(self, record: Record, owner: str, replicas: int) -> None:
        if record.id != self._id:
            return await self._store.save(record, owner, replicas)
        async with self._lock:
            if (self.last or {}).get("status") in TERMINAL:
                return
            record.version = max(record.version, self._version)
            try:
                await self._store.save(record, owner, replicas)
            except VersionConflict:  # another gateway cancelled (or deleted) it meanwhile: that stands
                try:
                    current = await self._store.load(record.id, owner, replicas, Kind.RESPONSE)
                except NotFound:
                    current = Record(record.id, Kind.RESPONSE, [], record.route,
                                     response={**(record.response or {}), "status": "cancelled"})
                if (current.response or {}).get("status") != "cancelled":
                    raise
                self._version, self.last = current.version, current.response
                if self.on_cancelled is not None:
                    self.on_cancelled()  # the run stops: the shard's work is aborted
                return
            self._version = record.version
            self.last = record.response

    async def cancelled_elsewhere(self, owner: str, replicas: int) -> bool:
        """Whether another gateway stored this response cancelled (`POST .../cancel` sent there); its
        version is taken, so this gateway's own end is written over it."""
        async with self._lock:
            if self.last is None or self.last.get("status") in TERMINAL:
                return False
            current = await self._store.load(self._id, owner, replicas, Kind.RESPONSE)
            if (current.response or {}).get("status") != "cancelled":
                return False
            self._version = max(self._version, current.version)
            return True


class BackgroundHandler(ResponsesHandler):
    """One background response's request (see the module docstring)."""

    def __init__(self, gw: Gateway, rt: Runtime, request: Request, store: ConversationStore, run: Run,
                 deadline: float) -> None:
        super().__init__(gw, rt, request, PinnedStore(store, run.id))
        self.pinned: PinnedStore = self.store  # type: ignore[assignment]
        self.run = run
        self.pinned.on_cancelled = lambda: run.stop(CANCELLED)
        self.response_id = self.route = run.id
        self.deadline = deadline
        self.x.span.set_attribute("switchboard.response_id", run.id)
        self.x.span.set_attribute("switchboard.background", True)
        self.x.stopped_as = lambda: STOPPED_AS.get(run.stop_reason or "")

    def recorded(self, status: int) -> None:
        self.gw.responses_metrics.count(Op.BACKGROUND, status)

    def go_background(self, rreq: ResponsesRequest, raw: bytes) -> None:
        rreq.stream = True  # its events are the run's, whether or not the client follows them

    def _opened(self, checked: Checked, policy: Any, stream: EventSource) -> Opened:
        opened = super()._opened(checked, policy, stream)
        opened.include_usage = True
        return opened

    async def _route(self, caller: Caller, checked: Checked, prepared: Prepared) -> EventSource:
        """Every check passed: store it ``queued`` (any gateway's poll finds it) and let the client
        have its id, then wait for a slot and a shard as any request does."""
        queued = self._response("queued", [], None)
        await self.store_state(queued)
        self.run.accept(queued)
        self.run.tell("response.created", response=queued)  # a stream following it has its id at once
        self.run.tell("response.queued", response=queued)  # (OpenAI's order: created, queued, in_progress)
        self.announced = self.run.next_seq
        log.info("request %s: background response accepted (%d history items)", self.request_id,
                 len(self.history_items))
        return await super()._route(caller, checked, prepared)

    async def _store_in_progress(self) -> None:
        """Stored ``queued`` already (any poll finds it): ``in_progress`` off the stream's path."""
        self.store.later(self.store_state(self._response("in_progress", [], None)), name="background-progress")

    async def store_state(self, response: dict[str, Any]) -> None:
        rreq = self.rreq
        assert rreq is not None and self.tier is not None
        start = len(self.history_items)
        record = Record(self.response_id, Kind.RESPONSE, self.history_items + self.new_items, self.route,
                        response=response, input_range=(start, start + len(self.new_items)),
                        deadline=0.0 if response["status"] in TERMINAL else self.deadline)
        await self.store.save(record, self.owner, self.tier.replication)

    def _unfinished(self, code: str, message: str) -> dict[str, Any]:
        """A stopped run's response: ``cancelled`` (cancel), ``failed`` (shutdown, time limit), with
        the output and usage so far; any other failure as a streamed response's."""
        reason = self.run.stop_reason
        if reason is None or self.unfinished is not None:
            return super()._unfinished(code, message)
        assert self.opened is not None
        choice = self.opened.completion.choice(0)
        output = self._output("incomplete") if choice.text or choice.calls else []
        usage = response_usage(self.opened.completion.usage.wire())
        self.unfinished = self.ended(reason, output, usage)
        return self.unfinished

    def ended(self, reason: str | None, output: list[dict[str, Any]], usage: dict[str, Any] | None,
              error: SwitchboardError | None = None) -> dict[str, Any]:
        """The response of a run that ended without its reply."""
        if reason == CANCELLED:
            return self._response("cancelled", output, usage)
        response = self._response("failed", output, usage)
        if error is not None:
            code = error.code if error.code in RESPONSE_ERROR_CODES else (
                "rate_limit_exceeded" if error.status == 429 else "server_error")
            response["error"] = {"code": code, "message": error.message}
        else:
            response["error"] = {"code": "server_error",
                                 "message": STOP_MESSAGES.get(reason or "", "the response ended without its reply")}
        return response


async def watch_remote_cancel(handler: BackgroundHandler, run: Run) -> None:
    """Every CANCEL_POLL_S, whether a cancel reached another gateway (it stores the record cancelled,
    `cancel` below) or the response was deleted: then this run is stopped as if cancelled here (its
    shard work aborted; a deleted one's end is not written back: the tombstone outranks it)."""
    while not run.done:
        await asyncio.sleep(CANCEL_POLL_S)
        if handler.tier is None:
            continue
        try:
            if await handler.pinned.cancelled_elsewhere(handler.owner, handler.tier.replication):
                log.info("background response %s: cancelled on another gateway", run.id)
                run.stop(CANCELLED)
                return
        except NotFound:  # deleted (DELETE /v1/responses/{id}) while it ran: nobody can read it any more
            log.info("background response %s: deleted while it ran; stopped", run.id)
            run.stop(CANCELLED)
            return
        except SwitchboardError as exc:  # the nodes failed for now: next time
            log.debug("background response %s: cancel check failed (%s)", run.id, exc.code)


async def drive(runs: BackgroundRuns, run: Run, handler: BackgroundHandler, scope: Scope) -> None:
    """The run's task: the request, then what it came to, stored; bounded by --background-max-s."""
    timer = asyncio.get_running_loop().call_later(runs.max_s, run.stop, "timed_out")
    watcher = asyncio.get_running_loop().create_task(watch_remote_cancel(handler, run))
    try:
        await handler.serve(scope, run.receive, run.send)
    except asyncio.CancelledError:  # shutdown past its wait: still store the end below
        run.stop_reason = run.stop_reason or "shutdown"
    except Exception:
        log.exception("background response %s: unhandled error", run.id)
    finally:
        timer.cancel()
        watcher.cancel()
        final = None if run.early is not None else await settle(handler, run)
        run.ended(final)
        runs.finished(run)
        status = (final or {}).get("status", "rejected")
        log.info("background response %s ended %s after %.1f s%s", run.id, status, time.monotonic() - run.started,
                 f" (stopped: {run.stop_reason})" if run.stop_reason else "")


async def settle(handler: BackgroundHandler, run: Run) -> dict[str, Any] | None:
    """What the run came to. The handler stored it when the stream ended (completed, incomplete,
    failed, stopped); when it ended before its stream (a stop or an error while queued) it is built
    and stored here, and a stream following it is told (``error`` + ``response.failed``)."""
    last = handler.pinned.last
    if last is not None and last.get("status") in TERMINAL:
        if last["status"] in UNTOLD and run.stop_reason is not None:
            _tell(run, last)  # stopped mid-stream: the stream ended without its events
        return last
    if handler.rreq is None or handler.tier is None or last is None:
        return None  # never accepted (nothing stored, the client got the error)
    response = handler.ended(run.stop_reason, [], None, run.error)
    try:
        await handler.store_state(response)
    except Exception:  # noqa: BLE001 -- the nodes failed too: the record expires at its deadline
        log.warning("background response %s: could not store its end (%s)", run.id, response["status"])
    if response["status"] in UNTOLD:
        _tell(run, response)
    return response


def _tell(run: Run, response: dict[str, Any]) -> None:
    """The end of a stopped run to a stream following it: a failure's ``error`` then ``response.failed``; a
    cancelled run's ``response.failed`` with status ``cancelled`` (the Responses stream has no event of its own
    for it; the SDK's `responses.stream`, the Agents SDK and every client that waits for completed, failed or
    incomplete end there. Untold, the stream just stopped after its last delta)."""
    if response["status"] == "failed":
        err = response.get("error") or {}
        run.tell("error", code=err.get("code"), message=err.get("message"), param=None)
    run.tell("response.failed", response=response)


async def serve_background(gw: Gateway, rt: Runtime, store: ConversationStore, runs: BackgroundRuns,
                           front: ResponsesHandler, raw: bytes, scope: Scope, receive: Receive, send: Send) -> None:
    """The client's side of a create with ``background: true`` (its key already authenticated by
    `front`): start the run and answer once it is accepted, with the ``queued`` response or its
    events; an error before that is answered as the request's own (400, 404, 429, 503...)."""
    request, rreq = front.request, front.rreq
    assert front.principal is not None and rreq is not None
    parent = trace.set_span_in_context(front.x.span)  # the create's own request span (the client's trace)
    with tracer.start_as_current_span("responses.background.create", context=parent) as span:
        try:
            run = runs.admit(new_id("resp"), front.owner, front.principal.tenant, raw)
        except SwitchboardError as exc:
            gw.responses_metrics.count(Op.CREATE, exc.status)
            span.set_attribute("error.type", exc.code or "error")
            request.state.request_id, request.state.trace_id = front.request_id, front.x.trace_id
            log.info("request %s: background response refused (%s)", front.request_id, exc.code)
            await render(exc, request)(scope, receive, send)
            return
        span.set_attribute("switchboard.response_id", run.id)
        detached = {**scope, "state": {}}
        handler = BackgroundHandler(gw, rt, Request(detached, run.receive), store, run,
                                    deadline=time.time() + runs.max_s + min(DEADLINE_GRACE_S, runs.max_s))
        run.task = asyncio.get_running_loop().create_task(drive(runs, run, handler, detached),
                                                          name=f"background-{run.id}")
        await run.accepted()
        if run.early is not None:
            status, raw_headers, body = run.early
            gw.responses_metrics.count(Op.CREATE, status)
            await send({"type": "http.response.start", "status": status, "headers": raw_headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        if run.response is None:  # ended before it was accepted without an answer (a bug): still an answer
            gw.responses_metrics.count(Op.CREATE, 500)
            request.state.request_id, request.state.trace_id = handler.request_id, handler.x.trace_id
            await render(SwitchboardError("internal server error"), request)(scope, receive, send)
            return
        gw.responses_metrics.count(Op.CREATE, 200)
        log.info("request %s: background response %s queued", handler.request_id, run.id)
        headers = {"X-Request-Id": handler.request_id}
        if rreq.stream:
            await follow(run, -1, scope, receive, send, headers)
            return
        await JSONResponse(run.response, headers=headers)(scope, receive, send)


async def follow(run: Run, after: int, scope: Scope, receive: Receive, send: Send, headers: dict[str, str],
                 body_unread: bool = False) -> None:
    """`run`'s events after `after` as SSE, until it ends or the client leaves (the run goes on);
    `body_unread`: the request's body is read first (a retrieve's GET), so the watch's message is the
    disconnect. Unread, the (empty) body was the message it got, and a stream whose client left was
    noticed only when its run ended."""
    while body_unread:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body_unread = bool(message.get("more_body"))
    watch = DisconnectWatch(receive)
    watch.start()
    try:
        extra = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + extra})
        async for event in run.events(after):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        watch.stop()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not watch.swallow():
            raise
    finally:
        watch.stop()


def mount_background(app: FastAPI, gw: Gateway, store: Any, runs: Any) -> None:
    """GET /v1/responses/{id} and POST /v1/responses/{id}/cancel on `app`; `store()` and `runs()`
    once the lifespan opened them."""

    async def current(response_id: str, owner: str, replicas: int) -> tuple[Run | None, Record]:
        """This gateway's run of it (if any) and its record (404: unknown or another key's); an
        unfinished record past its deadline is stored failed here (its gateway is gone)."""
        record = await store().load(response_id, owner, replicas, Kind.RESPONSE)
        run = runs().get(response_id, owner)
        if run is None and expired(record.response, record.deadline):
            record.response = {**(record.response or {}), "status": "failed",
                               "error": {"code": "server_error", "message": EXPIRED_MESSAGE}}
            record.deadline = 0.0
            try:
                await store().save(record, owner, replicas)
            except SwitchboardError as exc:
                log.info("expired background response: could not store it failed (%s)", exc.code)
            gw.responses_metrics.count(Op.BACKGROUND, 500)
        return run, record

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request, stream: bool = False,
                       starting_after: int | None = None) -> Response:
        with observed(gw.responses_metrics, Op.RETRIEVE, request) as span:
            owner, replicas = record_caller(gw, request)
            # the SDK sends include[]=...; OpenAI's 400 names a value it does not define (it was ignored)
            check_include(request.query_params.getlist("include") + request.query_params.getlist("include[]"))
            run, record = await current(response_id, owner, replicas)
            if not stream:
                live = run.response if run is not None and not run.done else None
                return JSONResponse(dict(live or record.response or {}))
            if not (record.response or {}).get("background"):
                raise InvalidRequest("only background responses can be streamed again", param="stream")
            if run is None:
                raise InvalidRequest("this response's events are no longer held here (it ended more than "
                                     "--background-keep-s ago, or another gateway ran it); retrieve it without "
                                     "stream", param="stream")
            after = -1 if starting_after is None else starting_after
            run.check_after(after)
            if run.followers >= MAX_FOLLOWERS:
                runs().metrics.resumes.labels("busy").inc()
                raise RateLimited(f"{MAX_FOLLOWERS} streams already follow this response; close one, or retry "
                                  "later", param="stream", retry_after=1)
            span.set_attribute("switchboard.background.starting_after", after)
            runs().metrics.resumes.labels("ok").inc()
        run.followers += 1  # given back when the stream ends, however it ends
        return StreamResponse(run, after, {"X-Request-Id": request.state.request_id})

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request) -> dict[str, Any]:
        with observed(gw.responses_metrics, Op.CANCEL, request):
            owner, replicas = record_caller(gw, request)
            run, record = await current(response_id, owner, replicas)
            if run is not None and not run.done:
                if run.stop(CANCELLED):
                    log.info("background response %s: cancel requested", response_id)
                assert run.task is not None
                await asyncio.wait([run.task], timeout=CANCEL_WAIT_S)
                return dict(run.response or {})
            response = dict(record.response or {})
            if not response.get("background"):
                raise InvalidRequest(NOT_BACKGROUND, param="response_id")
            if response.get("status") == "cancelled":
                return response  # idempotent, as OpenAI's
            if response.get("status") in TERMINAL:
                done = response["status"]  # OpenAI's "Cannot cancel a completed response.", with its article
                raise InvalidRequest(f"Cannot cancel {'an' if done[0] in 'aeiou' else 'a'} {done} response.",
                                     param="response_id")
            # another gateway runs it: the record says cancelled, and that gateway, which reads it every
            # CANCEL_POLL_S, stops the run and stores the output it had
            record.response, record.deadline = {**response, "status": "cancelled"}, 0.0
            # two versions on: a progress write the running gateway makes meanwhile, one version on from
            # what was read here, cannot tie with this one (a tie is written over) and so cannot undo it
            record.version += 1
            await store().save(record, owner, replicas)
            log.info("background response %s: cancelled for the gateway running it", response_id)
            return record.response


class StreamResponse(Response):
    """A run's events as the response of `GET /v1/responses/{id}?stream=true` (FastAPI calls it as an
    ASGI app once the route returned)."""

    def __init__(self, run: Run, after: int, headers: dict[str, str]) -> None:
        super().__init__()
        self._run, self._after, self._extra = run, after, headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await follow(self._run, self._after, scope, receive, send, self._extra, body_unread=True)
        finally:
            self._run.followers -= 1
