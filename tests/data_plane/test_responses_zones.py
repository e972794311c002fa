"""A Responses chain and a conversation across zones: turn 1 through zone A's gateway, turn 2 through
zone B's, with the openai SDK against real processes on loopback.

    PYTHONPATH=$PWD .venv/bin/python -m pytest tests/data_plane/test_responses_zones.py -q      # ~15 s

Two zones on one machine (each a shard and a cache node started with ``--zone``; one gateway per
zone), as `switchboard up --zones a,b` lays them out. A paid key's records have a replica in each
zone, so zone B's gateway continues what zone A's made, with the same context: its turn 2 sends the
model exactly the prompt zone A's gateway sends for the same turn (the synthetic engine answers with
words derived from the prompt, so the same prompt gives the same answer). A free key's records live
in the zone that made them (one replica, local), like free X-Session-Id sessions: zone B answers 404.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support.cluster import ADMIN_TOKEN, KEYS
from tests.support.metrics import metric
from tests.support.procs import Service
from tests.support.zones import start_zones, zone_gateway

ZONES = ("a", "b")


@pytest.fixture(scope="module")
def gateways() -> Iterator[dict[str, Service]]:
    cp = Service(["control-plane", "--admin-token", ADMIN_TOKEN, "--warmup", "0"])
    members = [Service([*args, "--registry-url", cp.url, "--node-id", f"{args[0]}-{z}", "--zone", z])
               for z in ZONES for args in (["shard", "--engine", "synthetic", "--synthetic-token-delay-ms", "1"],
                                           ["cache-node"])]
    gws = {z: zone_gateway(cp.url, z) for z in ZONES}
    for svc in (cp, *members, *gws.values()):
        svc.ready_timeout = 240  # two cores shared by a loaded machine: start-up can take minutes
    started: list[Service] = []
    try:
        cp.start()
        started.append(cp)
        start_zones(members, gws, started)
        yield gws
    finally:
        for svc in reversed(started):
            svc.stop()


def sdk(gw: Service, tier: str = "plus") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS[tier], max_retries=0, timeout=30)


def test_chain_made_in_zone_a_continues_in_zone_b(gateways: dict[str, Service]) -> None:
    a, b = sdk(gateways["a"]), sdk(gateways["b"])
    r1 = a.responses.create(model="synthetic", input="my bike has eleven sprockets and a long cage derailleur",
                            instructions="answer briefly", max_output_tokens=8, temperature=0)
    assert b.responses.retrieve(r1.id).output_text == r1.output_text  # the record is readable from zone B
    via_b = b.responses.create(model="synthetic", input="how many sprockets", previous_response_id=r1.id,
                               max_output_tokens=8, temperature=0)
    via_a = a.responses.create(model="synthetic", input="how many sprockets", previous_response_id=r1.id,
                               max_output_tokens=8, temperature=0)  # the same turn, branching in zone A
    assert via_b.usage is not None and via_a.usage is not None and r1.usage is not None
    # turn 2 carried turn 1 (instructions, input and answer) and is the same prompt in both zones
    assert via_b.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    assert via_b.usage.input_tokens == via_a.usage.input_tokens
    assert via_b.output_text == via_a.output_text
    # and zone B's chain goes on from zone B's response, in zone A too
    r3 = a.responses.create(model="synthetic", input="thanks", previous_response_id=via_b.id, max_output_tokens=4)
    assert r3.usage is not None and r3.usage.input_tokens > via_b.usage.input_tokens + via_b.usage.output_tokens
    assert metric(gateways["b"].url, "switchboard_router_zone_decisions_total", locality="local") >= 1


def test_conversation_made_in_zone_a_continues_in_zone_b(gateways: dict[str, Service]) -> None:
    a, b = sdk(gateways["a"]), sdk(gateways["b"])
    conv = a.conversations.create(metadata={"zone": "a"})
    r1 = a.responses.create(model="synthetic", input="remember the code word walnut", conversation=conv.id,
                            max_output_tokens=6, temperature=0)
    assert b.conversations.retrieve(conv.id).metadata == {"zone": "a"}
    r2 = b.responses.create(model="synthetic", input="what was the code word", conversation=conv.id,
                            max_output_tokens=6, temperature=0)
    assert r1.usage is not None and r2.usage is not None
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    items = a.conversations.items.list(conv.id, order="asc")  # zone B's turn is in zone A's view
    texts = [i.content[0].text for i in items.data if i.type == "message"]  # type: ignore[union-attr]
    assert texts == ["remember the code word walnut", r1.output_text, "what was the code word", r2.output_text]


def test_free_records_stay_in_their_zone(gateways: dict[str, Service]) -> None:
    a, b = sdk(gateways["a"], "free"), sdk(gateways["b"], "free")
    r1 = a.responses.create(model="synthetic", input="hello from zone a", max_output_tokens=4)
    assert a.responses.retrieve(r1.id).id == r1.id
    with pytest.raises(openai.BadRequestError) as e:  # one replica, in zone A: zone B does not have it
        b.responses.create(model="synthetic", input="and now", previous_response_id=r1.id, max_output_tokens=4)
    assert e.value.code == "previous_response_not_found"
