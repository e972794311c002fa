"""`POST /v1/completions`: OpenAI's legacy Completions API, served over the chat path.

    client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=32)

A `CompletionsHandler` is a ChatHandler (data_plane/gateway/chat.py): the same key, tier, rate limit (RPM/TPM),
input safety, context check, admission, KV-aware routing, resumable shard stream, output safety, usage ledger,
metrics and spans. What differs: the body (data_plane/completions_request.py: the prompt goes to the shard as
a raw prompt, no chat template), no sessions, and the reply's shape (data_plane/gateway/completions_wire.py).
With several prompts each goes to a shard as its own request (its `n` choices), admitted together and merged
into one stream whose choices are indexed prompt_index * n + i (`Prompts`). With echo and logprobs each
choice's prompt logprobs, sent by its shard on its first chunk, are kept for the reply's shape (`Echoed`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import replace
from typing import Any

from opentelemetry import trace
from starlette.types import Send

from data_plane.common.errors import ContextLengthExceeded, InvalidRequest
from data_plane.common.outcome import Outcome
from data_plane.completions_request import LegacyRequest, parse_completion_request
from data_plane.gateway.chat import ChatHandler
from data_plane.gateway.completions_wire import LegacyShape
from data_plane.gateway.context import Window
from data_plane.gateway.metrics import request_code
from data_plane.gateway.phases import Caller, Checked, Opened, Prepared
from data_plane.gateway.safety.pipeline import SafetyPolicy, raise_if_blocked
from data_plane.gateway.stream import EventSource
from data_plane.membership.view import Member
from data_plane.protocol import ChatCompletionRequest
from data_plane.routing.events import Delta, Event, Fingerprint, Finish, ToolCallDelta, UsageEvent
from data_plane.routing.resume import ResumableStream
from data_plane.tiers import Tier

tracer = trace.get_tracer(__name__)

COMPLETIONS_PATH = "/v1/completions"


class CompletionsHandler(ChatHandler):
    """One legacy completions request (see the module docstring)."""

    OPERATION = "text_completion"

    legacy: LegacyRequest | None = None
    _prompt_ids: list[int] | None = None
    """The token ids of the prompt being fitted (`fit`), when it came as ids."""
    _parts: list[Prepared]
    """Each prompt's window and shard request (`_prepare`), in prompt order."""
    _prompt_logprobs: dict[int, tuple[Any, ...]]
    """Each choice's prompt logprobs as its shard sent them (echo with logprobs), by choice index (`Echoed`)."""

    def _record(self, outcome: Outcome) -> None:
        super()._record(outcome)  # the ledger's row and switchboard_gateway_requests_total, as every chat request's
        self.gw.metrics.endpoint_requests.labels("completions", str(outcome.status), request_code(outcome.code)).inc()

    def field(self, name: str, req: ChatCompletionRequest) -> str:
        return "prompt" if name == "messages" else name

    async def parse(self, raw: bytes) -> ChatCompletionRequest:
        self.legacy = parse_completion_request(raw, self.request.headers.get("content-type"))
        self._prompt_logprobs = {}
        if self.legacy.echo and self.gw.counter.decode is None and any(p.ids for p in self.legacy.prompts):
            raise InvalidRequest("echo with a token-id prompt needs the model's tokenizer at the gateway: send the "
                                 "prompt as text", param="echo")
        return self.legacy.chat

    async def context(self, req: ChatCompletionRequest, messages: list[dict[str, str]],
                      tier: Tier) -> list[dict[str, str]]:
        return messages  # no sessions: the prompt is the whole context

    def fit(self, prompt: list[dict[str, str]], budget: int, step: int) -> Window:
        """The prompt whole (one prompt is never cut), or a 400 context_length_exceeded naming it. Counted as the
        shard encodes it, no template: the budget's slack for one is the prompt's, less a token for the BOS a
        tokenizer may put before a text prompt (token ids go as they are)."""
        ids = len(self._prompt_ids or ())
        text = sum(self.gw.counter.count(m["content"]) for m in prompt if m["content"])
        room = budget + self.gw.counter.slack - (1 if text else 0)
        if ids + text > room:
            raise ContextLengthExceeded(f"the prompt has {ids + text} tokens, but only {room} fit in this model's "
                                        "context beside max_tokens; shorten the prompt or lower max_tokens",
                                        param="prompt")
        return Window(prompt, ids + text, 0)

    async def _budget(self, caller: Caller, checked: Checked) -> tuple[Checked, SafetyPolicy]:
        """The chat path's, with a token-id prompt's ids in the rate limit's estimate (the messages hold no text
        for them): counted as tokens outside the window are, then left out again (`fit` counts them)."""
        ids = sum(len(p.ids or ()) for p in self.legacy.prompts) if self.legacy else 0
        if not ids:
            return await super()._budget(caller, checked)
        budgeted, policy = await super()._budget(caller, replace(checked, tools_tokens=checked.tools_tokens + ids))
        decode = self.gw.counter.decode
        if self.legacy and decode is not None:  # the input filters read what the ids spell, as they read a text
            with tracer.start_as_current_span("safety.input"):
                verdict = policy.check_input(decode(p.ids) for p in self.legacy.prompts if p.ids)
                self.gw.safety_metrics.record("input", verdict)
                raise_if_blocked(verdict, param="prompt")
        return replace(budgeted, tools_tokens=checked.tools_tokens), policy

    async def _prepare(self, caller: Caller, checked: Checked) -> Prepared:
        legacy = self.legacy
        assert legacy is not None
        parts = []
        for k, p in enumerate(legacy.prompts):
            self._prompt_ids = p.ids
            one = replace(checked, req=legacy.for_prompt(k), messages=[checked.messages[k]])
            prepared = await super()._prepare(caller, one)
            if len(legacy.prompts) > 1:  # its own engine requests (a choice's are `<id>-<i>`)
                prepared = replace(prepared, request=prepared.request.model_copy(
                    update={"request_id": f"{self.request_id}p{k}"}))
            parts.append(prepared)
        self._parts = parts
        return parts[0]

    async def _route(self, caller: Caller, checked: Checked, prepared: Prepared) -> EventSource:
        if len(self._parts) == 1:
            return Echoed(await super()._route(caller, checked, prepared), self._prompt_logprobs)
        rt, x, tier = self.rt, self.x, caller.tier
        tenant = caller.principal.tenant
        tokens = sum(p.window.prompt_tokens + p.max_tokens * (self.legacy.n if self.legacy else 1) for p in self._parts)
        x.admitted(await rt.admission.acquire(tier, caller.tiers, tenant=tenant, tokens=tokens, slots=checked.choices))
        with tracer.start_as_current_span("router.route") as route_span:
            streams = await _open_all([rt.upstream.open_resumable(p.request, None) for p in self._parts])
            for p, shard in zip(self._parts, streams, strict=True):
                rt.router.observe_kv(None, shard.member.id, p.window.prompt_tokens)  # kv_aware routing
            route_span.set_attribute("switchboard.shard", streams[0].member.id)
            route_span.set_attribute("switchboard.prompts", len(streams))
        x.first_token_at = time.monotonic()
        return Echoed(Prompts(streams, self.legacy.n if self.legacy else 1), self._prompt_logprobs)

    def _shape(self) -> LegacyShape:
        legacy = self.legacy
        assert legacy is not None
        decode = self.gw.counter.decode
        echo = [decode(p.ids) if p.ids and decode is not None else p.text for p in legacy.prompts] if legacy.echo else []
        return LegacyShape(echo, legacy.n, legacy.logprobs, self._prompt_logprobs, legacy.echo_only)

    async def respond_body(self, opened: Opened) -> dict[str, Any]:
        return self._shape().body(await super().respond_body(opened))

    async def respond_stream(self, opened: Opened, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        await super().respond_stream(opened, self._shape().send(send), headers)


async def _open_all(opening: list[Coroutine[Any, Any, ResumableStream]]) -> list[ResumableStream]:
    """Every prompt's shard stream, opened at once (each waits for its first token); when one fails, or the
    request is cancelled meanwhile, the ones that opened are closed (their shards abort) and it is raised."""
    tasks = [asyncio.ensure_future(c) for c in opening]
    try:
        await asyncio.wait(tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)
        _close_opened(tasks)
        raise
    failed = next((t.exception() for t in tasks if t.exception() is not None), None)
    if failed is not None:
        _close_opened(tasks)
        raise failed
    return [t.result() for t in tasks]


def _close_opened(tasks: Sequence[asyncio.Future[ResumableStream]]) -> None:
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is None:
            t.result().close()


class Prompts:
    """Several prompts' shard streams as one (an EventSource): prompt k's choice i is choice k * n + i, the
    usage is their sum once every stream gave its own."""

    def __init__(self, streams: Sequence[EventSource], n: int) -> None:
        self.streams = streams
        self.n = n
        self.member: Member = streams[0].member
        self._pumps: list[asyncio.Task[None]] = []

    async def _pump(self, k: int, queue: asyncio.Queue[tuple[int, list[Event] | Exception | None]]) -> None:
        try:
            async for events in self.streams[k].batches():
                await queue.put((k, events))
            await queue.put((k, None))
        except Exception as exc:  # noqa: BLE001 -- handed to the reader, which raises it
            await queue.put((k, exc))

    async def batches(self) -> AsyncIterator[list[Event]]:
        queue: asyncio.Queue[tuple[int, list[Event] | Exception | None]] = asyncio.Queue()
        tasks = self._pumps = [asyncio.create_task(self._pump(k, queue)) for k in range(len(self.streams))]
        usage = [UsageEvent(0, 0)] * len(self.streams)
        prompts = [0] * len(self.streams)
        running = len(tasks)
        try:
            while running:
                k, item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                out: list[Event] = []
                for event in item:
                    if isinstance(event, UsageEvent):
                        usage[k] = event
                    elif isinstance(event, Delta) and event.usage is not None:
                        # a running count is the request's: every prompt's tokens so far, so a client that
                        # leaves before the final usage is billed for all the prompts, not the largest one
                        prompts[k] = event.usage[0]
                        out.append(replace(event, index=event.index + k * self.n,
                                           usage=(sum(prompts), event.usage[1])))
                    elif isinstance(event, (Delta, ToolCallDelta, Finish, Fingerprint)):  # the fingerprint: the
                        out.append(replace(event, index=event.index + k * self.n))  # body's system_fingerprint
                if out:
                    yield out
            yield [UsageEvent(sum(u.prompt_tokens for u in usage), sum(u.completion_tokens for u in usage),
                              sum(u.cached_tokens for u in usage))]
        finally:
            for t in tasks:
                t.cancel()

    def close(self) -> None:
        """Synchronous, as a shard stream's: every stream closed (its shard aborts), the readers stopped."""
        for s in self.streams:
            s.close()
        for t in self._pumps:
            t.cancel()


class Echoed:
    """An EventSource that keeps each choice's prompt logprobs (the first a shard sent it: a resumed stream's
    shard computes them again, over the output so far too) for the reply's shape, and passes every event on."""

    def __init__(self, source: EventSource, prompt_logprobs: dict[int, tuple[Any, ...]]) -> None:
        self.source = source
        self.prompt_logprobs = prompt_logprobs

    @property
    def member(self) -> Member:  # the stream's shard now (a resume moves it)
        return self.source.member

    @member.setter
    def member(self, member: Member) -> None:
        self.source.member = member

    async def batches(self) -> AsyncIterator[list[Event]]:
        async for events in self.source.batches():
            for e in events:
                if isinstance(e, Delta) and e.prompt_logprobs is not None:
                    self.prompt_logprobs.setdefault(e.index, e.prompt_logprobs)
            yield events

    def close(self) -> None:
        self.source.close()
