"""One chat call through a gateway, and the checks on an OpenAI-shaped error, for tests.

    r = chat(gw.url, "free", "hello", max_tokens=8)          # httpx.Response (stream=True for SSE)
    err = assert_openai_error(r, 429, "rate_limit_exceeded")  # status, shape, Retry-After, no leak
    assert_no_leak(r.text)                                    # no stack trace or source path

Used by the reliability, hop-auth and at-rest tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx

from tests.support.cluster import KEYS

LEAK_MARKERS = ("Traceback", 'File "', "site-packages", "/work/", '.py"', ".py:")
"""What a stack trace or a source path looks like inside an error body."""


def chat(
    url: str,
    tier: str = "plus",
    content: str = "hello there",
    *,
    key: str | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
    **body: Any,
) -> httpx.Response:
    """One chat completion through a gateway (non-streaming unless stream=True is passed)."""
    body.setdefault("max_tokens", 4)
    messages = body.pop("messages", None) or [{"role": "user", "content": content}]
    auth = {"Authorization": f"Bearer {key or KEYS[tier]}"}
    return httpx.post(
        url + "/v1/chat/completions",
        json={"messages": messages, **body},
        headers={**auth, **(headers or {})},
        timeout=timeout,
    )


def assert_openai_error(resp: httpx.Response, status: int | Iterable[int], code: str | None = None) -> dict:
    """`resp` is an OpenAI-shaped error with `status` (and `code`); returns the error object."""
    statuses = {status} if isinstance(status, int) else set(status)
    assert resp.status_code in statuses, (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert err["message"], err
    if code is not None:
        assert err["code"] == code, err
    if resp.status_code in (429, 503):
        assert int(resp.headers["retry-after"]) >= 1, dict(resp.headers)
    assert_no_leak(resp.text)
    return err


def assert_no_leak(text: str) -> None:
    """An error body carries no stack trace and no source path."""
    for marker in LEAK_MARKERS:
        assert marker not in text, f"{marker!r} leaked in {text[:500]!r}"
