"""The openai SDK's higher-level helpers against a real gateway and the real model, as an app developer
calls them from the SDK's docs: `chat.completions.stream()` with `n` > 1 and with logprobs. Where they
broke, the server was at fault; each test names what the helper met. What `test_clients_compat.py` and
`test_structured_api.py` cover already is not repeated here.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_sdk_helpers.py -q

Real processes: the session's fp32 shard (the batch-invariant format: a seeded reply is the same bits on
every run), a cache node and a gateway on loopback.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.chat import sdk
from tests.support.cluster import KEYS, gateway_before
from tests.support.procs import CLUSTER_HEADERS, Service

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def gateway(fp32_shard: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with gateway_before(fp32_shard, tmp_path_factory.mktemp("sdk-helpers")) as gw:
        yield gw


def _sse(url: str, headers: dict[str, str], body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]


def test_n_choices_open_in_index_order_so_the_stream_helper_assembles_each(gateway: Service,
                                                                            fp32_shard: Service) -> None:
    """With `n` > 1 a choice opened at its first released delta: one whose start a stop string's prefix
    held back (or that released nothing until its end) opened after a higher one, and the stream went out
    as choices 1, 0, 2 or 2, 0, 1. The SDK's stream helper keeps choices in a list read by `index`: it
    raised IndexError ("list index out of range") on such a stream, or appended a choice's text to another.
    Seeds that gave those orders on this shard (10 in 30 did); now every choice opens in index order, on the
    gateway and on a shard served directly, and the helper's final completion holds each choice's text."""
    ask = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6, "n": 3,
           "temperature": 1.3, "stop": ["Hello", "Hi", "H", "S"]}
    user = {"Authorization": f"Bearer {KEYS['plus']}"}
    for seed in (8, 9, 11, 27):
        for url, headers in ((gateway.url, user), (fp32_shard.url, CLUSTER_HEADERS)):
            chunks = _sse(url, headers, {"model": MODEL, "stream": True, "seed": seed, **ask})
            order: list[int] = []
            texts = {0: "", 1: "", 2: ""}
            for chunk in chunks:
                for choice in chunk["choices"]:
                    if choice["index"] not in order:
                        order.append(choice["index"])
                        assert choice["delta"]["role"] == "assistant", (seed, url, choice)
                    texts[choice["index"]] += choice["delta"].get("content") or ""
            assert order == [0, 1, 2], (seed, url, order)
        with sdk(gateway).chat.completions.stream(model=MODEL, seed=seed, **ask) as stream:
            done = [e.content for e in stream if e.type == "content.done"]
            final = stream.current_completion_snapshot  # get_final_completion() raises for a reply cut at 6
        assert [(c.index, c.message.content) for c in final.choices] == list(texts.items()), seed
        assert all(c.finish_reason in ("stop", "length") for c in final.choices)
        assert sorted(done) == sorted(t for t in texts.values() if t), seed  # the helper's events for text


def test_a_streamed_reply_of_no_text_has_the_logprobs_object_the_plain_one_has(gateway: Service) -> None:
    """Asked for logprobs, a reply without text (a stop string at its first token, tool calls) has
    `logprobs: {"content": [], "refusal": null}` (docs/STRUCTURED.md), but streamed no chunk carried any:
    the SDK's stream helper, which builds the final completion from the chunks, gave `logprobs` None, and
    `final.choices[0].logprobs.content` raised AttributeError where the same request unstreamed worked.
    Each choice now opens with its (empty) logprobs object, as OpenAI's streams do."""
    client = sdk(gateway)
    ask: Any = [{"role": "user", "content": "Say hi."}]
    first = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, temperature=0).choices[0]
    stop = (first.message.content or "?")[0]  # the greedy reply's first character: a reply of no text
    tool: Any = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}
    for ask_more in ({"stop": [stop]}, {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}):
        fields: Any = {"model": MODEL, "messages": ask, "max_tokens": 40, "temperature": 0, "logprobs": True,
                       **ask_more}
        plain = client.chat.completions.create(**fields).choices[0]
        with client.chat.completions.stream(**fields) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_completion().choices[0]
        assert not plain.message.content and final.message.content == plain.message.content, ask_more
        assert plain.logprobs is not None and plain.logprobs.content == [], ask_more
        assert final.logprobs is not None and final.logprobs.content == [], (ask_more, final.logprobs)
        assert "logprobs.content.done" in kinds, kinds
