"""Structured outputs and tools at their edges, found by building on them as an application does (the
openai SDK's `create`/`parse`/streams, the Responses API, raw HTTP to a shard): schemas past what the
grammar compiler takes. Real processes: the session's fp32 shard, a cache node and a gateway on loopback.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_structured_edges.py -q
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from data_plane.schema_rewrite import hoist
from tests.support.chat import assert_no_leak, refusal, sdk
from tests.support.cluster import KEYS, gateway_before
from tests.support.procs import CLUSTER_HEADERS, Service

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Give me the data."}]


@pytest.fixture(scope="module")
def gateway(fp32_shard: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with gateway_before(fp32_shard, tmp_path_factory.mktemp("structured-edges")) as gw:
        yield gw


def nested(objects: int) -> dict[str, Any]:
    """A schema of `objects` objects, each the one property of the next (2 JSON levels an object)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(objects):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
    return schema


def test_a_schema_nested_past_the_grammars_bound_is_a_400_not_a_500(gateway: Service, fp32_shard: Service) -> None:
    """A schema nested 320-480 objects deep (inside the body's own nesting bound) was a 500 from the
    gateway, or a 502 after the shard failed the same way: their recursive walks of the schema (closing
    objects, strict mode's check) ran out of Python's stack. The grammar compiler takes at most 124 levels
    (61 objects; 62 was already its 400, "recursion limit exceeded"). Now a 400 `grammar_too_large` naming
    where the schema is, from the gateway and from a shard asked directly, streamed or not; 61 objects are
    still served, 62 are the same 400."""
    client = sdk(gateway)
    deep = nested(400)
    asks: list[tuple[dict[str, Any], str]] = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "d", "strict": True, "schema": deep}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": nested(320)}}},
         "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}]},
         "tools.0.function.parameters"),
        ({"extra_body": {"structured_outputs": {"json": deep}}}, "structured_outputs")]
    for fields, param in asks:
        for stream in (False, True):
            body = refusal(lambda fields=fields, stream=stream: client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=5, stream=stream, **fields))
            assert (body["param"], body["code"]) == (param, "grammar_too_large"), body
            assert "at most 124" in body["message"], body
    body = refusal(lambda: client.responses.create(model=MODEL, input="Hi", max_output_tokens=5, text={
        "format": {"type": "json_schema", "name": "d", "schema": deep}}))
    assert (body["param"], body["code"]) == ("text.format", "grammar_too_large"), body
    shard = httpx.post(fp32_shard.url + "/v1/chat/completions", headers=CLUSTER_HEADERS, timeout=60, json={
        "model": MODEL, "messages": ASK, "max_tokens": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}})
    assert shard.status_code == 400 and shard.json()["error"]["code"] == "grammar_too_large", shard.text
    assert_no_leak(shard.text)
    def edge(objects: int) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": "d", "strict": True, "schema": nested(objects)}}

    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, response_format=edge(61))
    assert reply.choices[0].message.content.startswith('{"a":')
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                                          response_format=edge(62)))
    assert body["code"] == "grammar_too_large", body


def test_a_schema_sent_as_json_text_is_served_as_the_same_schema_sent_as_an_object(gateway: Service) -> None:
    """vLLM's `structured_outputs.json` takes a schema as an object or as its JSON text. The object was
    closed (an object listing `properties` takes no other keys, an unbounded integer gets JSON's portable
    range: docs/STRUCTURED.md) and depth-checked, the text went to the grammar as sent: its objects stayed
    open, and SmolLM2 answered `{"a": 1, "b": 2}` to a schema of `a` alone. Now the text is read as the
    object it spells: the same output either way, and the same 400 for one nested too deeply."""
    client = sdk(gateway)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"]}
    ask = [{"role": "user", "content": "Pick one. Reply in JSON."}]
    texts = [client.chat.completions.create(model=MODEL, messages=ask, max_tokens=12, temperature=0,
                                            extra_body={"structured_outputs": {"json": form}}
                                            ).choices[0].message.content
             for form in (schema, json.dumps(schema))]
    assert texts[0] == texts[1], texts
    assert set(json.loads(texts[1])) == {"a"}, texts
    body = refusal(lambda: client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=5, extra_body={"structured_outputs": {"json": json.dumps(nested(300))}}))
    assert (body["param"], body["code"]) == ("structured_outputs", "grammar_too_large"), body
    past_json = "[" * 5000 + "]" * 5000  # past json.loads' own recursion: a 400 invalid_grammar before
    body = refusal(lambda: client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=5, extra_body={"structured_outputs": {"json": past_json}}))
    assert (body["param"], body["code"]) == ("structured_outputs", "grammar_too_large"), body


def test_a_pointer_into_the_schema_itself_is_served_in_tool_parameters(gateway: Service) -> None:
    """A `$ref` to a place in the schema itself ("#/properties/a": zod-to-json-schema writes one for a
    schema used twice, so LangChain.js and the Vercel AI SDK send them) is served in a response_format, but
    in a tool's parameters, or in a response_format beside tools, it was a 400 "Pointer '/properties/a'
    does not exist": the schema is nested in the tool-call envelope, where the pointer named the
    envelope's own root. Now it points into the schema as sent, streamed or not."""
    client = sdk(gateway)
    twice = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}, "b": {"$ref": "#/properties/a"}},
             "required": ["a", "b"]}
    ask = [{"role": "user", "content": "Fill in a and b."}]
    kw: dict[str, Any] = {"model": MODEL, "messages": ask, "max_tokens": 40, "temperature": 0,
                          "tools": [{"type": "function", "function": {"name": "f", "parameters": twice}}],
                          "tool_choice": "required", "parallel_tool_calls": False}
    with client.chat.completions.stream(**kw) as stream:
        streamed = stream.get_final_completion()
    for reply in (client.chat.completions.create(**kw), streamed):
        (call,) = reply.choices[0].message.tool_calls
        assert set(json.loads(call.function.arguments)) == {"a", "b"}, call
    beside = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "ab", "schema": twice}},
        tools=[{"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {}}}}])
    assert beside.choices[0].finish_reason in ("stop", "tool_calls", "length"), beside  # served, not a 400


def test_a_definition_named_root_keeps_its_place_beside_a_pointer_into_the_schema() -> None:
    """The schema's own copy (where "#/..." pointers go once nested in a tool's envelope) was kept under
    `<prefix>root`, the name a definition of the schema's own called root moves to: the pointer then
    landed in that definition (a valid schema refused, or with "$ref": "#" a wrong grammar)."""
    defs: dict[str, Any] = {}
    schema = {"$defs": {"root": {"type": "integer"}}, "type": "object",
              "properties": {"a": {"type": "string"}, "b": {"$ref": "#/properties/a"}, "c": {"$ref": "#/$defs/root"},
                             "d": {"$ref": "#"}}}
    body = hoist(schema, "t0_", defs)
    whole = body["properties"]["b"]["$ref"].split("/")[2]
    assert defs[whole]["properties"]["a"] == {"type": "string"}, (body, defs)
    assert body["properties"]["d"]["$ref"] == f"#/$defs/{whole}"
    assert body["properties"]["c"]["$ref"] == "#/$defs/t0_root" and defs["t0_root"] == {"type": "integer"}


def test_replies_carry_refusal_null_where_openais_spec_requires_it(gateway: Service, fp32_shard: Service) -> None:
    """OpenAI's spec requires `refusal` (null when the model did not refuse) in a reply's message, and
    `content` and `refusal` in a choice's `logprobs` object, streamed or not; OpenAI always sends them. Both
    were left out (the openai SDK fills in None; a client generated from the spec, or one checking
    `"refusal" in message` before it reads the content, found them missing). Now present, from the gateway
    and from a shard asked directly, for text, a JSON-schema reply and a tool call."""
    asks: list[dict[str, Any]] = [
        {"logprobs": True},
        {"logprobs": True, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}}}],
         "tool_choice": "required"}]
    user = {"Authorization": f"Bearer {KEYS['plus']}"}
    for url, headers in ((gateway.url, user), (fp32_shard.url, CLUSTER_HEADERS)):
        for ask in asks:
            body = {"model": MODEL, "messages": ASK, "max_tokens": 20, "temperature": 0, **ask}
            reply = httpx.post(url + "/v1/chat/completions", headers=headers, json=body, timeout=60)
            choice = reply.json()["choices"][0]
            assert "refusal" in choice["message"] and choice["message"]["refusal"] is None, (url, ask, choice)
            if ask.get("logprobs"):
                assert choice["logprobs"]["refusal"] is None and choice["logprobs"]["content"], (url, ask, choice)
                with httpx.stream("POST", url + "/v1/chat/completions", headers=headers, timeout=60,
                                  json={**body, "stream": True}) as streamed:
                    chunks = [json.loads(line[6:]) for line in streamed.iter_lines()
                              if line.startswith("data: {")]
                scored = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0].get("logprobs")]
                assert scored and all(lp["refusal"] is None for lp in scored), (url, ask, scored)


def test_with_tool_choice_none_the_prompt_holds_the_tools_and_the_reply_calls_none(gateway: Service) -> None:
    """OpenAI's `tool_choice: "none"`: the model sees the tools but calls none (vLLM renders them into the chat
    template unless told --exclude-tools-when-tool-choice-none). The tools were left out of the prompt: the
    prompt tokens of a request with tools and tool_choice none equalled those of one without tools. Now the
    prompt holds them (more prompt tokens, the same count streamed), and the reply is text, never a call."""
    client = sdk(gateway)
    tools: list[Any] = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                                          "parameters": {"type": "object", "properties": {
                                                              "city": {"type": "string"}}, "required": ["city"]}}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw: dict[str, Any] = {"model": MODEL, "messages": ask, "max_tokens": 30, "temperature": 0}
    bare = client.chat.completions.create(**kw)
    withheld = client.chat.completions.create(**kw, tools=tools, tool_choice="none")
    assert bare.usage and withheld.usage and withheld.usage.prompt_tokens > bare.usage.prompt_tokens + 20
    reply = withheld.choices[0]
    assert not reply.message.tool_calls and reply.finish_reason in ("stop", "length") and reply.message.content
    assert not reply.message.content.lstrip().startswith("{"), reply.message.content
    chunks = list(client.chat.completions.create(**kw, tools=tools, tool_choice="none", stream=True,
                                                 stream_options={"include_usage": True}))
    assert not [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.message.content
    assert chunks[-1].usage and chunks[-1].usage.prompt_tokens == withheld.usage.prompt_tokens


def test_finish_reason_at_the_token_limit_is_length_unless_the_reply_stopped_within_it(fp32_shard: Service) -> None:
    """OpenAI: `length` when max_tokens was reached, `stop` at a natural stop point or a stop sequence; vLLM's
    check_stop tests EOS and stop tokens before the limit. A reply that ends (EOS) within the limit is `stop`;
    one exactly as long as the limit is `length` (EOS was never sampled: vLLM says the same), JSON that
    closed on the last allowed token too; a stop string completed by the last allowed token is `stop`."""
    def ask(max_tokens: int, **kw: Any) -> tuple[str, int, str]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello in three words."}],
                "temperature": 0, "max_tokens": max_tokens, **kw}
        reply = httpx.post(fp32_shard.url + "/v1/chat/completions", headers=CLUSTER_HEADERS, json=body,
                           timeout=120).json()
        choice = reply["choices"][0]
        return choice["finish_reason"], reply["usage"]["completion_tokens"], choice["message"]["content"]

    schema = {"type": "json_schema", "json_schema": {"name": "g", "schema": {
        "type": "object", "properties": {"greeting": {"type": "string", "maxLength": 20}}, "required": ["greeting"]}}}
    for kw in ({}, {"response_format": schema}):
        reason, k, text = ask(100, **kw)
        assert reason == "stop" and k > 3, (kw, reason, k, text)
        assert ask(k + 1, **kw) == ("stop", k, text)
        assert ask(k, **kw) == ("length", k, text)  # all of it, but the limit came before EOS
        assert ask(k - 1, **kw)[0] == "length"
    first = httpx.post(fp32_shard.url + "/v1/chat/completions", headers=CLUSTER_HEADERS, timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Say hello in three words."}], "temperature": 0,
        "max_tokens": 3, "logprobs": True}).json()["choices"][0]["logprobs"]["content"]
    before, third = "".join(t["token"] for t in first[:2]), first[2]["token"]
    if third not in before + third[:-1]:  # (else the stop string would end the reply before its last token)
        assert ask(3, stop=[third]) == ("stop", 3, before)  # completed by the last allowed token: stop
