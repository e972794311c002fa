"""The Responses and Conversations APIs where an app built on OpenAI's would notice a difference: a
function call left without its output, the words of a chat-path error, an update's unknown field. The
real model, two cache nodes and a gateway on loopback (test_responses_api.py's stack), driven by the
openai SDK."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.data_plane import test_responses_api
from tests.data_plane.test_responses_api import MODEL, Stack
from tests.support.cluster import KEYS

stack = test_responses_api.stack
"""That module's stack (the fixture), for this module's own instance."""

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_call_left_without_its_output_is_openais_400(stack: Stack) -> None:
    """A chain (or conversation) whose last response is a function call, continued with a new message
    only, was a 200: the model saw the call with no result and answered as if it had one, where OpenAI
    answers 400 "No tool output found for function call <call_id>." (param input), streamed or not, and
    so does its input-token count; with the output the turn goes on."""
    client = stack.sdk()
    ask = {"model": MODEL, "tools": [WEATHER], "parallel_tool_calls": False, "temperature": 0}
    first = client.responses.create(input="What is the weather in Paris?", tool_choice="required",
                                    max_output_tokens=40, **ask)
    (call,) = [o for o in first.output if o.type == "function_call"]
    conv = client.conversations.create(items=[{"role": "user", "content": "Weather in Paris?"},
                                              {"type": "function_call", "call_id": call.call_id,
                                               "name": call.name, "arguments": call.arguments}])
    inline = [{"role": "user", "content": "Weather in Paris?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"role": "user", "content": "And in Rome?"}]
    for where in ({"previous_response_id": first.id, "input": "And in Rome?"},
                  {"conversation": conv.id, "input": "And in Rome?"}, {"input": inline}):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as bad:
                client.responses.create(max_output_tokens=4, stream=stream, **ask, **where)
            body = bad.value.body
            assert body["message"] == f"No tool output found for function call {call.call_id}.", body
            assert body["param"] == "input" and body["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError):
            client.responses.input_tokens.count(model=MODEL, **where)
    answered = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    after = client.responses.create(previous_response_id=first.id, input=answered, tool_choice="none",
                                    max_output_tokens=24, **ask)
    assert after.status in ("completed", "incomplete") and after.output_text
    assert client.responses.create(conversation=conv.id, input=answered, tool_choice="none", max_output_tokens=24,
                                   **ask).output_text
    assert len(client.conversations.items.list(conv.id, limit=100).data) == 4  # the refused turns left nothing


def test_a_context_error_names_max_output_tokens_not_the_chat_fields(stack: Stack) -> None:
    """With truncation "auto", a message too long for the window was refused in the chat path's words:
    "...only N fit with this max_tokens; shorten the message or lower max_tokens", a field the
    Responses body has not (its param already said input)."""
    r = httpx.post(stack.gateway.url + "/v1/responses", timeout=60, headers={"Authorization": f"Bearer {KEYS['plus']}"},
                   json={"model": MODEL, "input": "word " * 3000, "max_output_tokens": 4, "truncation": "auto"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input" and err["code"] == "context_length_exceeded"
    assert "max_tokens" not in err["message"] and "max_output_tokens" in err["message"], err


def test_an_update_with_an_unknown_field_names_it(stack: Stack) -> None:
    """`POST /v1/conversations/{id}` with a field beside `metadata` answered "metadata is required"
    naming metadata, which was there; it names the field now, as create does (a stored chat completion's
    update shares the check)."""
    client = stack.sdk()
    conv = client.conversations.create(metadata={"a": "1"})
    url, auth = f"{stack.gateway.url}/v1/conversations/{conv.id}", {"Authorization": f"Bearer {KEYS['plus']}"}
    r = httpx.post(url, json={"metadata": {"a": "2"}, "title": "x"}, headers=auth, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "title" and r.json()["error"]["code"] == "unsupported_parameter"
    r = httpx.post(url, json={}, headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata", r.text
    assert client.conversations.retrieve(conv.id).metadata == {"a": "1"}


def test_a_reply_cut_before_any_text_or_call_is_announced_in_the_stream(stack: Stack) -> None:
    """A required call cut by max_output_tokens inside its envelope (no name yet, no text) is an incomplete
    response holding one empty message, streamed or not; the stream sent no event for that message, so its
    final output named an item no `output_item.added`/`.done` had (a client building the output from the
    events had none, one reading the final response had one)."""
    client = stack.sdk()
    ask = {"model": MODEL, "input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required",
           "max_output_tokens": 5, "temperature": 0}
    plain = client.responses.create(**ask)
    assert plain.status == "incomplete" and [o.type for o in plain.output] == ["message"]
    with client.responses.create(stream=True, **ask) as stream:
        events = list(stream)
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.incomplete_details.reason == "max_output_tokens"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [e.item.id for e in events if e.type == "response.output_item.added"] == [i.id for i in done]
    assert done == final.response.output and done[0].type == "message" and done[0].status == "incomplete"
    assert [e.type for e in events][2:-1] == ["response.output_item.added", "response.content_part.added",
                                            "response.output_text.done", "response.content_part.done",
                                            "response.output_item.done"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert client.responses.retrieve(final.response.id).output == done


def test_reasoning_values_and_item_statuses_are_openais(stack: Stack) -> None:
    """`reasoning.effort` (and `summary`), the chat path's `reasoning_effort`, and an input item's `status`
    took any value (a typo such as "hihg" went unnoticed) where OpenAI answers 400 naming the field and its
    values; they are no-ops here, still checked. OpenAI's own values are served."""
    client = stack.sdk()
    bad = [({"reasoning": {"effort": "ultra"}}, "reasoning.effort"),
           ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
           ({"reasoning": {"effort": 3}}, "reasoning.effort"),
           ({"input": [{"type": "message", "role": "user", "content": "Hi", "status": "done"}]}, "input[0].status"),
           ({"input": [{"role": "user", "content": "Hi"},
                       {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "status": "x"},
                       {"type": "function_call_output", "call_id": "c1", "output": "1"}]}, "input[1].status")]
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(**{"model": MODEL, "input": "Hi", "max_output_tokens": 1, **body})
        assert refused.value.body["param"] == param, refused.value.body
        assert refused.value.body["code"] in ("invalid_value", "invalid_type")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="Hi", reasoning={"effort": "hihg"}, max_output_tokens=1)
    assert refused.value.body["message"] == ("Invalid value: 'hihg'. Supported values are: 'none', 'minimal', 'low', "
                                             "'medium', 'high', 'xhigh', and 'max'.")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                       reasoning_effort="ultra")  # type: ignore[arg-type]
    assert refused.value.body["param"] == "reasoning_effort" and refused.value.body["code"] == "invalid_value"
    served = client.responses.create(model=MODEL, max_output_tokens=1, reasoning={"effort": "xhigh", "summary": "auto"},
                                     input=[{"type": "message", "role": "user", "content": "Hi", "status": "completed"}])
    assert served.usage is not None and served.usage.output_tokens == 1
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          reasoning_effort="minimal").usage.completion_tokens == 1


def test_the_sdks_own_reasoning_values_are_served(stack: Stack) -> None:
    """The openai SDK's `Reasoning` takes effort "max", `context` and `mode`, and chat's `reasoning_effort` "max":
    since the values were checked (no-ops, still OpenAI's), "max" was a 400 "Invalid value" on both paths (it
    was served before), and `reasoning.context` / `reasoning.mode` a 400 "Unrecognized request argument"."""
    client = stack.sdk()
    served = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1,
                                     reasoning={"effort": "max", "context": "all_turns", "mode": "standard"})
    assert served.usage is not None and served.usage.output_tokens == 1
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          reasoning_effort="max").usage.completion_tokens == 1
    for reasoning, param in (({"context": "everything"}, "reasoning.context"), ({"mode": 3}, "reasoning.mode")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, reasoning=reasoning)  # type: ignore[arg-type]
        assert refused.value.body["param"] == param, refused.value.body


def test_compact_takes_the_fields_openais_does(stack: Stack) -> None:
    """`client.responses.compact(..., prompt_cache_key=...)` (and safety_identifier, service_tier,
    prompt_cache_retention, prompt_cache_options: fields of OpenAI's compact body, no-ops here as on create) was a
    400 "Unrecognized request argument supplied"; an unknown field and a bad value are still 400s naming them."""
    client = stack.sdk()
    items = [{"role": "user", "content": "word " * 120}, {"role": "assistant", "content": "ok " * 60},
             {"role": "user", "content": "And now?"}]
    raw = client.responses.with_raw_response.compact(model=MODEL, input=items, prompt_cache_key="k-1",  # type: ignore[arg-type]
                                                     safety_identifier="user-7", service_tier="auto",
                                                     prompt_cache_retention="24h",
                                                     extra_body={"prompt_cache_options": {}, "keep_tokens": 16})
    done = raw.parse()
    assert done.object == "response.compaction" and done.output[0].type == "compaction"
    assert done.safety_identifier == "user-7" and done.service_tier == "default"
    follow = client.responses.create(model=MODEL, max_output_tokens=2, input=raw.http_response.json()["output"])
    assert follow.usage is not None and follow.usage.output_tokens > 0
    for body, param in (({"title": "x"}, "title"), ({"prompt_cache_key": 5}, "prompt_cache_key"),
                        ({"service_tier": "turbo"}, "service_tier"), ({"prompt_cache_retention": "1y"},
                                                                      "prompt_cache_retention")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.compact(model=MODEL, input="x", extra_body=body)
        assert refused.value.body["param"] == param, refused.value.body


def test_service_tiers_and_cache_retention_are_openais_values(stack: Stack) -> None:
    """OpenAI's service tiers now include "fast" (chat, Responses, compact) and "ultrafast" (Responses): they were
    400s here, where every tier is served at this server's one, "default". prompt_cache_retention took any string
    where OpenAI takes "in_memory" or "24h" (a 400 otherwise, naming it); "in-memory", which older SDKs sent, too."""
    client = stack.sdk()
    for tier in ("fast", "ultrafast"):
        done = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, service_tier=tier)
        assert done.service_tier == "default"
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          service_tier="fast").choices
    assert client.responses.compact(model=MODEL, input="Hi", service_tier="fast").object == "response.compaction"
    kept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, prompt_cache_retention="in_memory")
    assert kept.prompt_cache_retention == "in_memory"
    older = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1,  # openai-python before f9d2d13
                                    prompt_cache_retention="in-memory")  # type: ignore[arg-type]
    assert older.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=1,
                                prompt_cache_retention="forever")  # type: ignore[arg-type]
    assert refused.value.body["param"] == "prompt_cache_retention" and refused.value.body["code"] == "invalid_value"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                       prompt_cache_retention="forever")  # type: ignore[arg-type]
    assert refused.value.body["param"] == "prompt_cache_retention"


def test_a_background_stream_names_its_response_as_soon_as_it_is_queued(stack: Stack) -> None:
    """`background=True, stream=True`: OpenAI's stream opens with ``response.created`` and ``response.queued``
    (status queued), then ``response.in_progress`` once the run starts. Its first event was sent only once the
    shard began (status in_progress, no ``response.queued``): a run waiting for a slot told its client nothing,
    not even the id it needs to resume or cancel it if the connection drops."""
    client = stack.sdk()
    with client.responses.stream(model=MODEL, input="Say hi.", max_output_tokens=6, background=True) as stream:
        events = list(stream)
    assert [(e.type, getattr(e, "response", None) and e.response.status) for e in events[:3]] == [
        ("response.created", "queued"), ("response.queued", "queued"), ("response.in_progress", "in_progress")]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete")
    rid = events[0].response.id
    with client.responses.retrieve(rid, stream=True, starting_after=1) as resumed:
        again = list(resumed)
    assert [e.sequence_number for e in again] == [e.sequence_number for e in events[2:]]
    assert client.responses.retrieve(rid).output_text == events[-1].response.output_text


def test_an_error_in_a_list_names_its_index_as_openai_does(stack: Stack) -> None:
    """The Responses API names an item of a list `tools[0].name`, as OpenAI does and as its own input errors did
    (`input[1].status`); errors from the checks it shares with the chat path said `tools.0.name`, and its body's
    `context_management.0.type`: two notations in one API."""
    auth = {"Authorization": f"Bearer {KEYS['plus']}"}
    loose = {"type": "object", "properties": {"a": {"type": "string"}}}
    for body, param in (({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
                        ({"tools": [WEATHER, {"type": "function", "parameters": loose}]}, "tools[1].name"),
                        ({"tools": [{"type": "function", "name": "f", "strict": True, "parameters": loose}]},
                         "tools[0].parameters"),
                        ({"context_management": [{"type": "bogus"}]}, "context_management[0].type")):
        for path in ("/v1/responses", "/v1/responses/input_tokens")[:1 if "context_management" in body else 2]:
            r = httpx.post(stack.gateway.url + path, json={"model": MODEL, "input": "x", **body}, headers=auth,
                           timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
            assert ".0." not in r.json()["error"]["message"] and ".1." not in r.json()["error"]["message"], r.text


def test_a_function_tool_field_openai_has_not_is_a_400_not_dropped(stack: Stack) -> None:
    """A Responses function tool's unknown field (a typo such as `paramters`, which left the tool without its
    schema) was dropped while the Response echoed it as if honoured; the chat path's tools answer 400 for one.
    OpenAI's own fields are served: output_schema (a no-op) and the tool-search and programmatic-calling
    fields at the values that change nothing here; other values are 400s naming them."""
    client = stack.sdk()
    for extra, param, code in (({"paramters": {"type": "object"}}, "tools[0].paramters", "unsupported_parameter"),
                               ({"defer_loading": True}, "tools[0].defer_loading", "unsupported_parameter"),
                               ({"allowed_callers": ["programmatic"]}, "tools[0].allowed_callers",
                                "unsupported_parameter")):
        for call in (client.responses.create, client.responses.input_tokens.count):
            with pytest.raises(openai.BadRequestError) as refused:
                call(model=MODEL, input="Hi", tools=[{**WEATHER, **extra}])  # type: ignore[operator]
            assert (refused.value.body["param"], refused.value.body["code"]) == (param, code), refused.value.body
    neutral = {**WEATHER, "defer_loading": False, "allowed_callers": ["direct"], "output_schema": {"type": "string"}}
    done = client.responses.create(model=MODEL, input="Hi", tools=[neutral], max_output_tokens=1)
    assert done.usage is not None and done.usage.output_tokens == 1


def test_metadata_past_its_bounds_is_worded_alike_on_every_route(stack: Stack) -> None:
    """`metadata` past OpenAI's bounds (16 pairs, keys of 64 and values of 512 characters) was refused in pydantic's
    words on create and chat ("metadata: Value error, at most 16 pairs, ...") and in other words on the
    Conversations routes, each with code invalid_value; now OpenAI's ("Invalid 'metadata': too many properties.
    Expected an object with at most 16 properties, but got an object with 17 properties instead.", its code)."""
    client = stack.sdk()
    conv = client.conversations.create()
    routes = [lambda m: client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, metadata=m),
              lambda m: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                       max_tokens=1, metadata=m),
              lambda m: client.conversations.create(metadata=m),
              lambda m: client.conversations.update(conv.id, metadata=m)]
    for metadata, code, words in (({f"k{i}": "v" for i in range(17)}, "object_above_max_properties",
                                   "but got an object with 17 properties instead."),
                                  ({"k" * 65: "v"}, "string_above_max_length", "a key with length 65 instead."),
                                  ({"k": "v" * 513}, "string_above_max_length", "a string with length 513 instead.")):
        for route in routes:
            with pytest.raises(openai.BadRequestError) as refused:
                route(metadata)
            body = refused.value.body
            assert (body["param"], body["code"]) == ("metadata", code), body
            assert body["message"].startswith("Invalid 'metadata': ") and body["message"].endswith(words), body
    assert client.conversations.update(conv.id, metadata={f"k{i}": "v" * 512 for i in range(16)}).metadata


def test_a_tool_choice_field_openai_has_not_is_a_400_not_dropped(stack: Stack) -> None:
    """A function or allowed_tools `tool_choice` with a field OpenAI's has not (`{"type": "function", "nmae":
    ...}` beside its name, an allowed tool's `function` level copied from chat) was served with the field dropped;
    now the chat path's 400, naming it."""
    client = stack.sdk()
    for choice, param in (({"type": "function", "name": "get_weather", "strict": True}, "tool_choice.strict"),
                          ({"type": "allowed_tools", "mode": "auto", "tools": [
                              {"type": "function", "name": "get_weather", "function": {"name": "get_weather"}}]},
                           "tool_choice.tools[0].function"),
                          ({"type": "allowed_tools", "mode": "auto", "tools": [], "parallel": False},
                           "tool_choice.parallel")):
        for call in (client.responses.create, client.responses.input_tokens.count):
            with pytest.raises(openai.BadRequestError) as refused:
                call(model=MODEL, input="Hi", tools=[WEATHER], tool_choice=choice)  # type: ignore[operator]
            assert (refused.value.body["param"], refused.value.body["code"]) == (param, "unsupported_parameter")
    done = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=30,
                                   tool_choice={"type": "allowed_tools", "mode": "required",
                                                "tools": [{"type": "function", "name": "get_weather"}]})
    assert done.output[0].type == "function_call"


def test_a_chat_field_sent_to_responses_is_refused_by_its_own_name(stack: Stack) -> None:
    """An app moving from Chat Completions sends `max_tokens`: the 400 said "Unrecognized request argument
    supplied: max_output_tokens" (param max_output_tokens), the field to use named as the one not supported;
    `messages` was param `input`, `response_format` param `text.format`. The body's own error was renamed as
    a chat path's error is, on the way out of the handler."""
    client = stack.sdk()
    for field, value, theirs in (("max_tokens", 5, "max_output_tokens"), ("messages", [], "input"),
                                 ("response_format", {"type": "json_object"}, "text.format")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="Hi", extra_body={field: value})
        assert (refused.value.body["param"], refused.value.body["code"]) == (field, "unsupported_parameter")
        message = refused.value.body["message"]
        assert message.startswith(f"Unrecognized request argument supplied: {field} ") and f"'{theirs}'" in message
