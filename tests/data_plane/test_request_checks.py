"""Request bodies before any field is read (data_plane/request_checks.py): a body nested just deep
enough to parse but not to re-encode, and the nulls real SDKs send, in process (no server needed).

    .venv/bin/python -m pytest tests/data_plane/test_request_checks.py -q   # ~2 s
"""

from __future__ import annotations

import json
import threading

import pytest

from data_plane.common.errors import SwitchboardError
from data_plane.gateway.responses_input import input_items
from data_plane.gateway.responses_items import parse_responses_request, withheld_reasoning
from data_plane.protocol import parse_chat_request


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("parse,body", [
    (parse_chat_request, '{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "metadata": {{"k": {}}}}}'),
    (parse_responses_request, '{{"model": "m", "input": "hi", "metadata": {{"k": {}}}}}'),
])
def test_a_body_nested_near_the_parsers_limit_is_a_400_never_a_recursion_error(parse, body) -> None:
    """Review: encoding the body again to find lone surrogates takes a few more frames than parsing
    it, so some depths parsed and then failed in json.dumps: an uncaught RecursionError, a 500."""
    failures: list[str] = []

    def scan() -> None:  # on a thread of its own: a stack as shallow as a server's handler's, not pytest's
        for depth in range(850, 1010):
            try:
                parse(body.format(nested(depth)).encode(), "application/json")
            except SwitchboardError as e:
                if e.status != 400:
                    failures.append(f"{depth}: {e}")
            except Exception as e:  # noqa: BLE001 - what the test is for
                failures.append(f"{depth}: {type(e).__name__}")

    t = threading.Thread(target=scan)
    t.start()
    t.join()
    assert not failures, failures[:3]


def test_an_input_item_id_of_null_is_no_id() -> None:
    """The openai SDK's input item types declare `id: Optional[str]`: null means none, as absent
    (review: a 400 "input[0].id must be a string" since the sweep's id check)."""
    items = [{"type": "message", "role": "user", "content": "What is the weather?", "id": None},
             {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}", "id": None,
              "status": None},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny", "id": None, "status": None}]
    out = input_items(items)
    assert [i["type"] for i in out] == ["message", "function_call", "function_call_output"]
    assert all(isinstance(i.get("id"), str) and i["id"] for i in out)  # given ids of their own
    with pytest.raises(SwitchboardError) as e:
        input_items([{**items[0], "id": 5}])
    assert e.value.status == 400 and e.value.param == "input[0].id"


def test_a_reasoning_item_without_an_id_gets_one_and_is_named_by_it_as_withheld() -> None:
    """Codex and the Agents SDK (`reasoning_item_id_policy="omit"`) send reasoning items without an id, as
    OpenAI's Responses API takes them: a 400 "Missing required parameter: 'input[0].id'" here. Given an `rs_`
    id of ours (null is none too), which `input_transformations` names; one sent with an id keeps it."""
    raw = [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"},
           {"type": "reasoning", "id": None, "summary": [{"type": "summary_text", "text": "t"}]},
           {"type": "reasoning", "id": "rs_kept", "summary": []}]
    out = input_items(raw)
    assert [i["id"][:3] for i in out] == ["rs_"] * 3 and out[2]["id"] == "rs_kept" and out[0]["id"] != out[1]["id"]
    assert out[0]["encrypted_content"] == "gAAAA"
    assert [t["id"] for t in withheld_reasoning(out)["input_transformations"]] == [i["id"] for i in out]


def test_an_input_of_only_reasoning_items_is_a_400_that_says_so() -> None:
    """Reasoning items are withheld from this model: an input of nothing else left the chat request no message,
    and the 400 said "Invalid 'input': empty array", of an input that held items. It says why now."""
    req = parse_responses_request(b'{"model": "m", "input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}',
                                  None)
    with pytest.raises(SwitchboardError) as e:
        req.turn_request([], input_items(req.input), str)
    assert (e.value.status, e.value.param) == (400, "input") and "only reasoning items" in e.value.message


def test_a_daybreak_access_program_is_openais_403() -> None:
    """The openai SDK's `access_programs.cyber`: "Requests that require unavailable Daybreak access return 403"
    (a PermissionDeniedError to the SDK); it was a 400 unsupported_parameter here. Standard is served."""
    for program in ("daybreak_blue", "daybreak_red"):
        with pytest.raises(SwitchboardError) as e:
            parse_responses_request(json.dumps({"model": "m", "input": "Hi", "access_programs": {"cyber": program}})
                                    .encode(), "application/json")
        assert (e.value.status, e.value.code, e.value.param) == (403, "permission_denied", "access_programs.cyber")
    parse_responses_request(b'{"model": "m", "input": "Hi", "access_programs": {"cyber": "standard"}}', None)


def test_replayed_openai_assistant_messages_and_the_sdks_stream_options_are_accepted() -> None:
    """An app that replays OpenAI's message objects sends `refusal`, `audio` and `function_call` as
    null, and the current openai SDK may send `stream_options.include_obfuscation`: all were 400s
    (extra fields forbidden). A refusal with no content is that turn's text; a non-null audio, or a
    function_call that is not the deprecated call's `{name, arguments}` (served as a tool call:
    tests/data_plane/test_chat_legacy_functions.py), is still refused, naming the field."""
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False},
            "messages": [{"role": "user", "content": "Help me."},
                         {"role": "assistant", "content": None, "refusal": "I can't help with that.",
                          "audio": None, "function_call": None},
                         {"role": "user", "content": "Then say hi."}]}
    req = parse_chat_request(json.dumps(body).encode(), "application/json")
    assert [m.text() for m in req.messages] == ["Help me.", "I can't help with that.", "Then say hi."]
    for field, value, param in (("audio", {"id": "audio_1"}, "audio"), ("function_call", {"name": "f"}, "function_call.arguments"),
                                ("function_call", "f", "function_call")):
        bad = {**body, "messages": [{"role": "assistant", "content": "x", field: value}, body["messages"][2]]}
        with pytest.raises(SwitchboardError) as e:
            parse_chat_request(json.dumps(bad).encode(), "application/json")
        assert e.value.status == 400 and e.value.param == f"messages.0.{param}", e.value.param


def test_replayed_sdk_message_objects_with_annotations_and_parsed_are_accepted() -> None:
    """The openai SDK's `message.model_dump()` writes `annotations` (null, or OpenAI's `[]`), and a message
    its `parse` helpers return carries `parsed` (and a tool call, `parsed_arguments`): both were a 400
    naming the field. They are replayed; the prompt is made of the content and the calls only."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}', "parsed_arguments": {"city": "Paris"}}}
    body = {"model": "m", "messages": [
        {"role": "user", "content": "Invent a person."},
        {"role": "assistant", "content": '{"name":"Ann","age":3}', "refusal": None, "annotations": [],
         "audio": None, "function_call": None, "tool_calls": None, "parsed": {"name": "Ann", "age": 3}},
        {"role": "assistant", "content": None, "annotations": None, "parsed": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]}
    req = parse_chat_request(json.dumps(body).encode(), "application/json")
    plain = req.plain_messages(tools_prompt=False)
    assert plain[1] == {"role": "assistant", "content": '{"name":"Ann","age":3}'}
    assert "parsed" not in plain[2]["content"] and "get_weather" in plain[2]["content"]


def test_a_tool_result_may_answer_a_call_in_the_session_it_continues() -> None:
    """With X-Session-Id (or the body's session_id) the call a tool message answers is in the session's
    transcript, not in the request: accepted there (was a 400), and read as the tool's result without a
    name; without a session, or starting one, it is still a 400."""
    body = {"model": "m", "messages": [{"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]}
    raw = json.dumps(body).encode()
    req = parse_chat_request(raw, "application/json", "sess_abc")
    assert req.plain_messages() == [{"role": "user", "content": "The tool returned: Sunny"}]
    parse_chat_request(json.dumps({**body, "session_id": "sess_abc"}).encode(), "application/json")
    for session in (None, "new"):
        with pytest.raises(SwitchboardError) as e:
            parse_chat_request(raw, "application/json", session)
        assert e.value.status == 400 and e.value.param == "messages"


def test_a_function_result_continuing_a_session_names_its_function() -> None:
    """A legacy `role: "function"` message continuing a session (its call in the transcript) was read as "The tool
    returned: Sunny", its function's name dropped, though the same result with its call in the request reads
    "The tool get_weather returned: Sunny" (data_plane/legacy_functions.py)."""
    body = {"model": "m", "messages": [{"role": "function", "name": "get_weather", "content": "Sunny"}]}
    req = parse_chat_request(json.dumps(body).encode(), "application/json", "sess_abc")
    assert req.plain_messages() == [{"role": "user", "content": "The tool get_weather returned: Sunny"}]


def test_an_assistant_refusal_part_replays_as_its_text_and_elsewhere_is_a_400() -> None:
    """History recorded on OpenAI may carry assistant content parts of type "refusal" (the SDK's
    ChatCompletionContentPartRefusalParam): they were a 400 "content part type 'refusal' is not supported"."""
    def chat(message: dict) -> bytes:
        return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}, message,
                                                      {"role": "user", "content": "why?"}]}).encode()

    req = parse_chat_request(chat({"role": "assistant", "content": [
        {"type": "text", "text": "Sorry. "}, {"type": "refusal", "refusal": "I can't help with that."}]}),
        "application/json")
    assert req.messages[1].text() == "Sorry. I can't help with that."
    for bad, param in [({"role": "assistant", "content": [{"type": "refusal"}]}, "messages.1.content.0.refusal"),
                       ({"role": "assistant", "content": [{"type": "text", "text": "x"},
                                                          {"type": "refusal", "refusal": "x", "extra": 1}]},
                        "messages.1.content.1.refusal"),
                       ({"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}, "messages.1.content.0")]:
        with pytest.raises(SwitchboardError) as e:
            parse_chat_request(chat(bad), "application/json").messages[1].text()
        assert e.value.status == 400 and e.value.param == param, (bad, e.value)
    with pytest.raises(SwitchboardError) as e:  # a lone surrogate in a refusal: a 400 as in text, never a 500
        parse_chat_request(chat({"role": "assistant", "content": [{"type": "refusal", "refusal": "\ud800"}]}),
                           "application/json")
    assert e.value.status == 400


CLOSED = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}


@pytest.mark.parametrize("schema,context", [
    ({"type": "object"}, "()"),  # a free-form object (a `dict` field) cannot be strict
    ({**CLOSED, "additionalProperties": True}, "()"),
    ({**CLOSED, "properties": {"a": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {}}]}}},
     "('properties', 'a', 'anyOf', 1)"),
    ({**CLOSED, "$defs": {"B": {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}}},
     "('$defs', 'B')"),
    ({**CLOSED, "properties": {"a": {"type": "array", "items": {"type": ["object", "null"]}}}},
     "('properties', 'a', 'items')"),
])
def test_strict_mode_needs_every_object_closed(schema, context) -> None:
    """OpenAI's strict mode: every object says `additionalProperties: false`, wherever it sits (a 400
    naming the path, as OpenAI words it); the same schema without `strict` is served (closed by the grammar)."""
    def body(strict: bool) -> bytes:
        return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "strict": strict, "schema": schema}}}).encode()

    with pytest.raises(SwitchboardError) as e:
        parse_chat_request(body(True), "application/json")
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_json_schema", "response_format")
    assert f"In context={context}, 'additionalProperties' is required to be supplied and to be false." in e.value.message
    parse_chat_request(body(False), "application/json")


def test_strict_schemas_the_sdk_builds_pass_the_strict_check() -> None:
    """The openai SDK's strict conversion of nested models, optional fields and lists is what strict mode
    asks for: none of it may be refused."""
    import openai
    from pydantic import BaseModel

    class Inner(BaseModel):
        x: int
        note: str | None = None

    class Outer(BaseModel):
        items: list[Inner]
        best: Inner | None = None
        tags: list[str] = []

    tool = openai.pydantic_function_tool(Outer)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "response_format": {
        "type": "json_schema", "json_schema": {"name": "o", "strict": True,
                                               "schema": tool["function"]["parameters"]}}}
    assert parse_chat_request(json.dumps(body).encode(), "application/json").tools


@pytest.mark.parametrize("call,param,got", [
    ({"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
     "messages.1.tool_calls.0.function.arguments", "an object"),
    ({"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": 5}},
     "messages.1.tool_calls.0.function.arguments", "an integer"),
    ({"id": "c1", "type": "function", "function": "get_weather"}, "messages.1.tool_calls.0.function", "a string"),
    ({"id": "c1", "type": "function"}, "messages.1.tool_calls.0.function", "null"),
    ({"id": 7, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
     "messages.1.tool_calls.0.id", "an integer"),
])
def test_a_malformed_tool_call_in_history_is_a_400_naming_it(call, param, got) -> None:
    """An assistant message's tool call with its arguments as a JSON object (a hand-built history), or its
    function as a bare name, was a 500: writing the history back as the envelope read them as strings."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"},
                                       {"role": "assistant", "content": None, "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]}
    with pytest.raises(SwitchboardError) as e:
        parse_chat_request(json.dumps(body).encode(), "application/json").plain_messages()
    assert (e.value.status, e.value.param) == (400, param)
    assert e.value.message == f"Invalid type for '{param}': expected {'an object' if param.endswith('function') else 'a string'}, but got {got} instead."
    good = {**call, "id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    body["messages"][1]["tool_calls"] = [good]
    replayed = parse_chat_request(json.dumps(body).encode(), "application/json").plain_messages()
    assert any(m["role"] == "assistant" and "get_weather" in m["content"] for m in replayed)


def test_an_assistant_messages_audio_is_a_400_in_openais_words_and_null_is_served() -> None:
    """An audio reply replayed (`audio: {"id": ...}`) read "messages.1.audio: Input should be None"."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "x", "audio": {"id": "audio_1"}},
                                       {"role": "user", "content": "more"}]}
    with pytest.raises(SwitchboardError) as e:
        parse_chat_request(json.dumps(body).encode(), "application/json")
    assert e.value.status == 400 and e.value.param == "messages.1.audio" and e.value.code == "unsupported_value"
    assert "Audio is not supported" in str(e.value) and "Input should be" not in str(e.value)
    body["messages"][1]["audio"] = None
    assert parse_chat_request(json.dumps(body).encode(), "application/json").messages[1].audio is None


def _sdk_fields(kind: str) -> set[str]:
    """Every key the openai SDK defines for an input item of `kind`: its input params' and the output items'
    a client replays (a Response's `output`, a conversation's listed items), by their wire names."""
    from typing import get_args

    from openai.types.conversations.conversation_item import ConversationItem
    from openai.types.responses.response_input_item_param import ResponseInputItemParam
    from openai.types.responses.response_output_item import ResponseOutputItem
    keys: set[str] = set()
    for param in get_args(ResponseInputItemParam):
        fields = {k for base in param.__mro__ for k in getattr(base, "__annotations__", {})}
        if "type" not in fields:
            continue
        hint = {k: v for base in reversed(param.__mro__) for k, v in getattr(base, "__annotations__", {}).items()}
        if kind in str(hint["type"]).split("'") or (kind == "message" and "role" in fields and "tools" not in fields):
            keys |= fields
    for union in (ResponseOutputItem, ConversationItem):
        for model in get_args(get_args(union)[0]):
            fields_by_alias = {name for k, f in getattr(model, "model_fields", {}).items() for name in (f.alias or k, k)}
            if getattr(model, "model_fields", {}).get("type") is not None and \
                    kind in str(model.model_fields["type"].annotation).split("'"):
                keys |= fields_by_alias
    return keys


def test_unknown_keys_of_an_input_item_are_openais_400_and_every_sdk_field_passes() -> None:
    """An input item's (or content part's) unknown key was dropped without a word (a misspelt `call_id` went
    unnoticed); OpenAI answers 400 ``unknown_parameter`` "Unknown parameter: 'input[0].foo'.". Every field the
    SDK's item types define still passes, those this server ignores too (`status`, `phase`, `namespace`...), and
    its output items as `model_dump()` gives them (`async_`: an app that replays `r.output` that way worked)."""
    from data_plane.gateway.responses_input import ITEM_FIELDS
    for kind in ("message", "function_call", "function_call_output", "reasoning", "compaction", "item_reference"):
        sdk = _sdk_fields(kind)
        assert {"type", "id"} <= sdk, (kind, sdk)
        assert sdk <= ITEM_FIELDS[kind], (kind, sorted(sdk - ITEM_FIELDS[kind]))
    replayed = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?",
                                                                  "prompt_cache_breakpoint": None}],
                 "id": None, "status": "completed", "phase": None},
                {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "phase": "final_answer",
                 "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "weather", "arguments": "{}",
                 "status": "completed", "namespace": None, "caller": None, "async": None, "created_by": None},
                {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "sunny",
                 "status": "completed", "namespace": None, "caller": None, "name": None, "created_by": None}]
    assert [i["type"] for i in input_items(replayed)] == ["message", "message", "function_call", "function_call_output"]
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText
    output = [ResponseOutputMessage(id="msg_2", type="message", role="assistant", status="completed",
                                    content=[ResponseOutputText(type="output_text", text="ok", annotations=[])]),
              ResponseFunctionToolCall(type="function_call", id="fc_2", call_id="call_2", name="f", arguments="{}")]
    for dumped in ([o.model_dump() for o in output], [o.model_dump(by_alias=True) for o in output]):  # replayed whole
        assert [i["type"] for i in input_items(dumped)] == ["message", "function_call"]
    for where, bad in (("input[0].foo", [{"role": "user", "content": "hi", "foo": 1}]),
                       ("input[1].callid", [replayed[2], {**replayed[3], "callid": "call_1"}]),
                       ("input[0].content[0].cache", [{"role": "user", "content": [{"type": "input_text", "text": "x",
                                                                                     "cache": True}]}]),
                       ("items[0].extra", [{"type": "item_reference", "id": "msg_9", "extra": 1}])):
        with pytest.raises(SwitchboardError) as e:
            input_items(bad, param=where.partition("[")[0])
        assert (e.value.status, e.value.code, e.value.param) == (400, "unknown_parameter", where), e.value
        assert e.value.message == f"Unknown parameter: '{where}'."


@pytest.mark.parametrize("field,value,theirs", [
    ("max_tokens", 5, "max_output_tokens"), ("max_completion_tokens", 5, "max_output_tokens"),
    ("messages", [{"role": "user", "content": "hi"}], "input"), ("response_format", {"type": "json_object"}, "text"),
])
def test_a_chat_field_sent_to_responses_is_named_as_sent(field: str, value: object, theirs: str) -> None:
    """An app moving from Chat Completions sends `max_tokens` to /v1/responses: the 400 said
    "Unrecognized request argument supplied: max_output_tokens" (param max_output_tokens), naming the very
    field the app should use as the one not supported (`messages` named `input`, `response_format`
    `text.format`): the body's own error went through the renaming meant for the chat path's errors."""
    body = {"model": "m", "input": "hi", field: value}
    with pytest.raises(SwitchboardError) as info:
        parse_responses_request(json.dumps(body).encode(), "application/json")
    assert (info.value.status, info.value.param, info.value.code) == (400, field, "unsupported_parameter")
    assert info.value.message.startswith(f"Unrecognized request argument supplied: {field} ")
    assert f"'{theirs}" in info.value.message, info.value.message


def test_a_responses_body_error_keeps_openais_indexes() -> None:
    with pytest.raises(SwitchboardError) as info:
        parse_responses_request(b'{"model": "m", "input": "hi", "context_management": [{"type": 7}]}', None)
    assert info.value.param == "context_management[0].type", info.value.param
