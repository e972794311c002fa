"""The Responses API's input items: what `input` (and a conversation's `items`) may hold, validated and
stored, and the chat messages they stand for.

    items = input_items(req.input)                        # input as items, each with an id; 400 naming a bad one
    refuse_duplicates(items, "input", earlier)            # OpenAI's 400 for an id given twice
    messages = items_to_messages(items, open_compaction)  # the chat messages they stand for

Message items become chat messages, `function_call` / `function_call_output` items an assistant message's
`tool_calls` / a `tool` message, a `compaction` item (this server's) the summary it holds. A `reasoning` item
(an OpenAI reasoning model's, in a history replayed here) is validated and kept, never shown to the model:
this model does not reason, and OpenAI withholds a reasoning item from a model it does not belong to
(its Response lists it in `input_transformations`, reason "model_mismatch").
Called by data_plane/gateway/responses_items.py (the request), conversations, responses_compact.
"""

from __future__ import annotations

import secrets
from typing import Any

from data_plane.common.errors import InvalidRequest, UnsupportedParameter, clipped
from data_plane.request_checks import check_one_of

ITEM_STATUSES = ("in_progress", "completed", "incomplete")
"""OpenAI's values of an input item's `status` (stored as completed: the item is whole once sent)."""
SUPPORTED_ITEM_TYPES = ("message", "function_call", "function_call_output", "compaction", "item_reference", "reasoning")
REASONING_FIELDS = {"type", "id", "summary", "content", "encrypted_content", "status"}
"""A reasoning item's fields (the openai SDK's ResponseReasoningItemParam); another is a 400 naming it."""
ITEM_FIELDS = {
    "message": {"type", "id", "role", "content", "status", "phase"},
    "function_call": {"type", "id", "call_id", "name", "arguments", "status", "namespace", "caller", "async",
                      "async_", "created_by"},
    "function_call_output": {"type", "id", "call_id", "output", "status", "namespace", "caller", "name", "created_by"},
    "compaction": {"type", "id", "encrypted_content", "created_by"},
    "item_reference": {"type", "id"},
    "reasoning": REASONING_FIELDS,
}
"""Each item type's fields, as the openai SDK types them: its input params (EasyInputMessageParam, Message,
ResponseOutputMessageParam, ResponseFunctionToolCallParam, FunctionCallOutput, ...) and the output items a
client replays as input (a Response's `output`, a conversation's listed items: `created_by`; `async_`, the
Python name `model_dump()` gives `async`). Those this server ignores (`status`, `phase`, `namespace`...) pass;
any other key is OpenAI's 400
``unknown_parameter`` naming it: it was dropped without a word (a misspelt `call_id` went unnoticed)."""
PART_FIELDS = {
    "input_text": {"type", "text", "prompt_cache_breakpoint"},
    "output_text": {"type", "text", "annotations", "logprobs"},
    "refusal": {"type", "refusal"},
}
"""A text content part's fields (ResponseInputTextParam, ResponseOutputTextParam, ResponseOutputRefusalParam)."""
TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    """An unguessable id in OpenAI's style (`resp_...`, `msg_...`, `conv_...`): valid as a session id."""
    return f"{prefix}_{secrets.token_hex(24)}"


def input_items(value: str | list[dict[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """`input` as stored items (each with an id and a status), validated; 400 naming the bad item. An
    ``item_reference`` stays as one, for `resolve_references` (data_plane/gateway/item_index.py) to replace."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}] if value else []
    if not isinstance(value, list):  # routes that read raw JSON (compact, conversations) pass anything
        raise InvalidRequest(f"{param} must be a string or an array of items", param=param)
    out = []
    for i, raw in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(raw, dict):
            raise InvalidRequest(f"{where} must be an object", param=where)
        if raw.get("id") is not None and not isinstance(raw["id"], str):  # stored, listed, used as cursors
            # (null is the SDK's "no id": its input item types declare `id: Optional[str]`)
            raise InvalidRequest(f"{where}.id must be a string", param=f"{where}.id")
        # the SDK's ItemReference may leave out its type: an item that is nothing but an id is one
        kind = raw.get("type", "item_reference" if set(raw) == {"id"} else "message")
        if kind not in SUPPORTED_ITEM_TYPES:
            raise UnsupportedParameter(f"input item type {kind!r} is not supported", param=f"{where}.type")
        refuse_unknown(raw, ITEM_FIELDS[kind], where)
        check_one_of(raw.get("status"), ITEM_STATUSES, f"{where}.status")
        if kind == "message":
            role = raw.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(f"{where}.role must be user, system, developer or assistant", param=f"{where}.role")
            parts = _text_parts(raw.get("content"), role, f"{where}.content")
            out.append({"type": "message", "id": raw.get("id") or new_id("msg"), "status": "completed",
                        "role": role, "content": parts})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(raw.get(key), str):
                    raise InvalidRequest(f"{where}.{key} must be a string", param=f"{where}.{key}")
            out.append({"type": "function_call", "id": raw.get("id") or new_id("fc"), "status": "completed",
                        "call_id": raw["call_id"], "name": raw["name"], "arguments": raw["arguments"]})
        elif kind == "reasoning":  # kept (stored, listed), never part of the prompt: items_to_messages
            out.append(_reasoning_item(raw, where))
        elif kind == "item_reference":  # a stored item, resolved by the caller (data_plane/gateway/item_index.py)
            if not isinstance(raw.get("id"), str) or not raw["id"]:
                raise InvalidRequest(f"{where}.id must be a string", param=f"{where}.id")
            out.append({"type": "item_reference", "id": raw["id"]})
        elif kind == "function_call_output":
            output = raw.get("output")
            if isinstance(output, list):  # content parts: text only (an image's would vanish from the prompt)
                output = "".join(p["text"] for p in _text_parts(output, "tool", f"{where}.output"))
            if not isinstance(raw.get("call_id"), str) or not isinstance(output, str):
                raise InvalidRequest(f"{where} needs call_id and output strings", param=where)
            out.append({"type": "function_call_output", "id": raw.get("id") or new_id("fco"),
                        "status": "completed", "call_id": raw["call_id"], "output": output})
        else:  # compaction: an item this server made (data_plane/gateway/memory.py)
            if not isinstance(raw.get("encrypted_content"), str):
                raise InvalidRequest(f"{where}.encrypted_content must be a string", param=where)
            out.append({"type": "compaction", "id": raw.get("id") or new_id("cmp"),
                        "encrypted_content": raw["encrypted_content"]})
    refuse_duplicates(out, param)
    return out


def _reasoning_item(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """A reasoning item as OpenAI's reasoning models write it (in a history replayed here), checked as its
    shape says: a `summary` list of summary_text parts, optionally an id, `content` (reasoning_text parts),
    `encrypted_content` and `status` (another key: `refuse_unknown`)."""
    # no id: OpenAI's Responses API takes one without (Codex never sends it, the Agents SDK's
    # `reasoning_item_id_policy="omit"` strips it): stored under an id of ours, as a message without one is
    item: dict[str, Any] = {"type": "reasoning", "id": raw.get("id") or new_id("rs"), "status": "completed"}
    for key, part_type, required in (("summary", "summary_text", True), ("content", "reasoning_text", False)):
        parts = raw.get(key)
        if parts is None and not required:
            continue
        if key not in raw:
            raise InvalidRequest(f"Missing required parameter: '{where}.{key}'.", param=f"{where}.{key}",
                                 code="missing_required_parameter")
        if not isinstance(parts, list):
            raise InvalidRequest(f"{where}.{key} must be an array of {part_type} parts", param=f"{where}.{key}")
        for j, part in enumerate(parts):
            if (not isinstance(part, dict) or part.get("type") != part_type or not isinstance(part.get("text"), str)
                    or set(part) != {"type", "text"}):
                raise InvalidRequest(f"{where}.{key}[{j}] must be a {part_type} part: {{type, text}}",
                                     param=f"{where}.{key}[{j}]")
        item[key] = [{"type": part_type, "text": p["text"]} for p in parts]
    if raw.get("encrypted_content") is not None:
        if not isinstance(raw["encrypted_content"], str):
            raise InvalidRequest(f"{where}.encrypted_content must be a string", param=f"{where}.encrypted_content")
        item["encrypted_content"] = raw["encrypted_content"]
    return item


def refuse_unknown(raw: dict[str, Any], known: set[str], where: str) -> None:
    """OpenAI's 400 for a key `raw` (an item, a content part) does not define: "Unknown parameter:
    'input[0].foo'.", code ``unknown_parameter``, `param` the key's path."""
    for key in sorted(set(raw) - known, key=str):
        raise InvalidRequest(f"Unknown parameter: '{where}.{clipped(str(key))}'.", param=f"{where}.{clipped(str(key))}",
                             code="unknown_parameter")


def refuse_duplicates(items: list[dict[str, Any]], param: str, earlier: list[dict[str, Any]] | None = None) -> None:
    """OpenAI's 400 for an item id given twice, in `items` or already among `earlier` (the conversation or
    chain they join): ids are the cursors of item lists (`after`) and what item routes name, so a repeated
    one made a conversation's pages loop forever (`after` found its first copy) and a delete drop both."""
    seen = {item.get("id") for item in earlier or ()}
    for item in items:
        if item["id"] in seen:
            raise InvalidRequest(f"Duplicate item found with id {clipped(item['id'])}. Remove duplicate items from your "
                                 "input and try again.", param=param)
        seen.add(item["id"])


def _text_parts(content: Any, role: str, at: str) -> list[dict[str, Any]]:
    """A message's `content` (or a function_call_output's `output`) as text parts; a 400 naming `at`
    (``input[0].content``), or its part, when it is not text."""
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return [content_part(kind, content)]
    if not isinstance(content, list):
        raise InvalidRequest(f"{at} must be a string or a list of parts", param=at)
    parts = []
    for j, part in enumerate(content):
        ptype = part.get("type") if isinstance(part, dict) else None
        if ptype in TEXT_PARTS and not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{at}[{j}].text must be a string", param=f"{at}[{j}].text")
        if ptype in PART_FIELDS:
            refuse_unknown(part, PART_FIELDS[ptype], f"{at}[{j}]")
        if ptype == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            parts.append({"type": "refusal", "refusal": part["refusal"]})  # an output message's other part
            continue  # (OpenAI's replies carry them): replayed as the turn's text, as the chat path does
        if ptype not in TEXT_PARTS:
            raise UnsupportedParameter(f"content part type {ptype!r} is not supported; only text parts are",
                                       param=f"{at}[{j}]")
        parts.append(content_part(kind, part["text"]))
    return parts


def content_part(kind: str, text: str) -> dict[str, Any]:
    return {"type": kind, "text": text, "annotations": [], "logprobs": []} if kind == "output_text" else {
        "type": kind, "text": text}


def items_to_messages(items: list[dict[str, Any]], open_compaction: Any = None) -> list[dict[str, Any]]:
    """The chat messages `items` stand for (function calls as assistant tool_calls, their outputs as
    tool messages; a compaction item as the summary it holds, opened by `open_compaction`). A reasoning item
    stands for none: this model does not reason, and OpenAI withholds one from a model it is not from."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": "".join(p.get("text", p.get("refusal", "")) for p in item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls are one assistant message
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "compaction" and open_compaction is not None:
            out.append({"role": "system", "content": open_compaction(item["encrypted_content"])})
    return out
