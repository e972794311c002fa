"""The Responses API's streaming events, translated from the chat path's SSE chunks as they are sent.

    events = ResponseEvents(send, start=lambda: response_in_progress, finish=lambda: final_response)
    await completion.stream_to(events.send, stream, include_usage=True, headers=headers)

`Completion.stream_to` (data_plane/gateway/stream.py) writes chat.completion.chunk SSE onto an
ASGI `send`; this object stands in for that `send` and writes OpenAI's Responses events instead,
each with its `sequence_number`: ``response.created``, ``response.in_progress``, then per output
item ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``... (or ``response.function_call_arguments.delta`` for a tool call),
their ``.done`` events, and ``response.completed`` (``response.incomplete`` when cut by
max_output_tokens or the output filter). A failure mid-stream becomes an ``error`` event then
``response.failed`` carrying the failed response as it is stored (``fail``: its error, the output
the client got so far). So streaming, the output filter, usage and the ledger are the chat path's own.

Items are sent one after another, as OpenAI sends them: a function call's ``.done`` events go out when
the next call begins (the chat path sends parallel calls in order, each whole before the next), so
``output_item.done`` of item i precedes ``output_item.added`` of item i+1; a client that acts on a call
once its item is done (runs it, renders it) is not kept waiting for the whole reply. The text item stays
open to the end (a vLLM tool parser sends text before its calls, and nothing after them).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from starlette.types import Message, Send

from data_plane.common.errors import SwitchboardError
from data_plane.gateway.responses_calls import call_status
from data_plane.gateway.responses_input import content_part
from data_plane.gateway.responses_items import in_responses_terms, text_logprobs


def call_item_id(call_id: str) -> str:
    """The output item id of a function call (derived, so the stream and the stored record agree)."""
    return "fc_" + hashlib.sha256(call_id.encode()).hexdigest()[:40]


class ResponseEvents:
    """An ASGI `send` that turns chat SSE chunks into Responses SSE events (see the module docstring)."""

    def __init__(self, send: Send, *, start: Callable[[], dict[str, Any]],
                 finish: Callable[[str | None, list[dict[str, Any]]], dict[str, Any]],
                 fail: Callable[[str, str], dict[str, Any]], message_id: str, announced: int = 0) -> None:
        """`start()`: the response object while in progress; `finish(finish_reason, output)`: the
        final one (as stored); `fail(code, message)`: the failed one (as stored); `message_id`: the
        id of the text output item; `announced`: how many events were sent before this stream began (a
        background run's ``response.created`` and ``response.queued``): numbering goes on after them, and
        ``response.created`` is not sent again."""
        self._send = send
        self._start = start
        self._finish = finish
        self._fail = fail
        self._message_id = message_id
        self._seq = announced
        self._out: list[bytes] = []
        self._text: list[str] = []
        self._message_index: int | None = None
        self._calls: dict[int, dict[str, Any]] = {}
        """chat tool_call index -> its output item (arguments accumulating)."""
        self._items: list[dict[str, Any]] = []
        self._done: dict[int, dict[str, Any]] = {}
        """Output index -> the item as its ``output_item.done`` event carried it."""
        self._logprobs: list[dict[str, Any]] = []
        """The text's logprobs so far (chat entries), when the request included them."""
        self._pending: list[dict[str, Any]] = []
        """Logprobs that came in a chunk without text: they go with the next text delta."""
        self._finish_reason: str | None = None
        self._failed = False

    def _event(self, kind: str, **fields: Any) -> None:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        self._out.append(b"event: " + kind.encode() + b"\ndata: "
                         + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            await self._send(message)
            response = self._start()
            if not self._seq:
                self._event("response.created", response=response)
            self._event("response.in_progress", response=response)
            return
        for block in message.get("body", b"").split(b"\n\n"):
            if block.startswith(b"data: "):
                self._chunk(block[6:])
        more = bool(message.get("more_body"))
        body, self._out = b"".join(self._out), []
        if body or not more:
            await self._send({"type": "http.response.body", "body": body, "more_body": more})

    def _chunk(self, data: bytes) -> None:
        if data == b"[DONE]":
            self._close()
            return
        chunk = json.loads(data)
        if "error" in chunk:
            self._failed = True
            err = chunk["error"]  # named in the Responses body's terms (text.format, not response_format)
            said = in_responses_terms(SwitchboardError(err.get("message", ""), param=err.get("param")))
            self._event("error", code=err.get("code"), message=said.message, param=said.param)
            self._event("response.failed", response=self._fail(err.get("code") or "error", said.message))
            return
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if not delta.get("tool_calls"):  # a function call's item has no logprobs
                self._pending += (choice.get("logprobs") or {}).get("content") or []
            if delta.get("content"):
                self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                self._call_delta(call)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]

    def _open_message(self) -> int:
        """The text output item's index, announced (``output_item.added``, ``content_part.added``) the first time."""
        if self._message_index is None:
            self._message_index = len(self._items)
            item = {"type": "message", "id": self._message_id, "status": "in_progress", "role": "assistant",
                    "content": []}
            self._items.append(item)
            self._event("response.output_item.added", output_index=self._message_index, item=item)
            self._event("response.content_part.added", item_id=self._message_id, output_index=self._message_index,
                        content_index=0, part=content_part("output_text", ""))
        return self._message_index

    def _text_delta(self, text: str) -> None:
        self._open_message()
        self._text.append(text)
        logprobs, self._pending = self._pending, []
        self._logprobs += logprobs
        self._event("response.output_text.delta", item_id=self._message_id, output_index=self._message_index,
                    content_index=0, delta=text, logprobs=text_logprobs(logprobs, with_bytes=False))

    def _call_delta(self, call: dict[str, Any]) -> None:
        index = call.get("index", 0)
        item = self._calls.get(index)
        fn = call.get("function") or {}
        if item is None:
            self._close_calls()  # the calls before this one are whole
            call_id = call.get("id") or f"call_{index}"
            item = {"type": "function_call", "id": call_item_id(call_id), "status": "in_progress",
                    "call_id": call_id, "name": fn.get("name") or "", "arguments": ""}
            self._calls[index] = item
            item["output_index"] = len(self._items)
            self._items.append(item)
            self._event("response.output_item.added", output_index=item["output_index"],
                        item={k: v for k, v in item.items() if k != "output_index"})
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            self._event("response.function_call_arguments.delta", item_id=item["id"],
                        output_index=item["output_index"], delta=fn["arguments"])

    def _close_calls(self) -> None:
        """Send the ``.done`` events of the function calls still open (each is whole: a later item began)."""
        for index, item in enumerate(self._items):
            if item["type"] == "function_call" and index not in self._done:
                self._item_done(index, "completed")

    def _item_done(self, index: int, status: str) -> None:
        """Item `index`'s ``.done`` events; `status` is the response's (a call cut inside its arguments
        is incomplete)."""
        item = self._items[index]
        if item["type"] == "message":
            if self._pending:  # tokens with no text of their own (half a character at the cut): their logprobs
                self._text_delta("")  # go out in a delta too, so the deltas add up to the done event's
            text = "".join(self._text)
            part = content_part("output_text", text)
            logprobs = self._logprobs + self._pending
            part["logprobs"] = text_logprobs(logprobs)
            self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=text, logprobs=text_logprobs(logprobs, with_bytes=False))
            self._event("response.content_part.done", item_id=item["id"], output_index=index,
                        content_index=0, part=part)
            done = {**item, "status": status, "content": [part]}
        else:
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"], name=item["name"])
            done = {k: v for k, v in item.items() if k != "output_index"} | {
                "status": call_status(item["arguments"], status)}
        self._event("response.output_item.done", output_index=index, item=done)
        self._done[index] = done

    def _close(self) -> None:
        if self._failed:
            return
        status = "completed" if self._finish_reason in (None, "stop", "tool_calls") else "incomplete"
        if not self._items:  # no text and no call (a call cut inside its envelope, an empty reply): the response
            self._open_message()  # holds an empty message (output_items), so the stream announces one too
        for index in range(len(self._items)):
            if index not in self._done:
                self._item_done(index, status)
        output = [self._done[index] for index in range(len(self._items))]
        response = self._finish(self._finish_reason, output)
        kind = "response.completed" if response["status"] == "completed" else "response." + response["status"]
        self._event(kind, response=response)
