"""The WebSocket mode's refusals with a real gateway and synthetic shard: a 429 frame carries the HTTP answer's
retry headers (data_plane/gateway/responses_socket.py `error_frame`), read by the openai SDK's own event type."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from openai.types.responses.responses_server_event import ResponseWsError
from websockets.sync.client import connect

from tests.support.procs import Service

KEY = "sk-wslim-free-0123456789"
TIERS = {"tiers": {"free": {"priority": 2, "rpm": 1, "tpm": 20000, "max_context_tokens": 2048,
                            "max_output_tokens": 256, "replication": 1, "shed_order": 0}}}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One gateway whose key may send one request a minute."""
    path: Path = tmp_path_factory.mktemp("ws-limits") / "tiers.yaml"
    path.write_text(yaml.safe_dump(TIERS))
    with Service(["shard", "--engine", "synthetic", "--synthetic-token-delay-ms", "0"]) as shard, \
            Service(["gateway", "--shard-urls", shard.url, "--tokenizer", "whitespace", "--model-name", "synthetic",
                     "--tiers-file", str(path)], env={"SWITCHBOARD_GATEWAY_API_KEYS": f"{KEY}:acme:free"}) as gw:
        yield gw


def test_a_429_frame_carries_the_retry_headers(gateway: Service) -> None:
    """The frame's error lost Retry-After, retry-after-ms, x-should-retry and x-ratelimit-*: a client on the
    socket could not back off. They are now the error's `headers`, as OpenAI's WebSocket mode sends them."""
    url = gateway.url.replace("http://", "ws://") + "/v1/responses"
    frame = json.dumps({"type": "response.create", "model": "synthetic", "input": "hi", "max_output_tokens": 2,
                        "store": False})
    with connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}, open_timeout=30) as ws:
        ws.send(frame)
        while (event := json.loads(ws.recv(timeout=30)))["type"] not in ("response.completed", "response.incomplete"):
            assert event["type"] != "error", event
        ws.send(frame)  # the minute's second request: 429
        refused = json.loads(ws.recv(timeout=30))
    assert refused["type"] == "error" and refused["status"] == 429, refused
    event = ResponseWsError.model_validate(refused)  # the SDK's type reads it, headers and all
    assert event.error.code == "rate_limit_exceeded" and event.error.headers is not None, refused
    headers = event.error.headers
    assert float(headers["retry-after"]) > 0 and float(headers["retry-after-ms"]) > 0, headers
    assert headers["x-ratelimit-limit-requests"] == "1" and headers["x-ratelimit-remaining-requests"] == "0", headers
    assert "content-length" not in headers and "content-type" not in headers
