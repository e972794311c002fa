"""The rules a Responses request's function tools and function-call items follow: a tool's fields are
OpenAI's, each `function_call_output` answers a `function_call` before it, each call is answered
(OpenAI's 400s, in its words), and a call the output limit cut is "incomplete".

    chat_function(tool, 0)                # {"name": ..., "parameters": ...}; 400 for a field it has not
    check_call_outputs(history + new)     # 400 "No tool output found for function call call_1."
    call_status('{"city":"Pa', "incomplete")  # "incomplete": no app should run it
"""

from __future__ import annotations

import json
from typing import Any

from data_plane.common.errors import InvalidRequest, UnsupportedParameter, clipped

FUNCTION_FIELDS = ("name", "description", "parameters", "strict")
"""A Responses function tool's fields the chat path takes (beside `type`)."""
NEUTRAL_FIELDS: dict[str, tuple[Any, ...]] = {"defer_loading": (None, False), "allowed_callers": (None, ["direct"])}
"""OpenAI's tool-search and programmatic-calling fields: accepted at the value that changes nothing here."""

CHOICE_FIELDS = {"function": ("type", "name"), "allowed_tools": ("type", "mode", "tools")}
"""The fields of OpenAI's function and allowed_tools choices (an allowed tool's: a function choice's)."""


def chat_function(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """Function tool `i` as the chat path's `function`: a field OpenAI's function tool has not is a 400 naming it
    (as the chat path's own tools are), not a setting dropped while the Response echoes it; `output_schema`
    (what the function returns) is a no-op, the tool-search and programmatic fields are served at their neutral
    values only."""
    for key, value in tool.items():
        if key in NEUTRAL_FIELDS and value not in NEUTRAL_FIELDS[key]:
            raise UnsupportedParameter(f"Unsupported parameter: 'tools[{i}].{key}' is not supported with this "
                                       "model.", param=f"tools[{i}].{key}")
        if key not in (*FUNCTION_FIELDS, *NEUTRAL_FIELDS, "type", "output_schema"):
            raise UnsupportedParameter(f"Unrecognized request argument supplied: tools[{i}].{key}",
                                       param=f"tools[{i}].{key}")
    return {k: v for k, v in tool.items() if k in FUNCTION_FIELDS}


def check_choice_fields(choice: Any) -> None:
    """A 400 naming a field a function or allowed_tools `tool_choice` (or one of its tools) has not: it was
    dropped while the Response echoed it (the chat path's choice answers 400 for one)."""
    if not isinstance(choice, dict) or choice.get("type") not in CHOICE_FIELDS:
        return
    entries = [("tool_choice", choice, CHOICE_FIELDS[choice["type"]])]
    tools = choice.get("tools") if choice["type"] == "allowed_tools" else None
    entries += [(f"tool_choice.tools[{i}]", t, CHOICE_FIELDS["function"]) for i, t in enumerate(tools or [])
                if isinstance(tools, list) and isinstance(t, dict) and t.get("type") == "function"]  # (others: 400)
    for where, entry, fields in entries:
        for key in entry:
            if key not in fields:
                raise UnsupportedParameter(f"Unrecognized request argument supplied: {where}.{key}",
                                           param=f"{where}.{key}")


def check_call_outputs(items: list[dict[str, Any]]) -> None:
    """OpenAI's 400s, in its words, for a function_call_output that answers no function_call before it
    (the chat path's check would name tool messages and tool_call_id, which a Responses client never sent),
    and for a function_call that no function_call_output answers: the model saw a call without its result
    (a chain or conversation continued with a new message only) and answered as if it had one."""
    called: set[str] = set()
    unanswered: dict[str, None] = {}  # in order: the first is the one the error names
    for item in items:
        if item["type"] == "function_call":
            called.add(item["call_id"])
            unanswered[item["call_id"]] = None
        elif item["type"] == "function_call_output":
            if item["call_id"] not in called:
                raise InvalidRequest(f"No tool call found for function call output with call_id {clipped(item['call_id'])}.",
                                     param="input")
            unanswered.pop(item["call_id"], None)
    if unanswered:
        raise InvalidRequest(f"No tool output found for function call {next(iter(unanswered))}.", param="input")


def call_status(arguments: str, status: str) -> str:
    """A function_call item's status: "incomplete" when the reply was cut (`status`) inside this
    call's arguments (they are no whole JSON value), so an app does not run a call with half its
    arguments; calls the model finished before the cut are "completed"."""
    if status == "completed":
        return status
    try:
        json.loads(arguments)
    except ValueError:
        return "incomplete"
    return "completed"
