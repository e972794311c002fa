"""The generic tool envelope (data_plane/structured.py) parsed back into OpenAI's message shape, as it streams.

    parser = EnvelopeParser(json_response=False)
    for event in parser.feed(text_delta):        # Content(text) | CallStart(index, name) | Arguments(index, text)
        ...
    message = assemble(parser.feed(whole_text))  # {"content": ..., "tool_calls": [...]} for one body

The model's output is forced by grammar into ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}``
or ``{"response": ...}``, properties in that order. The parser reads it incrementally, so a stream can
carry OpenAI's exact deltas: for each call, first its ``index`` with ``id``, ``type`` and
``function.name`` (once), then ``function.arguments`` fragments (the raw JSON text of the arguments as it
arrives; a tool without parameters gives "{}"). A ``response`` string is unescaped into plain content as
it arrives (an escape split across deltas waits for its end); a JSON ``response`` (auto tools with a
response_format) streams as its JSON text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_HEAD = re.compile(r'\s*\{\s*"(tool_calls|response)"\s*:\s*')
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str
    id: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


Event = Content | CallStart | Arguments


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


_HEX = "0123456789abcdefABCDEF"
_LOW_ESCAPE = ("\\", "u", "dD", "cdefCDEF", _HEX, _HEX)
"""The shape of an escaped low surrogate, character by character: `\\uDC00` to `\\uDFFF`."""


def _unicode_escape(buf: str, i: int) -> tuple[str, int]:
    """The character the `\\uXXXX` escape at `buf[i]` stands for and the characters it takes (0: wait for
    more text). JSON's grammar admits any four hex digits, and so may vLLM's grammar backends (a torch
    shard's llguidance grammar writes no surrogate escape), so a model may write half a surrogate pair: as
    a UTF-8 decoder does with broken bytes, that half is U+FFFD. Kept, a lone surrogate was no text at
    all (the shard's SSE line could not be encoded), and a half followed by other text raised."""
    digits = buf[i + 2 : i + 6]
    if not all(c in _HEX for c in digits):  # not an escape a JSON grammar writes: keep the text readable
        return "\ufffd", 2
    cp = int(digits, 16)
    if 0xDC00 <= cp < 0xE000:
        return "\ufffd", 6
    if not 0xD800 <= cp < 0xDC00:
        return chr(cp), 6
    tail = buf[i + 6 : i + 12]
    if any(c not in allowed for c, allowed in zip(tail, _LOW_ESCAPE, strict=False)):
        return "\ufffd", 6  # the next text is no low surrogate: this half stands alone
    if len(tail) < len(_LOW_ESCAPE):
        return "", 0
    low = int(buf[i + 8 : i + 12], 16)
    return chr(0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)), 12


class _Value:
    """Tracks a raw JSON value's end (depth, strings) character by character."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False
        self.done = False

    def take(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of them unless it ends inside)."""
        for i, ch in enumerate(text):
            if not self.started and ch.isspace():
                continue
            self.started = True
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
            elif self.depth == 0 and ch in ",}] \n":
                self.done = True
                return i
        return len(text)


class EnvelopeParser:
    def __init__(self, json_response: bool = False) -> None:
        self.json_response = json_response
        self.buf = ""
        self.state = "head"
        self.calls: list[CallStart] = []
        self._value: _Value | None = None
        self._args_out = False

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while True:
            before = (self.state, len(self.buf))
            getattr(self, "_" + self.state)(out)
            if (self.state, len(self.buf)) == before:
                return out

    def _head(self, out: list[Event]) -> None:
        m = _HEAD.match(self.buf)
        if m:
            self.buf = self.buf[m.end():]
            if m.group(1) == "tool_calls":
                self.state = "calls"
            elif self.json_response:
                self.state, self._value = "json_response", _Value()
            else:
                self.state = "response_open"

    def _response_open(self, out: list[Event]) -> None:
        s = self.buf.lstrip()
        if s.startswith('"'):
            self.buf, self.state = s[1:], "response"

    def _response(self, out: list[Event]) -> None:
        text, i = [], 0
        buf = self.buf
        while i < len(buf):
            ch = buf[i]
            if ch == '"':
                self.state, i = "done", i + 1
                break
            if ch != "\\":
                text.append(ch)
                i += 1
                continue
            if i + 1 >= len(buf):
                break
            code = buf[i + 1]
            if code == "u":
                if i + 6 > len(buf):
                    break
                char, used = _unicode_escape(buf, i)
                if not used:  # a high surrogate whose second half may still come
                    break
                text.append(char)
                i += used
                continue
            text.append(_ESCAPES.get(code, code))
            i += 2
        self.buf = buf[i:]
        if text:
            out.append(Content("".join(text)))

    def _take_value(self) -> str:
        """The next piece of the JSON value being streamed (leading blanks of its first piece dropped)."""
        assert self._value is not None
        n = self._value.take(self.buf)
        piece, self.buf = self.buf[:n], self.buf[n:]
        if not self._args_out:
            piece = piece.lstrip()
        if piece:
            self._args_out = True
        return piece

    def _json_response(self, out: list[Event]) -> None:
        if piece := self._take_value():
            out.append(Content(piece))
        if self._value is not None and self._value.done:
            self.state = "done"

    def _calls(self, out: list[Event]) -> None:
        s = self.buf.lstrip()
        if s.startswith("["):
            self.buf, self.state = s[1:], "call"

    def _call(self, out: list[Event]) -> None:
        s = self.buf.lstrip()
        if s.startswith("]"):
            self.buf, self.state = s[1:], "done"
            return
        s = s.removeprefix(",")
        m = _NAME.match(s)
        if m:
            start = CallStart(len(self.calls), json.loads(f'"{m.group(1)}"'), new_call_id())
            self.calls.append(start)
            out.append(start)
            self.buf, self.state, self._value, self._args_out = s[m.end():], "arguments", _Value(), False
        elif s != self.buf:
            self.buf = s

    def _arguments(self, out: list[Event]) -> None:
        if piece := self._take_value():
            out.append(Arguments(len(self.calls) - 1, piece))
        if self._value is not None and self._value.done:
            self.state = "call_end"

    def _call_end(self, out: list[Event]) -> None:
        s = self.buf.lstrip()
        if s.startswith("}"):
            self.buf, self.state = s[1:], "call"

    def _done(self, out: list[Event]) -> None:
        self.buf = ""


def assemble(events: list[Event]) -> dict[str, Any]:
    """One message's `content` and `tool_calls` (OpenAI's shape) from all of its events."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        else:
            calls[e.index]["function"]["arguments"] += e.text
    message: dict[str, Any] = {"content": "".join(content) if content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def delta_of(event: Event) -> dict[str, Any]:
    """The chunk delta for one event (OpenAI's streamed tool-call shape)."""
    if isinstance(event, Content):
        return {"content": event.text}
    if isinstance(event, CallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


CALLS_PREFIX = '{"tool_calls":'
"""How an assistant turn that called tools starts once written back as text (`envelope_text`; the model's own
output under the grammar, as a session transcript keeps it)."""


def holds_tool_calls(messages: list[dict[str, Any]]) -> bool:
    """Whether a conversation holds tool calls: an assistant message with `tool_calls`, or one written back
    as the envelope (a shard sees those, and a session's transcript keeps them)."""
    return any(m.get("role") == "assistant" and (m.get("tool_calls") or (
        isinstance(m.get("content"), str) and m["content"].startswith(CALLS_PREFIX))) for m in messages)


def envelope_text(content: str | None, tool_calls: list[dict[str, Any]] | None) -> str:
    """An assistant message with tool calls, written back as the envelope the model produced (history)."""
    if not tool_calls:
        return json.dumps({"response": content or ""}, ensure_ascii=False)
    calls = []
    for call in tool_calls:
        fn = call.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (ValueError, RecursionError):  # a client's history may hold any text (nested past the parser: a 500)
            args = fn.get("arguments")
        calls.append({"name": fn.get("name", ""), "arguments": args})
    return json.dumps({"tool_calls": calls}, ensure_ascii=False, separators=(",", ":"))


def envelope_calls(content: str | None) -> list[str]:
    """The functions an envelope (`envelope_text`) called, in order; none for text, an answer, or an envelope
    cut short (a reply stopped by its token limit is not a whole one)."""
    if not content or not content.startswith(CALLS_PREFIX):
        return []
    try:
        calls: Any = json.loads(content)["tool_calls"]
    except (ValueError, KeyError, TypeError):
        return []
    if not isinstance(calls, list):
        return []
    return [str(c.get("name", "")) if isinstance(c, dict) else "" for c in calls]


class SentOutput:
    """What a stream has sent of choice 0, written back as the text the model produced: a resumed request
    (data_plane/routing/resume.py) ends with it as the assistant message to continue, and a torch shard
    advances the grammar over it (data_plane/shard/engines/grammar.py `CompiledGrammar.resumed`).

        sent = SentOutput.for_body(body)            # the envelope when the request has tools
        sent.content("Hel"); sent.call(0, "get_weather", '{"ci')
        sent.text()                                  # '{"tool_calls":[{"name":"get_weather","arguments":{"ci'

    With tools the shard sent parsed deltas, not the envelope: it is rebuilt in the grammar's compact form
    (data_plane/structured.py), up to the last piece received (the model re-writes anything after it).
    """

    def __init__(self, envelope: bool, json_response: bool = False) -> None:
        self.envelope = envelope
        self.json_response = json_response
        self._content: list[str] = []
        self._calls: list[tuple[str, list[str]]] = []

    @classmethod
    def for_body(cls, body: dict[str, Any]) -> SentOutput:
        choice = body.get("tool_choice")
        rf = body.get("response_format")
        answer_json = isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema")
        if not body.get("tools") or choice == "none":  # ToolMode.ANSWER (data_plane/structured.py) or free text
            answer = not answer_json and not body.get("structured_outputs")
            return cls(answer and holds_tool_calls(body.get("messages") or []))
        auto = choice in (None, "auto") or (isinstance(choice, dict) and choice.get("type") == "allowed_tools"
                                            and (choice.get("allowed_tools") or {}).get("mode") == "auto")
        return cls(True, answer_json and auto)

    def content(self, text: str) -> None:
        self._content.append(text)

    def call(self, index: int, name: str | None, arguments: str) -> None:
        if index >= len(self._calls):
            self._calls.append((name or "", []))
        self._calls[index][1].append(arguments)

    def text(self) -> str:
        content = "".join(self._content)
        if not self.envelope:
            return content
        if self._calls:
            calls = [f'{{"name":{json.dumps(name, ensure_ascii=False)},"arguments":{"".join(args)}'
                     for name, args in self._calls]
            return '{"tool_calls":[' + "},".join(calls)
        if not self._content:
            return ""
        if self.json_response:
            return '{"response":' + content
        return '{"response":' + json.dumps(content, ensure_ascii=False)[:-1]
