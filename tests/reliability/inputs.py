"""Handcrafted bad and odd inputs for the gateway's chat endpoint, as one table.

Each case: (name, body, extra headers, statuses allowed). `body` is a dict (sent as JSON), or raw
bytes (sent as is, with a JSON content type unless the headers say otherwise). Cases already in
tests/data_plane/test_gateway.py (unknown parameter, empty messages, negative max_tokens, max_tokens
over the tier cap, unknown model, blocked input, 300 messages, malformed JSON, invalid UTF-8 bytes,
wrong content type, 50k-deep nesting, 2 MiB body, bad session id) are not repeated.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

USER = [{"role": "user", "content": "hello"}]
OK = {200}
BAD = {400}


def _raw(obj: Any) -> bytes:
    return json.dumps(obj).encode()


CASES: list[tuple[str, Any, dict[str, str], set[int]]] = [
    # sizes
    ("10k messages", {"messages": USER * 10_000}, {}, BAD),
    (
        "10k text parts in one message (10k tokens: over the window)",
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x "}] * 10_000}],
            "max_tokens": 2,
        },
        {},
        BAD,
    ),
    ("one 900 KB word", {"messages": [{"role": "user", "content": "a" * 900_000}], "max_tokens": 2}, {}, OK),
    ("max_tokens 1e6 (over every tier cap)", {"messages": USER, "max_tokens": 1_000_000}, {}, BAD),
    ("max_tokens 1e7 (over the schema bound)", {"messages": USER, "max_tokens": 10_000_000}, {}, BAD),
    ("max_tokens 2**63", {"messages": USER, "max_tokens": 2**63}, {}, BAD),
    ("max_tokens 2**64 + 1", {"messages": USER, "max_tokens": 2**64 + 1}, {}, BAD),
    ("max_tokens 1e308", b'{"messages":[{"role":"user","content":"x"}],"max_tokens":1e308}', {}, BAD),
    ("max_completion_tokens huge", {"messages": USER, "max_completion_tokens": 999_999}, {}, BAD),
    ("max_tokens zero", {"messages": USER, "max_tokens": 0}, {}, BAD),
    ("max_tokens 4.0", {"messages": USER, "max_tokens": 4.0}, {}, OK),
    ("max_tokens true (strict types: not 1)", {"messages": USER, "max_tokens": True}, {}, BAD),
    ("max_tokens a string", {"messages": USER, "max_tokens": "5"}, {}, BAD),
    ("max_tokens 4.5", {"messages": USER, "max_tokens": 4.5}, {}, BAD),
    ("n a string", {"messages": USER, "n": "2", "max_tokens": 2}, {}, BAD),
    ("n true", {"messages": USER, "n": True, "max_tokens": 2}, {}, BAD),
    ("logprobs a string", {"messages": USER, "logprobs": "false", "max_tokens": 2}, {}, BAD),
    (
        "max_tokens and max_completion_tokens disagree",
        {"messages": USER, "max_tokens": 3, "max_completion_tokens": 4},
        {},
        BAD,
    ),
    # text
    ("NUL character", {"messages": [{"role": "user", "content": "a\u0000b"}], "max_tokens": 2}, {}, OK | BAD),
    (
        "control characters",
        {"messages": [{"role": "user", "content": "\x01\x1b[31m\x7f"}], "max_tokens": 2},
        {},
        OK | BAD,
    ),
    (
        "emoji, RTL, combining marks",
        {"messages": [{"role": "user", "content": "😀 שלום e\u0301 \u202e abc"}], "max_tokens": 2},
        {},
        OK,
    ),
    (
        "surrogate pair escape (valid)",
        b'{"messages":[{"role":"user","content":"\\ud83d\\ude00"}],"max_tokens":2}',
        {},
        OK,
    ),
    ("only whitespace", {"messages": [{"role": "user", "content": " \n\t "}], "max_tokens": 2}, {}, OK | BAD),
    ("empty content", {"messages": [{"role": "user", "content": ""}], "max_tokens": 2}, {}, OK | BAD),
    ("null content", {"messages": [{"role": "user", "content": None}], "max_tokens": 2}, {}, BAD),
    (
        "null content on an assistant turn (allowed, as OpenAI does)",
        {"messages": USER + [{"role": "assistant", "content": None}] + USER, "max_tokens": 2},
        {},
        OK,
    ),
    (
        "lone surrogate in a JSON schema (was a 500)",
        (b'{"messages":[{"role":"user","content":"x"}],"max_tokens":2,"response_format":{"type":"json_schema",'
        b'"json_schema":{"name":"x","schema":{"type":"string","enum":["\\ud800"]}}}}'),
        {},
        BAD,
    ),
    (
        "lone surrogate in a tool call's arguments (was a 500)",
        (b'{"messages":[{"role":"user","content":"x"},{"role":"assistant","tool_calls":[{"id":"c1","type":"function",'
        b'"function":{"name":"f","arguments":"\\ud800"}}]},{"role":"tool","tool_call_id":"c1","content":"ok"}],'
        b'"max_tokens":2}'),
        {},
        BAD,
    ),
    # structure
    (
        "developer role",
        {"messages": [{"role": "developer", "content": "be brief"}] + USER, "max_tokens": 2},
        {},
        OK,
    ),
    (
        "assistant message last",
        {"messages": USER + [{"role": "assistant", "content": "hi"}], "max_tokens": 2},
        {},
        OK | BAD,
    ),
    ("tool role", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, {}, BAD),
    ("name of 257 chars", {"messages": [{"role": "user", "content": "x", "name": "n" * 257}]}, {}, BAD),
    ("unknown key inside a message", {"messages": [{"role": "user", "content": "x", "evil": 1}]}, {}, BAD),
    (
        "text part with an extra key",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "extra": {"a": [1]}}]}]},
        {},
        BAD,
    ),
    ("stop: empty string", {"messages": USER, "stop": [""]}, {}, BAD),
    ("stop: 257 chars", {"messages": USER, "stop": "s" * 257}, {}, BAD),
    ("metadata with a nested value", {"messages": USER, "metadata": {"a": {"b": 1}}}, {}, BAD),
    ("temperature NaN", b'{"messages":[{"role":"user","content":"x"}],"temperature":NaN}', {}, BAD),
    ("top_p Infinity", b'{"messages":[{"role":"user","content":"x"}],"top_p":Infinity}', {}, BAD),
    (
        "seed beyond int64",
        b'{"messages":[{"role":"user","content":"x"}],"seed":99999999999999999999999}',
        {},
        BAD,
    ),
    (
        "duplicate keys",
        b'{"messages":[],"messages":[{"role":"user","content":"x"}],"max_tokens":2}',
        {},
        OK | BAD,
    ),
    ("stream is a string (it streamed: lax mode took 'yes' as true)", {"messages": USER, "stream": "yes"}, {}, BAD),
    ("stream_options without stream", {"messages": USER, "stream_options": {"include_usage": True}}, {}, BAD),
    # extension fields a client may send (the gateway sets its own)
    (
        "client sets continue_final_message",
        {
            "messages": USER + [{"role": "assistant", "content": "hi"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "max_tokens": 2,
        },
        {},
        OK | BAD,
    ),
    ("client sets a past deadline", {"messages": USER, "deadline": 1.0, "max_tokens": 2}, {}, OK | BAD),
    (
        "client sets request_id of 128 chars",
        {"messages": USER, "request_id": "r" * 128, "max_tokens": 2},
        {},
        OK,
    ),
    ("client sets session_id in the body to a bad id", {"messages": USER, "session_id": "bad id!"}, {}, BAD),
    # whole bodies
    ("body is null", b"null", {}, BAD),
    ("body is a string", b'"hello"', {}, BAD),
    ("body is a number", b"42", {}, BAD),
    ("empty body", b"", {}, BAD),
    ("UTF-16 body", json.dumps({"messages": USER}).encode("utf-16"), {}, BAD),
    ("UTF-8 BOM", b"\xef\xbb\xbf" + _raw({"messages": USER, "max_tokens": 2}), {}, OK | BAD),
    (
        "gzip body without decoding support (was a 400 'not valid UTF-8')",
        gzip.compress(_raw({"messages": USER})),
        {"content-encoding": "gzip"},
        {415},
    ),
    (
        "multipart form",
        b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\nb\r\n--x--\r\n",
        {"content-type": "multipart/form-data; boundary=x"},
        {415},
    ),
    ("no content type", _raw({"messages": USER, "max_tokens": 2}), {"content-type": ""}, OK | {415}),
    # headers
    ("session id of 129 chars", {"messages": USER}, {"X-Session-Id": "s" * 129}, BAD),
    ("8 KB Authorization header", {"messages": USER}, {"Authorization": "Bearer " + "k" * 8192}, {401}),
    ("traceparent garbage", {"messages": USER, "max_tokens": 2}, {"traceparent": "00-zz-yy-01"}, OK),
]
