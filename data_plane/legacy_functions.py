"""OpenAI's deprecated function calling, served as the tool calls it became:

    req = as_tools(validated_request, continues)     # before check_supported: functions -> tools, ...
    message = legacy_message(message)                # a reply's tool call -> message.function_call
    delta = legacy_delta(delta)                      # the same, streamed
    reason = legacy_finish(reason)                   # "tool_calls" -> "function_call"
    check_supported(req, continues)                  # req.check_supported, its 400s naming functions / function_call
    with legacy_terms(req): ...                      # any SwitchboardError inside, named so too (a shard's 400)

The request side (OpenAI still takes every one of these, and the openai SDK types them):
``functions: [{name, description, parameters}]`` is ``tools`` of type function; ``function_call``
``"auto"`` / ``"none"`` / ``{"name": ...}`` is ``tool_choice``; an assistant message's ``function_call:
{name, arguments}`` is one tool call (its id minted here: the legacy form has none), and a ``role:
"function"`` message (``name``, ``content``) the tool message answering the latest such call of that name.
A function message that answers no call is the same text a tool result renders as (or, with a session
whose transcript holds the call, a tool message: data_plane/gateway/tool_results.py counts it). A legacy
call need not be answered, in a session's last turn either (a request with ``functions`` skips that check:
data_plane/gateway/chat.py); and only an assistant message may hold a ``function_call`` (OpenAI's 400).
A stored completion keeps the messages as sent (data_plane/gateway/chat_store.py), not these.

The reply side, only when the request gave ``functions`` (as OpenAI answers it): one call at most per
choice (``parallel_tool_calls`` false), as ``message.function_call`` (no ``tool_calls``), streamed as
``delta.function_call`` (its name first, then the arguments), with ``finish_reason: "function_call"``.
A request in the current form (``tools``), even with function messages in its history, gets tool calls.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict

from data_plane.common.errors import InvalidRequest, SwitchboardError
from data_plane.structured import NamedFunction, NamedToolChoice, ToolDef

Request = TypeVar("Request", bound=BaseModel)
"""data_plane/protocol.py's ChatCompletionRequest (which imports this module: not named here)."""
FunctionChoice = Literal["none", "auto"] | NamedFunction
"""A request's legacy `function_call`."""
LEGACY_CALL_ID = "call_legacy_"
"""The prefix of the ids minted for legacy calls: OpenAI never asked for their results (no 400 for one
unanswered, as for a tool call: data_plane/gateway/tool_results.py)."""
FINISH_TOOL_CALLS = "tool_calls"
FINISH_FUNCTION_CALL = "function_call"


class FunctionCall(BaseModel):
    """An assistant message's legacy call (`{"name", "arguments"}`)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


def as_tools(request: Request, continues: bool = False) -> Request:
    """`request` with its legacy function-calling fields and messages in the tool form (a copy; itself
    when it has none). `continues`: a server-side session's transcript may hold the calls function
    messages answer. A 400 for a mix the reply could not be shaped for."""
    req: Any = request
    update: dict[str, Any] = {}
    if req.functions:
        if req.tools is not None or req.tool_choice is not None:
            raise InvalidRequest("Set functions and function_call, or tools and tool_choice, not both "
                                 "(functions is the deprecated form of tools).", param="functions")
        update["tools"] = [ToolDef(type="function", function=f) for f in req.functions]
        update["parallel_tool_calls"] = False  # the legacy reply holds one call
        choice = req.function_call
        if isinstance(choice, NamedFunction):
            update["tool_choice"] = NamedToolChoice(type="function", function=choice)
        elif choice is not None:
            update["tool_choice"] = choice
        update["function_call"] = None
    elif req.function_call not in (None, "none"):
        raise InvalidRequest("Invalid value for 'function_call': 'function_call' is only allowed when 'functions' "
                             "are specified.", param="function_call")
    if any(m.role == "function" or m.function_call is not None for m in req.messages):
        update["messages"] = _messages(req.messages, continues)
    return request.model_copy(update=update) if update else request


def check_supported(request: Request, continues: bool) -> None:
    """`request.check_supported(continues=...)`, its 400 in the legacy fields' terms (`legacy_terms`)."""
    with legacy_terms(request):
        cast(Any, request).check_supported(continues=continues)


@contextmanager
def legacy_terms(request: BaseModel) -> Iterator[None]:
    """A SwitchboardError raised inside, for a request that gave `functions`, names the fields it sent
    (``functions.0.name``, ``function_call``), not the tools they became (``tools.0.function.name``): the
    gateway's checks, and a shard's 400 (a function's schema its grammar refuses)."""
    try:
        yield
    except SwitchboardError as exc:
        if getattr(request, "functions", None) and exc.param:
            _in_legacy_terms(exc)
        raise


def _in_legacy_terms(exc: SwitchboardError) -> None:
    param = str(exc.param)
    renamed = re.sub(r"^tools\.(\d+)\.function(?=\.|$)", r"functions.\1", param)
    renamed = re.sub(r"^tool_choice(\.function)?(?=\.|$)", "function_call", renamed)
    if renamed == param:
        return
    message = exc.message.replace(param, renamed)
    if param.startswith("tool_choice"):  # "tool_choice names 'x', which is not among the tools"
        message = re.sub(r"\btools\b", "functions", re.sub(r"\btool_choice\b", "function_call", message))
    exc.message, exc.param = message, renamed


def _messages(messages: list[Any], continues: bool) -> list[Any]:
    """The messages (protocol.ChatMessage) with the legacy calls and results as tool calls and tool messages."""
    out: list[Any] = []
    open_calls: list[tuple[str, str]] = []  # (id, name) of the legacy calls not answered yet
    for i, m in enumerate(messages):
        if m.function_call is not None and m.role != "assistant":  # as OpenAI's 400 says it
            raise InvalidRequest("Invalid parameter: only messages with role 'assistant' can have a function call.",
                                 param=f"messages.{i}.function_call")
        if m.role == "assistant" and m.function_call is not None:
            if m.tool_calls:
                raise InvalidRequest("an assistant message has function_call or tool_calls, not both",
                                     param=f"messages.{i}.function_call")
            call_id = f"{LEGACY_CALL_ID}{i}"
            call = {"id": call_id, "type": "function", "function": m.function_call.model_dump()}
            out.append(m.model_copy(update={"function_call": None, "tool_calls": [call]}))
            open_calls = [(call_id, m.function_call.name)]
        elif m.role == "function":
            if not m.name:
                raise InvalidRequest(f"messages.{i}.name: a function message needs the name of the function "
                                     "whose result it holds", param=f"messages.{i}.name")
            text = m.text(f"messages.{i}") if m.content is not None else ""
            answered = next((c for c in open_calls if c[1] == m.name), None)
            if answered is not None:
                open_calls.remove(answered)
                out.append(m.model_copy(update={"role": "tool", "tool_call_id": answered[0], "content": text}))
            elif continues:  # the call may be the session's last turn (its transcript keeps no ids)
                out.append(m.model_copy(update={"role": "tool", "tool_call_id": f"call_{m.name}", "content": text}))
            else:  # a result of no call in sight: what a tool result renders as (ChatCompletionRequest.plain_messages)
                out.append(m.model_copy(update={"role": "user", "name": None,
                                                "content": f"The tool {m.name} returned: {text}"}))
        else:
            if m.role != "tool":
                open_calls = []
            out.append(m)
    return out


def legacy_message(message: dict[str, Any]) -> dict[str, Any]:
    """A reply's message with its (first) tool call as the legacy `function_call`."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    fn = calls[0]["function"]
    return {**rest, "function_call": {"name": fn["name"], "arguments": fn["arguments"]}}


def legacy_delta(delta: dict[str, Any]) -> dict[str, Any]:
    """A streamed delta with its tool call piece as a `function_call` piece (the name with the first)."""
    calls = delta.get("tool_calls")
    if not calls:
        return delta
    rest = {k: v for k, v in delta.items() if k != "tool_calls"}
    fn = calls[0].get("function") or {}
    piece = {"name": fn["name"], "arguments": fn.get("arguments", "")} if "name" in fn else \
        {"arguments": fn.get("arguments", "")}
    return {**rest, "function_call": piece}


def legacy_finish(reason: str | None) -> str | None:
    return FINISH_FUNCTION_CALL if reason == FINISH_TOOL_CALLS else reason
