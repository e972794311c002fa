"""OpenAI's rule that a tool call is answered before the conversation goes on, checked by the gateway:

    check_answered(req.messages)                     # the request's own calls (param messages.<i>.role)
    check_session_answered(stored, req.messages)     # the calls of a session's last turn (X-Session-Id)

An assistant message with `tool_calls` must be followed by `tool` messages answering each call's id before
any other message; OpenAI refuses anything else with a 400 ("An assistant message with 'tool_calls' must be
followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have
response messages: call_..."). Served anyway, an app tested here broke on OpenAI, and the model saw a call
with no result and answered as if it had one.

With a server-side session the app sends only the new messages, so the calls of the session's last turn are
in its transcript (as the tool envelope, without their ids: the ids were minted for the reply) and their
results are the request's first messages: counted against the envelope's calls. The other way round too:
tool messages that answer more calls than the last turn made (any, after a plain reply: a result sent twice,
say a retry of a turn that had gone through) or, later in the request, none of its own assistant messages'
calls, are OpenAI's 400 for a tool message that answers nothing (they were served: the model read a result
of no call, and the session kept it). The gateway checks the merged history here; a shard never does (it gets
plain messages, and a resume continues an unanswered call).
"""

from __future__ import annotations

from collections.abc import Sequence

from data_plane.common.errors import InvalidRequest
from data_plane.legacy_functions import LEGACY_CALL_ID
from data_plane.protocol import ChatMessage
from data_plane.tool_calls import envelope_calls

_RULE = ("An assistant message with 'tool_calls' must be followed by tool messages responding to each "
         "'tool_call_id'.")
_ORPHAN = "messages with role 'tool' must answer a preceding assistant message's tool_calls (tool_call_id)"


def check_answered(messages: Sequence[ChatMessage]) -> None:
    """400 when an assistant message's tool calls are not all answered by the tool messages right after it."""
    for i, m in enumerate(messages):
        if m.role != "assistant" or not m.tool_calls:
            continue
        # (shape checked by ChatCompletionRequest.check_supported; a deprecated function_call need not be answered)
        missing = [c["id"] for c in m.tool_calls if not c["id"].startswith(LEGACY_CALL_ID)]
        for after in messages[i + 1:]:
            if after.role != "tool":
                break
            if after.tool_call_id in missing:
                missing.remove(after.tool_call_id)
        if missing:
            raise InvalidRequest(f"{_RULE} The following tool_call_ids did not have response messages: "
                                 f"{', '.join(missing)}", param=f"messages.{i}.role")


def check_session_answered(stored: Sequence[dict[str, str]], messages: Sequence[ChatMessage]) -> None:
    """400 when a session's last turn called tools and the request does not open with a tool message for
    each call (system and developer messages aside: they replace the stored ones, ahead of the history)."""
    turns = [m for m in stored if m.get("role") != "system"]
    names = envelope_calls(turns[-1].get("content")) if turns and turns[-1].get("role") == "assistant" else []
    new = [m for m in messages if m.role not in ("system", "developer")]
    answered = 0
    while answered < len(new) and new[answered].role == "tool":
        answered += 1
    if answered < len(names):
        raise InvalidRequest(
            f"{_RULE} The session's last assistant message called {len(names)} tool(s) "
            f"({', '.join(names)}) and {answered} tool message(s) answer them: send one tool message per call, "
            f"first, with the tool_call_id the reply gave it.", param="messages")
    check_session_results(len(names), new, answered)


def check_session_results(calls: int, new: Sequence[ChatMessage], leading: int) -> None:
    """400 when tool messages answer no call: the first `leading` of the request's `new` messages (system and
    developer messages aside) answer the session's last turn, which made `calls` calls (their ids are not in
    the transcript, so different ids are counted: one result sent twice still passes); a later one answers
    a call of an assistant message before it in the request (parse_chat_request leaves both to this check
    when a session continues). A deprecated function result (turned into a tool message whose id is
    `call_<its name>`, data_plane/legacy_functions.py) is let through, as without a session."""
    def legacy(m: ChatMessage) -> bool:
        return bool(m.name) and m.tool_call_id == f"call_{m.name}"

    ids = {m.tool_call_id for m in new[:leading] if not legacy(m)}
    if len(ids) > calls:
        raise InvalidRequest(f"{_ORPHAN}. The session's last assistant message called {calls} tool(s), and "
                             f"this request's first tool messages answer {len(ids)} different tool_call_id(s).",
                             param="messages")
    called: set[str] = set()
    for m in new[leading:]:
        if m.role == "assistant" and m.tool_calls:
            called.update(c["id"] for c in m.tool_calls)
        elif m.role == "tool" and m.tool_call_id not in called and not legacy(m):
            raise InvalidRequest(_ORPHAN, param="messages")
