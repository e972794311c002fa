"""Error messages quote a client's value, never at length.

    .venv/bin/python -m pytest tests/reliability/test_echo.py -q

OpenAI's messages name the id or value they refuse; ours did too, whole: a 500 KB conversation id, item
reference, call_id, `after` cursor or path id came back as a 500 KB message (nothing bounds those fields'
length), which a client's logs then hold. `data_plane.common.errors.clipped` cuts the quote.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.chat import assert_openai_error
from tests.support.cluster import KEYS, Cluster

LONG = "x" * 500_000
AUTH = {"Authorization": f"Bearer {KEYS['plus']}"}


def _send(c: Cluster, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.request(method, c.gateway.url + path, json=body, headers=AUTH, timeout=60)


USER = {"type": "message", "role": "user", "content": "hi"}
CASES: list[tuple[str, str, str, dict[str, Any] | None, int]] = [
    ("conversation id", "POST", "/v1/responses", {"model": "synthetic", "input": "hi", "conversation": "conv_" + LONG},
     404),
    ("item reference", "POST", "/v1/responses", {"model": "synthetic", "input": [{"type": "item_reference",
                                                                                   "id": "msg_" + LONG}]}, 404),
    ("call_id", "POST", "/v1/responses", {"model": "synthetic", "input": [
        {"type": "function_call_output", "call_id": "call_" + LONG, "output": "x"}]}, 400),
    ("duplicate item id", "POST", "/v1/conversations", {"items": [{**USER, "id": "msg_" + LONG}] * 2}, 400),
    ("response path id", "GET", "/v1/responses/resp_" + LONG[:60_000], None, 404),
    ("conversation path id", "GET", "/v1/conversations/conv_" + LONG[:60_000], None, 404),
    ("chat completion path id", "GET", "/v1/chat/completions/chatcmpl-" + LONG[:60_000], None, 404),
    ("model path id", "GET", "/v1/models/" + LONG[:60_000], None, 404),
    ("after cursor", "GET", "/v1/chat/completions?after=" + LONG[:60_000], None, 400),
]


@pytest.mark.parametrize("name,method,path,body,status", CASES, ids=[c[0] for c in CASES])
def test_an_error_quotes_a_long_value_cut(cluster: Cluster, name: str, method: str, path: str,
                                          body: dict[str, Any] | None, status: int) -> None:
    err = assert_openai_error(_send(cluster, method, path, body), status)
    assert len(err["message"]) < 600, (name, len(err["message"]), err["message"][:200])
    assert "x" * 100 in err["message"], err["message"][:300]  # the value is still named (its start)
