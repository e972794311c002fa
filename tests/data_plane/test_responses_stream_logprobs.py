"""The Responses stream's text logprobs: the deltas add up to the done event's, even when the reply ends on
tokens with no text of their own (half a multi-byte character cut by max_output_tokens)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from data_plane.gateway.responses_stream import ResponseEvents


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "bytes": list(token.encode()), "logprob": logprob, "top_logprobs": []}


def _sse(chunk: dict[str, Any] | str) -> bytes:
    return b"data: " + (chunk if isinstance(chunk, str) else json.dumps(chunk)).encode() + b"\n\n"


def _events(chunks: list[dict[str, Any] | str]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    events = ResponseEvents(send, start=lambda: {"status": "in_progress"},
                            finish=lambda reason, output: {"status": "incomplete", "output": output},
                            fail=lambda code, message: {"status": "failed"}, message_id="msg_1")

    async def run() -> None:
        await events.send({"type": "http.response.start", "status": 200, "headers": []})
        for i, chunk in enumerate(chunks):
            await events.send({"type": "http.response.body", "body": _sse(chunk), "more_body": i < len(chunks) - 1})

    asyncio.run(run())
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return [json.loads(block.split(b"\ndata: ", 1)[1]) for block in body.split(b"\n\n") if block]


def test_logprobs_of_a_textless_last_token_go_out_in_a_delta() -> None:
    half = {"token": "\ufffd", "bytes": [0xe3], "logprob": -0.5, "top_logprobs": []}
    chunks: list[dict[str, Any] | str] = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                      "logprobs": {"content": [_entry("Hi", -0.1)]}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "logprobs": {"content": [half]}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        "[DONE]",
    ]
    events = _events(chunks)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert "".join(d["delta"] for d in deltas) == done["text"] == "Hi"
    assert [lp for d in deltas for lp in d["logprobs"]] == done["logprobs"]
    assert [lp["logprob"] for lp in done["logprobs"]] == [-0.1, -0.5]
