"""Requests typed by the installed openai SDK that the gateway answered otherwise than OpenAI's API does:
a reasoning item in a replayed Responses history, the create body's newer fields (`background_options`,
`access_programs`, `image`), a chat message with an empty content array, and a custom tool's call in a chat
history. The real model, two cache nodes and a gateway on loopback (test_responses_api.py's stack), driven by
the openai SDK.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_sdk_request_odds.py -q
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from openai.types.responses import ResponseReasoningItem
from openai.types.responses.response_create_params import ResponseCreateParamsStreaming
from openai.types.responses.response_reasoning_item import Summary

from data_plane.gateway.responses_items import ResponsesRequest
from tests.data_plane import test_responses_api
from tests.data_plane.test_responses_api import MODEL, Stack
from tests.support.cluster import KEYS
from tests.support.waits import eventually

stack = test_responses_api.stack
"""That module's stack (the fixture), for this module's own instance."""

REASONING = ResponseReasoningItem(id="rs_1", type="reasoning",
                                  summary=[Summary(type="summary_text", text="The user greets; greet back.")])
"""A reasoning item as the SDK hands one back from an OpenAI reasoning model (replayed with model_dump)."""


def _refused(call: Any, **kwargs: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as bad:
        call(**kwargs)
    body: dict[str, Any] = bad.value.body  # type: ignore[assignment]
    assert body["type"] == "invalid_request_error", body
    return body


def test_a_reasoning_item_in_the_history_is_accepted_and_withheld_from_the_model(stack: Stack) -> None:
    """A history replayed from an OpenAI reasoning model (or the Agents SDK handing off between models) holds
    reasoning items: each was a 400 "input item type 'reasoning' is not supported". As OpenAI does for a model
    that does not reason, the item is accepted and withheld from the prompt (the same input-token count as
    without it), the Response says so in `input_transformations`; a conversation stores and lists it; a
    reasoning item of the wrong shape is a 400 naming its field."""
    client = stack.sdk()
    user, reply = {"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi! How can I help?"}
    follow = {"role": "user", "content": "Say hello again."}
    with_reasoning = [user, REASONING.model_dump(), reply, follow]
    served = client.responses.create(model=MODEL, input=with_reasoning, max_output_tokens=4)  # type: ignore[arg-type]
    assert served.status in ("completed", "incomplete") and served.usage is not None
    assert [(t.id, t.type, t.action, t.reason) for t in served.input_transformations or []] == [
        ("rs_1", "reasoning", "removed", "model_mismatch")]
    bare = [{"type": "reasoning", "id": "rs_2", "summary": []}]  # the probe's: an empty summary
    count = client.responses.input_tokens.count(model=MODEL, input=[user, *bare, reply, follow])  # type: ignore[list-item]
    assert count.input_tokens == client.responses.input_tokens.count(model=MODEL, input=[user, reply, follow]).input_tokens
    assert served.usage.input_tokens == count.input_tokens  # the summary never reached the prompt
    streamed = list(client.responses.create(model=MODEL, input=with_reasoning, max_output_tokens=2, stream=True))  # type: ignore[arg-type]
    assert streamed[-1].type in ("response.completed", "response.incomplete")

    conv = client.conversations.create(items=[user, REASONING.model_dump(), reply])  # type: ignore[list-item]
    listed = client.conversations.items.list(conv.id, order="asc").data
    assert [item.type for item in listed] == ["message", "reasoning", "message"]
    assert client.responses.create(model=MODEL, conversation=conv.id, input="Again?", max_output_tokens=2).usage

    bad = [({"id": "rs_3"}, "input[1].summary", "missing_required_parameter"),
           ({"id": "rs_3", "summary": [{"type": "text", "text": "x"}]}, "input[1].summary[0]", None),
           ({"id": "rs_3", "summary": "x"}, "input[1].summary", None),
           ({"id": "rs_3", "summary": [], "content": [{"type": "summary_text", "text": "x"}]}, "input[1].content[0]", None),
           ({"id": "rs_3", "summary": [], "encrypted_content": 5}, "input[1].encrypted_content", None),
           ({"id": "rs_3", "summary": [], "thoughts": "x"}, "input[1].thoughts", "unknown_parameter"),
           ({"id": "rs_3", "summary": [], "status": "done"}, "input[1].status", "invalid_value")]
    for fields, param, code in bad:
        body = _refused(client.responses.create, model=MODEL, max_output_tokens=1,
                        input=[user, {"type": "reasoning", **fields}, reply, follow])
        assert body["param"] == param, body
        assert code is None or body["code"] == code, body


SDK_CHECKED = (3, 63, 0)
"""The openai release whose Responses create params were all checked here."""


def test_a_reasoning_item_without_an_id_is_accepted_and_stored_under_one_of_ours(stack: Stack) -> None:
    """OpenAI's Responses API takes a reasoning item without its id: Codex never sends one, nor does the
    Agents SDK with `RunConfig(reasoning_item_id_policy="omit")` (its documented cure for OpenAI's "provided
    without its required following item" 400), nor the AI SDK with `store: false`. Each was a 400
    "Missing required parameter: 'input[1].id'" here. Served now, withheld from the model like any reasoning
    item; stored (and listed, and named in `input_transformations`) under an `rs_` id of ours, the way a
    message sent without an id is; a conversation takes one too."""
    from agents import Agent
    from agents.items import ReasoningItem
    from agents.run_internal.items import run_item_to_input_item

    client = stack.sdk()
    sent = ResponseReasoningItem(id="rs_openai", type="reasoning", encrypted_content="gAAAA-opaque",
                                 summary=[Summary(type="summary_text", text="The user greets; greet back.")])
    idless = run_item_to_input_item(ReasoningItem(agent=Agent(name="a"), raw_item=sent), "omit")
    assert isinstance(idless, dict) and "id" not in idless  # what the Agents SDK sends
    user, reply = {"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi! How can I help?"}
    follow = {"role": "user", "content": "Say hello again."}
    served = client.responses.create(model=MODEL, input=[user, idless, reply, follow], max_output_tokens=2)  # type: ignore[list-item]
    assert served.usage is not None
    assert served.usage.input_tokens == client.responses.input_tokens.count(
        model=MODEL, input=[user, reply, follow]).input_tokens  # type: ignore[list-item]
    stored = [i for i in client.responses.input_items.list(served.id, order="asc").data if i.type == "reasoning"]
    assert len(stored) == 1 and stored[0].id.startswith("rs_") and stored[0].id != "rs_openai"
    assert [(t.id, t.reason) for t in served.input_transformations or []] == [(stored[0].id, "model_mismatch")]
    assert client.responses.retrieve(served.id).input_transformations == served.input_transformations
    conv = client.conversations.create(items=[user, idless, reply])  # type: ignore[list-item]
    listed = client.conversations.items.list(conv.id, order="asc").data
    assert listed[1].type == "reasoning" and listed[1].id.startswith("rs_")


def test_every_field_of_the_sdks_create_body_is_a_field_here() -> None:
    """The installed SDK's create params: a field it types that the body does not know is a 400
    "Unrecognized request argument" for any app that sets it (background_options, access_programs and
    image were)."""
    typed = ResponseCreateParamsStreaming.__required_keys__ | ResponseCreateParamsStreaming.__optional_keys__
    missing = typed - set(ResponsesRequest.model_fields)
    installed = tuple(int(p) for p in openai.__version__.split(".")[:3] if p.isdigit())
    if missing and installed > SDK_CHECKED:
        # the SDK is not pinned: a field added by a later release must not turn CI red on a commit that did not
        # change the API; the skip names the fields (pytest -rs prints it) for the next session to serve
        pytest.skip(f"openai {openai.__version__} types create fields not served yet: {sorted(missing)} "
                    f"(checked against {'.'.join(map(str, SDK_CHECKED))})")
    assert missing == set()


def test_the_sdks_newer_create_fields_are_served_at_values_that_mean_something_here(stack: Stack) -> None:
    """`background_options`, `access_programs` and `image` (openai-python's create params) were each a 400
    "Unrecognized request argument supplied". Served: the soonest window, any window for a background response
    (it starts at once, so it meets it), the Standard access program (echoed), image compression "auto" or
    "disabled" (no images here: the Response's effective policy is "disabled", on compact too). A value this
    server cannot honour, or that OpenAI refuses, is a 400 naming its field."""
    client = stack.sdk()
    ask: dict[str, Any] = {"model": MODEL, "input": "Hi", "max_output_tokens": 1}
    served = client.responses.create(**ask, background_options={"completion_window": "soonest", "continuation_id": "b7"},
                                     access_programs={"cyber": "standard"}, image={"context_compression": "auto"})
    assert served.usage is not None and served.usage.output_tokens == 1
    assert served.access_programs is not None and served.access_programs.cyber == "standard"
    assert served.image is not None and served.image.context_compression == "disabled"
    assert client.responses.create(**ask, image={"context_compression": "disabled"}).usage
    queued = client.responses.create(**ask, background=True, background_options={"completion_window": "8h"})
    eventually(lambda: client.responses.retrieve(queued.id).status in ("completed", "incomplete"), 60,
               what="the background response with an 8h window done")
    compacted = client.responses.compact(model=MODEL, input="Hello there", image={"context_compression": "auto"})
    assert compacted.output

    refused = [({"access_programs": {"cyber": "blue"}}, "access_programs.cyber", "invalid_value"),
               ({"image": {"context_compression": "enabled"}}, "image.context_compression", "unsupported_parameter"),
               ({"image": {"detail": "low"}}, "image.detail", "unsupported_parameter"),
               ({"background_options": {"completion_window": "2h"}}, "background_options.completion_window",
                "invalid_value"),  # OpenAI's: a discounted window needs background
               ({"background": True, "service_tier": "priority", "background_options": {"completion_window": "2h"}},
                "background_options.completion_window", "invalid_value"),
               ({"background_options": {"completion_window": "1h"}}, "background_options.completion_window",
                "invalid_value"),
               ({"background_options": {"continuation_id": ""}}, "background_options.continuation_id", None)]
    for extra, param, code in refused:
        body = _refused(client.responses.create, **ask, **extra)
        assert body["param"] == param, body
        assert code is None or body["code"] == code, body
    for program in ("daybreak_red", "daybreak_blue"):  # OpenAI's 403 for Daybreak access the caller lacks
        with pytest.raises(openai.PermissionDeniedError) as denied:
            client.responses.create(**ask, access_programs={"cyber": program})  # type: ignore[typeddict-item]
        said: dict[str, Any] = denied.value.body  # type: ignore[assignment]
        assert said["param"] == "access_programs.cyber" and said["code"] == "permission_denied", said
        assert program in said["message"]
    body = _refused(client.responses.compact, model=MODEL, input="Hi", image={"context_compression": "enabled"})
    assert body["param"] == "image.context_compression"


def test_a_chat_message_with_an_empty_content_array_is_openais_400(stack: Stack) -> None:
    """`{"role": "user", "content": []}` was served as an empty turn; OpenAI answers 400 "Invalid
    'messages[0].content': empty array. Expected an array with minimum length 1, but got an empty array
    instead." (code empty_array), streamed or not. An assistant's empty content (as null) is still served."""
    client = stack.sdk()
    for messages, at in (([{"role": "user", "content": []}], 0),
                         ([{"role": "system", "content": []}, {"role": "user", "content": "Hi"}], 0),
                         ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                           {"role": "user", "content": []}], 2)):
        for stream in (False, True):
            body = _refused(client.chat.completions.create, model=MODEL, messages=messages, max_tokens=1, stream=stream)
            assert body["message"] == (f"Invalid 'messages.{at}.content': empty array. Expected an array with minimum "
                                       "length 1, but got an empty array instead."), body
            assert body["param"] == f"messages.{at}.content" and body["code"] == "empty_array"
    reply = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": []}, {"role": "user", "content": "Hi"}])
    assert reply.usage is not None and reply.usage.completion_tokens == 1


def test_langchains_empty_tool_result_is_still_served(stack: Stack) -> None:
    """A LangChain tool that returns an empty list (a search with no hits) becomes `ToolMessage(content=[])`,
    which langchain-openai sends as `{"role": "tool", "content": []}`: served until the empty-array check
    made it a 400 empty_array, failing the agent's next step. Served again, as an empty result (as an
    assistant's empty array is), through ChatOpenAI itself; a user's empty array is still OpenAI's 400."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def search(query: str) -> list[str]:
        """Search the notes."""
        return []

    call = {"type": "tool_call", "id": "call_1", "name": "search", "args": {"query": "kiwi"}}
    result = search.invoke(call)
    assert isinstance(result, ToolMessage) and result.content == []  # what LangChain makes of it
    llm = ChatOpenAI(base_url=stack.gateway.url + "/v1", api_key=KEYS["plus"], model=MODEL, temperature=0,  # type: ignore[arg-type]
                     max_tokens=4, max_retries=0).bind_tools([search])
    reply = llm.invoke([HumanMessage("Find my notes on kiwi."), AIMessage(content="", tool_calls=[call]), result])
    assert isinstance(reply, AIMessage) and reply.usage_metadata and reply.usage_metadata["output_tokens"] >= 1
    body = _refused(stack.sdk().chat.completions.create, model=MODEL, max_tokens=1,
                    messages=[{"role": "user", "content": []}])
    assert body["code"] == "empty_array" and body["param"] == "messages.0.content", body


def test_a_custom_tool_call_in_the_history_is_a_400_naming_its_type(stack: Stack) -> None:
    """A custom tool's call (`{"type": "custom", "custom": {"name", "input"}}`, the SDK's
    ChatCompletionMessageCustomToolCallParam) in an assistant message was a 400 "Invalid type for
    'messages.1.tool_calls.0.function': expected an object, but got null instead.", a field the client never
    meant to send. This server serves function tools only: the 400 names the call's type."""
    client = stack.sdk()
    call = {"id": "call_1", "type": "custom", "custom": {"name": "run_sql", "input": "SELECT 1"}}
    messages = [{"role": "user", "content": "Run it"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
    body = _refused(client.chat.completions.create, model=MODEL, messages=messages, max_tokens=1)
    assert body["param"] == "messages.1.tool_calls.0.type" and body["code"] == "unsupported_parameter", body
    assert "'custom'" in body["message"] and "function" not in body["param"], body
