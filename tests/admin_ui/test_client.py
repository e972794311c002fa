"""The console's HTTP client against a real control plane and gateway: every failure has its name."""

from __future__ import annotations

import pytest

from admin_ui.client import (
    AdminClient,
    ChatDelta,
    ChatEnd,
    ChatStart,
    GatewayClient,
    NotAvailable,
    Rejected,
    Unauthorized,
    Unreachable,
)
from tests.support.cluster import ADMIN_TOKEN
from tests.support.procs import free_port


@pytest.fixture
def client(cluster):
    c = AdminClient(cluster.control_plane.url, ADMIN_TOKEN)
    yield c
    c.close()


def test_members_come_back_as_listed(client):
    ids = {m["id"] for m in client.members()["members"]}
    assert {"shard-0", "shard-1"} <= ids


def test_nothing_listening_is_unreachable():
    c = AdminClient(f"http://127.0.0.1:{free_port()}", ADMIN_TOKEN, timeout_s=1)
    with pytest.raises(Unreachable):
        c.members()
    assert c.health() is False


def test_wrong_token_is_unauthorized(cluster):
    with pytest.raises(Unauthorized):
        AdminClient(cluster.control_plane.url, "nope").members()


def test_a_missing_route_is_not_available_but_a_missing_member_is_rejected(client, cluster):
    with pytest.raises(NotAvailable):
        client._call("GET", "/no-such-endpoint")
    with pytest.raises(Rejected) as exc:
        client.drain("no-such-member")
    assert exc.value.status == 404 and "no-such-member" in exc.value.message


def test_an_invalid_tier_policy_is_rejected_with_the_servers_words(client):
    try:
        client.tiers()
    except NotAvailable:
        pytest.skip("/admin/v1/tiers is not available yet")
    with pytest.raises(Rejected) as exc:
        client.put_tiers({"tiers": {"free": {"priority": 1}}})
    assert exc.value.status == 400 and exc.value.message


def test_gateway_chat_streams_with_ids_and_usage(cluster):
    events = list(GatewayClient(cluster.gateway.url).stream_chat(
        cluster.keys["plus"], [{"role": "user", "content": "hi"}], max_tokens=8))
    start, end = events[0], events[-1]
    assert isinstance(start, ChatStart) and start.status == 200 and start.request_id and len(start.trace_id) == 32
    assert any(isinstance(e, ChatDelta) for e in events)
    assert isinstance(end, ChatEnd) and end.error is None and end.usage["completion_tokens"] > 0


def test_gateway_responses_api_keeps_the_conversation(cluster):
    gw = GatewayClient(cluster.gateway.url)
    first = list(gw.stream_response(cluster.keys["plus"], "hi there", max_tokens=8))
    end = first[-1]
    assert isinstance(end, ChatEnd) and end.error is None and end.response_id.startswith("resp_")
    assert any(isinstance(e, ChatDelta) for e in first)
    second = list(gw.stream_response(cluster.keys["plus"], "and then", max_tokens=8,
                                     previous_response_id=end.response_id))[-1]
    assert second.error is None and second.usage["prompt_tokens"] > end.usage["prompt_tokens"] + 8


def test_gateway_refusal_ends_the_stream_with_its_error(cluster):
    events = list(GatewayClient(cluster.gateway.url).stream_chat("sk-wrong-key-000000", [{"role": "user",
                                                                                           "content": "hi"}]))
    assert events[0].status == 401
    assert isinstance(events[-1], ChatEnd) and events[-1].error
