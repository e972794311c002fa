"""The Responses and Conversations APIs where an app built on OpenAI's would notice a difference: a
function call left without its output, the words of a chat-path error, an update's unknown field. The
real model, two cache nodes and a gateway on loopback (test_responses_api.py's stack), driven by the
openai SDK."""

from __future__ import annotations

import httpx

from tests.data_plane import test_responses_api
from tests.data_plane.test_responses_api import MODEL, Stack
from tests.support.cluster import KEYS

stack = test_responses_api.stack
"""That module's stack (the fixture), for this module's own instance."""

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
