"""What the Playground sends to shape an answer (a JSON schema, tools) and how it shows what came back
(no Streamlit here, so tests read it directly).

    fields = output_fields("JSON schema", schema_text, tools_text, "auto", parallel=True)  # {"response_format": ...}
    calls = ToolCalls(); calls.add(event)                                     # streamed ChatToolCall events
    calls.done()                                   # [{"id", "name", "arguments"}] in index order
    structured_json('{"name": "Ada"}')              # (parsed, None) or (None, why it is not JSON)
"""

from __future__ import annotations

import json
from typing import Any

from admin_ui.client import ChatToolCall

OUTPUTS = ("Text", "JSON schema", "Tools")
"""The Playground's output kinds: plain text, `response_format` json_schema, `tools`."""

EXAMPLE_SCHEMA = json.dumps({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}, indent=2)
"""Sent with ``strict: true``: closed, every property required (strict mode's rules; a 400 otherwise)."""
EXAMPLE_TOOLS = json.dumps([{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"]}}}], indent=2)


def output_fields(kind: str, schema_text: str, tools_text: str, tool_choice: str,
                  parallel: bool = True) -> dict[str, Any]:
    """The request fields for `kind` (OUTPUTS); ValueError saying what is wrong with the JSON typed."""
    if kind == "JSON schema":
        schema = _json(schema_text, "The JSON schema")
        if not isinstance(schema, dict):
            raise ValueError("The JSON schema must be a JSON object.")
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "playground", "schema": schema, "strict": True}}}
    if kind == "Tools":
        tools = _json(tools_text, "The tools")
        if not isinstance(tools, list) or not tools:
            raise ValueError('The tools must be a JSON list of {"type": "function", "function": {...}} objects.')
        return {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    return {}


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None


class ToolCalls:
    """Streamed tool-call fragments put back together (OpenAI's shape: id and name once, then arguments)."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, str]] = {}

    def add(self, event: ChatToolCall) -> None:
        call = self._calls.setdefault(event.index, {"id": "", "name": "", "arguments": ""})
        call["id"] = event.id or call["id"]
        call["name"] = event.name or call["name"]
        call["arguments"] += event.arguments

    def done(self) -> list[dict[str, str]]:
        return [self._calls[i] for i in sorted(self._calls)]


def structured_json(text: str) -> tuple[Any, str | None]:
    """(the parsed answer, None), or (None, why it is not JSON)."""
    try:
        return json.loads(text), None
    except ValueError as exc:
        return None, str(exc)
