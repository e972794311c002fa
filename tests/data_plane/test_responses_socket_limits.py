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


def _tiers_file(folder: Path) -> Path:
    (folder / "tiers.yaml").write_text(yaml.safe_dump(TIERS))
    return folder / "tiers.yaml"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One gateway whose key may send one request a minute."""
    path = _tiers_file(tmp_path_factory.mktemp("ws-limits"))
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


def test_a_key_holds_at_most_its_rpm_in_open_sockets(tmp_path: Path) -> None:
    """Sockets cost nothing until a frame is sent: one free key opened 150 in a second and left them idle, each held
    for ever, towards the gateway's connection bound (then 503 for every tenant). A key now holds at most its tier's
    RPM at once (1 here): the next upgrade is a 429 in OpenAI's shape, and a closed socket frees its place."""
    import time

    from websockets.exceptions import InvalidStatus

    with Service(["shard", "--engine", "synthetic", "--synthetic-token-delay-ms", "0"]) as shard, \
            Service(["gateway", "--shard-urls", shard.url, "--tokenizer", "whitespace", "--model-name", "synthetic",
                     "--tiers-file", str(_tiers_file(tmp_path))], env={"SWITCHBOARD_GATEWAY_API_KEYS": f"{KEY}:acme:free"}) as gw:
        url = gw.url.replace("http://", "ws://") + "/v1/responses"
        auth = {"Authorization": f"Bearer {KEY}"}
        with connect(url, additional_headers=auth, open_timeout=30):
            with pytest.raises(InvalidStatus) as refused:
                connect(url, additional_headers=auth, open_timeout=30)
            assert refused.value.response.status_code == 429
            assert json.loads(refused.value.response.body or b"")["error"]["code"] == "rate_limit_exceeded"
        deadline = time.monotonic() + 10
        while True:  # the gateway sees the close a moment later
            try:
                with connect(url, additional_headers=auth, open_timeout=30):
                    break
            except InvalidStatus:
                assert time.monotonic() < deadline, "a closed socket did not free its place"
                time.sleep(0.1)
