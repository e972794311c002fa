"""A request with n choices holds n admission slots through a real gateway (a synthetic shard, loopback).

    .venv/bin/python -m pytest tests/data_plane/test_admission_choices.py -q     # ~10 s

A shard decodes each choice as its own sequence in its batch. Counted as one slot, a free key's three
`n: 8` requests held 24 sequences on a 16-slot shard, past the reserve admission leaves for the tiers
above, and an enterprise request waited ~10 s for its first token (0.2 s unloaded).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.metrics import metric
from tests.support.procs import Service
from tests.support.waits import eventually

FREE = "sk-choices-free-0123456789"
ENTERPRISE = "sk-choices-ent-0123456789"


@pytest.fixture(scope="module")
def gateway() -> Iterator[Service]:
    """Eight slots: free may fill 6 of them (two reserve levels of 12.5 %), enterprise all 8."""
    keys = f"{FREE}:acme:free,{ENTERPRISE}:globex:enterprise"
    with Service(["shard", "--engine", "synthetic", "--synthetic-token-delay-ms", "40"]) as shard, \
            Service(["gateway", "--shard-urls", shard.url, "--tokenizer", "whitespace", "--model-name", "synthetic",
                     "--max-inflight", "8", "--queue-timeouts", "free=1"], env={"SWITCHBOARD_GATEWAY_API_KEYS": keys}) as gw:
        yield gw


def body(n: int, max_tokens: int) -> dict[str, object]:
    return {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "n": n, "ignore_eos": True, "stream": True}


def test_a_request_with_n_choices_holds_n_slots_and_the_reserve_stays_free(gateway: Service) -> None:
    def inflight() -> float:
        return metric(gateway.url, "switchboard_admission_inflight")

    with httpx.Client(timeout=60) as client, \
            client.stream("POST", gateway.url + "/v1/chat/completions", json=body(4, 250),
                          headers={"Authorization": f"Bearer {FREE}"}) as held:
        assert held.status_code == 200
        lines = held.iter_lines()
        next(lines)  # the stream is open: its slots are held
        eventually(lambda: inflight() == 4, 10, what="four slots held for n=4")
        # 4 + 4 would pass free's 6 of 8: the second waits, and is shed at free's deadline (1 s here)
        second = client.post(gateway.url + "/v1/chat/completions", json={**body(4, 4), "stream": False},
                             headers={"Authorization": f"Bearer {FREE}"}, timeout=60)
        assert second.status_code == 503 and second.json()["error"]["code"] == "overloaded", second.text
        # the reserve was kept for the tiers above: enterprise starts at once
        ent = client.post(gateway.url + "/v1/chat/completions", json={**body(2, 2), "stream": False},
                          headers={"Authorization": f"Bearer {ENTERPRISE}"})
        assert ent.status_code == 200 and len(ent.json()["choices"]) == 2, ent.text
        held.close()
    eventually(lambda: inflight() == 0, 10, what="every slot released")
