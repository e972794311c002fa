"""What a shard's SSE stream says, parsed: the events :class:`~data_plane.routing.upstream.Upstream`
hands the gateway.

    events = parse_line(b'data: {"choices": [{"delta": {"content": "Hi"}}]}')  # [Delta("Hi")]
    isinstance(events, SwitchboardError)      # the shard's error event, as one of ours
    raise unresumed(events)                   # once no shard could continue the stream

Comments and ``[DONE]`` parse to no event, a role chunk to its `Fingerprint` only (none when it has none).
A chunk may hold several: vLLM (and other OpenAI-compatible servers) send a choice's last token in the chunk
that carries its finish_reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from data_plane.common.errors import (
    InvalidRequest,
    Overloaded,
    PipelineStageLost,
    SwitchboardError,
    UpstreamError,
    from_openai_body,
)


@dataclass(frozen=True)
class Delta:
    text: str
    usage: tuple[int, int] | None = None
    """(prompt_tokens, completion_tokens so far), when the shard reports continuous usage."""
    index: int = 0
    """The choice (``n``)."""
    logprobs: tuple[Any, ...] = ()
    """OpenAI logprobs ``content`` entries of this chunk, as the shard sent them."""
    cached_tokens: int | None = None
    """Prompt tokens the shard served from its prefix cache, when its continuous usage says (known once it
    prefilled): a stream that ends without its final usage (the client left) still records its cache hit."""
    prompt_logprobs: tuple[Any, ...] | None = None
    """The prompt tokens' entries (the first None), on a choice's first chunk when the request asked them
    (`prompt_logprobs`: the legacy Completions API's echo + logprobs)."""


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed tool-call fragment (OpenAI's shape): `id` and `name` on a call's first, `arguments`
    fragments after."""

    call: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    index: int = 0


@dataclass(frozen=True)
class Finish:
    reason: str
    index: int = 0


@dataclass(frozen=True)
class UsageEvent:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens the shard served from its prefix cache (usage.prompt_tokens_details)."""


@dataclass(frozen=True)
class Fingerprint:
    """The shard's `system_fingerprint` (what decides its numerics: data_plane/shard/engines/fingerprint.py),
    read from a choice's opening chunk, so once per shard stream and choice: a resumed stream's next shard
    says its own, and the chunks after it carry that one."""

    value: str
    index: int = 0


Event = Delta | ToolCallDelta | Finish | UsageEvent | Fingerprint


def parse_line(line: bytes) -> list[Event] | SwitchboardError:
    """One SSE line from a shard -> its events (none for a role chunk, a comment, [DONE]) or an error.

    A choice's text (and logprobs), tool-call fragments and finish come out in that order, whichever of
    them the chunk holds: a finish_reason beside content was read as the finish alone, so a vLLM shard's
    last token (which vLLM sends with the finish) never reached the client."""
    if not line.startswith(b"data:"):
        return []
    data = line[5:].strip()
    if data == b"[DONE]":
        return []
    try:
        body = json.loads(data)
    except ValueError:
        return UpstreamError("a shard sent a malformed stream event")
    if not isinstance(body, dict):
        return UpstreamError("a shard sent a malformed stream event")
    if "error" in body:  # the shard's word on the client's request (a grammar it cannot follow) stays a 400:
        # rebuilt as 502 it was resumed on another shard, to fail the same way, and the client read server_error
        client = isinstance(body["error"], dict) and body["error"].get("type") == InvalidRequest.type
        return from_openai_body(400 if client else 502, body)
    choices = body.get("choices") or []
    usage = body.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else None
    if not choices:
        if usage:
            return [UsageEvent(int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)), cached or 0)]
        return []
    events: list[Event] = []
    for choice in choices:
        index = int(choice.get("index") or 0)
        delta = choice.get("delta") or {}
        if "role" in delta and isinstance(fp := body.get("system_fingerprint"), str) and fp:
            events.append(Fingerprint(fp, index))
        content = delta.get("content")
        logprobs = tuple((choice.get("logprobs") or {}).get("content") or ())
        prompt = (choice.get("logprobs") or {}).get("prompt")
        if content or logprobs or prompt is not None:
            so_far = None
            if usage:
                so_far = (int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))
            events.append(Delta(content or "", so_far, index, logprobs, cached if so_far else None,
                                None if prompt is None else tuple(prompt)))
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            events.append(ToolCallDelta(int(call.get("index") or 0), call.get("id"), fn.get("name"),
                                        fn.get("arguments") or "", index))
        if choice.get("finish_reason"):
            events.append(Finish(choice["finish_reason"], index))
    return events


__all__ = ["Delta", "Event", "Fingerprint", "Finish", "ToolCallDelta", "UsageEvent", "client_error", "parse_line", "unresumed"]


def client_error(exc: SwitchboardError) -> SwitchboardError:
    """A shard's error event as the client reads it when it ends the request: ``pipeline_stage_lost`` (the
    shard's word to the gateway, which counts it under its own reason) as ``overloaded``, the code the
    same event had before it had its own; any other error as it is."""
    if exc.code == PipelineStageLost.code:
        return type(exc)(exc.message, param=exc.param, code=Overloaded.code)
    return exc


def unresumed(exc: SwitchboardError) -> SwitchboardError:
    """What the client reads when its stream broke mid-way and no shard could continue it.

    A shard ends its open streams with a 503 ``overloaded`` event when its engine or a pipeline stage fails:
    words for the gateway, which resumes them elsewhere. With nowhere to resume (a lone shard, every other
    one out) that event reached the client as it was, ``overloaded`` for a shard that had died; it now reads
    as a broken connection does, the gateway's ``upstream_error`` (so does ``pipeline_stage_lost``, the same
    event from a shard that lost a stage)."""
    if isinstance(exc, UpstreamError) and exc.code in (Overloaded.code, PipelineStageLost.code):
        return UpstreamError(f"the shard serving this stream failed mid-way and no other shard could continue it "
                             f"({exc.message}); retry the request")
    return exc
