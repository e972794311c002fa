"""The legacy Completions API's reply: a chat completion (body or SSE chunks) reshaped as a `text_completion`.

    body = LegacyShape(echo_texts, n, logprobs=2).body(chat_body)     # the JSON reply
    send = LegacyShape(...).send(send)                                # an ASGI send that rewrites the chunks

The chat path (data_plane/gateway/stream.py) writes what it always writes, filters, usage and errors
included; only the shape changes here: `choices[].text` (with the prompt before it under `echo`), logprobs
in the legacy format (`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob}, `text_offset`: each
token's character offset in the choice's text), ids `cmpl-...`, object `text_completion`. A stream's role
chunks have no legacy twin and are left out; its error events and `[DONE]` pass as they are.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from starlette.types import Message, Send

OBJECT = "text_completion"


class LegacyShape:
    def __init__(self, echo: list[str], n: int, logprobs: int | None,
                 prompt_logprobs: dict[int, tuple[Any, ...]] | None = None, echo_only: bool = False) -> None:
        """`echo`: each prompt's text to put before its choices' text (empty: none); `n` choices per prompt;
        `prompt_logprobs`: each choice's prompt entries as the shard sent them (filled while the reply streams),
        put before its tokens' under echo; `echo_only` (max_tokens 0): the generated token left out."""
        self.echo = echo
        self.n = n
        self.logprobs = logprobs
        self.prompt_logprobs = {} if prompt_logprobs is None else prompt_logprobs
        self.echo_only = echo_only
        self._offsets: dict[int, int] = {}
        """Each streamed choice's text so far (characters), for its tokens' text_offset."""
        self._opened: set[int] = set()
        self._prompt_sent: set[int] = set()
        self._tail = b""

    def _prefix(self, index: int) -> str:
        k = index // self.n
        return self.echo[k] if k < len(self.echo) else ""

    def _legacy_logprobs(self, entries: Sequence[dict[str, Any]], start: int) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = start
        for e in entries:
            tokens.append(e["token"])
            token_logprobs.append(e["logprob"])
            if e["logprob"] is None:  # a prompt's first token: nothing predicts it
                tops.append(None)
            else:
                top = {t["token"]: t["logprob"] for t in e.get("top_logprobs") or ()}
                top.setdefault(e["token"], e["logprob"])  # OpenAI's: the token's own too (up to logprobs + 1)
                tops.append(top)
            offsets.append(offset)
            offset += len(e["token"])
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _joined(self, index: int, entries: Sequence[dict[str, Any]], start: int) -> dict[str, Any]:
        """The legacy lists of a choice's `entries` (text offsets from `start`), its prompt's before them when
        echoed and not sent yet (their offsets from 0)."""
        out = self._legacy_logprobs([] if self.echo_only else entries, start)
        prompt = self.prompt_logprobs.get(index) if self.echo else None
        if prompt is not None and index not in self._prompt_sent:
            self._prompt_sent.add(index)
            head = self._legacy_logprobs([e for e in prompt if e is not None], 0)
            out = {k: head[k] + out[k] for k in out}
        return out

    def _head(self, chat: dict[str, Any]) -> dict[str, Any]:
        out = {"id": "cmpl-" + str(chat.get("id", "")).removeprefix("chatcmpl-"), "object": OBJECT,
               "created": chat.get("created"), "model": chat.get("model")}
        if "system_fingerprint" in chat:
            out["system_fingerprint"] = chat["system_fingerprint"]
        return out

    def _usage(self, usage: dict[str, Any] | None) -> dict[str, Any] | None:
        """With echo_only none of the tokens generated is the reply's: no completion tokens."""
        if usage is None or not self.echo_only:
            return usage
        return {**usage, "completion_tokens": 0, "total_tokens": usage.get("prompt_tokens", 0)}

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A chat.completion body as a text_completion."""
        choices = []
        for c in chat.get("choices", []):
            index = c["index"]
            prefix = self._prefix(index)
            text = prefix + ("" if self.echo_only else c.get("message", {}).get("content") or "")
            lp = None
            if self.logprobs is not None:
                lp = self._joined(index, (c.get("logprobs") or {}).get("content") or [], len(prefix))
            reason = "length" if self.echo_only else c.get("finish_reason")
            choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": reason})
        out = {**self._head(chat), "choices": choices}
        if chat.get("usage") is not None:
            out["usage"] = self._usage(chat["usage"])
        return out

    def chunk(self, chat: dict[str, Any]) -> dict[str, Any] | None:
        """A chat.completion.chunk as a text_completion chunk (None: nothing a legacy client would see)."""
        choices = []
        for c in chat.get("choices", []):
            index = c["index"]
            delta = c.get("delta") or {}
            text = "" if self.echo_only else delta.get("content") or ""
            if index not in self._opened:
                self._opened.add(index)
                text = (prefix := self._prefix(index)) + text
                self._offsets[index] = len(prefix)
            entries = [] if self.echo_only else (c.get("logprobs") or {}).get("content") or []
            prompt = (self.logprobs is not None and self.echo and index in self.prompt_logprobs
                      and index not in self._prompt_sent)
            reason = c.get("finish_reason")
            if not text and not entries and not prompt and reason is None:
                continue  # a role chunk
            lp = None
            if self.logprobs is not None and (entries or prompt):
                lp = self._joined(index, entries, self._offsets.get(index, 0))
                self._offsets[index] = self._offsets.get(index, 0) + sum(len(e["token"]) for e in entries)
            if self.echo_only and reason is not None:
                reason = "length"
            choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": reason})
        if not choices and chat.get("usage") is None:
            return None
        out = {**self._head(chat), "choices": choices}
        if "usage" in chat:
            out["usage"] = self._usage(chat["usage"])
        return out

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event + b"\n\n"
        data = json.loads(event[6:])
        if data.get("object") != "chat.completion.chunk":
            return event + b"\n\n"  # an error event
        chunk = self.chunk(data)
        if chunk is None:
            return b""
        return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    def send(self, send: Send) -> Send:
        """`send` with each SSE event of the body rewritten (whole events: a write that ends mid-event keeps the rest)."""

        async def rewritten(message: Message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            data = self._tail + message.get("body", b"")
            *events, self._tail = data.split(b"\n\n")
            body = b"".join(self._event(e) for e in events if e)
            more = message.get("more_body", False)
            if not more and self._tail:
                body, self._tail = body + self._tail, b""
            await send({"type": "http.response.body", "body": body, "more_body": more})

        return rewritten
