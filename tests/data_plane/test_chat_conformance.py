"""Where Chat Completions answered differently from OpenAI's API, found by driving it as an application
does (the openai SDK, instructor, LangChain, raw SSE): strict schemas strict mode refuses, `usage: null`
on the chunks before the usage chunk, refusals worded for people. Real processes: the session's fp32
shard, a cache node and a gateway on loopback.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_chat_conformance.py -q
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.chat import refusal, sdk
from tests.support.cluster import KEYS, gateway_before
from tests.support.metrics import metric
from tests.support.procs import CLUSTER_HEADERS, Service
from tests.support.schemas import GetWeather, Person

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Invent a person. Give their name and age."}]
OPEN_PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"]}


@pytest.fixture(scope="module")
def gateway(fp32_shard: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with gateway_before(fp32_shard, tmp_path_factory.mktemp("chat-conformance")) as gw:
        yield gw


def strict_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}}


def test_a_strict_schema_strict_mode_refuses_is_a_400_as_openai_answers_it(gateway: Service) -> None:
    """`strict: true` with an object left open, or a property missing from `required`, was served (the
    grammar closed the object and let the property be left out); OpenAI refuses such a schema with a 400
    before generating, and an app tested here would fail there. Now the same 400: its code, its param
    and its words (with the path to the object), streamed or not, in Chat Completions and Responses."""
    client = sdk(gateway)
    for stream in (False, True):
        body = refusal(lambda stream=stream: client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=5, stream=stream, response_format=strict_format(OPEN_PERSON)))
        assert (body["code"], body["param"], body["type"]) == (
            "invalid_json_schema", "response_format", "invalid_request_error")
        assert body["message"] == ("Invalid schema for response_format 'person': In context=(), "
                                   "'additionalProperties' is required to be supplied and to be false.")
    optional_age = {**OPEN_PERSON, "additionalProperties": False, "required": ["name"]}
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                                          response_format=strict_format(optional_age)))
    assert body["message"].endswith("'required' is required to be supplied and to be an array including every "
                                    "key in properties. Missing 'age'.")
    nested = {"type": "object", "properties": {"people": {"type": "array", "items": OPEN_PERSON}},
              "required": ["people"], "additionalProperties": False}
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                                          response_format=strict_format(nested)))
    assert "In context=('properties', 'people', 'items'), 'additionalProperties'" in body["message"]
    tool: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, tools=[tool]))
    assert (body["code"], body["param"]) == ("invalid_function_parameters", "tools.0.function.parameters")
    assert body["message"].startswith("Invalid schema for function 'get_weather': In context=(), 'additionalProp")
    body = refusal(lambda: client.responses.create(model=MODEL, input="Hi", max_output_tokens=5, text={"format": {
        "type": "json_schema", "name": "person", "strict": True, "schema": OPEN_PERSON}}))
    assert (body["code"], body["param"]) == ("invalid_json_schema", "text.format")
    flat_tool = {"type": "function", **tool["function"]}
    body = refusal(lambda: client.responses.create(model=MODEL, input="Hi", max_output_tokens=5, tools=[flat_tool]))
    assert body["param"] == "tools[0].parameters"  # (OpenAI's notation on the Responses API)
    # not strict: served, the grammar closing the object (as before)
    loose = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": OPEN_PERSON}})
    assert loose.choices[0].message.content


class Team(BaseModel):
    """Nested models, an optional field, a list: `$defs`, `anyOf` with null, `items` in the strict schema."""

    lead: Person
    members: list[Person] = Field(max_length=1)
    motto: str | None = Field(default=None, max_length=12)


def test_strict_schemas_the_clients_build_are_served(gateway: Service) -> None:
    """What the clients send with strict mode on follows its rules, so the check must let all of it
    through: the openai SDK's `parse` (nested models, an optional field) and `pydantic_function_tool`,
    LangChain's `with_structured_output(strict=True)` (json_schema and function calling) and
    `bind_tools(strict=True)`."""
    from langchain_openai import ChatOpenAI

    client = sdk(gateway)
    team = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Invent a team."}],
                                         response_format=Team, max_tokens=120, temperature=0)
    assert team.choices[0].finish_reason in ("stop", "length")
    called = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                            tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
                                            max_tokens=40, temperature=0)
    assert called.choices[0].message.tool_calls
    llm = ChatOpenAI(base_url=gateway.url + "/v1", api_key=KEYS["plus"], model=MODEL, temperature=0,
                     max_tokens=60, max_retries=0)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method, strict=True).invoke(ASK[0]["content"])
        assert isinstance(person, Person), method
    msg = llm.bind_tools([GetWeather], strict=True, tool_choice="GetWeather").invoke("What is the weather in Paris?")
    assert msg.tool_calls and GetWeather.model_validate(msg.tool_calls[0]["args"])


def sse_chunks(url: str, headers: dict[str, str], body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    events = [block[len("data: "):] for block in text.split("\n\n") if block.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_usage_is_null_on_every_chunk_before_the_usage_chunk(gateway: Service, fp32_shard: Service) -> None:
    """With `stream_options.include_usage`, OpenAI's chunks carry `"usage": null` until the last, which
    has the usage and no choices; Switchboard left the key out (the openai SDK takes either; clients
    generated from the spec, where the field is nullable but not optional, read it). On the gateway (its
    content chunks are spliced bytes), for text, n=2 and tool calls, and on a shard served directly."""
    user = {"Authorization": f"Bearer {KEYS['plus']}"}
    asks: list[dict[str, Any]] = [{"max_tokens": 6},
            {"max_tokens": 4, "n": 2, "seed": 1, "temperature": 0.8},
            {"max_tokens": 30, "tools": [openai.pydantic_function_tool(GetWeather)], "tool_choice": "required",
             "messages": [{"role": "user", "content": "Weather in Paris?"}]}]
    for url, headers in ((gateway.url, user), (fp32_shard.url, CLUSTER_HEADERS)):
        for ask in asks:
            body = {"model": MODEL, "messages": ASK, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, **ask}
            chunks = sse_chunks(url, headers, body)
            *before, last = chunks
            assert last["choices"] == [] and last["usage"]["total_tokens"] > 0, (url, ask)
            assert before and all("usage" in c and c["usage"] is None for c in before), (url, ask, before)
            plain = sse_chunks(url, headers, {k: v for k, v in body.items() if k != "stream_options"})
            assert all("usage" not in c for c in plain), (url, ask)


def test_refusals_name_what_was_sent_in_plain_words(gateway: Service) -> None:
    """A schema or regex the grammar compiler refuses read "the tools is not valid", "the json_schema is
    not valid" (the constraint's label), and a refused structured_outputs constraint named
    response_format as its param."""
    client = sdk(gateway)
    bad_type = {"type": "object", "properties": {"x": {"type": "colour"}}}
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, tools=[
        {"type": "function", "function": {"name": "f", "parameters": bad_type}}]))
    assert body["param"] == "tools.0.function.parameters" and body["message"].startswith(
        "Invalid schema for function 'f': the JSON schema is not valid: "), body  # (named since: the next test)
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": bad_type}}))
    assert body["param"] == "response_format" and body["message"].startswith("the JSON schema is not valid: ")
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5,
                                                          extra_body={"structured_outputs": {"regex": "(("}}))
    assert body["param"] == "structured_outputs" and body["message"].startswith("the regex is not valid: ")


WEATHER = [{"role": "user", "content": "Weather in Paris?"}]


def test_a_streamed_tool_call_opens_with_content_null_as_openai_streams_it(gateway: Service,
                                                                           fp32_shard: Service) -> None:
    """Every stream opened with `{"role": "assistant", "content": ""}`; OpenAI opens a reply that is a tool
    call with one delta holding the role, `"content": null` and the call's name, so the openai SDK's stream
    helper assembled `content == ""` where the same reply unstreamed has `None`. Now as OpenAI: the gateway
    and a shard served directly, one choice or n=2 with include_usage; a text reply still opens with `""`.
    LangChain's streamed tool calls still merge into the call."""
    from langchain_openai import ChatOpenAI

    user = {"Authorization": f"Bearer {KEYS['plus']}"}
    tools = [openai.pydantic_function_tool(GetWeather)]
    for url, headers in ((gateway.url, user), (fp32_shard.url, CLUSTER_HEADERS)):
        for ask in ({}, {"n": 2, "seed": 1, "temperature": 0.8, "stream_options": {"include_usage": True}}):
            body = {"model": MODEL, "messages": WEATHER, "max_tokens": 30, "temperature": 0, "stream": True,
                    "tools": tools, "tool_choice": "required", **ask}
            deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"])
                      for c in sse_chunks(url, headers, body) if c["choices"]]
            for index in range(int(ask.get("n", 1))):
                first, *rest = [d for i, d in deltas if i == index]
                assert first["role"] == "assistant" and first["content"] is None, (url, ask, first)
                assert first["tool_calls"][0]["function"] == {"name": "GetWeather", "arguments": ""}, first
                assert not any("role" in d or "content" in d for d in rest), (url, ask, rest)
        text = sse_chunks(url, headers, {"model": MODEL, "messages": ASK, "max_tokens": 3, "stream": True})
        assert text[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}, (url, text[0])
    client = sdk(gateway)
    ask_call: dict[str, Any] = {"model": MODEL, "messages": WEATHER, "tools": tools, "tool_choice": "required",
                                "parallel_tool_calls": False, "max_tokens": 60, "temperature": 0}
    with client.chat.completions.stream(**ask_call) as stream:
        streamed = stream.get_final_completion().choices[0].message
    whole = client.chat.completions.create(**ask_call).choices[0].message
    assert streamed.content is None and whole.content is None
    assert streamed.tool_calls and isinstance(streamed.tool_calls[0].function.parsed_arguments, GetWeather)
    llm = ChatOpenAI(base_url=gateway.url + "/v1", api_key=KEYS["plus"], model=MODEL, temperature=0,
                     max_tokens=60, max_retries=0).bind_tools([GetWeather], tool_choice="required",
                                                              parallel_tool_calls=False)
    merged: Any = None
    for chunk in llm.stream("What is the weather in Paris?"):
        merged = chunk if merged is None else merged + chunk
    assert merged.tool_calls and merged.tool_calls[0]["name"] == "GetWeather", merged
    assert GetWeather.model_validate(merged.tool_calls[0]["args"])


def _function(name: str = "get_weather", parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}}}}


PATTERN = "Expected a string that matches the pattern '^[a-zA-Z0-9_-]+$'."
STRICT_ANY_OF = {"name": "person", "strict": True, "schema": {"anyOf": [
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"], "additionalProperties": False}]}}


@pytest.mark.parametrize("fields,param,code,message", [
    ({"tools": []}, None, "invalid_value", "[] is too short - 'tools'"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "invalid_value",
     "Invalid value for 'parallel_tool_calls': 'parallel_tool_calls' is only allowed when 'tools' are specified."),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": OPEN_PERSON}}},
     "response_format.json_schema.name", "missing_required_parameter",
     "Missing required parameter: 'response_format.json_schema.name'."),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a person", "schema": OPEN_PERSON}}},
     "response_format.json_schema.name", "invalid_value",
     f"Invalid 'response_format.json_schema.name': string does not match pattern. {PATTERN}"),
    ({"tools": [_function("weather.get")]}, "tools.0.function.name", "invalid_value",
     f"Invalid 'tools.0.function.name': string does not match pattern. {PATTERN}"),
    ({"tools": [_function("get_weather\n")]}, "tools.0.function.name", "invalid_value",  # `$` would pass it
     f"Invalid 'tools.0.function.name': string does not match pattern. {PATTERN}"),
    ({"tools": [_function(), _function("w" * 65)]}, "tools.1.function.name", "string_above_max_length",
     ("Invalid 'tools.1.function.name': string too long. Expected a string with maximum length 64, but got a "
      "string with length 65 instead.")),
    ({"tools": [_function(parameters={"type": "array", "items": {"type": "string"}})]},
     "tools.0.function.parameters", "invalid_function_parameters",
     """Invalid schema for function 'get_weather': schema must be a JSON Schema of 'type: "object"', got 'type: "array"'."""),
    ({"response_format": {"type": "json_schema", "json_schema": STRICT_ANY_OF}}, "response_format",
     "invalid_json_schema",
     """Invalid schema for response_format 'person': schema must be a JSON Schema of 'type: "object"', got 'type: "None"'."""),
])
def test_tools_and_formats_openai_refuses_are_a_400_as_openai_answers_them(gateway: Service, fields: dict[str, Any],
                                                                           param: str | None, code: str,
                                                                           message: str) -> None:
    """Served though OpenAI refuses them (an app tested here would fail there): `"tools": []`,
    parallel_tool_calls without tools, a json_schema format without a name or with one OpenAI's pattern
    refuses, a function name with a dot or over 64 characters (the pattern allowed `.` and `:`), a
    function's parameters not an object's schema, a strict schema whose root is an `anyOf`. Now OpenAI's
    400, its param (in the chat path's dotted form) and its words, streamed or not."""
    client = sdk(gateway)
    for stream in (False, True):
        body = refusal(lambda stream=stream: client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=5, stream=stream, **fields))
        assert (body["param"], body["code"], body["message"]) == (param, code, message)


def test_names_and_schemas_openai_takes_are_still_served(gateway: Service) -> None:
    """The other side of the checks above: names with `_` and `-`, a function without parameters or with
    `{}`, a non-strict format whose root is an `anyOf`; and a Responses tool named with a dot is refused
    naming the Responses field."""
    client = sdk(gateway)
    tools = [_function("get-weather_2"), {"type": "function", "function": {"name": "now"}},
             {"type": "function", "function": {"name": "today", "parameters": {}}}]
    reply = client.chat.completions.create(model=MODEL, messages=WEATHER, max_tokens=30, temperature=0, tools=tools,
                                           tool_choice="required", parallel_tool_calls=False)
    assert reply.choices[0].message.tool_calls
    loose = {**STRICT_ANY_OF, "strict": False, "name": "a-or_b"}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0,
                                           response_format={"type": "json_schema", "json_schema": loose})
    assert reply.choices[0].message.content
    body = refusal(lambda: client.responses.create(model=MODEL, input="Hi", max_output_tokens=5, tools=[
        {"type": "function", "name": "weather.get", "parameters": {"type": "object", "properties": {}}}]))
    assert (body["param"], body["message"]) == (
        "tools[0].name", f"Invalid 'tools[0].name': string does not match pattern. {PATTERN}")


def test_a_tool_schema_the_grammar_refuses_is_named_in_the_clients_terms(gateway: Service) -> None:
    """A tool whose parameters no value satisfies (a required property's minimum above its maximum), when
    it is the only one that may be called, was a 400 about our tool-call envelope ("required property
    'tool_calls' is unsatisfiable"), a schema the client never sent. Now the 400 names the function and
    where its parameters are (the Responses field when asked there). (Beside another tool that may be
    called, the envelope is satisfiable and served: that one is called.)"""
    client = sdk(gateway)
    impossible = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
                  "required": ["a"]}
    tools = [_function(), _function("pick", impossible)]
    for stream in (False, True):
        body = refusal(lambda stream=stream: client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=5, stream=stream, tools=tools,
            tool_choice={"type": "function", "function": {"name": "pick"}}))
        assert (body["param"], body["code"]) == ("tools.1.function.parameters", "invalid_grammar"), body
        assert body["message"] == ("Invalid schema for function 'pick': the JSON schema is not valid: Unsatisfiable "
                                   "schema: required property 'a' is unsatisfiable"), body
    flat = [{"type": "function", **t["function"]} for t in tools]
    body = refusal(lambda: client.responses.create(model=MODEL, input="Hi", max_output_tokens=5, tools=flat[1:],
                                                   tool_choice="required"))
    assert body["param"] == "tools[0].parameters" and "'pick'" in body["message"], body
    # the property not required: `{}` satisfies the schema, and is served
    optional = {k: v for k, v in impossible.items() if k != "required"}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0,
                                           tools=[_function("pick", optional)], tool_choice="required")
    assert reply.choices[0].message.tool_calls


def test_a_content_part_refused_is_named_with_its_message_and_part(gateway: Service) -> None:
    """An image part (or a text part with a key too many) was a 400 naming `messages.content`: which
    message, which part? Now its path, as the request's other checks name theirs (`messages.<i>...`)."""
    client = sdk(gateway)
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    messages: list[Any] = [{"role": "user", "content": [image]}]
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5))
    assert (body["param"], body["code"]) == ("messages.0.content.0", "unsupported_parameter"), body
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Look:"}, image]}]
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5))
    assert body["param"] == "messages.1.content.1", body


HELLO = [{"role": "user", "content": "Say hello."}]


def test_a_logit_bias_key_in_other_digits_is_a_400_not_a_server_error(gateway: Service) -> None:
    """A logit_bias key of Unicode digits passed the key check (`str.isdigit()`): "²" was then a 500 on the
    shard (int() refuses it) and a 502 to the client, "٥" was read as token 5. Now both are the 400 any key
    that is not a token id gets, in OpenAI's words (an id past the vocabulary too); a token id in ASCII digits
    still biases (100 forces the token)."""
    client = sdk(gateway)
    for key in ("²", "٥"):
        body = refusal(lambda key=key: client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                                                      logit_bias={key: 1}))
        said = f"Invalid key in 'logit_bias': {key}. You should only be submitting non-negative integers."
        assert (body["param"], body["message"]) == ("logit_bias", said), body
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                                          logit_bias={"99999999": 1}))  # the shard's check
    assert body["message"] == "Invalid key in 'logit_bias': 99999999. Maximum value is 49151.", body
    forced = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0,
                                            logit_bias={"28": 100})
    assert forced.choices[0].message.content == ",,,"


def test_top_p_0_stream_null_and_service_tier_are_read_as_openai_reads_them(gateway: Service) -> None:
    """OpenAI's spec takes `top_p` in 0..1 and `stream: null`: both were a 400 here (top_p must be > 0, stream a
    boolean). top_p 0 keeps the one most likely token (greedy, whatever the temperature; the gateway sends a
    shard top_k 1, as vLLM refuses top_p 0), in Responses too; a null stream is a JSON reply. And a
    `service_tier` OpenAI does not have was served in chat (Responses refused it): now a 400 naming it."""
    client = sdk(gateway)
    greedy = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0)
    for temperature in (None, 2.0):
        nucleus = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, top_p=0,
                                                 temperature=temperature)
        assert nucleus.choices[0].message.content == greedy.choices[0].message.content, temperature
    reply = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=6, top_p=0, temperature=2)
    assert reply.output_text == greedy.choices[0].message.content and reply.top_p == 0
    r = httpx.post(gateway.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['plus']}"},
                   json={"model": MODEL, "messages": HELLO, "max_tokens": 2, "stream": None}, timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2,
                                                          extra_body={"service_tier": "gold"}))
    assert body["param"] == "service_tier"
    assert client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, service_tier="flex").choices



def test_vllm_top_k_minus_1_means_every_token(gateway: Service, fp32_shard: Service) -> None:
    """vLLM takes `top_k` 0 or -1 for "every token", and clients written for it send -1: a 400 here (top_k
    had to be >= 0). Now -1 is every token (0 for the sampler, which would take -1 to torch.topk): the
    seeded reply is the one without top_k, through the gateway and on a shard served directly."""
    client = sdk(gateway)
    ask: dict[str, Any] = {"model": MODEL, "messages": HELLO, "max_tokens": 8, "temperature": 0.9, "seed": 5}
    free = client.chat.completions.create(**ask).choices[0].message.content
    assert client.chat.completions.create(**ask, extra_body={"top_k": -1}).choices[0].message.content == free
    r = httpx.post(fp32_shard.url + "/v1/chat/completions", headers=CLUSTER_HEADERS, json={**ask, "top_k": -1},
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == free, r.text

SAY_JSON = "'messages' must contain the word 'json' in some form, to use 'response_format' of type 'json_object'."
SAY_JSON_IN_INPUT = ("Response input messages must contain the word 'json' in some form to use 'text.format' of type "
                     "'json_object'.")


def test_json_mode_without_the_word_json_is_refused_as_openai_refuses_it(gateway: Service) -> None:
    """`response_format: json_object` needs the word "json" in the messages on OpenAI (a 400 otherwise), and
    here it was served: an app tested here failed there, and the model, never told to write JSON, answered
    `{}`. Now OpenAI's 400 (its words and param), streamed or not; any message may say it (a system one, in any
    case); a session's later turns are served (its transcript holds the earlier ones). The Responses API: the
    input must say it, the instructions do not count (param text.format)."""
    client = sdk(gateway)
    fmt: dict[str, Any] = {"type": "json_object"}
    for stream in (False, True):
        body = refusal(lambda stream=stream: client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=5, stream=stream, response_format=fmt))
        assert (body["param"], body["message"]) == ("messages", SAY_JSON), body
    said = [{"role": "system", "content": "Answer in JSON."}, *HELLO]
    reply = client.chat.completions.create(model=MODEL, messages=said, max_tokens=20, temperature=0, response_format=fmt)
    assert reply.choices[0].message.content.startswith("{")
    opened = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=said, max_tokens=5, response_format=fmt, extra_headers={"X-Session-Id": "new"})
    later = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, response_format=fmt,
                                           extra_headers={"X-Session-Id": opened.headers["x-session-id"]})
    assert later.choices[0].message.content.startswith("{")
    body = refusal(lambda: client.responses.create(model=MODEL, input="Say hello.", instructions="Answer in JSON.",
                                                   max_output_tokens=5, text={"format": fmt}))
    assert (body["param"], body["message"]) == ("text.format", SAY_JSON_IN_INPUT)
    assert client.responses.create(model=MODEL, input="Say hello in json.", max_output_tokens=5,
                                   text={"format": fmt}).output_text.startswith("{")


def test_a_prompt_that_fits_the_context_is_served_without_max_tokens(gateway: Service) -> None:
    """Without max_tokens the gateway keeps 256 tokens for the reply while it fits the window, and a message
    that fit the 2048-token context but not beside those 256 was a 400 "lower max_tokens" (none was sent);
    OpenAI and vLLM serve it, the reply getting the room left. Now served so: a reply that ends at `length`
    within the context. With a max_tokens that leaves no room, still the 400."""
    client = sdk(gateway)
    long = [{"role": "user", "content": "word " * 1900 + "\nSay hello."}]
    reply = client.chat.completions.create(model=MODEL, messages=long, temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens > 0, reply
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= 2048, reply.usage
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=long, max_tokens=300))
    assert body["code"] == "context_length_exceeded"


def test_an_unserved_route_is_a_404_naming_it_as_openai_does(gateway: Service, fp32_shard: Service) -> None:
    """A route this server does not serve (embeddings, the legacy edits, a typo) answered 404 "Not
    Found", which told a client nothing; OpenAI answers "Invalid URL (POST /v1/embeddings)". Now those words,
    on the gateway and a shard alike; the SDK raises NotFoundError. An unknown model id stays model_not_found."""
    client = sdk(gateway)
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model=MODEL, input="hi")
    assert info.value.body["message"] == "Invalid URL (POST /v1/embeddings)", info.value.body
    for url in (gateway.url, fp32_shard.url):
        for method, path in (("POST", "/v1/edits"), ("GET", "/v1/nope")):  # (/v1/completions: test_completions_api.py)
            r = httpx.request(method, url + path, headers={"Authorization": f"Bearer {KEYS['plus']}"})
            assert r.status_code == 404 and r.json()["error"]["message"] == f"Invalid URL ({method} {path})", r.text
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert (info.value.body["code"], info.value.body["param"]) == ("model_not_found", "model")


@pytest.mark.parametrize("fields,param,code,said", [
    ({"temperature": 2.5}, "temperature", "decimal_above_max_value",
     "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 2.5 instead."),
    ({"frequency_penalty": -3}, "frequency_penalty", "decimal_below_min_value",
     "Invalid 'frequency_penalty': decimal below minimum value. Expected a value >= -2, but got -3 instead."),
    ({"n": 0}, "n", "integer_below_min_value",
     "Invalid 'n': integer below minimum value. Expected a value >= 1, but got 0 instead."),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "integer_above_max_value",
     "Invalid 'top_logprobs': integer above maximum value. Expected a value <= 20, but got 21 instead."),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "integer_below_min_value",
     "Invalid 'max_completion_tokens': integer below minimum value. Expected a value >= 1, but got 0 instead."),
    ({"messages": []}, "messages", "empty_array",
     "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead."),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "array_above_max_length",
     ("Invalid 'stop': array too long. Expected an array with maximum length 4, but got an array with length 5 "
     "instead.")),
    ({"user": "u" * 300}, "user", "string_above_max_length",
     ("Invalid 'user': string too long. Expected a string with maximum length 256, but got a string with length 300 "
     "instead.")),
    ({"temperature": "hot"}, "temperature", "invalid_type",
     "Invalid type for 'temperature': expected a decimal, but got a string instead."),
    ({"stop": 5}, "stop", "invalid_type",
     "Invalid type for 'stop': expected one of a string or an array, but got an integer instead."),
    ({"service_tier": "gold"}, "service_tier", "invalid_value",
     "Invalid value: 'gold'. Supported values are: 'auto', 'default', 'flex', 'scale', 'priority', and 'fast'."),
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value",
     "Invalid value: 'xml'. Supported values are: 'text', 'json_object', and 'json_schema'."),
])
def test_a_value_out_of_its_range_is_worded_as_openai_words_it(gateway: Service, fields: dict[str, Any], param: str,
                                                                code: str, said: str) -> None:
    """A number out of its range, an empty messages list, a fifth stop sequence, a string too long read
    "temperature: Input should be less than or equal to 2" (pydantic's words; "at most 4 stop sequences") with
    code invalid_value, a value not among a field's "service_tier: Input should be 'auto', ... or 'priority'";
    OpenAI says "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got 2.5
    instead." with its own code, and "Invalid value: 'gold'. Supported values are: ..., and 'fast'."
    (request_checks.openai_words); a value of the wrong type "temperature: Input should be a valid number",
    where OpenAI says "Invalid type for 'temperature': expected a decimal, but got a string instead."
    (invalid_type). Now those, the Responses API's fields too."""
    client = sdk(gateway)
    counted = metric(gateway.url, "switchboard_gateway_requests_total", code="invalid_value")
    body = refusal(lambda: client.chat.completions.create(**{"model": MODEL, "messages": HELLO, **fields}))
    assert (body["param"], body["code"], body["message"]) == (param, code, said)
    # the request counter's bounded label: still invalid_value (an unknown code would be "other")
    assert metric(gateway.url, "switchboard_gateway_requests_total", code="invalid_value") == counted + 1
    if param == "max_completion_tokens":
        body = refusal(lambda: client.responses.create(model=MODEL, input="Hi", max_output_tokens=0))
        assert (body["param"], body["code"]) == ("max_output_tokens", code), body
        assert body["message"] == said.replace("'max_completion_tokens'", "'max_output_tokens'")


def test_logprobs_asked_for_are_an_object_even_for_a_reply_without_text(gateway: Service) -> None:
    """With `logprobs: true`, a reply with no text (a stop string at its first token, EOS forced, a tool call)
    came back from the gateway with `"logprobs": null` where the shard itself answers `{"content": []}`:
    an app reading `choice.logprobs.content` (a confidence score) raised on it. Now the object, empty; a
    request that did not ask still gets null."""
    client = sdk(gateway)
    for ask in ({"stop": ["Hello"]}, {"logit_bias": {"2": 100}}):  # the greedy reply opens with "Hello"; 2 is EOS
        reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0,
                                               logprobs=True, **ask)
        choice = reply.choices[0]
        assert (choice.message.content, choice.finish_reason) == ("", "stop"), (ask, choice)
        assert choice.logprobs is not None and choice.logprobs.content == [], (ask, choice)
    called = client.chat.completions.create(model=MODEL, messages=WEATHER, max_tokens=30, temperature=0, logprobs=True,
                                            tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required")
    assert called.choices[0].message.tool_calls and called.choices[0].logprobs is not None
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0, stop=["Hello"])
    assert plain.choices[0].logprobs is None


def test_openai_parameters_are_accepted_or_refused_in_openai_words(gateway: Service) -> None:
    """What OpenAI has and this model does not do is a 400 naming it, in OpenAI's words: "Unsupported
    parameter: 'audio' is not supported with this model." (was "parameter 'audio' is not supported by this
    server"); an unknown key "Unrecognized request argument supplied: foo" (was lowercase). What OpenAI takes
    for a text model is accepted (store, metadata, user, service_tier, reasoning_effort, modalities ["text"])."""
    client = sdk(gateway)
    refused: list[tuple[dict[str, Any], str]] = [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"), ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "Hello"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options")]
    for fields, param in refused:
        body = refusal(lambda fields=fields: client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2,
                                                                            **fields))
        assert (body["param"], body["code"], body["message"]) == (
            param, "unsupported_parameter", f"Unsupported parameter: '{param}' is not supported with this model."), body
    body = refusal(lambda: client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2,
                                                          extra_body={"foo": 1}))
    assert (body["code"], body["message"]) == ("unsupported_parameter", "Unrecognized request argument supplied: foo")
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, store=True, metadata={"app": "qa"},
                                           user="u-1", service_tier="auto", reasoning_effort="low", modalities=["text"])
    assert reply.choices[0].finish_reason in ("stop", "length")
