"""OpenAI's deprecated function calling (`functions`, `function_call`, `role: "function"` messages) through the
gateway with the openai SDK, as OpenAI still serves it: every one of these was a 400 (data_plane/legacy_functions.py).
Real processes: the session's fp32 shard, a cache node and a gateway.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_chat_legacy_functions.py -q
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.support.chat import sdk
from tests.support.cluster import gateway_before
from tests.support.procs import Service

MODEL = "SmolLM2-135M-Instruct"
GET_WEATHER = {"name": "get_weather", "description": "The weather in a city now.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
CALLED = {"role": "assistant", "content": None,
          "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
RESULT = {"role": "function", "name": "get_weather", "content": "Sunny, 24 C"}


@pytest.fixture(scope="module")
def gateway(fp32_shard: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with gateway_before(fp32_shard, tmp_path_factory.mktemp("legacy-functions")) as gw:
        yield gw


def test_a_function_result_in_the_history_is_served(gateway: Service) -> None:
    """A history in the legacy form (an assistant `function_call`, then the `function` message with its result)
    was a 400 ("messages.2.role: Input should be 'system', ..."): OpenAI serves it, with or without `functions`,
    streamed or not. An unanswered legacy call is no 400 either (OpenAI never asked for one), and a function
    message that answers no call in sight is served as its result's text."""
    client = sdk(gateway)
    history = [ASK, CALLED, RESULT]
    for extra in ({}, {"functions": [GET_WEATHER], "function_call": "none"}):
        reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0, **extra)
        assert reply.choices[0].message.content, reply
        assert reply.choices[0].message.function_call is None and reply.choices[0].finish_reason == "length"
    # function_call "auto" (the default with functions): this model calls again, in the legacy shape
    again = client.chat.completions.create(model=MODEL, messages=history, max_tokens=40, temperature=0,
                                           functions=[GET_WEATHER]).choices[0]
    assert again.finish_reason == "function_call" and again.message.function_call is not None, again
    assert again.message.function_call.name == "get_weather" and again.message.tool_calls is None
    pieces = [c.choices[0] for c in client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=40, temperature=0, functions=[GET_WEATHER], stream=True) if c.choices]
    assert pieces[-1].finish_reason == "function_call" and all(p.delta.tool_calls is None for p in pieces), pieces
    assert "".join(p.delta.function_call.arguments for p in pieces if p.delta.function_call) == \
        again.message.function_call.arguments
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == client.chat.completions.create(model=MODEL, messages=history, max_tokens=8,
                                                      temperature=0).choices[0].message.content
    for odd in ([ASK, CALLED, {"role": "user", "content": "Never mind."}],        # the call left unanswered
                [ASK, {**RESULT, "content": None}],                              # a result of no call, content null
                [ASK, CALLED, RESULT, {"role": "assistant", "content": "Sunny."}, ASK, CALLED, RESULT]):
        assert client.chat.completions.create(model=MODEL, messages=odd, max_tokens=4).choices[0].message


def test_functions_get_a_function_call_reply(gateway: Service) -> None:
    """`functions` with `function_call` naming one was a 400 ("Unsupported parameter: 'functions'"): the reply is
    OpenAI's legacy shape, `message.function_call` and no `tool_calls` (`finish_reason` "stop" for a forced
    call, "function_call" for one the model chose); streamed as `delta.function_call` pieces, the name first. The current form (`tools`) still gets tool calls."""
    client = sdk(gateway)
    args: dict[str, Any] = {"model": MODEL, "messages": [ASK], "max_tokens": 40, "temperature": 0,
                            "functions": [GET_WEATHER], "function_call": {"name": "get_weather"}}
    reply = client.chat.completions.create(**args)
    message, finish = reply.choices[0].message, reply.choices[0].finish_reason
    assert message.tool_calls is None and message.function_call is not None, message
    assert message.function_call.name == "get_weather" and finish == "stop", reply  # forced: "stop", as OpenAI's
    assert set(json.loads(message.function_call.arguments)) == {"city"}, message.function_call
    pieces = [c.choices[0] for c in client.chat.completions.create(**args, stream=True) if c.choices]
    assert all(p.delta.tool_calls is None for p in pieces), pieces
    calls = [p.delta.function_call for p in pieces if p.delta.function_call is not None]
    assert calls[0].name == "get_weather" and all(c.name is None for c in calls[1:]), calls
    assert pieces[0].delta.role == "assistant" and pieces[0].delta.content is None, pieces[0]
    assert "".join(c.arguments or "" for c in calls) == message.function_call.arguments
    assert pieces[-1].finish_reason == "stop"
    tools = client.chat.completions.create(model=MODEL, messages=[ASK], max_tokens=40, temperature=0,
                                           tools=[{"type": "function", "function": GET_WEATHER}],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert tools.choices[0].message.tool_calls and tools.choices[0].message.function_call is None
    # the whole legacy loop: the reply's call and its result sent back, the model answers in words
    follow = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, functions=[GET_WEATHER],
                                            function_call="none",
                                            messages=[ASK, message.model_dump(exclude_none=True), RESULT])
    assert follow.choices[0].message.content and follow.choices[0].message.function_call is None


@pytest.mark.parametrize(("extra", "param"), [
    ({"function_call": "auto"}, "function_call"),
    ({"function_call": {"name": "get_weather"}}, "function_call"),
    ({"functions": [GET_WEATHER], "tools": [{"type": "function", "function": GET_WEATHER}]}, "functions"),
    ({"functions": [GET_WEATHER], "function_call": {"name": "get_time"}}, "function_call"),
    ({"functions": [{**GET_WEATHER, "name": "get weather!"}]}, "functions.0.name"),
    ({"functions": [{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}}}]},
     "functions.0.parameters"),
    ({"functions": [{"description": "no name"}]}, "functions.0.name"),
    ({"messages": [{**ASK, "function_call": {"name": "get_weather", "arguments": "{}"}}]}, "messages.0.function_call"),
], ids=["choice-without-functions", "named-without-functions", "functions-and-tools", "unknown-name",
        "invalid-name", "invalid-schema", "no-name", "user-message-with-a-call"])
def test_legacy_fields_that_cannot_be_served_are_400s(gateway: Service, extra: dict[str, Any], param: str) -> None:
    """A 400 of a legacy request names its fields: an unknown or invalid function name said `tool_choice` and
    `tools.0.function.name`, fields of the form the body did not use (data_plane/legacy_functions.check_supported)."""
    with pytest.raises(openai.BadRequestError) as bad:
        sdk(gateway).chat.completions.create(**{"model": MODEL, "messages": [ASK], "max_tokens": 4, **extra})
    body: dict[str, Any] = bad.value.body  # type: ignore[assignment]
    assert body["param"] == param and body["type"] == "invalid_request_error", body
    # named as the body named it: the checks' own terms (tools.0.function.name, tool_choice) were never sent
    assert "tool" not in body["message"] or "tools" in extra, body


def test_a_stored_completion_keeps_the_legacy_messages_as_sent(gateway: Service) -> None:
    """`store: true` kept the messages as the gateway rewrote them: `messages.list` gave the assistant's
    `function_call` back as `tool_calls` with an id the client never sent, the function message as role "tool",
    and a function result of no call as a *user* message "The tool lookup returned: ..." (OpenAI keeps them as sent)."""
    client = sdk(gateway)
    orphan = {"role": "function", "name": "lookup", "content": "42"}
    sent: list[dict[str, Any]] = [ASK, CALLED, RESULT, orphan]
    reply = client.chat.completions.create(model=MODEL, messages=sent, max_tokens=2, store=True, functions=[GET_WEATHER])
    stored = [m.model_dump(exclude_none=True) for m in client.chat.completions.messages.list(reply.id)]
    kept = [{k: v for k, v in m.items() if k in ("role", "content", "name", "function_call", "tool_calls")}
            for m in stored]
    assert kept == [{k: v for k, v in m.items() if v is not None} for m in sent], stored


def test_a_sessions_legacy_call_need_not_be_answered(gateway: Service) -> None:
    """A session whose last turn was a legacy `function_call` reply, continued with a user message (the app
    dropped the call), was a 400 "An assistant message with 'tool_calls' must be followed by tool messages ...
    with the tool_call_id the reply gave it" (the legacy reply gave none), though the same history sent whole is
    served: OpenAI never asked for a function call's result. A function message answers it, as before."""
    client = sdk(gateway)
    args: dict[str, Any] = {"model": MODEL, "max_tokens": 40, "temperature": 0, "functions": [GET_WEATHER]}
    for follow in ({"role": "user", "content": "Never mind, tell me a joke."}, RESULT):
        first = client.chat.completions.with_raw_response.create(
            **args, messages=[ASK], function_call={"name": "get_weather"}, extra_headers={"X-Session-Id": "new"})
        assert first.parse().choices[0].message.function_call is not None
        session = first.headers["x-session-id"]
        again = client.chat.completions.create(**args, messages=[follow], function_call="none",
                                               extra_headers={"X-Session-Id": session}).choices[0]
        assert again.message.content and again.message.function_call is None, again
