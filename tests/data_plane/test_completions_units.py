"""The legacy Completions API's pieces without processes: a raw prompt on the shard (no template; a resume
continues the same text; token ids kept exactly), the reply reshaped across split SSE writes, several
prompts' streams merged.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_completions_units.py -q
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from data_plane.chat_messages import ChatMessage
from data_plane.common.errors import InvalidRequest
from data_plane.gateway.completions import Prompts, _open_all
from data_plane.gateway.completions_wire import LegacyShape
from data_plane.protocol import ShardRequest, parse_chat_request
from data_plane.routing.events import Delta, Event, Fingerprint, Finish, UsageEvent
from data_plane.routing.lanes import continued
from data_plane.shard.engines.synthetic import SyntheticEngine
from data_plane.shard.generation import generation_requests, prompt_ids


def _on_shard(request: ShardRequest) -> Any:
    """`request` as a shard reads it off the wire."""
    return parse_chat_request(json.dumps(request.wire()).encode(), "application/json", client=False)


def test_a_raw_prompt_is_encoded_as_it_is_and_a_resume_continues_its_text() -> None:
    engine = SyntheticEngine()
    request = ShardRequest(messages=[ChatMessage(role="user", content="once upon")], raw_prompt=True,
                           continue_final_message=True, add_generation_prompt=False, max_tokens=4, stream=True)
    _, ids = prompt_ids(_on_shard(request), engine)
    assert ids == engine.encode_text("once upon")  # no template: no role tokens
    resumed = request.model_copy(update={"messages": continued(request, " a time")})
    _, ids = prompt_ids(_on_shard(resumed), engine)
    assert ids == engine.encode_text("once upon a time")

    tokens = request.model_copy(update={"messages": [ChatMessage(role="user", content="")],
                                        "prompt_token_ids": [7, 8, 9]})
    assert prompt_ids(_on_shard(tokens), engine)[1] == [7, 8, 9]
    resumed = tokens.model_copy(update={"messages": continued(tokens, " a time")})
    assert prompt_ids(_on_shard(resumed), engine)[1] == [7, 8, 9, *engine.encode_text("a time")]

    for ids in ([1, -1], [1, 100]):  # a negative id killed a torch engine (an index error in its step)
        engine.vocab_size = 100  # type: ignore[attr-defined]
        with pytest.raises(InvalidRequest) as bad:
            prompt_ids(_on_shard(tokens.model_copy(update={"prompt_token_ids": ids})), engine)
        assert bad.value.param == "prompt"


def test_an_engine_without_prompt_logprobs_refuses_them() -> None:
    """The synthetic engine computes none: echo with logprobs is a 400 naming echo, not a reply without them."""
    request = ShardRequest(messages=[ChatMessage(role="user", content="once upon")], raw_prompt=True,
                           continue_final_message=True, add_generation_prompt=False, max_tokens=4, stream=True,
                           logprobs=True, top_logprobs=1, prompt_logprobs=1)
    req = _on_shard(request)
    with pytest.raises(InvalidRequest) as refused:
        generation_requests(req, SyntheticEngine(), "r", (), req.output_plan())
    assert refused.value.param == "echo"


def test_the_stream_is_reshaped_across_split_writes() -> None:
    shape = LegacyShape(["Hi"], 1, 1)
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    lp = {"content": [{"token": " there", "logprob": -0.5, "bytes": [], "top_logprobs": []}]}
    text = {**head, "choices": [{"index": 0, "delta": {"content": " there"}, "logprobs": lp, "finish_reason": None}]}
    end = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    raw = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in (role, text, end)) + b"data: [DONE]\n\n"
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        sent.append(message["body"])

    async def run() -> None:
        rewritten = shape.send(send)
        for i in range(0, len(raw), 17):
            await rewritten({"type": "http.response.body", "body": raw[i:i + 17], "more_body": i + 17 < len(raw)})

    asyncio.run(run())
    events = [e for e in b"".join(sent).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["Hi", " there", ""]
    assert chunks[0]["id"] == "cmpl-1" and {c["object"] for c in chunks} == {"text_completion"}
    assert chunks[1]["choices"][0]["logprobs"] == {"tokens": [" there"], "token_logprobs": [-0.5],
                                                   "top_logprobs": [{" there": -0.5}], "text_offset": [2]}
    assert chunks[2]["choices"][0]["finish_reason"] == "stop"


def test_the_prompts_logprobs_go_on_the_first_chunk_that_can_carry_them() -> None:
    """Echo with logprobs: the prompt's entries (offsets from 0, the first null) before the output's; when they
    reach the gateway after the choice opened, on its next chunk. With echo_only (max_tokens 0) the generated
    token is left out: its text, its entry, its usage."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    lp = {"content": [{"token": " there", "logprob": -0.5, "bytes": [], "top_logprobs": []}]}
    text = {**head, "choices": [{"index": 0, "delta": {"content": " there"}, "logprobs": lp, "finish_reason": None}]}
    prompt = ({"token": "H", "logprob": None, "bytes": [], "top_logprobs": []},
              {"token": "i", "logprob": -2.0, "bytes": [], "top_logprobs": [{"token": "o", "logprob": -1.0}]})
    found: dict[int, tuple[Any, ...]] = {}
    shape = LegacyShape(["Hi"], 1, 1, found)
    assert shape.chunk(role)["choices"][0] == {"index": 0, "text": "Hi", "logprobs": None, "finish_reason": None}
    found[0] = prompt
    assert shape.chunk(text)["choices"][0]["logprobs"] == {
        "tokens": ["H", "i", " there"], "token_logprobs": [None, -2.0, -0.5],
        "top_logprobs": [None, {"o": -1.0, "i": -2.0}, {" there": -0.5}], "text_offset": [0, 1, 2]}
    only = LegacyShape(["Hi"], 1, 1, {0: prompt}, echo_only=True)
    first = only.chunk(role)["choices"][0]
    assert first["text"] == "Hi" and first["logprobs"]["token_logprobs"] == [None, -2.0]
    assert only.chunk(text) is None
    done = {**head, "choices": [{"index": 0, "message": {"content": " there"}, "logprobs": lp,
                                 "finish_reason": "stop"}], "usage": {"prompt_tokens": 2, "completion_tokens": 1,
                                                                      "total_tokens": 3}}
    body = LegacyShape(["Hi"], 1, 1, {0: prompt}, echo_only=True).body(done)
    assert body["choices"][0]["text"] == "Hi" and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["logprobs"]["tokens"] == ["H", "i"]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}


class _Source:
    member: Any = None

    def __init__(self, batches: list[list[Event]]) -> None:
        self._batches = batches
        self.closed = False

    async def batches(self) -> AsyncIterator[list[Event]]:
        for b in self._batches:
            yield b

    def close(self) -> None:
        self.closed = True


def test_several_prompts_streams_are_one_with_their_choices_indexed_per_prompt() -> None:
    a = _Source([[Delta("x", index=1)], [Finish("stop", index=1), UsageEvent(3, 1)]])
    b = _Source([[Delta("y", index=0), Finish("length", index=0)], [UsageEvent(4, 2, 1)]])
    merged = Prompts([a, b], 2)  # type: ignore[list-item]

    async def run() -> list[Event]:
        return [e async for batch in merged.batches() for e in batch]

    events = asyncio.run(run())
    assert sorted((type(e).__name__, getattr(e, "index", None)) for e in events if not isinstance(e, UsageEvent)) == [
        ("Delta", 1), ("Delta", 2), ("Finish", 1), ("Finish", 2)]
    assert events[-1] == UsageEvent(7, 3, 1)
    merged.close()
    assert a.closed and b.closed


def test_when_one_prompts_stream_fails_to_open_the_others_are_closed() -> None:
    opened = _Source([])

    async def ok() -> Any:
        return opened

    async def refused() -> Any:
        await asyncio.sleep(0.01)
        raise InvalidRequest("prompt token id 7 is out of vocabulary", param="prompt")

    with pytest.raises(InvalidRequest):
        asyncio.run(_open_all([ok(), refused()]))
    assert opened.closed, "the stream that opened was closed: its shard aborts, not generating for nobody"


def test_a_failed_prompt_stream_fails_the_whole_and_close_stops_every_reader() -> None:
    class Broken(_Source):
        async def batches(self) -> AsyncIterator[list[Event]]:
            yield [Delta("x")]
            raise InvalidRequest("the shard went away", param=None)

    class Endless(_Source):
        async def batches(self) -> AsyncIterator[list[Event]]:
            while True:
                await asyncio.sleep(0.01)
                yield [Delta("y")]

    async def run() -> Prompts:
        merged = Prompts([Broken([]), Endless([])], 1)  # type: ignore[list-item]
        with pytest.raises(InvalidRequest):
            async for _ in merged.batches():
                pass
        merged.close()
        await asyncio.sleep(0.05)
        assert all(t.done() for t in merged._pumps)
        return merged

    merged = asyncio.run(run())
    assert all(s.closed for s in merged.streams)  # type: ignore[attr-defined]


def test_several_prompts_pass_on_the_fingerprint_and_a_running_count_of_every_prompt() -> None:
    """A multi-prompt reply had system_fingerprint null (the merge dropped the shards' Fingerprint events), and a
    client that left before the final usage was billed the largest prompt's tokens, not every prompt's."""
    a = _Source([[Fingerprint("fp_a"), Delta("x", usage=(30, 1))], [Delta("y", usage=(30, 2))]])
    b = _Source([[Fingerprint("fp_a"), Delta("z", usage=(40, 1))]])
    merged = Prompts([a, b], 1)  # type: ignore[list-item]

    async def run() -> list[Event]:
        return [e async for batch in merged.batches() for e in batch]

    events = asyncio.run(run())
    assert [e.value for e in events if isinstance(e, Fingerprint)] == ["fp_a", "fp_a"]
    running = [e.usage for e in events if isinstance(e, Delta)]
    assert max(u[0] for u in running if u is not None) == 70
