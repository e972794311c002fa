"""The chat path's phase values (data_plane/gateway/phases.py): the shard request built once from a
checked request, its wire form, and the system/history merge.

    .venv/bin/python -m pytest tests/data_plane/test_gateway_phases.py -q      # < 1 s, no processes
"""

from __future__ import annotations

import json

import pytest

from data_plane.common.errors import InvalidRequest
from data_plane.gateway.abuse import Measures
from data_plane.gateway.auth import Principal
from data_plane.gateway.context import Window
from data_plane.gateway.phases import Caller, Checked, merge_history, shard_request
from data_plane.protocol import ChatCompletionRequest, ShardRequest, parse_chat_request
from data_plane.tiers import TierPolicy

TIERS = TierPolicy.default()


def _caller() -> Caller:
    return Caller(Principal("k1", "acme", "plus"), TIERS.get("plus"), TIERS, Measures())


def _checked(body: dict[str, object]) -> Checked:
    req = ChatCompletionRequest.model_validate(body)
    return Checked(req, "m", 2048, 64, req.plain_messages(tools_prompt=False), 0)


def test_the_shard_request_carries_the_window_the_caps_and_the_clients_fields_as_given() -> None:
    checked = _checked({"model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                                   {"role": "user", "content": "hi"}],
                        "temperature": 0.5, "stop": "x", "response_format": {"type": "json_schema", "json_schema": {
                            "name": "n", "schema": {"type": "object"}}}, "user": "not-forwarded"})
    window = Window(checked.messages, 9, 0)
    request = shard_request(checked, _caller(), window, 32, request_id="r1", deadline=5.0, session_id="sess_1",
                            kv_ttl_s=60.0)
    plus = TIERS.get("plus")
    assert request.wire() == {
        "model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 32, "stream": True, "temperature": 0.5, "stop": ["x"],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
        "priority": plus.priority, "cache_salt": "tenant:acme", "request_id": "r1", "deadline": 5.0,
        "session_id": "sess_1", "kv_replicas": plus.replication, "kv_ttl_s": 60.0}
    # the shard reads the wire form back as the request it is
    assert ChatCompletionRequest.model_validate(json.loads(json.dumps(request.wire()))).max_tokens == 32


def test_a_request_without_model_or_session_sends_neither() -> None:
    request = shard_request(_checked({"messages": [{"role": "user", "content": "hi"}]}), _caller(),
                            Window([{"role": "user", "content": "hi"}], 1, 0), 8, request_id="r2", deadline=1.0,
                            session_id=None, kv_ttl_s=60.0)
    assert set(request.wire()) == {"messages", "max_tokens", "stream", "priority", "cache_salt", "request_id",
                                   "deadline"}
    assert isinstance(request, ShardRequest) and request.model_config.get("frozen")


def test_new_system_messages_replace_the_stored_ones_in_front() -> None:
    history = [{"role": "system", "content": "old"}, {"role": "user", "content": "a"},
               {"role": "assistant", "content": "b"}]
    assert merge_history(history, [{"role": "user", "content": "c"}]) == [*history, {"role": "user", "content": "c"}]
    new = [{"role": "user", "content": "c"}, {"role": "system", "content": "new"}]
    assert merge_history(history, new) == [{"role": "system", "content": "new"}, {"role": "user", "content": "a"},
                                           {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]


def test_a_clients_continuation_reaches_the_shard_and_is_refused_with_a_session() -> None:
    """continue_final_message (vLLM's) was accepted and then dropped: the shard answered the partial
    assistant message with a new turn. It is sent on; with a session (whose transcript keeps whole turns)
    it is a 400 naming it."""
    body = {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "It is"}],
            "continue_final_message": True, "add_generation_prompt": False}
    checked = _checked(body)
    request = shard_request(checked, _caller(), Window(checked.messages, 9, 0), 8, request_id="r3", deadline=1.0,
                            session_id=None, kv_ttl_s=60.0)
    wire = request.wire()
    assert wire["continue_final_message"] is True and wire["add_generation_prompt"] is False
    assert wire["messages"][-1] == {"role": "assistant", "content": "It is"}
    raw = json.dumps(body).encode()
    assert parse_chat_request(raw, "application/json").continue_final_message
    for session in ("new", "sess_abc"):
        with pytest.raises(InvalidRequest) as err:
            parse_chat_request(raw, "application/json", session)
        assert err.value.param == "continue_final_message"
    # with tools the reply is the tool envelope, which the client's text is not: a 400 that says so, not the
    # grammar's "the output already sent does not follow the schema"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(InvalidRequest, match="or tools") as err:
        parse_chat_request(json.dumps({**body, "tools": tools}).encode(), "application/json")
    assert err.value.param == "continue_final_message"
