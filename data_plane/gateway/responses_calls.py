"""The rules a Responses request's function-call items follow: each `function_call_output` answers a
`function_call` before it, each call is answered (OpenAI's 400s, in its words), and a call the output
limit cut is "incomplete".

    check_call_outputs(history + new)     # 400 "No tool output found for function call call_1."
    call_status('{"city":"Pa', "incomplete")  # "incomplete": no app should run it
"""

from __future__ import annotations

import json
from typing import Any

from data_plane.common.errors import InvalidRequest


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
                raise InvalidRequest(f"No tool call found for function call output with call_id {item['call_id']}.",
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
