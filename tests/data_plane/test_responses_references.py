"""`item_reference` inputs, and the Response object's echoes and query checks: the real model, two cache
nodes and a gateway on loopback (test_responses_api.py's stack), driven by the openai SDK."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.data_plane import test_responses_api
from tests.data_plane.test_responses_api import MODEL, Stack
from tests.support.cluster import KEYS

stack = test_responses_api.stack
"""That module's stack (the fixture), for this module's own instance."""


def ref(item_id: str) -> dict:
    return {"type": "item_reference", "id": item_id}


def test_an_item_reference_is_the_stored_item_it_names(stack: Stack) -> None:
    """Input and output items of a stored response resolve (the prompt is the one the items themselves
    make), in a plain request, after previous_response_id and in a conversation."""
    sdk = stack.sdk()
    first = sdk.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4, temperature=0)
    (asked,) = sdk.responses.input_items.list(first.id).data
    answer = first.output[0]
    literal = [{"type": "message", "role": "user", "content": "Name a colour."},
               {"type": "message", "role": "assistant", "content": first.output_text}]
    by_ref = [ref(asked.id), ref(answer.id)]
    count = sdk.responses.input_tokens.count
    assert count(model=MODEL, input=by_ref).input_tokens == count(model=MODEL, input=literal).input_tokens
    second = sdk.responses.create(model=MODEL, input=[*by_ref, {"role": "user", "content": "Another?"}],
                                  max_output_tokens=4, temperature=0)
    got = sdk.responses.input_items.list(second.id, order="asc").data
    assert [i.id for i in got[:2]] == [asked.id, answer.id]
    assert got[1].content[0].text == first.output_text and got[0].content[0].text == "Name a colour."
    # with previous_response_id: an item of another response joins the chain
    other = sdk.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=4, temperature=0)
    chained = sdk.responses.create(model=MODEL, previous_response_id=second.id, input=[ref(other.output[0].id)],
                                   max_output_tokens=4, temperature=0)
    assert [i.id for i in sdk.responses.input_items.list(chained.id).data] == [other.output[0].id]
    # in a conversation: a conversation's item, and a response's, both resolve; the turn holds them
    conv = sdk.conversations.create(items=[{"type": "message", "role": "user", "content": "I like blue."}])
    (held,) = sdk.conversations.items.list(conv.id).data
    conv2 = sdk.conversations.create()
    sdk.responses.create(model=MODEL, conversation=conv2.id, input=[ref(held.id), ref(other.output[0].id)],
                         max_output_tokens=4, temperature=0)
    ids = [i.id for i in sdk.conversations.items.list(conv2.id, order="asc").data]
    assert ids[:2] == [held.id, other.output[0].id] and len(ids) == 3
    sdk.conversations.items.create(conv2.id, items=[ref(answer.id)])
    assert sdk.conversations.items.retrieve(answer.id, conversation_id=conv2.id).id == answer.id


def _missing(sdk: openai.OpenAI, item_id: str) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        sdk.responses.create(model=MODEL, input=[ref(item_id)], max_output_tokens=2)
    assert e.value.body["param"] == "input" and item_id in e.value.body["message"]


def test_an_item_reference_resolves_for_its_key_only_and_never_once_deleted(stack: Stack) -> None:
    sdk = stack.sdk()
    first = sdk.responses.create(model=MODEL, input="Say hi.", max_output_tokens=3, temperature=0)
    (asked,) = sdk.responses.input_items.list(first.id).data
    _missing(stack.sdk("plus2"), first.output[0].id)  # another key of the same tenant: OpenAI's unknown id
    _missing(sdk, "msg_never_stored")
    with pytest.raises(openai.NotFoundError):
        sdk.responses.input_tokens.count(model=MODEL, input=[ref("msg_never_stored")])
    unstored = sdk.responses.create(model=MODEL, input="Say hi.", max_output_tokens=3, store=False)
    _missing(sdk, unstored.output[0].id)
    sdk.responses.delete(first.id)
    _missing(sdk, first.output[0].id)
    _missing(sdk, asked.id)
    conv = sdk.conversations.create(items=[{"role": "user", "content": "one"}, {"role": "user", "content": "two"}])
    one, two = sdk.conversations.items.list(conv.id, order="asc").data
    sdk.conversations.items.delete(one.id, conversation_id=conv.id)
    _missing(sdk, one.id)
    assert sdk.responses.input_tokens.count(model=MODEL, input=[ref(two.id)]).input_tokens > 0
    sdk.conversations.delete(conv.id)
    _missing(sdk, two.id)
    r = httpx.post(stack.gateway.url + "/v1/conversations", json={"items": [ref("msg_never_stored")]},
                   headers={"Authorization": f"Bearer {KEYS['plus']}"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "items", r.text
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model=MODEL, input=[{"type": "item_reference", "id": 7}], max_output_tokens=2)
    assert e.value.body["param"] == "input[0].id"


def test_too_many_distinct_references_are_a_400_before_any_read(stack: Stack) -> None:
    """Each distinct id costs cache reads before admission: more than MAX_REFERENCES is refused at once;
    MAX_REFERENCES are read (and here, none is stored: a 404 naming the first)."""
    from data_plane.gateway.item_index import MAX_REFERENCES

    sdk = stack.sdk()
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model=MODEL, input=[ref(f"msg_{i}") for i in range(MAX_REFERENCES + 1)],
                             max_output_tokens=2)
    assert e.value.body["param"] == "input" and str(MAX_REFERENCES) in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        sdk.responses.create(model=MODEL, input=[ref(f"msg_{i}") for i in range(MAX_REFERENCES)], max_output_tokens=2)
    assert e.value.body["param"] == "input" and "msg_0" in e.value.body["message"]


def test_text_verbosity_is_echoed_and_checked(stack: Stack) -> None:
    """OpenAI's Response echoes text.verbosity ("medium" unless the request said), created and retrieved."""
    sdk = stack.sdk()
    plain = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert plain.text.verbosity == "medium" and plain.text.format.type == "text"
    low = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2, text={"verbosity": "low"})
    assert low.text.verbosity == "low" and sdk.responses.retrieve(low.id).text.verbosity == "low"
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2, text={"verbosity": "loud"})
    assert e.value.body["param"] == "text.verbosity" and "loud" in e.value.body["message"]


def test_retrieve_refuses_an_include_value_openai_does_not_define(stack: Stack) -> None:
    sdk = stack.sdk()
    made = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert sdk.responses.retrieve(made.id, include=["message.output_text.logprobs"]).id == made.id
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.retrieve(made.id, include=["message.output_text.logprobz"])  # type: ignore[list-item]
    assert e.value.body["param"] == "include[0]" and "message.output_text.logprobz" in e.value.body["message"]
    r = httpx.get(f"{stack.gateway.url}/v1/responses/{made.id}", params={"include": "nope"},
                  headers={"Authorization": f"Bearer {KEYS['plus']}"})
    assert r.status_code == 400 and "'nope'" in r.json()["error"]["message"], r.text


def test_a_query_parameter_error_carries_a_request_id_and_a_trace_id(stack: Stack) -> None:
    """As every other error does (a complaint leads to the trace), though FastAPI refuses it before the route."""
    made = stack.sdk().responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    auth = {"Authorization": f"Bearer {KEYS['plus']}"}
    for path in (f"/v1/responses/{made.id}/input_items?limit=many", f"/v1/responses/{made.id}?stream=maybe"):
        r = httpx.get(stack.gateway.url + path, headers=auth)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] in ("limit", "stream"), r.text
        assert len(err["request_id"]) == 32 and len(err["trace_id"]) == 32 and set(err["trace_id"]) != {"0"}, err
        assert r.headers["x-request-id"] == err["request_id"]


def test_calls_cut_by_the_output_limit_agree_streamed_stored_and_not(stack: Stack) -> None:
    """Parallel calls until max_output_tokens: an incomplete response keeps what was generated (OpenAI's),
    so the last call, cut before or inside its arguments, is an incomplete item in the stream's events,
    its final response, the stored response and the non-streamed one alike."""
    sdk = stack.sdk()
    tool = {"type": "function", "name": "weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    ask = {"model": MODEL, "input": "What is the weather in Paris, London, Rome, Berlin and Madrid?",
           "tools": [tool], "tool_choice": "required", "parallel_tool_calls": True, "temperature": 0,
           "extra_body": {"cache": {"no-cache": True}}}

    def calls(output: list) -> list[tuple[str, str, str]]:
        return [(i.name, i.arguments, i.status) for i in output if i.type == "function_call"]

    for limit in (26, 28, 39):  # greedy: cut before the last call's arguments, inside them, before them
        with sdk.responses.stream(**ask, max_output_tokens=limit) as stream:
            events = list(stream)
        final = events[-1].response
        announced = [e.item for e in events if e.type == "response.output_item.done"]
        plain = sdk.responses.create(**ask, max_output_tokens=limit)
        stored = sdk.responses.retrieve(final.id)
        assert final.status == plain.status == stored.status == "incomplete"
        assert calls(announced) == calls(final.output) == calls(stored.output) == calls(plain.output), limit
        assert len(calls(plain.output)) >= 2 and calls(plain.output)[-1][2] == "incomplete", plain.output
        assert [(i.id, i.call_id) for i in announced] == [(i.id, i.call_id) for i in stored.output]
