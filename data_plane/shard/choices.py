"""A request's choices on their way out of the shard: tool-call envelopes parsed, logprobs rendered, n merged.

    choice = Choice(0, plan, token_bytes)             # one per `n` (resumed=: the envelope already sent)
    deltas = choice.feed(out)                          # chunk deltas (content / tool_calls) + logprobs
    choice.message(), choice.finish(out.finish_reason) # the whole message and its finish_reason
    async for index, out in merged([outputs0, outputs1, ...]): ...

finish_reason follows OpenAI: ``tool_calls`` when the model called tools (required, or auto and it chose
to), ``stop`` for a named tool choice, ``length`` whenever the limit cut the output (a cut structure is
never reported as complete). Logprobs are OpenAI's shape: ``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [...]}]}``, with ``bytes`` the token's own UTF-8 bytes (a token may hold part of a
character), for the content's tokens only: under tools, none for the envelope or a call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import fields, replace
from typing import Any

from data_plane.common.errors import InvalidRequest, UnsupportedParameter
from data_plane.shard.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    StopStrings,
    TokenLogprob,
)
from data_plane.shard.engines.grammar import GrammarError, GrammarKind, GrammarSpec
from data_plane.structured import OutputPlan, ToolMode
from data_plane.tool_calls import Content, EnvelopeParser, assemble, delta_of

log = logging.getLogger(__name__)

FINISH_TOOL_CALLS = "tool_calls"


class Choice:
    def __init__(self, index: int, plan: OutputPlan, token_bytes: Callable[[int], bytes] | None,
                 resumed: str = "", stop: Sequence[str] = (), first_token: int | None = None) -> None:
        """`first_token`: the prompt's first token (its prompt logprobs entry has a token and a null logprob)."""
        self.index = index
        self.first_token = first_token
        self.plan = plan
        self.token_bytes = token_bytes
        self.parser = EnvelopeParser(plan.json_response) if plan.tool_mode != ToolMode.NONE else None
        # under tools the engine sees the envelope, so the stop strings are applied here, to the content
        self.stop = ContentStop(stop) if self.parser is not None and stop else None
        if self.parser is not None and resumed:
            # A resumed stream: the envelope so far was sent by another shard. Parsed, not sent again, so
            # calls keep their indexes and a call under way gets only the rest of its arguments.
            self.parser.feed(resumed)
        self.events: list[Any] = []
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.prompt_logprobs: list[dict[str, Any] | None] | None = None
        """With the request's prompt_logprobs: each prompt token's entry (the first None), sent on the first chunk."""

    def feed(self, out: GenerationOutput) -> list[dict[str, Any]]:
        """The chunk deltas for one engine output (the logprobs ride on the first, or on an empty delta)."""
        deltas: list[dict[str, Any]] = []
        if self.stopped:
            return deltas  # a stop string ended the content; the engine is aborting the rest
        visible = True  # whether this output's tokens are the client's content (not the tool envelope)
        if self.parser is not None:
            before = self.parser.state
            events = self.parser.feed(out.text) if out.text else []
            if self.stop is not None:
                events = self.stop.events(events, final=out.finish_reason is not None)
            self.events.extend(events)
            deltas.extend(delta_of(e) for e in events)
            visible = _content_tokens(before, self.parser.state, events)
        if out.text:
            self.text.append(out.text)
            if self.parser is None:
                deltas.append({"content": out.text})
        visible = visible and not self.stopped  # the token that completed a stop string is none of the content
        lps = [self._entry(e) for e in out.logprobs] if self.token_bytes is not None and visible else []
        self.logprobs.extend(lps)
        prompt = None
        if out.prompt_logprobs is not None and self.token_bytes is not None:
            prompt = self.prompt_logprobs = [self._entry(e) if e is not None else self._first()
                                             for e in out.prompt_logprobs]
        if lps or prompt is not None:
            if not deltas:
                deltas.append({})
            wire: dict[str, Any] = {"content": lps, "refusal": None}
            if prompt is not None:
                wire["prompt"] = prompt
            deltas[0] = {**deltas[0], "logprobs": wire}
        return deltas

    def _entry(self, e: TokenLogprob) -> dict[str, Any]:
        assert self.token_bytes is not None

        def one(token_id: int, logprob: float) -> dict[str, Any]:
            raw = self.token_bytes(token_id)  # type: ignore[misc]
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

        return {**one(e.token_id, e.logprob), "top_logprobs": [one(t.token_id, t.logprob) for t in e.top]}

    def _first(self) -> dict[str, Any] | None:
        """The prompt's first token's entry: nothing predicts it (logprob null, no alternatives)."""
        if self.first_token is None or self.token_bytes is None:
            return None
        raw = self.token_bytes(self.first_token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": None, "bytes": list(raw),
                "top_logprobs": []}

    @property
    def stopped(self) -> bool:
        """A stop string ended the content (under tools: otherwise the engine stops and says so)."""
        return self.stop is not None and self.stop.stopped

    @property
    def called_tools(self) -> bool:
        return self.parser is not None and bool(self.parser.calls)

    def message(self) -> dict[str, Any]:
        if self.parser is None:
            return {"role": "assistant", "content": "".join(self.text)}
        return {"role": "assistant", **assemble(self.events)}

    def finish(self, reason: str | None) -> str | None:
        if self.stopped:
            return FINISH_STOP
        if reason == FINISH_LENGTH or not self.called_tools:
            return reason
        return "stop" if self.plan.tool_mode == ToolMode.NAMED else FINISH_TOOL_CALLS

    def wire_logprobs(self) -> dict[str, Any] | None:
        if self.token_bytes is None:
            return None
        wire: dict[str, Any] = {"content": self.logprobs, "refusal": None}
        if self.prompt_logprobs is not None:
            wire["prompt"] = self.prompt_logprobs
        return wire


class ContentStop:
    """Stop strings over a message's content as it streams, for a choice under tools: the engine applies
    stop strings to what it generates, which there is the envelope (`{"tool_calls":[{"name":...` or
    `{"response":"...`), so a stop string such as `"`, `,` or `name` cut every call and every answer
    (an empty message, finish "stop", even with tool_choice required). Here they apply, as the client
    reads them, to the unescaped content only (the engine's own :class:`StopStrings`); calls are never cut."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.strings = StopStrings(stop)

    @property
    def stopped(self) -> bool:
        return self.strings.stopped

    def events(self, events: list[Any], final: bool) -> list[Any]:
        """`events` with their content cut at the first stop string (and nothing after it)."""
        out: list[Any] = []
        for e in events:
            if not isinstance(e, Content):
                out.append(e)
                continue
            if piece := self.strings.feed(e.text):
                out.append(Content(piece))
            if self.stopped:
                return out
        if final and (tail := self.strings.flush()):
            out.append(Content(tail))
        return out


_CONTENT_STATES = ("response", "json_response")


def _content_tokens(before: str, after: str, events: list[Any]) -> bool:
    """Whether an output's tokens belong to the message's content rather than to the tool envelope.

    Under tools the model writes ``{"response": "..."}`` or ``{"tool_calls": [...]}`` (tool_calls.py); the
    client sees only the content string unescaped, or the calls. Logprobs are per token of the client's
    content, as OpenAI's are: the envelope's own tokens (its head, the closing quote, a call's name and
    arguments) are none of the client's text, so their logprobs are left out (a call has none, as a
    Responses API function call item has none). A token that started inside the content and either gave
    content or is still inside it (an escape waiting for its end) counts; one that also opens or closes
    the envelope counts when it gave content (its text is the content plus a quote or a brace)."""
    if before not in _CONTENT_STATES or any(not isinstance(e, Content) for e in events):
        return False
    return bool(events) or after in _CONTENT_STATES


async def merged(streams: Sequence[AsyncIterator[GenerationOutput]]) -> AsyncIterator[tuple[int, GenerationOutput]]:
    """(choice index, output) from every stream as they come; closing this closes them all (aborting)."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            aclose = getattr(streams[0], "aclose", None)
            if aclose is not None:
                await aclose()  # the engine aborts the request at its next step
        return
    queue: asyncio.Queue[tuple[int, GenerationOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[GenerationOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s), name=f"choice-{i}") for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # each stream closes inside its task (the engine aborts that choice)
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))


SAMPLING_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(SamplingParams)}
"""What an engine without `prepare` resets the parameters it `honours` to before the check below (a
parameter left at its default asks for nothing)."""
_GRAMMAR_CODES = {"unsupported": "unsupported_schema", "too_large": "grammar_too_large",
                  "timeout": "grammar_timeout", "invalid": "invalid_grammar", "resume_rejected": "invalid_resume"}


async def prepare_requests(engine: Any, reqs: Sequence[GenerationRequest], plan: OutputPlan) -> None:
    """Compile the grammar (once: the choices share its cache entry) before any is enqueued; a refused
    grammar is a 400 naming the field (and, for a JSON schema, the unsupported keywords). An engine without
    `prepare` (no logits processing) refuses what needs it with a 400, but for the `SamplingParams` fields
    it lists in `honours` (the synthetic engine's `ignore_eos`)."""
    prepare = getattr(engine, "prepare", None)
    if prepare is None:
        honoured = {name: SAMPLING_DEFAULTS[name] for name in getattr(engine, "honours", ())}
        plain = [replace(r.params, **honoured) for r in reqs]
        if any(p.processed or p.min_p for p in plain):
            raise UnsupportedParameter("this shard's engine does not support structured outputs, tools, "
                                       "logprobs, penalties or logit_bias", param=plan.param)
        return
    try:
        for r in reqs:
            await prepare(r)
    except GrammarError as exc:
        blamed = await _function_at_fault(engine, plan) if exc.reason in _SCHEMA_REASONS else None
        refused, param = blamed or (exc, plan.param)
        raise InvalidRequest(refused.message, param=param, code=_GRAMMAR_CODES.get(refused.reason)) from None


_SCHEMA_REASONS = frozenset({"invalid", "unsupported"})
MAX_BLAMED = 16
"""Functions checked one by one to name the one a refused envelope is refused for (each a compile on the
shard's grammar pool; verdicts are kept): past that, the 400 speaks of the tools as a whole."""


async def _function_at_fault(engine: Any, plan: OutputPlan) -> tuple[GrammarError, str] | None:
    """For a tool envelope the grammar refused: the first function whose parameters it refuses alone, and
    where the request holds them, so the 400 speaks of the client's schema, not of our envelope."""
    grammars = getattr(engine, "grammars", None)
    if grammars is None:
        return None
    for f in plan.functions[:MAX_BLAMED]:
        refused = await grammars.refusal(GrammarSpec(GrammarKind.JSON_SCHEMA, f.grammar_source()))
        if refused is not None:
            return GrammarError(f"Invalid schema for function {f.name!r}: {refused.message}", refused.reason), f.param
    return None


def choice_streams(engine: Any, reqs: Sequence[GenerationRequest]) -> list[AsyncIterator[GenerationOutput]]:
    """Choice 0 is enqueued now (its errors raise here); with n > 1 the others are enqueued once choice 0
    has its first token, so its prompt blocks are in the prefix cache and theirs are copied, not recomputed."""
    first = engine.generate(reqs[0])
    if len(reqs) == 1:
        return [first]
    ready = asyncio.Event()

    async def lead() -> AsyncIterator[GenerationOutput]:
        try:
            async for out in first:
                ready.set()
                yield out
        finally:
            ready.set()

    async def follow(req: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        await ready.wait()
        async for out in engine.generate(req):
            yield out

    return [lead(), *(follow(r) for r in reqs[1:])]


def token_bytes(engine: Any) -> Callable[[int], bytes]:
    grammars = getattr(engine, "grammars", None)
    if grammars is not None:  # llguidance's tokenizer knows each token's exact bytes
        return lambda token_id: bytes(grammars.tokenizer.decode_bytes([token_id]))
    return lambda token_id: str(engine._tokenizer.decode([token_id])).encode()


def describe(span: Any, reqs: Sequence[GenerationRequest], plan: OutputPlan) -> None:
    """Span attributes of a request's output shape (bounded values), from its first choice's engine
    request; each choice's `trace` is the span (the engine's own spans for it are its children)."""
    req = reqs[0]
    for r in reqs:
        r.trace = span.get_span_context()
    span.set_attribute("switchboard.structured.kind", plan.constraint.kind if plan.constraint else "none")
    span.set_attribute("switchboard.tools.mode", plan.tool_mode.value)
    span.set_attribute("gen_ai.request.choice.count", len(reqs))
    if req.params.seed is not None:
        span.set_attribute("gen_ai.request.seed", req.params.seed)
    span.set_attribute("switchboard.logprobs", req.params.logprobs)
    if req.resumed_text and plan.constraint is not None:
        span.set_attribute("switchboard.structured.resumed_chars", len(req.resumed_text))
        log.info("request %s resumes a %s stream after %d characters already sent", req.request_id,
                 plan.constraint.kind, len(req.resumed_text))
