"""Chat Completions as an application sees it, third round (tool-call history, structured outputs, the
SDK's parameters): each test is a place where the gateway answered otherwise than OpenAI's API does, found
by driving it with the openai SDK. Real processes: the session's fp32 shard, a cache node and a gateway.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_chat_app_contract.py -q
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.chat import sdk
from tests.support.cluster import KEYS, gateway_before
from tests.support.procs import CLUSTER_HEADERS, Service

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = {"role": "user", "content": "What is the weather in Paris and in Rome?"}
UNANSWERED = "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'."


def _call(i: int, city: str) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}


def _result(i: int, text: str = "Sunny") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call_{i}", "content": text}


@pytest.fixture(scope="module")
def gateway(fp32_shard: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with gateway_before(fp32_shard, tmp_path_factory.mktemp("chat-app-contract")) as gw:
        yield gw


def _refused(client: Any, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **extra)
    body: dict[str, Any] = bad.value.body  # type: ignore[assignment]
    return body


@pytest.mark.parametrize(("tail", "missing"), [
    ([{"role": "user", "content": "And?"}], "call_1, call_2"),           # the results never sent
    ([_result(1)], "call_2"),                                              # one of two answered
    ([], "call_1, call_2"),                                                # the calls end the history
    ([{"role": "user", "content": "x"}, _result(1), _result(2)], "call_1, call_2"),  # a message between
], ids=["no-results", "one-of-two", "trailing-calls", "user-between"])
def test_tool_calls_without_their_results_are_a_400_as_openai_answers_them(gateway: Service, tail: list[Any],
                                                                            missing: str) -> None:
    """OpenAI refuses a history whose assistant tool calls are not each answered by the tool messages right
    after it; the gateway served it (the model saw a call with no result, and an app tested here broke on
    OpenAI). Streamed or not, with tools or without; an answered history is still served."""
    client = sdk(gateway)
    history = [ASK, {"role": "assistant", "content": None, "tool_calls": [_call(1, "Paris"), _call(2, "Rome")]}, *tail]
    for extra in ({}, {"tools": [WEATHER]}, {"stream": True}):
        body = _refused(client, history, **extra)
        assert body["message"] == f"{UNANSWERED} The following tool_call_ids did not have response messages: {missing}"
        assert body["param"] == "messages.1.role" and body["type"] == "invalid_request_error"
    answered = [ASK, history[1], _result(1), _result(2, "Rainy")]
    reply = client.chat.completions.create(model=MODEL, messages=answered, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content


def _session_with_a_call(client: Any) -> tuple[dict[str, str], Any]:
    """A new session whose first turn made one forced get_weather call: its headers and the call."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False, max_tokens=40, temperature=0,
        extra_headers={"X-Session-Id": "new"})
    return {"X-Session-Id": raw.headers["x-session-id"]}, raw.parse().choices[0].message.tool_calls[0]


def test_a_sessions_tool_calls_must_be_answered_before_it_goes_on(gateway: Service) -> None:
    """With X-Session-Id the calls are in the transcript, so the check counts the request's leading tool
    messages against the last turn's calls: a user message instead of the result was served (the call left
    unanswered in the history from then on). The refused turn leaves the session as it was."""
    client = sdk(gateway)
    headers, call = _session_with_a_call(client)
    body = _refused(client, [{"role": "user", "content": "Never mind."}], extra_headers=headers)
    assert body["message"].startswith(UNANSWERED) and "get_weather" in body["message"], body
    assert body["param"] == "messages"
    body = _refused(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}],
                    extra_headers=headers, stream=True)
    assert body["message"].startswith(UNANSWERED)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}], max_tokens=30,
        temperature=0, extra_headers=headers).choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    after = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Thanks!"}],
                                           max_tokens=8, temperature=0, extra_headers=headers)
    assert after.choices[0].message.content  # the calls answered, the session goes on


ORPHAN = "messages with role 'tool' must answer a preceding assistant message's tool_calls (tool_call_id)"


def test_a_tool_result_that_answers_no_call_of_a_session_is_a_400(gateway: Service) -> None:
    """The other way round: tool messages where the session's last turn made fewer calls (none, after a plain
    reply: a result sent again, say by a retry of a turn that had gone through), or later in the request
    with no call of its own before them, were served (the model read a result of nothing, and the session
    kept it); OpenAI and the sessionless path refuse them. A deprecated function result still passes."""
    client = sdk(gateway)
    headers, call = _session_with_a_call(client)
    result = {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}
    body = _refused(client, [result, {**result, "tool_call_id": "call_other"}], extra_headers=headers)
    assert body["message"].startswith(ORPHAN) and "called 1 tool(s)" in body["message"], body
    assert body["param"] == "messages"
    client.chat.completions.create(model=MODEL, messages=[result], max_tokens=8, temperature=0, extra_headers=headers)
    for extra in ({}, {"stream": True}, {"tools": [WEATHER]}):  # the same result again: the last turn called nothing
        body = _refused(client, [result], extra_headers=headers, **extra)
        assert body["message"].startswith(ORPHAN) and "called 0 tool(s)" in body["message"], body
    body = _refused(client, [{"role": "user", "content": "And?"}, {**result, "tool_call_id": "call_zz"}],
                    extra_headers=headers)
    assert body["message"] == ORPHAN and body["param"] == "messages"
    legacy = client.chat.completions.create(  # a function result of no call in sight: served, as without a session
        model=MODEL, messages=[{"role": "function", "name": "get_weather", "content": "Rainy"}], max_tokens=8,
        temperature=0, extra_headers=headers)
    assert legacy.choices[0].finish_reason in ("stop", "length")
    after = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Thanks!"}],
                                           max_tokens=8, temperature=0, extra_headers=headers)
    assert after.choices[0].message.content  # the refused turns left the session as it was


@pytest.mark.parametrize(("body", "param"), [
    ({}, "messages"),
    ({"messages": [{"content": "Hi"}]}, "messages.0.role"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
], ids=["messages", "role", "function-name", "tool-choice-function", "json-schema"])
def test_a_required_field_left_out_is_openais_missing_required_parameter(gateway: Service, body: dict[str, Any],
                                                                          param: str) -> None:
    """A required field left out was pydantic's words with code invalid_value ("tools.0.function.name: Field
    required", "response_format: Value error, response_format of type json_schema needs a json_schema
    object"); OpenAI answers "Missing required parameter: 'messages'." with code missing_required_parameter,
    which clients match on."""
    body = {"model": MODEL, "max_tokens": 4, **({"messages": [{"role": "user", "content": "Hi"}], **body} if body else {})}
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEYS['plus']}"},
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == f"Missing required parameter: '{param}'.", err
    assert err["code"] == "missing_required_parameter" and param.startswith(err["param"])


def _schema_of(a: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
        "type": "object", "properties": {"z": {"type": "integer"}, "a": a}, "required": ["z", "a"],
        "additionalProperties": False, "$defs": defs}}}


ENDLESS = _schema_of({"$ref": "#/$defs/A"}, {"A": {"type": "object", "properties": {"x": {"$ref": "#/$defs/A"}},
                                                   "required": ["x"], "additionalProperties": False}})
"""Every output recurses forever ({"x": {"x": ...}}): llguidance's parser stops at its item limit."""
CYCLE = _schema_of({"$ref": "#/$defs/A"}, {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}})
"""A $ref cycle under a property: nothing can follow `"a":` (the grammar's mask allows only EOS there)."""


@pytest.mark.parametrize("response_format", [ENDLESS, CYCLE], ids=["endless-recursion", "ref-cycle"])
def test_a_schema_with_no_whole_output_is_a_400_and_the_shard_serves_on(gateway: Service, fp32_shard: Service,
                                                                        response_format: dict[str, Any]) -> None:
    """A schema whose grammar stops part-way through every output: with ENDLESS the matcher rejected a draft
    the jump-forward had planned, an AssertionError on the scheduler thread killed the shard's engine (every
    stream on it failed, the shard exited: one request of any key took a shard down), and the client got a
    502; with CYCLE the reply was `{"z":1,"a":` with finish_reason "stop". Now the request fails alone with
    a 400 invalid_grammar (an error event once the stream began), and the shard serves the next request."""
    client = sdk(gateway)
    ask = [{"role": "user", "content": "Give me JSON."}]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=ask, response_format=response_format, max_tokens=40,
                                       temperature=0)
    err: dict[str, Any] = bad.value.body  # type: ignore[assignment]
    assert err["code"] == "invalid_grammar" and err["param"] == "response_format", err
    assert err["message"].startswith("the JSON schema cannot be followed to a complete output"), err
    with pytest.raises(openai.APIError) as streamed:
        for _ in client.chat.completions.create(model=MODEL, messages=ask, response_format=response_format,
                                                max_tokens=40, temperature=0, stream=True):
            pass
    assert "cannot be followed to a complete output" in str(streamed.value)
    assert httpx.get(fp32_shard.url + "/health", timeout=10).status_code == 200
    after = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0,
                                           response_format={"type": "json_object"})
    assert after.choices[0].message.content


def test_replies_say_the_service_tier_that_served_them(gateway: Service) -> None:
    """OpenAI's completions and chunks carry `service_tier` (the tier that processed the request, "default"
    whatever `auto`, `flex` or `priority` asked); ours had none, so the SDK read None where an app reads the
    tier it was billed at (the Responses API said "default" already)."""
    client = sdk(gateway)
    ask = [{"role": "user", "content": "Hi"}]
    for asked in ({}, {"service_tier": "auto"}, {"service_tier": "flex"}):
        assert client.chat.completions.create(model=MODEL, messages=ask, max_tokens=2, **asked).service_tier == "default"
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}, service_tier="priority"))
    assert chunks and all(c.service_tier == "default" for c in chunks)


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"stop": ""}, "stop", "stop sequences must be non-empty"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}, "store": True}, "metadata", "at most 16 properties"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "needs exactly one of"),
], ids=["stop", "metadata", "structured_outputs"])
def test_a_refused_value_is_worded_without_pydantics_prefix(gateway: Service, fields: dict[str, Any], param: str,
                                                            words: str) -> None:
    """A value one of our validators refuses read "stop: Value error, stop sequences must be non-empty":
    pydantic's label for the exception class, in front of the client. The message is the validator's own."""
    with pytest.raises(openai.BadRequestError) as bad:
        sdk(gateway).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                             extra_body=fields)
    err: dict[str, Any] = bad.value.body  # type: ignore[assignment]
    assert err["param"] == param and words in err["message"] and "Value error" not in err["message"], err


def _with_format(fmt: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"u": {"type": "string", "format": fmt, "maxLength": 20}}, "required": ["u"],
            "additionalProperties": False}


def test_a_format_the_grammar_does_not_know_is_an_annotation_unless_strict(gateway: Service) -> None:
    """JSON Schema reads `format` as an annotation, and OpenAI serves a non-strict schema whatever its formats:
    here one the grammar compiler does not know (pydantic's SecretStr "password", Path "path", bytes "binary",
    an MCP tool's "uri-reference") was a 400 "Unknown format", so an instructor model with such a field could
    not be served. It is now a plain string. Strict mode takes OpenAI's nine formats and "uri" (enforced by the
    grammar), and refuses another in OpenAI's words ("'uri-reference' is not a valid format")."""
    client = sdk(gateway)
    ask = [{"role": "user", "content": "Give me JSON with a path."}]
    for fmt in ("password", "path", "binary", "uri-reference"):
        reply = client.chat.completions.create(
            model=MODEL, messages=ask, max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": _with_format(fmt)}})
        assert isinstance(json.loads(reply.choices[0].message.content or "")["u"], str)
        call = client.chat.completions.create(
            model=MODEL, messages=ask, max_tokens=40, temperature=0, tool_choice="required",
            tools=[{"type": "function", "function": {"name": "save", "parameters": _with_format(fmt)}}])
        assert isinstance(json.loads(call.choices[0].message.tool_calls[0].function.arguments)["u"], str)
    for fields, param, code, prefix in (
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "f", "strict": True,
                                                                         "schema": _with_format("uri-reference")}}},
             "response_format", "invalid_json_schema", "Invalid schema for response_format 'f': "),
            ({"tools": [{"type": "function", "function": {"name": "save", "strict": True,
                                                           "parameters": _with_format("password")}}]},
             "tools.0.function.parameters", "invalid_function_parameters", "Invalid schema for function 'save': ")):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, **fields)
        err: dict[str, Any] = bad.value.body  # type: ignore[assignment]
        fmt = "uri-reference" if param == "response_format" else "password"
        assert err["message"] == f"{prefix}In context=('properties', 'u'), '{fmt}' is not a valid format.", err
        assert (err["param"], err["code"]) == (param, code)
    for fmt in ("date", "uri"):  # one of OpenAI's nine, and pydantic's AnyUrl: strict, served and enforced
        ok = client.chat.completions.create(
            model=MODEL, messages=ask, max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "f", "strict": True, "schema": _with_format(fmt)}})
        assert ok.choices[0].finish_reason == "stop", fmt


def test_a_format_the_grammar_does_not_know_is_an_annotation_in_a_dicts_values_too(gateway: Service) -> None:
    """pydantic's dict[str, Path] (dict[str, SecretStr], dict[str, bytes]) puts the format in the object's
    `additionalProperties`, where the rewrite did not look: still the 400 "Unknown format: path" for a
    non-strict schema, response_format or a tool's parameters (OpenAI serves it)."""
    client = sdk(gateway)
    ask = [{"role": "user", "content": "Give me JSON with paths."}]
    schema = {"type": "object", "required": ["paths"], "properties": {
        "paths": {"type": "object", "additionalProperties": {"type": "string", "format": "path"}},
        "secrets": {"type": "object", "additionalProperties": {"anyOf": [{"type": "string", "format": "password"},
                                                                         {"type": "null"}]}}}}
    reply = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0,
                                           response_format={"type": "json_schema", "json_schema": {"name": "p",
                                                                                                   "schema": schema}})
    assert reply.choices[0].message.content
    call = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0,
                                          tool_choice="required",
                                          tools=[{"type": "function", "function": {"name": "save", "parameters": schema}}])
    assert call.choices[0].message.tool_calls


def test_a_schema_with_no_whole_output_names_the_responses_field(gateway: Service) -> None:
    """Through the Responses API the same 400 named `response_format`, a field a Responses client never sent
    (the shard's error came after the first token, past the renaming of the errors raised before it)."""
    fmt = ENDLESS["json_schema"]
    with pytest.raises(openai.BadRequestError) as bad:
        sdk(gateway).responses.create(model=MODEL, input="Give me JSON.", max_output_tokens=40, temperature=0,
                                      text={"format": {"type": "json_schema", "name": fmt["name"], "schema": fmt["schema"]}})
    err: dict[str, Any] = bad.value.body  # type: ignore[assignment]
    assert (err["param"], err["code"]) == ("text.format", "invalid_grammar"), err


def test_a_streamed_response_that_fails_on_its_schema_says_invalid_grammar(gateway: Service) -> None:
    """Streamed, the same schema's failure ended with `response.failed` carrying `server_error` (and the `error`
    event named `response_format`): the client's schema is no server error. Now both say `invalid_grammar`, the
    `error` event naming `text.format` as the non-streamed 400 does, and the stored response keeps the code."""
    fmt = ENDLESS["json_schema"]
    client = sdk(gateway)
    events = list(client.responses.create(model=MODEL, input="Give me JSON.", max_output_tokens=40, temperature=0,
                                          stream=True, text={"format": {"type": "json_schema", "name": fmt["name"],
                                                                        "schema": fmt["schema"]}}))
    (error,) = [e for e in events if e.type == "error"]
    assert (error.code, error.param) == ("invalid_grammar", "text.format"), error
    assert events[-1].type == "response.failed", [e.type for e in events]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "invalid_grammar", failed
    assert "cannot be followed to a complete output" in failed.error.message
    stored = client.responses.retrieve(failed.id)
    assert stored.status == "failed" and stored.error is not None and stored.error.code == "invalid_grammar", stored


def test_a_text_part_with_a_prompt_cache_breakpoint_is_served(gateway: Service) -> None:
    """The openai SDK types `prompt_cache_breakpoint` on a text content part (the end of a prefix to cache); chat
    completions answered it with a 400 "Unrecognized request argument supplied: messages.0.content.0.prompt_cache_
    breakpoint" while the Responses API's input_text took it and the request-level `prompt_cache_options` was a
    no-op. Now it is one too (the prefix cache matches by content), served as the same text; a malformed one is
    still a 400 naming it."""
    client = sdk(gateway)
    part: dict[str, Any] = {"type": "text", "text": "You answer in one word.",
                            "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "30m"}}
    system = {"role": "system", "content": [part]}
    marked = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "Hi"}],
                                            max_tokens=6, temperature=0)
    plain = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Hi"}])
    assert marked.choices[0].message.content == plain.choices[0].message.content
    assert marked.usage.prompt_tokens == plain.usage.prompt_tokens
    bad = {"role": "system", "content": [{**part, "prompt_cache_breakpoint": {"mode": "implicit"}}]}
    body = _refused(client, [bad, {"role": "user", "content": "Hi"}])
    assert body["param"] == "messages.0.content.0.prompt_cache_breakpoint", body


def test_requests_whose_grammar_ends_short_never_eject_the_shard(gateway: Service) -> None:
    """The shard refuses such a request with an error event before any token (its stream had begun): the
    router took that event for the shard failing, retried the request elsewhere and counted the failure, so
    3 of them from any key (a free one sending `structured_outputs: {"regex": "a{1000000}"}`) ejected the
    shard, and every tenant got 503 no_healthy_backend. Now each is the client's 400 and nothing else."""
    client = sdk(gateway)
    ask = [{"role": "user", "content": "Give me JSON."}]
    asks: list[dict[str, Any]] = [{"response_format": ENDLESS}, {"extra_body": {"structured_outputs": {
        "regex": "a{1000000}"}}}]
    for fields in asks * 2:
        for stream in (False, True):
            with pytest.raises(openai.APIError) as refused:
                reply = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0,
                                                       stream=stream, **fields)
                list(reply) if stream else None  # a stream's refusal is its error event
            assert "cannot be followed to a complete output" in str(refused.value), refused.value
    metrics = httpx.get(gateway.url + "/metrics", headers=CLUSTER_HEADERS, timeout=10).text
    failures = [line for line in metrics.splitlines()
                if line.startswith("switchboard_router_upstream_failures_total{") and not line.endswith(" 0.0")]
    assert failures == [], failures
    assert client.chat.completions.create(model=MODEL, messages=ask, max_tokens=4).choices[0].message.content
